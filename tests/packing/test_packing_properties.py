"""Property tests: every algorithm on random histograms, and the assignment on random lengths.

Invariants (packing/plan.py): exact cover (every sequence in exactly one slot), capacity
(sum <= L), depth, padding = sum over packs of (L - tokens in the pack), determinism for
a seed; for lp, the certified bound never exceeds the plan nor the true optimum.
"""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packing import ALGORITHMS, Histogram, assign, pack
from packing.assign import _fill_by_strategy, _fill_vectorised, _group_by_length
from packing.baselines import next_fit_pack_starts, next_fit_pack_starts_reference, plan_arrays_from_packs

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def histograms(draw, max_length=40, max_count=6):
    L = draw(st.integers(2, max_length))
    counts = draw(st.lists(st.integers(0, max_count), min_size=L, max_size=L))
    if sum(counts) == 0:
        counts[draw(st.integers(0, L - 1))] = 1
    return Histogram(counts, L)


def _depths(algorithm):
    limit = ALGORITHMS[algorithm].max_depth
    finite = st.integers(1, limit if limit is not None else 6)
    return finite if limit is not None else st.one_of(st.none(), finite)


def _padding_by_packs(plan):
    sums = np.add.reduceat(plan.strategy_lengths, plan.strategy_offsets[:-1])
    return int(((plan.max_sequence_length - sums) * plan.repeats).sum())


def _sorted_batching_padding(histogram, batch_size):
    lengths = np.sort(np.repeat(histogram.lengths, histogram.counts))[::-1]
    return sum(int(batch.max()) * batch.size - int(batch.sum())
               for batch in np.split(lengths, range(batch_size, lengths.size, batch_size)))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_plan_invariants(algorithm):
    @SETTINGS
    @given(histogram=histograms(), data=st.data())
    def check(histogram, data):
        depth = data.draw(_depths(algorithm), label="depth")
        seed = data.draw(st.integers(0, 3), label="seed")
        result = pack(histogram, algorithm, depth, seed=seed)
        plan = result.plan
        effective_depth = 1 if algorithm in ("none", "sort") else depth
        plan.validate(histogram.counts, effective_depth)  # exact cover, capacity, depth
        assert plan.num_tokens() == histogram.num_tokens
        if algorithm == "sort":
            assert result.num_padding_tokens == _sorted_batching_padding(histogram, 32)
        else:
            assert result.num_padding_tokens == _padding_by_packs(plan)
            assert result.num_padding_tokens == result.num_packs * histogram.max_sequence_length - histogram.num_tokens
        assert result.num_packs >= histogram.min_num_packs
        again = pack(histogram, algorithm, depth, seed=seed).plan
        assert again.strategies == plan.strategies and np.array_equal(again.repeats, plan.repeats)
        if algorithm == "lp":
            assert result.lp_bound_packs <= result.num_packs
    check()


def _optimal_num_packs(lengths, capacity, depth):
    """Exact minimum number of packs by exhaustive search (tiny inputs only)."""
    lengths = sorted(lengths, reverse=True)
    best = [len(lengths)]

    def search(index, packs):
        if len(packs) >= best[0]:
            return
        if index == len(lengths):
            best[0] = len(packs)
            return
        seen = set()
        for pack_index, (used, count) in enumerate(packs):
            if (used, count) in seen or used + lengths[index] > capacity or (depth and count >= depth):
                continue
            seen.add((used, count))
            packs[pack_index] = (used + lengths[index], count + 1)
            search(index + 1, packs)
            packs[pack_index] = (used, count)
        packs.append((lengths[index], 1))
        search(index + 1, packs)
        packs.pop()

    search(0, [])
    return best[0]


@SETTINGS
@given(L=st.integers(4, 24), data=st.data())
def test_lp_bound_is_below_the_true_optimum(L, data):
    lengths = data.draw(st.lists(st.integers(1, L), min_size=1, max_size=8), label="lengths")
    depth = data.draw(st.one_of(st.none(), st.integers(1, 4)), label="depth")
    result = pack(Histogram.from_lengths(lengths, L), "lp", depth)
    optimum = _optimal_num_packs(lengths, L, depth)
    assert result.lp_bound_packs <= optimum <= result.num_packs


