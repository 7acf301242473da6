"""Packed BERT pre-training and fine-tuning: the one entry point.

    python run.py                                        # the demo: small model, generated data, cpu
    python run.py --backend ipu --config phase2          # BERT-Large phase 2 on an IPU-M2000 POD16
    python run.py --backend cpu --config phase2 --set model.num_hidden_layers=2 --steps 5
    torchrun --nproc_per_node 2 run.py --backend cpu --config demo    # data parallel (gloo)
    python run.py --config phase2 --backend mock --profile           # packing overhead report
    python run.py --backend ipu --config phase2 --compile-only       # memory estimate + fill the executable cache
    python run.py --backend ipu --config phase2 --compile-only report   # ... Poplar's memory report instead
    python run.py --config finetune_classification --init-checkpoint DIR --set finetune.train_file=train.csv ...
    python run.py --print-config phase2 --backend mock               # the resolved config

Configs: configs/NAME[.yaml] or a path. Exit codes: 0 done; 2 a user mistake (one line on
stderr); 3 training diverged; 128+N stopped by signal N (SIGINT 130, SIGTERM 143) after
writing a checkpoint (inside a step with more than a few seconds left, one process drops that
step instead and keeps the last checkpoint).
"""
import json
import os
import signal
import sys
import threading

INTERRUPTED = "interrupted (nothing half-written was kept)"  # run_cli's line for Ctrl-C (and SIGTERM)
_SIGNALLED = []


def _signal_while_loading(signum, frame):
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt


if __name__ == "__main__" and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _signal_while_loading)  # as Ctrl-C, until run_cli takes over
try:  # torch loads for seconds: Ctrl-C or SIGTERM meanwhile get the same line as later, not a traceback
    import backends
    from backends import available_backends, get_backend, get_backend_class, offline_compilers
    from packing.entry import ArgumentParser, run_cli
    from bert_packed.tasks import registry as tasks
    from bert_packed.backend import OfflineCompile, Profiling, require
    from bert_packed.config import ConfigError, dump, input_paths, load_config, resolve_run
    from bert_packed.io.files import check_output_dir
except KeyboardInterrupt:
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(128 + _SIGNALLED[0] if _SIGNALLED else 130)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description="Packed BERT pre-training (see README).")
    # The choices are the backend registry's (backends.BACKENDS). argparse does not enforce them:
    # an unknown name gets the registry's own one-line error (exit 2), the same as any config mistake.
    names = available_backends()
    p.add_argument("--backend", default="cpu", metavar="{" + ",".join(names) + "}",
                   help=f"{' | '.join(names)} (default: cpu)")
    p.add_argument("--config", help="configs/NAME[.yaml] or a YAML path (default: demo)")
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--init-checkpoint", metavar="DIR", help="start from a Hugging Face BERT directory or a checkpoint "
                   "of this project (shorthand for --set model.init_checkpoint=DIR)")
    p.add_argument("--output-dir", help="where metrics.jsonl, summary.json, checkpoints go (default: runs/NAME)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set train.micro_batch_size=4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in the output dir")
    p.add_argument("--resume-force", action="store_true",
                   help="--resume even if settings that change the computation differ from the checkpoint's")
    modes = p.add_mutually_exclusive_group()  # each replaces training: one at a time
    modes.add_argument("--profile", action="store_true", help="write the packing-overhead report instead of training")
    modes.add_argument("--compile-only", nargs="?", const="cache", choices=("cache", "report"), metavar="MODE",
                   help="ipu/mock: print the per-IPU memory estimate and compile offline: 'cache' (default) with "
                        "the real run's options, filling the executable cache it loads; 'report' with Poplar's "
                        "memory report instead (not cached)")
    modes.add_argument("--print-config", nargs="?", const=True, metavar="NAME",
                   help="print the resolved config (of NAME, else --config) for --backend and exit")
    p.add_argument("--world-size", type=int,
                   help="data-parallel processes to validate for (default: $WORLD_SIZE or 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p, args) -> None:
    """What argparse cannot say: the world size, an empty path, and modes that contradict."""
    if args.world_size is None:  # torchrun sets WORLD_SIZE
        text = os.environ.get("WORLD_SIZE", "1")
        try:
            args.world_size = int(text)
        except ValueError:
            p.error(f"$WORLD_SIZE={text!r} is not a number of processes")
    if args.world_size < 1:
        p.error(f"--world-size counts processes: give 1 or more, got {args.world_size}")
    if args.init_checkpoint is not None and not args.init_checkpoint.strip():
        p.error("--init-checkpoint needs a Hugging Face directory or a checkpoint path, got an empty one")
    if args.output_dir is not None and not args.output_dir.strip():
        p.error("--output-dir needs a directory, got an empty one")
    mode = next((flag for flag, on in (("--profile", args.profile), ("--compile-only", args.compile_only),
                                       ("--print-config", args.print_config)) if on), None)
    if mode and (args.resume or args.resume_force):
        p.error(f"--resume continues a training run; {mode} does not train")
    if isinstance(args.print_config, str):
        if args.config is not None and args.config != args.print_config:
            p.error(f"--print-config {args.print_config} and --config {args.config} name two configs; give one")
        args.config = args.print_config
    args.config = args.config or "demo"


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: _done(_main(args)), interrupted=INTERRUPTED)


