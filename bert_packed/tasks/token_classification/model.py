"""The token classification model: the packed encoder and a linear head over every token,
with the mean cross-entropy over the step's labelled tokens (Hugging Face's
``BertForTokenClassification`` layout, so its checkpoints load and ours export).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from bert_packed.model.attention import profiler_scope
from bert_packed.model.dropout import Dropout
from bert_packed.tasks.token_classification.data import IGNORE_INDEX
from bert_packed.model.losses import add_sequence_normalizer, normalize
from bert_packed.model.modeling import BertConfig, BertModel, BertPreTrainedModel, PipelineLayout

__all__ = ["BertForTokenClassification", "token_loss_terms"]


def token_loss_terms(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-pack numerators and counts of the token cross-entropy: ``logits`` ``[B, S, C]``,
    ``labels`` ``[B, S]`` (any value where the weight is 0, e.g. -100), ``weights`` ``[B, S]``
    (1.0 for a scored token). Returns ``[B]`` float ``loss_sum``, ``correct_sum``, ``count``.
    Masked by multiplication, not ``ignore_index``: fixed shapes for the IPU."""
    num_packs, num_tokens, num_labels = logits.shape
    weights = weights.float()
    scored = weights > 0
    targets = torch.where(scored, labels, torch.zeros_like(labels))
    nll = F.cross_entropy(logits.reshape(-1, num_labels).float(), targets.reshape(-1), reduction="none")
    nll = nll.view(num_packs, num_tokens) * weights
    correct = (logits.argmax(dim=-1) == targets).float() * weights
    return {"loss_sum": nll.sum(dim=1), "correct_sum": correct.sum(dim=1), "count": weights.sum(dim=1)}


class BertForTokenClassification(BertPreTrainedModel):
    """Packed token classification: one logit row per token, whatever sequence of the pack it
    belongs to (each attends only to its own sequence).

    Hugging Face's ``BertForTokenClassification`` layout (``bert`` without pooler, dropout,
    ``classifier`` Linear(H, num_labels)), so its checkpoints load and ours export.
    ``model(**batch)`` with ``input_ids, segment_ids, position_ids, sequence_ids`` ``[B, S]``
    returns ``logits`` ``[B, S, num_labels]``; with ``labels`` ``[B, S]`` (``IGNORE_INDEX``
    where not scored) and optional ``label_weights`` ``[B, S]`` (default: labels != -100) also
    ``loss``: the summed cross-entropy of the scored tokens divided by ``normalizer`` ``[B]``
    (the step's scored-token count, from ``add_step_normalizers``) or by this batch's count:
    Hugging Face's mean over a batch's labelled tokens, for the whole step. ``accuracy`` is
    the same mean of right argmaxes; ``num_labelled_tokens`` this batch's count.
    """

    metric_names = ("loss", "accuracy")
    count_names = ("num_labelled_tokens",)
    normalizer_fields = ("normalizer",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.classifier.apply(self._init_weights)

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(self.bert.embeddings, self.bert.encoder.layer, self.classifier, False)

    def hf_label_config(self, id2label=None):
        return self._labels_of(id2label)  # the tags; no problem_type (it names sequence classification's)

    def add_step_normalizers(self, micro_batches, *, all_reduce=None):
        """Set ``normalizer`` (float32 ``[B]``) in every micro-batch to the step's scored-token count
        (``label_weights`` summed over all micro-batches, and over processes by ``all_reduce``)."""
        return add_sequence_normalizer(micro_batches, "label_weights", "normalizer", all_reduce=all_reduce)

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor, position_ids: torch.Tensor,
                sequence_ids: torch.Tensor, cls_positions: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, label_weights: Optional[torch.Tensor] = None,
                normalizer: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        sequence_output = self.bert(input_ids, segment_ids, position_ids, sequence_ids)
        logits = self.classifier(self.dropout(sequence_output))  # [B,S,num_labels]
        outputs: Dict[str, torch.Tensor] = {"logits": logits}
        if labels is None:
            return outputs
        if label_weights is None:
            label_weights = (labels != IGNORE_INDEX).float()
        with profiler_scope("packing/loss_unpacking"):
            terms = token_loss_terms(logits, labels, label_weights)
            outputs["loss"] = normalize(terms["loss_sum"], terms["count"], normalizer)
            outputs["accuracy"] = normalize(terms["correct_sum"], terms["count"], normalizer)
            outputs["num_labelled_tokens"] = terms["count"].sum()
        return outputs
