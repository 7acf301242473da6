"""Pipeline stages, recomputation, precision and the PopTorch optimizer for the BERT models.

The model declares its blocks (``model.pipeline_layout()``: embeddings, encoder layers, the
first head module, whether the heads share the embeddings' weight); this module places them.
Layout (Graphcore's PopTorch BERT, ``layers_per_ipu`` e.g. ``[3, 7, 7, 7]`` for BERT-Large on
4 IPUs per replica):

    IPU 0: "Embedding" (word/position/segment embeddings, attention-mask preparation),
           encoder layers 0..2
    IPU 1..3: encoder layers 3..9, 10..16, 17..23 ("Encoder<i>" blocks)
    "Heads": pre-training's pooler, NSP head and MLM head, whose decoder weight is TIED to the
           word embeddings, sit on IPU 0 (the IPU holding the embedding table; with
           AutoStage.AutoIncrement a last, separate pipeline stage); a task head that shares no
           weight (classification, question answering) sits after the last layer, on the last
           IPU, as in Graphcore's fine-tuning layouts (no extra stage).

``layers_per_ipu`` entries may be 0 (an IPU with no encoder layers: Graphcore's IPU 0 in
some layouts is embeddings + heads only).
"""
from __future__ import annotations

import types
from typing import List

import torch
from torch import nn

from bert_packed.config import ConfigError
from bert_packed.model.losses import metric_keys


def layer_ipus(layers_per_ipu: List[int], num_layers: int) -> List[int]:
    """IPU of each encoder layer: ``[3, 7, 7, 7]`` -> ``[0, 0, 0, 1, ..., 3]`` (length num_layers)."""
    if sum(layers_per_ipu) != num_layers or any(n < 0 for n in layers_per_ipu):
        raise ConfigError(f"ipu.layers_per_ipu={list(layers_per_ipu)} sums to {sum(layers_per_ipu)} but the "
                          f"model has {num_layers} encoder layers; make them agree")
    return [ipu for ipu, count in enumerate(layers_per_ipu) for _ in range(count)]


def heads_ipu(layers_per_ipu: List[int], tied_to_embeddings: bool) -> int:
    """Where the heads go: with the embeddings (IPU 0) when they share its weight (the MLM
    decoder), else after the last encoder layer, on the last IPU (Graphcore's fine-tuning layouts)."""
    return 0 if tied_to_embeddings else len(layers_per_ipu) - 1


def forward_stage_ipus(layers_per_ipu: List[int], heads_on_ipu: int = 0) -> List[int]:
    """IPU of each forward pipeline stage of the layout: ``[3, 7, 7, 7]`` -> ``[0, 1, 2, 3, 0]``
    (heads on IPU 0), ``[0, 1, 2, 3]`` (heads on IPU 3).

    Consecutive blocks on one IPU form one stage (PopART merges them); one IPU -> ``[0]``.
    """
    blocks = [0] + layer_ipus(layers_per_ipu, sum(layers_per_ipu)) + [heads_on_ipu]
    stages = [ipu for i, ipu in enumerate(blocks) if i == 0 or ipu != blocks[i - 1]]
    return stages if len(stages) > 1 else [0]


def check_pipeline_depth(layers_per_ipu: List[int], gradient_accumulation: int, device_iterations: int = 1,
                         heads_on_ipu: int = 0) -> None:
    """PopTorch's rule for pipelined training, as a config error before anything compiles.

    PopTorch (popart_compiler ``Compiler.cpp``, sdk-release-3.4) counts a training pipeline of F
    forward stages as ``2 F - 1`` stages (``CompilerImpl::numPipelineStages``: the backward
    stages, less one because the last IPU runs its forward and backward in one stage) and
    refuses the compile when ``accumulationFactor < num_pipeline_stages``: "poptorch.Options().
    Training.gradientAccumulation must be greater than or equal to the number of pipeline
    stages". Device iterations do not count: pipelined training without accumulation is refused
    whatever ``deviceIterations`` is. (``device_iterations`` is kept for the callers' signature.)
    ``heads_on_ipu``: where the model's heads go (``heads_ipu``); heads back on IPU 0 add a stage.
    """
    num_forward = len(forward_stage_ipus(layers_per_ipu, heads_on_ipu))
    if num_forward == 1:
        return
    stages = 2 * num_forward - 1
    if gradient_accumulation < stages:
        raise ConfigError(f"ipu.layers_per_ipu={list(layers_per_ipu)} makes {num_forward} forward pipeline stages, "
                          f"{stages} in training, and PopTorch needs a gradient accumulation of at least {stages} "
                          f"micro-batches per replica (got {gradient_accumulation}); raise train.gradient_accumulation "
                          f"(or train.global_batch_size), or use one IPU per replica: "
                          f"--set \"ipu.layers_per_ipu=[{sum(layers_per_ipu)}]\"")


