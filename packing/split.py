"""One plan for a sharded dataset: split a global plan over the shards' histograms.

A pack may only hold sequences of one shard (each shard is packed on its own, from memory,
in parallel), yet the plan should be the one of the *whole* dataset: planning every shard
on its own loses a little at every shard's edges, and the LP's certificate is about the
global histogram. So:

1. ``packing.pack`` plans the global histogram (the sum of the shards').
2. :func:`split_plan` apportions every strategy's repeat count over the shards: each shard
   takes its share (its fraction of the sequences still to place) of every strategy, as far
   as its own sequences can fill the copies, then as many further copies as it can fill.
   Only histograms are read; each shard gets a *part* (strategies it can fill completely)
   and a small *leftover* histogram (its sequences that the part does not place: the
   mismatch between the shard and its share of the plan).
3. :func:`complete_shard_plan` packs each leftover with the same algorithm and adds those
   packs to the part: an exact plan for the shard's histogram, which ``packing.assign``
   turns into concrete packs.
4. :func:`plan_shard` takes that plan as it is when it is within ``SPLIT_ACCEPT`` (0.05 %, half
   the 0.1 % target) of the shard's certified bound, which costs nothing to compute: the global
   LP's certificate duals price any shard (:func:`shard_bound`). Only a shard further off plans
   its own histogram (polished where still above) and keeps the better plan: a pack cannot cross
   shards, so the best plan of each shard is what counts. Solving every shard's own LP and MILP
   was half of `pack`'s time at S=512 (KJV, 4 shards of 40 k sequences: 24.5 s -> 2.5 s of
   planning, the gap to the global bound 0.007 % -> 0.040 %).

Measured as ``python -m bert_packed.data pack --algorithm lp`` plans (``pack_shards`` with its
options: no clock-bounded MILP, a node-bounded MILP polish where a plan is over 0.02 % above
its bound), K = 3, shards drawn at random from Wikipedia-512 (L = 512) or from its lengths
scaled to 128 (L = 128, as ``bert_packed.data.prepare.synthetic``); gap of the sharded total to the
global LP bound, and to the sum of the shards' own bounds (what no packing within shards beats):

    shards x sequences   global bound  sharded   gap       shards' bounds  gap to them
    512:  8 x 2.03 M     8,143,829     8,143,908  0.0010 %  8,143,837       0.0009 %
    512: 64 x 254 k      8,143,829     8,144,960  0.0139 %  8,144,357       0.0074 %
    512:  4 x 203 k        407,098       407,169  0.0174 %    407,138       0.0076 %
    512: 16 x 51 k         407,098       407,196  0.0241 %    407,192       0.0010 %
    512:  8 x 20 k          81,340        81,375  0.0430 %     81,375       0
    128:  8 x 250 k      1,004,692     1,004,953  0.0260 %  1,004,916       0.0037 %
    128: 40 x 50 k       1,004,692     1,005,471  0.0775 %  1,005,348       0.0122 %

(Those rows were measured when every shard also planned its own histogram; with
``SPLIT_ACCEPT`` the gaps grow towards it: 512, 8 x 2.03 M: 0.0095 %; 64 x 254 k: 0.0247 %.)
What is left is mostly what sharding itself costs (the shards' own bounds exceed the global
one: each shard's mismatch with the average histogram), growing as shards get smaller.
Pure numpy; deterministic (a function of the plan and histograms, and the seed).
"""
import numpy as np

from .histogram import Histogram, LengthCounts, PackingError, as_length_counts
from .plan import Plan


def _compact(plan, shard_counts):
    """(lengths, per-shard counts [m, k], per-strategy (member indices, multiplicities)) over the
    plan's distinct lengths, so the work is O(distinct lengths), whatever L is."""
    slots = plan.slot_length_counts()
    lengths = slots.lengths
    counts = np.zeros((len(shard_counts), lengths.size), np.int64)
    total = np.zeros(lengths.size, np.int64)
    for i, shard in enumerate(shard_counts):
        shard = as_length_counts(shard)
        where = np.searchsorted(lengths, shard.lengths)
        if np.any(where >= lengths.size) or np.any(lengths[np.minimum(where, lengths.size - 1)] != shard.lengths):
            raise PackingError(f"shard {i} has lengths the plan has no slot for; plan the sum of the shards' "
                               "histograms")
        counts[i, where] = shard.counts
        total[where] += shard.counts
    if not np.array_equal(total, slots.counts):
        raise PackingError("the plan does not cover the sum of the shards' histograms exactly; "
                           "plan that sum")
    members = []
    for s in range(plan.num_strategies):
        strategy = plan.strategy_lengths[plan.strategy_offsets[s]:plan.strategy_offsets[s + 1]]
        distinct, multiplicity = np.unique(strategy, return_counts=True)
        # Python ints: _fill visits every strategy for every shard (5,000 shards at 20 GB), and
        # NumPy calls on arrays of 1-3 items cost more than the arithmetic.
        members.append(tuple(zip(np.searchsorted(lengths, distinct).tolist(), multiplicity.tolist())))
    return lengths, counts, members


