"""Histogram packers from the papers and the per-sequence baselines people actually run.

Every function here takes a histogram's ``counts`` (a :class:`packing.histogram.LengthCounts`,
or dense np.int64 [L] with counts[i] = sequences of length i+1), ``max_sequence_length`` L and
``depth`` (max sequences per pack; ``None`` is unlimited) and returns ``(strategies,
repeats)`` that cover the histogram (every length has at least as many slots as sequences);
:func:`packing.plan.exact_plan` makes them exact. They visit the lengths that occur, never
every length up to L.

Invariants of every packer (property-tested in tests/packing/test_packing_properties.py):
each strategy sums to at most L, has at most ``depth`` entries, and the repeats are
positive integers; with exact_plan the slots equal the histogram.
"""
import bisect

from .histogram import as_length_counts


def _descending_lengths(counts):
    """(length, count) pairs for the non-empty bins, longest first."""
    lengths, counts = as_length_counts(counts)
    return list(zip(lengths[::-1].tolist(), counts[::-1].tolist()))


def pack_none(counts, max_sequence_length, depth):
    """One sequence per pack: the unpacked baseline."""
    bins = _descending_lengths(counts)
    return [(length,) for length, _ in bins], [n for _, n in bins]


class _OpenPacks:
    """Open packs grouped by their remaining space, for the histogram packers.

    ``groups[space]`` is a stack of ``[count, pack]`` (count identical packs); ``spaces``
    is the sorted list of spaces that have groups, so best/worst fit is one bisect.
    Packs that are full (no space or at the depth limit) go to ``closed``.
    """

    def __init__(self, max_sequence_length, depth):
        self.depth = max_sequence_length if depth is None else depth
        self.groups = {}
        self.spaces = []
        self.closed = []

    def add(self, pack, count, space):
        if count <= 0:
            return
        if len(pack) >= self.depth or space == 0:
            self.closed.append((pack, count))
            return
        if space not in self.groups:
            self.groups[space] = []
            bisect.insort(self.spaces, space)
        self.groups[space].append([count, pack])

    def pop(self, space):
        stack = self.groups[space]
        count, pack = stack.pop()
        if not stack:
            del self.groups[space]
            self.spaces.pop(bisect.bisect_left(self.spaces, space))
        return count, pack

    def worst_fit(self, length):
        """The largest space that fits ``length``, or None."""
        if self.spaces and self.spaces[-1] >= length:
            return self.spaces[-1]
        return None

    def best_fit(self, length):
        """The smallest space that fits ``length``, or None."""
        index = bisect.bisect_left(self.spaces, length)
        return self.spaces[index] if index < len(self.spaces) else None

    def result(self):
        packs = list(self.closed)
        for space in self.spaces:
            packs.extend((pack, count) for count, pack in self.groups[space])
        return [pack for pack, _ in packs], [count for _, count in packs]


