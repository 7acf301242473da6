"""Token sequences in, packed rows out: the format padding-free LLM training expects.

    from packing import pack_sequences
    rows = pack_sequences(tokenized, max_sequence_length=8192, algorithm="lp",
                          max_sequences_per_pack=None)
    rows[0]     # {"input_ids", "position_ids", "seq_lengths", "cu_seqlens"} for one row
    rows.to_columns()          # dict of lists: datasets.Dataset.from_dict(...) / TRL
    rows.padded(pad_token_id)  # fixed [rows, L] numpy arrays for compiled / static shapes

A *row* is the concatenation of the sequences of one pack (at most L tokens, at most
``max_sequences_per_pack`` sequences). ``position_ids`` restart at 0 for every sequence,
``seq_lengths`` are the row's sequence lengths (TRL's padding-free collator builds its
position ids from this column) and ``cu_seqlens`` their running sum starting at 0 (the
``cu_seqlens_q/k`` of FlashAttention's varlen kernels, per row; for a batch of rows
flattened into one, :func:`batch_cu_seqlens`). Every sequence lands in exactly one row,
whole (no truncation unless asked for), so a model that keeps sequences apart (block-
diagonal attention, positions per sequence) computes on packed rows exactly what it
computes on the sequences one by one.

:func:`pack_dataset` does the same for a Hugging Face ``datasets.Dataset`` (its
``input_ids`` column, plus any other per-token columns such as ``labels``), and
:func:`pack_stream` packs an iterable larger than memory chunk by chunk. numpy only.
"""
from collections.abc import Mapping

import numpy as np

from .algorithms import check_algorithm_depth, pack
from .assign import assign
from .histogram import Histogram, PackingError, _check_max_sequence_length, check_seed


