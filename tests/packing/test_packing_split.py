"""packing.split: one global plan apportioned over shards (numpy only), and its certificate."""
import numpy as np
import pytest

import packing
from packing.split import complete_shard_plan, pack_shards, plan_shard, split_plan

# As `bert_packed.data pack` runs lp: no clock-bounded MILP; small shards polished by a MILP
# bounded by nodes (deterministic).
POLISH = {"milp_node_limit": 1000, "max_milp_sequences": 1_000_000}
TOOL = {"max_milp_sequences": 0, "polish": POLISH}


def wikipedia_shards(num_shards, scale, seed=0):
    """Shards drawn at random from the Wikipedia-512 histogram scaled by ``scale``: dense [m, 512]."""
    counts = (np.asarray(packing.Histogram.load("wikipedia-512").counts) * scale).astype(np.int64)
    rng = np.random.default_rng(seed)
    shards = np.zeros((num_shards, counts.size), np.int64)
    for j, count in enumerate(counts):
        shards[:, j] = rng.multinomial(count, np.ones(num_shards) / num_shards)
    return shards


def test_split_covers_every_shard_exactly_and_uses_the_plan_at_most_once():
    shards = wikipedia_shards(5, 0.002, seed=1)
    result = packing.pack(packing.Histogram(shards.sum(axis=0)), algorithm="lpfhp", max_sequences_per_pack=3)
    parts = split_plan(result.plan, list(shards))
    used = {}
    for counts, (part, leftover) in zip(shards, parts):
        dense = part.slot_counts() if part.num_strategies else np.zeros(512, np.int64)
        dense[leftover.lengths - 1] += leftover.counts
        np.testing.assert_array_equal(dense, counts)  # part + leftover = the shard
        for strategy, repeat in zip(part.strategies, part.repeats.tolist()):
            used[strategy] = used.get(strategy, 0) + repeat
        plan, which, bound = plan_shard(part, leftover, counts, "lpfhp", 3)
        assert bound <= plan.num_packs
        plan.validate(counts, 3)
        assert which in ("global", "own")
    available = dict(zip(result.plan.strategies, result.plan.repeats.tolist()))
    assert all(repeat <= available[strategy] for strategy, repeat in used.items())
    # Most sequences follow the global plan; only the mismatch is left over.
    assert sum(int(leftover.counts.sum()) for _, leftover in parts) < 0.2 * shards.sum()


def _same_plan(a, b):
    return all(np.array_equal(getattr(a, name), getattr(b, name)) for name in
               ("strategy_offsets", "strategy_lengths", "repeats")) and a.max_sequence_length == b.max_sequence_length