def _open_packs(packs, length, remaining, max_sequence_length):
    """Nothing open fits ``length``: open packs holding as many copies of it as fit (and the
    depth allows), then one pack with the rest. Sequence by sequence, worst fit and best
    fit both do exactly this: the newly opened pack is the only one with room."""
    while remaining > 0:
        repeat = min(max_sequence_length // length, packs.depth, remaining)
        num_packs = remaining // repeat
        packs.add((length,) * repeat, num_packs, max_sequence_length - repeat * length)
        remaining -= num_packs * repeat


def pack_spfhp(counts, max_sequence_length, depth):
    """Shortest-pack-first histogram packing (Krell et al.): worst fit on the sorted histogram.

    Lengths are visited longest first; all sequences of a length go to the open packs
    with the most space left (a group of identical packs is split if it has more packs
    than there are sequences); when none fits, the rest open new packs, as many copies of
    the length per pack as fit (so 100 sequences of 171 tokens at L = 512 take 34 packs,
    not 100). O(distinct lengths^2) at most.
    """
    packs = _OpenPacks(max_sequence_length, depth)
    for length, remaining in _descending_lengths(counts):
        while remaining > 0:
            space = packs.worst_fit(length)
            if space is None:
                _open_packs(packs, length, remaining, max_sequence_length)
                break
            count, pack = packs.pop(space)
            if count > remaining:
                packs.add(pack, count - remaining, space)
            used = min(count, remaining)
            remaining -= used
            packs.add(pack + (length,), used, space - length)
    return packs.result()


def pack_lpfhp(counts, max_sequence_length, depth):
    """Longest-pack-first histogram packing (Krell et al., appendix): best fit with
    count splitting.

    Like SPFHP but each length goes to the open packs with the *least* space that still
    fits, and a length that fits several times into the space (or into an empty pack) is
    added that many times at once (e.g. 256 + 256), splitting the count.
    """
    packs = _OpenPacks(max_sequence_length, depth)
    depth_limit = packs.depth
    for length, remaining in _descending_lengths(counts):
        while remaining > 0:
            space = packs.best_fit(length)
            if space is None:
                _open_packs(packs, length, remaining, max_sequence_length)
                break
            count, pack = packs.pop(space)
            repeat = min(space // length, depth_limit - len(pack), remaining)
            used = min(count, remaining // repeat)
            if count > used:
                packs.add(pack, count - used, space)
            remaining -= used * repeat
            packs.add(pack + (length,) * repeat, used, space - repeat * length)
    return packs.result()


def _fit_decreasing(counts, max_sequence_length, depth, best):
    """Per-sequence first-fit / best-fit decreasing, simulated exactly on the histogram.

    Sequences of equal length are interchangeable, so item-by-item FFD/BFD can be
    replayed on groups of identical bins (in creation order, which is FFD's order and
    BFD's tie-break). A bin chosen for one sequence of length l stays the chosen bin
    until it cannot take another l, so each group absorbs ``k = min(space // l, depth
    left)`` sequences per bin at once; a group that is only partly used splits, its
    pieces keeping its place in the order (keys are tuples: the pieces of ``key`` are
    ``key + (0,)``, ``key + (1,)``, ``key + (2,)``).

    O((distinct lengths + bins touched) log): groups that can take the current length sit in a sorted
    list (by order for FFD, by (space, order) for BFD) and every group visited for a
    length leaves it (it is full for that length) except the last; the others wait in a
    heap by space until the lengths come down to what they can take.
    """
    import heapq

    depth_limit = max_sequence_length if depth is None else depth
    eligible = []  # sorted sort-keys; group data in `data`
    data = {}  # order key -> [count, space, pack]
    waiting = []  # heap of (-space, order key)
    closed = []
    counter = [0]

    def sort_key(key, space):
        return (space, key) if best else key

    def place(key, group):
        count, space, pack = group
        if space == 0 or len(pack) >= depth_limit:
            closed.append((key, group))
        else:
            data[key] = group
            heapq.heappush(waiting, (-space, key))

    for length, remaining in _descending_lengths(counts):
        while waiting and -waiting[0][0] >= length:
            space, key = heapq.heappop(waiting)
            bisect.insort(eligible, sort_key(key, -space))
        while remaining and eligible:
            entry = eligible.pop(0)
            key = entry[1] if best else entry
            count, space, pack = data.pop(key)
            per_bin = min(space // length, depth_limit - len(pack))
            full_bins = min(count, remaining // per_bin)
            remaining -= full_bins * per_bin
            if full_bins:
                place(key + (0,), [full_bins, space - per_bin * length, pack + (length,) * per_bin])
            left = count - full_bins
            if left and remaining:  # remaining < per_bin: one bin takes the rest
                place(key + (1,), [1, space - remaining * length, pack + (length,) * remaining])
                remaining, left = 0, left - 1
            if left:  # untouched bins keep their place (and stay eligible)
                data[key + (2,)] = [left, space, pack]
                bisect.insort(eligible, sort_key(key + (2,), space))
        while remaining > 0:
            per_bin = min(max_sequence_length // length, depth_limit, remaining)
            num_bins = remaining // per_bin
            counter[0] += 1
            place((counter[0],), [num_bins, max_sequence_length - per_bin * length, (length,) * per_bin])
            remaining -= num_bins * per_bin
    everything = closed + [(key, group) for key, group in data.items()]
    everything.sort(key=lambda item: item[0])
    return [group[2] for _, group in everything], [group[0] for _, group in everything]


def pack_ffd(counts, max_sequence_length, depth):
    """First-fit decreasing: each sequence, longest first, into the first bin it fits."""
    return _fit_decreasing(counts, max_sequence_length, depth, best=False)


def pack_bfd(counts, max_sequence_length, depth):
    """Best-fit decreasing: each sequence, longest first, into the fullest bin it fits."""
    return _fit_decreasing(counts, max_sequence_length, depth, best=True)
