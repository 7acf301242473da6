"""Kernel profile of the step ``python run.py --backend cuda --config MODEL`` trains with: the
first thing a GPU run measures, before any lever.

The config is run.py's own resolution (benchmarks/cuda_setups.py ``run_py_config``: attention,
compile, the micro-batch fitted to the GPU), with fewer micro-batches per step
(``--gradient-accumulation``) so that a profiled step, optimizer included, stays short. After
``--warmup-steps`` untimed steps (compilation), ``torch.profiler`` records ``--steps`` steps and
the report gives:

- the top kernels by device time (on a CPU: the top operators by self CPU time, "CPU ops instead
  of kernels"), with their share of the busy time;
- the GEMM share: matrix-multiply kernels (cuBLAS/CUTLASS gemm, ``mm``/``addmm``/``bmm``) over
  all kernel time;
- the gaps between launches: the device's idle time between one kernel's end and the next one's
  start over the profiled span (idle share, gaps over 10 us, the largest gaps), which is what
  CUDA graphs and fewer, larger kernels remove.

    python benchmarks/cuda_profile.py --model phase2 --output runs/cuda_profile
    python benchmarks/cuda_profile.py --model tiny --device cpu --steps 1 --warmup-steps 1 --output runs/profile_cpu

Writes ``profile.md`` and ``profile.json`` in ``--output`` (atomically).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
from typing import Any, Dict, List, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import fmt, markdown_table  # noqa: E402
from benchmarks.cuda_setups import RUN_PY_DEFAULT, SETUPS, _ours, device_of, sync  # noqa: E402
from bert_packed.config import ConfigError  # noqa: E402

GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|wgmma|aten::(mm|addmm|bmm|baddbmm|_scaled_mm|matmul)$|^(mm|addmm|bmm)$",
                  re.IGNORECASE)
GAP_US = 10.0  # a gap worth counting: longer than a kernel launch


def intervals(events, on_device: bool) -> List[Tuple[str, float, float]]:
    """(name, start us, end us) of the kernels (``on_device``) or of the top-level CPU operators."""
    out = []
    for e in events:
        device_event = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if on_device and not device_event:
            continue
        if not on_device and (device_event or e.cpu_parent is not None or e.name.startswith("ProfilerStep")):
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda t: t[1])


def gaps(spans: Sequence[Tuple[str, float, float]]) -> Dict[str, Any]:
    """Idle time between consecutive spans (overlaps merged) over the profiled span."""
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_share": None, "gaps_over_10us": 0, "median_gap_us": None,
                "largest_gaps_us": []}
    found, busy, end = [], 0.0, spans[0][1]
    for _, start, stop in spans:
        if start > end:
            found.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - spans[0][1]
    return {"span_us": span, "busy_us": busy, "idle_share": (span - busy) / span if span > 0 else None,
            "gaps_over_10us": sum(g > GAP_US for g in found),
            "median_gap_us": statistics.median(found) if found else 0.0,
            "largest_gaps_us": sorted(found, reverse=True)[:5]}


def summarize(events, on_device: bool, top: int = 15) -> Dict[str, Any]:
    """Top kernels (or CPU operators by self time), GEMM share and gaps of a profiler's events."""
    if on_device:
        spans = intervals(events, True)
        per_name: Dict[str, List[float]] = {}
        for name, start, stop in spans:
            per_name.setdefault(name, []).append(stop - start)
        totals = {name: (sum(times), len(times)) for name, times in per_name.items()}
    else:
        spans = intervals(events, False)
        totals = {}
        for e in events:
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                continue
            time, count = totals.get(e.name, (0.0, 0))
            totals[e.name] = (time + float(e.self_cpu_time_total), count + 1)
        totals.pop("ProfilerStep*", None)
    total = sum(t for t, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    gemm = sum(t for name, (t, _) in totals.items() if GEMM.search(name))
    return {
        "unit": "kernels (device time)" if on_device else "CPU operators (self CPU time)",
        "top": [{"name": name, "us": t, "calls": n, "share": t / total} for name, (t, n) in ranked[:top]],
        "total_us": total, "gemm_share": gemm / total, "distinct": len(totals),
        "gaps": gaps(spans), "gaps_between": "kernels" if on_device else "top-level CPU operators",
    }


def profile(args) -> Dict[str, Any]:
    spec = {"model": args.model, "device": args.device, "num_sequences": args.num_sequences,
            "pool_size": args.pool_size, "compile": False, "compile_backend": "inductor",
            "gradient_accumulation_override": args.gradient_accumulation}
    device = device_of(spec)
    step, pool, config, _, _ = _ours(spec, SETUPS[RUN_PY_DEFAULT], device)
    order = itertools.cycle(range(len(pool)))

    def one_step():
        step([pool[next(order)] for _ in range(step.accumulation)])

    for _ in range(args.warmup_steps):
        one_step()
    sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            one_step()
        sync(device)
    events = prof.events()
    on_device = device.type == "cuda" and bool(intervals(events, True))  # no kernel events: say so, CPU ops
    report = summarize(events, on_device, top=args.top)
    m, t = config.model, config.train
    report.update(model=args.model, device=str(device), steps=args.steps, compiled=bool(config.cuda.compile),
                  attention=m.attention_implementation, micro_batch_size=t.micro_batch_size,
                  gradient_accumulation=step.accumulation, precision=config.cuda.precision,
                  hidden_dropout_prob=m.hidden_dropout_prob, attention_probs_dropout_prob=m.attention_probs_dropout_prob,
                  fp8=bool(getattr(config.cuda, "fp8", False)), torch=torch.__version__,
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return report


def markdown(r: Dict[str, Any]) -> str:
    g = r["gaps"]
    head = (f"Profile of `run.py --backend cuda --config {r['model']}`'s step on {r['device_name']}: attention "
            f"{r['attention']}, compiled {'yes' if r['compiled'] else 'no'}, {r['precision']}, fp8 "
            f"{'yes' if r['fp8'] else 'no'}, micro-batch {r['micro_batch_size']} x {r['gradient_accumulation']}, "
            f"{r['steps']} step(s); {r['unit']}.\n\n"
            f"- GEMM share: {r['gemm_share']:.1%} of {r['total_us'] / 1e3:,.1f} ms over {r['distinct']} distinct names\n"
            f"- gaps between {r['gaps_between']}: idle {fmt(g['idle_share'], '{:.1%}')} of a "
            f"{g['span_us'] / 1e3:,.1f} ms span, {g['gaps_over_10us']} gaps over {GAP_US:g} us, median gap "
            f"{fmt(g['median_gap_us'], '{:.1f}')} us, largest {', '.join(f'{x:,.0f}' for x in g['largest_gaps_us'])} us\n\n")
    rows = [[i + 1, f"`{k['name'][:90]}`", f"{k['us'] / 1e3:,.2f}", k["calls"], f"{k['share']:.1%}"]
            for i, k in enumerate(r["top"])]
    return head + markdown_table(["#", "name", "ms", "calls", "share"], rows, align="rlrrr") + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="phase2", help="config name (default: phase2, BERT-Large at S=512)")
    p.add_argument("--device", default=None, help="default: cuda; 'cpu' for a dry run (CPU operators)")
    p.add_argument("--gradient-accumulation", type=int, default=2, help="micro-batches per profiled step")
    p.add_argument("--steps", type=int, default=2, help="profiled optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--num-sequences", type=int, default=20000, help="generated sequences to pack")
    p.add_argument("--pool-size", type=int, default=4, help="distinct micro-batches generated up front")
    p.add_argument("--top", type=int, default=15, help="kernels (or operators) listed")
    p.add_argument("--output", required=True, help="directory for profile.md and profile.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if min(args.gradient_accumulation, args.steps, args.top, args.pool_size) < 1 or args.warmup_steps < 0:
            raise ConfigError("--gradient-accumulation, --steps, --top and --pool-size must be >= 1, "
                              "--warmup-steps >= 0")
        if args.device is None and not torch.cuda.is_available():
            raise ConfigError("no GPU: give --device cpu for a dry run (CPU operators instead of kernels)")
        report = profile(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from bert_packed.io.files import write_text_atomic

    os.makedirs(args.output, exist_ok=True)
    text = markdown(report)
    write_text_atomic(os.path.join(args.output, "profile.json"), json.dumps(report, indent=1))
    write_text_atomic(os.path.join(args.output, "profile.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
