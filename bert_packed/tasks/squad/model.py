"""The question answering model: the packed encoder and a start / end score per token,
with the span loss over each packed feature's own tokens (Hugging Face's
``BertForQuestionAnswering`` layout, so its checkpoints load and ours export).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from bert_packed.model.attention import profiler_scope
from bert_packed.model.losses import add_sequence_normalizer, normalize
from bert_packed.model.modeling import BertConfig, BertModel, BertPreTrainedModel, PipelineLayout

__all__ = ["BertForQuestionAnswering", "span_loss_terms"]


def span_loss_terms(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    sequence_ids: torch.Tensor,
    start_positions: torch.Tensor,
    end_positions: torch.Tensor,
    weights: torch.Tensor,
) -> Dict[str, torch.Tensor]:
    """Per-pack span-extraction (question answering) numerators and counts.

    Every sequence k of a pack gets its own softmax over ITS OWN tokens only (other
    sequences and padding are masked out), so no span can start in one sequence and end in
    another and a packed sequence's loss is the one it has alone. Its loss is Hugging
    Face's ``(CE(start) + CE(end)) / 2``; ``correct`` means start and end both right.

    Args:
        start_logits, end_logits: ``[B, S]`` one score per token.
        sequence_ids: ``[B, S]`` 1..K, 0 = padding.
        start_positions, end_positions: ``[B, K]`` answer columns in the pack (any valid
            column in empty slots).
        weights: ``[B, K]`` 1.0 where sequence k exists.

    Returns ``[B]`` float tensors ``loss_sum``, ``correct_sum``, ``count`` (sequences), and
    ``[B, K, S]`` ``start_scores`` / ``end_scores`` (the logits with other sequences' tokens
    at a large negative value: each slot's own distribution).
    """
    num_slots = weights.shape[1]
    slots = torch.arange(1, num_slots + 1, device=sequence_ids.device)
    own = sequence_ids[:, None, :] == slots[None, :, None]  # [B, K, S]
    # A finite mask value (not -inf) keeps empty slots' softmax finite; their weight is 0.
    masked = torch.full_like(own, -1e4, dtype=torch.float32)
    zeros = torch.zeros_like(masked)
    bias = torch.where(own, zeros, masked)
    weights = weights.float()
    terms = []
    for logits, positions in ((start_logits, start_positions), (end_logits, end_positions)):
        scores = logits.float()[:, None, :] + bias  # [B, K, S]
        nll = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), positions.reshape(-1), reduction="none")
        terms.append((scores, nll.view(positions.shape), scores.argmax(dim=-1) == positions))
    (start_scores, start_nll, start_ok), (end_scores, end_nll, end_ok) = terms
    loss = (start_nll + end_nll) * 0.5 * weights
    correct = (start_ok & end_ok).float() * weights
    return {"loss_sum": loss.sum(dim=1), "correct_sum": correct.sum(dim=1), "count": weights.sum(dim=1),
            "start_scores": start_scores, "end_scores": end_scores}


class BertForQuestionAnswering(BertPreTrainedModel):
    """Packed extractive question answering (SQuAD): a start and an end score per token.

    Hugging Face's ``BertForQuestionAnswering`` layout (``bert`` without pooler,
    ``qa_outputs`` Linear(H, 2)), so its checkpoints load and ours export. Each packed
    feature (question + context window, with its own [CLS]) is scored on its own tokens
    only: ``model(**batch)`` with ``input_ids, segment_ids, position_ids, sequence_ids``
    ``[B,S]`` returns ``start_logits`` / ``end_logits`` ``[B,S]`` (per token, as in the
    pack); with ``start_positions`` / ``end_positions`` ``[B,K]`` (answer columns in the
    pack; a feature without the answer points at its [CLS]) and ``label_weights`` ``[B,K]``
    (1.0 where slot k holds a feature) it also returns ``loss``: the mean over features of
    ``(CE(start) + CE(end)) / 2``, each softmax over that feature's own tokens, divided by
    ``normalizer`` ``[B]`` (the step's feature count, as for NSP) when given, and
    ``span_accuracy`` and ``num_sequences``. ``span_accuracy``: the share of the features whose
    predicted start AND end (each the argmax over the feature's own tokens) are both the labelled
    ones ([CLS] for a feature without the answer): exact-span accuracy on the batch, the training
    counterpart of EM. Named for what it measures (it was ``accuracy``, which read like a
    classification metric): an untrained head scores ~0 (it hits one of ~S^2/2 spans by chance).

    Unlike Hugging Face's padded model, padding positions never enter the softmax, so the
    loss of a feature does not depend on how much padding its row has (the logits of real
    tokens are identical to Hugging Face's).
    """

    metric_names = ("loss", "span_accuracy")
    count_names = ("num_sequences",)
    normalizer_fields = ("normalizer",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.qa_outputs.apply(self._init_weights)

    def add_step_normalizers(self, micro_batches, *, all_reduce=None):
        """Set ``normalizer`` (float32 ``[B]``) in every micro-batch to the step's feature count
        (``label_weights`` summed over all micro-batches, and over processes by ``all_reduce``),
        as sequence classification does."""
        return add_sequence_normalizer(micro_batches, "label_weights", "normalizer", all_reduce=all_reduce)

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(self.bert.embeddings, self.bert.encoder.layer, self.qa_outputs, False)

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sequence_ids: torch.Tensor,
        cls_positions: Optional[torch.Tensor] = None,  # part of the packed batch; the head needs no [CLS] gather
        start_positions: Optional[torch.Tensor] = None,
        end_positions: Optional[torch.Tensor] = None,
        label_weights: Optional[torch.Tensor] = None,
        normalizer: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        sequence_output = self.bert(input_ids, segment_ids, position_ids, sequence_ids)
        logits = self.qa_outputs(sequence_output)  # [B,S,2]
        start_logits, end_logits = logits[..., 0], logits[..., 1]
        outputs: Dict[str, torch.Tensor] = {"start_logits": start_logits, "end_logits": end_logits}
        if start_positions is None or end_positions is None:
            return outputs
        if label_weights is None:
            label_weights = torch.ones(start_positions.shape, dtype=torch.float32, device=start_positions.device)
        with profiler_scope("packing/loss_unpacking"):
            terms = span_loss_terms(start_logits, end_logits, sequence_ids, start_positions, end_positions, label_weights)
            outputs["loss"] = normalize(terms["loss_sum"], terms["count"], normalizer)
            outputs["span_accuracy"] = normalize(terms["correct_sum"], terms["count"], normalizer)
            outputs["num_sequences"] = terms["count"].sum()
        return outputs
