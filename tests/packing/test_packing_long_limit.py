"""The packing API at an absurd length limit (issue 27, item 6): memory and time grow with the
number of sequences and of distinct lengths, never with max_sequence_length L.

A handful of short sequences at L = 10**8 (and 10**12) goes through every algorithm, assign,
the LLM API and the command line under tracemalloc (numpy's allocations are traced). The
bound asserted, 4 MiB, is three orders of magnitude below what the dense implementation
took at L = 10**8 (0.8-6 GiB per call; docs/benchmarks/packing.md, "Packing library") and a million
times below what it would need at 10**12. Results are checked too, and against the same
data at a small L where that has to give the same plan.
"""
import json
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packing import ALGORITHMS, Histogram, PackingError, assign, pack, pack_sequences, pack_stream
from packing.cli import main
from packing.histogram import MAX_SEQUENCE_LENGTH
from test_packing_bounds import _best_strategy_value, draw_pricing_problem
from test_packing_properties import _optimal_num_packs

LIMITS = [10**8, 10**12]
LENGTHS = [3, 5, 5, 7, 11]
MAX_TRACED = 4 * 2**20  # bytes; the dense code took 0.8-6 GiB at L = 1e8
# lp's certificate prices on a grid of at most 65,536 cells (tables of depth + 1 rows): ~7
# MiB where it runs; the dense code took 5.2 GiB for this at L = 1e8.
MAX_TRACED_LP = 16 * 2**20
MAX_SECONDS = 10.0  # generous on a shared machine; the dense code took 4-33 s per call at 1e8


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    """scipy, highspy and matplotlib load lazily; load them before anything is measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    histogram = Histogram.from_lengths([2, 3, 5, 7], 8)
    for name in ALGORITHMS:
        pack(histogram, name, 3)
    pack(Histogram.from_lengths([5, 5, 5, 4, 4, 4, 3, 3], 12), "lp", 4, target_gap=0)


def measured(function):
    """(result, traced peak bytes, seconds) of ``function()``."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        result = function()
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak, seconds


def assert_small(peak, seconds, what, limit=MAX_TRACED):
    assert peak < limit, f"{what}: {peak / 2**20:.1f} MiB traced"
    assert seconds < MAX_SECONDS, f"{what}: {seconds:.1f} s"


def _cases():
    for name, algorithm in ALGORITHMS.items():
        for depth in (3, None):
            if algorithm.supports(depth) and name not in ("nnlshp", "ennlshp"):  # those refuse (below)
                yield name, depth


@pytest.mark.parametrize("L", LIMITS)
@pytest.mark.parametrize("algorithm,depth", list(_cases()))
def test_every_algorithm_at_a_huge_limit(L, algorithm, depth):
    histogram, peak, seconds = measured(lambda: Histogram.from_lengths(LENGTHS, L))
    assert_small(peak, seconds, "from_lengths")
    small = pack(Histogram.from_lengths(LENGTHS, 64), algorithm, depth)

    def run():
        result = pack(histogram, algorithm, depth)
        return result, result.to_dict()

    (result, fields), peak, seconds = measured(run)
    assert_small(peak, seconds, f"pack {algorithm}")
    result.plan.validate(histogram, depth)
    # Short sequences pack the same way under any L beyond their sum: same plan as at L = 64.
    assert dict(zip(result.plan.strategies, result.plan.repeats.tolist())) == \
        dict(zip(small.plan.strategies, small.plan.repeats.tolist()))
    assert fields["num_sequences"] == 5 and fields["num_tokens"] == 31 and fields["max_sequence_length"] == L
    if algorithm != "sort":
        assert fields["num_padding_tokens"] == result.num_packs * L - 31
    assert result.lp_bound_packs <= result.num_packs

    packs, peak, seconds = measured(lambda: assign(result.plan, np.array(LENGTHS), seed=1, shuffle_packs=True))
    assert_small(peak, seconds, "assign")
    assert np.array_equal(np.sort(packs.sequence_indices), np.arange(len(LENGTHS)))