class PackedRows:
    """Packed rows in CSR form.

    Attributes:
        tokens: dict column name -> np.ndarray [total tokens] (``input_ids`` and any extra
            per-token columns), in row order, sequence after sequence.
        row_offsets: np.int64 [num_rows + 1]: row r is ``tokens[...][row_offsets[r]:row_offsets[r + 1]]``.
        seq_lengths: np.int64 [num_sequences] in row order; ``seq_row_offsets`` [num_rows + 1]
            says which belong to which row.
        sequence_indices: np.int64 [num_sequences]: the input index of each packed sequence.
        max_sequence_length: L.
        result: the :class:`packing.PackingResult` of the plan (packs, bound, gap, ...).
    """

    def __init__(self, tokens, row_offsets, seq_lengths, seq_row_offsets, sequence_indices, max_sequence_length,
                 result=None):
        self.tokens = tokens
        self.row_offsets = row_offsets
        self.seq_lengths = seq_lengths
        self.seq_row_offsets = seq_row_offsets
        self.sequence_indices = sequence_indices
        self.max_sequence_length = int(max_sequence_length)
        self.result = result

    def __len__(self):
        return int(self.row_offsets.size - 1)

    @property
    def position_ids(self):
        """np.int64 [total tokens]: 0, 1, ... restarting at every sequence."""
        return _positions(self.seq_lengths)

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        index %= len(self)
        start, stop = int(self.row_offsets[index]), int(self.row_offsets[index + 1])
        lengths = self.seq_lengths[self.seq_row_offsets[index]:self.seq_row_offsets[index + 1]]
        row = {name: values[start:stop] for name, values in self.tokens.items()}
        row["position_ids"] = _positions(lengths)
        row["seq_lengths"] = lengths
        row["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return row

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]

    def to_columns(self):
        """dict of lists (one entry per row): the token columns, ``position_ids`` and
        ``seq_lengths``, ready for ``datasets.Dataset.from_dict``."""
        positions = self.position_ids
        cut = self.row_offsets[1:-1]
        columns = {name: [part.tolist() for part in np.split(values, cut)] for name, values in self.tokens.items()}
        columns["position_ids"] = [part.tolist() for part in np.split(positions, cut)]
        columns["seq_lengths"] = [part.tolist() for part in np.split(self.seq_lengths, self.seq_row_offsets[1:-1])]
        return columns

    def padded(self, pad_token_id=0, label_pad_id=-100):
        """Fixed shapes: dict of np.int64 [num_rows, L]: every token column (``labels``
        padded with ``label_pad_id``, the others with ``pad_token_id``), ``position_ids``
        (0 on padding) and ``sequence_ids`` (1..k = which sequence of the row, 0 = padding),
        from which a block-diagonal attention mask is ``ids[:, :, None] == ids[:, None, :]``
        (and ids > 0). Dense by request: O(rows x L) memory (everything else here is O(tokens))."""
        for name, value in (("pad_token_id", pad_token_id), ("label_pad_id", label_pad_id)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PackingError(f"{name} must be an integer token id, got {value!r}")
        num_rows, L = len(self), self.max_sequence_length
        row_of_token = np.repeat(np.arange(num_rows), np.diff(self.row_offsets))
        column = np.arange(self.row_offsets[-1]) - self.row_offsets[row_of_token]
        out = {}
        for name, values in self.tokens.items():
            fill = label_pad_id if name == "labels" else pad_token_id
            array = np.full((num_rows, L), fill, dtype=np.int64)
            array[row_of_token, column] = values
            out[name] = array
        out["position_ids"] = np.zeros((num_rows, L), dtype=np.int64)
        out["position_ids"][row_of_token, column] = self.position_ids
        rank_in_row = np.arange(self.seq_lengths.size) - np.repeat(self.seq_row_offsets[:-1],
                                                                    np.diff(self.seq_row_offsets))
        out["sequence_ids"] = np.zeros((num_rows, L), dtype=np.int64)
        out["sequence_ids"][row_of_token, column] = np.repeat(rank_in_row + 1, self.seq_lengths)
        return out

    def __repr__(self):
        return (f"PackedRows(num_rows={len(self)}, num_sequences={self.seq_lengths.size}, "
                f"max_sequence_length={self.max_sequence_length})")


def _starts(lengths):
    """np.int64 [n]: where each of n consecutive sequences starts (0, l0, l0 + l1, ...)."""
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def _positions(lengths):
    """np.int64 [sum of lengths]: 0, 1, ... restarting at every sequence."""
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(_starts(lengths), lengths)


def batch_cu_seqlens(rows):
    """np.int32 [total sequences + 1]: cu_seqlens of several rows (dicts from
    ``PackedRows[i]``) concatenated into one flat batch, as flash_attn_varlen_func takes."""
    lengths = np.concatenate([np.asarray(row["seq_lengths"], dtype=np.int64) for row in rows])
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _is_whole(value):
    try:
        return int(value) == value
    except (TypeError, ValueError, OverflowError):  # None, "x", nan, inf
        return False


def _flatten(sequences, name):
    """(flat np.int64 tokens, np.int64 lengths) of a list of token sequences."""
    try:
        arrays = [np.asarray(sequence) for sequence in sequences]
    except Exception as exc:
        raise PackingError(f"{name} must be a list of token id sequences ({exc})") from None
    for index, array in enumerate(arrays):
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
            raise PackingError(f"{name}[{index}] must be a flat sequence of integer token ids, got shape "
                               f"{array.shape} and dtype {array.dtype}")
    lengths = np.fromiter((array.size for array in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)
    return flat, lengths


def pack_sequences(sequences, max_sequence_length, algorithm="lpfhp", max_sequences_per_pack=None, seed=0,
                   shuffle_rows=False, truncate=False, columns=None, **options):
    """Pack token sequences into rows of at most ``max_sequence_length`` tokens.

    Args:
        sequences: list of token id sequences (lists or 1-D integer arrays).
        max_sequence_length: L, tokens per row.
        algorithm: any name in ``packing.ALGORITHMS`` (``lpfhp``: fast; ``lp``: certified
            near-optimal; ``greedy``: next-fit in a seeded shuffled order).
        max_sequences_per_pack: depth limit (None = unlimited).
        seed: the shuffle of equal-length sequences over the plan's slots (and greedy's).
        shuffle_rows: return the rows in a seeded random order instead of plan order.
        truncate: cut sequences longer than L to L tokens instead of refusing them.
        columns: {name: list of sequences} of other per-token columns (e.g. ``labels``),
            each entry as long as its ``input_ids`` sequence; packed the same way.
        options: passed to the algorithm (e.g. ``time_limit`` for lp).

    Returns:
        :class:`PackedRows`. Empty sequences are refused (they cannot be packed and would
        vanish); a sequence longer than L is refused unless ``truncate``.
    """
    L = _check_max_sequence_length(max_sequence_length)
    depth = check_algorithm_depth(algorithm, max_sequences_per_pack)
    seed = check_seed(seed)
    flat, lengths = _flatten(sequences, "sequences")
    if lengths.size == 0:
        raise PackingError("there are no sequences to pack")
    if np.any(lengths == 0):
        raise PackingError(f"sequence {int(np.flatnonzero(lengths == 0)[0])} is empty; drop empty sequences first")
    if columns is not None and not isinstance(columns, Mapping):
        raise PackingError(f"columns must be a dict of column name -> token sequences, got {type(columns).__name__}")
    named = {"input_ids": flat}
    for name, values in (columns or {}).items():
        column_flat, column_lengths = _flatten(values, name)
        if not np.array_equal(column_lengths, lengths):
            bad = int(np.flatnonzero(column_lengths != lengths)[0]) if column_lengths.size == lengths.size else None
            where = f" at sequence {bad}" if bad is not None else f" ({column_lengths.size} sequences)"
            raise PackingError(f"column {name!r} does not match input_ids{where}")
        named[name] = column_flat
    starts = _starts(lengths)
    if np.any(lengths > L):
        if not truncate:
            index = int(np.flatnonzero(lengths > L)[0])
            raise PackingError(f"sequence {index} has {int(lengths[index])} tokens, more than max_sequence_length "
                               f"{L}; pass truncate=True or drop it")
        lengths = np.minimum(lengths, L)
    histogram = Histogram.from_lengths(lengths, L, name="sequences")
    if algorithm == "greedy" and "lengths" not in options:
        order = np.random.default_rng(seed).permutation(lengths.size)
        options = dict(options, lengths=lengths[order])
    result = pack(histogram, algorithm, depth, seed=seed, **options)
    packs = assign(result.plan, lengths, seed=seed, shuffle_packs=shuffle_rows)
    order = packs.sequence_indices
    packed_lengths = lengths[order]
    source = np.repeat(starts[order], packed_lengths) + _positions(packed_lengths)  # input index of each token
    tokens = {name: values[source] for name, values in named.items()}
    sequences_per_row = np.diff(packs.pack_offsets)
    row_tokens = np.add.reduceat(packed_lengths, packs.pack_offsets[:-1]) if len(packs) else packed_lengths[:0]
    row_offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum(row_tokens, out=row_offsets[1:])
    assert int(sequences_per_row.sum()) == order.size
    return PackedRows(tokens, row_offsets, packed_lengths, packs.pack_offsets, order, L, result)


def pack_stream(sequences, max_sequence_length, chunk_size=100_000, **kwargs):
    """Pack an iterable of token sequences (e.g. a streaming dataset) chunk by chunk: every
    ``chunk_size`` sequences are packed on their own (:func:`pack_sequences` arguments) and
    their rows yielded, so memory stays bounded by a chunk. Yields row dicts (as
    ``PackedRows[i]``); each carries ``sequence_indices``, the global input index of each of
    its sequences. A larger chunk packs tighter (more lengths to combine)."""
    if not _is_whole(chunk_size) or chunk_size < 1:
        raise PackingError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    chunk, first = [], 0
    iterator = iter(sequences)
    while True:
        for sequence in iterator:
            chunk.append(sequence)
            if len(chunk) == chunk_size:
                break
        if not chunk:
            return
        rows = pack_sequences(chunk, max_sequence_length, **kwargs)
        for index in range(len(rows)):
            row = rows[index]
            members = rows.sequence_indices[rows.seq_row_offsets[index]:rows.seq_row_offsets[index + 1]]
            row["sequence_indices"] = members + first
            yield row
        first += len(chunk)
        chunk = []


def pack_dataset(dataset, max_sequence_length, column="input_ids", extra_columns=(), **kwargs):
    """Pack a Hugging Face ``datasets.Dataset``'s ``column`` (token ids; ``extra_columns``
    such as ``labels`` go along) into a new Dataset of rows with ``input_ids``,
    ``position_ids`` and ``seq_lengths`` (TRL's padding-free format). Other columns are
    dropped (they are per sequence, not per token). ``kwargs``: :func:`pack_sequences`."""
    if column not in dataset.column_names:
        raise PackingError(f"the dataset has no column {column!r} (it has: {', '.join(dataset.column_names)})")
    for name in extra_columns:
        if name not in dataset.column_names:
            raise PackingError(f"the dataset has no column {name!r} (it has: {', '.join(dataset.column_names)})")
    rows = pack_sequences(dataset[column], max_sequence_length,
                          columns={name: dataset[name] for name in extra_columns}, **kwargs)
    packed = rows.to_columns()
    if column != "input_ids":
        packed[column] = packed.pop("input_ids")
    return type(dataset).from_dict(packed)
