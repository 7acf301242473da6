"""What packing costs and what it buys, per packing depth: ``run.py --profile``.

For every depth d in (1, 2, 3, 4, 8, 16) the report holds one row with

- the cost of one forward+backward of the *unpacked* model (depth 1, classic padded rows)
  and of the *packed* model at depth d, both at the same [B, S] (micro_batch_size x
  max_sequence_length), in the backend's unit: ``cycles`` (ipu: ``logCycleCount`` /
  ``cycleCount()``, plus PopVision totals through ``pva`` when importable),
  ``estimated cycles`` (mock: the GC200 cost model of ``ipu.cost_model``), ``ms``
  (cpu: median wall time; cuda: CUDA events);
- overhead = 1 - unpacked / packed: the paper's "percentage decrease in throughput"
  (packs/s) caused by the block-diagonal mask and the per-sequence loss unpacking. On
  noisy backends packed and unpacked runs are interleaved (each packed run right after a
  baseline run) and each side's cost is its fastest run, since other work on a shared
  machine only adds time; the median of the paired ratios is kept in the JSON too;
- packing factor (sequences per pack) and efficiency (real-token fraction) of the
  configured algorithm at depth d on the run's data: the length histogram of the
  generated data (``data.histogram``, mapped to S as the generator maps it) or the
  lengths of the HDF5 data (``data.path``);
- realized speed-up = packing factor x (1 - overhead) = sequences/s packed over padded,
  the paper's Table 1 column;
- a breakdown of the packed step's cost: ``mask`` (mask construction), ``attention``
  (masked attention; on cpu/cuda only the work inside the model's ``packing/attention``
  scope, i.e. applying the mask), ``loss_unpacking`` (per-sequence MLM/NSP gathers and
  reductions) and ``rest``. On cpu/cuda it comes from the model's
  ``torch.profiler.record_function`` scopes (``packing/mask``, ``packing/attention``,
  ``packing/loss_unpacking``), scaled to the step's cost.

Next to the estimate, ``throughput`` measures training itself: packed (the configured
depth) and padded ``train_step`` calls interleaved in one run on generated data with the
same sequences, sequences/s of each and their ratio (mock: derived from estimated
cycles, labelled so).

Outputs in ``output_dir``: ``overhead.json`` (everything), ``overhead.md`` (the table) and
``overhead.png`` (overhead and speed-ups against depth), written atomically.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from bert_packed.backend import Profiling, require
from bert_packed.io.files import atomic_path, write_text_atomic

DEPTHS = (1, 2, 3, 4, 8, 16)
CATEGORIES = ("mask", "attention", "loss_unpacking", "rest")
SCOPES = {"packing/mask": "mask", "packing/attention": "attention", "packing/loss_unpacking": "loss_unpacking"}
GC200_CLOCK_HZ = 1.33e9
# Packs the depths the configured algorithm is not defined for (fast, any depth).
FALLBACK_ALGORITHM = "lpfhp"


class ProfilingError(ValueError):
    """A profiling request that cannot be run (one-line message naming the fix)."""


# ----------------------------------------------------------------------------- packing statistics


def mapped_histogram_counts(counts: np.ndarray, source_length: int, max_sequence_length: int,
                            length_mapping: str = "scale") -> np.ndarray:
    """Map a length histogram onto S the way the generated data maps sampled lengths
    (``bert_packed.data.generated.map_lengths``: scale or truncate, clipped to [3, S])."""
    from bert_packed.data.generated import map_lengths

    lengths = map_lengths(np.arange(1, source_length + 1), source_length, max_sequence_length, length_mapping)
    mapped = np.zeros(max_sequence_length, dtype=np.int64)
    np.add.at(mapped, lengths - 1, np.asarray(counts, dtype=np.int64))
    return mapped


def data_lengths(config) -> Optional[np.ndarray]:
    """Sequence lengths of the run's data: a fine-tuning task's training file as tokenized, the
    HDF5 data (``data.path``), or None for generated data (``data.histogram``).

    HDF5 data is read block by block through the stats reader, not a data source, which would
    load the token arrays only to throw them away."""
    if config.data.path is None:
        from bert_packed.tasks.registry import get_task

        # Fine-tuning trains on its own file: its lengths, never the pre-training histogram.
        return get_task(copy.deepcopy(config)).training_lengths()
    from bert_packed.data.stats import dataset_stats

    counts = dataset_stats(config.data.path)["length_counts"]
    return np.repeat(np.arange(1, len(counts) + 1), counts)


def packing_statistics(config, depths: Sequence[int] = DEPTHS, lengths: Optional[np.ndarray] = None) -> Dict:
    """Packing factor and efficiency of ``config.data.packing_algorithm`` at every depth.

    Depth 1 is always the ``none`` algorithm (one sequence per row). A depth the configured
    algorithm is not defined for (nnlshp beyond 3) is packed with lpfhp and labelled so. Returns
    ``{"source": str, "theoretical_speedup": float, "rows": {depth: {...}}}``.
    """
    from packing import Histogram, PackingError, get_algorithm, pack

    d = config.data
    try:
        configured = get_algorithm(d.packing_algorithm)  # unknown name: one-line error
    except PackingError as error:
        raise ProfilingError(f"data.packing_algorithm: {error}") from None
    if lengths is not None:
        hist = Histogram.from_lengths(np.asarray(lengths), max_sequence_length=d.max_sequence_length)
        source = "lengths of the run's data" if d.path else "lengths of the fine-tuning training data"
    else:
        base = Histogram.load(d.histogram)
        counts = mapped_histogram_counts(base.counts, base.max_sequence_length, d.max_sequence_length,
                                         d.length_mapping)
        hist = Histogram(counts, max_sequence_length=d.max_sequence_length)
        source = f"histogram {d.histogram} mapped to S={d.max_sequence_length} ({d.length_mapping})"
    rows = {}
    for depth in depths:
        algorithm = "none" if depth == 1 else d.packing_algorithm
        label = algorithm
        if depth > 1 and not configured.supports(depth):
            # e.g. nnlshp is defined up to depth 3: keep the row, say which packer filled it.
            algorithm = FALLBACK_ALGORITHM
            label = f"{FALLBACK_ALGORITHM} ({d.packing_algorithm} not defined at depth {depth})"
        try:
            result = pack(hist, algorithm=algorithm, max_sequences_per_pack=depth, seed=config.train.seed)
        except PackingError as error:
            raise ProfilingError(f"packing with {algorithm} at depth {depth} failed: {error}") from None
        stats = result.to_dict()
        rows[depth] = {"algorithm": label, "packing_factor": float(stats["packing_factor"]),
                       "efficiency": float(stats["efficiency"]), "num_packs": int(stats["num_packs"])}
    return {"source": source, "theoretical_speedup": float(hist.theoretical_speedup), "rows": rows}


# ----------------------------------------------------------------------------- batches and models


def depth_config(config, depth: int, num_sequences: Optional[int] = None):
    """A copy of ``config`` whose data is packed at ``depth`` (1 = padded rows)."""
    new = copy.deepcopy(config)
    new.data.max_sequences_per_pack = int(depth)
    new.data.path = None  # costs depend on shapes only; generated packs have the real shapes
    if num_sequences is not None:
        new.data.num_sequences = int(num_sequences)
    return new


def profile_batches(config, depths: Sequence[int], micro_batch_size: int) -> Dict[int, Dict[str, np.ndarray]]:
    """One generated micro-batch [B, S] per depth (same B, S; K = depth, M = masked + K - 1),
    packed with lpfhp (see below); the packing statistics use the configured algorithm."""
    from bert_packed.tasks.pretraining.data import generated_source

    batches = {}
    for depth in depths:
        cfg = depth_config(config, depth, num_sequences=max(200, 4 * micro_batch_size * depth))
        # The batch supplies shapes and realistic contents; fixed-shape costs do not depend on
        # which packer filled the rows, so use the fast lpfhp rather than e.g. nnlshp's NNLS.
        if depth > 1:
            cfg.data.packing_algorithm = "lpfhp"
        source = generated_source(cfg, micro_batch_size=micro_batch_size, seed=config.train.seed)
        batches[depth] = next(iter(source))
    return batches


def build_profile_model(config, backend, execute: Optional[bool] = None):
    """The model to profile. A backend that prices shapes (the mock; unless ``execute``): on the
    meta device (no memory, nothing computed), since its cost is an estimate from shapes;
    otherwise a real model (the mock then runs it through its trainingModel with logCycleCount
    and reads cycleCount())."""
    import torch

    from bert_packed.tasks.pretraining.model import build_model

    if execute is None:
        execute = not backend.prices_from_shapes
    if not execute:
        with torch.device("meta"):
            return build_model(config)
    torch.manual_seed(config.train.seed)
    return build_model(config)


# ----------------------------------------------------------------------------- measurements


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 to /dev/null for a moment: for native libraries' chatter that Python's
    ``sys.stderr`` cannot catch. Only around calls that report errors by raising."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def scope_breakdown(model, batch: Dict[str, np.ndarray], device: str = "cpu") -> Dict[str, float]:
    """Fraction of one forward+backward spent inside the model's packing scopes.

    Runs the step once under ``torch.profiler`` and sums the CPU time of the events named
    ``packing/mask``, ``packing/attention``, ``packing/loss_unpacking``; ``rest`` is the
    remainder of the step's wall time. Returns fractions summing to 1.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    model.train()
    tensors = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    model.zero_grad(set_to_none=True)
    prof = profile(activities=activities)
    with _native_stderr_silenced():  # torch >= 2.12's kineto prints a "USDT: ... profiler_start" line
        prof.start()
    try:
        start = time.perf_counter()
        model(**tensors)["loss"].backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        total_us = (time.perf_counter() - start) * 1e6
    finally:
        with _native_stderr_silenced():  # ... and a "profiler_stop" line, at every start and stop
            prof.stop()
    model.zero_grad(set_to_none=True)
    spent = {name: 0.0 for name in CATEGORIES}
    for event in prof.events():
        category = SCOPES.get(event.name)
        if category is not None:
            spent[category] += event.cpu_time_total
    scoped = sum(spent.values())
    spent["rest"] = max(total_us - scoped, 0.0)
    denominator = max(sum(spent.values()), 1e-12)
    return {name: spent[name] / denominator for name in CATEGORIES}


