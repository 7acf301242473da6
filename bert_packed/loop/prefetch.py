"""Micro-batches made ahead in a background thread: packing and collation off the step's
critical path.

The data source is used by the worker thread only, and produces exactly the stream it would
produce in the loop's own thread (sources draw from their own seeded generators, never the
global ones). After every micro-batch the worker records the source's ``state_dict()``;
``state_dict()`` here is the position after the last micro-batch HANDED OUT, so a checkpoint
resumes exactly where the training steps were, not where the worker had got to.

``transform`` (the backend's ``stage_batch``) is applied to every micro-batch in the worker
too, e.g. copying it into page-locked memory for a non-blocking copy to a GPU.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, Optional


class Prefetcher:
    """An iterator over ``source``'s micro-batches, ``depth`` of them made ahead (0: made in the
    caller's thread, as without a prefetcher), each passed through ``transform`` when given."""

    _POLL_SECONDS = 0.1

    def __init__(self, source, depth: int = 2, transform: Optional[Callable[[Any], Any]] = None):
        self.source, self.depth = source, int(depth)
        self.transform = transform if transform is not None else (lambda batch: batch)
        self._state = source.state_dict()
        self._iterator = iter(source)
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, self.depth))
        self._stop = threading.Event()
        self._thread = None
        if self.depth > 0:
            self._thread = threading.Thread(target=self._work, name="packed-bert-prefetch", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batch = next(self._iterator)
                item = (self.transform(batch), self.source.state_dict(), None)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=self._POLL_SECONDS)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # handed to the consumer, raised in its thread
            self._queue.put((None, None, exc))

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, Any]:
        if self._thread is None:
            batch = next(self._iterator)
            self._state = self.source.state_dict()
            return self.transform(batch)
        batch, state, error = self._queue.get()
        if error is not None:
            self._stop.set()
            raise error
        self._state = state
        return batch

    def state_dict(self) -> Dict[str, Any]:
        """The source's position after the last micro-batch handed out."""
        return self._state

    def close(self) -> None:
        """Stop the worker (it finishes the micro-batch it is making)."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=self._POLL_SECONDS)
                except queue.Empty:
                    pass
            self._thread = None
