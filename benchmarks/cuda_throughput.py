"""Training throughput of packed BERT on GPUs, against the baselines GPU users run.

Every setup trains the config's recipe (its dropouts included: phase2 trains with hidden dropout
0.1) of one model shape (by default phase2 = BERT-Large at S = 512 and phase1_base = BERT-base at
S = 128) on the same generated Wikipedia-length sequences, and reports:

- real tokens/s (padding never counts; the first unit) and sequences/s, as the median over
  ``--repeats`` timed windows of at least ``--window-seconds`` (and ``--steps`` optimizer steps)
  each, with the min and max of the windows;
- model FLOPs utilisation (MFU): the useful training FLOPs per second (see
  :func:`benchmarks.cuda_setups.training_flops`: only real tokens, attention only within each
  sequence) over the device's published dense peak for the precision; "n/a" on a CPU or an
  unlisted GPU;
- each row's recipe and path: ``hidden_dropout_prob``, ``attention_probs_dropout_prob``,
  ``attention``, ``compiled``, ``fp8``, micro-batch and accumulation; the GPU's name, clocks and
  power limit (``gpu``: torch's device properties and ``nvidia-smi``);
- peak GPU memory over the timed steps; for compiled setups, the dynamo graphs compiled and the
  recompiles while timing.

The setups (``--setups``, benchmarks/cuda_setups.py): ``run-py-default`` is exactly what
``python run.py --backend cuda --config MODEL`` trains with (run.py's own resolution of the
backend's defaults: attention, compile, micro-batch fitted to the GPU), the ``lever-*`` rows are
that default plus one switch (a switch this tree lacks is a "not available" row), ``packed-*`` and
``padded-*`` are ours at ``--micro-batch-size`` x ``--gradient-accumulation`` with one attention,
and the ``hf-*`` rows are Hugging Face's ``BertForPreTraining`` padded and its padding-free
training (``DataCollatorWithFlattening``; compiled with ``dynamic=True``, as its flattened rows
change length every micro-batch).

Honesty rules: each setup runs in its own process (a fresh dynamo cache; with ``--compile``
dynamo's ``fail_on_recompile_limit_hit`` is on, so a silent fall-back to eager is an error, and a
setup that compiled no graph is a failure, never a "compiled" row); a setup this machine cannot
run is a row that says why, never a number. ``--scaling`` adds rows for 1..N GPUs under torchrun
(same micro-batch per GPU).

    python benchmarks/cuda_throughput.py --compile both --output runs/cuda_throughput.json   # every setup, eager and compiled
    python benchmarks/cuda_throughput.py --models phase2 --setups run-py-default lever-fp8 --window-seconds 20
    python benchmarks/cuda_throughput.py --models phase2 --compile --scaling auto             # + 1..N GPU scaling
    python benchmarks/cuda_throughput.py --tiles-only                                  # no GPU: flex's share of tiles
    python benchmarks/cuda_throughput.py --device cpu --models tiny --compile --compile-backend aot_eager \
        --steps 1 --repeats 2 --window-seconds 0 --warmup-steps 1 --micro-batch-size 4 --gradient-accumulation 1 \
        --num-sequences 300

Writes a JSON list (``--output``, atomically, after every row) and prints Markdown tables.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import (fmt, fmt_spread, markdown_table, rates, read_rows, run_worker, spread_fields,  # noqa: E402
                               timed_windows, write_rows)
from benchmarks.cuda_setups import (BASELINE, LAYOUTS, RUN_PY_DEFAULT, SETUPS, _hf, _ours, batch_counts,  # noqa: E402
                                    compile_stats, device_of, distributed, global_sum, gpu_info, peak_tflops,
                                    run_py_overrides, shared_clock, sync, training_flops, unavailable_reason)
from bert_packed.config import ConfigError, load_config  # noqa: E402

RESULT_PREFIX = "CUDA_THROUGHPUT_RESULT "
HF_PADDING_FREE = {"hf-padding-free-fa2", "hf-padding-free-varlen"}


# ----------------------------------------------------------------------------- one setup (worker process)


def run_setup(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Train one setup in this process and measure it (the worker's job)."""
    setup = SETUPS[spec["setup"]]
    device = device_of(spec)
    if spec["compile"] or setup.family == "run.py":
        # Fail loudly instead of silently running the rest eagerly once dynamo's cache is full.
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    build = _hf if setup.family == "hf" else _ours
    step, pool, config, model_config, metrics = build(spec, setup, device)
    counts = [batch_counts(b) for b in pool]
    order = itertools.cycle(range(len(pool)))
    nsp = setup.family != "hf" or setup.attention == "sdpa"

    def one_step():
        indices = [next(order) for _ in range(step.accumulation)]
        step([pool[i] for i in indices])
        done = {"sequences": 0.0, "tokens": 0.0, "slots": 0.0, "flops": 0.0}
        for i in indices:
            c = counts[i]
            done["sequences"] += c["sequences"]
            done["tokens"] += c["tokens"]
            done["slots"] += c["slots"]
            done["flops"] += training_flops(model_config, c["lengths"], c["masked"], with_nsp=nsp)
        return done

    for _ in range(spec["warmup_steps"]):
        one_step()
    sync(device)
    compiled_after_warmup = compile_stats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    windows = timed_windows(one_step, repeats=spec["repeats"], min_steps=spec["steps"],
                            min_seconds=spec["window_seconds"], sync=lambda: sync(device), clock=shared_clock)
    for w in windows:
        w["sequences"], w["tokens"], w["slots"], w["flops"] = global_sum(
            [w["sequences"], w["tokens"], w["slots"], w["flops"]])
    compiled_end = compile_stats()
    compiled = bool(step.compiled)
    if compiled and compiled_after_warmup["graphs"] < 1:
        raise RuntimeError(f"{setup.name}: compilation was asked for but dynamo compiled no graph")
    return _row(spec, setup, config, model_config, device, windows, compiled,
                (compiled_after_warmup, compiled_end), metrics, counts, step.accumulation)