def _fill(available, members, wanted, order):
    """Copies of each strategy (at most ``wanted``) that ``available`` counts fill, in ``order``;
    ``available`` is decremented in place."""
    left, want, taken = available.tolist(), wanted.tolist(), [0] * wanted.size
    for s in order:
        take = want[s]
        if take <= 0:
            continue
        for index, multiplicity in members[s]:
            fits = left[index] // multiplicity
            if fits < take:
                take = fits
        if take > 0:
            for index, multiplicity in members[s]:
                left[index] -= take * multiplicity
            taken[s] = take
    available[:] = left
    return np.asarray(taken, np.int64)


def _canonical_ranks(plan):
    """Each strategy's position in ``Plan.from_strategies``'s order (longest first, then by
    lengths), or None when the plan repeats a strategy (from_strategies would merge those)."""
    strategies = plan.strategies
    order = sorted(range(len(strategies)), key=lambda s: (-len(strategies[s]), strategies[s]))
    if any(strategies[a] == strategies[b] for a, b in zip(order, order[1:])):
        return None
    return np.asarray(order, np.int64)


def _part(plan, order, taken):
    """The plan of the strategies with ``taken`` copies: what ``Plan.from_strategies`` gives, laid
    out from the plan's arrays (from_strategies sorts and merges tuples: 0.2 ms a shard)."""
    if order is None:
        keep = taken > 0
        return Plan.from_strategies([plan.strategies[s] for s in np.flatnonzero(keep)], taken[keep],
                                    plan.max_sequence_length) if keep.any() else _empty_plan(plan)
    chosen = order[taken[order] > 0]
    if not chosen.size:
        return _empty_plan(plan)
    sizes = plan.strategy_sizes[chosen]
    offsets = np.zeros(chosen.size + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    slots = np.repeat(plan.strategy_offsets[chosen] - offsets[:-1], sizes) + np.arange(offsets[-1])
    return Plan(offsets, plan.strategy_lengths[slots], taken[chosen], plan.max_sequence_length)


def split_plan(plan, shard_counts):
    """Apportion an exact plan of the summed histogram over shards.

    Args:
        plan: an exact :class:`Plan` of the sum of ``shard_counts``.
        shard_counts: one histogram per shard (Histogram, LengthCounts or dense counts).

    Returns:
        ``[(part, leftover), ...]`` per shard: ``part`` a :class:`Plan` (possibly with no
        strategies) whose every slot the shard fills, ``leftover`` the LengthCounts of the
        shard's sequences the part leaves out. Deterministic.
    """
    lengths, counts, members = _compact(plan, shard_counts)
    remaining = plan.repeats.copy()
    still = int(counts.sum())
    # Longest strategies (by their longest member) first: long sequences have the fewest
    # partners, so their copies are the hardest to fill from what is left.
    longest = np.array([lengths[max(index for index, _ in pairs)] for pairs in members]) if members else np.zeros(0)
    order = np.lexsort((np.arange(len(members)), -longest)).tolist()
    ranks = _canonical_ranks(plan)
    result = []
    for i in range(counts.shape[0]):
        available = counts[i].copy()
        size = int(available.sum())
        share = np.floor(remaining * (size / still)).astype(np.int64) if still else remaining * 0
        taken = _fill(available, members, share, order)
        taken += _fill(available, members, remaining - taken, order)
        remaining -= taken
        still -= size
        part = _part(plan, ranks, taken)
        nonzero = available > 0
        result.append((part, LengthCounts(lengths[nonzero], available[nonzero])))
    return result


def _empty_plan(plan):
    return Plan(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), plan.max_sequence_length)


