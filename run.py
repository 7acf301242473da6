"""Packed BERT pre-training: the one entry point.

    python run.py                                        # the demo: small model, generated data, cpu
    python run.py --backend ipu --config phase2          # BERT-Large phase 2 on an IPU-M2000 POD16
    python run.py --backend cpu --config phase2 --set model.num_hidden_layers=2 --steps 5
    torchrun --nproc_per_node 2 run.py --backend cpu --config demo    # data parallel (gloo)
    python run.py --config phase2 --backend mock --profile           # packing overhead report
    python run.py --backend ipu --config phase2 --compile-only       # memory estimate + offline compile

Configs: configs/NAME[.yaml] or a path; `python -m bert_packed.config NAME` prints one resolved.
"""
import argparse
import os
import sys

from backends import get_backend
from bert_packed.config import load_config, validate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Packed BERT pre-training (see README).")
    p.add_argument("--backend", default="cpu", help="cpu | cuda | ipu | mock (default: cpu)")
    p.add_argument("--config", default="demo", help="configs/NAME[.yaml] or a YAML path (default: demo)")
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--output-dir", help="where metrics.jsonl, summary.json, checkpoints go (default: runs/NAME)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set train.micro_batch_size=4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in the output dir")
    p.add_argument("--profile", action="store_true", help="write the packing-overhead report instead of training")
    p.add_argument("--compile-only", action="store_true",
                   help="ipu/mock: print the per-IPU memory estimate and compile offline (Poplar memory report)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = args.overrides + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    try:
        config = load_config(args.config, overrides)
        # Config mistakes first, the same way whether or not the backend can run here.
        warnings = validate(config, args.backend, int(os.environ.get("WORLD_SIZE", "1")))
        backend = get_backend(args.backend, check_available=not args.compile_only)  # offline: no IPU needed
        if args.compile_only:
            from ipu.offline import compile_only

            compile_only(config, backend, args.output_dir or os.path.join("runs", config.name, "compile"))
            return 0
        if args.profile:
            from bert_packed.profiling import run_profile

            for warning in warnings:
                print(f"warning: {warning}", file=sys.stderr)
            output_dir = args.output_dir or os.path.join("runs", config.name, "profile")
            run_profile(config, backend, output_dir)
            if backend.name in ("ipu", "mock"):
                from ipu.offline import report_memory

                report_memory(config, backend, output_dir)
            return 0
        from bert_packed.train import train

        train(config, backend, output_dir=args.output_dir, resume=args.resume,
              show_progress=not args.no_progress)
    except ValueError as exc:
        # Our error classes (ConfigError, DataError, PackingError, ...) subclass ValueError and
        # mean a user mistake: one line, no traceback. A bare ValueError is a bug: show it.
        if type(exc) is ValueError:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
