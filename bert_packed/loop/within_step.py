"""Inside a step: progress over its micro-batches, the run's duration estimated from the first
one, and a stop signal honoured between micro-batches.

A step of a large configuration on a CPU can take hours (BERT-Large phase 2 on the mock: 4096
micro-batches of BERT-Large per step). Without this the user sees the opening line and then
nothing, and SIGTERM waits for the step to end. The backend reports each micro-batch through
``Backend.micro_batch_done`` (no device synchronisation); :class:`StepWatch` is the loop's hook.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

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

    def start(self, step: int, steps_in_call: int) -> None:
        """A ``train_step`` call for steps ``step`` .. ``step + steps_in_call - 1`` begins."""
        self.step, self.steps_in_call = step, steps_in_call
        self.started = self.last_line = self.clock()

    def __call__(self, index: int, count: int) -> None:
        done = index + 1
        elapsed = self.clock() - self.started
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
