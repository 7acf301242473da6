"""The algorithm registry and :func:`pack`, the one entry point from histogram to plan.

Depth rules (``max_sequences_per_pack``, None = unlimited):
  none, sort           any depth is accepted; they never put two sequences in a row.
  spfhp, lpfhp, ffd,   any depth or unlimited.
  bfd, lp, greedy
  nnlshp, ennlshp      1, 2 or 3 only: they enumerate every strategy summing to L, and
                       depth 4 has ~L^3/144 of them (the papers stop at 3 for this reason).
"""
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import baselines, bounds, heuristics, lp, nnls
from .histogram import Histogram, PackingError, check_seed
from .plan import PackingResult, Plan, check_depth, exact_plan


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    function: Callable
    max_depth: Optional[int] = None  # largest finite depth supported (None: any, and unlimited)

    def supports(self, depth):
        """Whether this algorithm is defined for ``depth`` (an int, or None = unlimited)."""
        return self.max_depth is None or (depth is not None and depth <= self.max_depth)


def _histogram_packer(function):
    def run(histogram, depth, seed, **options):
        counts = histogram.length_counts
        strategies, repeats = function(counts, histogram.max_sequence_length, depth, **options)
        return exact_plan(strategies, repeats, counts, histogram.max_sequence_length), {}
    return run


_run_none = _histogram_packer(heuristics.pack_none)  # pack() passes depth 1 to none and sort


def _run_sort(histogram, depth, seed, batch_size=32):
    if int(batch_size) != batch_size or batch_size < 1:
        raise PackingError(f"sort needs a positive integer batch_size, got {batch_size!r}")
    plan, _ = _run_none(histogram, 1, seed)
    padding = baselines.sorted_batching_padding(histogram.length_counts, int(batch_size))
    return plan, {"num_padding_tokens": padding, "batch_size": int(batch_size)}


def _run_greedy(histogram, depth, seed, lengths=None):
    if lengths is None:
        lengths = histogram.sample_lengths(seed=seed)  # the histogram's sequences, shuffled
    offsets, lengths, repeats = baselines.pack_greedy(lengths, histogram.max_sequence_length, depth)
    return Plan(offsets, lengths, repeats, histogram.max_sequence_length), {}


def _is_number(value):
    return not isinstance(value, bool) and isinstance(value, (int, float)) and bool(np.isfinite(value))


def _check_lp_options(options):
    """lp's own options, refused with one line when out of range (lp.pack_lp trusts them)."""
    limit = options.get("time_limit")
    if limit is not None and not (_is_number(limit) and limit > 0):
        raise PackingError(f"lp's time_limit must be a positive number of seconds (or None), got {limit!r}")
    gap = options.get("target_gap", 0.0)
    if not (_is_number(gap) and gap >= 0):
        raise PackingError(f"lp's target_gap must be a non-negative fraction, got {gap!r}")
    for name in ("max_lp_items", "pricing_cells", "milp_node_limit"):
        value = options.get(name, 1)
        if name == "milp_node_limit" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise PackingError(f"lp's {name} must be a positive integer, got {value!r}")
    master = options.get("master", "highs")
    if not isinstance(master, str) or master not in lp.MASTERS:
        raise PackingError(f"lp's master must be one of {', '.join(sorted(lp.MASTERS))}, got {master!r}")


def _run_lp(histogram, depth, seed, **options):
    _check_lp_options(options)
    counts = histogram.length_counts
    strategies, repeats, details = lp.pack_lp(counts, histogram.max_sequence_length, depth, **options)
    plan = exact_plan(strategies, repeats, counts, histogram.max_sequence_length)
    return plan, details


