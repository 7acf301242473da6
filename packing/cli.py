"""``python -m packing report|bench|plot``: the packing library's command line.

report  a table like Table 1 of Krell et al. (or ``--json``: one object per row with the
        field names of PackingResult.to_dict) for algorithms x depths on a histogram.
bench   timing of every algorithm on a histogram and of the assignment of a full-size
        dataset (in a subprocess, so its peak memory is measured on its own).
plot    PNGs of the length histogram, a plan's padding per pack and the NNLS residual.

User mistakes print one line ``error: ...`` to stderr and exit with status 2.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from .algorithms import ALGORITHMS, check_algorithm_depth, pack
from .histogram import Histogram, PackingError
from .entry import ArgumentParser, run_cli

# Rows of the default report: the paper's Table 1 (plus LPFHP's Table 5 and ours).
DEFAULT_ROWS = [("none", 1), ("sort", 1), ("greedy", None)] + \
    [("spfhp", d) for d in (2, 3, 4, 8, None)] + [("lpfhp", d) for d in (2, 3, 4, 8, None)] + \
    [("nnlshp", 3)] + [("lp", d) for d in (2, 3, 4, None)]
UNLIMITED_NAMES = ("max", "unlimited", "none", "inf")


def _depth(text):
    if text.lower() in UNLIMITED_NAMES:
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"max sequences per pack must be a positive integer or 'max', got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"max sequences per pack must be at least 1, got {value}")
    return value


def _depth_label(depth):
    return "max" if depth is None else str(depth)


def _load(args):
    return Histogram.load(args.histogram, max_sequence_length=args.max_sequence_length)


def _rows(args):
    """(algorithm, depth) pairs to run, validated up front so a bad pair fails before work."""
    if args.algorithm is None and args.max_sequences_per_pack is None:
        return DEFAULT_ROWS
    algorithms = args.algorithm or [name for name in ALGORITHMS if name != "ennlshp"]
    depths = args.max_sequences_per_pack or [3]
    rows = []
    for name in algorithms:
        for depth in ([1] if name in ("none", "sort") else depths):
            if args.algorithm is None and not ALGORITHMS[name].supports(depth):
                continue  # not asked for by name: skip the depths it does not support
            check_algorithm_depth(name, depth)
            if (name, depth) not in rows:
                rows.append((name, depth))
    return rows


def _lp_options(args):
    """lp's options from the command line (--time-limit bounds every lp call, the extra
    --bound ones too)."""
    limit = getattr(args, "time_limit", None)
    return {} if limit is None else {"time_limit": limit}


def _run_rows(histogram, rows, args, progress=True):
    results = []
    for name, depth in rows:
        if progress and sys.stderr.isatty():
            print(f"  {name} (depth {_depth_label(depth)}) ...", file=sys.stderr, flush=True)
        options = {"batch_size": args.batch_size} if name == "sort" else {}
        if name == "lp":
            options.update(_lp_options(args))
        results.append(pack(histogram, name, depth, seed=args.seed, **options))
    # The LP bound is a property of (histogram, depth): share it with every row of that depth.
    # An lp row that skipped its LP (its heuristic plan was within one pack of the simple
    # bounds) carries only the simple bounds: it certifies nothing beyond them.
    bounds = {result.max_sequences_per_pack: result.lp_bound_packs for result in results
              if result.algorithm == "lp" and not result.details.get("lp_skipped")}
    if args.bound:
        for depth in {result.max_sequences_per_pack for result in results} - set(bounds):
            if depth != 1:
                # target_gap=0: run the LP even where the heuristic plan is one pack from the
                # simple bounds, so the bound printed is the LP's own.
                bounds[depth] = pack(histogram, "lp", depth, target_gap=0, **_lp_options(args)).lp_bound_packs
    rows = []
    for result in results:
        shared = bounds.get(result.max_sequences_per_pack)
        if shared is not None and shared > result.lp_bound_packs:
            result.lp_bound_packs = shared  # its gap follows
        row = result.to_dict()
        skipped = result.details.get("lp_skipped") if result.algorithm == "lp" else None
        if skipped and shared is None:
            row["lp_skipped"] = skipped  # the bound column holds the simple bounds only
        rows.append(row)
    return rows


def format_table(histogram, rows):
    """The report as text: data statistics, then one line per (algorithm, depth)."""
    stats = histogram.statistics()
    lines = [
        f"histogram {stats['histogram']}: {stats['num_sequences']:,} sequences, {stats['num_tokens']:,} tokens, "
        f"L = {stats['max_sequence_length']}, padding without packing {stats['padding_fraction']:.2%}, "
        f"theoretical speed-up {stats['theoretical_speedup']:.4f}, ceil(tokens / L) = {stats['min_num_packs']:,}",
        "",
    ]
    header = ["algorithm", "depth", "packs", "tokens", "padding", "efficiency %", "packing factor", "max depth",
              "strategies", "seconds", "LP bound", "over bound %"]
    table = []
    for row in rows:
        bound = row["lp_bound_packs"]
        table.append([
            row["algorithm"], _depth_label(row["max_sequences_per_pack"]), f"{row['num_packs']:,}",
            f"{row['num_tokens']:,}", f"{row['num_padding_tokens']:,}", f"{100 * row['efficiency']:.3f}",
            f"{row['packing_factor']:.3f}", str(row["max_depth_used"]), str(row["num_strategies_used"]),
            f"{row['seconds']:.3f}", "-" if bound is None else f"{bound:,}",
            "-" if row["gap"] is None else f"{100 * row['gap']:.4f}",
        ])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *table)]
    for cells in [header] + table:
        lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(cells, widths))))
    lines.append("")
    lines.append("depth = max sequences per pack (max = unlimited); tokens = real tokens; efficiency = tokens / "
                 "(tokens + padding); LP bound = certified lower bound on the packs of any plan at that depth: the "
                 "best of ceil(tokens / L), ceil(sequences / depth), Martello-Toth L2 and lp's LP bound (a plan at "
                 "the bound is optimal; above it, the optimum lies between the two).")
    for row in rows:
        if row.get("lp_skipped"):
            lines.append(f"lp at depth {_depth_label(row['max_sequences_per_pack'])} skipped its LP ({row['lp_skipped']}): "
                         "its LP bound column is the simple bounds only, so over bound % may overstate the gap; "
                         "--bound runs the LP and prints its bound.")
    return "\n".join(lines)


def command_report(args):
    histogram = _load(args)
    rows = _rows(args)
    rows_out = _run_rows(histogram, rows, args)
    if args.json:
        print(json.dumps(rows_out, indent=1))
    else:
        print(format_table(histogram, rows_out))


# -- bench ---------------------------------------------------------------------------------

_ASSIGN_SCRIPT = r"""
import json, re, sys, time, tracemalloc
import numpy as np

