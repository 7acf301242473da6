"""Benchmark: `lp` on small inputs (a fine-tuning set, a shard): packs, bound and seconds.

    python benchmarks/packing_small_inputs.py [--sequences 2000] [--cases squad-384 ...] [--depths 3 8 max]

Draws `--sequences` lengths (seed 0) of each case of `benchmarks/packing_peers.py` and plans them
with `lp` at each depth (`time_limit=10`, the library's other defaults). Prints one line per
(case, depth): packs, the certified bound, how the plan was found, the seconds of the call and
its CPU seconds (all threads; the time to import and to draw the sample is not in them). The
packing library is taken from PYTHONPATH first, so two versions can be compared on the same samples.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.append(ROOT)  # after PYTHONPATH: a version given there wins

CASES = ["wikipedia-512", "squad-384", "longtail-8192", "mixture-8192"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--depths", nargs="+", default=["3", "8", "max"], help="depths; max = unlimited")
    args = parser.parse_args(argv)
    if args.sequences < 1:
        parser.error("--sequences must be at least 1")
    from benchmarks.packing_peers import CASES as KNOWN, make_histogram
    from packing import Histogram, pack

    for case in args.cases:
        if case not in KNOWN:
            parser.error(f"unknown case {case!r}; choose from {', '.join(KNOWN)}")
    for case in args.cases:
        source = make_histogram(case)
        histogram = Histogram.from_lengths(source.sample_lengths(args.sequences, seed=0), source.max_sequence_length)
        for depth in args.depths:
            started, cpu = time.perf_counter(), time.process_time()
            result = pack(histogram, "lp", None if depth == "max" else int(depth), time_limit=10)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            print(f"{case} depth {depth}: {result.num_packs:,} packs, bound {result.lp_bound_packs:,} "
                  f"({result.gap:.2%} over), {result.details.get('rounding')}, {seconds:.2f} s ({cpu:.2f} s of CPU)", flush=True)


if __name__ == "__main__":
    main()
