"""Optimizer step time on a real model's parameter shapes: single-tensor vs foreach vs fused.

Builds ``BertForSequenceClassification`` with all-MiniLM-L6-v2's shape (vocabulary 30,522,
hidden 384, 6 layers, 12 heads, intermediate 1536, 2 labels: 22.7 M parameters in 105
tensors; no download needed, the weights are random), gives every parameter a random
gradient, and times ``optimizer.step()`` of each implementation of ``bert_packed.optim``
(``build_optimizer(..., implementation=...)``), the variants interleaved round by round so
a busy machine slows them alike. Also times the global gradient norm the CPU backend computes
today (per-tensor norms and a ``float()``) against ``optim.grad_norm_`` (foreach norms, no
host read), and ``grad_norm_`` + ``step_unless_non_finite`` (the device-side skip) with
fused AdamW.

    python benchmarks/optimizer_step.py [--rounds 5] [--threads 2] [--json out.json]
    python benchmarks/optimizer_step.py --dry-run --rounds 1    # a 2-layer, hidden-32 shape (seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_header, markdown_row, spread  # noqa: E402
from bert_packed.tasks.classification.model import BertForSequenceClassification  # noqa: E402
from bert_packed.model.modeling import BertConfig  # noqa: E402
from bert_packed.optim import build_optimizer, grad_norm_, step_unless_non_finite  # noqa: E402

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, num_labels=2)
TINY = dict(MINILM, vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
VARIANTS = [("adamw", "single_tensor"), ("adamw", "foreach"), ("adamw", "fused"),
            ("lamb", "single_tensor"), ("lamb", "foreach")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 3 steps per variant (default 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--dry-run", action="store_true", help="a tiny shape (2 layers, hidden 32): seconds, "
                        "checks the plumbing, not the speed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = BertConfig(**(TINY if args.dry_run else MINILM))
    variants = [v for v in VARIANTS if v != ("adamw", "fused") or _has_fused()]
    models, optimizers = {}, {}
    for name, implementation in variants:
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = build_optimizer(model, name, lr=1e-4, eps=1e-8, weight_decay=0.01, implementation=implementation)
        optimizer.step()  # creates the state
        models[(name, implementation)], optimizers[(name, implementation)] = model, optimizer
    params = list(model.parameters())
    times = {v: [] for v in variants}
    norms = {"grad norm: per-tensor norms + float() (before)": [],
             "grad norm: optim.grad_norm_ (foreach, no host read)": []}
    flagged = [v for v in variants if v == ("adamw", "fused") or v[0] == "lamb"]
    for v in flagged:  # the backend's whole update: norm + non-finite flag on the device, then the step
        norms[f"optim.grad_norm_ + step_unless_non_finite, {v[1]} {v[0]}"] = []
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(3):
                start = time.perf_counter()
                optimizers[v].step()
                times[v].append(time.perf_counter() - start)
        for _ in range(3):
            start = time.perf_counter()
            grads = [p.grad for p in params if p.grad is not None]
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])))
            norms["grad norm: per-tensor norms + float() (before)"].append(time.perf_counter() - start)
            start = time.perf_counter()
            grad_norm_(params)
            norms["grad norm: optim.grad_norm_ (foreach, no host read)"].append(time.perf_counter() - start)
            for v in flagged:
                start = time.perf_counter()
                _, found_inf = grad_norm_(models[v].parameters())
                step_unless_non_finite(optimizers[v], found_inf)
                norms[f"optim.grad_norm_ + step_unless_non_finite, {v[1]} {v[0]}"].append(time.perf_counter() - start)
    count = sum(p.numel() for p in params)
    print(f"{count:,} parameters in {len(params)} tensors; torch {torch.__version__}, {args.threads} threads; "
          f"{3 * args.rounds} steps per variant, interleaved; load average {os.getloadavg()[0]:.1f}")
    print("\n" + markdown_header(["what", "implementation", "median ms", "min ms", "median vs single_tensor",
                                  "min vs single_tensor"]))
    rows = []
    for v in variants:
        mine, reference = spread(times[v]), spread(times[(v[0], "single_tensor")])
        row = {"optimizer": v[0], "implementation": v[1], "median_ms": mine["median"] * 1e3, "min_ms": mine["min"] * 1e3,
               "median_speedup": reference["median"] / mine["median"], "min_speedup": reference["min"] / mine["min"]}
        rows.append(row)
        print(markdown_row([f"{v[0]} step", v[1], f"{row['median_ms']:.1f}", f"{row['min_ms']:.1f}",
                            f"{row['median_speedup']:.2f}x", f"{row['min_speedup']:.2f}x"]))
    for what, values in norms.items():
        mine = spread(values)
        rows.append({"what": what, "median_ms": mine["median"] * 1e3, "min_ms": mine["min"] * 1e3})
        print(markdown_row([what, "", f"{mine['median'] * 1e3:.1f}", f"{mine['min'] * 1e3:.1f}", "", ""]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parameters": count, "tensors": len(params), "torch": torch.__version__,
                       "threads": args.threads, "rows": rows}, f, indent=2)
    return 0


def _has_fused() -> bool:
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