def peak_rss_kib():
    # VmHWM is this process's own peak; getrusage's ru_maxrss would carry the parent's
    # peak across fork + exec on Linux.
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

from packing import Histogram, assign, pack
name, num_sequences, algorithm, depth = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
histogram = Histogram.load(name)
lengths = histogram.sample_lengths(None if num_sequences == "all" else int(num_sequences), seed=0)
plan = pack(Histogram.from_lengths(lengths, histogram.max_sequence_length), algorithm,
            None if depth == "max" else int(depth)).plan
rss_before = peak_rss_kib()
tracemalloc.start()
started = time.perf_counter()
packs = assign(plan, lengths, seed=0)
seconds = time.perf_counter() - started
_, traced_peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
rss_peak = peak_rss_kib()
print(json.dumps({"num_sequences": int(lengths.size), "num_packs": packs.num_packs, "seconds": seconds,
                  "peak_rss_bytes": rss_peak * 1024, "rss_before_bytes": rss_before * 1024,
                  "assign_traced_peak_bytes": traced_peak}))
"""


def _time(histogram, name, depth, repeats, seed):
    times, result = [], None
    for _ in range(repeats):
        result = pack(histogram, name, depth, seed=seed)
        times.append(result.seconds)
    return result, float(np.median(times)), float(min(times))


def _stages(command, total):
    """A progress bar over a command's stages on stderr, shown on a terminal only (as the
    project's other bars): ``bench`` and ``plot`` take half a minute at full size."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"packing {command}", unit=" stage", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