@pytest.mark.parametrize("algorithm", ["none", "spfhp", "lpfhp", "bfd", "nnlshp", "lp", "greedy"])
def test_assignment_invariants(algorithm):
    @SETTINGS
    @given(histogram=histograms(max_length=30, max_count=8), data=st.data())
    def check(histogram, data):
        depth = data.draw(st.integers(1, 3), label="depth")
        seed = data.draw(st.integers(0, 2**31), label="seed")
        L = histogram.max_sequence_length
        lengths = histogram.sample_lengths(None, seed=seed)
        plan = pack(histogram, algorithm, depth).plan
        packs = assign(plan, lengths, seed=seed)
        # Exact cover of the sequence indices.
        assert np.array_equal(np.sort(packs.sequence_indices), np.arange(lengths.size))
        sizes = np.diff(packs.pack_offsets)
        assert sizes.min() >= 1 and sizes.max() <= plan.max_depth <= depth
        assert packs.pack_lengths(lengths).max() <= L
        # The packs realise the plan: same multiset of strategies.
        realised = {}
        for pack_indices in packs:
            key = tuple(sorted(lengths[pack_indices].tolist()))
            realised[key] = realised.get(key, 0) + 1
        assert realised == dict(zip(plan.strategies, plan.repeats.tolist()))
        # Deterministic for a seed; shuffled pack order keeps the same packs.
        again = assign(plan, lengths, seed=seed)
        assert np.array_equal(again.sequence_indices, packs.sequence_indices)
        shuffled = assign(plan, lengths, seed=seed, shuffle_packs=True)
        assert sorted(map(tuple, shuffled)) == sorted(map(tuple, packs))
    check()


@SETTINGS
@given(histogram=histograms(max_length=30, max_count=8), seed=st.integers(0, 100))
def test_both_assignment_layouts_agree(histogram, seed):
    # assign() loops over strategies for small plans and goes fully vectorised for huge
    # ones (greedy); the two must produce identical packs.
    lengths = histogram.sample_lengths(None, seed=seed)
    plan = pack(histogram, "lpfhp", 3).plan
    by_length = _group_by_length(lengths, histogram.max_sequence_length)
    bin_starts = np.concatenate([[0], np.cumsum(histogram.counts)])
    first = np.empty(lengths.size, dtype=np.int64)
    second = np.empty(lengths.size, dtype=np.int64)
    _fill_by_strategy(plan, by_length, bin_starts, first)
    _fill_vectorised(plan, by_length, second, histogram.max_sequence_length, np.int64)
    assert np.array_equal(first, second)


def test_greedy_is_next_fit_in_stream_order():
    lengths = np.array([5, 4, 3, 6, 1, 1, 1, 8])
    result = pack(Histogram.from_lengths(lengths, 10), "greedy", 3, lengths=lengths)
    # next fit, capacity 10, depth 3: [5,4] [3,6,1] [1,1,8]
    assert dict(zip(result.plan.strategies, result.plan.repeats.tolist())) == {(4, 5): 1, (1, 3, 6): 1, (1, 1, 8): 1}


@pytest.mark.parametrize("L,depth", [(4096, 8), (2048, None)])
def test_lp_handles_long_sequences(L, depth):
    # Column generation at L = 4096 and depth > 3 (nothing is enumerated at depth 4+).
    # Lengths are bucketed to multiples of 16 (as length-bucketing pipelines do), which
    # keeps the number of distinct lengths, and so the LP's rows, at 256.
    rng = np.random.default_rng(L)
    lengths = np.minimum(rng.geometric(3.0 / L, size=20_000) // 16 * 16 + 16, L)
    histogram = Histogram.from_lengths(lengths, L)
    result = pack(histogram, "lp", depth)
    result.plan.validate(histogram.counts, depth)
    assert result.details["converged"]
    assert result.lp_bound_packs <= result.num_packs <= result.lp_bound_packs * 1.001
    best_heuristic = min(pack(histogram, name, depth).num_packs for name in ("lpfhp", "bfd"))
    assert result.num_packs <= best_heuristic


def test_small_exhaustive_depth_cases():
    # Every multiset of up to 4 lengths in 1..6 with L = 6: lp is optimal or within one.
    for lengths in itertools.combinations_with_replacement(range(1, 7), 4):
        result = pack(Histogram.from_lengths(list(lengths), 6), "lp", 2)
        optimum = _optimal_num_packs(list(lengths), 6, 2)
        assert result.lp_bound_packs <= optimum <= result.num_packs <= optimum + 1


@SETTINGS
@given(L=st.integers(2, 40), data=st.data())
def test_blocked_next_fit_equals_the_sequential_loop(L, data):
    lengths = np.array(data.draw(st.lists(st.integers(1, L), min_size=1, max_size=400), label="lengths"))
    depth = data.draw(st.one_of(st.none(), st.integers(1, 4)), label="depth")
    block_size = data.draw(st.integers(1, 64), label="block_size")
    expected = next_fit_pack_starts_reference(lengths, L, depth)
    assert np.array_equal(next_fit_pack_starts(lengths, L, depth, block_size=block_size), expected)
    # The plan groups those packs into strategies exactly (checked against plain Python).
    offsets, slot_lengths, repeats = plan_arrays_from_packs(lengths, expected, L)
    packs = {}
    for start, stop in zip(expected, list(expected[1:]) + [lengths.size]):
        key = tuple(sorted(lengths[start:stop].tolist()))
        packs[key] = packs.get(key, 0) + 1
    got = {tuple(slot_lengths[offsets[i]:offsets[i + 1]].tolist()): int(r) for i, r in enumerate(repeats)}
    assert got == packs
