"""Build packed batches from unpacked BERT samples and a pack assignment; validate batches.

Input samples use the NVIDIA / MLPerf HDF5 field names, one row per unpacked sequence
(padded to any width ``S0``):

==========================  =========  ==============================================
field                       shape      meaning
==========================  =========  ==============================================
input_ids                   [N, S0]    tokens (already masked), 0 = padding
input_mask                  [N, S0]    1 for real tokens (a prefix of the row); optional:
                                       without it the length is the count of non-zero ids
segment_ids                 [N, S0]    token type ids
masked_lm_positions         [N, P]     positions of the masked tokens, 0 = unused slot
                                       (position 0 is [CLS], never masked)
masked_lm_ids               [N, P]     original tokens at those positions
next_sentence_labels        [N]        NSP label
==========================  =========  ==============================================

The assignment is ``packing.Assignment`` (or anything with the same two CSR arrays):
pack p holds samples ``sequence_indices[pack_offsets[p]:pack_offsets[p + 1]]``, in that
order. The output is the packed batch of docs/design.md as numpy arrays (int64, and
float32 ``nsp_weights``): sequences side by side in natural order, each with its own
[CLS], positions restarting at 0, ``sequence_ids`` 1..K, the masked tokens of the pack in
``M`` fixed slots (the seeds' rule M = masked tokens of a full-length sequence + K - 1).

Everything is vectorised with numpy index arithmetic over all tokens of all packs (no
Python loop over packs or sequences), so a data loader can collate thousands of packs at a
time. No torch here: the ``pack`` data step uses this module too.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional

import numpy as np

__all__ = [
    "BatchError",
    "PackSlice",
    "masked_tokens_per_pack",
    "sample_lengths",
    "slice_assignment",
    "one_per_pack",
    "PackLayout",
    "pack_tokens",
    "per_sequence",
    "collate",
    "collate_unpacked",
    "validate_batch",
]

TOKEN_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids")
MLM_FIELDS = ("mlm_positions", "mlm_labels", "mlm_sequence_ids")
SEQUENCE_FIELDS = ("cls_positions", "nsp_labels", "nsp_weights")


class BatchError(ValueError):
    """A batch (or the samples/assignment it is built from) is inconsistent; one-line message."""


class PackSlice(NamedTuple):
    """A minimal assignment (the CSR arrays of ``packing.Assignment``)."""

    pack_offsets: np.ndarray
    sequence_indices: np.ndarray

    @property
    def num_packs(self) -> int:
        return len(self.pack_offsets) - 1


def masked_tokens_per_pack(mask_tokens: int, max_sequences_per_pack: int) -> int:
    """The seeds' M: masked tokens of one full-length sequence + K - 1.

    Each of the K packed sequences rounds its own 15 % up, which adds at most one token per
    extra sequence (Graphcore: ``mask_tokens += max_sequences_per_pack - 1``).
    """
    return int(mask_tokens) + int(max_sequences_per_pack) - 1


def sample_lengths(samples: Mapping[str, np.ndarray]) -> np.ndarray:
    """Real-token count of every sample: its ``input_mask`` sum.

    Without ``input_mask`` (arrays built in code for pre-training, whose vocabulary has [PAD]
    at id 0): the count of non-zero ids. Tokenised text always passes ``input_mask`` (the
    tokenizer's lengths): with a vocabulary whose id 0 is not [PAD] the ids cannot tell."""
    if "input_mask" in samples:
        return np.asarray(samples["input_mask"]).astype(bool).sum(axis=1).astype(np.int64)
    return (np.asarray(samples["input_ids"]) != 0).sum(axis=1).astype(np.int64)


def slice_assignment(assignment: Any, start: int, stop: int) -> PackSlice:
    """Packs ``start:stop`` of ``assignment`` as a ``PackSlice`` (offsets rebased to 0)."""
    offsets = np.asarray(assignment.pack_offsets, dtype=np.int64)
    num_packs = len(offsets) - 1
    if not 0 <= start <= stop <= num_packs:
        raise BatchError(f"pack slice {start}:{stop} is outside the assignment's {num_packs} packs")
    window = offsets[start : stop + 1]
    indices = np.asarray(assignment.sequence_indices, dtype=np.int64)[window[0] : window[-1]]
    return PackSlice(window - window[0], indices)


def one_per_pack(sequence_indices) -> PackSlice:
    """The unpacked layout as an assignment: every sequence alone in its own pack."""
    indices = np.asarray(sequence_indices, dtype=np.int64)
    return PackSlice(np.arange(len(indices) + 1, dtype=np.int64), indices)


class PackLayout(NamedTuple):
    """Where every sequence of an assignment goes (arrays over sequences in pack order)."""

    offsets: np.ndarray  # [P + 1]
    order: np.ndarray  # [n] sample index
    pack_of: np.ndarray  # [n] pack
    slot: np.ndarray  # [n] 0-based slot k in its pack
    start: np.ndarray  # [n] first column in its pack
    lengths: np.ndarray  # [n] tokens


def pack_tokens(samples, assignment, S: int, K: int):
    """Token and per-sequence fields shared by every task's collate; returns (batch, layout).

    A task's collate adds its own per-sequence fields with ``per_sequence(layout, ...)``."""
    offsets = np.asarray(assignment.pack_offsets, dtype=np.int64)
    order = np.asarray(assignment.sequence_indices, dtype=np.int64)  # sample index, in pack order
    num_packs = len(offsets) - 1
    num_sequences = len(order)
    if num_packs < 0 or offsets[0] != 0 or offsets[-1] != num_sequences or np.any(np.diff(offsets) < 0):
        raise BatchError("assignment: pack_offsets must rise from 0 to len(sequence_indices)")

    input_ids = np.asarray(samples["input_ids"])
    num_samples = input_ids.shape[0]
    if num_sequences and (order.min() < 0 or order.max() >= num_samples):
        raise BatchError(f"assignment: sequence index outside the {num_samples} samples")

    sequences_per_pack = np.diff(offsets)
    if num_packs and sequences_per_pack.max(initial=0) > K:
        pack = int(np.argmax(sequences_per_pack))
        raise BatchError(
            f"pack {pack} holds {sequences_per_pack[pack]} sequences but max_sequences_per_pack is {K}; "
            "pack with a depth limit of at most K"
        )

    # Per sequence (in pack order): its pack, its slot k (0-based) and its start column.
    pack_of = np.repeat(np.arange(num_packs, dtype=np.int64), sequences_per_pack)
    slot = np.arange(num_sequences, dtype=np.int64) - offsets[pack_of]
    lengths = sample_lengths(samples)[order]
    if num_sequences and lengths.min() < 1:
        raise BatchError(f"sample {int(order[np.argmin(lengths)])} is empty")
    token_end = np.concatenate([[0], np.cumsum(lengths)])  # exclusive prefix sums over all tokens
    start = token_end[:-1] - token_end[offsets[pack_of]]
    pack_lengths = token_end[offsets[1:]] - token_end[offsets[:-1]]
    if num_packs and pack_lengths.max(initial=0) > S:
        pack = int(np.argmax(pack_lengths))
        raise BatchError(f"pack {pack} holds {pack_lengths[pack]} tokens but max_sequence_length is {S}")

    # Tokens: a pack's sequences are consecutive in pack order and fill its row from column 0,
    # so the real tokens in row-major order are the samples' real tokens in pack order: boolean
    # masks move them (about 10x faster than scattering by (row, column) pairs).
    taken = np.arange(input_ids.shape[1])[None, :] < lengths[:, None]  # [n, width]: real tokens
    filled = np.arange(S)[None, :] < pack_lengths[:, None]  # [P, S]: where they go
    batch = {name: np.zeros((num_packs, S), dtype=np.int64) for name in TOKEN_FIELDS}
    batch["input_ids"][filled] = input_ids[order][taken]
    batch["segment_ids"][filled] = np.asarray(samples["segment_ids"])[order][taken]
    batch["position_ids"][filled] = np.nonzero(taken)[1]  # restart at 0 for every sequence
    batch["sequence_ids"][filled] = np.repeat(slot + 1, lengths)
    batch["cls_positions"] = np.zeros((num_packs, K), dtype=np.int64)
    batch["cls_positions"][pack_of, slot] = start
    return batch, PackLayout(offsets, order, pack_of, slot, start, lengths)


def per_sequence(layout: PackLayout, values, K: int, dtype) -> np.ndarray:
    """``[P, K, ...]``: each sequence's value (a scalar or a row, e.g. multi-hot labels) in its slot."""
    values = np.asarray(values)
    values = values.reshape(-1) if values.ndim <= 1 else values
    out = np.zeros((len(layout.offsets) - 1, K) + values.shape[1:], dtype=dtype)
    out[layout.pack_of, layout.slot] = values[layout.order]
    return out


def collate(
    samples: Mapping[str, np.ndarray],
    assignment: Any,
    *,
    max_sequence_length: int,
    max_sequences_per_pack: int,
    max_masked_tokens_per_pack: int,
) -> Dict[str, np.ndarray]:
    """Packed pre-training batch of ``assignment.num_packs`` packs (the fields of docs/design.md, numpy).

    Shapes: ``[B, S]`` token fields with S = ``max_sequence_length``, ``[B, M]`` masked
    slots with M = ``max_masked_tokens_per_pack``, ``[B, K]`` per-sequence fields with
    K = ``max_sequences_per_pack``. Raises ``BatchError`` if a pack is too long, holds
    too many sequences or masked tokens, or a sample is malformed.
    """
    S, K, M = int(max_sequence_length), int(max_sequences_per_pack), int(max_masked_tokens_per_pack)
    batch, layout = pack_tokens(samples, assignment, S, K)
    offsets, order, pack_of, slot, start, lengths = layout
    num_packs = len(offsets) - 1
    batch["nsp_labels"] = per_sequence(layout, samples["next_sentence_labels"], K, np.int64)
    batch["nsp_weights"] = per_sequence(layout, np.ones(len(np.asarray(samples["input_ids"]))), K, np.float32)

    # Masked tokens: the pack's sequences in order, each with its valid slots in order.
    masked_positions = np.asarray(samples["masked_lm_positions"])[order].astype(np.int64)  # [n, P]
    masked_ids = np.asarray(samples["masked_lm_ids"])[order].astype(np.int64)
    valid = masked_positions > 0
    beyond = np.any(valid & (masked_positions >= lengths[:, None]), axis=1)
    if beyond.any():
        bad = int(np.argmax(beyond))
        raise BatchError(f"sample {int(order[bad])}: a masked_lm_position lies beyond its {lengths[bad]} tokens")
    masked_per_sequence = valid.sum(axis=1)
    masked_end = np.concatenate([[0], np.cumsum(masked_per_sequence)])
    masked_per_pack = masked_end[offsets[1:]] - masked_end[offsets[:-1]]
    if num_packs and masked_per_pack.max(initial=0) > M:
        pack = int(np.argmax(masked_per_pack))
        raise BatchError(
            f"pack {pack} holds {masked_per_pack[pack]} masked tokens but max_masked_tokens_per_pack is {M}; "
            "use M = masked tokens per sequence + K - 1"
        )
    # Row-major over `valid` is by sequence, then slot order: a pack's masked tokens fill its
    # first masked_per_pack slots in that order (boolean masks again, as for the tokens).
    filled = np.arange(M)[None, :] < masked_per_pack[:, None]
    for name in MLM_FIELDS:
        batch[name] = np.zeros((num_packs, M), dtype=np.int64)
    batch["mlm_positions"][filled] = (start[:, None] + masked_positions)[valid]
    batch["mlm_labels"][filled] = masked_ids[valid]
    batch["mlm_sequence_ids"][filled] = np.repeat(slot + 1, masked_per_sequence)
    return batch


def collate_unpacked(
    samples: Mapping[str, np.ndarray],
    sequence_indices=None,
    *,
    max_sequence_length: int,
    max_masked_tokens_per_pack: int,
) -> Dict[str, np.ndarray]:
    """Unpacked batch: each sample alone (K = 1), through the same ``collate``."""
    if sequence_indices is None:
        sequence_indices = np.arange(np.asarray(samples["input_ids"]).shape[0])
    return collate(
        samples,
        one_per_pack(sequence_indices),
        max_sequence_length=max_sequence_length,
        max_sequences_per_pack=1,
        max_masked_tokens_per_pack=max_masked_tokens_per_pack,
    )


# ----------------------------------------------------------------------------- validation


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; no torch import needed here
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _row(rows, b) -> int:
    return int(rows[b]) if rows is not None else int(b)


def validate_batch(batch: Mapping[str, Any], config: Optional[Any] = None, *, rows: Optional[Any] = None) -> None:
    """Reject an inconsistent packed batch with a one-line ``BatchError``.

    Checks field presence, shapes and dtypes; value ranges (against ``config`` when given:
    ``vocab_size``, ``type_vocab_size``, ``max_position_embeddings``,
    ``max_sequences_per_pack``, ``max_masked_tokens_per_pack`` as upper bounds); that every
    sequence is contiguous with positions 0..len-1; that ``cls_positions`` point at each
    sequence's first token and ``nsp_weights`` mark exactly the sequences present; and that
    every used masked slot points into its own sequence. Accepts numpy arrays or tensors.
    ``rows``: the packs' row numbers in their file, for the messages (default 0..B-1).
    """
    required = TOKEN_FIELDS + MLM_FIELDS + SEQUENCE_FIELDS
    missing = [name for name in required if name not in batch]
    if missing:
        raise BatchError(f"batch is missing field(s): {', '.join(missing)}")
    arrays = {name: _numpy(batch[name]) for name in required}
    for name in required:
        if name != "nsp_weights" and not np.issubdtype(arrays[name].dtype, np.integer):
            raise BatchError(f"batch field {name} must be an integer array, got {arrays[name].dtype}")
        if arrays[name].ndim != 2:
            raise BatchError(f"batch field {name} must be 2-D, got shape {arrays[name].shape}")
    B, S = arrays["input_ids"].shape
    M = arrays["mlm_positions"].shape[1]
    K = arrays["nsp_weights"].shape[1]
    for names, shape in ((TOKEN_FIELDS, (B, S)), (MLM_FIELDS, (B, M)), (SEQUENCE_FIELDS, (B, K))):
        for name in names:
            if arrays[name].shape != shape:
                raise BatchError(f"batch field {name} has shape {arrays[name].shape}, expected {shape}")
    for name in ("mlm_normalizer", "nsp_normalizer"):
        if name in batch and _numpy(batch[name]).shape != (B,):
            raise BatchError(f"batch field {name} has shape {_numpy(batch[name]).shape}, expected ({B},)")

    def check_range(name: str, low: int, high: int, what: str) -> None:
        values = arrays[name]
        if values.size and (values.min() < low or values.max() >= high):
            b, j = np.argwhere((values < low) | (values >= high))[0]
            raise BatchError(f"{name} of pack {_row(rows, b)}: value {int(values[b, j])} is outside [{low}, {high}) ({what})")

    if config is not None:
        if K > config.max_sequences_per_pack:
            raise BatchError(f"batch has K={K} sequence slots but max_sequences_per_pack is {config.max_sequences_per_pack}")
        if M > config.max_masked_tokens_per_pack:
            raise BatchError(f"batch has M={M} masked slots but max_masked_tokens_per_pack is {config.max_masked_tokens_per_pack}")
        if S > config.max_position_embeddings:
            raise BatchError(f"batch has S={S} tokens per pack but max_position_embeddings is {config.max_position_embeddings}")
        vocab = "model.vocab_size: the data's vocabulary is larger than the model's"
        check_range("input_ids", 0, config.vocab_size, vocab)
        check_range("mlm_labels", 0, config.vocab_size, vocab)
        check_range("segment_ids", 0, config.type_vocab_size, "model.type_vocab_size")
    check_range("position_ids", 0, S, "tokens per pack")
    check_range("sequence_ids", 0, K + 1, "0 = padding, 1..K")
    check_range("mlm_sequence_ids", 0, K + 1, "0 = unused slot, 1..K")
    check_range("mlm_positions", 0, S, "tokens per pack")
    check_range("cls_positions", 0, S, "tokens per pack")
    check_range("nsp_labels", 0, 2, "next-sentence label: 0 or 1")

    # Per (pack, sequence): first token, token count; contiguous runs with positions 0..len-1.
    sequence_ids = arrays["sequence_ids"]
    one_hot = sequence_ids[:, :, None] == np.arange(1, K + 1)[None, None, :]  # [B, S, K]
    counts = one_hot.sum(axis=1)  # [B, K]
    columns = np.arange(S)[None, :, None]
    first = np.where(one_hot, columns, S).min(axis=1)  # [B, K]
    last = np.where(one_hot, columns, -1).max(axis=1)
    present = counts > 0
    gap = present & (last - first + 1 != counts)
    if gap.any():
        b, k = np.argwhere(gap)[0]
        raise BatchError(f"pack {_row(rows, b)}: sequence {k + 1} is not contiguous (tokens {first[b, k]}..{last[b, k]} with gaps)")
    real = sequence_ids > 0
    first_of_token = np.take_along_axis(first, np.clip(sequence_ids - 1, 0, K - 1), axis=1)  # [B, S]
    wrong_position = real & (arrays["position_ids"] != np.arange(S)[None, :] - first_of_token)
    if wrong_position.any():
        b, t = np.argwhere(wrong_position)[0]
        raise BatchError(
            f"pack {_row(rows, b)}: token {t} of sequence {sequence_ids[b, t]} has position_id {arrays['position_ids'][b, t]}, "
            "positions must restart at 0 for every sequence"
        )
    weights = arrays["nsp_weights"]
    if np.any((weights != 0) != present) or np.any((weights != 0) & (weights != 1)):
        b = int(np.argwhere(((weights != 0) != present) | ((weights != 0) & (weights != 1)))[0][0])
        raise BatchError(f"pack {_row(rows, b)}: nsp_weights must be 1 exactly for the sequences present in sequence_ids")
    wrong_cls = present & (arrays["cls_positions"] != first)
    if wrong_cls.any():
        b, k = np.argwhere(wrong_cls)[0]
        raise BatchError(f"pack {_row(rows, b)}: cls_positions[{k}]={arrays['cls_positions'][b, k]} is not sequence {k + 1}'s first token {first[b, k]}")

    used = arrays["mlm_sequence_ids"] > 0
    owner = np.take_along_axis(sequence_ids, arrays["mlm_positions"], axis=1)
    wrong_owner = used & (owner != arrays["mlm_sequence_ids"])
    if wrong_owner.any():
        b, m = np.argwhere(wrong_owner)[0]
        raise BatchError(
            f"pack {_row(rows, b)}: masked slot {m} points at position {arrays['mlm_positions'][b, m]} of sequence {owner[b, m]}, "
            f"but mlm_sequence_ids says {arrays['mlm_sequence_ids'][b, m]}"
        )
    at_cls = used & (arrays["mlm_positions"] == np.take_along_axis(first, arrays["mlm_sequence_ids"].clip(1, K) - 1, axis=1))
    if at_cls.any():
        b, m = np.argwhere(at_cls)[0]
        raise BatchError(f"pack {_row(rows, b)}: masked slot {m} points at a [CLS] token")