def command_bench(args):
    histogram = _load(args)
    plan_rows = [("spfhp", 3), ("spfhp", None), ("lpfhp", 3), ("lpfhp", None), ("ffd", 3), ("bfd", 3)]
    if not args.quick:
        plan_rows += [("greedy", None), ("nnlshp", 3)]
    plan_rows += [("lp", 2), ("lp", 3), ("lp", 4), ("lp", None)]
    with _stages("bench", len(plan_rows) + 1) as bar:
        records, assignment, ratio = _bench(args, histogram, plan_rows, bar)
    _print_bench(args, histogram, records, assignment, ratio)


def _bench(args, histogram, plan_rows, bar):
    """(plan records, the assignment's record, nnlshp / lp time at depth 3 or None)."""
    records = []
    for name, depth in plan_rows:
        bar.set_postfix_str(f"timing {name} (depth {_depth_label(depth)})")
        fast = name in ("spfhp", "lpfhp", "ffd", "bfd")
        result, median, best = _time(histogram, name, depth, args.repeats if fast else 1, args.seed)
        records.append({"kind": "plan", "algorithm": name, "max_sequences_per_pack": depth,
                        "num_packs": result.num_packs, "efficiency": result.efficiency,
                        "lp_bound_packs": result.lp_bound_packs, "seconds_median": median, "seconds_min": best,
                        "repeats": args.repeats if fast else 1})
        bar.update()
    by_key = {(r["algorithm"], r["max_sequences_per_pack"]): r for r in records}
    ratio = None
    if ("nnlshp", 3) in by_key:
        ratio = by_key[("nnlshp", 3)]["seconds_median"] / by_key[("lp", 3)]["seconds_median"]
    bar.set_postfix_str("timing the assignment in a subprocess")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    completed = subprocess.run(
        [sys.executable, "-c", _ASSIGN_SCRIPT, args.histogram, "1000000" if args.quick else args.num_sequences,
         "lpfhp", "3"], capture_output=True, text=True, env=environment)
    if completed.returncode != 0:
        raise RuntimeError(f"assignment benchmark failed: {completed.stderr.strip().splitlines()[-1:]}")
    assignment = json.loads(completed.stdout.strip().splitlines()[-1])
    assignment["kind"] = "assign"
    records.append(assignment)
    bar.update()
    return records, assignment, ratio


def _print_bench(args, histogram, records, assignment, ratio):
    if args.json:
        print(json.dumps({"histogram": histogram.name, "plans": records[:-1], "assign": assignment,
                          "nnlshp_over_lp_depth3": ratio}, indent=1))
        return
    print(f"histogram {histogram.name}: {histogram.num_sequences:,} sequences, L = {histogram.max_sequence_length}")
    print(f"{'algorithm':10} {'depth':>5} {'packs':>12} {'efficiency %':>12} {'median s':>10} {'min s':>10} {'runs':>5}")
    for r in records[:-1]:
        print(f"{r['algorithm']:10} {_depth_label(r['max_sequences_per_pack']):>5} {r['num_packs']:>12,} "
              f"{100 * r['efficiency']:>12.3f} {r['seconds_median']:>10.4f} {r['seconds_min']:>10.4f} "
              f"{r['repeats']:>5}")
    if ratio is not None:
        print(f"nnlshp / lp time at depth 3: {ratio:.1f}x")
    print(f"assign: {assignment['num_sequences']:,} sequences -> {assignment['num_packs']:,} packs (lpfhp, depth 3) "
          f"in {assignment['seconds']:.2f} s; peak RSS of the process {assignment['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"(before assign {assignment['rss_before_bytes'] / 2**30:.2f} GiB), numpy peak during assign "
          f"{assignment['assign_traced_peak_bytes'] / 2**30:.2f} GiB")


# -- plot ----------------------------------------------------------------------------------

def _save(figure, path):
    """Atomic write: a half-written PNG never replaces a good one."""
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".png", dir=os.path.dirname(path) or ".")
    os.close(handle)
    try:
        figure.savefig(temporary, dpi=120)
        os.replace(temporary, path)
    except BaseException:  # a failed or interrupted write leaves no temporary file behind
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def command_plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import nnls

    histogram = _load(args)
    depth = args.max_sequences_per_pack[0] if args.max_sequences_per_pack else 3
    algorithm = args.algorithm[0] if args.algorithm else "lp"
    check_algorithm_depth(algorithm, depth)
    os.makedirs(args.output, exist_ok=True)
    residual = depth is not None and depth <= nnls.MAX_NNLS_DEPTH and nnls.fits_dense(
        "nnlshp", histogram.max_sequence_length, depth)
    with _stages("plot", 3 + residual) as bar:
        written = _plot(args, histogram, algorithm, depth, residual, plt, bar)
    for path in written:
        print(path)


