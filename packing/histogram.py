"""Sequence-length histograms: the input of every packing algorithm.

A histogram is ``counts[i]`` = number of sequences of length ``i + 1`` for
``i = 0 .. max_sequence_length - 1`` (so the last bin holds the full-length sequences).
Working on the histogram instead of the sequences is what makes the histogram packers
independent of the dataset size: Wikipedia's 16.3 M sequences are 512 numbers.

Internally a histogram keeps only its non-empty bins (:class:`LengthCounts`: the distinct
lengths that occur and their counts), and every algorithm works on those, so memory and
time grow with the number of sequences and of distinct lengths, never with the length
limit L itself: five sequences at L = 10**12 cost what they cost at L = 512. The dense
``counts`` array (O(L)) is built only when a caller asks for it.
"""
import json
import os
from typing import NamedTuple

import numpy as np

SHIPPED_HISTOGRAMS = {
    # name -> file inside packing/data (Graphcore's BERT pre-training Wikipedia histogram)
    "wikipedia-512": "wikipedia_512.json",
}


# Limits that keep every sum the library forms (sequences, tokens = sum of count x length,
# packs x L) exact in int64 and float64 arithmetic.
MAX_COUNT = 2**53
MAX_TOKENS = 2**62
# The largest length limit accepted: every length and every pack's sum stays exact in
# float64 as well as int64 (nothing is allocated per length, so this is about arithmetic).
MAX_SEQUENCE_LENGTH = 2**53


class PackingError(ValueError):
    """A user mistake (bad histogram, bad lengths, bad depth, unknown algorithm).

    The message is one line that names the problem and the fix; the command line
    prints it as ``error: ...`` and exits with status 2.
    """


