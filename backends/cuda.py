"""The ``cuda`` backend: packed BERT on NVIDIA GPUs.

It is the cpu backend's step (global-count normalisation, forward/backward per
micro-batch, one summed gradient all-reduce, one update) with GPU hooks:

- mixed precision: ``cuda.precision`` bf16 (default; autocast, no loss scaling needed),
  fp16 (autocast + dynamic loss scaling with ``torch.amp.GradScaler``) or fp32 (TF32
  matmuls unless ``cuda.allow_tf32: false``);
- fixed shapes: every micro-batch is [B, S] packs, so ``cuda.compile: true`` compiles
  the model once. Graph compilations are counted per optimizer step; after
  ``cuda.num_warmup_steps`` steps any new graph is a recompile, reported in the metrics
  (``recompiles_after_warmup``) and an error beyond ``cuda.max_recompiles_after_warmup``;
- block-sparse attention: ``model.attention_implementation: flex`` (FlexAttention with a
  per-batch document mask, bert_packed/flex_attention.py); ``dense`` and ``sdpa`` stay
  available;
- data parallel: ``torchrun --nproc_per_node N run.py --backend cuda ...``: one process
  per GPU (``LOCAL_RANK``), each reading its own shard of the packs; gradients summed with
  NCCL, while the loop's small host-side reductions (counts, metrics) go over gloo
  (process group ``cpu:gloo,cuda:nccl``);
- timing with CUDA events: ``device_seconds`` per step in the metrics (GPU time between
  the step's first and last kernel) and ``profile()`` in event milliseconds.

``CUDABackend(device="cpu")`` runs the same code on the CPU (bf16/fp16 autocast and
GradScaler exist there too); the tests use it to check everything but the kernels on a
machine without a GPU. ``run.py --backend cuda`` itself refuses to start without one.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from backends.cpu import CPUBackend
from bert_packed.backend import StepMetrics
from bert_packed.config import ConfigError, check_section

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


class RecompileError(ValueError):
    """torch.compile compiled new graphs after warm-up (one line: how many, and the fix)."""


def num_compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles included).

    A process-wide counter: the backend reads it before and after each optimizer step,
    so graphs compiled outside ``train_step`` (e.g. the eval-mode graph) do not count.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CUDABackend(CPUBackend):
    name = "cuda"
    config_section = "cuda"
    # Object/host collectives of the loop (CPU tensors) over gloo, gradients over NCCL.
    dist_backend = "cpu:gloo,cuda:nccl"
    cost_note = "CUDA-event time of forward+backward, fastest of interleaved runs"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """Why ``--backend cuda`` cannot run here (one line with the fix), or None if it can."""
        if torch.version.cuda is None:
            return (f"torch {torch.__version__} is a CPU-only build (no CUDA); install a CUDA build of torch "
                    f"on a machine with an NVIDIA GPU, or use --backend cpu")
        if not torch.cuda.is_available():
            return ("torch sees no CUDA GPU (torch.cuda.is_available() is False: check the NVIDIA driver and "
                    "CUDA_VISIBLE_DEVICES), or use --backend cpu")
        return None

    def __init__(self, device: Optional[Any] = None) -> None:
        super().__init__()
        if device is None:
            # One process per GPU under torchrun; set before the first NCCL collective.
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        self.device = torch.device(device)
        self.autocast_dtype: Optional[torch.dtype] = torch.bfloat16
        self.scaler = None
        self.skipped_step = False
        self.num_steps = 0
        self.num_recompiles = 0

    # -- configuration ----------------------------------------------------------------------

    def _check_model(self, model: torch.nn.Module) -> None:
        """Refuse combinations that cannot run, before any work (one line each)."""
        cuda = self.plan.settings
        attention = model.config.attention_implementation
        dropout = model.config.attention_probs_dropout_prob
        if attention == "flex" and dropout > 0:
            raise ConfigError(
                f"model.attention_implementation=flex has no attention dropout but "
                f"model.attention_probs_dropout_prob={dropout}; set it to 0 (Graphcore's phase-2 recipe does) "
                f"or use attention 'sdpa'"
            )
        if (self.device.type == "cuda" and cuda.precision == "bf16"
                and not torch.cuda.is_bf16_supported(including_emulation=False)):
            raise ConfigError(
                f"{torch.cuda.get_device_name(self.device)} has no bf16 support; set cuda.precision=fp16 (with loss "
                f"scaling) or fp32"
            )

    def prepare(self, model: torch.nn.Module, optimizer: Any, plan, *, scheduler: Optional[Any] = None,
                state: Optional[Dict[str, Any]] = None) -> None:
        self.plan = plan
        check_section(self.config_section, plan.settings)
        self._check_model(model)
        cuda = plan.settings
        self.autocast_dtype = _AUTOCAST_DTYPES[cuda.precision]
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cuda.allow_tf32
            torch.backends.cudnn.allow_tf32 = cuda.allow_tf32
        if cuda.precision == "fp16":
            # bf16 has fp32's exponent range; fp16 gradients underflow without scaling.
            if hasattr(torch.amp, "GradScaler"):  # torch >= 2.3
                self.scaler = torch.amp.GradScaler(self.device.type, init_scale=cuda.loss_scale_init)
            else:  # torch 2.0 (the Poplar SDK's): only the CUDA class exists
                self.scaler = torch.cuda.amp.GradScaler(init_scale=cuda.loss_scale_init,
                                                        enabled=self.device.type == "cuda")
        super().prepare(model, optimizer, plan, scheduler=scheduler, state=state)

    # -- hooks of the cpu step --------------------------------------------------------------

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        cuda = self.plan.settings
        if not cuda.compile:
            return model
        # dynamic=False: packs have one fixed [B, S] shape, so one static graph serves
        # every step; a dynamic-shape graph would only cost speed.
        mode = None if cuda.compile_mode == "default" else cuda.compile_mode
        return torch.compile(model, mode=mode, dynamic=False)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(self) -> None:
        if self.scaler is None:
            return super().optimizer_step()
        # Gradients were summed over ranks while scaled (every rank uses the same scale,
        # and after the all-reduce every rank sees the same inf/nan), so all ranks skip
        # or take the step together.
        self.scaler.unscale_(self.optimizer)
        self.clip_gradients()
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # An overflowing step is skipped and the scale lowered; the schedule then stays
        # where it is, so the retried step gets the learning rate it was meant to have.
        self.skipped_step = self.scaler.get_scale() < scale
        if self.scheduler is not None and not self.skipped_step:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- the protocol -----------------------------------------------------------------------

    def train_step(self, micro_batches: List[Dict[str, np.ndarray]]) -> StepMetrics:
        graphs_before = num_compiled_graphs()
        timer = _EventTimer(self.device)
        metrics = super().train_step(micro_batches).raw
        device_seconds = timer.stop()
        self.num_steps += 1
        cuda = self.plan.settings
        if self.num_steps > cuda.num_warmup_steps:
            self.num_recompiles += num_compiled_graphs() - graphs_before
            if self.num_recompiles > cuda.max_recompiles_after_warmup:
                raise RecompileError(
                    f"torch.compile compiled {self.num_recompiles} new graph(s) after the "
                    f"{cuda.num_warmup_steps} warm-up steps (at step {self.num_steps}): a shape or guard "
                    f"changed between steps; keep [B, S] fixed, or raise cuda.max_recompiles_after_warmup / "
                    f"cuda.num_warmup_steps"
                )
        metrics["recompiles_after_warmup"] = float(self.num_recompiles)
        if device_seconds is not None:
            metrics["device_seconds"] = device_seconds
            metrics["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.scaler is not None:
            metrics["loss_scale"] = float(self.scaler.get_scale())
            # By design, not divergence: the loop logs it and stops after
            # train.max_consecutive_skipped_steps in a row.
            metrics["skipped_step"] = float(self.skipped_step)
        return StepMetrics(metrics)

    def start_timer(self) -> Callable[[], float]:
        """CUDA events bracket the GPU work itself (no host overhead, no sync inside the window),
        so ``profile()`` reports event milliseconds; off-GPU the cpu backend's wall clock."""
        if self.device.type != "cuda":
            return super().start_timer()
        return _EventTimer(self.device).stop


class _EventTimer:
    """CUDA-event stopwatch on the current stream; ``stop()`` -> seconds (None off-GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.start = self.end = None
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def stop(self) -> Optional[float]:
        if self.start is None:
            return None
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3
