"""Per-sequence baselines that need the sequences themselves: ``greedy`` and ``sort``.

``greedy`` is next-fit in stream order (T5 / torchtune style): the dataset is shuffled
with a seed, then each sequence is appended to the current pack if it fits (and the pack
is below the depth limit), otherwise the pack is closed and a new one started.
``sort`` is sorted batching: no packing at all, but batches of ``batch_size`` sequences of
similar length padded only to their longest member; its cost is that every batch has a
different shape.
"""
import numpy as np

from .histogram import as_length_counts

# Random 64-bit values per length; a pack's strategy is identified by the sum of the
# values of its lengths (a multiset hash, independent of order). Two independent hashes
# make a collision between two different strategies (~ n^2 / 2^128) negligible.
_HASH_SEED = 20210707


def _draws(positions):
    """np.uint64 [k]: draws number ``positions`` (ascending) of ``integers(0, 2**63)`` from the
    hash generator, jumping over the others (PCG64 advances in O(log) steps; every value of
    this range takes exactly one 64-bit output)."""
    rng = np.random.default_rng(_HASH_SEED)
    out = np.empty(len(positions), dtype=np.uint64)
    done = 0
    for index, position in enumerate(positions):
        rng.bit_generator.advance(position - done)
        out[index] = rng.integers(0, 2**63, size=1, dtype=np.uint64)[0]
        done = position + 1
    return out


def _length_hashes(lengths, max_sequence_length):
    """(h0, h1), np.uint64 [n] each: the two multiset-hash values of each length, i.e. entry
    ``lengths`` of the rows of ``default_rng(_HASH_SEED).integers(0, 2**63, size=(2, L + 1))
    * 2 + 1``, without building that O(L) table: a prefix up to the longest length when that
    is small next to n, else one jump of the generator per distinct length."""
    L = int(max_sequence_length)
    longest = int(lengths.max()) if lengths.size else 0
    if longest <= 4 * lengths.size + 2**16:
        rng = np.random.default_rng(_HASH_SEED)
        first = rng.integers(0, 2**63, size=longest + 1, dtype=np.uint64)
        rng.bit_generator.advance(L - longest)  # row 1 starts at draw L + 1
        second = rng.integers(0, 2**63, size=longest + 1, dtype=np.uint64)
        table, index = (first, second), lengths
    else:
        distinct, index = np.unique(lengths, return_inverse=True)
        positions = distinct.tolist()
        table = (_draws(positions), _draws([L + 1 + position for position in positions]))
    return tuple((values * np.uint64(2) + np.uint64(1))[index] for values in table)


def _next_pointers(lengths, max_sequence_length, depth):
    """nxt[s]: where a next-fit pack starting at sequence s ends (exclusive)."""
    ends = np.cumsum(lengths)
    nxt = np.searchsorted(ends, ends - lengths + max_sequence_length, side="right")
    if depth is not None:
        np.minimum(nxt, np.arange(lengths.size) + depth, out=nxt)
    return nxt


def next_fit_pack_starts_reference(lengths, max_sequence_length, depth):
    """The obvious sequential next-fit: one Python step per pack (slow, for testing)."""
    nxt = _next_pointers(lengths, max_sequence_length, depth)
    starts, position = [], 0
    while position < lengths.size:
        starts.append(position)
        position = int(nxt[position])
    return np.asarray(starts, dtype=np.int64)


def next_fit_pack_starts(lengths, max_sequence_length, depth, block_size=2048):
    """Start index of every pack when next-fit packs ``lengths`` in order. np.int64 [num_packs].

    The chain of pack starts is sequential, but chains started at different points merge
    after a few packs. So: split the stream into blocks, follow a chain from every block
    boundary at once (vectorised over blocks), then repair each block from the true
    entry point of the chain (the previous block's exit) until it meets the guessed chain;
    from there on the two coincide. Same result as the sequential loop.
    """
    num_sequences = lengths.size
    nxt = _next_pointers(lengths, max_sequence_length, depth)
    nxt = np.append(nxt, num_sequences)  # sentinel: the end points to itself
    block_starts = np.arange(0, num_sequences, block_size, dtype=np.int64)
    block_ends = np.minimum(block_starts + block_size, num_sequences)
    on_chain = np.zeros(num_sequences + 1, dtype=bool)
    position = block_starts.copy()
    active = np.arange(block_starts.size)
    while active.size:
        on_chain[position[active]] = True
        position[active] = nxt[position[active]]
        active = active[position[active] < block_ends[active]]
    guessed_exit = position  # first chain node at or after each block's end
    true_exit = int(guessed_exit[0])  # block 0's chain starts at 0: it is the true one
    for block in range(1, block_starts.size):
        start, end = int(block_starts[block]), int(block_ends[block])
        guess, true = start, true_exit
        while guess != true and guess < end and true < end:
            if guess < true:  # a guessed node the true chain skips
                on_chain[guess] = False
                guess = int(nxt[guess])
            else:
                on_chain[true] = True
                true = int(nxt[true])
        if guess == true:
            true_exit = int(guessed_exit[block])
            continue
        while guess < end:
            on_chain[guess] = False
            guess = int(nxt[guess])
        while true < end:
            on_chain[true] = True
            true = int(nxt[true])
        true_exit = true
    return np.flatnonzero(on_chain[:num_sequences])


def plan_arrays_from_packs(lengths, starts, max_sequence_length):
    """Group concrete packs (consecutive runs of ``lengths`` beginning at ``starts``) into
    distinct strategies. Returns CSR arrays (offsets, ascending lengths, repeats)."""
    first, second = _length_hashes(lengths, max_sequence_length)
    key = np.add.reduceat(first, starts)
    check = np.add.reduceat(second, starts)
    _, first, inverse, repeats = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    if not np.array_equal(check[first][inverse], check):  # a 64-bit collision: group exactly by both
        _, first, repeats = np.unique(np.stack([key, check], axis=1), axis=0, return_index=True, return_counts=True)
    sizes = np.diff(np.append(starts, lengths.size))[first]
    offsets = np.zeros(first.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    owner = np.repeat(np.arange(first.size), sizes)
    source = starts[first][owner] + (np.arange(offsets[-1]) - offsets[owner])
    slot_lengths = lengths[source]
    order = np.lexsort((slot_lengths, owner))  # ascending lengths within each strategy
    return offsets, slot_lengths[order], repeats.astype(np.int64)


def pack_greedy(lengths, max_sequence_length, depth):
    """Next-fit over ``lengths`` (np.int64 [n]) in the given order; the caller shuffles."""
    starts = next_fit_pack_starts(lengths, max_sequence_length, depth)
    return plan_arrays_from_packs(lengths, starts, max_sequence_length)


def sorted_batching_padding(counts, batch_size):
    """Padding tokens of sorted batching: sequences sorted by length, cut into batches of
    ``batch_size``, each batch padded to its longest sequence. ``counts``: LengthCounts (or
    dense); O(distinct lengths + batches)."""
    lengths, counts = as_length_counts(counts)
    num_sequences = int(counts.sum())
    first_ranks = np.arange(0, num_sequences, batch_size, dtype=np.int64)
    # Length at a rank (0 = longest): the bin whose cumulative count first exceeds the rank.
    bins = np.searchsorted(np.cumsum(counts[::-1]), first_ranks, side="right")
    batch_max = lengths[::-1][bins]
    batch_sizes = np.minimum(batch_size, num_sequences - first_ranks)
    return int((batch_max * batch_sizes).sum() - (counts * lengths).sum())
