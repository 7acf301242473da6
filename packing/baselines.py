"""Per-sequence baselines that need the sequences themselves: ``greedy`` and ``sort``.

``greedy`` is next-fit in stream order (T5 / torchtune style): the dataset is shuffled
with a seed, then each sequence is appended to the current pack if it fits (and the pack
is below the depth limit), otherwise the pack is closed and a new one started.
``sort`` is sorted batching: no packing at all, but batches of ``batch_size`` sequences of
similar length padded only to their longest member; its cost is that every batch has a
different shape.
"""
import numpy as np

# Random 64-bit values per length; a pack's strategy is identified by the sum of the
# values of its lengths (a multiset hash, independent of order). Two independent hashes
# make a collision between two different strategies (~ n^2 / 2^128) negligible.
_HASH_SEED = 20210707


def _multiset_hashes(max_sequence_length):
    rng = np.random.default_rng(_HASH_SEED)
    return rng.integers(0, 2**63, size=(2, max_sequence_length + 1), dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def next_fit_pack_starts(lengths, max_sequence_length, depth):
    """Start index of every pack when next-fit packs ``lengths`` in order. np.int64 [num_packs]."""
    ends = np.cumsum(lengths)
    begins = ends - lengths
    # nxt[s]: where the pack starting at s ends (exclusive); limited by capacity and depth.
    nxt = np.searchsorted(ends, begins + max_sequence_length, side="right")
    if depth is not None:
        np.minimum(nxt, np.arange(lengths.size) + depth, out=nxt)
    del ends, begins
    starts = []
    append, position, num_sequences = starts.append, 0, lengths.size
    while position < num_sequences:  # one step per pack; the chain is inherently sequential
        append(position)
        position = nxt[position]
    return np.asarray(starts, dtype=np.int64)


def plan_arrays_from_packs(lengths, starts, max_sequence_length):
    """Group concrete packs (consecutive runs of ``lengths`` beginning at ``starts``) into
    distinct strategies. Returns CSR arrays (offsets, ascending lengths, repeats)."""
    table = _multiset_hashes(max_sequence_length)
    keys = np.stack([np.add.reduceat(table[0][lengths], starts), np.add.reduceat(table[1][lengths], starts)], axis=1)
    _, first, repeats = np.unique(keys, axis=0, return_index=True, return_counts=True)
    sizes = np.diff(np.append(starts, lengths.size))[first]
    offsets = np.zeros(first.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    owner = np.repeat(np.arange(first.size), sizes)
    source = starts[first][owner] + (np.arange(offsets[-1]) - offsets[owner])
    slot_lengths = lengths[source]
    order = np.lexsort((slot_lengths, owner))  # ascending lengths within each strategy
    return offsets, slot_lengths[order], repeats.astype(np.int64)


def pack_greedy(counts, max_sequence_length, depth, seed=0, lengths=None):
    """Next-fit in stream order after a seeded shuffle of the histogram's sequences
    (or of ``lengths`` itself, in its given order, when given)."""
    if lengths is None:
        rng = np.random.default_rng(seed)
        lengths = np.repeat(np.arange(1, max_sequence_length + 1, dtype=np.int64), counts)
        rng.shuffle(lengths)
    starts = next_fit_pack_starts(lengths, max_sequence_length, depth)
    return plan_arrays_from_packs(lengths, starts, max_sequence_length)


def sorted_batching_padding(counts, batch_size):
    """Padding tokens of sorted batching: sequences sorted by length, cut into batches of
    ``batch_size``, each batch padded to its longest sequence."""
    lengths = np.arange(1, counts.size + 1, dtype=np.int64)
    descending_counts = counts[::-1]
    num_sequences = int(counts.sum())
    first_ranks = np.arange(0, num_sequences, batch_size, dtype=np.int64)
    # Length at a rank (0 = longest): the bin whose cumulative count first exceeds the rank.
    bins = np.searchsorted(np.cumsum(descending_counts), first_ranks, side="right")
    batch_max = lengths[::-1][bins]
    batch_sizes = np.minimum(batch_size, num_sequences - first_ranks)
    return int((batch_max * batch_sizes).sum() - (counts * lengths).sum())