def _done(status: int) -> int:
    """The work is done and ``status`` known: from here on Ctrl-C and SIGTERM are ignored (in the
    main thread of ``python run.py``), so a completed run (every output written) is not reported killed."""
    if __name__ == "__main__" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return status


def register_config_sections() -> None:
    """What a config holds beyond its core sections: each backend's section, each task's keys."""
    backends.register_config_sections()
    tasks.register_config_sections()


def _main(args) -> int:
    register_config_sections()
    overrides = args.overrides + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    # A path, never YAML: quoted, so "null", "123" or "true" stay the folder names they are.
    overrides += [f"model.init_checkpoint={json.dumps(args.init_checkpoint)}"] if args.init_checkpoint else []
    config = load_config(args.config, overrides)
    # Config mistakes first, the same way whether or not the backend can run here. What runs (and
    # is printed) is the resolved run's config; the loaded one stays as the user gave it.
    resolved = resolve_run(config, get_backend_class(args.backend), args.world_size)
    warnings = resolved.warnings
    if args.print_config:
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"# resolved config {config.name!r} for backend {args.backend!r}")
        print(dump(resolved.config), end="")
        return 0
    if args.compile_only:
        return _compile_only(args, resolved.config)
    if args.profile:
        return _profile(args, resolved.config, warnings)
    backend = get_backend(args.backend, config=resolved.config)
    from bert_packed.loop.train import train

    train(config, backend, output_dir=args.output_dir, resume=args.resume or args.resume_force,
          resume_force=args.resume_force, show_progress=not args.no_progress, resolved=resolved)
    return 0


def _compile_only(args, config) -> int:
    """--compile-only: compiles offline, so it needs the compiler (the Poplar SDK), not free devices."""
    if not issubclass(get_backend_class(args.backend), OfflineCompile):  # before building it (cuda would pick a GPU)
        raise ConfigError(f"--compile-only compiles ahead of time: use --backend "
                          f"{' or '.join(offline_compilers())}, not {args.backend!r}")
    backend = get_backend(args.backend, config=config, check_available=False)
    output_dir = args.output_dir or os.path.join("runs", config.name, "compile")
    check_output_dir(output_dir, input_paths(config))
    backend.compile_only(config, output_dir, mode=args.compile_only)
    return 0


def _profile(args, config, warnings) -> int:
    """--profile: the packing-overhead report (and the backend's memory estimate) instead of training."""
    from bert_packed.analysis.profiling import format_markdown, run_profile

    require(get_backend_class(args.backend), Profiling, "--profile")
    backend = get_backend(args.backend, config=config)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    output_dir = args.output_dir or os.path.join("runs", config.name, "profile")
    check_output_dir(output_dir, input_paths(config))
    # Fresh backends for the throughput runs built as this one was (cuda.device=cpu: on the CPU).
    report = run_profile(config, backend, output_dir, show_progress=not args.no_progress and sys.stderr.isatty(),
                         make_backend=lambda: get_backend(args.backend, config=config))
    backend.memory_report(config, output_dir)
    print(format_markdown(report))
    written = ", ".join(name for name in ("overhead.md", "overhead.json", "overhead.png", "memory.md")
                        if os.path.exists(os.path.join(output_dir, name)))
    print(f"wrote {output_dir}: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