def measure_costs(backend, model, batches: Dict[int, Dict[str, np.ndarray]], *, num_repeats: int,
                  deterministic: bool, progress: Optional[Callable[[], None]] = None,
                  profile_kwargs: Optional[Dict[str, Any]] = None) -> Dict[int, Dict]:
    """Cost of the unpacked batch (depth 1) and of every packed one, interleaved.

    Round r measures, for each depth d > 1, the baseline then depth d, so every packed
    sample has a baseline sample taken right before it. Costs are the minimum over a
    depth's samples (interference only adds time) and overhead = 1 - unpacked / packed
    (the decrease in packs/s); ``overhead_paired_median`` = 1 - median(baseline / packed)
    over the pairs is reported too. A deterministic backend is measured once per shape.
    ``profile_kwargs`` go to every ``backend.profile`` call (ipu/mock: config, profile_dir).
    """
    kwargs = dict(profile_kwargs or {})
    rounds = 1 if deterministic else num_repeats
    depths = [d for d in batches if d != 1]
    samples = {d: {"baseline": [], "packed": [], "ratio": []} for d in depths}
    unit, breakdowns, extras = None, {}, {}
    baseline_once = None
    for _ in range(rounds):
        for depth in depths:
            if deterministic and baseline_once is not None:
                base = baseline_once
            else:
                base = backend.profile(model, batches[1], num_repeats=1, **kwargs)
                baseline_once = base
                breakdowns.setdefault(1, base.get("breakdown"))
                extras.setdefault(1, base)
            packed = backend.profile(model, batches[depth], num_repeats=1, **kwargs)
            unit = packed["unit"]
            breakdowns.setdefault(depth, packed.get("breakdown"))
            extras.setdefault(depth, packed)
            s = samples[depth]
            s["baseline"].append(float(base["cost"]))
            s["packed"].append(float(packed["cost"]))
            s["ratio"].append(float(base["cost"]) / float(packed["cost"]))
            if progress is not None:
                progress()
    all_baseline = [c for d in depths for c in samples[d]["baseline"]]
    out = {1: {"unpacked_cost": min(all_baseline), "packed_cost": min(all_baseline),
               "overhead": 0.0, "overhead_paired_median": 0.0, "num_samples": len(all_baseline), "unit": unit,
               "breakdown": breakdowns.get(1), "raw": extras.get(1)}}
    for depth in depths:
        s = samples[depth]
        # Other work on a shared machine only ever adds time, so the fastest of the
        # interleaved runs is the least disturbed estimate of each side; the median of the
        # paired ratios (robust to slow drift rather than to bursts) is kept alongside.
        unpacked, packed = min(s["baseline"]), min(s["packed"])
        out[depth] = {"unpacked_cost": unpacked, "packed_cost": packed, "overhead": 1.0 - unpacked / packed,
                      "overhead_paired_median": 1.0 - statistics.median(s["ratio"]), "num_samples": len(s["ratio"]),
                      "unit": unit, "breakdown": breakdowns.get(depth), "raw": extras.get(depth)}
    return out