def _row(spec, setup, config, model_config, device, windows, compiled, stats, metrics, counts, accumulation):
    """The result row of a measured setup."""
    world_size = distributed(device)[1]
    precision = config.cuda.precision
    info = gpu_info(device)
    peak = peak_tflops(info["device"], precision, config.cuda.allow_tf32) if device.type == "cuda" else None
    flops = statistics.median(rates(windows, "flops"))
    after_warmup, end = stats
    return {
        **_identity(spec, setup, config, compiled), "status": "ok", "gpus": world_size,
        "micro_batch_size": config.train.micro_batch_size if setup.family != "hf" else spec["micro_batch_size"],
        "gradient_accumulation": accumulation,
        "compile_backend": (spec["compile_backend"] if setup.family != "run.py" else "inductor") if compiled else None,
        "steps_per_window": [int(w["steps"]) for w in windows], "window_seconds": [w["seconds"] for w in windows],
        "min_window_seconds": spec["window_seconds"], "repeats": spec["repeats"], "warmup_steps": spec["warmup_steps"],
        "sequences_per_micro_batch": statistics.mean(c["sequences"] for c in counts),
        "sequences_timed": sum(w["sequences"] for w in windows),  # all ranks
        **spread_fields("tokens_per_second", rates(windows, "tokens")),
        **spread_fields("sequences_per_second", rates(windows, "sequences")),
        "token_efficiency": sum(w["tokens"] for w in windows) / max(1.0, sum(w["slots"] for w in windows))
        if setup.family != "hf" else None,
        "model_tflops_per_second": flops / 1e12, "peak_tflops": peak,
        "mfu": flops / (peak * 1e12 * world_size) if peak else None,
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "graphs_compiled": after_warmup["graphs"] if compiled else None,
        "graph_breaks": end["graph_breaks"] if compiled else None,
        "recompiles_while_timed": end["graphs"] - after_warmup["graphs"] if compiled else None,
        "recompiles_after_warmup": _number(metrics.get("recompiles_after_warmup")),
        "device": info["device"], "torch": torch.__version__, "gpu": info,
    }


