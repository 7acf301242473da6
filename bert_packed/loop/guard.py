"""The divergence guard: which step's numbers stop the run, and why (one line each).

A run stops at the first step whose loss (any of the task's ``*loss`` metrics) or gradient
norm is not finite, at the first evaluation whose loss is not finite, before a checkpoint of
non-finite weights, and after ``train.max_consecutive_skipped_steps`` updates in a row that the
backend skipped on purpose (fp16 loss scaling after an overflow: then the gradient norm may be
inf, and the step is not divergence by itself). The loop turns the reason into
``DivergenceError`` with the last good checkpoint kept.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch


def non_finite(metrics: Dict[str, Any], keys: Iterable[str]) -> Optional[str]:
    """'loss nan' for the first of ``keys`` whose value in ``metrics`` is not finite, else None."""
    for key in keys:
        value = metrics.get(key)
        if value is not None and not math.isfinite(float(value)):
            return f"{key} {float(value)}"
    return None


def non_finite_weights(model) -> List[str]:
    """Names of the model's floating-point tensors holding a non-finite value."""
    return [name for name, tensor in model.state_dict().items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


class DivergenceGuard:
    """``loss_names``: the task's loss metrics (``loss`` first); ``max_consecutive_skipped``:
    skipped updates in a row that stop the run."""

    def __init__(self, loss_names: Iterable[str], max_consecutive_skipped: int):
        self.loss_names = tuple(dict.fromkeys(["loss", *loss_names]))
        self.max_consecutive_skipped = int(max_consecutive_skipped)
        self.skipped_in_a_row = 0

    def check_step(self, metrics: Dict[str, Any]) -> Optional[str]:
        """Why this step's metrics stop the run ('non-finite loss nan'), or None. A step the
        backend skipped on purpose may have a non-finite gradient norm."""
        keys = self.loss_names + (() if metrics.get("skipped_step") else ("grad_norm",))
        bad = non_finite(metrics, keys)
        return None if bad is None else f"non-finite {bad}"

    @staticmethod
    def check_evaluation(metrics: Dict[str, Any]) -> Optional[str]:
        bad = non_finite({"loss": metrics["eval_loss"]}, ("loss",))
        return None if bad is None else f"non-finite eval_{bad}"

    def count_skipped(self, step: int, metrics: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
        """(notice, stop reason) for a skipped update; (None, None) for an applied one."""
        if not metrics.get("skipped_step"):
            self.skipped_in_a_row = 0
            return None, None
        self.skipped_in_a_row += 1
        notice = (f"step {step}: update skipped by loss scaling (gradient overflow; loss scale now "
                  f"{metrics.get('loss_scale', 'lowered')}), {self.skipped_in_a_row} in a row")
        stop = None
        if self.skipped_in_a_row >= self.max_consecutive_skipped:
            stop = (f"{self.skipped_in_a_row} consecutive updates skipped by loss scaling "
                    f"(train.max_consecutive_skipped_steps={self.max_consecutive_skipped})")
        return notice, stop
