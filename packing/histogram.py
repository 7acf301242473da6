"""Sequence-length histograms: the input of every packing algorithm.

A histogram is ``counts[i]`` = number of sequences of length ``i + 1`` for
``i = 0 .. max_sequence_length - 1`` (so the last bin holds the full-length sequences).
Working on the histogram instead of the sequences is what makes the histogram packers
independent of the dataset size: Wikipedia's 16.3 M sequences are 512 numbers.
"""
import json
import os

import numpy as np

SHIPPED_HISTOGRAMS = {
    # name -> file inside packing/data (Graphcore's BERT pre-training Wikipedia histogram)
    "wikipedia-512": "wikipedia_512.json",
}


# Limits that keep every sum the library forms (sequences, tokens = sum of count x length,
# packs x L) exact in int64 and float64 arithmetic.
MAX_COUNT = 2**53
MAX_TOKENS = 2**62


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
            raise PackingError(f"{what} must contain integers, found {bad!r}")
        if np.any(np.abs(array) > MAX_COUNT):
            bad = array[np.abs(array) > MAX_COUNT][0]
            raise PackingError(f"{what} must be at most 2**53, found {bad:.6g}")
    elif array.dtype == np.uint64 and np.any(array > MAX_COUNT):
        raise PackingError(f"{what} must be at most 2**53, found {int(array[array > MAX_COUNT][0])}")
    array = array.astype(np.int64)
    return array


class Histogram:
    """Counts of sequence lengths 1..max_sequence_length.

    Attributes:
        counts: np.int64 [max_sequence_length]; ``counts[i]`` sequences have length i+1.
        max_sequence_length: L, the pack size in tokens.
        name: where the histogram came from (shipped name, file name or "lengths").
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
        # Python integers: the int64 sums could wrap around before the check.
        tokens = sum(int(c) * (i + 1) for i, c in zip(np.flatnonzero(counts).tolist(), counts[counts > 0].tolist()))
        if tokens > MAX_TOKENS:
            raise PackingError(
                f"histogram has {tokens:.3e} tokens, beyond what 64-bit arithmetic holds exactly (2**62); "
                "split the data or check the counts")
        if counts.sum() == 0:
            raise PackingError("histogram is empty (all counts are zero); there is nothing to pack")
        self.counts = counts
        self.counts.setflags(write=False)
        self.max_sequence_length = int(max_sequence_length)
        self.name = name

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_lengths(cls, lengths, max_sequence_length, name="lengths"):
        """Histogram of a list/array of per-sequence lengths (each in 1..max_sequence_length)."""
        max_sequence_length = _check_max_sequence_length(max_sequence_length)
        lengths = _as_count_array(lengths, "sequence lengths")
        check_lengths(lengths, max_sequence_length)
        counts = np.bincount(lengths, minlength=max_sequence_length + 1)[1:]
        return cls(counts, max_sequence_length, name=name)

    @classmethod
    def load(cls, source, max_sequence_length=None):
        """Load a shipped histogram by name (``wikipedia-512``), a JSON file or a ``.npy`` file.

        JSON: ``{"max_sequence_length": L, "counts": [...]}`` with L counts.
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
        histogram = cls(counts, file_length, name=name)
        if max_sequence_length is not None and int(max_sequence_length) != histogram.max_sequence_length:
            raise PackingError(
                f"{source} has max_sequence_length {histogram.max_sequence_length}, "
                f"not the requested {max_sequence_length}")
        return histogram

    # -- statistics ---------------------------------------------------------------------

    @property
    def lengths(self):
        """np.int64 [L]: the length of each bin (1..L)."""
        return np.arange(1, self.max_sequence_length + 1, dtype=np.int64)

    @property
    def num_sequences(self):
        return int(self.counts.sum())

    @property
    def num_tokens(self):
        """Real (non-padding) tokens in the dataset."""
        return int((self.counts * self.lengths).sum())

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
        nonzero = np.flatnonzero(self.counts)
        return {
            "histogram": self.name,
            "max_sequence_length": self.max_sequence_length,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "mean_length": self.num_tokens / self.num_sequences,
            "min_length": int(nonzero[0] + 1),
            "padding_fraction": self.padding_fraction,
            "theoretical_speedup": self.theoretical_speedup,
            "min_num_packs": self.min_num_packs,
        }

    def sample_lengths(self, num_sequences=None, seed=0):
        """Per-sequence lengths: the histogram itself, shuffled (``num_sequences=None``), or
        ``num_sequences`` lengths drawn i.i.d. from it. np.int64 [n]."""
        rng = np.random.default_rng(check_seed(seed))
        if num_sequences is None:
            lengths = np.repeat(self.lengths, self.counts)
            rng.shuffle(lengths)
            return lengths
        probabilities = self.counts / self.counts.sum()
        return rng.choice(self.lengths, size=int(num_sequences), p=probabilities)

    def __repr__(self):
        return (f"Histogram({self.name!r}, max_sequence_length={self.max_sequence_length}, "
                f"num_sequences={self.num_sequences})")


def _check_max_sequence_length(max_sequence_length):
    if isinstance(max_sequence_length, bool):
        raise PackingError(f"max_sequence_length must be a positive integer, got {max_sequence_length!r}")
    try:
        value = int(max_sequence_length)
    except (TypeError, ValueError, OverflowError):
        raise PackingError(f"max_sequence_length must be a positive integer, got {max_sequence_length!r}") from None
    if value != max_sequence_length or value < 1:
        raise PackingError(f"max_sequence_length must be a positive integer, got {max_sequence_length!r}")
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
