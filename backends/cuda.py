"""The ``cuda`` backend: packed BERT on NVIDIA GPUs.

It is the cpu backend's step (global-count normalisation, forward/backward per
micro-batch, gradients summed over processes, one update) with GPU hooks:

- mixed precision: ``cuda.precision`` bf16 (default; autocast, no loss scaling needed),
  fp16 (autocast + dynamic loss scaling with ``torch.amp.GradScaler``) or fp32 (TF32
  matmuls unless ``cuda.allow_tf32: false``);
- fixed shapes: every micro-batch is [B, S] packs, so ``cuda.compile: true`` compiles
  the model once. Graph compilations are counted per optimizer step; after
  ``cuda.num_warmup_steps`` steps any new graph is a recompile, reported in the metrics
  (``recompiles_after_warmup``) and an error beyond ``cuda.max_recompiles_after_warmup``;
- block-sparse attention: ``model.attention_implementation: flex`` (FlexAttention with a
  per-batch document mask, bert_packed/model/attention/flex.py); ``dense``, ``sdpa`` and
  ``varlen`` stay available;
- data parallel: ``torchrun --nproc_per_node N run.py --backend cuda ...``: one process
  per GPU (``LOCAL_RANK``), each reading its own shard of the packs. The model trains
  through ``DistributedDataParallel``: ``no_sync`` on the accumulation micro-batches, then
  DDP's bucketed all-reduce overlapped with the last micro-batch's backward, with a hook that
  SUMS the buckets (every rank's loss is already divided by the step's global counts). The
  loop's small host-side reductions (counts, checkpoint state) go over gloo (process group
  ``cpu:gloo,cuda:nccl``). Evaluation, prediction and checkpoints use the inner model;
- no host synchronisation inside a step: the metric sums, the gradient norm, the fp16 skip
  flag and loss scale stay on the GPU until the loop reads them; the step's CUDA-event time
  and the peak memory are ``Deferred`` numbers worked out then; micro-batches are staged in
  page-locked memory by the loop's prefetch thread and copied without blocking;
- the CUDA generator of every rank is in the checkpoint (``cuda_rng`` in each process's backend
  state), so a resumed run draws the same dropout masks as the uninterrupted one.

``cuda.device: cpu`` (or ``CUDABackend(device="cpu")``) runs the same code on the CPU
(autocast and GradScaler exist there too; gloo between processes, DDP included); CI uses it
to check everything but the kernels on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from backends import cuda_config
from backends.cpu import CPUBackend, RecompileError, check_attention, num_compiled_graphs  # noqa: F401
from bert_packed.model.attention import get_attention
from bert_packed.backend import Deferred, StepMetrics
from bert_packed.config import ConfigError, check_section
from bert_packed.optim import Lamb, step_unless_non_finite

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


class CUDABackend(CPUBackend):
    name = "cuda"
    config_section = "cuda"
    # Object/host collectives of the loop (CPU tensors) over gloo, gradients over NCCL; an
    # instance on cuda.device=cpu uses gloo alone.
    dist_backend = "cpu:gloo,cuda:nccl"
    cost_note = "CUDA-event time of forward+backward, fastest of interleaved runs"

    @staticmethod
    def is_available(config=None) -> bool:
        if config is not None and config.sections["cuda"].device == "cpu":
            return True  # this backend's code on the CPU
        return torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls, config=None) -> Optional[str]:
        """Why ``--backend cuda`` cannot run here (one line with the fix), or None if it can."""
        if cls.is_available(config):
            return None
        if torch.version.cuda is None:
            return (f"torch {torch.__version__} is a CPU-only build (no CUDA); install a CUDA build of torch "
                    f"on a machine with an NVIDIA GPU, or use --backend cpu (or --set cuda.device=cpu to run this "
                    f"backend's code on the CPU)")
        return ("torch sees no CUDA GPU (torch.cuda.is_available() is False: check the NVIDIA driver and "
                "CUDA_VISIBLE_DEVICES), or use --backend cpu (or --set cuda.device=cpu to run this backend's code "
                "on the CPU)")

    @classmethod
    def for_config(cls, config) -> "CUDABackend":
        return cls(device=config.sections["cuda"].device)

    @classmethod
    def resolve_attention(cls, config) -> str:
        """``auto`` on CUDA: on a GPU the fastest measured (``flex`` compiled, ``sdpa`` when the
        recipe has attention dropout or the step is eager); ``dense`` with ``cuda.device=cpu``
        (backends/cuda_config.py)."""
        return cuda_config.default_attention(config)

    @classmethod
    def validate_config(cls, config, world_size: int) -> List[str]:
        """The section's checks, after the defaults the backend resolves on a GPU are filled in
        (``cuda.compile: null``; the micro-batch fitted to the GPU's memory) in ``config``, the
        resolved copy ``resolve_run`` builds: what runs is what it then says (``--print-config``),
        each fitted change a returned line."""
        cuda = config.sections["cuda"]
        cuda.compile = cuda_config.resolved_compile(config)
        notes = cuda_config.fit_micro_batch(config, gpu_memory_bytes(config), world_size)
        check_attention(config, cls.config_section, cuda.device)
        _check_levers(config)
        return notes

    @property
    def label(self) -> str:
        return self.name if self.device.type == "cuda" else f"{self.device.type} (backend cuda)"

    def __init__(self, device: Optional[Any] = None) -> None:
        """``device``: "cuda" (default; ``LOCAL_RANK``'s GPU under torchrun), "cpu", or a
        torch.device. Given here it wins over ``cuda.device`` (``for_config`` passes that)."""
        super().__init__()
        device = torch.device("cuda" if device is None else device)
        if device.type == "cuda":
            if device.index is None:  # one process per GPU under torchrun
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)  # before the first NCCL collective
        self.device = device
        self.dist_backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        self.autocast_dtype: Optional[torch.dtype] = torch.bfloat16
        self.scaler = self.schedule = self.ddp = None
        self.overflow = self.loss_scale = None  # fp16: the last step's, on the device

    @property
    def rng_device(self) -> torch.device:
        """The device whose default generator the model's random ops (dropout) draw from; on the
        CPU that is the host generator, which the loop checkpoints itself."""
        return self.device

    # -- configuration ----------------------------------------------------------------------

    def _check_model(self, model: torch.nn.Module) -> None:
        """Refuse combinations that cannot run, before any work (one line each)."""
        cuda = self.plan.settings
        attention = model.config.attention_implementation
        dropout = model.config.attention_probs_dropout_prob
        if not get_attention(attention).dropout and dropout > 0:
            raise ConfigError(
                f"model.attention_implementation={attention} has no attention dropout but "
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
        if cuda.fp8:
            self._float8(model)
        if cuda.compile_optimizer and (not isinstance(optimizer, Lamb) or cuda.precision == "fp16"):
            raise ConfigError("cuda.compile_optimizer compiles LAMB's update with its clipping: it needs "
                              "optimizer.name=lamb and cuda.precision bf16 or fp32; set cuda.compile_optimizer=false")
        self.autocast_dtype = _AUTOCAST_DTYPES[cuda.precision]
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cuda.allow_tf32
            torch.backends.cudnn.allow_tf32 = cuda.allow_tf32
        # bf16 has fp32's exponent range; fp16 gradients underflow without scaling.
        self.scaler = _grad_scaler(self.device, cuda.loss_scale_init) if cuda.precision == "fp16" else None
        self.schedule = None
        if self.scaler is not None and scheduler is not None:
            self.schedule = _HeldBackSchedule(scheduler, self.device)
        if state is not None:
            self._load_device_state(state)
        super().prepare(model, optimizer, plan, scheduler=scheduler, state=state)

    def _float8(self, model: torch.nn.Module) -> None:
        """``cuda.fp8``: the encoder layers' linear layers to torchao's ``Float8Linear`` in place (the
        same weight and bias Parameters, so the optimizer and the checkpoints are unchanged). Dynamic
        scaling per tensor; off a GPU, torchao's emulation (fp32 arithmetic with FP8 rounding)."""
        try:  # only with cuda.fp8
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except Exception as exc:  # not installed, or built for another torch (it fails in its own ways then)
            raise ConfigError(f"cuda.fp8: torchao's float8 training does not import with torch {torch.__version__} "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); install a "
                              f"torchao built for it, or set cuda.fp8=false") from None
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ConfigError(f"cuda.fp8: {torch.cuda.get_device_name(self.device)} has no FP8 tensor cores "
                              f"(compute capability 8.9 or newer: Ada, Hopper, Blackwell); set cuda.fp8=false")
        convert_to_float8_training(model, module_filter_fn=float8_layer,
                                   config=Float8LinearConfig(emulate=self.device.type != "cuda"))

    def optimizer_step(self) -> None:
        """``cuda.compile_optimizer`` (bf16/fp32): clipping and LAMB's update in one compiled
        function (``Lamb.clip_and_step``), otherwise the step below; no host read either way."""
        if self.scaler is not None or not self.plan.settings.compile_optimizer:
            return self._optimizer_step()
        self.used_learning_rate = float(self.optimizer.param_groups[0]["lr"])  # a host number: no sync
        self.grad_norm, self.found_inf = self.optimizer.clip_and_step(self.plan.max_grad_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _load_device_state(self, state: Dict[str, Any]) -> None:
        """The loss scaler and this rank's CUDA generator from a checkpoint's ``state_dict()``."""
        if self.scaler is not None and state.get("grad_scaler") is not None:
            self.scaler.load_state_dict(state["grad_scaler"])
        generator = state.get("cuda_rng")
        if generator is not None and self.rng_device.type == "cuda":
            torch.cuda.set_rng_state(generator, self.rng_device)

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer, the loss scaler (fp16) and this rank's CUDA generator state (the
        checkpointer keeps every process's device state, and gives each its own back)."""
        state = super().state_dict()
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        if self.rng_device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.rng_device)
        return state

    # -- hooks of the cpu step --------------------------------------------------------------

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def replicate(self, model: torch.nn.Module) -> torch.nn.Module:
        """Under torchrun: ``DistributedDataParallel`` (its constructor broadcasts rank 0's weights).

        - ``find_unused_parameters=True``: DDP then keeps its first bucket layout instead of
          rebuilding it after the first step, so a resumed run sums every gradient element in
          the same order as the uninterrupted run for any number of ranks (bit-exact resume), and
          a task whose model leaves parameters without a gradient trains. It costs one walk of
          the autograd graph per optimizer step, on the host, at the last micro-batch only;
        - buckets of ``cuda.ddp_bucket_cap_mb``; ``gradient_as_bucket_view``: the gradients live
          in DDP's buckets (no second copy);
        - buffers are not re-broadcast every forward (the model's are constants);
        - the communication hook sums instead of DDP's average.
        """
        if not self.distributed():
            return model
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # Buffers synced at construction only (torch 2.13 renamed the switch).
        new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        buffers = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
        self.ddp = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.plan.settings.ddp_bucket_cap_mb, find_unused_parameters=True,
            gradient_as_bucket_view=True, **buffers)
        self.ddp.register_comm_hook(None, _sum_over_ranks)
        return self.ddp

    def micro_batch_context(self, last: bool):
        """DDP's ``no_sync`` for every micro-batch but the step's last one: gradients accumulate
        locally and are all-reduced once, bucket by bucket during the last backward."""
        if self.ddp is None or last:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def reduce_gradients(self) -> None:
        if self.ddp is None:  # one process (nothing to do) or a DDP-less subclass
            super().reduce_gradients()

    def stage_batch(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """On a GPU: the micro-batch copied into page-locked memory (in the prefetch thread), as
        numpy views, so ``to_device`` copies it without blocking."""
        if self.device.type != "cuda":
            return batch
        # This thread's current device is this process's GPU: pinning in a thread left on
        # device 0 would create a CUDA context on GPU 0 in every rank.
        with torch.cuda.device(self.device):
            return {key: _pinned(value) for key, value in batch.items()}

    def to_device(self, batch: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
        if self.device.type != "cuda":
            return super().to_device(batch)
        # From page-locked memory (stage_batch) the copy runs while the host goes on; from pageable
        # memory (the step's normaliser fields, evaluation batches) CUDA stages the data first, so
        # the array may go as soon as the call returns. Neither waits for the GPU.
        return {key: _host_tensor(value).to(self.device, non_blocking=True) for key, value in batch.items()}

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self) -> None:
        """bf16/fp32: the cpu backend's (no host read). fp16: unscale, measure and clip, skip the
        update on the device when the scaled gradients overflowed (the scaler's own flag, as
        ``GradScaler.step`` would read it on the host) or the norm is not finite, update the scale,
        and advance the schedule unless the step was skipped (``_HeldBackSchedule``)."""
        if self.scaler is None:
            return super().optimizer_step()
        if self.schedule is not None:
            self.schedule.settle()  # the previous step's advance, before this update reads the rate
        self.scaler.unscale_(self.optimizer)
        self.clip_gradients()
        self.used_learning_rate = float(self.optimizer.param_groups[0]["lr"])  # settled above: this update's
        overflow = _scaler_overflow(self.scaler, self.optimizer, self.device)
        step_unless_non_finite(self.optimizer, torch.maximum(overflow, self.found_inf.to(overflow.device)))
        self.scaler.update()
        self.overflow = overflow
        self.loss_scale = _scale_tensor(self.scaler).detach().clone()
        if self.schedule is not None:
            self.schedule.step_taken(overflow)
        self.optimizer.zero_grad(set_to_none=True)

    def sync_to_host(self) -> None:
        if self.schedule is not None:
            self.schedule.settle()

    # -- the protocol -----------------------------------------------------------------------

    def train_step(self, micro_batches: List[Dict[str, np.ndarray]]) -> StepMetrics:
        timer = _EventTimer(self.device)
        metrics = super().train_step(micro_batches).raw
        device_seconds = timer.stop()
        metrics.setdefault("recompiles_after_warmup", 0.0)  # reported on every cuda run, compiled or not
        if device_seconds is not None:
            metrics["device_seconds"] = device_seconds
            # The allocator's running peak, read when the loop reads the step (no per-step call).
            metrics["max_memory_gib"] = Deferred(lambda: torch.cuda.max_memory_allocated(self.device) / 2**30)
        if self.scaler is not None:
            metrics["loss_scale"] = self.loss_scale
            # By design, not divergence: the loop logs it and stops after
            # train.max_consecutive_skipped_steps in a row.
            metrics["skipped_step"] = self.overflow
        return StepMetrics(metrics)

    def start_timer(self) -> Callable[[], float]:
        """CUDA events bracket the GPU work itself (no host overhead, no sync inside the window),
        so ``profile()`` reports event milliseconds; off-GPU the cpu backend's wall clock."""
        if self.device.type != "cuda":
            return super().start_timer()
        timer = _EventTimer(self.device)
        return lambda: timer.stop().item()


# ----------------------------------------------------------------------------- helpers


def gpu_memory_bytes(config) -> Optional[int]:
    """Total memory of the GPU this process trains on (``LOCAL_RANK``'s), or None: no GPU visible,
    or ``cuda.device=cpu``."""
    if config.sections["cuda"].device != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory


def float8_layer(module: torch.nn.Module, name: str) -> bool:
    """Which linear layers ``cuda.fp8`` computes in FP8: the encoder layers' (Q/K/V, attention
    output, feed-forward: nearly all of BERT's FLOPs), whose widths FP8 GEMMs take (multiples of
    16). The heads (pooler, MLM transform, the decoder tied to the embeddings) stay in 16 bits."""
    return (isinstance(module, torch.nn.Linear) and ".encoder.layer." in f".{name}."
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def _check_levers(config) -> None:
    """The levers' start-up checks that need no device (one line each)."""
    cuda = config.sections["cuda"]
    if cuda.fp8:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("cuda.fp8 computes the linear layers through torchao's float8 training, which is not "
                              "installed; pip install torchao, or set cuda.fp8=false")
    if cuda.compile_optimizer and (config.optimizer.name != "lamb" or cuda.precision == "fp16"):
        raise ConfigError(f"cuda.compile_optimizer compiles LAMB's update with its clipping: it needs optimizer.name="
                          f"lamb and cuda.precision bf16 or fp32 (here {config.optimizer.name}, {cuda.precision}); "
                          f"set cuda.compile_optimizer=false")


def _sum_over_ranks(process_group, bucket):  # no annotations: DDP checks them against the real types
    """DDP communication hook: the bucket SUMMED over ranks (DDP's built-in hook averages; every
    rank's loss is already divided by the step's global counts, so the sum is the gradient of the
    global batch, the step one process takes over it)."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def _grad_scaler(device: torch.device, init_scale: float):
    if hasattr(torch.amp, "GradScaler"):  # torch >= 2.3: CUDA and CPU
        return torch.amp.GradScaler(device.type, init_scale=init_scale)
    if device.type == "cuda":  # torch 2.0 (the Poplar SDK's): only the CUDA class exists
        return torch.cuda.amp.GradScaler(init_scale=init_scale)
    raise ConfigError(f"cuda.precision=fp16 on the CPU needs torch >= 2.3 (torch.amp.GradScaler), found "
                      f"{torch.__version__}; use cuda.precision=fp32 or bf16 there")


def _scaler_overflow(scaler, optimizer, device: torch.device) -> torch.Tensor:
    """1.0 (a 0-dim float32 device tensor) when ``unscale_`` found an inf/NaN in the scaled
    gradients: the flag ``scaler.update()`` lowers the scale on and ``GradScaler.step`` reads
    (with ``.item()``) to skip the update; here it stays on the device."""
    flags = [flag.to(device, non_blocking=True) for flag in scaler._found_inf_per_device(optimizer).values()]
    return torch.stack(flags).amax()


def _scale_tensor(scaler) -> torch.Tensor:
    """The scaler's current scale as a device tensor (``get_scale()`` would read it on the host)."""
    return scaler._get_scale_async()


def _pinned(value):
    """``value`` (a numpy array) copied into page-locked memory, as a numpy view of that tensor."""
    if not isinstance(value, np.ndarray) or value.dtype == object:
        return value
    return torch.from_numpy(np.ascontiguousarray(value)).pin_memory().numpy()


def _host_tensor(array) -> torch.Tensor:
    """The CPU tensor to copy ``array`` from: for a staged array the page-locked tensor behind it
    (the host allocator then keeps that block until the non-blocking copy is done), else the
    array's memory as it is."""
    base = array.base if isinstance(array, np.ndarray) else None
    if (isinstance(base, torch.Tensor) and base.is_pinned() and base.data_ptr() == array.ctypes.data
            and tuple(base.shape) == array.shape):
        return base
    return torch.as_tensor(np.ascontiguousarray(array))


class _HeldBackSchedule:
    """fp16 only: the learning-rate schedule does not advance after a step that loss scaling
    skipped (the retried step gets the rate it was meant to have), without a host wait per step.

    Whether a step was skipped is a flag on the device. Reading it right after the step would make
    the host wait for the GPU every step. Instead the flag is copied, at the end of the step, into
    page-locked memory behind an event, and ``settle()`` reads it just before the next update reads
    the learning rate, and advances the schedule then: one step late, exactly. By then the host has
    queued the next step's forward and backward behind that event, so in a running loop the GPU has
    long passed it and the read does not wait. (The alternative, a schedule computed on the device,
    needs the optimizer to take its learning rate as a tensor and the loop's host scheduler to be
    rebuilt from the device at every checkpoint.) ``settle()`` also runs before a checkpoint
    (``sync_to_host``)."""

    def __init__(self, scheduler, device: torch.device):
        self.scheduler = scheduler
        on_gpu = device.type == "cuda"
        self.flag = torch.zeros((), dtype=torch.float32, pin_memory=on_gpu)  # the last step's skip flag, on the host
        self.event = torch.cuda.Event() if on_gpu else None
        self.pending = False  # a step's skip flag waits to be settled

    def step_taken(self, skipped: torch.Tensor) -> None:
        """Register a step's skip flag (on the device); the schedule advances for it at the next
        ``settle()``. (The step's ``learning_rate`` metric is the rate its update used, known on
        the host before the update: ``CPUBackend.learning_rate``.)"""
        self.settle()
        self.flag.copy_(skipped, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()
        self.pending = True

    def settle(self) -> None:
        """Advance the schedule for the pending step unless it was skipped."""
        pending, self.pending = self.pending, False
        if not pending:
            return
        if self.event is not None:
            self.event.synchronize()
        if not self.flag.item():
            self.scheduler.step()


class _EventTimer:
    """CUDA-event stopwatch on the current stream; ``stop()`` -> the seconds as a ``Deferred``
    (read when the loop reads the step; None off-GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.start = self.end = None
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def stop(self) -> Optional[Deferred]:
        if self.start is None:
            return None
        self.end.record()
        start, end = self.start, self.end

        def seconds() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return Deferred(seconds)