def _number(value):
    return None if value is None else float(value)


def _identity(spec, setup, config, compiled: bool) -> Dict[str, Any]:
    """The fields every row has, measured or not: what it trains and how."""
    row = {"model": spec["model"], "setup": setup.name, "label": setup.label, "family": setup.family,
           "attention": setup.attention, "max_sequences_per_pack": setup.depth, "precision": spec["precision"],
           "compiled": compiled, "fp8": False, "hidden_dropout_prob": None, "attention_probs_dropout_prob": None}
    if setup.switch:
        row["switch"] = list(setup.switch)
    if config is not None:
        m = config.model
        row.update(hidden_dropout_prob=m.hidden_dropout_prob, attention_probs_dropout_prob=m.attention_probs_dropout_prob,
                   fp8=bool(getattr(config.cuda, "fp8", False)) if setup.family != "hf" else False)
        if setup.family != "hf":
            row.update(attention=m.attention_implementation, precision=config.cuda.precision,
                       max_sequences_per_pack=config.data.max_sequences_per_pack)
    return row


def measured_row(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``run_setup``'s row, or a "not available" row when the config refuses the setup (a lever's
    switch that needs a library the machine lacks)."""
    try:
        return run_setup(spec)
    except ConfigError as exc:
        return status_row(spec, f"not available: {exc}")


def run_in_this_process(spec: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
    """``--in-process`` (dry runs only: seconds instead of an interpreter per row): the setup in this
    process after a reset of dynamo's caches and counters. Not for figures: allocator, caches and
    threads carry over from the rows before."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    return {**measured_row(spec), "in_process": True}


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    result = measured_row(spec)
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------- the parent: one process per setup


def run_in_subprocess(spec: Dict[str, Any], gpus: Optional[int] = None,
                      timeout: Optional[float] = None) -> Dict[str, Any]:
    """Run one setup in a fresh interpreter (torchrun with ``gpus`` processes); its result row.
    A setup that outlasts ``timeout`` seconds is killed and becomes a 'failed: timeout' row."""
    if gpus is None:
        command = [sys.executable, "-m", "benchmarks.cuda_throughput", "--worker", json.dumps(spec)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                   "-m", "benchmarks.cuda_throughput", "--worker", json.dumps(spec)]
    row = run_worker(command, RESULT_PREFIX, timeout=timeout)
    if list(row) == ["status"]:
        status = row["status"]
        if status.startswith("failed: timeout"):
            status += " (--setup-timeout)"
        return status_row(spec, status, gpus=gpus or 1)
    return row


def status_row(spec: Dict[str, Any], status: str, gpus: int = 1, config=None) -> Dict[str, Any]:
    """The row of a setup that was not measured: what it would have trained, and why not."""
    setup = SETUPS[spec["setup"]]
    return {**_identity(spec, setup, config, False), "status": status, "gpus": gpus}


def tile_fractions(args):
    """No GPU needed: share of 128x128 score tiles flex computes, padded vs packed data."""
    from bert_packed.tasks.pretraining.data import build_data_source
    from bert_packed.model.attention.flex import active_block_fraction

    results = []
    for model_name in args.models:
        for layout, depth in LAYOUTS:
            config = load_config(model_name, [f"data.max_sequences_per_pack={depth}",
                                              f"data.num_sequences={args.num_sequences}",
                                              f"data.packing_algorithm={args.packing_algorithm}"] + list(args.set))
            source = build_data_source(config, split="train", micro_batch_size=args.micro_batch_size)
            batches = list(itertools.islice(iter(source), args.pool_size))
            rows = sum(b["input_ids"].shape[0] for b in batches)
            for block_size in args.block_sizes:
                fractions = [active_block_fraction(torch.as_tensor(b["sequence_ids"]), block_size) for b in batches]
                results.append({
                    "model": model_name, "layout": layout, "max_sequences_per_pack": depth,
                    "sequence_length": config.data.max_sequence_length, "block_size": block_size,
                    "sequences_per_row": float(sum(b["nsp_weights"].sum() for b in batches)) / rows,
                    "active_tile_fraction": float(np.mean(fractions)), "rows": rows,
                })
    return results




