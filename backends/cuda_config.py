"""The ``cuda`` config section (backend ``cuda``), registered by ``backends/__init__.py``, and the
defaults the backend resolves on a GPU (``python run.py --backend cuda --config phase2`` takes the
fastest measured path by itself: docs/cuda.md, "What runs by default"):

- ``cuda.compile: null`` -> compiled on a GPU (one static graph of the fixed-shape packs), eager
  with ``cuda.device=cpu`` (CI) or an attention whose shapes follow each batch;
- ``model.attention_implementation: auto`` -> ``flex`` when compiled and the recipe has no
  attention dropout (FlexAttention has none), else ``sdpa``; ``dense`` with ``cuda.device=cpu``;
- ``cuda.fit_micro_batch: true`` -> the step's packs split into the largest micro-batches that fit
  the GPU's memory (:func:`fit_micro_batch`), the packs per step (the recipe) unchanged, unless
  ``train.micro_batch_size`` or ``train.gradient_accumulation`` is given on the command line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from backends.cpu_config import CPUConfig
from bert_packed.config import HARMLESS, bounded
from bert_packed.limits import at_most

# Share of the GPU's memory a fitted micro-batch may plan for (the rest: the allocator's
# fragmentation, cuDNN/cuBLAS workspaces, compile autotuning), and the margin on the estimate of
# each pack's activations (measured on an H200: 0.44 GiB per BERT-Large pack at S = 512 compiled
# with flex against 0.40 estimated, docs/benchmarks/cuda.md).
MEMORY_FRACTION = 0.85
ACTIVATION_MARGIN = 1.25
WORKSPACE_BYTES = 2 * 2**30


@dataclass
class CUDAConfig(CPUConfig):
    """NVIDIA GPU settings (backend ``cuda``): the cpu section's compile settings, and these."""

    # torch.compile the model (see the cpu section). null: the backend chooses: compiled on a GPU
    # (BERT-Large phase 2 on an H200: 1.35-1.57x eager, docs/benchmarks/cuda.md), eager with
    # cuda.device=cpu or an attention whose shapes follow each batch (bucketed).
    compile: Optional[bool] = field(default=None, metadata=HARMLESS)
    # On a GPU, split the step's packs (train.micro_batch_size x train.gradient_accumulation, or
    # train.global_batch_size) into the largest micro-batches that fit the GPU's memory: the same
    # packs per optimizer step (the recipe), fewer and larger forward passes. Not when
    # train.micro_batch_size or train.gradient_accumulation is given on the command line; false
    # keeps the config's.
    fit_micro_batch: bool = True

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


# ----------------------------------------------------------------------------- resolved defaults


def on_gpu(config) -> bool:
    return config.sections["cuda"].device == "cuda"


def resolved_compile(config) -> bool:
    """``cuda.compile`` as the run uses it: the config's, or for ``null`` the backend's choice."""
    cuda = config.sections["cuda"]
    if cuda.compile is not None:
        return bool(cuda.compile)
    if not on_gpu(config):
        return False
    from bert_packed.model.attention import AttentionError, get_attention

    name = config.model.attention_implementation
    try:
        return get_attention(name).static_shapes if name != "auto" else True
    except AttentionError:
        return True  # an unknown name is the model config's error


def default_attention(config) -> str:
    """``model.attention_implementation: auto`` on this backend (module docstring)."""
    if not on_gpu(config):
        return "dense"
    from bert_packed.model.attention import available_attention_implementations

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.sections["cuda"].precision, torch.float32)
    dropout = config.model.attention_probs_dropout_prob
    fast = available_attention_implementations(torch.device("cuda"), dtype=dtype, dropout_p=dropout, needs_grad=True)
    return "flex" if resolved_compile(config) and "flex" in fast else "sdpa"


def parameter_count(model) -> int:
    """BERT pre-training's parameters (embeddings, encoder, pooler, MLM transform and bias, NSP),
    counted as the IPU memory model counts them (``ipu.memory.parameter_counts``)."""
    from ipu.memory import parameter_counts

    counts = parameter_counts(model)
    return counts["embeddings"] + model.num_hidden_layers * counts["layer"] + counts["heads"]


def pack_activation_bytes(config, attention: str) -> float:
    """Estimated activation memory of one pack in a training step: Korthikanti et al. (2022),
    s*h*(34 + 5*a*s/h) bytes per layer in 16-bit (the 5*a*s/h term only for attentions that keep
    the [heads, S, S] scores: dense and sdpa with a mask), twice that in fp32; the MLM logits over
    the pack's masked slots in fp32, with their gradient."""
    m, d = config.model, config.data
    s, h = d.max_sequence_length, m.hidden_size
    scores = 5 * m.num_attention_heads * s / h if _keeps_scores(attention) else 0.0
    width = 1.0 if config.sections["cuda"].precision in ("bf16", "fp16") else 2.0
    per_layer = s * h * (34 + scores) * width
    logits = 2 * 4 * (d.max_masked_tokens + d.max_sequences_per_pack - 1) * m.vocab_size
    return m.num_hidden_layers * per_layer + logits


def _keeps_scores(attention: str) -> bool:
    from bert_packed.model.attention import find_attention

    impl = find_attention(attention)
    return impl is None or impl.keeps_scores  # unknown: the larger estimate


def max_fitting_micro_batch(config, memory_bytes: int, attention: str) -> int:
    """The most packs one forward pass may hold in ``memory_bytes`` of GPU memory (at least 1):
    weights, gradients and two optimizer moments in fp32, a workspace, then the activations."""
    static = 16 * parameter_count(config.model) + WORKSPACE_BYTES
    per_pack = ACTIVATION_MARGIN * pack_activation_bytes(config, attention)
    return max(1, int((MEMORY_FRACTION * memory_bytes - static) // per_pack))


def fit_micro_batch(config, memory_bytes: Optional[int], world_size: int, replicas: int = 1) -> List[str]:
    """Split the step's packs into the largest micro-batches that fit (module docstring), in
    place; one note per change. ``memory_bytes`` None: no GPU to size them for (kept)."""
    train = config.train
    cuda = config.sections["cuda"]
    given = config.cli_keys.get("train", set())
    if not cuda.fit_micro_batch or not on_gpu(config) or given & {"micro_batch_size", "gradient_accumulation"}:
        return []
    if memory_bytes is None:
        return [f"train.micro_batch_size={train.micro_batch_size} kept: no GPU visible to fit it to (on a GPU "
                f"the backend fits it to the GPU's memory; cuda.fit_micro_batch=false keeps it)"]
    if train.global_batch_size is not None:
        per_replica = train.global_batch_size // (world_size * replicas)
    else:
        per_replica = train.micro_batch_size * train.gradient_accumulation
    most = max_fitting_micro_batch(config, memory_bytes, config.model.attention_implementation)
    size = max(d for d in range(1, min(most, per_replica) + 1) if per_replica % d == 0)
    if size == train.micro_batch_size:
        return []
    before = (train.micro_batch_size, train.gradient_accumulation)
    train.micro_batch_size = size
    if train.global_batch_size is None:
        train.gradient_accumulation = per_replica // size
    return [f"train.micro_batch_size={size} x train.gradient_accumulation={per_replica // size} (the config's "
            f"{before[0]} x {before[1]}: the same {per_replica} packs per step, fitted to the GPU's "
            f"{memory_bytes / 2**30:.1f} GiB; --set train.micro_batch_size or cuda.fit_micro_batch=false to choose)"]
