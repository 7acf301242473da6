"""Are two versions of ``packing`` the same on ordinary inputs? Field by field, every algorithm.

    git archive f73733c packing | tar -x -C /tmp/before
    python benchmarks/packing_equivalence.py --compare-with /tmp/before
    python benchmarks/packing_equivalence.py --compare-with . --dry-run   # L = 8 and 30, 1 and 5 sequences only

Cases (deterministic): a 20,000-sequence sample of ``wikipedia-512`` and lognormal lengths
(median L / 5) at L = 8, 30, 512, 2,048, 8,192, 40,000 and 100,000 with 1, 5, 200 and 3,000
sequences. For each: the histogram's statistics and a draw of ``sample_lengths``; every
algorithm at depths 1, 2, 3, 8 and unlimited where it is defined (nnlshp / ennlshp only at
L <= 600, ennlshp only up to 300 sequences; lp with a 20 s limit) with ``to_dict()`` (less
``seconds``), ``details``, the plan and ``assign``'s packs; ``pack_sequences`` (lpfhp,
greedy, lp at depth 4) on up to 300 of the sequences. Each version runs in its own
subprocess; the script prints how many results there are and which differ. (lp under a
time limit can differ when a run is slowed down past it: rerun on a quieter machine.)
"""
import argparse
import os
import pickle
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import pickle, sys
import numpy as np
from packing import ALGORITHMS, Histogram, assign, pack, pack_sequences
out = {}
rng = np.random.default_rng(123)
dry = len(sys.argv) > 2 and sys.argv[2] == "dry"
cases = [] if dry else [("wikipedia-sample", Histogram.load("wikipedia-512").sample_lengths(20000, seed=1), 512)]
for L in (8, 30) if dry else (8, 30, 512, 2048, 8192, 40000, 100000):
    for n in (1, 5) if dry else (1, 5, 200, 3000):
        cases.append((f"L{L}-n{n}", np.clip(rng.lognormal(np.log(L / 5), 1.0, n).astype(np.int64), 1, L), L))
for name, lengths, L in cases:
    histogram = Histogram.from_lengths(lengths, L)
    out[(name, "statistics")] = histogram.statistics()
    out[(name, "sample")] = histogram.sample_lengths(50, seed=3).tolist()
    for algorithm in ALGORITHMS:
        for depth in (1, 2, 3, 8, None):
            if not ALGORITHMS[algorithm].supports(depth) or (algorithm in ("nnlshp", "ennlshp") and L > 600) \
                    or (algorithm == "ennlshp" and lengths.size > 300):
                continue
            try:
                result = pack(histogram, algorithm, depth, seed=1, **({"time_limit": 20} if algorithm == "lp" else {}))
            except Exception as exc:
                out[(name, algorithm, depth)] = repr(exc)
                continue
            fields = result.to_dict()
            fields.pop("seconds")
            details = {k: v for k, v in result.details.items() if k != "time_limit_reached"}
            packs = assign(result.plan, lengths, seed=2, shuffle_packs=depth == 2)
            out[(name, algorithm, depth)] = (fields, details, result.plan.strategies, result.plan.repeats.tolist(),
                                             packs.pack_offsets.tolist(), packs.sequence_indices.tolist())
    tokens = [list(range(int(n))) for n in lengths[:300]]
    for algorithm in ("lpfhp", "greedy", "lp"):
        rows = pack_sequences(tokens, L, algorithm, 4, seed=5)
        out[(name, "pack_sequences", algorithm)] = (rows.tokens["input_ids"].tolist(), rows.row_offsets.tolist(),
                                                    rows.seq_lengths.tolist(), rows.sequence_indices.tolist())
pickle.dump(out, open(sys.argv[1], "wb"))
"""


def _results(root, path, dry_run=False):
    environment = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", CHILD, path] + (["dry"] if dry_run else []), env=environment, cwd=root,
                   check=True)
    with open(path, "rb") as handle:
        return pickle.load(handle)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare-with", required=True, metavar="DIR", help="a directory holding the other packing/")
    parser.add_argument("--dry-run", action="store_true", help="only L = 8 and 30 with 1 and 5 sequences (seconds)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        other = _results(os.path.abspath(args.compare_with), os.path.join(scratch, "other.pkl"), args.dry_run)
        this = _results(ROOT, os.path.join(scratch, "this.pkl"), args.dry_run)
    differ = sorted((str(key) for key in set(other) | set(this) if other.get(key) != this.get(key)))
    print(f"{len(this)} results, {len(differ)} differ")
    for key in differ:
        print(f"  {key}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
