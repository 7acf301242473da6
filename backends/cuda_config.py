"""The ``cuda`` config section (backend ``cuda``), registered by ``backends/__init__.py``."""
from __future__ import annotations

from dataclasses import dataclass, field

from bert_packed.config import HARMLESS, bounded


@dataclass
class CUDAConfig:
    """NVIDIA GPU settings (backend ``cuda``)."""

    # Where the backend runs: "cuda" (a GPU per process; LOCAL_RANK picks it under torchrun) or
    # "cpu" (this backend's own code on the CPU: no GPU needed, gloo between processes; CI).
    device: str = field(default="cuda", metadata={"choices": ("cuda", "cpu")})
    precision: str = field(default="bf16", metadata={"choices": ("bf16", "fp16", "fp32")})
    # torch.compile the model once (fixed shapes: no recompiles after warm-up).
    compile: bool = field(default=False, metadata=HARMLESS)
    # torch.compile mode: "default", "reduce-overhead" (CUDA graphs) or "max-autotune".
    compile_mode: str = field(default="default", metadata={
        "choices": ("default", "reduce-overhead", "max-autotune"), **HARMLESS})
    # Optimizer steps that may compile (the first forward/backward compiles; eval compiles
    # its own graph on first use). After them, graphs compiled are counted as recompiles.
    num_warmup_steps: int = bounded(2, ge=0, **HARMLESS)
    # Recompiles tolerated after warm-up; more is an error (a shape or guard changed: with
    # fixed [B, S] packs that is a bug, and it silently costs seconds per step).
    max_recompiles_after_warmup: int = bounded(0, ge=0, **HARMLESS)
    # fp16 only: GradScaler's initial loss scale (dynamic afterwards).
    loss_scale_init: float = bounded(65536.0, gt=0.0)
    # Let fp32 matmuls use TF32 tensor cores (Ampere and newer).
    allow_tf32: bool = True
    # Data parallel: MiB of gradients per DDP all-reduce bucket (torch's default 25). Smaller
    # buckets start communicating earlier in the backward, larger ones make fewer calls. At
    # least DDP's 1 MiB first bucket: torch.compile splits a DDP model at bucket boundaries and
    # refuses smaller ones.
    ddp_bucket_cap_mb: float = bounded(25.0, ge=1.0)
