"""How much of the training loop's wall time went to waiting for data (``summary.json``
``data_wait_fraction``), and the warning when the input pipeline is the bottleneck.

The loop fetches each step's micro-batches from the prefetcher (``loop.prefetch``) and then runs
the step; the time in the fetch is time the step waited for data: the reader, packing and
collation did not keep ahead. The share is taken over this invocation's loop (from its first
fetch to its end, evaluations and checkpoints included) on the main process.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

WARN_ABOVE = 0.05  # the loop waits for data more than this share of its time: warn
MIN_LOOP_SECONDS = 30.0  # a shorter loop is a smoke test (a tiny model's steps of milliseconds): not warned


class DataWait:
    """Seconds waited for data against the loop's wall time, for one invocation."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.started: Optional[float] = None
        self.stopped: Optional[float] = None
        self.waited = 0.0

    def start(self) -> None:
        self.started, self.stopped, self.waited = self.clock(), None, 0.0

    def add(self, seconds: float) -> None:
        self.waited += float(seconds)

    def stop(self) -> None:
        if self.started is not None and self.stopped is None:
            self.stopped = self.clock()

    def wall_seconds(self) -> Optional[float]:
        if self.started is None:
            return None
        return (self.stopped if self.stopped is not None else self.clock()) - self.started

    def fraction(self) -> Optional[float]:
        """The waited share of the loop's wall time (None before the loop ran)."""
        wall = self.wall_seconds()
        if not wall:
            return None
        return min(1.0, self.waited / wall)

    def warning(self) -> Optional[str]:
        """One line when the loop waited for data more than ``WARN_ABOVE`` of its time."""
        share, wall = self.fraction(), self.wall_seconds()
        if share is None or share <= WARN_ABOVE or wall < MIN_LOOP_SECONDS:
            return None
        return (f"the training loop waited for data {100 * share:.1f} % of its time ({self.waited:.1f} s of "
                f"{wall:.1f} s; summary.json data_wait_fraction): the input pipeline is the bottleneck; raise "
                f"train.prefetch_micro_batches, or read the data from faster storage")
