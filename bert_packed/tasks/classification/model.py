"""The sequence classification model: the packed encoder, the pooler and a linear head
over each packed sequence's own [CLS], and its per-sequence losses (Hugging Face's
``BertForSequenceClassification`` layout, so its checkpoints load and ours export).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from bert_packed.model.attention import profiler_scope
from bert_packed.model.dropout import Dropout
from bert_packed.model.losses import add_sequence_normalizer, normalize, nsp_loss_terms
from bert_packed.model.modeling import BertConfig, BertModel, BertPreTrainedModel, PipelineLayout

__all__ = ["BertForSequenceClassification", "classification_loss_terms"]


def classification_loss_terms(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                              problem_type: str) -> Dict[str, torch.Tensor]:
    """Per-pack numerators and counts of a per-sequence classification or regression loss.

    Args:
        logits: ``[B, K, C]`` one row of scores per sequence slot.
        labels: ``single_label_classification``: int ``[B, K]``; ``multi_label_classification``:
            0/1 floats ``[B, K, C]``; ``regression``: floats ``[B, K]`` (C = 1) or ``[B, K, C]``.
            Any valid value in empty slots.
        weights: ``[B, K]`` 1.0 where sequence k exists.
        problem_type: one of Hugging Face's three names.

    Each sequence's loss is Hugging Face's for that problem type on that sequence alone
    (cross-entropy; binary cross-entropy with logits averaged over the C labels; squared
    error averaged over the C outputs). Returns ``[B]`` float tensors ``loss_sum``,
    ``count`` (sequences) and, for the two classification types, ``correct_sum``
    (multi-label: every label right at logit > 0).
    """
    if problem_type == "single_label_classification":
        return nsp_loss_terms(logits, labels, weights)
    weights = weights.float()
    logits = logits.float()
    if problem_type == "multi_label_classification":
        targets = labels.float()
        per_sequence = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(dim=-1)
        correct = ((logits > 0) == (targets > 0.5)).all(dim=-1).float() * weights
        return {"loss_sum": (per_sequence * weights).sum(dim=1), "correct_sum": correct.sum(dim=1),
                "count": weights.sum(dim=1)}
    if problem_type == "regression":
        targets = labels.float().reshape(logits.shape)
        per_sequence = ((logits - targets) ** 2).mean(dim=-1)
        return {"loss_sum": (per_sequence * weights).sum(dim=1), "count": weights.sum(dim=1)}
    raise ValueError(f"unknown problem_type {problem_type!r}")


class BertForSequenceClassification(BertPreTrainedModel):
    """Packed sequence classification: one logit row per packed sequence, from its own [CLS].

    Hugging Face's flattening collator gives one loss per *row*; here every sequence of
    the pack is classified and weighted on its own. ``model(**batch)`` with the fields of
    ``CLASSIFICATION_FIELDS``: ``cls_positions`` ``[B,K]``, ``label_weights`` ``[B,K]``
    (1.0 where sequence k exists) and ``labels`` by ``config.resolved_problem_type``
    (Hugging Face's names and losses):

    * ``single_label_classification``: int64 ``[B,K]``, cross-entropy; metric ``accuracy``;
    * ``multi_label_classification``: float ``[B,K,num_labels]`` of 0/1, binary
      cross-entropy with logits averaged over the labels; metric ``accuracy`` = exact match
      (every label right at logit > 0);
    * ``regression``: float ``[B,K]`` (``num_labels`` 1) or ``[B,K,num_labels]``, mean
      squared error averaged over the labels.

    Every loss is a mean over *sequences* (each sequence's own loss, weighted by
    ``label_weights``), divided by the optional ``normalizer`` ``[B]`` (the step's sequence
    count, as for NSP) or by the batch's own count: the sequence-weighted loss of Hugging
    Face's unpacked ``BertForSequenceClassification`` (whose means over the batch's
    elements are the same numbers when every sequence has ``num_labels`` labels).
    Returns ``logits`` ``[B,K,num_labels]``, and with labels ``loss``, the metrics of
    ``metric_names`` and ``num_sequences``.
    """

    count_names = ("num_sequences",)
    normalizer_fields = ("normalizer",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.problem_type = config.resolved_problem_type
        self.bert = BertModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.classifier.apply(self._init_weights)

    @property
    def metric_names(self):
        return ("loss",) if self.problem_type == "regression" else ("loss", "accuracy")

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(self.bert.embeddings, self.bert.encoder.layer, self.bert.pooler, False)

    def hf_label_config(self, id2label: Optional[Mapping[int, str]] = None) -> Dict[str, Any]:
        return {**self._labels_of(id2label), "problem_type": self.config.resolved_problem_type}

    def add_step_normalizers(self, micro_batches, *, all_reduce=None):
        """Set ``normalizer`` (float32 ``[B]``) in every micro-batch to the step's sequence count
        (``label_weights`` summed over all micro-batches, and over processes by ``all_reduce``)."""
        return add_sequence_normalizer(micro_batches, "label_weights", "normalizer", all_reduce=all_reduce)

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sequence_ids: torch.Tensor,
        cls_positions: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        label_weights: Optional[torch.Tensor] = None,
        normalizer: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        sequence_output = self.bert(input_ids, segment_ids, position_ids, sequence_ids)
        with profiler_scope("packing/loss_unpacking"):
            pooled_output = self.bert.pool(sequence_output, cls_positions)
        logits = self.classifier(self.dropout(pooled_output))  # [B,K,num_labels]
        outputs: Dict[str, torch.Tensor] = {"logits": logits}
        if labels is None:
            return outputs
        if label_weights is None:
            label_weights = torch.ones(cls_positions.shape, dtype=torch.float32, device=cls_positions.device)
        with profiler_scope("packing/loss_unpacking"):
            terms = classification_loss_terms(logits, labels, label_weights, self.problem_type)
            outputs["loss"] = normalize(terms["loss_sum"], terms["count"], normalizer)
            if "correct_sum" in terms:
                outputs["accuracy"] = normalize(terms["correct_sum"], terms["count"], normalizer)
            outputs["num_sequences"] = terms["count"].sum()
        return outputs
