"""Assignment: a plan plus the real per-sequence lengths -> concrete packs of sequence indices.

The plan says "use strategy (95, 184, 233) 24 times"; the assignment decides *which*
sequences of length 95, 184 and 233 go into each of those 24 packs. Sequences of equal
length are interchangeable for packing, so the k-th slot of length l (in pack order) gets
the k-th sequence of length l in a seeded shuffle of that length's bin. Everything is a
handful of O(n) numpy passes (the per-length grouping is a radix sort on 16-bit keys),
with no Python loop over sequences or packs.
"""
import numpy as np

from .histogram import PackingError, check_lengths, count_lengths


class Assignment:
    """Packs in CSR form.

    Attributes:
        pack_offsets: np.int64 [num_packs + 1]; pack p holds
            ``sequence_indices[pack_offsets[p]:pack_offsets[p + 1]]``.
        sequence_indices: np.int64 [num_sequences]; every index 0..n-1 exactly once.
        max_sequence_length: L.
    """

    def __init__(self, pack_offsets, sequence_indices, max_sequence_length):
        self.pack_offsets = pack_offsets
        self.sequence_indices = sequence_indices
        self.max_sequence_length = int(max_sequence_length)

    @property
    def num_packs(self):
        return int(self.pack_offsets.size - 1)

    @property
    def num_sequences(self):
        return int(self.sequence_indices.size)

    def pack(self, index):
        """np.int64 [k]: the sequence indices of pack ``index``."""
        return self.sequence_indices[self.pack_offsets[index]:self.pack_offsets[index + 1]]

    def __len__(self):
        return self.num_packs

    def __iter__(self):
        for index in range(self.num_packs):
            yield self.pack(index)

    def pack_lengths(self, lengths):
        """np.int64 [num_packs]: tokens in each pack, given the per-sequence lengths."""
        tokens = np.asarray(lengths, dtype=np.int64)[self.sequence_indices]
        return np.add.reduceat(tokens, self.pack_offsets[:-1]) if self.num_packs else tokens[:0]

    def __repr__(self):
        return f"Assignment(num_packs={self.num_packs}, num_sequences={self.num_sequences})"


def _group_by_length(lengths, max_sequence_length):
    """Indices that sort ``lengths`` ascending, stably: a radix sort when lengths fit 16 bits."""
    short = max_sequence_length < 2**16 or (lengths.size and int(lengths.max()) < 2**16)
    key = lengths.astype(np.uint16) if short else lengths
    return np.argsort(key, kind="stable")


def _index_dtype(size):
    # int32 halves the memory traffic of every gather; outputs are int64 (the API).
    return np.int32 if size < 2**31 - 1 else np.int64


def assign(plan, lengths, seed=0, shuffle_packs=False):
    """Concrete packs for ``lengths`` (np.int [n], each in 1..L) following ``plan``.

    Requires the plan to be exact for these lengths (it came from the histogram of the
    same lengths): otherwise raises PackingError naming the first length that differs.

    Guarantees: every sequence index appears exactly once; each pack's lengths sum to at
    most L and it has at most ``plan.max_depth`` sequences; the packs follow the plan's
    strategies (pack order = strategy order, unless ``shuffle_packs`` shuffles it); the
    result is a pure function of (plan, lengths, seed). Within a pack, sequences follow
    the strategy (ascending length). Time and memory O(n + plan size), whatever L is.
    """
    L = plan.max_sequence_length
    try:
        lengths = np.asarray(lengths)
    except Exception as exc:
        raise PackingError(f"sequence lengths must be a flat array of integers ({exc})") from None
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise PackingError(f"sequence lengths must be a 1-D integer array, got shape {lengths.shape} "
                           f"and dtype {lengths.dtype}")
    check_lengths(lengths, L)
    num_sequences = lengths.size
    counts = count_lengths(lengths)  # the data's non-empty bins: O(n), not O(L)
    _check_same_bins(counts, plan.slot_length_counts())
    index_dtype = _index_dtype(num_sequences)
    rng = np.random.default_rng(seed)

    # Sequences grouped by length (radix sort), then each length's bin shuffled in place.
    by_length = _group_by_length(lengths, L).astype(index_dtype, copy=False)
    ends = np.cumsum(counts.counts)
    starts = ends - counts.counts
    for start, end in zip(starts.tolist(), ends.tolist()):  # ascending lengths, as the dense loop was
        if end - start > 1:
            rng.shuffle(by_length[start:end])
    bin_starts = dict(zip((counts.lengths - 1).tolist(), starts.tolist()))  # bin of length l at key l - 1

    sizes = plan.strategy_sizes
    pack_offsets = np.zeros(plan.num_packs + 1, dtype=np.int64)
    np.cumsum(np.repeat(sizes, plan.repeats), out=pack_offsets[1:])
    sequence_indices = np.empty(num_sequences, dtype=np.int64)
    if plan.num_strategies <= 100_000:
        _fill_by_strategy(plan, by_length, bin_starts, sequence_indices)
    else:  # plans with very many strategies (greedy): one vectorised pass instead
        _fill_vectorised(plan, by_length, sequence_indices, L, index_dtype)
    assignment = Assignment(pack_offsets, sequence_indices, L)
    return _shuffled(assignment, rng) if shuffle_packs else assignment