@pytest.mark.parametrize("L", LIMITS)
@pytest.mark.parametrize("algorithm", ["nnlshp", "ennlshp"])
def test_dense_algorithms_refuse_cheaply(L, algorithm):
    histogram = Histogram.from_lengths(LENGTHS, L)

    def run():
        with pytest.raises(PackingError, match=f"^{algorithm} at max_sequence_length {L}, depth 3 needs a dense"):
            pack(histogram, algorithm, 3)

    _, peak, seconds = measured(run)
    assert_small(peak, seconds, f"{algorithm} refusal")  # the dense code built an O(L) array to say no


# Sequences of 0.2 L .. 0.73 L tokens (shares of L in %) and a few short ones: the heuristics
# need one pack more than the simple bounds, so lp really runs (LP, pricing, MILP), with
# short items far below one cell of the certificate's pricing grid (light items: bounded by
# the depth limit at depth 4, by their value per token at unlimited depth).
SEARCH_DEPTH_4 = ([22, 33, 22, 42, 73, 23, 37, 39, 69, 27], LENGTHS, 4)
SEARCH_UNLIMITED = ([64, 50, 50, 41, 39, 28, 22], [3, 5], None)


@pytest.mark.parametrize("L", LIMITS)
@pytest.mark.parametrize("shares,short,depth", [SEARCH_DEPTH_4, SEARCH_UNLIMITED], ids=["depth4", "unlimited"])
def test_lp_column_generation_at_a_huge_limit(L, shares, short, depth):
    lengths = [share * (L // 100) for share in shares] + short
    histogram = Histogram.from_lengths(lengths, L)
    result, peak, seconds = measured(lambda: pack(histogram, "lp", depth, target_gap=0, time_limit=30))
    assert_small(peak, seconds, "lp", MAX_TRACED_LP)
    assert result.details["lp_skipped"] is None and result.details["num_rounds"] > 0  # the LP ran
    result.plan.validate(histogram, depth)
    optimum = _optimal_num_packs(lengths, L, depth)  # exhaustive search
    assert result.lp_bound_packs <= optimum == result.num_packs


@pytest.mark.parametrize("L", LIMITS)
def test_llm_api_at_a_huge_limit(L):
    tokens = [list(range(100, 100 + n)) for n in LENGTHS]
    for algorithm in ("lpfhp", "lp", "greedy"):
        rows, peak, seconds = measured(lambda: pack_sequences(tokens, L, algorithm, 3, seed=2))
        assert_small(peak, seconds, f"pack_sequences {algorithm}")
        assert len(rows) == 2 and rows.max_sequence_length == L
        assert sorted(np.concatenate([rows[i]["input_ids"] for i in range(len(rows))]).tolist()) == \
            sorted(token for sequence in tokens for token in sequence)
        for i in range(len(rows)):
            row = rows[i]
            assert row["cu_seqlens"][-1] == row["input_ids"].size <= L
        columns = rows.to_columns()
        assert [sum(lengths) for lengths in columns["seq_lengths"]] == [len(ids) for ids in columns["input_ids"]]
    streamed, peak, seconds = measured(lambda: list(pack_stream(iter(tokens), L, chunk_size=2)))
    assert_small(peak, seconds, "pack_stream")
    assert sorted(index for row in streamed for index in row["sequence_indices"].tolist()) == list(range(5))


@pytest.mark.parametrize("L", LIMITS)
def test_histogram_statistics_and_sampling_at_a_huge_limit(L):
    def run():
        histogram = Histogram.from_length_counts([11, 3, 5, 7], [1, 1, 2, 1], L)
        return histogram, histogram.statistics(), histogram.sample_lengths(seed=4), \
            histogram.sample_lengths(1000, seed=4)

    (histogram, stats, shuffled, drawn), peak, seconds = measured(run)
    assert_small(peak, seconds, "statistics")
    assert histogram.distinct_lengths.tolist() == [3, 5, 7, 11] and histogram.distinct_counts.tolist() == [1, 2, 1, 1]
    assert stats["num_sequences"] == 5 and stats["num_tokens"] == 31 and stats["min_length"] == 3
    assert stats["min_num_packs"] == 1 and stats["padding_fraction"] == pytest.approx(1 - 31 / (5 * L))
    assert sorted(shuffled.tolist()) == sorted(LENGTHS) and set(drawn.tolist()) <= set(LENGTHS)


def test_sparse_and_dense_histograms_are_the_same():
    # Histogram.counts is dense on request; built from the non-empty bins, the same object
    # as from dense counts: same bins, same plans, same draws.
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=2000)
    dense = Histogram(np.bincount(lengths, minlength=301)[1:], 300)
    values, counts = np.unique(lengths, return_counts=True)
    sparse = Histogram.from_length_counts(values[::-1], counts[::-1], 300)  # any order
    from_lengths = Histogram.from_lengths(lengths, 300)
    for histogram in (sparse, from_lengths):
        assert np.array_equal(histogram.counts, dense.counts)
        assert np.array_equal(histogram.distinct_lengths, dense.distinct_lengths)
        assert np.array_equal(histogram.sample_lengths(500, seed=3), dense.sample_lengths(500, seed=3))
        for algorithm in ("sort", "lpfhp", "greedy", "lp"):
            a, b = pack(histogram, algorithm, 3), pack(dense, algorithm, 3)
            assert a.plan.strategies == b.plan.strategies and a.lp_bound_packs == b.lp_bound_packs
    assert Histogram.from_length_counts([4, 2, 4, 9], [1, 3, 2, 0], 10).distinct_counts.tolist() == [3, 3]


def test_sampling_over_the_non_empty_bins_draws_as_over_all_bins():
    # sample_lengths(n) now draws over the non-empty bins only; it must give the draws that
    # rng.choice over all L bins (zeros included) gives.
    rng = np.random.default_rng(5)
    counts = np.zeros(700, dtype=np.int64)
    counts[rng.choice(700, 40, replace=False)] = rng.integers(1, 1000, 40)
    histogram = Histogram(counts, 700)
    for seed in range(5):
        expected = np.random.default_rng(seed).choice(np.arange(1, 701), size=3000, p=counts / counts.sum())
        assert np.array_equal(histogram.sample_lengths(3000, seed=seed), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_certificate_pricing_with_light_items_never_prices_below_the_best(data):
    # On a huge L the certificate's pricing grid is capped (packing.lp._MAX_BOUND_CELLS) and
    # items shorter than one cell weigh nothing on it; its value must still be at least the
    # best strategy's true value (else Farley's bound could pass the optimum). Here the cap
    # is made tiny so that small L exercises it; the reference is a plain table in tokens.
    import packing.lp as lp

    L, weights, values, depth = draw_pricing_problem(data, (20, 150), 10, [None, 1, 2, 3, 5])
    cells = data.draw(st.integers(2, 12), label="cells")
    saved = lp._MAX_BOUND_CELLS
    lp._MAX_BOUND_CELLS = cells
    try:
        pricer = lp._Pricer(weights, L, depth, 1, "down")
        value = pricer.best_value(values)
    finally:
        lp._MAX_BOUND_CELLS = saved
    assert pricer.capacity <= cells
    assert value >= _best_strategy_value(weights, values, L, depth) - 1e-9


def test_certificate_grid_is_unchanged_below_the_cap():
    # Below _MAX_BOUND_CELLS cells (every L <= 65,536) the certificate's grid is the one it
    # always was: every item at least one cell, so no item is light.
    import packing.lp as lp

    weights = np.array([1, 40, 900, 30000])
    pricer = lp._Pricer(weights, 65536, 8, 32, "down")
    assert pricer.quantum == 1 and pricer.num_light == 0 and pricer.capacity == 65536
    capped = lp._Pricer(weights, 10**8, 8, 10**8 // 2048, "down")
    assert capped.capacity <= lp._MAX_BOUND_CELLS and capped.num_light == 3  # below 10**8 / 65,536 tokens


def test_refused_limits_and_lengths():
    for bad in (2**53 + 1, 10**30, 1e30):
        with pytest.raises(PackingError, match=r"^max_sequence_length must be at most 2\*\*53 .*surely a mistake$"):
            Histogram.from_lengths([3], bad)
        with pytest.raises(PackingError, match=r"at most 2\*\*53"):
            pack_sequences([[1, 2]], bad)
    assert Histogram.from_lengths([3], MAX_SEQUENCE_LENGTH).max_sequence_length == 2**53
    for bad in (2.5, "512", None, float("nan"), float("inf"), True, 0, -3):
        with pytest.raises(PackingError, match="^max_sequence_length must be a positive integer"):
            Histogram.from_lengths([3], bad)
    with pytest.raises(PackingError, match="^a sequence of length 100000001 is longer than max_sequence_length "
                                           "100000000; truncate it or raise max_sequence_length$"):
        Histogram.from_lengths([3, 10**8 + 1], 10**8)
    with pytest.raises(PackingError, match="^a sequence of length 12 is longer than max_sequence_length 10"):
        Histogram.from_length_counts([3, 12], [1, 1], 10)
    with pytest.raises(PackingError, match="^histogram has 2 lengths but 3 counts; give one count per length$"):
        Histogram.from_length_counts([3, 4], [1, 1, 1], 10)
    with pytest.raises(PackingError, match="^histogram counts must be non-negative, found -1 sequences of length 4$"):
        Histogram.from_length_counts([3, 4], [1, -1], 10)
    with pytest.raises(PackingError, match="^histogram has .* tokens, beyond what 64-bit arithmetic"):
        Histogram.from_length_counts([2**40, 2**40], [2**22, 2**22], 2**41)  # each fine, the sum is not
    with pytest.raises(PackingError, match="^histogram is empty"):
        Histogram.from_length_counts([3], [0], 10)


def _sparse_file(tmp_path, payload):
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps(payload))
    return path


@pytest.mark.parametrize("L", LIMITS)
def test_report_and_plot_on_a_sparse_histogram_file(tmp_path, capsys, L):
    path = _sparse_file(tmp_path, {"max_sequence_length": L, "lengths": [3, 5, 7, 11], "counts": [1, 2, 1, 1]})
    arguments = ["report", "--histogram", str(path), "--algorithm", "lpfhp", "lp", "greedy", "sort",
                 "--max-sequences-per-pack", "3", "max", "--json"]
    status, peak, seconds = measured(lambda: main(arguments))
    assert status == 0
    assert_small(peak, seconds, "report")
    rows = json.loads(capsys.readouterr().out)
    assert {row["max_sequence_length"] for row in rows} == {L} and {row["num_tokens"] for row in rows} == {31}
    assert all(row["num_packs"] == (5 if row["algorithm"] == "sort" else 2 if row["max_sequences_per_pack"] == 3
                                    else 1) for row in rows)
    status, peak, seconds = measured(lambda: main(["plot", "--histogram", str(path), "--output", str(tmp_path / "png"),
                                                   "--algorithm", "lpfhp"]))
    assert status == 0 and seconds < MAX_SECONDS
    assert peak < 64 * 2**20  # matplotlib's own figures; the dense code needed 2 x 8 bytes x L
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["histogram.png", "padding_lpfhp_3.png"]


SPARSE_FILE_ERRORS = {
    "no limit": ({"lengths": [3], "counts": [1]}, "{path} lists lengths and counts but no max_sequence_length; add it"),
    "length above L": ({"max_sequence_length": 10**8, "lengths": [3, 10**8 + 1], "counts": [1, 1]},
                       "a sequence of length 100000001 is longer than max_sequence_length 100000000; truncate it or "
                       "raise max_sequence_length"),
    "sizes differ": ({"max_sequence_length": 10**8, "lengths": [3, 4], "counts": [1]},
                     "histogram has 2 lengths but 1 counts; give one count per length"),
    "absurd limit": ({"max_sequence_length": 10**30, "lengths": [3], "counts": [1]},
                     "max_sequence_length must be at most 2**53 (9,007,199,254,740,992), got 1.000e+30; a row of "
                     "that many tokens is surely a mistake"),
    "fractional limit": ({"max_sequence_length": 1e8 + 0.5, "lengths": [3], "counts": [1]},
                         "max_sequence_length must be a positive integer, got 100000000.5"),
    "fractional length": ({"max_sequence_length": 10**8, "lengths": [3.5], "counts": [1]},
                          "histogram lengths must contain integers, found 3.5"),
}


@pytest.mark.parametrize("case", list(SPARSE_FILE_ERRORS))
def test_sparse_histogram_file_mistakes_are_one_line(tmp_path, capsys, case):
    payload, message = SPARSE_FILE_ERRORS[case]
    path = _sparse_file(tmp_path, payload)
    before = path.read_bytes()
    assert main(["report", "--histogram", str(path), "--algorithm", "lpfhp"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message.format(path=path)}\n" and captured.out == ""
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["sparse.json"]
