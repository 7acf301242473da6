"""The ``cpu`` backend: eager fp32, the reference every other backend is tested against.

Data parallel with ``torchrun --nproc_per_node N run.py --backend cpu`` (gloo). Each rank
runs its own micro-batches; the losses are normalised by the step's GLOBAL counts
(masked tokens / sequences over all micro-batches of all ranks, see
bert_packed.model.losses), so every rank's gradient is its share of the global-mean gradient
and the ranks' gradients are SUMMED (not averaged) with one all-reduce. The result is
the same optimizer step a single process takes over the same global batch.

The class is written to be subclassed (the cuda backend does): override the hooks
``device``, ``dist_backend``, ``autocast``, ``backward``, ``optimizer_step``, ``start_timer``,
``wrap_model``, ``replicate`` / ``micro_batch_context`` / ``reduce_gradients`` (how gradients are
summed over processes), ``learning_rate``.
"""
from __future__ import annotations

import contextlib
import ctypes
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from bert_packed.model.attention import find_attention, get_attention, list_attention_implementations, no_profiler_scopes
from bert_packed.model.dropout import host_dropout
from bert_packed.config import ConfigError
from bert_packed.backend import Backend, Profiling, StepMetrics
from bert_packed.loop.estimate import host_flops_per_second
from bert_packed.loop.within_step import watch_layers
from bert_packed.model.losses import metric_keys, step_normalizers
from bert_packed.optim import grad_norm_, step_unless_non_finite


class RecompileError(ValueError):
    """torch.compile compiled new graphs after warm-up (one line: how many, and the fix)."""


