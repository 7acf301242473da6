"""Packed SQuAD batches: features side by side in fixed ``[B, S]`` rows.

:func:`pack_features` plans the packs with the ``packing`` library (depth 1 = the padded
layout); :func:`collate_question_answering` builds the batch ``QA_FIELDS``: each feature with
its own [CLS], positions restarting, and the answer positions moved to pack columns;
:func:`feature_slots` maps every pack slot back to its feature. No torch here: the model side is
``bert_packed.modeling.BertForQuestionAnswering``.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

import numpy as np

from bert_packed.collate import BatchError, one_per_pack, pack_tokens, per_sequence

__all__ = ["QA_FIELDS", "pack_features", "collate_question_answering", "feature_slots"]

# The packed QA batch (BertForQuestionAnswering's inputs): token fields [B, S], then per
# feature slot [B, K]: its [CLS] column, answer start / end columns (absolute in the pack),
# and 1.0 where the slot holds a feature.
QA_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions",
             "start_positions", "end_positions", "label_weights")


def pack_features(lengths: np.ndarray, *, max_sequence_length: int, max_sequences_per_pack: int,
                  algorithm: str = "lpfhp", seed: int = 0, shuffle: bool = False):
    """Packs of feature indices (``packing.Assignment``; depth 1 = one feature per row).

    Features keep their index, so predictions map back to examples whatever the order.
    """
    from packing import Histogram, assign, pack

    lengths = np.asarray(lengths, dtype=np.int64)
    if max_sequences_per_pack == 1:
        order = np.random.default_rng(seed).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
        return one_per_pack(order)
    histogram = Histogram.from_lengths(lengths, max_sequence_length=max_sequence_length, name="squad features")
    result = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed)
    return assign(result.plan, lengths, seed=seed, shuffle_packs=shuffle)


def collate_question_answering(samples: Mapping[str, np.ndarray], assignment: Any, *, max_sequence_length: int,
                               max_sequences_per_pack: int) -> Dict[str, np.ndarray]:
    """Packed QA batch (``QA_FIELDS``, numpy) of ``assignment``'s packs of ``samples``.

    ``samples``: ``input_ids``, ``segment_ids``, ``input_mask`` and per-feature
    ``start_positions`` / ``end_positions`` (token within the feature), e.g.
    ``SquadFeatures.samples()``. The answer positions become pack columns (feature start +
    token), so the model needs no per-feature offset; empty slots point at column 0 with
    weight 0.
    """
    S, K = int(max_sequence_length), int(max_sequences_per_pack)
    batch, layout = pack_tokens(samples, assignment, S, K)
    lengths = layout.lengths
    for name in ("start_positions", "end_positions"):
        local = np.asarray(samples[name], dtype=np.int64)[layout.order]
        if len(local) and (local.min() < 0 or np.any(local >= lengths)):
            bad = int(np.argmax((local < 0) | (local >= lengths)))
            raise BatchError(f"feature {int(layout.order[bad])}: {name} {int(local[bad])} is outside its "
                             f"{int(lengths[bad])} tokens")
        absolute = np.zeros((len(layout.offsets) - 1, K), dtype=np.int64)
        absolute[layout.pack_of, layout.slot] = layout.start + local
        batch[name] = absolute
    batch["label_weights"] = per_sequence(layout, np.ones(len(np.asarray(samples["input_ids"]))), K, np.float32)
    return batch


def feature_slots(assignment: Any, max_sequences_per_pack: int) -> np.ndarray:
    """``[P, K]`` feature index of every pack slot of ``assignment`` (-1 for an empty slot):
    how a packed batch's per-slot outputs map back to features."""
    offsets = np.asarray(assignment.pack_offsets, dtype=np.int64)
    indices = np.asarray(assignment.sequence_indices, dtype=np.int64)
    per_pack = np.diff(offsets)
    pack_of = np.repeat(np.arange(len(per_pack)), per_pack)
    slot = np.arange(len(indices)) - offsets[pack_of]
    out = np.full((len(per_pack), int(max_sequences_per_pack)), -1, dtype=np.int64)
    out[pack_of, slot] = indices
    return out

