"""Packed BERT: one model for packed and unpacked batches, read top to bottom.

    config -> embeddings -> attention -> layer -> encoder -> pooler -> BertModel

Every task builds its model on ``BertModel`` in its own package: pre-training's MLM and NSP
heads are ``bert_packed/tasks/pretraining/model.py``, the fine-tuning heads
``bert_packed/tasks/<task>/model.py``.

A *pack* is one fixed-length row of ``S`` tokens holding up to ``K`` sequences side by
side (natural order, each with its own [CLS]). Three things make a pack compute exactly
what the same sequences compute alone:

1. positions restart at 0 for every sequence (``position_ids``; looked up, not added as
   a fixed range), so each sequence sees the position embeddings it would see alone;
2. attention is block-diagonal: a token attends only to tokens of its own sequence
   (``sequence_ids``; see ``bert_packed/model/attention/__init__.py``);
3. losses and metrics are per sequence (``bert_packed/model/losses.py``): the pooler and NSP
   head read each sequence's own [CLS], and the MLM loss is normalised per masked token or
   per sequence, by the step's global count.

An unpacked batch is a pack with one sequence (K = 1); there is no second code path.

Shape legend: B packs per batch, S tokens per pack, K = max_sequences_per_pack,
M = max_masked_tokens_per_pack, H hidden size, N heads, D = H / N, V vocabulary.

Parameter names and shapes are those of ``transformers.BertForPreTraining`` and the other
``BertFor*`` classes (the MLM decoder is tied to the word embeddings), so a Hugging Face state
dict loads (``load_hf_state_dict``) and exports (``hf_state_dict``).
Only torch 2.0 operations are used (the IPU path compiles this file with PopTorch) and
every shape is static: gathers take index tensors, masks replace boolean indexing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from bert_packed.model import attention as attention_registry
from bert_packed.config import model_rules, model_shape_error
from bert_packed.model.dropout import Dropout
# PROBLEM_TYPES: Hugging Face's names (``BertConfig.problem_type``); None resolves as Hugging Face does.
from bert_packed.limits import PROBLEM_TYPE, PROBLEM_TYPES, value_rule

__all__ = [
    "ModelConfigError",
    "BertConfig",
    "BertEmbeddings",
    "BertSelfAttention",
    "BertLayer",
    "BertEncoder",
    "BertPooler",
    "BertModel",
    "PipelineLayout",
    "PRETRAINING_FIELDS",
    "PROBLEM_TYPES",
    "hf_state_dict",
    "hf_shapes",
    "hf_parameter_name",
    "load_hf_state_dict",
]

# The packed batch (docs/design.md, "The packed batch"). All int64 except nsp_weights (float); the two optional
# normaliser fields are float [B] (see bert_packed.model.losses.add_step_normalizers).
PRETRAINING_FIELDS = (
    "input_ids",  # [B,S] tokens, 0 = padding
    "segment_ids",  # [B,S] token type ids
    "position_ids",  # [B,S] restart at 0 for every sequence
    "sequence_ids",  # [B,S] 1..K = sequence of the pack, 0 = padding
    "mlm_positions",  # [B,M] positions of masked tokens, 0 in unused slots
    "mlm_labels",  # [B,M] original tokens at those positions
    "mlm_sequence_ids",  # [B,M] owning sequence 1..K, 0 = unused slot
    "cls_positions",  # [B,K] index of each sequence's [CLS]
    "nsp_labels",  # [B,K] next-sentence label per sequence
    "nsp_weights",  # [B,K] 1.0 where sequence k exists
)
OPTIONAL_FIELDS = ("mlm_normalizer", "nsp_normalizer")  # [B] float, the step's global counts


class ModelConfigError(ValueError):
    """A model configuration value is invalid (one-line message naming the field and the fix)."""


# ----------------------------------------------------------------------------- config


@dataclass
class BertConfig:
    """BERT architecture with Hugging Face ``BertConfig`` field names, plus the packing fields.

    The defaults are BERT-Base. ``max_sequences_per_pack`` (K) and
    ``max_masked_tokens_per_pack`` (M) fix the static shapes of the per-sequence and
    masked-token inputs; the seeds' rule is M = masked tokens of one full-length sequence
    + K - 1 (each packed sequence may round its 15 % up by one token), e.g. 76 + 3 - 1 = 78
    at S = 512, K = 3.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # "gelu" (erf), "gelu_new" / "gelu_pytorch_tanh" (tanh approximation), "relu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: Optional[int] = 0  # None: no padding row in the word embeddings (Hugging Face allows null)
    # The MLM decoder shares the word-embedding matrix (False: a checkpoint's own decoder matrix).
    tie_word_embeddings: bool = True
    # Sequence classification head (BertForSequenceClassification).
    num_labels: int = 2
    classifier_dropout: Optional[float] = None  # None: use hidden_dropout_prob, as Hugging Face does
    # None: Hugging Face's rule at config time: num_labels == 1 is regression, else single-label.
    problem_type: Optional[str] = None
    # Packing.
    max_sequences_per_pack: int = 3
    max_masked_tokens_per_pack: int = 78
    mlm_loss_normalization: str = "token"  # "token" (canonical BERT) | "sequence" (paper Listing 1)
    attention_implementation: str = "dense"  # name in bert_packed.model.attention's registry
    # GPU levers, off by default (docs/cuda.md, "Levers"); neither changes what the model computes
    # nor its Hugging Face names and shapes (``hf_state_dict``), and checkpoints of either kind load.
    fused_qkv: bool = False  # query, key and value projected by one GEMM (the parameters stay three)
    vocab_padding_multiple: int = 1  # word embeddings and MLM decoder get V rounded up to this; 1 = none

    def __post_init__(self) -> None:
        # Each field by the model section's declared rule (bert_packed.config.model_rules), the
        # packing and head fields by their own; then the rules between fields, as a config's.
        for name, (test, expected) in _field_rules().items():
            value = getattr(self, name)
            if not test(value):
                raise ModelConfigError(f"model config: {name} must be {expected}, got {value!r}")
        shape_error = model_shape_error(self, prefix="")
        if shape_error is not None:
            raise ModelConfigError(f"model config: {shape_error}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"model config: hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.problem_type == "single_label_classification" and self.num_labels < 2:
            raise ModelConfigError("model config: single_label_classification needs num_labels >= 2 (one label is "
                                   "a constant: its loss would be 0); use problem_type regression for one score")
        try:
            attention_registry.get_attention(self.attention_implementation)
        except attention_registry.AttentionError as error:
            raise ModelConfigError(f"model config: {error}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the word embeddings and the MLM decoder: ``vocab_size`` rounded up to a multiple
        of ``vocab_padding_multiple`` (the extra rows are zero and never win: see ``fit_vocab_rows``)."""
        multiple = self.vocab_padding_multiple
        return -(-self.vocab_size // multiple) * multiple

    @property
    def resolved_problem_type(self) -> str:
        """``problem_type``, or Hugging Face's default for ``num_labels`` (1: regression)."""
        if self.problem_type is not None:
            return self.problem_type
        return "regression" if self.num_labels == 1 else "single_label_classification"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides: Any) -> "BertConfig":
        """Build from a mapping with our field names; unknown keys are an error."""
        values = {**values, **overrides}
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ModelConfigError(f"model config: unknown field(s) {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> "BertConfig":
        """Build from a ``transformers.BertConfig`` (or its ``to_dict()``); other HF keys are ignored."""
        values = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        names = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in values.items() if k in names}
        if picked.get("classifier_dropout") is None:
            picked.pop("classifier_dropout", None)
        if "id2label" in values and "num_labels" not in values:
            picked["num_labels"] = len(values["id2label"])
        return cls(**{**picked, **overrides})

    def to_hf_dict(self) -> Dict[str, Any]:
        """The Hugging Face ``BertConfig`` keyword arguments (``transformers.BertConfig(**cfg.to_hf_dict())``)."""
        keys = (
            "vocab_size hidden_size num_hidden_layers num_attention_heads intermediate_size hidden_act "
            "hidden_dropout_prob attention_probs_dropout_prob max_position_embeddings type_vocab_size "
            "initializer_range layer_norm_eps pad_token_id num_labels classifier_dropout tie_word_embeddings"
        ).split()
        out = {k: getattr(self, k) for k in keys}
        if self.problem_type is not None:
            out["problem_type"] = self.problem_type
        return out


_FIELD_RULES: Dict[str, Any] = {}


def _field_rules() -> Dict[str, Any]:
    """name -> (test, what it must be) of every ``BertConfig`` field with a rule: the model
    section's (bert_packed.config.model_rules) and those of the fields it does not have."""
    if not _FIELD_RULES:
        positive = value_rule(int, {"ge": 1})
        names = {f.name for f in dataclasses.fields(BertConfig)}
        _FIELD_RULES.update({name: rule for name, rule in model_rules().items() if name in names})
        _FIELD_RULES.update({name: positive for name in ("num_labels", "max_sequences_per_pack",
                                                          "max_masked_tokens_per_pack")})
        _FIELD_RULES["problem_type"] = value_rule(Optional[str], PROBLEM_TYPE)
    return _FIELD_RULES


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu": F.gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "relu": F.relu}


def gather_rows(hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``hidden_states[b, positions[b, i]]`` for every b, i: ``[B,S,H]`` x ``[B,P]`` -> ``[B,P,H]``.

    An index gather (fixed output shape P), not boolean indexing, so it compiles for the IPU.
    """
    index = positions[:, :, None].expand(-1, -1, hidden_states.shape[-1])
    return torch.gather(hidden_states, 1, index)


# ----------------------------------------------------------------------------- embeddings


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout.

    Positions come from ``position_ids`` (restarting at 0 in each packed sequence), so a
    sequence in a pack gets exactly the position embeddings it would get alone.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        # Not snake-cased: the checkpoint name (Hugging Face, and Google's TF before it).
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        fit_vocab_rows(state_dict, [prefix + "word_embeddings.weight"], self.word_embeddings.num_embeddings,
                       self.vocab_size)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(segment_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


# ----------------------------------------------------------------------------- attention


class BertSelfAttention(nn.Module):
    """Q/K/V projections; the attention itself is a registered function (``attention.py``).

    ``config.fused_qkv``: the three projections as one GEMM of the input with the query, key and
    value weights stacked ([3H, H], concatenated in every forward: a copy of 3 H^2 numbers, small
    beside the GEMM, and fused into it under ``torch.compile``). The parameters stay the three
    Linear(H, H) of Hugging Face's names: checkpoints and the export are unchanged, and LAMB keeps
    one trust ratio per projection (a single [3H, H] parameter would share one between the three,
    another optimizer)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.fused_qkv = bool(config.fused_qkv)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:  # [B,S,H] -> [B,N,S,D]
        return x.view(x.shape[0], x.shape[1], self.num_attention_heads, self.head_dim).transpose(1, 2)

    def _project(self, hidden_states: torch.Tensor):
        """(query, key, value), each ``[B,N,S,D]``."""
        if not self.fused_qkv:
            return (self._split_heads(self.query(hidden_states)), self._split_heads(self.key(hidden_states)),
                    self._split_heads(self.value(hidden_states)))
        projections = (self.query, self.key, self.value)
        weight = torch.cat([p.weight for p in projections])  # [3H, H]: rows 0..H-1 the query's
        bias = torch.cat([p.bias for p in projections])
        batch, length = hidden_states.shape[0], hidden_states.shape[1]
        qkv = F.linear(hidden_states, weight, bias).view(batch, length, 3, self.num_attention_heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B,N,S,D] views
        return query, key, value

    def forward(
        self, hidden_states: torch.Tensor, attend: attention_registry.AttentionImplementation, prepared: Any
    ) -> torch.Tensor:
        query, key, value = self._project(hidden_states)
        context = attend.attend(query, key, value, prepared, dropout_p=self.dropout_p, training=self.training)
        return context.transpose(1, 2).reshape(hidden_states.shape)  # [B,N,S,D] -> [B,S,H]


class BertSelfOutput(nn.Module):
    """Projection to hidden_size, dropout, residual, post-LayerNorm. The attention block
    uses it as is; BertOutput (the feed-forward block) only changes the input width.
    Attribute names are Hugging Face's, so state dicts load."""

    def __init__(self, config: BertConfig, in_features: Optional[int] = None):
        super().__init__()
        self.dense = nn.Linear(in_features or config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: torch.Tensor, attend: attention_registry.AttentionImplementation, prepared: Any) -> torch.Tensor:
        return self.output(self.self(hidden_states, attend, prepared), hidden_states)


# ----------------------------------------------------------------------------- layer, encoder


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states))