def _checkpoint_output(poptorch):
    def hook(module, inputs, output):
        # Keep each layer's output as a recomputation checkpoint: the backward pass recomputes
        # the layer's internals from it instead of storing every activation of the stage.
        return poptorch.recomputationCheckpoint(output)
    return hook


def _serialize_decoder(decoder: nn.Linear, poptorch, factor: int) -> None:
    """Split the MLM decoder matmul ([M,H] x [H,V]) into ``factor`` pieces along V, in place.

    The forward method is replaced on the instance, so parameter names (and the tie to the
    word embeddings) stay exactly as they are.
    """
    def forward(self, hidden_states):
        logits = poptorch.serializedMatMul(hidden_states, self.weight.t(),
                                           poptorch.MatMulSerializationMode.OutputChannels, factor)
        return logits if self.bias is None else logits + self.bias
    decoder.forward = types.MethodType(forward, decoder)


def parallelize(model, ipu_config, poptorch):
    """Annotate ``model`` in place for pipelined execution from the blocks it declares
    (``model.pipeline_layout()``, see ``bert_packed.model.modeling.PipelineLayout``); returns it."""
    layout = model.pipeline_layout()
    ipus = layer_ipus(ipu_config.layers_per_ipu, len(layout.layers))
    poptorch.BeginBlock(layout.embeddings, "Embedding", ipu_id=0)
    for index, (layer, ipu) in enumerate(zip(layout.layers, ipus)):
        poptorch.BeginBlock(layer, f"Encoder{index}", ipu_id=ipu)
        if ipu_config.recompute_checkpoint_every_layer:
            layer.register_forward_hook(_checkpoint_output(poptorch))
    poptorch.BeginBlock(layout.head, "Heads",
                        ipu_id=heads_ipu(ipu_config.layers_per_ipu, layout.head_tied_to_embeddings))
    if ipu_config.embedding_serialization_factor > 1 and layout.vocabulary_projection is not None:
        _serialize_decoder(layout.vocabulary_projection, poptorch, ipu_config.embedding_serialization_factor)
    return model


class TrainingWrapper(nn.Module):
    """What PopTorch compiles: the model plus the one marked loss, returning scalars only.

    ``loss_multiplier`` scales the loss PopTorch differentiates (not the reported metrics): see
    ``backends.ipu`` for why (global-count normalisation under PopTorch's Mean reduction).
    """

    def __init__(self, model, poptorch, loss_multiplier: float = 1.0):
        super().__init__()
        self.model = model
        self._poptorch = poptorch
        self.loss_multiplier = float(loss_multiplier)

    def forward(self, **batch):
        out = self.model(**batch)
        final_loss = self._poptorch.identity_loss(out["loss"] * self.loss_multiplier, reduction="none")
        return (final_loss,) + tuple(out[name].float() for name in metric_keys(self.model))


class EvalWrapper(nn.Module):
    """Forward only, the same scalar outputs (no loss marker needed for inference)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        out = self.model(**batch)
        return tuple(out[name].float() for name in metric_keys(self.model))


class PredictWrapper(nn.Module):
    """Forward only, returning the model's ``names`` outputs (e.g. per-sequence logits)."""

    def __init__(self, model, names):
        super().__init__()
        self.model = model
        self.names = tuple(names)

    def forward(self, **batch):
        out = self.model(**batch)
        return tuple(out[name].float() for name in self.names)


