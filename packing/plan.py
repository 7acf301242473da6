"""Packing plans (strategies with repeat counts) and packing results.

A *strategy* is a sorted tuple of sequence lengths that share one pack (sum <= L,
at most ``max_sequences_per_pack`` entries); a *plan* says how often each strategy is
used. Every plan this package returns is **exact**: its slots are exactly the
histogram (``slot_counts == histogram.counts``), so every sequence lands in exactly one
pack and the padding of a pack is ``L - sum(strategy)``. Algorithms that over-subscribe a
length (NNLSHP's "explicit padding") are normalised by :func:`exact_plan`.
"""
import numpy as np

from .histogram import LengthCounts, PackingError, as_length_counts


class Plan:
    """Strategies (CSR) and their repeat counts.

    Attributes:
        max_sequence_length: L.
        strategy_offsets: np.int64 [num_strategies + 1]; strategy s has the lengths
            ``strategy_lengths[strategy_offsets[s]:strategy_offsets[s + 1]]`` (ascending).
        strategy_lengths: np.int64 [total number of slots over strategies].
        repeats: np.int64 [num_strategies], all >= 1.
    """

    def __init__(self, strategy_offsets, strategy_lengths, repeats, max_sequence_length):
        self.strategy_offsets = np.asarray(strategy_offsets, dtype=np.int64)
        self.strategy_lengths = np.asarray(strategy_lengths, dtype=np.int64)
        self.repeats = np.asarray(repeats, dtype=np.int64)
        self.max_sequence_length = int(max_sequence_length)

    @classmethod
    def from_strategies(cls, strategies, repeats, max_sequence_length):
        """Build a plan from an iterable of length tuples and their repeat counts.

        Strategies are sorted, strategies with a zero repeat are dropped and equal
        strategies are merged (so ``num_strategies`` counts distinct packs).
        """
        merged = _merged(strategies, repeats)
        keys = sorted(merged, key=lambda key: (-len(key), key))
        sizes = np.array([len(key) for key in keys], dtype=np.int64)
        offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        lengths = np.fromiter((length for key in keys for length in key), dtype=np.int64, count=int(offsets[-1]))
        return cls(offsets, lengths, [merged[key] for key in keys], max_sequence_length)

    # -- views --------------------------------------------------------------------------

    @property
    def num_strategies(self):
        return int(self.repeats.size)

    @property
    def strategy_sizes(self):
        """np.int64 [num_strategies]: sequences per pack of each strategy."""
        return np.diff(self.strategy_offsets)

    @property
    def strategies(self):
        """List of ascending tuples of lengths, one per strategy."""
        offsets, lengths = self.strategy_offsets, self.strategy_lengths.tolist()
        return [tuple(lengths[offsets[s]:offsets[s + 1]]) for s in range(self.num_strategies)]

    @property
    def num_packs(self):
        return int(self.repeats.sum())

    @property
    def max_depth(self):
        """The largest number of sequences in any pack of the plan."""
        return int(self.strategy_sizes.max()) if self.num_strategies else 0

    def slot_length_counts(self):
        """:class:`LengthCounts` of the plan's slots (A @ repeats over the lengths that occur):
        O(plan size), whatever L is."""
        per_slot = np.repeat(self.repeats, self.strategy_sizes)
        order = np.argsort(self.strategy_lengths, kind="stable")
        lengths = self.strategy_lengths[order]
        starts = np.flatnonzero(np.diff(lengths, prepend=-1))
        if starts.size == 0:
            return LengthCounts(lengths, per_slot[:0])
        return LengthCounts(lengths[starts], np.add.reduceat(per_slot[order], starts))

    def slot_counts(self):
        """np.int64 [L]: how many slots of each length 1..L the plan has (A @ repeats). Dense,
        O(L): ``slot_length_counts`` is the same without the empty lengths."""
        lengths, counts = self.slot_length_counts()
        dense = np.zeros(self.max_sequence_length, dtype=np.int64)
        dense[lengths - 1] = counts
        return dense

    def num_tokens(self):
        return int((self.strategy_lengths * np.repeat(self.repeats, self.strategy_sizes)).sum())

    def validate(self, counts, max_sequences_per_pack=None):
        """Check the plan's invariants against a histogram (a Histogram, its LengthCounts or
        dense counts); raise AssertionError if broken.

        Exact cover (slots == counts), capacity (sum <= L), depth, positive repeats.
        """
        sums = np.add.reduceat(self.strategy_lengths, self.strategy_offsets[:-1]) if self.num_strategies else []
        assert np.all(self.repeats >= 1), "plan has a non-positive repeat count"
        assert np.all(self.strategy_sizes >= 1), "plan has an empty strategy"
        assert np.all(np.asarray(sums) <= self.max_sequence_length), "a strategy exceeds max_sequence_length"
        if max_sequences_per_pack is not None:
            assert self.max_depth <= max_sequences_per_pack, (
                f"plan uses depth {self.max_depth} > max_sequences_per_pack {max_sequences_per_pack}")
        expected, slots = as_length_counts(counts), self.slot_length_counts()
        assert np.array_equal(slots.lengths, expected.lengths) and np.array_equal(slots.counts, expected.counts), \
            "plan does not cover the histogram exactly"

    def __repr__(self):
        return f"Plan(num_strategies={self.num_strategies}, num_packs={self.num_packs}, max_depth={self.max_depth})"