def complete_shard_plan(part, leftover, algorithm, max_sequences_per_pack, seed=0, **options):
    """``part`` plus the packs of ``leftover`` (planned with ``algorithm``): an exact plan of the
    shard's histogram. Returns (plan, packs used for the leftover)."""
    from .algorithms import pack

    if leftover.counts.size == 0:
        return part, 0
    histogram = Histogram.from_length_counts(leftover.lengths, leftover.counts, part.max_sequence_length,
                                             name="leftover")
    extra = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed,
                 **options).plan
    strategies = part.strategies + extra.strategies
    repeats = np.concatenate([part.repeats, extra.repeats])
    return Plan.from_strategies(strategies, repeats, part.max_sequence_length), extra.num_packs


POLISH_ABOVE = 2e-4  # polish a plan more than 0.02 % above its bound (a fifth of a 0.1 % target)


def pack_polished(histogram, algorithm, max_sequences_per_pack, seed=0, polish=None, polish_above=POLISH_ABOVE,
                  **options):
    """``pack(histogram, ...)``, run again with ``options`` updated by ``polish`` when the first
    plan is more than ``polish_above`` (a fraction) above its bound; the better result is
    returned. For lp, ``polish`` is its MILP (``{"milp_node_limit": 1000, ...}``): the LP's
    rounding costs about a dozen packs whatever the size, which matters only on small shards,
    where the MILP is cheap enough and closes it; big shards skip it."""
    from .algorithms import pack

    result = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed,
                  **options)
    if polish and result.num_packs > result.lp_bound_packs * (1.0 + polish_above):
        polished = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed,
                        **{**options, **polish})
        if polished.num_packs < result.num_packs:
            return polished
    return result


SPLIT_ACCEPT = 5e-4  # a shard's part of the global plan is taken unplanned within 0.05 % of its bound


def global_duals(result):
    """``(lengths, duals)`` of an lp result's certificate (``details["lp_item_lengths"]`` and
    ``["lp_duals"]``: non-negative, non-decreasing in length, no strategy worth more than 1), or
    None for an algorithm without one. They price any histogram over the same L and depth: see
    :func:`shard_bound`."""
    details = getattr(result, "details", None) or {}
    if details.get("lp_duals") is None or details.get("lp_item_lengths") is None:
        return None
    return np.asarray(details["lp_item_lengths"], np.int64), np.asarray(details["lp_duals"], np.float64)


def shard_bound(counts, max_sequence_length, max_sequences_per_pack, duals=None):
    """A certified lower bound on the packs of one shard, without solving anything: the best of
    the simple bounds (tokens, depth, Martello-Toth L2) and, given the global LP's certificate
    duals ``(lengths, y)``, ``ceil(counts . y)``. Why the duals bound a shard: ``y`` is dual
    feasible for the LP over every strategy of L and depth (Farley's scaling), whatever the
    counts; a shard's lengths are among the global ones (a length missing from ``lengths`` takes
    the y of the next shorter one, which only lowers the bound: y is non-decreasing and a shorter
    sequence is never harder to place). Summed over the shards these bounds are at least the
    global LP bound. O(distinct lengths)."""
    from .bounds import lower_bounds
    from .lp import _ceil_bound

    counts = as_length_counts(counts)
    bound = max(lower_bounds(counts, max_sequence_length, max_sequences_per_pack).values())
    if duals is not None and counts.counts.size:
        lengths, values = duals
        index = np.searchsorted(lengths, counts.lengths, side="right") - 1
        priced = np.where(index >= 0, values[np.maximum(index, 0)], 0.0)
        bound = max(bound, _ceil_bound(float(np.dot(counts.counts.astype(np.float64), priced))))
    return int(bound)