def _as_count_array(values, what):
    """Validate a 1-D sequence of non-negative integers and return it as int64."""
    try:
        array = np.asarray(values)
    except Exception as exc:  # ragged lists and the like
        raise PackingError(f"{what} must be a flat list of integers ({exc})") from None
    if array.ndim != 1:
        raise PackingError(f"{what} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        raise PackingError(f"{what} is empty; give at least one value")
    if array.dtype == object and all(isinstance(value, int) and not isinstance(value, bool) for value in array):
        raise PackingError(f"{what} must be at most 2**53, found {max(array, key=abs)}")  # beyond int64
    if array.dtype == bool or not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise PackingError(f"{what} must contain integers, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.floating):
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            bad = array[~np.isfinite(array) | (array != np.round(array))][0]
            raise PackingError(f"{what} must contain integers, found {float(bad)!r}")
        if np.any(np.abs(array) > MAX_COUNT):
            bad = array[np.abs(array) > MAX_COUNT][0]
            raise PackingError(f"{what} must be at most 2**53, found {bad:.6g}")
    elif array.dtype == np.uint64 and np.any(array > MAX_COUNT):
        raise PackingError(f"{what} must be at most 2**53, found {int(array[array > MAX_COUNT][0])}")
    array = array.astype(np.int64)
    return array


class LengthCounts(NamedTuple):
    """A histogram's non-empty bins: ``lengths`` np.int64 [k] (ascending, distinct) and
    ``counts`` np.int64 [k] (each >= 1): ``counts[j]`` sequences have length ``lengths[j]``.
    O(distinct lengths), whatever L is; what every algorithm works on."""
    lengths: np.ndarray
    counts: np.ndarray


def as_length_counts(counts):
    """The :class:`LengthCounts` of a Histogram, of a LengthCounts (returned as is) or of a
    dense ``counts`` array (np.int [L], ``counts[i]`` = sequences of length i+1; O(L))."""
    if isinstance(counts, LengthCounts):
        return counts
    if isinstance(counts, Histogram):
        return counts.length_counts
    counts = np.asarray(counts, dtype=np.int64)
    nonzero = np.flatnonzero(counts)
    return LengthCounts(nonzero + 1, counts[nonzero])


def dense_counts(counts, max_sequence_length):
    """np.int64 [L]: the dense form of a LengthCounts (or a dense array, returned as int64).
    O(L): only for the algorithms that are dense by nature (nnlshp) and for callers asking."""
    if isinstance(counts, Histogram):
        counts = counts.length_counts
    if isinstance(counts, LengthCounts):
        dense = np.zeros(int(max_sequence_length), dtype=np.int64)
        dense[counts.lengths - 1] = counts.counts
        return dense
    return np.asarray(counts, dtype=np.int64)


def count_lengths(lengths):
    """LengthCounts of per-sequence lengths (np.int [n], all >= 1): a counting pass when the
    longest length is small next to n, a sort otherwise, so O(n) memory either way."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return LengthCounts(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    longest = int(lengths.max())
    if longest <= 4 * lengths.size + 2**16:
        counts = np.bincount(lengths, minlength=longest + 1)
        nonzero = np.flatnonzero(counts)
        return LengthCounts(nonzero.astype(np.int64), counts[nonzero].astype(np.int64))
    distinct, counts = np.unique(lengths, return_counts=True)
    return LengthCounts(distinct.astype(np.int64), counts.astype(np.int64))


class Histogram:
    """Counts of sequence lengths 1..max_sequence_length.

    Stored sparsely (only the lengths that occur), so its memory does not depend on L.

    Attributes:
        max_sequence_length: L, the pack size in tokens (at most MAX_SEQUENCE_LENGTH = 2**53).
        name: where the histogram came from (shipped name, file name or "lengths").
        length_counts: :class:`LengthCounts`, the non-empty bins (``distinct_lengths``,
            ``distinct_counts``); O(distinct lengths).
        counts: np.int64 [max_sequence_length], read-only; ``counts[i]`` sequences have length
            i+1. Dense, so O(L) memory and time: built on first use (and kept), for callers
            that want it; nothing in the library needs it.
    """

    def __init__(self, counts, max_sequence_length=None, name="histogram"):
        counts = _as_count_array(counts, "histogram counts")
        if np.any(counts < 0):
            first = int(np.flatnonzero(counts < 0)[0])
            raise PackingError(
                f"histogram counts must be non-negative, found {counts[first]} sequences of length {first + 1}")
        if max_sequence_length is None:
            max_sequence_length = counts.size
        max_sequence_length = _check_max_sequence_length(max_sequence_length)
        if max_sequence_length != counts.size:
            raise PackingError(
                f"histogram has {counts.size} bins but max_sequence_length is {max_sequence_length}; "
                "counts must have exactly one bin per length 1..max_sequence_length")
        nonzero = np.flatnonzero(counts)
        self._set(LengthCounts(nonzero + 1, counts[nonzero]), max_sequence_length, name)
        counts.setflags(write=False)
        self._dense = counts  # given dense (our own copy): kept for .counts

    def _set(self, length_counts, max_sequence_length, name):
        """Check (token total, emptiness) and store non-empty bins."""
        lengths, counts = length_counts
        _check_tokens(lengths, counts)
        if counts.size == 0:
            raise PackingError("histogram is empty (all counts are zero); there is nothing to pack")
        lengths, counts = lengths.astype(np.int64), counts.astype(np.int64)
        lengths.setflags(write=False)
        counts.setflags(write=False)
        self.length_counts = LengthCounts(lengths, counts)
        self.max_sequence_length = int(max_sequence_length)
        self.name = name
        self._dense = None

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_lengths(cls, lengths, max_sequence_length, name="lengths"):
        """Histogram of a list/array of per-sequence lengths (each in 1..max_sequence_length).
        O(n) memory, O(n) or O(n log n) time (n sequences), whatever L is."""
        max_sequence_length = _check_max_sequence_length(max_sequence_length)
        lengths = _as_count_array(lengths, "sequence lengths")
        check_lengths(lengths, max_sequence_length)
        histogram = cls.__new__(cls)
        histogram._set(count_lengths(lengths), max_sequence_length, name)
        return histogram

    @classmethod
    def from_length_counts(cls, lengths, counts, max_sequence_length, name="histogram"):
        """Histogram of its non-empty bins: ``counts[j]`` sequences of length ``lengths[j]``
        (each in 1..max_sequence_length; a length given twice adds up, zero counts are
        dropped). O(distinct lengths), whatever L is."""
        max_sequence_length = _check_max_sequence_length(max_sequence_length)
        lengths = _as_count_array(lengths, "histogram lengths")
        counts = _as_count_array(counts, "histogram counts")
        if lengths.size != counts.size:
            raise PackingError(f"histogram has {lengths.size} lengths but {counts.size} counts; "
                               "give one count per length")
        if np.any(counts < 0):
            first = int(np.flatnonzero(counts < 0)[0])
            raise PackingError(f"histogram counts must be non-negative, found {counts[first]} sequences of "
                               f"length {lengths[first]}")
        check_lengths(lengths, max_sequence_length)
        keep = counts > 0
        lengths, counts = lengths[keep], counts[keep]
        order = np.argsort(lengths, kind="stable")
        lengths, counts = lengths[order], counts[order]
        _check_tokens(lengths, counts)  # before adding up repeated lengths: then no sum wraps around
        starts = np.flatnonzero(np.diff(lengths, prepend=-1))
        merged = LengthCounts(lengths[starts], np.add.reduceat(counts, starts) if starts.size else counts)
        histogram = cls.__new__(cls)
        histogram._set(merged, max_sequence_length, name)
        return histogram

    @classmethod
    def load(cls, source, max_sequence_length=None):
        """Load a shipped histogram by name (``wikipedia-512``), a JSON file or a ``.npy`` file.

        JSON: ``{"max_sequence_length": L, "counts": [...]}`` with L counts, or the sparse
        ``{"max_sequence_length": L, "lengths": [...], "counts": [...]}`` (one count per
        listed length; the size of the file does not grow with L).
        ``.npy``: a 1-D integer array of counts (L is its length).
        ``max_sequence_length``, if given, must agree with the file.
        """
        source = str(source)
        if source in SHIPPED_HISTOGRAMS:
            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", SHIPPED_HISTOGRAMS[source])
            name = source
        elif os.path.exists(source):
            path, name = source, os.path.basename(source)
        else:
            shipped = ", ".join(sorted(SHIPPED_HISTOGRAMS))
            raise PackingError(f"histogram {source!r} is neither a shipped name ({shipped}) nor an existing file")
        if path.endswith(".npy"):
            try:
                counts = np.load(path, allow_pickle=False)
            except Exception as exc:
                raise PackingError(f"cannot read {source} as a .npy array: {exc}") from None
            file_length = None
        else:
            try:
                with open(path) as handle:
                    data = json.load(handle)
            except (OSError, ValueError) as exc:
                raise PackingError(f"cannot read {source} as JSON: {exc}") from None
            if not isinstance(data, dict) or "counts" not in data:
                raise PackingError(
                    f"{source} must be a JSON object {{\"max_sequence_length\": L, \"counts\": [...]}}")
            counts, file_length = data["counts"], data.get("max_sequence_length")
            if "lengths" in data:
                if file_length is None:
                    raise PackingError(f"{source} lists lengths and counts but no max_sequence_length; add it")
                histogram = cls.from_length_counts(data["lengths"], counts, file_length, name=name)
                return _agree(histogram, source, max_sequence_length)
        return _agree(cls(counts, file_length, name=name), source, max_sequence_length)

    # -- statistics ---------------------------------------------------------------------

    @property
    def distinct_lengths(self):
        """np.int64 [k]: the lengths that occur, ascending (O(distinct lengths))."""
        return self.length_counts.lengths

    @property
    def distinct_counts(self):
        """np.int64 [k]: how many sequences have each of ``distinct_lengths``."""
        return self.length_counts.counts

    @property
    def counts(self):
        """np.int64 [L], read-only: ``counts[i]`` sequences have length i+1. Dense: O(L) memory
        and time on first use (kept afterwards); use ``length_counts`` where L may be large."""
        if self._dense is None:
            dense = dense_counts(self.length_counts, self.max_sequence_length)
            dense.setflags(write=False)
            self._dense = dense
        return self._dense

    @property
    def lengths(self):
        """np.int64 [L]: the length of each bin (1..L). Dense: O(L)."""
        return np.arange(1, self.max_sequence_length + 1, dtype=np.int64)

    @property
    def num_sequences(self):
        return int(self.length_counts.counts.sum())

    @property
    def num_tokens(self):
        """Real (non-padding) tokens in the dataset."""
        lengths, counts = self.length_counts
        return int((counts * lengths).sum())

    @property
    def padding_fraction(self):
        """Fraction of padding tokens when every sequence is padded to L (no packing)."""
        return 1.0 - self.num_tokens / (self.num_sequences * self.max_sequence_length)

    @property
    def theoretical_speedup(self):
        """1 / (1 - padding fraction): the speed-up of perfect packing over padding."""
        return self.num_sequences * self.max_sequence_length / self.num_tokens

    @property
    def min_num_packs(self):
        """ceil(tokens / L): no packing of any depth can use fewer packs."""
        return -(-self.num_tokens // self.max_sequence_length)

    def statistics(self):
        """The numbers a report prints about the data itself."""
        return {
            "histogram": self.name,
            "max_sequence_length": self.max_sequence_length,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "mean_length": self.num_tokens / self.num_sequences,
            "min_length": int(self.distinct_lengths[0]),
            "padding_fraction": self.padding_fraction,
            "theoretical_speedup": self.theoretical_speedup,
            "min_num_packs": self.min_num_packs,
        }

    def sample_lengths(self, num_sequences=None, seed=0):
        """Per-sequence lengths: the histogram itself, shuffled (``num_sequences=None``), or
        ``num_sequences`` lengths drawn i.i.d. from it. np.int64 [n]."""
        rng = np.random.default_rng(check_seed(seed))
        lengths, counts = self.length_counts
        if num_sequences is None:
            lengths = np.repeat(lengths, counts)
            rng.shuffle(lengths)
            return lengths
        # Over the non-empty bins only: the same draws as over all L bins (an empty bin adds
        # 0 to the cumulative distribution, so it is never picked), without the O(L) arrays.
        probabilities = counts / counts.sum()
        return rng.choice(lengths, size=int(num_sequences), p=probabilities)

    def __repr__(self):
        return (f"Histogram({self.name!r}, max_sequence_length={self.max_sequence_length}, "
                f"num_sequences={self.num_sequences})")


def _check_tokens(lengths, counts):
    """PackingError if the histogram has more than MAX_TOKENS tokens (so no int64 sum wraps)."""
    tokens = float(np.dot(counts.astype(np.float64), lengths.astype(np.float64)))
    if tokens > MAX_TOKENS / 2:  # near the limit: exactly, in Python integers (int64 could wrap)
        tokens = sum(int(c) * int(length) for length, c in zip(lengths.tolist(), counts.tolist()))
    if tokens > MAX_TOKENS:
        raise PackingError(
            f"histogram has {tokens:.3e} tokens, beyond what 64-bit arithmetic holds exactly (2**62); "
            "split the data or check the counts")


def _agree(histogram, source, max_sequence_length):
    """``histogram``, after checking it against the ``max_sequence_length`` asked for (if any)."""
    if max_sequence_length is not None and int(max_sequence_length) != histogram.max_sequence_length:
        raise PackingError(
            f"{source} has max_sequence_length {histogram.max_sequence_length}, "
            f"not the requested {max_sequence_length}")
    return histogram


def _check_max_sequence_length(max_sequence_length):
    if isinstance(max_sequence_length, bool):
        raise PackingError(f"max_sequence_length must be a positive integer, got {max_sequence_length!r}")
    try:
        value = int(max_sequence_length)
    except (TypeError, ValueError, OverflowError):
        raise PackingError(f"max_sequence_length must be a positive integer, got {max_sequence_length!r}") from None
    if value != max_sequence_length or value < 1:
        raise PackingError(f"max_sequence_length must be a positive integer, got {max_sequence_length!r}")
    if value > MAX_SEQUENCE_LENGTH:
        digits = str(value)
        shown = f"{int(digits[:4]) / 1000:.3f}e+{len(digits) - 1}"  # 1.000e+30: no float overflow
        raise PackingError(f"max_sequence_length must be at most 2**53 ({MAX_SEQUENCE_LENGTH:,}), got {shown}; "
                           "a row of that many tokens is surely a mistake")
    return value


def check_lengths(lengths, max_sequence_length):
    """Raise PackingError unless every length is in 1..max_sequence_length."""
    if lengths.size and lengths.min() < 1:
        raise PackingError(f"sequence lengths must be at least 1, found {int(lengths.min())}")
    if lengths.size and lengths.max() > max_sequence_length:
        raise PackingError(
            f"a sequence of length {int(lengths.max())} is longer than max_sequence_length "
            f"{max_sequence_length}; truncate it or raise max_sequence_length")


def check_seed(seed):
    """A seed is a non-negative integer (numpy's generators refuse negative ones); returns it."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise PackingError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)
