"""Atomic checkpoints: everything needed to continue a run exactly.

A checkpoint is one ``torch.save`` file holding the step, model, optimizer and schedule
state, every rank's data-source position and RNG states (torch, numpy, python), and the
throughput totals so far. It is written to a temporary file in the same directory and
``os.replace``-d into place, so a kill at any moment leaves either the previous complete
checkpoint or the new complete one, never a torn file.
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict

import numpy as np
import torch

from bert_packed.io import atomic_path

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> Dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temp file in the same directory + os.replace)."""
    with atomic_path(path, prefix=".checkpoint-", suffix=".tmp") as tmp:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def load_checkpoint(path: str) -> Dict[str, Any]:
    # weights_only=False: the file holds RNG states and python objects we wrote ourselves.
    return torch.load(path, map_location="cpu", weights_only=False)