def default_report_reader(profile_dir: str):
    """Open the newest PopVision report under ``profile_dir`` with ``pva`` (None without pva or a report)."""
    try:
        import pva  # shipped with the Poplar SDK, not on PyPI
    except ImportError:
        return None
    reports = sorted(glob.glob(os.path.join(profile_dir, "**", "*.pop"), recursive=True), key=os.path.getmtime)
    return pva.openReport(reports[-1]) if reports else None


def pva_total_cycles(report) -> Optional[float]:
    """Execution cycles of a pva report: the total when present, else the sum over steps (IPU 0)."""
    if report is None:
        return None
    execution = report.execution
    total = getattr(getattr(execution, "totalCycles", None), "total", None)
    if total is not None:
        return float(total)
    return float(sum(step.ipus[0].cycles for step in execution.steps))


def measure_throughput(config, make_backend: Callable[[], Any], packed_depth: int, *, num_steps: int,
                       progress: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Train packed (``packed_depth``) and padded (depth 1) side by side: ``num_steps`` of each.

    The two modes' ``train_step`` calls alternate (packed, padded, packed, ...) so machine
    noise hits both alike; one untimed warm-up step each. Both draw from generated data
    with the same sequences (the lengths depend on the seed, not on the depth).

    ``sequences_per_second`` = measured packs/s x the data's sequences per pack over its
    whole epoch: a step's cost does not depend on what the rows hold (fixed shapes), so
    this is the long-run rate; ``measured_sequences_per_second`` counts only the sequences
    that were in the timed steps (noisier for few steps). ``speedup`` uses total times;
    ``speedup_median_steps`` the median step time of each mode (robust to bursts of other
    work on a shared machine). ``make_backend()`` returns a fresh, unprepared backend object
    (one per mode: both stay prepared side by side).
    """
    import torch

    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.loop.plan import make_plan
    from bert_packed.tasks.pretraining.data import generated_source

    if num_steps < 1:
        raise ProfilingError(f"throughput needs at least one step per mode, got {num_steps}")
    B = config.train.micro_batch_size
    modes = {}
    for name, depth in (("packed", packed_depth), ("padded", 1)):
        cfg = depth_config(config, depth)
        source = generated_source(cfg, micro_batch_size=B, seed=config.train.seed)
        torch.manual_seed(config.train.seed)
        model = build_model(cfg)
        optimizer, scheduler = build_optimizer(cfg, model)
        backend = make_backend()
        backend.prepare(model, optimizer, make_plan(cfg, backend), scheduler=scheduler)
        it = iter(source)
        backend.train_step([next(it)])  # warm-up (compilation, allocators), not timed
        modes[name] = {"backend": backend, "iterator": it, "seconds": 0.0, "sequences": 0.0, "packs": 0,
                       "depth": depth, "packing_factor": float(source.packing_factor), "step_seconds": []}
    for _ in range(num_steps):
        for mode in modes.values():
            batch = next(mode["iterator"])
            start = time.perf_counter()
            mode["backend"].train_step([batch])
            elapsed = time.perf_counter() - start
            mode["seconds"] += elapsed
            mode["step_seconds"].append(elapsed)
            mode["sequences"] += float(np.sum(batch["nsp_weights"]))
            mode["packs"] += int(batch["input_ids"].shape[0])
            if progress is not None:
                progress()
    result = {"method": f"measured: {num_steps} interleaved train_step calls per mode; sequences/s = "
                        f"packs/s x the generated data's sequences per pack over its epoch",
              "num_steps": num_steps}
    for name, m in modes.items():
        packs_per_second = m["packs"] / m["seconds"]
        result[name] = {"depth": m["depth"], "steps": num_steps, "packs": m["packs"], "seconds": m["seconds"],
                        "packs_per_second": packs_per_second, "data_packing_factor": m["packing_factor"],
                        "sequences_per_second": packs_per_second * m["packing_factor"],
                        "measured_sequences": m["sequences"],
                        "measured_sequences_per_second": m["sequences"] / m["seconds"],
                        "median_step_seconds": statistics.median(m["step_seconds"])}
    result["speedup"] = result["packed"]["sequences_per_second"] / result["padded"]["sequences_per_second"]
    result["measured_speedup"] = (result["packed"]["measured_sequences_per_second"]
                                  / result["padded"]["measured_sequences_per_second"])
    # Robust to bursts of other work on a shared machine: the typical step of each mode.
    result["speedup_median_steps"] = (result["packed"]["data_packing_factor"] * result["padded"]["median_step_seconds"]
                                      / result["padded"]["data_packing_factor"] / result["packed"]["median_step_seconds"])
    return result


def estimated_throughput(rows: List[Dict], packed_depth: int, micro_batch_size: int) -> Dict[str, Any]:
    """Sequences/s per replica from estimated cycles (mock): B x packing factor / (cycles / clock)."""
    by_depth = {row["depth"]: row for row in rows}
    padded, packed = by_depth[1], by_depth[packed_depth]
    out = {"method": "estimated from the cost model's cycles at 1.33 GHz (no execution)"}
    for name, row, cost in (("padded", padded, padded["unpacked_cost"]), ("packed", packed, packed["packed_cost"])):
        seconds = cost / GC200_CLOCK_HZ
        out[name] = {"depth": row["depth"], "sequences_per_second": micro_batch_size * row["packing_factor"] / seconds,
                     "packs_per_second": micro_batch_size / seconds}
    out["speedup"] = out["packed"]["sequences_per_second"] / out["padded"]["sequences_per_second"]
    return out


# ----------------------------------------------------------------------------- the report


def _breakdown_in_unit(breakdown: Optional[Dict], cost: float) -> Dict[str, float]:
    """Absolute breakdown in the cost's unit: as given (cycle estimates) or fractions x cost."""
    if not breakdown:
        return {}
    values = {name: float(breakdown.get(name, 0.0)) for name in CATEGORIES}
    total = sum(values.values())
    if total <= 0:
        return {}
    if abs(total - 1.0) < 1e-6:  # fractions
        return {name: v * cost for name, v in values.items()}
    return {name: v * cost / total for name, v in values.items()}


def format_markdown(report: Dict) -> str:
    """The report as a Markdown table (the paper's Table 1 columns plus costs and breakdown)."""
    unit = report["unit"]
    lines = [f"# Packing overhead: {report['backend']} backend, config {report['config']}", "",
             f"Model: {report['model']}; shape [B, S] = [{report['micro_batch_size']}, {report['max_sequence_length']}]; "
             f"algorithm {report['algorithm']} on {report['packing_source']} "
             f"(theoretical speed-up {report['theoretical_speedup']:.4f}). Cost unit: **{unit}** "
             f"({report['cost_note']}).", "",
             f"| depth | algorithm | unpacked ({unit}) | packed ({unit}) | overhead % | packing factor | "
             f"efficiency % | realized speed-up | mask % | attention % | loss unpacking % | rest % |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        b = row["breakdown"]
        share = [100.0 * b.get(name, float("nan")) / row["packed_cost"] if b else float("nan") for name in CATEGORIES]
        lines.append(f"| {row['depth']} | {row['algorithm']} | {row['unpacked_cost']:.6g} | {row['packed_cost']:.6g} | "
                     f"{100 * row['overhead']:.2f} | {row['packing_factor']:.4f} | {100 * row['efficiency']:.2f} | "
                     f"{row['realized_speedup']:.4f} | " + " | ".join(f"{s:.2f}" for s in share) + " |")
    t = report.get("throughput")
    if t:
        lines += ["", f"Training throughput, packed (depth {t['packed']['depth']}) vs padded, side by side "
                      f"({t['method']}):", "",
                  "| mode | sequences/s | packs/s |", "|---|---:|---:|"]
        for name in ("padded", "packed"):
            lines.append(f"| {name} | {t[name]['sequences_per_second']:.4g} | {t[name]['packs_per_second']:.4g} |")
        lines += ["", f"Packed / padded sequences/s: **{t['speedup']:.3f}**"]
        if "speedup_median_steps" in t:
            lines[-1] += f" (from median step times: {t['speedup_median_steps']:.3f})"
    if report.get("cost_scope"):
        lines += ["", report["cost_scope"]]
    if report.get("pva_cycles") is not None:
        lines += ["", f"PopVision (pva) total cycles of the profiled run: {report['pva_cycles']:.6g}"]
    lines += ["", "overhead = 1 - unpacked / packed, the decrease in packs/s (on noisy backends: fastest of "
                  "interleaved runs); realized speed-up = packing factor x (1 - overhead); "
                  "breakdown shares are of the packed step's cost.", ""]
    return "\n".join(lines)


def plot_report(report: Dict, path: str) -> None:
    """Overhead % and speed-ups against packing depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [row["depth"] for row in report["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(depths, [100 * row["overhead"] for row in report["rows"]], "o-")
    left.set_xscale("log", base=2)
    left.set_xlabel("packing depth")
    left.set_ylabel(f"overhead % ({report['unit']})")
    left.grid(True, alpha=0.3)
    right.plot(depths, [row["packing_factor"] for row in report["rows"]], "s--", label="packing factor")
    right.plot(depths, [row["realized_speedup"] for row in report["rows"]], "o-", label="realized speed-up")
    right.axhline(report["theoretical_speedup"], color="gray", lw=0.8, label="theoretical (no padding)")
    right.set_xscale("log", base=2)
    right.set_xlabel("packing depth")
    right.set_ylabel("x over padded BERT")
    right.legend()
    right.grid(True, alpha=0.3)
    for ax in (left, right):
        ax.set_xticks(depths)
        ax.set_xticklabels([str(d) for d in depths])
        ax.minorticks_off()
    fig.suptitle(f"{report['backend']}: {report['model']}, algorithm {report['algorithm']}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def run_profile(config, backend, output_dir: str, *, depths: Sequence[int] = DEPTHS,
                num_repeats: int = 3, throughput: bool = True, throughput_steps: int = 8,
                report_reader: Optional[Callable[[str], Any]] = None, show_progress: bool = True,
                execute: Optional[bool] = None, make_backend: Optional[Callable[[], Any]] = None) -> Dict:
    """Profile every depth on ``backend`` (a backend object with the ``Profiling`` capability;
    ``run.py`` resolves names) and write overhead.json/.md/.png to ``output_dir``.

    ``report_reader(profile_dir) -> pva report or None`` reads PopVision reports (default:
    ``pva.openReport`` on the newest ``*.pop``; tests inject a fake). ``execute``: run the model
    on the mock (default: no, BERT-Large is priced from shapes on the meta device).
    ``make_backend()``: fresh backend objects for the side-by-side throughput runs (default:
    ``type(backend)()``). Returns the report dict.
    """
    if isinstance(backend, str):
        raise TypeError(f"run_profile() takes a backend object, not the name {backend!r}: "
                        f"resolve it with backends.get_backend({backend!r})")
    require(backend, Profiling, "profiling")
    backend_name = backend.name
    depths = sorted({int(d) for d in depths} | {1})
    if any(d < 1 for d in depths):
        raise ProfilingError(f"packing depths must be >= 1, got {depths}")
    os.makedirs(output_dir, exist_ok=True)
    B, S = config.train.micro_batch_size, config.data.max_sequence_length
    packing = packing_statistics(config, depths, data_lengths(config))

    model = build_profile_model(config, backend, execute)
    batches = profile_batches(config, depths, B)
    deterministic = backend.deterministic_cost
    num_calls = (1 if deterministic else num_repeats) * (len(depths) - 1)
    from tqdm import tqdm

    bar = tqdm(total=num_calls, desc=f"profile {backend_name}", disable=not show_progress, leave=False)
    profile_kwargs = backend.profile_options(config, output_dir)
    costs = measure_costs(backend, model, batches, num_repeats=num_repeats, deterministic=deterministic,
                          progress=bar.update, profile_kwargs=profile_kwargs)
    bar.close()

    rows = []
    for depth in depths:
        c, p = costs[depth], packing["rows"][depth]
        breakdown = c["breakdown"]
        if breakdown is None:
            breakdown = backend.scope_breakdown(model, batches[depth])
        rows.append({"depth": depth, "algorithm": p["algorithm"], "unpacked_cost": c["unpacked_cost"],
                     "packed_cost": c["packed_cost"], "overhead": c["overhead"],
                     "overhead_paired_median": c.get("overhead_paired_median"), "num_samples": c["num_samples"],
                     "packing_factor": p["packing_factor"], "efficiency": p["efficiency"],
                     "realized_speedup": p["packing_factor"] * (1.0 - c["overhead"]),
                     "breakdown": _breakdown_in_unit(breakdown, c["packed_cost"]),
                     "max_masked_tokens_per_pack": int(batches[depth]["mlm_positions"].shape[1])})
    unit = costs[depths[-1]]["unit"] or costs[1]["unit"]
    m = config.model
    report = {"backend": backend_name, "config": getattr(config, "name", ""), "unit": unit,
              "cost_note": backend.cost_note,
              "model": f"{m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
                       f"attention {m.attention_implementation}",
              "micro_batch_size": B, "max_sequence_length": S, "algorithm": config.data.packing_algorithm,
              "packing_source": packing["source"], "theoretical_speedup": packing["theoretical_speedup"],
              "num_repeats": 1 if deterministic else num_repeats, "rows": rows}
    scope = backend.cost_scope(config)
    if scope:
        report["cost_scope"] = scope

    # PopVision totals when the backend left a profile directory behind (ipu; mock in tests).
    raw = costs[depths[-1]].get("raw") or {}
    profile_dir = raw.get("profile_dir")
    report["cycle_count_logged"] = raw.get("cycle_count_logged")
    report["pva_cycles"] = None
    if profile_dir:
        reader = report_reader or default_report_reader
        report["pva_cycles"] = pva_total_cycles(reader(profile_dir))

    packed_depth = config.data.max_sequences_per_pack if config.data.max_sequences_per_pack in depths else 3
    if throughput and packed_depth in depths and packed_depth > 1:
        if backend.throughput_is_estimated:
            report["throughput"] = estimated_throughput(rows, packed_depth, B)
        else:
            tbar = tqdm(total=2 * throughput_steps, desc="throughput", disable=not show_progress, leave=False)
            report["throughput"] = measure_throughput(config, make_backend or type(backend), packed_depth,
                                                      num_steps=throughput_steps, progress=tbar.update)
            tbar.close()

    write_text_atomic(os.path.join(output_dir, "overhead.json"), json.dumps(report, indent=2, default=float) + "\n")
    write_text_atomic(os.path.join(output_dir, "overhead.md"), format_markdown(report))
    plot_report(report, os.path.join(output_dir, "overhead.png"))
    return report
