"""The backend contract: every member the training loop, the tasks and run.py use (:class:`Backend`),
and two optional capabilities the loop never needs: :class:`Profiling` (``run.py --profile``,
``bert_packed.analysis.profiling``) and :class:`OfflineCompile` (``run.py --compile-only``). A backend
has a capability by subclassing it; whoever needs one checks ``isinstance`` and refuses a
backend without it in one line (exit 2).

A backend owns the whole optimizer step (forward, backward, gradient reduction, update),
because on the IPU PopTorch compiles all of it into one call; so the abstraction is
``train_step``, not ``backward()``. Implementations live above this package, in ``backends/``
(``ipu/`` holds the IPU knowledge they use), and subclass :class:`Backend`; nothing here names one. Members with a default
below have that default because it is right for a backend that does not say otherwise
(one replica per process, weights on the host, nothing to compile ahead of time); the rest
must be implemented. Nothing is probed with ``getattr``: a member a backend lacks is a
mistake the base class reports.

Shapes: B = micro_batch_size packs, S = max_sequence_length, K = max_sequences_per_pack,
M = max masked tokens per pack; batch fields as in docs/internals.md.

- ``train_step(micro_batches)``: ``micro_batches`` is a list of dicts of numpy arrays, the
  ``micro_batches_per_step x steps_per_call`` micro-batches this process contributes to one
  call (step-major; within a step replica-major for a backend that feeds several replicas).
  The backend fills in the global-count normalisers (``bert_packed.model.losses.step_normalizers``,
  counts summed over processes), runs forward+backward over all of them, reduces gradients
  across processes, and applies one optimizer (and schedule) update per step. Returns the
  step's metrics over ALL processes (a list of them when ``steps_per_call > 1``; a
  ``StepMetrics`` where they stay on the device until read): the
  model's ``metric_keys`` (step means, as if the step were one unpacked batch, then the
  counts), ``learning_rate``, and where the backend has them ``grad_norm`` (global norm before
  clipping) and ``skipped_step`` (1.0 when the update was skipped on purpose, e.g. fp16 loss
  scaling after an overflow; then ``grad_norm`` may be inf). A backend never applies an
  update whose loss or gradient norm is non-finite; the loop stops the run on the first one.
  After each training micro-batch's forward and backward are issued, a backend whose step is a
  loop on the host calls ``micro_batch_done(i, n)`` (no device synchronisation: the loop uses it
  for progress inside a long step and to stop between micro-batches, raising
  ``StepAbandoned``, which the backend lets through without applying any update). A backend
  that runs a micro-batch eagerly on the host, layer by layer (cpu, the mock), also calls
  ``layer_done(phase, k, n)`` as its forward and backward reach each encoder layer
  (``bert_packed.loop.within_step.watch_layers`` installs the model hooks that do): a micro-batch
  of minutes then shows where it is and stops inside, raising ``StepAbandoned`` the same way.
- ``eval_step(batch)``: the same metrics for one micro-batch, no update.
- ``predict_step(batch, names)``: the model's ``names`` outputs as float32 numpy arrays.
- ``Profiling.profile(model, batch, num_repeats=)`` -> ``{"cost": float, "unit": str,
  "breakdown": dict or None}``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

import numpy as np

from bert_packed.errors import ConfigError

Batch = Dict[str, np.ndarray]
Metrics = Dict[str, float]


class StepAbandoned(Exception):
    """Raised by the loop's micro-batch hook (``Backend.micro_batch_done``) to stop a step before
    its update: a stop signal during a step that would take long to finish. ``done`` of ``count``
    micro-batches of the call had run; no optimizer or schedule update was applied. ``where``: the
    point it stopped at, for the user (default "after micro-batch {done} of {count}"; inside a
    micro-batch, ``Backend.layer_done``, e.g. "in micro-batch 1 of 4096 (backward, layer 20 of 24)")."""

    def __init__(self, done: int, count: int, where: Optional[str] = None):
        self.where = where or f"after micro-batch {done} of {count}"
        super().__init__(f"step abandoned {self.where}")
        self.done, self.count = done, count


class Deferred:
    """A step's number that the host can only work out once the device has got that far (the
    CUDA-event time of the step, a learning rate that depends on a flag computed on the device):
    ``item()`` (or ``float()``) works it out then, waiting for the device if it must, and keeps
    the value. A ``StepMetrics`` value may be one; the loop reads it with the tensors."""

    __slots__ = ("_read", "_value")

    def __init__(self, read: Callable[[], float]):
        self._read, self._value = read, None

    def item(self) -> float:
        if self._read is not None:
            self._value, self._read = float(self._read()), None
        return self._value

    __float__ = item

    def __repr__(self) -> str:
        return f"Deferred({'unread' if self._read is not None else self._value})"


class StepMetrics(Mapping):
    """A step's metrics as a backend returns them without waiting for the device: the values
    may be 0-dim device tensors or ``Deferred`` numbers. Reading one (``metrics["loss"]``,
    ``dict(metrics)``) gives a python float, which waits for the device then; the training loop
    instead collects ``raw`` (the values as they are) of all steps since it last looked and reads
    them in one transfer (``bert_packed.loop.logger.to_host``): no host synchronisation inside a
    step."""

    def __init__(self, values: Dict[str, Any]):
        self.raw = dict(values)

    def __getitem__(self, key: str) -> float:
        value = self.raw[key]
        return float(value) if hasattr(value, "item") else value

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __repr__(self) -> str:
        return f"StepMetrics({self.raw!r})"


class Backend:
    """Base class of every backend (see the module docstring for the step contract)."""

    #: The name ``--backend`` selects it by (``backends.BACKENDS``).
    name: ClassVar[str] = ""
    #: The config section this backend reads and validates (registered by its package), or None.
    config_section: ClassVar[Optional[str]] = None
    #: torch.distributed backend for the process group under torchrun; None: the backend has its
    #: own launcher and reports its shard through ``process_shard``.
    dist_backend: ClassVar[Optional[str]] = "gloo"

    #: Set by the training loop: called as ``micro_batch_hook(i, n)`` after micro-batch i (0-based)
    #: of the n of a ``train_step`` call was issued (``micro_batch_done``); None outside a run.
    micro_batch_hook: Optional[Callable[[int, int], None]] = None
    #: Set by the training loop with ``micro_batch_hook``: called as ``layer_hook(phase, k, n)`` when a
    #: training micro-batch's ``phase`` reaches encoder layer k (0-based) of n (``layer_done``).
    layer_hook: Optional[Callable[[str, int, int], None]] = None

    def __init__(self) -> None:
        self.plan = None  # the StepPlan of prepare()

    # -- before anything is built (class-level: usable when the backend cannot run here) -----
    @staticmethod
    def is_available(config=None) -> bool:
        """True when this machine can run the backend (hardware and libraries present), for
        ``config`` when given (a setting may choose a device that is present, e.g. cuda.device)."""
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls, config=None) -> Optional[str]:
        """Why the backend cannot run here (for ``config`` when given), one line with the fix;
        None when it can."""
        return None if cls.is_available(config) else "not available on this machine"

    @classmethod
    def for_config(cls, config) -> "Backend":
        """An unprepared instance for ``config`` (``backends.get_backend`` builds them this way:
        settings needed before ``prepare``, such as the device the process group depends on, are
        read here). The default ignores the config."""
        return cls()

    @classmethod
    def validate_config(cls, config, world_size: int) -> List[str]:
        """Check this backend's config section (and what it needs of the others); raise
        ``ConfigError`` (one line) on a mistake, return warnings. Called once per resolved run, by
        ``bert_packed.config.resolve_run``, on the copy it builds (never on the user's config),
        with ``model.attention_implementation`` already resolved (``resolve_attention``): a
        default the backend settles (cuda: ``compile: null``, the micro-batch fitted to the GPU)
        is written into that copy, in place, which is the run's configuration from then on
        (config.yaml, ``--print-config``, checkpoints), each change worth saying a returned line."""
        return []

    @classmethod
    def resolve_attention(cls, config) -> str:
        """The attention implementation ``model.attention_implementation: auto`` means here:
        ``dense``, exact and static-shaped everywhere (the IPU's block-diagonal mask). Asked once
        per resolved run (``bert_packed.config.resolve_run``, before ``validate_config``, the
        config still saying ``auto``); nothing else resolves ``auto`` for a backend."""
        return "dense"

    @classmethod
    def replicas_per_process(cls, config) -> int:
        """Data-parallel model copies one process feeds (ipu: the replication factor)."""
        return 1

    @classmethod
    def steps_per_call_for(cls, config) -> int:
        """Optimizer steps one ``train_step`` call runs (ipu: device iterations)."""
        return 1

    @classmethod
    def process_shard(cls) -> Optional[Tuple[int, int]]:
        """(index, count) of this process when the backend's own launcher started it, else None."""
        return None

    # -- the run ----------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Where the run's first line says it trains: the backend's name, or the device used
        when that is not what the name says (``--backend cuda --set cuda.device=cpu``)."""
        return self.name

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches this process contributes to one optimizer step."""
        return self._planned().micro_batches_per_step

    @property
    def steps_per_call(self) -> int:
        """Optimizer steps one ``train_step`` call runs."""
        return self._planned().steps_per_call

    def _planned(self):
        if self.plan is None:
            raise RuntimeError(f"backend {self.name!r}: prepare() first")
        return self.plan

    def prepare(self, model, optimizer, plan, *, scheduler=None, state: Optional[Dict[str, Any]] = None) -> None:
        """Take ownership of ``model``/``optimizer``/``scheduler`` for the step ``plan``
        (``bert_packed.loop.plan.StepPlan``: never the raw config). ``state``: what
        ``state_dict()`` returned at a checkpoint, applied before anything is compiled, so a
        resumed run compiles with the resumed optimizer."""
        raise NotImplementedError

    def train_step(self, micro_batches: List[Batch]):
        """One call: ``steps_per_call`` optimizer steps (see the module docstring)."""
        raise NotImplementedError

    def eval_step(self, batch: Batch) -> Metrics:
        """Metrics of ``batch`` without updating anything."""
        raise NotImplementedError

    def predict_step(self, batch: Batch, names=("logits",)) -> Dict[str, np.ndarray]:
        """The model's ``names`` outputs for ``batch`` (float32 numpy), in eval mode."""
        raise NotImplementedError

    def micro_batch_done(self, index: int, count: int) -> None:
        """Tell the loop that micro-batch ``index`` (0-based) of the ``count`` of this
        ``train_step`` call has been issued. Call it from inside the step's micro-batch loop, with
        no device synchronisation (on a GPU it marks when the host queued the work, which the
        device follows within its queue's depth). The hook may raise ``StepAbandoned``: let it
        through before any update. A backend that runs a whole step in one device call (IPU)
        never calls it; the loop then shows progress per step only."""
        if self.micro_batch_hook is not None:
            self.micro_batch_hook(index, count)

    def layer_done(self, phase: str, index: int, count: int) -> Optional[bool]:
        """Tell the loop that a training micro-batch's ``phase`` ("forward", "backward"; the
        mock's compile: "trace") reaches encoder layer ``index`` (0-based) of ``count``: called by
        the model hooks of ``bert_packed.loop.within_step.watch_layers``, which only a backend
        that runs the layers eagerly on the host installs (never inside a compiled graph). The
        hook may raise ``StepAbandoned``: let it through, as from ``micro_batch_done``. False:
        nobody needs the reports (no loop listening, or its micro-batches are short): the model
        hooks remove themselves."""
        if self.layer_hook is None:
            return False
        return self.layer_hook(phase, index, count)

    def stage_batch(self, batch: Batch) -> Batch:
        """Called on every training micro-batch as it is made, in the loop's prefetch thread (off
        the step's critical path): put it where ``train_step`` copies it to the device fastest
        (the cuda backend: page-locked memory, for non-blocking copies). Returns the same fields
        with the same values, still numpy arrays; the default returns ``batch`` itself."""
        return batch

    def sync_to_host(self) -> None:
        """Make the trained weights readable in the host model and the host's training state
        current (the schedule's position where the device decides whether it advances), before a
        checkpoint or an export. Nothing to do where both live on the host."""

    def state_dict(self) -> Dict[str, Any]:
        """What the backend must keep for an exact resume: ``optimizer`` (the optimizer state as
        the backend holds it) and any device state (e.g. RNG). Given back to ``prepare``."""
        raise NotImplementedError

    def compute_rate(self) -> Optional[float]:
        """Roughly the FLOP/s this backend's training reaches here, for the loop's warning before a
        run whose steps would take many minutes (``bert_packed.loop.estimate``); None: no
        estimate (the default: an accelerator, whose speed is not worth guessing). May measure
        for a fraction of a second; asked only for a large step."""
        return None


class Profiling:
    """Optional capability: what ``run.py --profile`` (``bert_packed.analysis.profiling``) asks of a
    backend besides the contract: the cost of one forward+backward, how to read it, and the
    backend's own extras for the report. Mix it into a :class:`Backend` subclass."""

    #: What ``profile`` measures, and how to read it (the profiling report's caption).
    cost_unit: ClassVar[str] = "ms"
    cost_note: ClassVar[str] = ""
    #: ``profile`` is exact for a fixed program (hardware cycle counters, cost models): one
    #: measurement per shape is enough.
    deterministic_cost: ClassVar[bool] = False
    #: ``profile`` prices a model on the meta device from its shapes, without running it.
    prices_from_shapes: ClassVar[bool] = False
    #: The profiler's training throughput is derived from ``profile`` costs, not measured.
    throughput_is_estimated: ClassVar[bool] = False

    def profile(self, model, batch: Batch, *, num_repeats: int = 5, **options) -> Dict[str, Any]:
        """Cost of one forward+backward of ``model`` on ``batch``: ``{"cost", "unit", "breakdown"}``."""
        raise NotImplementedError

    def profile_options(self, config, output_dir: str) -> Dict[str, Any]:
        """Extra keyword arguments for every ``profile`` call of a profiling run."""
        return {}

    def scope_breakdown(self, model, batch: Batch) -> Optional[Dict[str, float]]:
        """Fractions of a step spent in the model's packing scopes, where ``profile`` gave none."""
        return None

    def cost_scope(self, config) -> Optional[str]:
        """A sentence on what a profiled cost covers, when it is not simply one forward+backward."""
        return None

    def memory_report(self, config, output_dir: str) -> Optional[Dict[str, Any]]:
        """Write and return a memory estimate of ``config``'s layout, where the backend has one."""
        return None


class OfflineCompile:
    """Optional capability: compiling the training executable ahead of time, without the
    devices (``run.py --compile-only``). Mix it into a :class:`Backend` subclass."""

    def compile_only(self, config, output_dir: str, *, mode: str = "cache") -> Dict[str, Any]:
        """Compile the training executable ahead of time: ``mode`` "cache" fills the executable
        cache the real run loads, "report" writes the compiler's memory report instead."""
        raise NotImplementedError


def require(backend, capability: type, what: str) -> None:
    """A one-line ``ConfigError`` unless ``backend`` (object or class) has ``capability``
    (:class:`Profiling`, :class:`OfflineCompile`); ``what`` names the option that needs it."""
    cls = backend if isinstance(backend, type) else type(backend)
    if not issubclass(cls, capability):
        raise ConfigError(f"{what}: backend {cls.name!r} has no {capability.__name__} capability "
                          f"(bert_packed.backend.{capability.__name__}); use another --backend")
