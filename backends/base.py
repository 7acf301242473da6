"""The Backend protocol: what run.py and the training loop need from a device.

A backend owns the whole optimizer step (forward, backward, gradient reduction,
update), because on the IPU PopTorch compiles all of it into one call; so the
abstraction is ``train_step``, not ``backward()``.

Contract (shapes: B = micro_batch_size packs, S = max_sequence_length, K =
max_sequences_per_pack, M = max masked tokens per pack; fields as in docs/internals.md):

- ``train_step(micro_batches)``: ``micro_batches`` is a list of dicts of numpy arrays,
  one per micro-batch this process contributes to ONE optimizer step (its gradient
  accumulation micro-batches; for ipu/mock, all local replicas' micro-batches, replica
  major). The backend fills in the global-count normalisers (all-reducing the counts
  across processes), runs forward+backward over all of them, reduces gradients across
  processes, and applies one optimizer (and schedule) update. Returns the step's metrics
  over ALL processes: ``loss``, ``mlm_loss``, ``nsp_loss`` (step means, as if the step were
  one unpacked batch), ``mlm_accuracy``, ``nsp_accuracy``, and the counts
  ``num_sequences``, ``num_mlm_tokens`` (python floats). Optional: ``grad_norm`` (global
  gradient norm of the step before clipping, where the backend has it: cpu, cuda) and
  ``skipped_step`` (1.0 when the backend skipped the update on purpose, e.g. fp16 loss
  scaling after an overflow; then ``grad_norm`` may be inf). The loop stops the run on the
  first non-finite ``loss``/``mlm_loss``/``nsp_loss``, or ``grad_norm`` of a step not skipped
  on purpose (a backend should not apply such an update), and after
  ``train.max_consecutive_skipped_steps`` skipped steps in a row.
- ``eval_step(batch)``: same metrics for one micro-batch dict, no update (global over
  processes as well).
- ``profile(model, batch, *, num_repeats=5)`` -> ``{"cost": float, "unit": str,
  "breakdown": dict or None}``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, runtime_checkable

import numpy as np

Batch = Dict[str, np.ndarray]
Metrics = Dict[str, float]


@runtime_checkable
class Backend(Protocol):
    name: str

    @staticmethod
    def is_available() -> bool:
        """True when this machine can run the backend (hardware and libraries present)."""

    def prepare(self, model: Any, optimizer: Any, config: Any, scheduler: Optional[Any] = None) -> None:
        """Take ownership of model/optimizer/schedule (move to device, compile, wrap)."""

    def train_step(self, micro_batches: List[Batch]) -> Metrics:
        """One optimizer step over ``micro_batches`` (see module docstring)."""

    def eval_step(self, batch: Batch) -> Metrics:
        """Metrics of ``batch`` without updating anything."""

    def profile(self, model: Any, batch: Batch, *, num_repeats: int = 5) -> Dict[str, Any]:
        """Cost of one forward+backward of ``model`` on ``batch``."""
