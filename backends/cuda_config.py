"""The ``cuda`` config section (backend ``cuda``), registered by ``backends/__init__.py``."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bert_packed.config import HARMLESS, bounded
from bert_packed.limits import STEPS, at_most


@dataclass
class CUDAConfig:
    """NVIDIA GPU settings (backend ``cuda``)."""

    precision: str = field(default="bf16", metadata={"choices": ("bf16", "fp16", "fp32")})
    # torch.compile the model once (fixed shapes: no recompiles after warm-up).
    compile: bool = field(default=False, metadata=HARMLESS)
    # torch.compile mode: "default", "reduce-overhead" (CUDA graphs) or "max-autotune".
    compile_mode: str = field(default="default", metadata={
        "choices": ("default", "reduce-overhead", "max-autotune"), **HARMLESS})
    # Optimizer steps that may compile (the first forward/backward compiles; eval compiles
    # its own graph on first use). After them, graphs compiled are counted as recompiles.
    num_warmup_steps: int = bounded(2, ge=0, **STEPS, **HARMLESS)
    # Recompiles tolerated after warm-up; more is an error (a shape or guard changed: with
    # fixed [B, S] packs that is a bug, and it silently costs seconds per step). Each takes
    # seconds to minutes, so 10^6 would be weeks of compiling.
    max_recompiles_after_warmup: int = bounded(0, ge=0, **at_most(10**6, "each recompile takes seconds to minutes"),
                                               **HARMLESS)
    # fp16 only: GradScaler's initial loss scale (dynamic afterwards; each overflowing step is
    # skipped and halves it). GradScaler keeps it in fp32: above fp32's largest value it is inf,
    # and halving inf never recovers.
    loss_scale_init: float = bounded(65536.0, gt=0.0, **at_most(float(torch.finfo(torch.float32).max),
                                                                "GradScaler keeps it in fp32, whose largest value "
                                                                "that is"))
    # Let fp32 matmuls use TF32 tensor cores (Ampere and newer).
    allow_tf32: bool = True