def num_compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles included).

    A process-wide counter: the backend reads it before and after each optimizer step,
    so graphs compiled outside ``train_step`` (e.g. the eval-mode graph) do not count.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of unmapping it: no ``mmap`` for large
    allocations (``M_MMAP_MAX`` 0; glibc maps every allocation over its threshold, at most 32
    MiB, afresh and pays a page fault per 4 KiB page on first touch) and no trimming of the
    heap below 2 GiB of free memory at its top. Process-wide; True where applied (glibc on
    Linux), False elsewhere (another C library, or none to ask)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own symbol: musl has no mallopt
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def native_bf16() -> Optional[bool]:
    """Whether this CPU has native bf16 instructions (AVX512-BF16 or AMX on x86, the bf16
    extension on Arm): torch's own query where it has one (2.2 and later), else the kernel's
    CPU flags (Linux); None where neither tells."""
    queries = [getattr(getattr(torch, "cpu", None), name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    queries = [query for query in queries if callable(query)]
    if queries and platform.machine().lower() in ("x86_64", "amd64"):
        return any(bool(query()) for query in queries)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = {word for line in f if line.split(":")[0].strip() in ("flags", "Features")
                     for word in line.split(":", 1)[1].split()}
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) if flags else None


def check_cpu_precision(config, section: str) -> None:
    """Refuse ``precision=bf16`` at start-up on a CPU known to lack native bf16 instructions."""
    if getattr(config.sections[section], "precision", "fp32") == "bf16" and native_bf16() is False:
        raise ConfigError(f"{section}.precision=bf16 needs a CPU with native bf16 instructions (AVX512-BF16 or "
                          f"AMX; the bf16 extension on Arm) and this one has none; use {section}.precision=fp32")


def check_attention(config, section: str, device_type: str = "cpu") -> None:
    """The one start-up check of ``model.attention_implementation`` against a backend's step, by the
    implementation's declared capabilities (``bert_packed.model.attention.AttentionImplementation``):
    ``compile`` with shapes that follow each batch (``bucketed``: every batch would compile a new
    graph, and the run would stop at the first step after warm-up with a recompile error, minutes
    of compiling later), and training on a torch device type it does not train on (flex and
    varlen have no CPU backward), each one line naming what can. An unknown name is the model
    config's error (one line there); attention dropout is checked on the built model (prepare)."""
    name = config.model.attention_implementation
    impl = find_attention(name)
    if impl is None:
        return
    settings = config.sections[section]
    if settings.compile and not impl.static_shapes:
        raise ConfigError(f"{section}.compile cannot compile model.attention_implementation={name}: its shapes "
                          f"depend on each batch (a new graph every step); set {section}.compile=false or use "
                          f"attention 'dense' or 'sdpa'")
    if not impl.trains_on_device(device_type):
        able = [n for n in list_attention_implementations()
                if get_attention(n).trains_on_device(device_type) and get_attention(n).static_shapes]
        where = f"{section}.device={device_type}" if "device" in vars(settings) else f"backend {section!r}"
        raise ConfigError(f"{where} cannot train model.attention_implementation={name}: torch has no "
                          f"{impl.training_needs} on a {device_type.upper()}; use attention "
                          f"{' or '.join(repr(n) for n in able)} there, or a GPU")


class CPUBackend(Backend, Profiling):
    name = "cpu"
    config_section = "cpu"
    device = torch.device("cpu")
    dist_backend = "gloo"  # process-group backend the loop initialises under torchrun
    cost_unit = "ms"
    cost_note = "wall time of forward+backward, fastest of interleaved runs"

    @classmethod
    def resolve_attention(cls, config) -> str:
        """``auto`` on the CPU: ``bucketed`` (attention per sequence: no work in the masked
        blocks between a pack's sequences; fine-tuning on Rotten Tomatoes 1.04-1.06x the dense
        mask at the same quality over six seeds, docs/benchmarks/trainer.md), unless the step is
        compiled (fixed shapes: ``dense``)."""
        return "dense" if config.sections[cls.config_section].compile else "bucketed"

    @classmethod
    def validate_config(cls, config, world_size: int) -> List[str]:
        check_attention(config, cls.config_section)
        check_cpu_precision(config, cls.config_section)
        return []

    @staticmethod
    def is_available(config=None) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.model = self.optimizer = self.scheduler = None
        # forward_module: the (wrapped, e.g. compiled) model for evaluation and prediction;
        # train_module: the same, or a data-parallel replica of it (cuda: DDP) for training.
        self.forward_module = self.train_module = None
        # Of the last step, set by clip_gradients: 0-dim device tensors (read by the loop when it logs).
        self.grad_norm = self.found_inf = None
        self.used_learning_rate: Optional[float] = None  # the rate of the last update (optimizer_step)
        self.num_steps = self.num_recompiles = 0
        self.cpu_bf16 = False  # cpu.precision=bf16 (set by prepare): the forward under bf16 autocast
        self.layer_handles: List[Any] = []  # the model hooks of watch_layers (prepare)

    # -- hooks (override in subclasses) ----------------------------------------------------

    def autocast(self):
        """Context manager around the forward pass: bf16 autocast with ``cpu.precision=bf16``,
        else nothing (fp32)."""
        if self.cpu_bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module used for forward calls: ``model``, or with ``compile`` set in the backend's
        section, ``torch.compile(model)`` (its state stays in ``model``). ``dynamic=False``: packs
        have one fixed [B, S] shape, so one static graph serves every step; a dynamic-shape graph
        would only cost speed (and padding's varying shapes are what packing removes)."""
        settings = self.plan.settings
        if not settings.compile:
            return model
        mode = None if settings.compile_mode == "default" else settings.compile_mode
        return torch.compile(model, mode=mode, dynamic=False)

    def tracing(self):
        """Context around a call of the (possibly compiled) model: a compiled one runs without the
        profiler scopes, which dynamo would only warn about and drop; an eager one draws its CPU
        dropout masks from raw random bits with ``fast_dropout`` (``bert_packed.model.dropout``)."""
        if self.plan.settings.compile:
            return no_profiler_scopes()
        return host_dropout(self.plan.settings.fast_dropout)

    def replicate(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make every process start from rank 0's weights (whatever its seed did); returns the
        module to train through (here ``model`` itself; gradients are summed by
        ``reduce_gradients``)."""
        if self.distributed():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        return model

    def micro_batch_context(self, last: bool):
        """Context around one training micro-batch's forward and backward; ``last``: the step's
        last one (a data-parallel wrapper synchronises gradients only there)."""
        return contextlib.nullcontext()

    def learning_rate(self) -> Any:
        """The learning rate this step's update used (the ``learning_rate`` metric): recorded by
        ``optimizer_step`` before the schedule advances, so step 1 of a warm-up logs the rate step 1
        ran at, not step 2's."""
        return self.used_learning_rate

    def compute_rate(self) -> Optional[float]:
        """On the CPU: this machine's measured rate (``loop.estimate.host_flops_per_second``); on an
        accelerator (a subclass's device): no estimate."""
        return host_flops_per_second() if self.device.type == "cpu" else None

    def to_device(self, batch: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
        return {k: torch.as_tensor(np.ascontiguousarray(v)).to(self.device) for k, v in batch.items()}

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def start_timer(self) -> Callable[[], float]:
        """Start timing device work; the returned function gives the seconds since (wall clock here)."""
        start = time.perf_counter()
        return lambda: time.perf_counter() - start

    def optimizer_step(self) -> None:
        """Clip (if configured), update, advance the schedule, clear gradients, with no host
        synchronisation: a non-finite gradient norm is not applied (the weights and moments stay
        as they were), decided on the device (``optim.step_unless_non_finite``); the loop reads
        ``grad_norm`` with the step's other numbers and stops the run at that step."""
        self.clip_gradients()
        self.used_learning_rate = float(self.optimizer.param_groups[0]["lr"])  # a host number: no sync
        step_unless_non_finite(self.optimizer, self.found_inf)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> None:
        """Measure the global gradient norm (``self.grad_norm``, before clipping, a 0-dim device
        tensor) and whether it is finite (``self.found_inf``), and clip to
        ``optimizer.max_grad_norm`` when configured: foreach norms, nothing read on the host."""
        self.grad_norm, self.found_inf = grad_norm_(self.model.parameters(), self.plan.max_grad_norm)

    # -- collectives -------------------------------------------------------------------------

    @staticmethod
    def distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (no-op in one process)."""
        if self.distributed():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def reduce_gradients(self) -> None:
        """Sum gradients over ranks: one flat all-reduce instead of one per parameter."""
        if not self.distributed():
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- the protocol ------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer: Any, plan, *, scheduler: Optional[Any] = None,
                state: Optional[Dict[str, Any]] = None) -> None:
        self.plan = plan
        self.cpu_bf16 = type(self).autocast is CPUBackend.autocast and getattr(plan.settings, "precision",
                                                                                "fp32") == "bf16"
        if plan.settings.reuse_freed_memory:
            reuse_freed_memory()
        self.model = model.to(self.device)
        self.optimizer, self.scheduler = optimizer, scheduler
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        replica = self.replicate(self.model)
        self.forward_module = self.wrap_model(self.model)
        self.train_module = self.forward_module if replica is self.model else self.wrap_model(replica)
        self.watch_layers()

    def watch_layers(self) -> None:
        """A micro-batch run eagerly on the host CPU can take minutes (BERT-Large at S=512): hooks
        on the model's encoder layers report its forward and backward layer by layer
        (``Backend.layer_done``: where it is, a stop inside it). Not on a GPU, whose layers the
        host only queues, nor in a compiled graph (``compile``: dynamo would trace the hooks)."""
        for handle in self.layer_handles:
            handle.remove()
        eager_on_host = self.device.type == "cpu" and not self.plan.settings.compile
        self.layer_handles = watch_layers(self.model, self.layer_done) if eager_on_host else []

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def _run(self, micro_batches: List[Dict[str, np.ndarray]], train: bool) -> torch.Tensor:
        """The step's summed metrics (``metric_keys`` order) over all processes, on the device."""
        keys = metric_keys(self.model)
        # Accumulated and reduced on the device: nothing is copied to the host here.
        sums = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        batches = step_normalizers(self.model, micro_batches, all_reduce=self.all_reduce_)  # the step's global counts
        module = self.train_module if train else self.forward_module
        for i, batch in enumerate(batches):
            with self.micro_batch_context(last=i == len(batches) - 1) if train else contextlib.nullcontext():
                with self.autocast(), self.tracing():
                    out = module(**self.to_device(batch))
                if train:
                    self.backward(out["loss"])
            sums += torch.stack([out[k].detach().double() for k in keys])
            if train:
                self.micro_batch_done(i, len(batches))  # progress, or a stop before the update
        return self.all_reduce_(sums)

    def train_step(self, micro_batches: List[Dict[str, np.ndarray]]) -> StepMetrics:
        """One step; its numbers stay on the device as 0-dim tensors until read (the loop reads
        them when it logs: no host synchronisation inside the step)."""
        graphs_before = num_compiled_graphs() if self.plan.settings.compile else 0
        self.model.train()
        sums = self._run(micro_batches, train=True)
        self.reduce_gradients()
        self.optimizer_step()
        metrics: Dict[str, Any] = dict(zip(metric_keys(self.model), sums.unbind()))
        metrics["grad_norm"] = self.grad_norm
        if self.scheduler is not None:
            metrics["learning_rate"] = self.learning_rate()
        if self.plan.settings.compile:
            metrics["recompiles_after_warmup"] = float(self._count_recompiles(graphs_before))
        return StepMetrics(metrics)

    def _count_recompiles(self, graphs_before: int) -> int:
        """Graphs compiled after the warm-up steps (an error beyond ``max_recompiles_after_warmup``)."""
        self.num_steps += 1
        settings, section = self.plan.settings, self.config_section
        if self.num_steps > settings.num_warmup_steps:
            self.num_recompiles += num_compiled_graphs() - graphs_before
            if self.num_recompiles > settings.max_recompiles_after_warmup:
                raise RecompileError(
                    f"torch.compile compiled {self.num_recompiles} new graph(s) after the "
                    f"{settings.num_warmup_steps} warm-up steps (at step {self.num_steps}): a shape or guard "
                    f"changed between steps; keep [B, S] fixed, or raise {section}.max_recompiles_after_warmup / "
                    f"{section}.num_warmup_steps")
        return self.num_recompiles

    @torch.no_grad()
    def eval_step(self, batch: Dict[str, np.ndarray]) -> Dict[str, float]:
        self.model.eval()
        return dict(zip(metric_keys(self.model), self._run([batch], train=False).tolist()))

    @torch.no_grad()
    def predict_step(self, batch: Dict[str, np.ndarray], names=("logits",)) -> Dict[str, np.ndarray]:
        """The model's ``names`` outputs (e.g. per-sequence ``logits`` [B,K,C]) for ``batch``, as
        float32 numpy arrays, in eval mode; no labels needed."""
        self.model.eval()
        with self.autocast(), self.tracing():
            out = self.forward_module(**self.to_device(batch))
        return {name: out[name].detach().float().cpu().numpy() for name in names}

    def scope_breakdown(self, model: torch.nn.Module, batch: Dict[str, np.ndarray]) -> Optional[Dict[str, float]]:
        from bert_packed.analysis.profiling import scope_breakdown

        return scope_breakdown(model, batch, device=str(self.device))

    def profile(self, model: torch.nn.Module, batch: Dict[str, np.ndarray], *, num_repeats: int = 5) -> Dict[str, Any]:
        """Median ms (``start_timer``) of one forward+backward of ``model`` on ``batch`` (after a warm-up)."""
        model = model.to(self.device).train()
        tensors = self.to_device(batch)
        times = []
        for i in range(num_repeats + 1):
            model.zero_grad(set_to_none=True)
            elapsed = self.start_timer()
            with self.autocast():
                loss = model(**tensors)["loss"]
            loss.backward()
            elapsed_ms = elapsed() * 1e3
            if i:  # the first call warms up allocators and caches
                times.append(elapsed_ms)
        model.zero_grad(set_to_none=True)
        return {"cost": statistics.median(times), "unit": "ms", "breakdown": None}