def plan_shard(part, leftover, counts, algorithm, max_sequences_per_pack, seed=0, polish=None, duals=None,
               accept=SPLIT_ACCEPT, **options):
    """The plan a shard is packed by: ``(plan, which, bound)``. ``bound`` is the shard's certified
    lower bound (:func:`shard_bound`, raised to its own LP bound where that is solved); their sum
    over shards bounds every packing whose packs stay within shards. Each step below runs only
    when the plans before it are all more than ``accept`` (a fraction) above ``bound``, cheapest
    first:

    1. "global": its part of the global plan plus its leftover packed with ``algorithm``
       (:func:`complete_shard_plan`; the leftover is small, so this is cheap);
    2. "global" again, the leftover polished with ``polish`` (where given): about a thousand
       sequences whatever the shard's size (one partial copy of each of the global plan's
       strategies), so its MILP is far cheaper than the shard's own, and it closes most of the
       rounding's loss (about 7 packs a leftover on KJV at S=512). Skipped where saving every
       leftover pack above the leftover's lower bound would still leave the shard outside;
    3. "own": ``algorithm``'s plan of the shard's histogram ``counts`` alone;
    4. the same polished with ``polish`` (where given).

    Solving the shard's own LP (and polishing it with a MILP) costs several times the rest of the
    shard's `pack` and could gain at most ``accept``. The plan with the fewest packs is kept (ties:
    the earlier). A pack cannot cross shards, so each shard's best plan is what counts; all are
    exact plans of the shard. Deterministic where ``algorithm`` is."""
    from .algorithms import pack

    counts = as_length_counts(counts)
    length = part.max_sequence_length
    bound = shard_bound(counts, length, max_sequences_per_pack, duals)
    best, extra = complete_shard_plan(part, leftover, algorithm, max_sequences_per_pack, seed, **options)
    which = "global"

    def good(plan):  # against the bound as it stands: the shard's own LP bound raises it in step 3
        return plan.num_packs <= bound * (1.0 + accept)

    if good(best):
        return best, which, bound
    # Polishing the leftover can save at most its packs above its own lower bound: skip it where even
    # that would not bring the shard within the tolerance (a big shard far off; its own plan is next).
    reachable = best.num_packs - (extra - shard_bound(leftover, length, max_sequences_per_pack, duals))
    if polish and leftover.counts.size and reachable <= bound * (1.0 + accept):
        polished, _ = complete_shard_plan(part, leftover, algorithm, max_sequences_per_pack, seed,
                                          **{**options, **polish})
        best = polished if polished.num_packs < best.num_packs else best
        if good(best):
            return best, which, bound
    histogram = Histogram.from_length_counts(counts.lengths, counts.counts, length, name="shard")
    own = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed, **options)
    bound = max(bound, own.lp_bound_packs)
    if own.num_packs < best.num_packs:
        best, which = own.plan, "own"
    if polish and not good(best):
        polished = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed,
                        **{**options, **polish})
        bound = max(bound, polished.lp_bound_packs)
        if polished.num_packs < best.num_packs:
            best, which = polished.plan, "own"
    return best, which, bound


def pack_shards(shard_counts, max_sequence_length, algorithm="lp", max_sequences_per_pack=3, seed=0, polish=None,
                **options):
    """Plan a sharded dataset in one call, as ``python -m bert_packed.data pack`` does: the global
    result (:func:`pack_polished`), each shard's plan (:func:`plan_shard`), and the certificate.
    Returns ``(global PackingResult, [Plan per shard], summary dict)`` with ``num_packs``
    (sharded total), ``unsharded_packs``, ``sharding_gap`` (fraction), ``lp_bound_packs``,
    ``gap`` (the sharded total against the global bound), ``shards_lp_bound_packs`` (the sum of
    the shards' certified bounds, :func:`plan_shard`: no packing within shards does better), ``leftover_sequences`` and
    ``shards_on_global_plan``."""
    shard_counts = [as_length_counts(counts) for counts in shard_counts]
    lengths = np.concatenate([c.lengths for c in shard_counts])
    total = np.concatenate([c.counts for c in shard_counts])
    histogram = Histogram.from_length_counts(lengths, total, max_sequence_length, name="shards")
    result = pack_polished(histogram, algorithm, max_sequences_per_pack, seed, polish, **options)
    duals = global_duals(result)
    plans, leftover, on_global, bounds = [], 0, 0, 0
    for counts, (part, rest) in zip(shard_counts, split_plan(result.plan, shard_counts)):
        plan, which, bound = plan_shard(part, rest, counts, algorithm, max_sequences_per_pack, seed, polish,
                                        duals, **options)
        plans.append(plan)
        leftover += int(rest.counts.sum())
        on_global += which == "global"
        bounds += bound
    summary = sharding_summary(sum(p.num_packs for p in plans), result, bounds)
    summary.update({"leftover_sequences": leftover, "shards_on_global_plan": on_global})
    return result, plans, summary


def sharding_summary(num_packs, result, shards_bound=None):
    """The certificate of a sharded plan: its packs against the global LP bound, against the
    unsharded plan (``result``, the global histogram's) and, given the sum of the shards' own
    bounds, against the best any packing within shards can do."""
    bound = result.lp_bound_packs
    summary = {"num_packs": int(num_packs), "unsharded_packs": result.num_packs,
               "sharding_gap": num_packs / result.num_packs - 1.0, "lp_bound_packs": bound,
               "gap": (num_packs / bound - 1.0) if bound else None}
    if shards_bound is not None:
        summary.update({"shards_lp_bound_packs": int(shards_bound),
                        "gap_to_shards_bound": num_packs / shards_bound - 1.0 if shards_bound else None})
    return summary