def _check_same_bins(counts, slots):
    """PackingError naming the shortest length where the data's bins and the plan's slots differ."""
    if np.array_equal(counts.lengths, slots.lengths) and np.array_equal(counts.counts, slots.counts):
        return
    data = dict(zip(counts.lengths.tolist(), counts.counts.tolist()))
    plan = dict(zip(slots.lengths.tolist(), slots.counts.tolist()))
    first = min(length for length in set(data) | set(plan) if data.get(length, 0) != plan.get(length, 0))
    raise PackingError(
        f"the plan has {plan.get(first, 0)} slots of length {first} but the data has {data.get(first, 0)} "
        "such sequences; build the plan from the histogram of these same lengths")


def _fill_by_strategy(plan, by_length, bin_starts, sequence_indices):
    """Strategy s occupies a block of ``repeats[s] * size`` slots (its packs, one after
    another). The copy c of slot j (length l, the t-th l in the strategy, m l's in all)
    takes the next free sequence of length l: rank ``used[l] + c * m + t`` in l's bin.
    One strided numpy write per (strategy, slot): no sort of the slots needed.
    ``bin_starts[l - 1]``: where length l's bin starts in ``by_length`` (an array over
    1..L, or a dict over the lengths that occur)."""
    used = {}
    block_start = 0
    offsets, lengths_flat = plan.strategy_offsets, plan.strategy_lengths
    for s, repeat in enumerate(plan.repeats.tolist()):
        members = lengths_flat[offsets[s]:offsets[s + 1]].tolist()
        size = len(members)
        block = sequence_indices[block_start:block_start + repeat * size]
        for length in set(members):
            positions = [j for j, member in enumerate(members) if member == length]
            multiplicity = len(positions)
            first = int(bin_starts[length - 1]) + used.get(length, 0)
            for t, j in enumerate(positions):
                block[j::size] = by_length[first + t:first + repeat * multiplicity:multiplicity]
            used[length] = used.get(length, 0) + repeat * multiplicity
        block_start += repeat * size


def _fill_vectorised(plan, by_length, sequence_indices, L, index_dtype):
    """Same result as _fill_by_strategy, for plans with many strategies: lay out every
    slot's length in pack order, then match the k-th slot of length l with the k-th
    sequence of length l by grouping both sides by length."""
    sizes = plan.strategy_sizes
    num_sequences = sequence_indices.size
    pack_strategy = np.repeat(np.arange(plan.num_strategies, dtype=index_dtype), plan.repeats)
    slot_pack = np.repeat(np.arange(pack_strategy.size, dtype=index_dtype), sizes[pack_strategy])
    pack_offsets = np.zeros(pack_strategy.size + 1, dtype=np.int64)
    np.cumsum(sizes[pack_strategy], out=pack_offsets[1:])
    slot_source = plan.strategy_offsets[pack_strategy[slot_pack]]
    slot_source += np.arange(num_sequences, dtype=np.int64)
    slot_source -= pack_offsets[slot_pack]
    del slot_pack, pack_strategy
    slot_order = _group_by_length(plan.strategy_lengths[slot_source], L)
    del slot_source
    sequence_indices[slot_order] = by_length


def _shuffled(assignment, rng):
    """The same packs in a seeded random order."""
    offsets = assignment.pack_offsets
    order = rng.permutation(assignment.num_packs)
    sizes = np.diff(offsets)[order]
    new_offsets = np.zeros_like(offsets)
    np.cumsum(sizes, out=new_offsets[1:])
    owner = np.repeat(np.arange(order.size), sizes)
    source = offsets[order][owner] + (np.arange(assignment.num_sequences) - new_offsets[owner])
    return Assignment(new_offsets, assignment.sequence_indices[source], assignment.max_sequence_length)
