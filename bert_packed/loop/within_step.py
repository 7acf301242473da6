"""Inside a step: progress over its micro-batches, the run's duration estimated from the first
one, and a stop signal honoured between micro-batches, and inside one between its layers.

A step of a large configuration on a CPU can take hours (BERT-Large phase 2 on the mock: 4096
micro-batches of BERT-Large per step, the first one minutes). Without this the user sees the
opening line and then nothing, and SIGTERM waits for the step (or the micro-batch) to end. The
backend reports each micro-batch through ``Backend.micro_batch_done`` (no device
synchronisation) and, where it runs the layers eagerly on the host, each encoder layer its
forward and backward reach through ``Backend.layer_done`` (model hooks: :func:`watch_layers`);
:class:`StepWatch` is the loop's hook for both.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch

from bert_packed.backend import StepAbandoned

# A progress line inside a step at most this often (seconds): on a pipe (a log file) a line every
# 15 s shows the run is alive without flooding it; on a terminal the same lines sit above the bar.
LINE_EVERY_SECONDS = 15.0
# On a terminal the bar's status is redrawn at most this often instead of lines.
STATUS_EVERY_SECONDS = 1.0
# The estimate line after the invocation's first micro-batch, when one step will take at least
# this long (faster runs show their pace in the per-step progress soon enough).
ESTIMATE_FROM_SECONDS = 10.0
# A stop signal abandons the step when finishing it would take longer than this; a step that is
# nearly done is finished instead and checkpointed, as at any step boundary.
ABANDON_FROM_SECONDS = 2.0
# The layer reports (``watch_layers``) are removed for the rest of the run when the run's first
# micro-batch took less than this: a stop between micro-batches comes soon enough then, and the
# hooks would cost a small model's step ~15 %.
LAYERS_FROM_SECONDS = 1.0


def memory_text() -> str:
    """This process's resident memory for a progress line ("RSS 5.2 GiB", psutil's on every
    system); "" where it cannot be read."""
    try:
        import psutil

        return f"RSS {psutil.Process().memory_info().rss / 2 ** 30:.1f} GiB"
    except Exception:  # psutil missing, or the system refuses: the line goes without it
        return ""


def watch_layers(model, layer_done: Callable[[str, int, int], None]) -> List:
    """Model hooks that call ``layer_done(phase, k, n)`` as a training micro-batch runs encoder
    layer k of n: ``"forward"`` before the layer's forward and before each of its parts (its
    child modules: attention, intermediate, output), ``"backward"`` as the gradient of the
    layer's output and of each part's output is ready (before that part's backward). A layer of
    BERT-Large takes seconds on a busy CPU; its parts are a third of that each. The layers are
    the ones the model declares (``model.pipeline_layout()``); the model's code is unchanged.
    Evaluation (no gradient, eval mode) calls nothing. When ``layer_done`` returns False the
    hooks remove themselves (a run of short micro-batches, or no run listening). Returns the hook
    handles (``handle.remove()``); none for a model that declares no layout. Only for a model run
    eagerly: a compiled graph (torch.compile, PopTorch) must not contain them."""
    try:
        layers = list(model.pipeline_layout().layers)
    except NotImplementedError:
        return []
    count, handles = len(layers), []

    def report(phase: str, index: int) -> None:
        if layer_done(phase, index, count) is False:
            for handle in handles:
                handle.remove()

    for index, layer in enumerate(layers):
        def before(module, args, index=index):
            if module.training and torch.is_grad_enabled():
                report("forward", index)

        def after(module, args, output, index=index):
            if module.training and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: report("backward", index))

        for part in (layer, *layer.children()):
            handles += [part.register_forward_pre_hook(before), part.register_forward_hook(after)]
    return handles


def duration_text(seconds: float) -> str:
    """``seconds`` rounded for a person: "0.04 s", "4.4 s", "45 s", "12 min", "3 h 10 min", "6,700 h"."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    if hours < 100:
        return f"{int(hours)} h {int((seconds % 3600) / 60)} min"
    return f"{float(f'{hours:.2g}'):,.0f} h"


class StepWatch:
    """The backend's micro-batch hook for one run (one process).

    ``write``: where progress lines go (``None``: no progress shown; the stop still works);
    ``status``: on a terminal, a one-line status to redraw (the progress bar's), used instead of
    the progress lines inside a step;
    ``stop``: the run's ``StopSignals`` (its ``signum`` is set by SIGINT/SIGTERM);
    ``can_abandon``: whether a stop may end a step early (one process only: with several, the
    others would wait for this one in the step's gradient reduction); ``clock``: seconds,
    replaceable in tests."""

    def __init__(self, write: Optional[Callable[[str], None]], stop, *, total_steps: int, can_abandon: bool,
                 status: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.monotonic):
        self.write, self.status, self.stop, self.total_steps = write, status, stop, total_steps
        self.can_abandon, self.clock = can_abandon, clock
        self.step, self.steps_in_call, self.started, self.last_line = 0, 1, 0.0, 0.0
        self.estimated = False
        self.micro_batches = self.done = 0  # in this call: micro-batches, and those finished
        self.done_at = 0.0  # when the last micro-batch finished (or the call started)
        self.read_from = 0.0  # when the loop began reading the next call's micro-batches (``read``)
        self.layers_wanted: Optional[bool] = None  # decided by the run's first micro-batch (``layer``)
        self.traced = False  # this call began with a trace of the model (the mock's compile)

    def start(self, step: int, steps_in_call: int, micro_batches: int = 0) -> None:
        """A ``train_step`` call for steps ``step`` .. ``step + steps_in_call - 1`` begins, over
        ``micro_batches`` micro-batches (0: not said; then a stop inside a micro-batch counts as long)."""
        self.step, self.steps_in_call, self.micro_batches = step, steps_in_call, micro_batches
        self.started = self.last_line = self.done_at = self.clock()
        self.done, self.traced = 0, False

    def read(self, index: int, count: int) -> None:
        """The loop read micro-batch ``index`` of the ``count`` of the next call (before
        ``start``): thousands of them take seconds on a busy host, so a stop that comes meanwhile
        drops the step once reading has taken ``ABANDON_FROM_SECONDS`` (a quick read is followed
        by the step and a checkpoint, as at any step boundary)."""
        now = self.clock()
        if index == 0:
            self.read_from = now
        elif self.stop.signum is not None and self.can_abandon and now - self.read_from > ABANDON_FROM_SECONDS:
            raise StepAbandoned(0, count, where=f"while its micro-batches were read ({index + 1} of {count})")

    def __call__(self, index: int, count: int) -> None:
        done = self.done = index + 1
        self.done_at = self.clock()
        elapsed = self.done_at - self.started
        if self.layers_wanted is None:
            self.layers_wanted = elapsed >= LAYERS_FROM_SECONDS
        per_micro_batch = elapsed / done
        left = per_micro_batch * (count - done)  # seconds, at this step's pace so far
        if self.stop.signum is not None and self.can_abandon and left > ABANDON_FROM_SECONDS:
            raise StepAbandoned(done, count)
        if self.write is None or done == count:
            return
        per_step = per_micro_batch * count / self.steps_in_call
        if not self.estimated:
            self.estimated = True
            if per_step >= ESTIMATE_FROM_SECONDS:
                steps_left = self.total_steps - self.step + 1
                self.write(f"step {self.step}: micro-batch 1 of {count} took {duration_text(elapsed)}: "
                           f"~{duration_text(per_step)} per step, run ~{duration_text(per_step * steps_left)} for "
                           f"the {steps_left} steps left at this rate")
                self.last_line = self.clock()
            return
        now = self.clock()
        if now - self.last_line >= (LINE_EVERY_SECONDS if self.status is None else STATUS_EVERY_SECONDS):
            self.last_line = now
            if self.status is not None:
                self.status(f"step {self.step}: micro-batch {done}/{count}, ~{duration_text(left)} left")
                return
            self.write(f"step {self.step}: micro-batch {done}/{count}, {duration_text(elapsed)} so far, "
                       f"~{duration_text(left)} left in this step")

    def layer(self, phase: str, index: int, count: int) -> bool:
        """The backend's layer hook (``Backend.layer_done``): the current micro-batch's ``phase``
        reaches encoder layer ``index`` of ``count``. A stop abandons the step here when the rest
        of it would take longer than ``ABANDON_FROM_SECONDS``; else, while a micro-batch is slow to
        come, the progress says where it is and how much memory the process holds (the first
        minute of a huge run). Returns False once the run's first micro-batch was short: the
        layer reports are then removed (``watch_layers``)."""
        if self.layers_wanted is False:
            return False
        if phase == "trace":
            self.traced = True
        abandon = (self.stop.signum is not None and self.can_abandon
                   and self._left(phase, index, count) > ABANDON_FROM_SECONDS)
        if not abandon and (self.write is None or self.clock() - max(self.last_line, self.done_at) < (
                LINE_EVERY_SECONDS if self.status is None else STATUS_EVERY_SECONDS)):
            return True  # the common case (a micro-batch shorter than a progress interval says it at its end)
        if phase == "trace":
            doing, detail = "tracing the model to compile it", f"layer {index + 1} of {count}"
        else:
            of = f" of {self.micro_batches}" if self.micro_batches else ""
            doing, detail = f"micro-batch {self.done + 1}{of}", f"{phase}, layer {index + 1} of {count}"
        if abandon:
            raise StepAbandoned(self.done, self.micro_batches,
                                where=f"{'while' if phase == 'trace' else 'in'} {doing} ({detail})")
        now = self.last_line = self.clock()
        rss = memory_text()
        memory = f", {rss}" if rss else ""
        if self.status is not None:
            self.status(f"step {self.step}: {doing}: {detail}{memory}")
        else:
            self.write(f"step {self.step}: {doing}: {detail}, {duration_text(now - self.started)} so far{memory}")
        return True

    def _left(self, phase: str, index: int, count: int) -> float:
        """Seconds the call would still take, from its pace so far in layer units (a layer's
        forward 1, its backward 2, a micro-batch 3 x ``count``, the mock's trace ``count``);
        infinite when the call's size is not said, 0 at its first layer (the next one can tell)."""
        if not self.micro_batches:
            return float("inf")
        if phase == "trace":
            units = index
        else:
            within = index if phase == "forward" else count + 2 * (count - 1 - index)
            units = (count if self.traced else 0) + 3 * count * self.done + within
        if units <= 0:
            return 0.0
        total = (count if self.traced else 0) + 3 * count * self.micro_batches
        return (self.clock() - self.started) * (total - units) / units
