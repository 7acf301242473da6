"""The ``ipu`` config section (backends ``ipu`` and ``mock``) and its validation.

The backend package registers it (``backends/__init__.py``); the IPU code path reads it from
the step plan (``plan.settings``). See the research notes on Graphcore's PopTorch BERT and
docs/ipu.md. Pipeline: one stage per IPU of a replica.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from bert_packed.config import HARMLESS, bounded
from bert_packed.errors import ConfigError




@dataclass
class IPUConfig:
    """Graphcore IPU settings (backends ``ipu`` and ``mock``)."""

    # Encoder layers on each IPU of one replica; its length is the IPUs per replica and
    # it must sum to model.num_hidden_layers. The embeddings sit on IPU 0; heads tied to the
    # embeddings (the MLM decoder) on IPU 0 too, other task heads on the last IPU.
    layers_per_ipu: List[int] = field(default_factory=lambda: [3, 7, 7, 7])
    replication_factor: int = bounded(4, ge=1)
    # Optimizer steps per host call (PopTorch deviceIterations).
    device_iterations: int = bounded(1, ge=1)
    # What the host gets back per call (PopTorch OutputMode).
    output_mode: str = field(default="sum", metadata={"choices": ("all", "sum", "final", "default")})
    # Fraction of tile memory for matmul/conv temporaries, one per IPU (or one for all).
    available_memory_proportion: List[float] = field(default_factory=lambda: [0.1, 0.15, 0.15, 0.15])
    enable_half_partials: bool = True
    half_precision: bool = True
    # Gradient accumulators (PopTorch optimizer accum_type): "auto" = fp16 with half_precision
    # (Graphcore's choice: half the memory; PopTorch then keeps a running mean, which cannot
    # overflow), else fp32. LAMB's two moments are always fp32.
    accumulator_dtype: str = field(default="auto", metadata={"choices": ("auto", "fp16", "fp32")})
    stochastic_rounding: bool = True
    loss_scaling: float = bounded(8192.0, gt=0.0)
    # PopTorch's executable cache: BERT-Large compiles for tens of minutes, a cached executable
    # loads in seconds. A relative path is relative to the working directory; null = off.
    executable_cache_dir: Optional[str] = field(default="runs/executable_cache", metadata=HARMLESS)
    synthetic_data: bool = False
    log_cycle_count: bool = field(default=False, metadata=HARMLESS)
    optimizer_state_offchip: bool = True
    replicated_tensor_sharding: bool = True
    recompute_checkpoint_every_layer: bool = True
    auto_round_num_ipus: bool = True
    # Split the tied MLM decoder matmul into this many pieces to fit IPU 0's memory.
    embedding_serialization_factor: int = 2

    @property
    def ipus_per_replica(self) -> int:
        return len(self.layers_per_ipu)

    @property
    def fp16_accumulators(self) -> bool:
        return self.accumulator_dtype == "fp16" or (self.accumulator_dtype == "auto" and self.half_precision)


def validate(config, world_size: int = 1) -> List[str]:
    """The ``ipu`` section against the model (bounds are checked by ``bert_packed.config``)."""
    ipu, m = config.ipu, config.model
    negative = [n for n in ipu.layers_per_ipu if n < 0]
    if negative or not ipu.layers_per_ipu:
        raise ConfigError(f"ipu.layers_per_ipu={ipu.layers_per_ipu}: give one count >= 0 per IPU "
                          f"(encoder layers on that IPU)")
    if sum(ipu.layers_per_ipu) != m.num_hidden_layers:
        raise ConfigError(
            f"ipu.layers_per_ipu={ipu.layers_per_ipu} sums to {sum(ipu.layers_per_ipu)} but "
            f"model.num_hidden_layers={m.num_hidden_layers}; make them agree"
        )
    if len(ipu.available_memory_proportion) not in (1, len(ipu.layers_per_ipu)):
        raise ConfigError(
            f"ipu.available_memory_proportion has {len(ipu.available_memory_proportion)} entries; "
            f"give 1 or one per IPU ({len(ipu.layers_per_ipu)})"
        )
    bad = [p for p in ipu.available_memory_proportion if not 0.0 < p <= 1.0]
    if bad:
        raise ConfigError(f"ipu.available_memory_proportion={ipu.available_memory_proportion}: each entry is a "
                          f"fraction of tile memory in (0, 1], got {bad[0]}")
    if ipu.embedding_serialization_factor < 1 or m.vocab_size % ipu.embedding_serialization_factor:
        raise ConfigError(
            f"ipu.embedding_serialization_factor={ipu.embedding_serialization_factor} must be >= 1 and divide "
            f"model.vocab_size={m.vocab_size}; pick a divisor (1 = no serialization)"
        )
    return []
