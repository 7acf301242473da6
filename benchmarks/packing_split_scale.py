"""Benchmark: `pack`'s serial step at Wikipedia scale: one global plan, split over every shard.

    python benchmarks/packing_split_scale.py [--shards 4768] [--sequences 195000000] [--algorithm lp]

Draws `--shards` shard histograms (multinomial, seed 0) from the shipped Wikipedia-512 length
distribution, `--sequences` in all (195 M and 4,768 shards: 20 GB of text at S=512, dupe 10, as
`create` shards it), then times what `python -m bert_packed.data pack` does in its own process
before any shard is packed: the global plan (`packing.split.pack_polished`, K=3) and its split
over the shards (`packing.split.split_plan`). Everything after that runs on the workers. Prints
one line. The packing library is taken from PYTHONPATH first, so two versions can be compared.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.append(ROOT)  # after PYTHONPATH: a version given there wins

import numpy as np  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=4768)
    parser.add_argument("--sequences", type=int, default=195_000_000)
    parser.add_argument("--algorithm", default="lp")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.sequences < args.shards:
        parser.error("--shards must be at least 1 and --sequences at least --shards")
    import packing
    from packing.split import pack_polished, split_plan

    distribution = np.asarray(packing.Histogram.load("wikipedia-512").counts, np.float64)
    counts = np.random.default_rng(0).multinomial(args.sequences // args.shards, distribution / distribution.sum(),
                                                  size=args.shards)
    start = time.perf_counter()
    result = pack_polished(packing.Histogram(counts.sum(axis=0), 512, name="shards"), args.algorithm, 3, 0)
    planned = time.perf_counter()
    parts = split_plan(result.plan, list(counts))
    split = time.perf_counter()
    assert len(parts) == args.shards
    print(f"{args.shards:,} shards, {int(counts.sum()):,} sequences, {args.algorithm}: global plan "
          f"{planned - start:.2f} s ({result.plan.num_strategies} strategies), split {split - planned:.2f} s "
          f"({(split - planned) / args.shards * 1e3:.2f} ms a shard)")


if __name__ == "__main__":
    main()
