"""lp's master LP: one warm-started HiGHS instance (``master="highs"``, the default) vs
scipy's linprog re-solving from scratch every column-generation round (``"scipy"``).

    python benchmarks/packing_lp_master.py
    python benchmarks/packing_lp_master.py --dry-run     # squad-384 at depth 8 only (seconds)

Same cases, same rounds (the two give the same LP); run alternately in one process, so
the ratio is comparable on a shared machine. target_gap=0: the LP runs to convergence.
"""
import argparse
import os
import sys
import time

import numpy as np  # noqa: E402

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import spread  # noqa: E402
from benchmarks.packing_peers import make_histogram  # noqa: E402
from packing import Histogram, pack  # noqa: E402


def cases():
    wikipedia = Histogram.load("wikipedia-512")
    yield "wikipedia-512", wikipedia, 3
    yield "wikipedia-512", wikipedia, None
    yield "squad-384", make_histogram("squad-384"), 8
    rng = np.random.default_rng(4096)
    lengths = np.minimum(rng.geometric(3.0 / 4096, size=20_000) // 16 * 16 + 16, 4096)
    yield "geometric-4096 (256 lengths)", Histogram.from_lengths(lengths, 4096), 8


def main(argv=None):
    """Every case, or (``--dry-run``) the smallest."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="squad-384 at depth 8 only (seconds)")
    args = parser.parse_args(argv)
    selected = [("squad-384", 8)] if args.dry_run else None
    print(f"{'case':30} {'depth':>5} {'master':>6} {'rounds':>6} {'packs':>10} {'bound':>10} {'seconds':>8}")
    for name, histogram, depth in cases():
        if selected is not None and (name, depth) not in selected:
            continue
        seconds = {}
        for master in ("highs", "scipy", "highs", "scipy"):  # alternate; keep the faster of two runs
            started = time.perf_counter()
            result = pack(histogram, "lp", depth, master=master, target_gap=0.0)
            elapsed = time.perf_counter() - started
            seconds.setdefault(master, []).append(elapsed)
            last = result
            print(f"{name:30} {('max' if depth is None else depth):>5} {master:>6} {last.details['num_rounds']:>6} "
                  f"{last.num_packs:>10,} {last.lp_bound_packs:>10,} {elapsed:>8.2f}", flush=True)
        best = {master: spread(times)["min"] for master, times in seconds.items()}
        print(f"{'':30} {'':>5} scipy / highs (best of 2 each): {best['scipy'] / best['highs']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