def _plot(args, histogram, algorithm, depth, residual, plt, bar):
    """Write the PNGs (``bar`` counts them); returns their paths."""
    from . import nnls

    written = []
    bar.set_postfix_str("histogram")

    figure, axis = plt.subplots(figsize=(8, 4))
    axis.bar(histogram.distinct_lengths, histogram.distinct_counts, width=1.0)  # the lengths that occur
    axis.set_xlim(0.5, histogram.max_sequence_length + 0.5)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length")
    axis.set_ylabel("sequences (log)")
    axis.set_title(f"{histogram.name}: {histogram.num_sequences:,} sequences, "
                   f"{histogram.padding_fraction:.1%} padding at L = {histogram.max_sequence_length}")
    figure.tight_layout()
    path = os.path.join(args.output, "histogram.png")
    _save(figure, path)
    written.append(path)
    plt.close(figure)
    bar.update()

    # Padding per pack of the chosen plan: what is left of L in each pack.
    bar.set_postfix_str(f"{algorithm} plan at depth {_depth_label(depth)}")
    result = pack(histogram, algorithm, depth, seed=args.seed)
    bar.update()
    bar.set_postfix_str("padding per pack")
    plan = result.plan
    sums = np.add.reduceat(plan.strategy_lengths, plan.strategy_offsets[:-1])
    padding, slot = np.unique(histogram.max_sequence_length - sums, return_inverse=True)  # no per-L array
    unused = np.bincount(slot.ravel(), weights=plan.repeats, minlength=padding.size)
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.bar(padding, unused, width=1.0)
    axis.set_xlim(-0.5, histogram.max_sequence_length - 0.5)
    axis.set_yscale("symlog")
    axis.set_xlabel("padding tokens in the pack")
    axis.set_ylabel("packs")
    axis.set_title(f"{algorithm}, depth {_depth_label(depth)}: {result.num_packs:,} packs, "
                   f"efficiency {result.efficiency:.3%}")
    figure.tight_layout()
    path = os.path.join(args.output, f"padding_{algorithm}_{_depth_label(depth)}.png")
    _save(figure, path)
    written.append(path)
    plt.close(figure)
    bar.update()

    # The papers' Figures 7/8: residual b - A round(x) of NNLS, unweighted and weighted
    # (not where nnlshp itself refuses the size: its dense matrix would not fit).
    if residual:
        bar.set_postfix_str("NNLS residuals")
        figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for axis, weight, title in ((axes[0], 1.0, "unweighted"), (axes[1], 0.09, "weight 0.09 for lengths <= 8")):
            residual = nnls.nnls_residual(histogram.length_counts, histogram.max_sequence_length, depth,
                                          short_weight=weight)
            axis.bar(histogram.lengths, residual, width=1.0)
            axis.set_yscale("symlog")
            axis.set_xlabel("sequence length")
            axis.set_title(f"NNLS residual, depth {depth}, {title}")
        axes[0].set_ylabel("left out (+) / padding slots (-)")
        figure.tight_layout()
        path = os.path.join(args.output, f"residual_nnlshp_{depth}.png")
        _save(figure, path)
        written.append(path)
        plt.close(figure)
        bar.update()
    return written