def _ratio(row: Dict[str, Any], ok: List[Dict[str, Any]], setups) -> str:
    """row's real tokens/s over the best baseline row of ``setups`` (same model; same compile flag
    where that baseline has one, else its eager row)."""
    candidates = [b for b in ok if b["model"] == row["model"] and b["setup"] in setups]
    same = [b for b in candidates if b["compiled"] == row["compiled"]]
    pool = same or [b for b in candidates if not b["compiled"]]
    if not pool:
        return "-"
    return f"{row['tokens_per_second'] / max(b['tokens_per_second'] for b in pool):.3f}x"


def _recipe(r: Dict[str, Any]) -> str:
    if r.get("hidden_dropout_prob") is None:
        return "-"
    return f"{r['hidden_dropout_prob']:g} / {r['attention_probs_dropout_prob']:g}"


def markdown(results: List[Dict[str, Any]]) -> str:
    header = ["model", "setup", "attention", "compiled", "fp8", "dropout (hidden / attention)",
              "real tokens/s median (min-max)", "sequences/s", "MFU", "peak GiB", "micro-batch x accumulation",
              f"x {BASELINE}", "x HF padded", "x HF padding-free"]
    single = [r for r in results if not r.get("scaling")]
    ok = [r for r in single if r["status"] == "ok"]
    rows = []
    for r in single:
        identity = [r["model"], r["label"], r["attention"]]
        if r["status"] != "ok":
            asked = "asked, not run" if r.get("compile_requested") else "-"
            rows.append(identity + [asked, "yes" if r.get("fp8") else "no", _recipe(r), r["status"]])
            continue
        compiled = (f"yes ({r['graphs_compiled']} graph(s), {r['recompiles_while_timed']} recompiles)"
                    if r["compiled"] else "no")
        rows.append(identity + [
            compiled, "yes" if r["fp8"] else "no", _recipe(r), fmt_spread(r, "tokens_per_second", "{:,.0f}"),
            f"{r['sequences_per_second']:.1f}", fmt(r["mfu"], "{:.1%}"), fmt(r["max_memory_gib"]),
            f"{r['micro_batch_size']} x {r['gradient_accumulation']}", _ratio(r, ok, {BASELINE}),
            _ratio(r, ok, {"hf-padded-sdpa"}), _ratio(r, ok, HF_PADDING_FREE)])
    table = markdown_table(header, rows, align="lllllllrrrrrrr")
    scaling = [r for r in results if r.get("scaling")]
    if scaling:
        table += "\n\n" + scaling_markdown(scaling)
    return table


def scaling_markdown(scaling: List[Dict[str, Any]]) -> str:
    one = {(r["model"], r["setup"]): r for r in scaling if r["gpus"] == 1 and r["status"] == "ok"}
    rows = []
    for r in scaling:
        if r["status"] != "ok":
            rows.append([r["model"], r["label"], r["gpus"], r["status"]])
            continue
        ref = one.get((r["model"], r["setup"]))
        efficiency = (r["tokens_per_second"] / (r["gpus"] * ref["tokens_per_second"])) if ref else None
        rows.append([r["model"], r["label"], r["gpus"], fmt_spread(r, "tokens_per_second", "{:,.0f}"),
                     f"{r['tokens_per_second'] / r['gpus']:,.0f}", fmt(efficiency, "{:.1%}"), fmt(r["mfu"], "{:.1%}")])
    return markdown_table(["model", "setup", "GPUs", "real tokens/s median (min-max)", "per GPU", "scaling efficiency",
                           "MFU"], rows, align="llrrrrr")


