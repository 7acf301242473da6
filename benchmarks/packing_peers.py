"""Packing at LLM scale: `packing`'s algorithms side by side with the packers people use.

    python benchmarks/packing_peers.py                       # every case, table on stdout
    python benchmarks/packing_peers.py --json out.json --plot out.png
    python benchmarks/packing_peers.py --cases mixture-8192 --depths max 8

Cases (deterministic, seed 0): the shipped ``wikipedia-512`` histogram (16.3 M sequences,
BERT pre-training), ``squad-384`` (a SQuAD-1.1-like short histogram: 88,641 sequences,
mean ~170 tokens, at L = 384) and four long-context LLM mixes of 1 M sequences:
``longtail-L`` (log-normal lengths, median L / 12) and ``mixture-L`` (60 % short chat
turns, 30 % documents around L / 6, 10 % long documents in [L / 2, L]) at L = 8,192 and
32,768.

Every run is its own subprocess, so ``peak_rss`` is that run's own peak (VmHWM, which
includes the ~0.1 GiB of Python + numpy). `packing`'s algorithms run on the whole
histogram; the peers (TRL's ``pack_dataset`` BFD as SFTTrainer calls it, ``binpacking``
and ``prtpy`` first-fit decreasing, each only if installed; torchtune's packer is
next-fit in stream order, which ``greedy`` is) need one Python object per sequence, so
they run on an i.i.d. sample (``--peer-sample``, smaller for the O(n x bins) ones) next to
``lpfhp`` and ``lp`` on that same sample. ``gap`` is packs / bound - 1 with the bound of
that histogram (the best of LP, tokens, depth and Martello-Toth L2: see packing/bounds.py).
Times are wall seconds on whatever machine runs it: on a shared CPU compare ratios.
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)

from benchmarks.common import result_line, run_worker  # noqa: E402

RECORD = "RECORD "  # the worker's result line: this prefix, then the record as JSON

CASES = ["wikipedia-512", "squad-384", "longtail-8192", "mixture-8192", "longtail-32768", "mixture-32768"]
OURS = ["lp", "lpfhp", "spfhp", "bfd", "greedy"]
PEERS = ["trl-bfd", "binpacking-wfd", "prtpy-ffd"]
PEER_LIMITS = {"binpacking-wfd": 5_000, "prtpy-ffd": 5_000}  # O(n x bins) pure Python


def make_lengths(case, num_sequences=None, seed=0):
    """Per-sequence lengths of a case (np.int64), or None for the histogram-only ones."""
    kind, L = case.rsplit("-", 1)
    L = int(L)
    rng = np.random.default_rng(seed)
    n = num_sequences or 1_000_000
    if kind == "longtail":
        lengths = rng.lognormal(np.log(L / 12), 1.1, n)
    elif kind == "mixture":
        part = rng.choice(3, size=n, p=[0.6, 0.3, 0.1])
        lengths = np.where(part == 0, rng.lognormal(np.log(300), 0.7, n),
                           np.where(part == 1, rng.lognormal(np.log(L / 6), 0.5, n), rng.uniform(L / 2, L, n)))
    elif kind == "squad":
        n = num_sequences or 88_641
        lengths = rng.gamma(4.0, 170 / 4.0, n) + 20  # question + context tokens, SQuAD-like
    else:
        return None
    return np.clip(np.ceil(lengths), 1, L).astype(np.int64)


def make_histogram(case):
    from packing import Histogram

    if case == "wikipedia-512":
        return Histogram.load("wikipedia-512")
    return Histogram.from_lengths(make_lengths(case), int(case.rsplit("-", 1)[1]), name=case)


def _peak_rss():
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmHWM:\s+(\d+)", handle.read()).group(1)) * 1024


def worker(case, algorithm, depth, sample, time_limit):
    """One run; prints one JSON line."""
    from packing import Histogram, pack

    depth = None if depth == "max" else int(depth)
    lengths = None
    if sample:
        full = make_histogram(case)
        lengths = full.sample_lengths(sample, seed=0)
        histogram = Histogram.from_lengths(lengths, full.max_sequence_length)
    else:
        histogram = make_histogram(case)
    L = histogram.max_sequence_length
    options = {"time_limit": time_limit} if algorithm == "lp" and time_limit else {}
    record = {"case": case, "algorithm": algorithm, "depth": depth, "num_sequences": histogram.num_sequences,
              "sample": bool(sample)}
    if algorithm in OURS:
        result = pack(histogram, algorithm, depth, **options)
        record.update(packs=result.num_packs, seconds=result.seconds, bound=result.lp_bound_packs, gap=result.gap,
                      time_limit_reached=result.details.get("time_limit_reached", False))
    else:
        bound = pack(histogram, "lpfhp", depth).lp_bound_packs  # the simple bounds (lp's row has the LP one)
        if lengths is None:
            lengths = histogram.sample_lengths(seed=0)
        _run_peer(algorithm, np.array([1]), L)  # imports (torch for TRL) are not the packer's time
        started = time.perf_counter()
        packs = _run_peer(algorithm, lengths, L)
        seconds = time.perf_counter() - started
        record.update(packs=packs, seconds=seconds, bound=bound, gap=packs / bound - 1)
    record["peak_rss"] = _peak_rss()
    print(result_line(RECORD, record))


def _run_peer(name, lengths, L):
    if name == "trl-bfd":
        import datasets
        import pyarrow as pa
        from trl.data_utils import pack_dataset

        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(offsets[-1], dtype=np.int32)))
        dataset = datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column})))
        return pack_dataset(dataset, L, strategy="bfd").num_rows  # as SFTTrainer calls it
    if name == "binpacking-wfd":
        import binpacking

        return len(binpacking.to_constant_volume(lengths.tolist(), L))
    if name == "prtpy-ffd":
        import prtpy

        return len(prtpy.pack(algorithm=prtpy.packing.first_fit_decreasing, binsize=L, items=lengths.tolist()))
    raise ValueError(name)


def _available(peer):
    module = {"trl-bfd": "trl", "binpacking-wfd": "binpacking", "prtpy-ffd": "prtpy"}[peer]
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run(case, algorithm, depth, sample=None, time_limit=None, timeout=600):
    command = [sys.executable, os.path.abspath(__file__), "--worker", case, algorithm, depth,
               str(sample or 0), str(time_limit or 0)]
    started = time.perf_counter()
    record = run_worker(command, RECORD, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if str(record.get("status", "")).startswith("failed: "):
        error = record["status"][len("failed: "):]
        error = f"did not finish in {timeout} s" if error.startswith("timeout after") else error
        return {"case": case, "algorithm": algorithm, "depth": depth, "error": error}
    record["wall_seconds"] = time.perf_counter() - started
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--depths", nargs="+", default=["max", "8"], help="'max' = unlimited")
    parser.add_argument("--algorithms", nargs="+", default=OURS, choices=OURS)
    parser.add_argument("--peer-sample", type=int, default=20_000, help="sequences the peers pack (i.i.d. sample)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="lp's time_limit (s)")
    parser.add_argument("--timeout", type=int, default=600, help="per run (s)")
    parser.add_argument("--skip-peers", action="store_true", help="only packing's own algorithms")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--plot", help="write a PNG of gap vs time here")
    args = parser.parse_args(argv)
    if args.worker:
        case, algorithm, depth, sample, time_limit = args.worker
        worker(case, algorithm, depth, int(sample) or None, float(time_limit) or None)
        return 0
    records = []

    def show(record):
        records.append(record)
        if "error" in record:
            print(f"{record['case']:15} {record['algorithm']:15} {record['depth']:>4}  {record['error']}", flush=True)
            return
        depth = "max" if record["depth"] is None else record["depth"]
        flag = " (time limit)" if record.get("time_limit_reached") else ""
        print(f"{record['case']:15} {record['algorithm']:15} {depth:>4} {record['num_sequences']:>10,} "
              f"{record['packs']:>10,} {record['bound']:>10,} {100 * record['gap']:>9.4f} {record['seconds']:>9.3f} "
              f"{record['peak_rss'] / 2**30:>7.2f}{flag}", flush=True)

    print(f"{'case':15} {'algorithm':15} {'depth':>4} {'sequences':>10} {'packs':>10} {'bound':>10} {'gap %':>9} "
          f"{'seconds':>9} {'RSS GiB':>7}")
    for case in args.cases:
        for depth in args.depths:
            for algorithm in args.algorithms:
                if algorithm == "greedy" and depth != "max":
                    continue
                show(run(case, algorithm, depth, time_limit=args.time_limit, timeout=args.timeout))
        # Peers on a sample (unlimited depth: none of them has a depth limit), with ours beside them.
        for peer in [] if args.skip_peers else PEERS:
            sample = min(args.peer_sample, PEER_LIMITS.get(peer, args.peer_sample))
            if not _available(peer):
                records.append({"case": case, "algorithm": peer, "depth": "max", "error": "not installed"})
                print(f"{case:15} {peer:15}  max  skipped: not installed", flush=True)
                continue
            for algorithm in ("lp", "lpfhp", peer):
                show(run(case, algorithm, "max", sample=sample, time_limit=args.time_limit, timeout=args.timeout))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)
    if args.plot:
        _plot(records, args.plot)
    return 0


def _plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "error" not in r and not r["sample"]]
    cases = sorted({r["case"] for r in rows}, key=CASES.index)
    figure, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    markers = dict(zip(OURS, "o^sDv"))
    for axis, case in zip(axes, cases):
        for r in (r for r in rows if r["case"] == case):
            depth = "max" if r["depth"] is None else r["depth"]
            axis.scatter(max(r["seconds"], 1e-3), max(100 * r["gap"], 1e-4), marker=markers.get(r["algorithm"], "x"),
                         color="C0" if depth == "max" else "C1", label=f"{r['algorithm']} d={depth}")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(case, fontsize=9)
        axis.set_xlabel("seconds")
    axes[0].set_ylabel("gap to bound % (floored at 1e-4)")
    handles, labels = axes[-1].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    figure.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center", ncol=6)
    figure.tight_layout(rect=(0, 0, 1, 0.86))
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