@pytest.mark.parametrize("layout", ["canonical", "unsorted", "repeated"])
def test_each_part_is_the_plan_from_strategies_builds(layout):
    """A part is laid out from the global plan's arrays (not re-sorted and merged per shard,
    which took most of the split's time at 5,000 shards): it must be the plan that
    Plan.from_strategies makes of the same strategies and copies, also for a plan whose
    strategies are out of that order or repeated (built directly, as an algorithm may)."""
    shards = wikipedia_shards(6, 0.002, seed=3)
    plan = packing.pack(packing.Histogram(shards.sum(axis=0)), algorithm="lpfhp", max_sequences_per_pack=3).plan
    strategies, repeats = plan.strategies, plan.repeats.tolist()
    if layout != "canonical":
        strategies, repeats = strategies[::-1], repeats[::-1]  # shortest packs first
    if layout == "repeated":  # the first strategy's copies in two entries
        strategies, repeats = [strategies[0]] + strategies, [repeats[0] - repeats[0] // 2, repeats[0] // 2] + repeats[1:]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in strategies])])
    given = packing.Plan(offsets, [n for x in strategies for n in x], repeats, 512)
    for part, leftover in split_plan(given, list(shards)):
        expected = packing.Plan.from_strategies(part.strategies, part.repeats, 512)
        assert _same_plan(part, expected) and part.num_strategies > 0
    canonical = split_plan(packing.Plan.from_strategies(strategies, repeats, 512), list(shards))
    if layout == "canonical":  # the same plan, so the same parts
        assert all(_same_plan(a, b) for (a, _), (b, _) in zip(split_plan(given, list(shards)), canonical))


def test_one_shard_is_the_global_plan_itself():
    counts = wikipedia_shards(1, 0.001)[0]
    result = packing.pack(packing.Histogram(counts), algorithm="lp", max_sequences_per_pack=3, max_milp_sequences=0)
    [(part, leftover)] = split_plan(result.plan, [counts])
    assert leftover.counts.size == 0 and part.num_packs == result.num_packs
    plan, _ = complete_shard_plan(part, leftover, "lp", 3)
    assert plan.num_packs == result.num_packs


def test_sharded_lp_stays_within_a_tenth_of_a_percent_of_the_global_bound():
    """4 shards of about 200 k sequences each drawn from Wikipedia-512 (K = 3)."""
    shards = wikipedia_shards(4, 0.05, seed=2)
    result, plans, summary = pack_shards(list(shards), 512, "lp", 3, **TOOL)
    for counts, plan in zip(shards, plans):
        plan.validate(counts, 3)
    assert summary["num_packs"] == sum(plan.num_packs for plan in plans)
    assert summary["lp_bound_packs"] == result.lp_bound_packs <= summary["num_packs"]
    assert summary["gap"] < 1e-3 and summary["sharding_gap"] < 1e-3, summary
    assert result.lp_bound_packs <= summary["shards_lp_bound_packs"] <= summary["num_packs"]


def test_split_is_deterministic_and_refuses_a_plan_of_other_data():
    shards = wikipedia_shards(3, 0.001, seed=3)
    first = pack_shards(list(shards), 512, "lpfhp", 3)
    second = pack_shards(list(shards), 512, "lpfhp", 3)
    assert [p.strategies for p in first[1]] == [p.strategies for p in second[1]]
    assert [p.repeats.tolist() for p in first[1]] == [p.repeats.tolist() for p in second[1]]
    other = shards.copy()
    other[0, 100] += 1
    with pytest.raises(packing.PackingError, match="sum of the shards"):
        split_plan(first[0].plan, list(other))


def test_lp_milp_node_limit_is_deterministic_and_validated():
    """milp_node_limit: the MILP bounded by nodes, not by a clock (what sharded `pack` uses so
    its plans are the same under any load); on a shard-sized histogram it closes the rounding gap."""
    counts = wikipedia_shards(1, 0.0005, seed=5)[0]  # about 8 k sequences
    histogram = packing.Histogram(counts)
    runs = [packing.pack(histogram, algorithm="lp", max_sequences_per_pack=3, milp_time_limit=None, **POLISH)
            for _ in range(2)]
    assert runs[0].plan.strategies == runs[1].plan.strategies
    assert runs[0].plan.repeats.tolist() == runs[1].plan.repeats.tolist()
    rounded = packing.pack(histogram, algorithm="lp", max_sequences_per_pack=3, max_milp_sequences=0)
    assert runs[0].num_packs <= rounded.num_packs and runs[0].lp_bound_packs == rounded.lp_bound_packs
    for bad in (0, 2.5, "10"):
        with pytest.raises(packing.PackingError, match="milp_node_limit must be a positive integer"):
            packing.pack(histogram, algorithm="lp", max_sequences_per_pack=3, milp_node_limit=bad)


def test_the_global_lp_duals_bound_every_shard_without_a_solve():
    """shard_bound: the global LP's certificate duals price each shard; never above the shard's
    own LP bound, and the shards' bounds add up to at least the global one."""
    from packing.split import global_duals, shard_bound

    shards = wikipedia_shards(4, 0.005, seed=9)
    result = packing.pack(packing.Histogram(shards.sum(axis=0)), algorithm="lp", max_sequences_per_pack=3,
                          max_milp_sequences=0)
    duals = global_duals(result)
    assert duals is not None and global_duals(packing.pack(packing.Histogram(shards[0]), algorithm="lpfhp")) is None
    bounds = [shard_bound(counts, 512, 3, duals) for counts in shards]
    for counts, bound in zip(shards, bounds):
        own = packing.pack(packing.Histogram(counts), algorithm="lp", max_sequences_per_pack=3, max_milp_sequences=0)
        assert shard_bound(counts, 512, 3) <= bound <= own.lp_bound_packs <= own.num_packs
    assert sum(bounds) >= result.lp_bound_packs


@pytest.mark.slow
def test_a_shard_takes_its_split_unplanned_only_within_the_tolerance():
    shards = wikipedia_shards(3, 0.002, seed=4)
    result = packing.pack(packing.Histogram(shards.sum(axis=0)), algorithm="lp", max_sequences_per_pack=3,
                          max_milp_sequences=0)
    from packing.split import global_duals, shard_bound

    duals = global_duals(result)
    for counts, (part, leftover) in zip(shards, split_plan(result.plan, list(shards))):
        split, _ = complete_shard_plan(part, leftover, "lp", 3, max_milp_sequences=0)
        bound = shard_bound(counts, 512, 3, duals)
        loose = plan_shard(part, leftover, counts, "lp", 3, duals=duals, accept=1.0, max_milp_sequences=0)
        assert loose[1] == "global" and loose[2] == bound and loose[0].num_packs == split.num_packs
        strict = plan_shard(part, leftover, counts, "lp", 3, duals=duals, accept=0.0, max_milp_sequences=0)
        strict[0].validate(counts, 3)
        assert strict[0].num_packs <= split.num_packs and bound <= strict[2] <= strict[0].num_packs
        if split.num_packs <= bound:  # optimal already: nothing is planned again
            assert strict[1] == "global"
        else:  # planned again: the own plan is kept only when it has fewer packs
            assert strict[1] == "global" or strict[0].num_packs < split.num_packs


@pytest.mark.slow
def test_a_shard_is_planned_cheapest_first_and_stops_at_the_first_plan_within_the_tolerance(monkeypatch):
    """With ``polish`` (as `pack` runs lp): the split with its leftover rounded, then with the
    leftover polished by the MILP (never more packs, fewer over these shards), then the shard's
    own plan, then that polished; each step only while every plan so far is outside ``accept``,
    and the leftover's polish only where it could bring the shard within."""
    import packing.algorithms
    from packing.split import global_duals, shard_bound

    shards = wikipedia_shards(4, 0.002, seed=11)
    result = packing.pack(packing.Histogram(shards.sum(axis=0)), algorithm="lp", max_sequences_per_pack=3,
                          max_milp_sequences=0)
    duals = global_duals(result)
    real_pack = packing.algorithms.pack
    calls = []

    def counting_pack(histogram, **kwargs):
        calls.append((histogram.name, "milp_node_limit" in kwargs))
        return real_pack(histogram, **kwargs)

    def planned(part, leftover, counts, accept):
        calls.clear()
        monkeypatch.setattr(packing.algorithms, "pack", counting_pack)
        try:
            return plan_shard(part, leftover, counts, "lp", 3, polish=POLISH, duals=duals, accept=accept,
                              max_milp_sequences=0)
        finally:
            monkeypatch.setattr(packing.algorithms, "pack", real_pack)

    plain_total = polished_total = skipped = 0
    for counts, (part, leftover) in zip(shards, split_plan(result.plan, list(shards))):
        assert leftover.counts.size
        bound = shard_bound(counts, 512, 3, duals)
        plain, extra = complete_shard_plan(part, leftover, "lp", 3, max_milp_sequences=0)
        polished, _ = complete_shard_plan(part, leftover, "lp", 3, **{"max_milp_sequences": 0, **POLISH})
        polished.validate(counts, 3)
        # what polishing the leftover could reach at best (its packs down to its own lower bound)
        reachable = plain.num_packs - (extra - shard_bound(leftover, 512, 3, duals))
        assert reachable <= polished.num_packs
        assert bound <= polished.num_packs <= plain.num_packs
        plain_total, polished_total = plain_total + plain.num_packs, polished_total + polished.num_packs

        taken = planned(part, leftover, counts, accept=1.0)  # step 1 is within: nothing else runs
        assert taken[1] == "global" and taken[0].num_packs == plain.num_packs and calls == [("leftover", False)]
        if polished.num_packs < plain.num_packs:  # step 2 is within, step 1 not: steps 3-4 do not run
            taken = planned(part, leftover, counts, accept=(polished.num_packs + 0.5) / bound - 1.0)
            assert taken[1] == "global" and taken[0].num_packs == polished.num_packs
            assert calls == [("leftover", False), ("leftover", True)]
        strict = planned(part, leftover, counts, accept=0.0)
        strict[0].validate(counts, 3)
        assert strict[0].num_packs <= polished.num_packs and bound <= strict[2] <= strict[0].num_packs
        if polished.num_packs > bound:  # nothing within: every step ran, in order, but the leftover's
            # polish where it could not reach the bound
            steps = [("leftover", False)] + [("leftover", True)] * (reachable <= bound) + [("shard", False)]
            assert calls[:len(steps)] == steps and calls[len(steps):] in ([], [("shard", True)])
            skipped += reachable > bound
            assert strict[1] == "own" or strict[0].num_packs == polished.num_packs
    assert polished_total < plain_total, (polished_total, plain_total)
    assert skipped  # a shard where the leftover's polish could not have helped skipped it