def build_optimizer(torch_optimizer: torch.optim.Optimizer, poptorch, ipu_config, max_grad_norm=None):
    """The PopTorch optimizer equivalent to the loop's ``torch_optimizer`` (same param groups).

    ``max_grad_norm`` (``optimizer.max_grad_norm``; None = no clipping): PopTorch's own global
    gradient-norm clip, applied on the device to the unscaled, accumulated gradients, as the
    cpu/cuda backends clip before their step (the fine-tuning configs clip at 1.0, the Trainer's).

    ``bert_packed.optim.Lamb`` -> ``poptorch.optim.LAMB``: same update (see bert_packed/optim.py);
    per-group ``weight_decay`` and ``max_weight_norm`` carry over; a group without a clamp
    (``max_weight_norm=None``) gets PopTorch's default clamp 65500 (fp16 max), far above any
    BERT weight norm. ``torch.optim.AdamW`` -> ``poptorch.optim.AdamW``. ``loss_scaling`` from
    ``ipu.loss_scaling`` (the device multiplies the loss and divides the gradients by it);
    ``ipu_config`` is the ``ipu`` config section.
    """
    groups = []
    for group in torch_optimizer.param_groups:
        entry = {"params": list(group["params"]), "weight_decay": float(group["weight_decay"]),
                 "lr": float(group["lr"])}
        if group.get("max_weight_norm") is not None:
            entry["max_weight_norm"] = float(group["max_weight_norm"])
        groups.append(entry)
    defaults = torch_optimizer.defaults
    loss_scaling = float(ipu_config.loss_scaling)
    clip = {} if max_grad_norm is None else {"max_grad_norm": float(max_grad_norm)}
    if type(torch_optimizer).__name__ == "Lamb":
        bias_correction = {bool(g.get("bias_correction", True)) for g in torch_optimizer.param_groups}
        if len(bias_correction) != 1:
            raise ConfigError("poptorch.optim.LAMB has one bias_correction for all groups; the groups differ")
        # Gradient accumulators in fp16 by default (Graphcore's BERT and optimum-graphcore): one
        # copy of the weights in fp16 instead of fp32. PopTorch then keeps their running mean
        # (MeanReductionStrategy.Running, set in ipu/options.py), never the sum of GA x replicas
        # loss-scaled gradients, so they cannot overflow where one micro-batch's gradient does
        # not. LAMB's first and second moments stay fp32 (in Streaming Memory, sharded).
        accum = torch.float16 if ipu_config.fp16_accumulators else torch.float32
        return poptorch.optim.LAMB(groups, lr=float(defaults["lr"]), betas=tuple(defaults["betas"]),
                                   eps=float(defaults["eps"]), weight_decay=float(defaults["weight_decay"]),
                                   bias_correction=bias_correction.pop(), loss_scaling=loss_scaling,
                                   max_weight_norm=defaults.get("max_weight_norm"),
                                   accum_type=accum, first_order_momentum_accum_type=torch.float32,
                                   second_order_momentum_accum_type=torch.float32, **clip)
    if isinstance(torch_optimizer, torch.optim.AdamW):
        return poptorch.optim.AdamW(groups, lr=float(defaults["lr"]), betas=tuple(defaults["betas"]),
                                    eps=float(defaults["eps"]), weight_decay=float(defaults["weight_decay"]),
                                    loss_scaling=loss_scaling,
                                    accum_type=torch.float16 if ipu_config.fp16_accumulators else torch.float32,
                                    first_order_momentum_accum_type=torch.float32,
                                    second_order_momentum_accum_type=torch.float32, **clip)
    raise ConfigError(f"the IPU path supports optimizer.name lamb or adamw, not {type(torch_optimizer).__name__}")


def sync_learning_rates(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Copy each group's ``lr`` (the loop's schedule writes ``source``) into ``target``."""
    for src, dst in zip(source.param_groups, target.param_groups):
        dst["lr"] = src["lr"]