ALGORITHMS = {
    algorithm.name: algorithm for algorithm in [
        Algorithm("none", "one sequence per pack (the padded baseline)", _run_none),
        Algorithm("sort", "sorted batching: batches of similar length, padded to their longest", _run_sort),
        Algorithm("greedy", "next-fit in stream order after a seeded shuffle (T5 / torchtune)", _run_greedy),
        Algorithm("spfhp", "shortest-pack-first histogram packing (worst fit, Krell et al.)",
                  _histogram_packer(heuristics.pack_spfhp)),
        Algorithm("lpfhp", "longest-pack-first histogram packing (best fit + count splitting, Krell et al.)",
                  _histogram_packer(heuristics.pack_lpfhp)),
        Algorithm("ffd", "first-fit decreasing, per sequence (replayed exactly on the histogram)",
                  _histogram_packer(heuristics.pack_ffd)),
        Algorithm("bfd", "best-fit decreasing, per sequence (replayed exactly on the histogram)",
                  _histogram_packer(heuristics.pack_bfd)),
        Algorithm("nnlshp", "non-negative least squares histogram packing (Krell et al.)",
                  _histogram_packer(nnls.pack_nnlshp), max_depth=nnls.MAX_NNLS_DEPTH),
        Algorithm("ennlshp", "extended NNLS with padding-token weights (Krell et al., slow)",
                  _histogram_packer(nnls.pack_ennlshp), max_depth=nnls.MAX_NNLS_DEPTH),
        Algorithm("lp", "linear program over strategies with column generation; certified bound (ours)", _run_lp),
    ]
}


def get_algorithm(name):
    """The registry entry for ``name``; PackingError listing the choices if unknown."""
    if name not in ALGORITHMS:
        raise PackingError(f"unknown packing algorithm {name!r}; choose one of: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def check_algorithm_depth(name, max_sequences_per_pack):
    """Validate a (algorithm, depth) pair before any work; returns the depth (int or None)."""
    algorithm = get_algorithm(name)
    depth = check_depth(max_sequences_per_pack)
    if not algorithm.supports(depth):
        asked = "unlimited depth" if depth is None else f"max_sequences_per_pack={depth}"
        raise PackingError(
            f"{name} is defined for max_sequences_per_pack <= {algorithm.max_depth} only (asked: {asked}); "
            "use lp, lpfhp or spfhp for deeper packs")
    return depth


def pack(histogram, algorithm="lpfhp", max_sequences_per_pack=3, seed=0, **options):
    """Plan how to pack a histogram.

    Args:
        histogram: a :class:`Histogram` (or anything ``Histogram.load`` accepts).
        algorithm: a name in ``ALGORITHMS``.
        max_sequences_per_pack: the depth limit; None = unlimited (not for nnlshp/ennlshp).
        seed: only ``greedy`` is random (its shuffle); every algorithm is deterministic
            for a given seed.
        options: algorithm-specific: ``sort``: batch_size (32); ``lp``: time_limit,
            milp_time_limit, milp_node_limit, max_repair_rounds; ``nnlshp``: short_length, short_weight;
            ``greedy``: lengths (pack this stream as given instead of a shuffled histogram).

    Returns:
        PackingResult with an exact plan (every sequence in exactly one slot),
        ``lp_bound_packs``: a certified lower bound on the packs of *any* plan with this
        depth, the best of ceil(tokens / L), ceil(sequences / depth), Martello-Toth L2 and
        (``lp`` only) the LP bound, each in ``details["bounds"]``; ``gap`` = packs / bound - 1;
        and timing in ``seconds`` (the algorithm and its bounds, not loading).
    """
    if not isinstance(histogram, Histogram):
        histogram = Histogram.load(histogram)
    depth = check_algorithm_depth(algorithm, max_sequences_per_pack)
    seed = check_seed(seed)
    if algorithm in ("none", "sort"):
        depth = 1  # they never share a row, whatever the limit
    entry = ALGORITHMS[algorithm]
    started = time.perf_counter()
    try:
        plan, details = entry.function(histogram, depth, seed, **options)
    except TypeError as exc:
        if "unexpected keyword" in str(exc):
            raise PackingError(f"{algorithm} does not take the option(s) {sorted(options)}") from None
        raise
    details = dict(details)
    padding = details.pop("num_padding_tokens", None)
    components = bounds.lower_bounds(histogram.length_counts, histogram.max_sequence_length, depth)
    lp_bound = details.pop("lp_bound_packs", None)
    if lp_bound is not None:
        components["lp"] = int(lp_bound)
    details["bounds"] = components
    seconds = time.perf_counter() - started
    return PackingResult(algorithm, histogram, depth, plan, seconds, lp_bound_packs=max(components.values()),
                         num_padding_tokens=padding, details=details)


def residual(histogram, plan):
    """np.int64 [L]: counts minus the plan's slots (zero everywhere for an exact plan).
    Dense, O(L)."""
    return np.asarray(histogram.counts) - plan.slot_counts()