def _merged(strategies, repeats):
    """{ascending length tuple: total repeat}: equal strategies merged, empty strategies and
    zero repeats dropped; ValueError on a negative repeat."""
    merged = {}
    for strategy, repeat in zip(strategies, repeats):
        repeat = int(repeat)
        if repeat < 0:
            raise ValueError(f"negative repeat count {repeat} for strategy {strategy}")
        if repeat == 0 or len(strategy) == 0:
            continue
        key = tuple(sorted(int(length) for length in strategy))
        merged[key] = merged.get(key, 0) + repeat
    return merged


def exact_plan(strategies, repeats, counts, max_sequence_length):
    """Turn a covering plan (every length has at least as many slots as sequences) into an
    exact one by deleting the surplus slots; a deleted slot becomes padding, so the number
    of packs can only go down (a pack whose slots are all surplus disappears).

    Deterministic: surplus slots are taken from the strategies using that length most.
    Raises RuntimeError if some length has fewer slots than sequences (an algorithm bug).
    ``counts``: a LengthCounts (or dense counts); O(plan size + distinct lengths).
    """
    needed = as_length_counts(counts)
    table = _merged(strategies, repeats)
    surplus = {}  # length -> slots minus sequences, for every length with either
    for key, repeat in table.items():
        for length in key:
            surplus[length] = surplus.get(length, 0) + repeat
    for length, count in zip(needed.lengths.tolist(), needed.counts.tolist()):
        surplus[length] = surplus.get(length, 0) - count
    short = [length for length, excess in surplus.items() if excess < 0]
    if short:
        short = min(short)
        raise RuntimeError(f"plan leaves {-surplus[short]} sequences of length {short} unpacked")
    for length in sorted(length for length, excess in surplus.items() if excess):
        excess = surplus[length]
        users = [(key, key.count(length)) for key in table if length in key]
        users.sort(key=lambda item: (-item[1] * table[item[0]], item[0]))
        for key, multiplicity in users:
            if excess == 0:
                break
            repeat = table[key]
            take = min(excess, repeat * multiplicity)
            excess -= take
            whole, rest = divmod(take, multiplicity)  # copies losing all / some of the slots
            del table[key]
            remaining = {key: repeat - whole - (1 if rest else 0)}
            without = tuple(x for x in key if x != length)
            remaining[without] = remaining.get(without, 0) + whole
            if rest:
                fewer = list(without) + [length] * (multiplicity - rest)
                fewer = tuple(sorted(fewer))
                remaining[fewer] = remaining.get(fewer, 0) + 1
            for new_key, new_repeat in remaining.items():
                if new_repeat > 0 and len(new_key):
                    table[new_key] = table.get(new_key, 0) + new_repeat
    return Plan.from_strategies(list(table), list(table.values()), max_sequence_length)


