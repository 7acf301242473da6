"""Pre-training's model: the MLM and NSP heads on ``BertModel`` (``BertForPreTraining``, with
Hugging Face's parameter names), and the model a pre-training config builds (``build_model``).

The MLM head runs only on the M gathered masked positions, and both losses are per sequence
(``bert_packed.model.losses``), so a pack computes what its sequences compute alone."""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from bert_packed.model.attention import profiler_scope
from bert_packed.model.build import bert_config
from bert_packed.model.losses import (PRETRAINING_COUNTS, PRETRAINING_METRICS, add_step_normalizers, mlm_loss_terms,
                                      normalize, nsp_loss_terms)
from bert_packed.model.modeling import (ACTIVATIONS, OPTIONAL_FIELDS, BertConfig, BertModel, BertPreTrainedModel,
                                        PipelineLayout, fit_vocab_rows, gather_rows, zero_vocab_padding)

__all__ = ["BertForPreTraining", "BertLMPredictionHead", "BertPreTrainingHeads", "build_model"]


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.activation(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    """MLM head; ``decoder.weight`` is tied to the word embeddings, ``decoder.bias`` is ``bias``."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.decoder.bias = self.bias  # same Parameter under both names, as in Hugging Face

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        names = [prefix + name for name in ("decoder.weight", "decoder.bias", "bias")]
        fit_vocab_rows(state_dict, names, self.decoder.out_features, self.vocab_size)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(self.transform(hidden_states))
        if self.decoder.out_features != self.vocab_size:
            # A padded vocabulary (vocab_padding_multiple): the GEMM runs at the padded width, the
            # padding's logits are cut here, so they never win and never reach the loss.
            logits = logits[..., : self.vocab_size]
        return logits


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, masked_hidden_states: torch.Tensor, pooled_output: torch.Tensor):
        return self.predictions(masked_hidden_states), self.seq_relationship(pooled_output)


class BertForPreTraining(BertPreTrainedModel):
    """MLM + NSP pre-training on a packed batch (an unpacked batch is K = 1).

    ``model(**batch)`` with the fields of ``PRETRAINING_FIELDS`` (plus optional
    ``mlm_normalizer`` / ``nsp_normalizer``) returns a dict:

    * ``loss`` = ``mlm_loss + nsp_loss``: the one scalar to differentiate;
    * ``mlm_loss``, ``nsp_loss``, ``mlm_accuracy``, ``nsp_accuracy``: scalars. Without
      normaliser fields they are this batch's means; with them they are this batch's share
      of the step's means (sum over the step's micro-batches and replicas to get the step's);
    * ``mlm_logits`` ``[B,M,V]`` (masked slots only), ``nsp_logits`` ``[B,K,2]``;
    * ``num_sequences``, ``num_mlm_tokens``, ``num_mlm_correct``, ``num_nsp_correct``: this
      batch's counts (float scalar tensors), for exact aggregation across micro-batches/ranks.

    The MLM head runs only on the M gathered masked positions, not on all S tokens.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.cls.apply(self._init_weights)
        self.tie_weights()
        zero_vocab_padding(self)

    # What the backends sum over micro-batches and replicas: the step's shares of the loss
    # and metrics (normalised by the step's counts), then this batch's counts.
    metric_names = PRETRAINING_METRICS
    count_names = PRETRAINING_COUNTS
    normalizer_fields = OPTIONAL_FIELDS

    def pipeline_layout(self) -> PipelineLayout:
        # The pooler runs first among the heads (pool -> cls); the MLM decoder is the word
        # embeddings' matrix when tied, so the heads belong with the embeddings then.
        return PipelineLayout(self.bert.embeddings, self.bert.encoder.layer, self.bert.pooler,
                              bool(self.config.tie_word_embeddings), self.cls.predictions.decoder)

    def tie_weights(self) -> None:
        """Share the MLM decoder weight with the word embeddings (call again after replacing either).

        Nothing to do with ``tie_word_embeddings: false`` (a checkpoint with its own decoder matrix)."""
        if self.config.tie_word_embeddings:
            self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def add_step_normalizers(self, micro_batches, *, all_reduce=None):
        """Give every pack of one optimizer step the step's global counts (see ``bert_packed.model.losses``)."""
        return add_step_normalizers(micro_batches, self.config.mlm_loss_normalization, all_reduce=all_reduce)

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sequence_ids: torch.Tensor,
        mlm_positions: torch.Tensor,
        mlm_labels: torch.Tensor,
        mlm_sequence_ids: torch.Tensor,
        cls_positions: torch.Tensor,
        nsp_labels: torch.Tensor,
        nsp_weights: torch.Tensor,
        mlm_normalizer: Optional[torch.Tensor] = None,
        nsp_normalizer: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        sequence_output = self.bert(input_ids, segment_ids, position_ids, sequence_ids)
        masked_hidden_states = gather_rows(sequence_output, mlm_positions)  # [B,M,H]
        with profiler_scope("packing/loss_unpacking"):
            pooled_output = self.bert.pool(sequence_output, cls_positions)  # [B,K,H]
        mlm_logits, nsp_logits = self.cls(masked_hidden_states, pooled_output)

        with profiler_scope("packing/loss_unpacking"):
            mlm = mlm_loss_terms(
                mlm_logits,
                mlm_labels,
                mlm_sequence_ids,
                max_sequences_per_pack=nsp_weights.shape[1],
                normalization=self.config.mlm_loss_normalization,
            )
            nsp = nsp_loss_terms(nsp_logits, nsp_labels, nsp_weights)
            mlm_loss = normalize(mlm["loss_sum"], mlm["count"], mlm_normalizer)
            nsp_loss = normalize(nsp["loss_sum"], nsp["count"], nsp_normalizer)
            mlm_accuracy = normalize(mlm["correct_sum"], mlm["count"], mlm_normalizer)
            nsp_accuracy = normalize(nsp["correct_sum"], nsp["count"], nsp_normalizer)
        return {
            "loss": mlm_loss + nsp_loss,
            "mlm_loss": mlm_loss,
            "nsp_loss": nsp_loss,
            "mlm_accuracy": mlm_accuracy,
            "nsp_accuracy": nsp_accuracy,
            "mlm_logits": mlm_logits,
            "nsp_logits": nsp_logits,
            "num_sequences": nsp["count"].sum(),
            "num_mlm_tokens": mlm["num_tokens"].sum(),
            "num_mlm_correct": mlm["num_correct"].sum(),
            "num_nsp_correct": nsp["correct_sum"].sum(),
        }


def build_model(config):
    """BertForPreTraining from the model section plus the data section's packed shapes."""
    return BertForPreTraining(bert_config(config))