def build_parser():
    parser = ArgumentParser(prog="python -m packing", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    def common(sub):
        sub.add_argument("--histogram", default="wikipedia-512",
                         help="shipped name (wikipedia-512) or a JSON {max_sequence_length, counts} / .npy file")
        sub.add_argument("--max-sequence-length", type=int, default=None,
                         help="L; must match the histogram (checked)")
        sub.add_argument("--seed", type=int, default=0, help="seed of the greedy shuffle (default 0)")

    report = commands.add_parser("report", help="table of algorithms x depths (like the paper's Table 1)")
    common(report)
    report.add_argument("--algorithm", nargs="+", default=None, metavar="A",
                        help=f"one or more of: {', '.join(ALGORITHMS)} (default: a Table 1 like set)")
    report.add_argument("--max-sequences-per-pack", nargs="+", type=_depth, default=None, metavar="D",
                        help="one or more depths; 'max' = unlimited (default 3 when --algorithm is given)")
    report.add_argument("--batch-size", type=int, default=32, help="batch size of 'sort' (default 32)")
    report.add_argument("--bound", action="store_true", help="compute the LP bound for every depth in the table")
    report.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="wall-time limit of each lp row (the best plan and bound so far come back)")
    report.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
    report.set_defaults(handler=command_report)

    bench = commands.add_parser("bench", help="timing of each algorithm and of the assignment at scale")
    common(bench)
    bench.add_argument("--repeats", type=int, default=5, help="runs of the fast algorithms (median reported)")
    bench.add_argument("--num-sequences", default="all",
                       help="sequences drawn for the assignment benchmark ('all' = the histogram itself)")
    bench.add_argument("--quick", action="store_true", help="skip greedy and nnlshp; assign 1M sequences")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.set_defaults(handler=command_bench)

    plot = commands.add_parser("plot", help="PNGs of the histogram, a plan's padding and the NNLS residual")
    common(plot)
    plot.add_argument("--output", required=True, help="directory for the PNGs")
    plot.add_argument("--algorithm", nargs=1, default=None, metavar="A", help="plan to plot (default lp)")
    plot.add_argument("--max-sequences-per-pack", nargs=1, type=_depth, default=None, metavar="D",
                      help="its depth (default 3)")
    plot.set_defaults(handler=command_plot)
    return parser


def main(argv=None):
    """Run the command line; returns the exit status (2 for every user mistake, with one line
    ``error: ...`` on stderr: bad input, unwritable output, Ctrl-C)."""
    return run_cli(lambda: _run(argv), interrupted="error: interrupted; nothing was written that is not complete",
                   interrupted_status=2)


# The size flags' maximums and why (absurd values ran for hours or ran out of memory).
MAX_SEQUENCE_LENGTH = (65536, "one head's dense attention scores are 16 GiB at 65536 tokens; BERT checkpoints hold "
                              "at most 8192 positions")
MAX_BATCH_SIZE = (2**20, "16 times the largest published BERT batch (65536 sequences)")
MAX_REPEATS = (1000, "a median of more runs is no more accurate, and greedy takes seconds a run")
MAX_TIME_LIMIT = (7 * 86400, "a week; lp finds its plan in seconds to minutes")
MAX_NUM_SEQUENCES = (2**31, "the assignment keeps several int64 arrays per sequence: tens of GiB beyond that")


def _check_maximums(args) -> None:
    for flag, name, (limit, why) in (("--max-sequence-length", "max_sequence_length", MAX_SEQUENCE_LENGTH),
                                     ("--batch-size", "batch_size", MAX_BATCH_SIZE),
                                     ("--repeats", "repeats", MAX_REPEATS),
                                     ("--time-limit", "time_limit", MAX_TIME_LIMIT)):
        value = getattr(args, name, None)
        if value is not None and value > limit:
            raise PackingError(f"{flag} must be <= {limit} ({why}), got {value}")
    count = getattr(args, "num_sequences", "all")
    if count != "all":
        if not str(count).isdigit() or int(count) < 1:
            raise PackingError(f"--num-sequences must be 'all' or a positive integer, got {str(count)[:40]!r}")
        if int(count) > MAX_NUM_SEQUENCES[0]:
            raise PackingError(f"--num-sequences must be <= {MAX_NUM_SEQUENCES[0]} ({MAX_NUM_SEQUENCES[1]}), got "
                               f"{count}")


def _run(argv) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "batch_size", 1) < 1:
        raise PackingError(f"--batch-size must be at least 1, got {args.batch_size}")
    if getattr(args, "repeats", 1) < 1:
        raise PackingError(f"--repeats must be at least 1, got {args.repeats}")
    if args.seed < 0:
        raise PackingError(f"--seed must be a non-negative integer, got {args.seed}")
    if getattr(args, "time_limit", None) is not None and not 0 < args.time_limit < np.inf:
        raise PackingError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    if args.max_sequence_length is not None and args.max_sequence_length < 1:
        raise PackingError(f"--max-sequence-length must be a positive integer, got {args.max_sequence_length}")
    _check_maximums(args)
    try:
        args.handler(args)
    except OSError as exc:  # unwritable output, a directory that is a file, a full disk
        where = f" {exc.filename}" if exc.filename else ""
        raise PackingError(f"cannot write{where}: {exc.strerror or exc}") from None
