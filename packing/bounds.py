"""Lower bounds on the number of packs, cheap enough to attach to every result.

Each is a number of packs that *no* plan of the histogram at the given depth can beat:

- ``tokens``: ceil(tokens / L), every pack holds at most L tokens;
- ``depth``: ceil(sequences / depth), every pack holds at most ``depth`` sequences;
- ``l2``: Martello & Toth's L2 bound (1990), which adds what the token bound misses: long
  sequences that no partner fits beside. For a threshold k <= L/2, sequences longer than
  L - k each need a pack that no sequence of length >= k can join, sequences in
  (L/2, L - k] need a pack each too, and the sequences in [k, L/2] must fit in what those
  packs leave free or open new ones. It holds at any depth (a depth limit only removes
  plans). O(L) with suffix sums.

``lp`` adds a fourth, usually the strongest: the LP bound of its column generation
(see packing/lp.py). :func:`packing.pack` reports the best of all of them as
``lp_bound_packs`` and the gap of the plan against it.
"""
import numpy as np


def _suffix_sums(counts):
    """(C, T), np.int64 [L + 2]: C[x] = sequences of length >= x, T[x] = their tokens, x = 0..L+1."""
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.arange(1, counts.size + 1, dtype=np.int64)
    C = np.zeros(counts.size + 2, dtype=np.int64)
    T = np.zeros(counts.size + 2, dtype=np.int64)
    C[1:-1] = np.cumsum(counts[::-1])[::-1]
    T[1:-1] = np.cumsum((counts * lengths)[::-1])[::-1]
    C[0], T[0] = C[1], T[1]
    return C, T


def token_bound(counts, max_sequence_length):
    """ceil(tokens / L)."""
    tokens = int((np.asarray(counts, dtype=np.int64) * np.arange(1, len(counts) + 1)).sum())
    return -(-tokens // int(max_sequence_length))


def depth_bound(num_sequences, depth):
    """ceil(sequences / depth); ``depth`` None (unlimited) gives 1 for a non-empty histogram."""
    if depth is None:
        return 1 if num_sequences else 0
    return -(-int(num_sequences) // int(depth))


def martello_toth_l2(counts, max_sequence_length):
    """Martello & Toth's L2 lower bound on the number of packs (valid at any depth)."""
    L = int(max_sequence_length)
    C, T = _suffix_sums(counts)
    half = L // 2  # "small" means length <= L / 2, "big" means length > L / 2
    k = np.arange(0, half + 1, dtype=np.int64)
    alone_from = L - k + 1  # lengths >= this have no partner of length >= k
    num_big = C[half + 1]  # alone + (L/2, L - k]
    num_middle = num_big - C[alone_from]
    room = num_middle * L - (T[half + 1] - T[alone_from])
    small_tokens = T[np.maximum(k, 1)] - T[half + 1]
    overflow = np.maximum(small_tokens - room, 0)
    return int((num_big + -(-overflow // L)).max())


def lower_bounds(counts, max_sequence_length, depth):
    """{"tokens", "depth", "l2"}: the cheap bounds on the packs of any plan at ``depth``."""
    counts = np.asarray(counts, dtype=np.int64)
    return {"tokens": token_bound(counts, max_sequence_length),
            "depth": depth_bound(int(counts.sum()), depth),
            "l2": martello_toth_l2(counts, max_sequence_length)}
