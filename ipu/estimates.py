"""Estimates of what a PopTorch executable costs, from what it was compiled for: GC200 cycles
(``ipu.cost_model``) and per-IPU memory (``ipu.memory``). The mock backend's ``cycleCount()``
and compile-time memory check use them (``install_mock_estimators``); the profiler's
breakdown on the mock too.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from bert_packed.errors import ConfigError
from ipu import memory
from ipu.cost_model import estimate_cycles


def _bert_config(model):
    """The ``BertConfig`` of a (possibly wrapped) BERT model, or None."""
    for candidate in (model, getattr(model, "model", None)):
        config = getattr(candidate, "config", None)
        if config is not None and hasattr(config, "num_hidden_layers"):
            return config
    return None


def estimate_run_cycles(info: Dict[str, Any]) -> Dict[str, Any]:
    """Estimated GC200 cycles of one PopTorch run (first replica) from ``ipu.cost_model``.

    ``info``: ``model``, ``signature`` [(path, micro-batch shape, dtype)], ``pipeline`` (the
    executor's plan), ``training``, ``device_iterations``, ``gradient_accumulation``, and
    optionally ``layers_per_ipu`` and ``precision``. The cost model gives one micro-batch's
    cycles on the bottleneck stage; a run streams device_iterations x GA micro-batches through
    the pipeline, so it is that many times one (steady state: pipeline ramp-up and the weight
    update are not modelled). Returns {"total", "per_micro_batch", "breakdown", "unit"}.
    """
    config = _bert_config(info["model"])
    if config is None:
        raise ConfigError("the cycle estimate knows BERT only: the model has no BERT config")
    shapes = {path.split("'")[1]: shape for path, shape, _ in info["signature"] if "'" in path}
    missing = [k for k in ("input_ids", "nsp_weights", "mlm_positions") if k not in shapes]
    if missing:
        raise ConfigError(f"the cycle estimate needs the batch fields {missing}")
    micro_batch_size, sequence_length = shapes["input_ids"]
    max_sequences_per_pack = shapes["nsp_weights"][1]
    plan = info.get("pipeline") or {}
    layers_per_ipu = info.get("layers_per_ipu")
    if layers_per_ipu is None and plan.get("blocks"):
        counts = [0] * plan["num_ipus_per_replica"]
        for block_id, ipu_id, _ in plan["blocks"]:
            if str(block_id).startswith("Encoder"):
                counts[ipu_id] += 1
        layers_per_ipu = counts
    precision = info.get("precision")
    if precision is None:
        dtype = next(info["model"].parameters()).dtype
        precision = "fp16" if dtype == torch.float16 else "fp32"
    estimate = estimate_cycles(
        config, micro_batch_size=int(micro_batch_size), sequence_length=int(sequence_length),
        max_sequences_per_pack=int(max_sequences_per_pack), packed=max_sequences_per_pack > 1,
        num_ipus_per_replica=len(layers_per_ipu) if layers_per_ipu else 1, training=bool(info["training"]),
        layers_per_ipu=list(layers_per_ipu) if layers_per_ipu else None, precision=precision,
        max_masked_tokens_per_pack=int(shapes["mlm_positions"][1]))
    num_micro_batches = int(info["device_iterations"]) * int(info["gradient_accumulation"])
    return {"total": int(estimate["total"]) * num_micro_batches, "per_micro_batch": int(estimate["total"]),
            "breakdown": estimate.get("breakdown"), "unit": "estimated cycles"}


def estimate_run_memory(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``ipu.memory`` estimate of what the (mock) executor compiles: the layout from its pipeline
    plan, the shapes from its inputs, precisions from the model and optimizer, optimizer state
    placement and replicas (all PopRun instances) from its options. None for a non-BERT model."""
    config = _bert_config(info["model"])
    plan, options = info.get("pipeline") or {}, info["options"]
    shapes = {path.split("'")[1]: shape for path, shape, _ in info["signature"] if "'" in path}
    if config is None or "input_ids" not in shapes or "mlm_positions" not in shapes or not plan.get("blocks"):
        return None
    layers_per_ipu = [0] * plan["num_ipus_per_replica"]
    for block_id, ipu_id, _ in plan["blocks"]:
        if str(block_id).startswith("Encoder"):
            layers_per_ipu[ipu_id] += 1
    location = options.TensorLocations.location_optimizer
    optimizer = info.get("optimizer")
    weight_dtype = next(info["model"].parameters()).dtype
    accum = getattr(optimizer, "accum_type", None) or torch.float32
    proportions = options.available_memory_proportion
    layout = memory.Layout(
        layers_per_ipu=layers_per_ipu, micro_batch_size=int(shapes["input_ids"][0]),
        sequence_length=int(shapes["input_ids"][1]), max_masked_tokens_per_pack=int(shapes["mlm_positions"][1]),
        replicas=options.replication_factor * options.Distributed.num_distributed_processes,
        weight_bytes=torch.finfo(weight_dtype).bits // 8, accumulator_bytes=torch.finfo(accum).bits // 8,
        optimizer_state_offchip=location.get("onChip", 1) == 0,
        replicated_tensor_sharding=bool(location.get("useReplicatedTensorSharding", 0)),
        recompute_checkpoint_every_layer=plan.get("num_recomputation_checkpoints", 0) > 0,
        embedding_serialization_factor=max(plan.get("serialization_factors") or [1]),
        available_memory_proportion=[proportions.get(i, 0.6) for i in range(len(layers_per_ipu))])
    return memory.estimate_memory(config, layout)


def install_mock_estimators(mock_poptorch) -> None:
    """The mock's ``cycleCount()`` returns ``estimate_run_cycles(...)["total"]``; its compile
    estimates memory with ``estimate_run_memory`` (and warns above an IPU's memory)."""
    mock_poptorch.set_cycle_estimator(lambda info: estimate_run_cycles(info)["total"])
    mock_poptorch.set_memory_estimator(estimate_run_memory)