class BertOutput(BertSelfOutput):
    """The feed-forward block's output: intermediate_size -> hidden_size, residual, LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__(config, in_features=config.intermediate_size)


class BertLayer(nn.Module):
    """One post-LN transformer layer: attention block, then feed-forward block (per token)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: torch.Tensor, attend: attention_registry.AttentionImplementation, prepared: Any) -> torch.Tensor:
        attention_output = self.attention(hidden_states, attend, prepared)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states: torch.Tensor, attend: attention_registry.AttentionImplementation, prepared: Any) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, attend, prepared)
        return hidden_states


class BertPooler(nn.Module):
    """dense + tanh on each sequence's [CLS] vector: ``[B,K,H] -> [B,K,H]``."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden_states))


# ----------------------------------------------------------------------------- base model


class PipelineLayout(NamedTuple):
    """What a pipelined backend places, declared by the model (the IPU layout needs no guessing).

    ``embeddings`` start the first stage; ``layers`` are the encoder layers, one block each;
    ``head`` is the first module of the heads (their block starts where it runs);
    ``head_tied_to_embeddings``: the heads share a weight with the embeddings (the MLM decoder
    is the word-embedding matrix), so they must sit on the embeddings' device; other heads go
    after the last layer. ``vocabulary_projection``: the tied [H, V] decoder, which a backend
    may split to fit memory (None when the model has none)."""

    embeddings: nn.Module
    layers: Sequence[nn.Module]
    head: nn.Module
    head_tied_to_embeddings: bool
    vocabulary_projection: Optional[nn.Linear] = None


class BertPreTrainedModel(nn.Module):
    """What every model declares to the backends and tasks, and the weight initialisation
    shared by the models (Hugging Face's ``_init_weights`` rule).

    ``metric_names``: outputs normalised by the step's global counts (their sum over
    micro-batches and replicas is the step's mean); ``count_names``: this batch's counts;
    ``normalizer_fields``: the batch fields ``add_step_normalizers`` fills in."""

    config: BertConfig
    metric_names: Tuple[str, ...] = ()
    count_names: Tuple[str, ...] = ()
    normalizer_fields: Tuple[str, ...] = ()

    @property
    def hf_architecture(self) -> str:
        """The ``transformers`` class the export is loaded as (``architectures`` in config.json)."""
        return type(self).__name__

    def add_step_normalizers(self, micro_batches, *, all_reduce=None):
        """Give every pack of one optimizer step the step's global counts (``normalizer_fields``)."""
        raise NotImplementedError(f"{type(self).__name__} declares no step normalizers")

    def hf_label_config(self, id2label: Optional[Mapping[int, str]] = None) -> Dict[str, Any]:
        """The label keys of the export's config.json (none for a model without labels)."""
        return {}

    def _labels_of(self, id2label: Optional[Mapping[int, str]]) -> Dict[str, Any]:
        """``id2label`` / ``label2id`` of a labelling head (default names LABEL_i)."""
        labels = id2label or {i: f"LABEL_{i}" for i in range(self.config.num_labels)}
        return {"id2label": {str(int(i)): str(name) for i, name in labels.items()},
                "label2id": {str(name): int(i) for i, name in labels.items()}}

    def pipeline_layout(self) -> PipelineLayout:
        """The blocks a pipelined backend places (see ``PipelineLayout``)."""
        raise NotImplementedError(f"{type(self).__name__} declares no pipeline layout")

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
        """Load a Hugging Face state dict (see the module-level ``load_hf_state_dict``)."""
        return load_hf_state_dict(self, state_dict, strict=strict)

    def hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """This model's weights under Hugging Face names (see the module-level ``hf_state_dict``)."""
        return hf_state_dict(self)


class BertModel(BertPreTrainedModel):
    """The encoder: ``forward(input_ids, segment_ids, position_ids, sequence_ids) -> [B,S,H]``.

    ``pooler`` is kept here (as in Hugging Face, for the parameter names) but applied by the
    heads, on the [CLS] vectors gathered per sequence (``pool``). ``add_pooling_layer=False``
    leaves it out, as Hugging Face's question-answering model does (its checkpoints have none).
    """

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(self._init_weights)
        zero_vocab_padding(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sequence_ids: torch.Tensor,
    ) -> torch.Tensor:
        """All ``[B,S]`` int64; returns the last layer's hidden states ``[B,S,H]``.

        Padding tokens (``sequence_ids == 0``) get finite but meaningless outputs.
        """
        hidden_states = self.embeddings(input_ids, segment_ids, position_ids)
        attend = attention_registry.get_attention(self.config.attention_implementation)
        if attend.check is not None:
            attend.check(
                device=hidden_states.device,
                dtype=hidden_states.dtype,
                dropout_p=self.config.attention_probs_dropout_prob if self.training else 0.0,
                needs_grad=torch.is_grad_enabled(),
            )
        # Built once per forward and shared by every layer.
        bound = {"max_sequences": self.config.max_sequences_per_pack} if attend.takes_max_sequences else {}
        prepared = attend.prepare(sequence_ids, dtype=hidden_states.dtype, **bound)
        return self.encoder(hidden_states, attend, prepared)

    def pool(self, sequence_output: torch.Tensor, cls_positions: torch.Tensor) -> torch.Tensor:
        """Pooled [CLS] vector of every sequence slot: ``[B,S,H]``, ``[B,K]`` -> ``[B,K,H]``."""
        if self.pooler is None:
            raise ModelConfigError("this encoder was built without a pooler (add_pooling_layer=False)")
        return self.pooler(gather_rows(sequence_output, cls_positions))


# ----------------------------------------------------------------------------- heads



# ----------------------------------------------------------------------------- task models



# ----------------------------------------------------------------------------- HF weights

# Hugging Face buffers that are not weights (recomputed from shapes; we take positions as input).
_HF_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids", "embeddings.position_ids", "embeddings.token_type_ids")


def hf_parameter_name(key: str) -> str:
    """A checkpoint's parameter name as the model has it: old (TF-converted) checkpoints call
    the LayerNorm parameters gamma / beta."""
    return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def load_hf_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a ``transformers`` state dict into ``model`` (same names and shapes).

    Hugging Face's non-weight buffers (``position_ids``, ``token_type_ids``) are dropped,
    old ``LayerNorm.gamma/beta`` names are renamed, a ``bert.``-prefixed checkpoint loads
    into a bare ``BertModel``, and a checkpoint without ``cls.predictions.decoder.weight``
    (it is tied) loads too: the tie to the word embeddings provides it. Use
    ``strict=False`` to start a task model from another head's checkpoint (e.g. sequence
    classification from a pre-training checkpoint). Returns ``load_state_dict``'s result.
    """
    state = {}
    for key, value in state_dict.items():
        if key in _HF_BUFFERS:
            continue
        key = hf_parameter_name(key)
        if isinstance(model, BertModel) and key.startswith("bert."):
            key = key[len("bert.") :]  # a task model's checkpoint into the bare encoder
        state[key] = value
    # Tied weights: whichever is missing is the other one.
    if "cls.predictions.decoder.weight" not in state and "bert.embeddings.word_embeddings.weight" in state:
        if hasattr(model, "cls"):
            state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    if "cls.predictions.decoder.bias" not in state and "cls.predictions.bias" in state and hasattr(model, "cls"):
        state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    result = model.load_state_dict(state, strict=strict)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return result


# The tensors with one row per vocabulary entry (padded with ``vocab_padding_multiple``).
_VOCAB_ROW_TENSORS = ("word_embeddings.weight", "predictions.decoder.weight", "predictions.decoder.bias",
                      "predictions.bias")


def fit_vocab_rows(state: Dict[str, torch.Tensor], names: Sequence[str], rows: int, vocab_size: int) -> None:
    """Bring the vocabulary tensors ``names`` of ``state`` (a state dict being loaded) to the model's
    ``rows``, in place: a ``vocab_size``-row tensor (Hugging Face's, or an unpadded model's) gets
    zero rows appended; a padded one loses its padding rows when they are zero (they always are:
    they are never read, so they never get a gradient). Other shapes are left for
    ``load_state_dict`` to report."""
    for name in names:
        tensor = state.get(name)
        if tensor is None or tensor.shape[0] == rows:
            continue
        if tensor.shape[0] == vocab_size < rows:
            state[name] = torch.cat([tensor, tensor.new_zeros((rows - vocab_size,) + tuple(tensor.shape[1:]))])
        elif tensor.shape[0] > rows >= vocab_size and not tensor[rows:].any():
            state[name] = tensor[:rows]


def zero_vocab_padding(model: nn.Module) -> None:
    """Zero the padding rows of the word embeddings and the MLM decoder (``vocab_padding_multiple``):
    nothing reads them, so they get no gradient and stay zero, and neither the gradient norm nor a
    trust ratio (LAMB's ``||w||``) sees them."""
    vocab_size = model.config.vocab_size
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(_VOCAB_ROW_TENSORS) and parameter.shape[0] > vocab_size:
                parameter[vocab_size:].zero_()


def _hf_tensors(model: nn.Module):
    """(Hugging Face name, tensor view) of every tensor of ``model``'s state dict, in its order: padded
    vocabulary tensors cut to ``vocab_size``."""
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    padded = config is not None and config.padded_vocab_size != vocab_size
    for key, value in model.state_dict().items():
        value = value.detach()
        if padded and key.endswith(_VOCAB_ROW_TENSORS) and value.shape[0] == config.padded_vocab_size:
            yield key, value[:vocab_size]
        else:
            yield key, value


def hf_shapes(model: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """The shapes of ``hf_state_dict(model)``, without copying a tensor."""
    return {name: tuple(tensor.shape) for name, tensor in _hf_tensors(model)}


def hf_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``model``'s weights under Hugging Face names and shapes (loadable by ``transformers`` with
    strict=False buffers aside): the same whatever ``vocab_padding_multiple``."""
    return {name: tensor.clone() for name, tensor in _hf_tensors(model)}