def tiles_markdown(results):
    lines = ["| model | layout | sequences per row | tile | score tiles flex computes | per sequence (dense padded = 1) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        per_sequence = r["active_tile_fraction"] / r["sequences_per_row"]
        lines.append(f"| {r['model']} | {r['layout']} (depth {r['max_sequences_per_pack']}) | "
                     f"{r['sequences_per_row']:.3f} | {r['block_size']} | {100 * r['active_tile_fraction']:.1f} % "
                     f"| {per_sequence:.3f} |")
    return "\n".join(lines)



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["phase2", "phase1_base"],
                   help="config names (default: BERT-Large at S=512 and BERT-base at S=128)")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS), metavar="SETUP",
                   help=f"setups to run (default: all): {', '.join(SETUPS)}")
    p.add_argument("--micro-batch-size", type=int, default=16,
                   help="rows (packs or padded sequences) per micro-batch (not run-py-default's: run.py chooses)")
    p.add_argument("--gradient-accumulation", type=int, default=4, help="micro-batches per optimizer step (idem)")
    p.add_argument("--hf-sequences-per-micro-batch", type=int, default=None,
                   help="sequences per flattened HF padding-free micro-batch (default: as many as one micro-batch "
                        "of our depth-3 packs holds on the same data)")
    p.add_argument("--window-seconds", type=float, default=20.0,
                   help="each timed window runs at least this long (and at least --steps steps)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps per timed window, at least")
    p.add_argument("--repeats", type=int, default=3, help="timed windows (the table shows their median, min, max)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (compile, allocator)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="autocast precision (not run-py-default's: the config's cuda.precision)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="torch.compile (ours: cuda.compile; HF: the model, dynamic shapes when padding-free); "
                        "'both': each setup eager and compiled (default: off; --compile alone: on); "
                        "run.py's rows compile as run.py resolves it")
    p.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune"))
    p.add_argument("--compile-backend", default="inductor",
                   help="dynamo backend; not inductor (e.g. aot_eager) only to check compilation quickly on a CPU")
    p.add_argument("--pool-size", type=int, default=16, help="distinct micro-batches generated up front")
    p.add_argument("--num-sequences", type=int, default=20000, help="generated sequences to pack (per setup)")
    # lp reaches 99.9 % efficiency at depth 3 (packing factor 2.0 on Wikipedia-512); lpfhp
    # only 89.5 % there (1.79), which would cap the ratio at 1.79x.
    p.add_argument("--packing-algorithm", default="lp", help="data.packing_algorithm for the packed setups")
    p.add_argument("--device", default=None, help="default: cuda (LOCAL_RANK); 'cpu' for a smoke test")
    p.add_argument("--scaling", nargs="+", default=None, metavar="N|auto",
                   help="also run the packed setups on N GPUs each with torchrun ('auto': 1, 2, 4, ... up to all)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra config override (not for run.py's rows)")
    p.add_argument("--tiles-only", action="store_true", help="only flex's share of score tiles (no GPU, no model)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[128], help="--tiles-only: tile sizes to measure")
    p.add_argument("--output", default=None, help="JSON results file, rewritten after every row (default: print only)")
    p.add_argument("--setup-timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a setup's process after this long (a 'failed: timeout' row)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="print one table of earlier --output files (rows of several runs, one machine)")
    p.add_argument("--in-process", action="store_true",
                   help="dry runs only: every setup in this process (seconds per row; no figures from it)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def scaling_counts(requested: List[str], device: torch.device) -> List[int]:
    available = torch.cuda.device_count() if device.type == "cuda" else 0
    if requested == ["auto"]:
        counts = [n for n in (2 ** i for i in range(8)) if n <= available]
        if available and available not in counts:
            counts.append(available)
        return counts if available > 1 else []
    try:
        counts = sorted({int(n) for n in requested})
    except ValueError:
        raise ConfigError(f"--scaling takes GPU counts or 'auto', got {' '.join(requested)}") from None
    if device.type == "cuda" and counts and counts[-1] > available:
        raise ConfigError(f"--scaling {counts[-1]}: only {available} GPU(s) visible")
    if min(counts) < 1:
        raise ConfigError("--scaling counts must be >= 1")
    return counts


def _check_args(args) -> None:
    """Mistakes in the arguments: one line each (ConfigError), before any run."""
    if args.device is None and not torch.cuda.is_available():
        from backends.cuda import CUDABackend

        raise ConfigError(f"no GPU: {CUDABackend.unavailable_reason()} (or --tiles-only / --device cpu)")
    if args.in_process and args.scaling:
        raise ConfigError("--in-process runs one process; --scaling needs one per GPU")
    if args.setup_timeout is not None and not args.setup_timeout > 0:
        raise ConfigError(f"--setup-timeout must be a positive number of seconds, got {args.setup_timeout:g}")
    if not args.window_seconds >= 0 or args.repeats < 1 or args.steps < 1 or args.warmup_steps < 0:
        raise ConfigError(f"--window-seconds must be >= 0, --repeats and --steps >= 1, --warmup-steps >= 0; got "
                          f"{args.window_seconds:g}, {args.repeats}, {args.steps}, {args.warmup_steps}")
    for model_name in args.models:
        load_config(model_name, list(args.set))  # a bad name or override: one line, before any run


def _switch_missing(setup, base: Dict[str, Any], model_name: str) -> Optional[str]:
    """A lever whose switch this tree's config does not know: "not available" (no process started)."""
    if setup.family != "run.py":
        return None
    try:
        load_config(model_name, run_py_overrides({**base, "model": model_name}, setup))
    except ConfigError as exc:
        return f"not available: {exc}"
    return None


def run_rows(args) -> List[Dict[str, Any]]:
    """Every requested row, each setup in its own process; ``--output`` rewritten after each."""
    device = torch.device(args.device or "cuda")
    counts = scaling_counts(args.scaling, device) if args.scaling else []
    base = {
        "micro_batch_size": args.micro_batch_size, "gradient_accumulation": args.gradient_accumulation,
        "hf_sequences_per_micro_batch": args.hf_sequences_per_micro_batch, "window_seconds": args.window_seconds,
        "steps": args.steps, "repeats": args.repeats, "warmup_steps": args.warmup_steps,
        "precision": args.precision, "compile_mode": args.compile_mode, "compile_backend": args.compile_backend,
        "pool_size": args.pool_size, "num_sequences": args.num_sequences, "packing_algorithm": args.packing_algorithm,
        "device": args.device, "set": list(args.set),
    }
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    results: List[Dict[str, Any]] = []

    def add(row):
        print(json.dumps(row), file=sys.stderr)
        results.append(row)
        write_rows(args.output, results)  # what has run survives a kill of the whole benchmark

    for model_name in args.models:
        m = load_config(model_name, list(args.set)).model
        dropout = (m.hidden_dropout_prob, m.attention_probs_dropout_prob)
        for name in args.setups:
            setup = SETUPS[name]
            reason = unavailable_reason(setup, device, args.precision, dropout) or _switch_missing(setup, base, model_name)
            for compile_ in (modes if setup.family != "run.py" else [False]):
                spec = {**base, "model": model_name, "setup": name, "compile": compile_}
                if reason:
                    row = status_row(spec, reason)
                    row.update(hidden_dropout_prob=dropout[0], attention_probs_dropout_prob=dropout[1])
                    row["compile_requested"] = compile_  # nothing compiled: "compiled" stays false
                    add(row)
                    continue
                add((run_in_this_process if args.in_process else run_in_subprocess)(spec, timeout=args.setup_timeout))
                if setup.family == "ours" and setup.depth > 1:
                    for gpus in counts:
                        add({**run_in_subprocess(spec, gpus=gpus, timeout=args.setup_timeout), "scaling": True})
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    try:
        if args.table:
            try:
                results = [row for path in args.table for row in read_rows(path, ("setup", "status"))]
            except ValueError as exc:
                raise ConfigError(f"--table {exc}") from None
            print(markdown(results))
            return 0
        if args.tiles_only:
            results = tile_fractions(args)
            table = tiles_markdown(results)
        else:
            _check_args(args)
            results = run_rows(args)
            table = markdown(results)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_rows(args.output, results)
    print(table)
    failed = [r for r in results if str(r.get("status", "ok")).startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
