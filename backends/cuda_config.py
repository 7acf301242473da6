"""The ``cuda`` config section (backend ``cuda``), registered by ``backends/__init__.py``."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.cpu_config import CPUConfig
from bert_packed.config import HARMLESS, bounded
from bert_packed.limits import at_most


@dataclass
class CUDAConfig(CPUConfig):
    """NVIDIA GPU settings (backend ``cuda``): the cpu section's compile settings, and these."""

    # Where the backend runs: "cuda" (a GPU per process; LOCAL_RANK picks it under torchrun) or
    # "cpu" (this backend's own code on the CPU: no GPU needed, gloo between processes; CI).
    device: str = field(default="cuda", metadata={"choices": ("cuda", "cpu")})
    precision: str = field(default="bf16", metadata={"choices": ("bf16", "fp16", "fp32")})
    # fp16 only: GradScaler's initial loss scale (dynamic afterwards; each overflowing step is
    # skipped and halves it). GradScaler keeps it in fp32: above fp32's largest value it is inf,
    # and halving inf never recovers.
    loss_scale_init: float = bounded(65536.0, gt=0.0, **at_most(float(torch.finfo(torch.float32).max),
                                                                "GradScaler keeps it in fp32, whose largest value "
                                                                "that is"))
    # Let fp32 matmuls use TF32 tensor cores (Ampere and newer).
    allow_tf32: bool = True
    # Data parallel: MiB of gradients per DDP all-reduce bucket (torch's default 25). Smaller
    # buckets start communicating earlier in the backward, larger ones make fewer calls. At
    # least DDP's 1 MiB first bucket: torch.compile splits a DDP model at bucket boundaries and
    # refuses smaller ones. At most 16 GiB, more than any GPU's whole gradient of BERT-Large
    # (1.3 GB): one bucket then holds every gradient, and larger caps change nothing.
    ddp_bucket_cap_mb: float = bounded(25.0, ge=1.0, **at_most(16384.0, "one bucket already holds every "
                                                                        "gradient; larger caps change nothing"))
    # Levers, each off until a GPU measures it (docs/cuda.md, "Levers"). fp8: the encoder layers'
    # linear layers compute in FP8 through torchao's float8 training (dynamic scaling; the
    # weights, optimizer and checkpoints stay as they are); needs torchao and a GPU with FP8 tensor
    # cores (compute capability 8.9+: Ada, Hopper, Blackwell); on cuda.device=cpu torchao's
    # emulation runs instead (for tests).
    fp8: bool = False
    # LAMB's update and the gradient clipping as one torch.compile'd function (Lamb.clip_and_step):
    # the chain of foreach operations becomes a few fused kernels. optimizer.name=lamb, precision
    # bf16 or fp32 (fp16 unscales and clips first, eagerly). The first step compiles it.
    compile_optimizer: bool = field(default=False, metadata=HARMLESS)  # the same update: a resume may switch it
