"""Lower bounds on the number of packs, cheap enough to attach to every result.

Each is a number of packs that *no* plan of the histogram at the given depth can beat:

- ``tokens``: ceil(tokens / L), every pack holds at most L tokens;
- ``depth``: ceil(sequences / depth), every pack holds at most ``depth`` sequences;
- ``l2``: Martello & Toth's L2 bound (1990), which adds what the token bound misses: long
  sequences that no partner fits beside. For a threshold k <= L/2, sequences longer than
  L - k each need a pack that no sequence of length >= k can join, sequences in
  (L/2, L - k] need a pack each too, and the sequences in [k, L/2] must fit in what those
  packs leave free or open new ones. It holds at any depth (a depth limit only removes
  plans). O(distinct lengths) with suffix sums, at the thresholds where it can change.

``lp`` adds a fourth, usually the strongest: the LP bound of its column generation
(see packing/lp.py). :func:`packing.pack` reports the best of all of them as
``lp_bound_packs`` and the gap of the plan against it.
"""
import numpy as np

from .histogram import as_length_counts


def _suffix_sums(lengths, counts):
    """(C, T) as functions of x (np.int64 arrays of points): C(x) = sequences of length >= x,
    T(x) = their tokens, from the non-empty bins (ascending lengths). O(k) to build."""
    C = np.zeros(counts.size + 1, dtype=np.int64)
    T = np.zeros(counts.size + 1, dtype=np.int64)
    C[:-1] = np.cumsum(counts[::-1])[::-1]
    T[:-1] = np.cumsum((counts * lengths)[::-1])[::-1]

    def at(x):
        index = np.searchsorted(lengths, x, side="left")  # first bin with length >= x
        return C[index], T[index]
    return at


def token_bound(counts, max_sequence_length):
    """ceil(tokens / L)."""
    lengths, counts = as_length_counts(counts)
    tokens = int((counts * lengths).sum())
    return -(-tokens // int(max_sequence_length))


def depth_bound(num_sequences, depth):
    """ceil(sequences / depth); ``depth`` None (unlimited) gives 1 for a non-empty histogram."""
    if depth is None:
        return 1 if num_sequences else 0
    return -(-int(num_sequences) // int(depth))


def martello_toth_l2(counts, max_sequence_length):
    """Martello & Toth's L2 lower bound on the number of packs (valid at any depth).

    The bound is a maximum over thresholds k = 0..L/2 of a function that only changes where
    k or L - k + 1 crosses a length that occurs, so it is evaluated at those points only:
    O(distinct lengths log), whatever L is."""
    L = int(max_sequence_length)
    lengths, counts = as_length_counts(counts)
    suffix = _suffix_sums(lengths, counts)
    half = L // 2  # "small" means length <= L / 2, "big" means length > L / 2
    # Every k where a term can change: k = l and l + 1 (T(max(k, 1)) drops past a length l)
    # and k = L - l, L - l + 1 (C(L - k + 1) grows as L - k + 1 passes l); plus k = 0, 1.
    k = np.concatenate([[0, 1], lengths, lengths + 1, L - lengths, L - lengths + 1])
    k = np.unique(k[(k >= 0) & (k <= half)])
    num_big, big_tokens = suffix(np.array([half + 1]))
    alone_count, alone_tokens = suffix(L - k + 1)  # lengths >= this have no partner of length >= k
    num_middle = num_big - alone_count  # alone + (L/2, L - k]
    room = num_middle * L - (big_tokens - alone_tokens)
    small_tokens = suffix(np.maximum(k, 1))[1] - big_tokens
    overflow = np.maximum(small_tokens - room, 0)
    return int((num_big + -(-overflow // L)).max())


def lower_bounds(counts, max_sequence_length, depth):
    """{"tokens", "depth", "l2"}: the cheap bounds on the packs of any plan at ``depth``.
    ``counts``: a Histogram, its LengthCounts or dense counts."""
    counts = as_length_counts(counts)
    return {"tokens": token_bound(counts, max_sequence_length),
            "depth": depth_bound(int(counts.counts.sum()), depth),
            "l2": martello_toth_l2(counts, max_sequence_length)}
