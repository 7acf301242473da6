"""How a run ends before its last step: the exceptions (one line for the user, an exit code)
and the SIGINT/SIGTERM flag the loop reads at step boundaries (and, in one process, between the
micro-batches of a long step: ``loop.within_step``)."""
from __future__ import annotations

import signal
import threading
import time

from packing.entry import _raise_signal as _cli_sigterm


class TrainingStopped(Exception):
    """The run stopped before its last step on purpose; ``str(exc)`` is one line for the user,
    ``exit_code`` what the command line exits with, ``label`` how that line starts."""

    exit_code, label = 1, "error"


class DivergenceError(TrainingStopped):
    """A non-finite loss / gradient norm / weight, or too many skipped steps in a row. The last
    good checkpoint is kept and summary.json says what happened."""

    exit_code = 3


class Interrupted(TrainingStopped):
    """SIGINT / SIGTERM: the run stopped at a step boundary after writing a checkpoint, or inside
    a long step, dropping it and keeping the last checkpoint (``_Run._abandon``)."""

    label = "stopped"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)  # the shell's convention for "ended by signal N"


class CollectiveTimeout(TrainingStopped):
    """Distributed run: a collective outlived ``train.collective_timeout_minutes``."""


# The interpreter's own dispositions (SIGINT raises KeyboardInterrupt, SIGTERM ends the process;
# either ignored, or None: set outside Python) and packing.entry.run_cli's SIGTERM handler.
REPLACEABLE = (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN, None, _cli_sigterm)


class StopSignals:
    """SIGINT/SIGTERM set a flag the loop reads at the next step boundary (and, with ``mid_step``,
    between the micro-batches of a long step: ``loop.within_step``); another one more than
    ``GRACE_SECONDS`` later aborts at once (KeyboardInterrupt). Signals within the grace period
    are the same request: Ctrl-C under torchrun reaches a worker twice, from the terminal and
    forwarded by the agent. Only in the main thread (handlers cannot be set elsewhere), and only
    over the handlers of a plain Python program or of our command line (``REPLACEABLE``): a
    handler the program that called ``train()`` installed itself (a test runner that must stop on
    Ctrl-C, a notebook kernel) keeps its signal."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    GRACE_SECONDS = 2.0

    def __init__(self, announce, *, mid_step: bool = False):
        self.signum, self.announce, self.previous, self.when = None, announce, {}, 0.0
        self.mid_step = mid_step  # the loop may end a long step early (loop.within_step)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) in REPLACEABLE:
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            if time.monotonic() - self.when > self.GRACE_SECONDS:
                raise KeyboardInterrupt
            return
        self.signum, self.when = signum, time.monotonic()
        try:
            when = ("stopping: a step that is nearly done is finished and checkpointed, a long one dropped"
                    if self.mid_step else "stopping after this step (a checkpoint is written)")
            self.announce(f"{signal.Signals(signum).name}: {when}; send it again to abort at once")
        except RuntimeError:  # the signal interrupted a write to the same stream: skip the notice
            pass

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        return False
