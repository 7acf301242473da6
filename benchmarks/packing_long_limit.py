"""Memory and time of the packing API at an absurd length limit (issue 27, item 6).

    python benchmarks/packing_long_limit.py                    # L = 10**8, table on stdout
    python benchmarks/packing_long_limit.py --max-sequence-length 1000000000000 --json out.json
    git archive f73733c packing | tar -x -C /tmp/before        # the dense code, before issue 27
    python benchmarks/packing_long_limit.py --compare-with /tmp/before   # both, case by case

A handful of short sequences (lengths 3, 5, 5, 7, 11 tokens; the llm cases: token lists of
those lengths) at a length limit L. Each case runs in its own subprocess with its address
space capped (``--memory-limit-gib``, default 8), so a case that would need more ends in a
MemoryError instead of taking the machine down, and its peak is its own. Per case:
``traced_peak`` is tracemalloc's peak over the call (numpy's allocations are traced),
``peak_rss`` the process's VmHWM (it includes the ~0.1 GiB of Python, numpy, scipy), and
``seconds`` the wall time of the call. A ``PackingError`` (a refusal, e.g. nnlshp's dense
matrix) is a result too: its cost is what the refusal took.

Cases: ``from_lengths`` (the histogram), ``pack:<algorithm>`` at depth 3 (greedy and lp also
at unlimited depth), ``pack:lp-search`` (ten sequences of 0.2 L to 0.73 L tokens plus the short
ones, depth 4, ``target_gap=0``: the heuristics need 5 packs, the bounds say 4, so the LP
and the MILP run), ``assign`` (lpfhp's
plan), ``pack_sequences`` (lpfhp, lp), ``pack_stream`` (chunks of 2).
"""
import argparse
import json
import os
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, markdown_header, markdown_row  # noqa: E402

LENGTHS = [3, 5, 5, 7, 11]

CHILD = r"""
import json, re, resource, sys, time, tracemalloc
limit = int(float(sys.argv[3]) * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import numpy as np
import scipy.optimize, scipy.sparse  # imported before the measurement: not the call's cost
import packing
from packing import Histogram, PackingError, assign, pack, pack_sequences, pack_stream
case, L = sys.argv[1], int(sys.argv[2])
lengths = np.array(json.loads(sys.argv[4]), dtype=np.int64)
tokens = [list(range(1, n + 1)) for n in lengths.tolist()]
prepared = {}
if case in ("assign",) or case.startswith("pack:"):
    prepared["histogram"] = Histogram.from_lengths(lengths, L)
if case == "assign":
    prepared["plan"] = pack(prepared["histogram"], "lpfhp", 3).plan
if case == "pack:lp-search":
    big = [share * (L // 100) for share in (22, 33, 22, 42, 73, 23, 37, 39, 69, 27)]
    prepared["histogram"] = Histogram.from_lengths(big + lengths.tolist(), L)

def run():
    if case == "from_lengths":
        return Histogram.from_lengths(lengths, L).num_sequences
    if case == "pack:lp-search":
        result = pack(prepared["histogram"], "lp", 4, target_gap=0, time_limit=60)
        assert result.details["num_rounds"] > 0, result.details  # the LP ran
        return result.num_packs
    if case.startswith("pack:"):
        name, _, depth = case[5:].partition("@")
        return pack(prepared["histogram"], name, None if depth == "max" else int(depth or 3)).num_packs
    if case == "assign":
        return assign(prepared["plan"], lengths, seed=0).num_packs
    if case.startswith("pack_sequences:"):
        return len(pack_sequences(tokens, L, case.split(":")[1], 3))
    if case == "pack_stream":
        return sum(1 for _ in pack_stream(iter(tokens), L, chunk_size=2, algorithm="lpfhp"))
    raise SystemExit(f"unknown case {case}")

tracemalloc.start()
started = time.perf_counter()
try:
    outcome = {"result": run()}
except PackingError as exc:
    outcome = {"refused": str(exc)}
except MemoryError:
    outcome = {"memory_error": True}
seconds = time.perf_counter() - started
_, peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
rss = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
print(json.dumps(dict(outcome, case=case, seconds=seconds, traced_peak_bytes=peak, peak_rss_bytes=rss)))
"""

CASES = (["from_lengths"]
         + [f"pack:{name}" for name in ("none", "sort", "greedy", "spfhp", "lpfhp", "ffd", "bfd", "nnlshp", "ennlshp",
                                        "lp")]
         + ["pack:greedy@max", "pack:lpfhp@max", "pack:lp@max", "pack:lp-search", "assign", "pack_sequences:lpfhp",
            "pack_sequences:lp", "pack_stream"])


def _bytes(value):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value} B"


def _run(case, root, args):
    """One case in a child process importing ``packing`` from ``root``; its JSON record."""
    environment = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, case, str(args.max_sequence_length), str(args.memory_limit_gib),
         json.dumps(LENGTHS)], capture_output=True, text=True, env=environment, cwd=root)
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        return {"case": case, "crashed": (completed.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(lines[-1])


def _outcome(case, record, args):
    if "crashed" in record:
        return f"crashed: {record['crashed'][:80]}"
    if "refused" in record:
        return f"PackingError: {record['refused'][:40]}..."
    if record.get("memory_error"):
        return f"MemoryError (> {args.memory_limit_gib:g} GiB)"
    return f"{record['result']} {'sequences' if case == 'from_lengths' else 'packs/rows'}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-sequence-length", type=int, default=10**8)
    parser.add_argument("--memory-limit-gib", type=float, default=8.0,
                        help="address-space cap of each case's process (default 8)")
    parser.add_argument("--cases", nargs="+", default=CASES, help=f"default: {' '.join(CASES)}")
    parser.add_argument("--compare-with", default=None, metavar="DIR",
                        help="a directory holding another version of packing/: each case runs with it first, "
                             "then with this checkout's")
    parser.add_argument("--json", default=None, help="also write the records to this file")
    args = parser.parse_args(argv)
    roots = ([("other", os.path.abspath(args.compare_with))] if args.compare_with else []) + [("this", ROOT)]
    records = []
    print(f"L = {args.max_sequence_length:,}, lengths {LENGTHS}, address space capped at "
          f"{args.memory_limit_gib:g} GiB per case")
    print(markdown_header(["case", "code", "outcome", "seconds", "traced peak", "peak RSS"], align="lllrrr"))
    for case in args.cases:
        for label, root in roots:
            record = _run(case, root, args)
            record["code"] = label
            print(markdown_row([case, label, _outcome(case, record, args), f"{record.get('seconds', 0):.3f}",
                                _bytes(record.get("traced_peak_bytes", 0)), _bytes(record.get("peak_rss_bytes", 0))]),
                  flush=True)
            records.append(record)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"max_sequence_length": args.max_sequence_length, "lengths": LENGTHS, "records": records},
                      handle, indent=1)


if __name__ == "__main__":
    main()
