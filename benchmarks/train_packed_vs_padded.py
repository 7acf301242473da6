"""Training throughput, packed vs padded, side by side in one process.

Both variants use the same config (default: the demo shape: BERT 2x128, S=128, micro-batch
16 rows, generated Wikipedia-shaped data) and differ only in data.max_sequences_per_pack:
3 (packed, the config's algorithm) vs 1 (padded: one sequence per row). Steps alternate
in blocks between the two models so a busy machine slows both alike. Throughput counts
real sequences (and real tokens) per second of ``train_step`` (forward, backward, update);
data generation is excluded.

    python benchmarks/train_packed_vs_padded.py [--config demo] [--steps 60] [--block 5] [--json]
"""
import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from backends import get_backend  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from bert_packed.config import load_config  # noqa: E402
from bert_packed.tasks.pretraining.data import build_data_source  # noqa: E402
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model  # noqa: E402
from bert_packed.loop.plan import make_plan  # noqa: E402
from run import register_config_sections  # noqa: E402

register_config_sections()  # the backends' sections before any config loads


def _variant(config_name, depth, overrides, backend_name):
    config = load_config(config_name, overrides + [f"data.max_sequences_per_pack={depth}"])
    if config.train.num_threads is not None:  # as run.py would (the demo: 1)
        torch.set_num_threads(config.train.num_threads)
    torch.manual_seed(config.train.seed)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model)
    backend = get_backend(backend_name)
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    source = build_data_source(config, micro_batch_size=config.train.micro_batch_size)
    return {"config": config, "backend": backend, "iterator": iter(source), "source": source,
            "sequences": 0.0, "tokens": 0.0, "seconds": 0.0, "steps": 0, "losses": []}


def _run_block(v, num_steps, measure):
    for _ in range(num_steps):
        batch = next(v["iterator"])
        start = time.perf_counter()
        metrics = v["backend"].train_step([batch])
        seconds = time.perf_counter() - start
        v["losses"].append(metrics["mlm_loss"])
        if measure:
            v["sequences"] += float(batch["nsp_weights"].sum())
            v["tokens"] += float((batch["sequence_ids"] > 0).sum())
            v["seconds"] += seconds
            v["steps"] += 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="demo")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--steps", type=int, default=60, help="measured steps per variant")
    p.add_argument("--block", type=int, default=5, help="steps per variant before switching")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per variant first")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    variants = {"packed": _variant(args.config, 3, args.overrides, args.backend),
                "padded": _variant(args.config, 1, args.overrides, args.backend)}
    for v in variants.values():
        _run_block(v, args.warmup, measure=False)
    while min(v["steps"] for v in variants.values()) < args.steps:
        for v in variants.values():
            _run_block(v, min(args.block, args.steps - v["steps"]), measure=True)

    rows = {}
    for name, v in variants.items():
        c = v["config"]
        rows[name] = {
            "max_sequences_per_pack": c.data.max_sequences_per_pack, "packing_factor": v["source"].packing_factor,
            "rows_per_step": c.train.micro_batch_size, "steps": v["steps"],
            "sequences_per_second": v["sequences"] / v["seconds"], "tokens_per_second": v["tokens"] / v["seconds"],
            "seconds_per_step": v["seconds"] / v["steps"],
        }
    ratio = rows["packed"]["sequences_per_second"] / rows["padded"]["sequences_per_second"]
    result = {"config": args.config, "backend": args.backend, "overrides": args.overrides, "torch_threads":
              torch.get_num_threads(), "variants": rows, "speedup_sequences_per_second": ratio}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.config} on {args.backend} ({torch.get_num_threads()} threads), {args.steps} measured steps each, "
          f"alternating blocks of {args.block}")
    print(markdown_table(["variant", "K", "sequences/pack", "s/step", "sequences/s", "real tokens/s"],
                         [[name, r["max_sequences_per_pack"], f"{r['packing_factor']:.3f}", f"{r['seconds_per_step']:.4f}",
                           f"{r['sequences_per_second']:.1f}", f"{r['tokens_per_second']:.0f}"] for name, r in rows.items()]))
    print(f"packed / padded sequences/s: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