class PackingResult:
    """A plan plus what a report says about it (docs/design.md's field names in ``to_dict``).

    ``num_padding_tokens`` is ``num_packs * L - num_tokens`` for every packing algorithm;
    only ``sort`` (sorted batching, where a batch is padded to its longest sequence) sets
    it explicitly.
    """

    FIELDS = ("algorithm", "max_sequence_length", "max_sequences_per_pack", "num_sequences", "num_packs",
              "num_tokens", "num_padding_tokens", "efficiency", "packing_factor", "theoretical_speedup",
              "max_depth_used", "num_strategies_used", "seconds", "lp_bound_packs", "gap")

    def __init__(self, algorithm, histogram, max_sequences_per_pack, plan, seconds,
                 lp_bound_packs=None, num_padding_tokens=None, details=None):
        self.algorithm = algorithm
        self.histogram = histogram
        self.max_sequences_per_pack = max_sequences_per_pack
        self.plan = plan
        self.seconds = float(seconds)
        self.lp_bound_packs = None if lp_bound_packs is None else int(lp_bound_packs)
        self._num_padding_tokens = num_padding_tokens
        self.details = dict(details or {})

    @property
    def num_packs(self):
        return self.plan.num_packs

    @property
    def num_padding_tokens(self):
        if self._num_padding_tokens is not None:
            return int(self._num_padding_tokens)
        return self.num_packs * self.histogram.max_sequence_length - self.histogram.num_tokens

    @property
    def efficiency(self):
        """Fraction of real tokens among all tokens processed."""
        num_tokens = self.histogram.num_tokens
        return num_tokens / (num_tokens + self.num_padding_tokens)

    @property
    def gap(self):
        """How far the plan is from optimal at most: num_packs / lp_bound_packs - 1 (0.0 =
        certified optimal); None where no bound is known."""
        if not self.lp_bound_packs:
            return None
        return self.num_packs / self.lp_bound_packs - 1.0

    @property
    def packing_factor(self):
        """Sequences per pack (row) on average: the speed-up over one sequence per row."""
        return self.histogram.num_sequences / self.num_packs

    def to_dict(self):
        histogram = self.histogram
        return {
            "algorithm": self.algorithm,
            "max_sequence_length": histogram.max_sequence_length,
            "max_sequences_per_pack": self.max_sequences_per_pack,
            "num_sequences": histogram.num_sequences,
            "num_packs": self.num_packs,
            "num_tokens": histogram.num_tokens,
            "num_padding_tokens": self.num_padding_tokens,
            "efficiency": self.efficiency,
            "packing_factor": self.packing_factor,
            "theoretical_speedup": histogram.theoretical_speedup,
            "max_depth_used": self.plan.max_depth,
            "num_strategies_used": self.plan.num_strategies,
            "seconds": self.seconds,
            "lp_bound_packs": self.lp_bound_packs,
            "gap": self.gap,
        }

    def __repr__(self):
        depth = "unlimited" if self.max_sequences_per_pack is None else self.max_sequences_per_pack
        return (f"PackingResult({self.algorithm}, depth={depth}, num_packs={self.num_packs}, "
                f"efficiency={self.efficiency:.4%})")


def check_depth(max_sequences_per_pack):
    """Validate ``max_sequences_per_pack`` (None = unlimited); return it as int or None."""
    if max_sequences_per_pack is None:
        return None
    if isinstance(max_sequences_per_pack, bool):
        raise PackingError(f"max_sequences_per_pack must be a positive integer, got {max_sequences_per_pack!r}")
    try:
        depth = int(max_sequences_per_pack)
    except (TypeError, ValueError):
        raise PackingError(f"max_sequences_per_pack must be a positive integer, got {max_sequences_per_pack!r}") from None
    if depth != max_sequences_per_pack or depth < 1:
        raise PackingError(
            f"max_sequences_per_pack must be a positive integer (or unlimited), got {max_sequences_per_pack!r}")
    return depth
