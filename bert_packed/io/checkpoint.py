"""Atomic, checksummed checkpoints: everything needed to continue a run exactly.

A checkpoint is one ``torch.save`` file holding the step, model, optimizer and schedule
state, every rank's data-source position and RNG states (torch, numpy, python), the
throughput totals so far, the backend name and the configuration as given. It is written to
a temporary file in the same directory (``.checkpoint-<host>.<pid>.*.tmp``) and
``os.replace``-d into place, so a kill at any moment leaves either the previous complete
checkpoint or the new complete one, never a torn file.

After the ``torch.save`` payload comes a one-line trailer with the payload's SHA-256 and
size (``torch.load`` ignores bytes after the zip archive). ``load_checkpoint`` verifies it
before unpickling anything: a truncated, corrupted or bit-flipped file is refused with one
line naming it (:class:`CheckpointError`), it never loads into a model silently.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from bert_packed.io.files import atomic_path

CHECKPOINT_NAME = "checkpoint.pt"
_TRAILER_RE = re.compile(rb"\n#packed-bert-checkpoint v1 sha256=([0-9a-f]{64}) bytes=(\d{20})\n\Z")
_TRAILER_SIZE = len(b"\n#packed-bert-checkpoint v1 sha256=") + 64 + len(b" bytes=") + 20 + 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, truncated, corrupted, incompatible): one line."""


def rng_state() -> Dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class _HashingWriter:
    """Write-only file wrapper that hashes and counts what passes through (torch.save streams into it)."""

    def __init__(self, handle):
        self.handle, self.sha256, self.size = handle, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically, with the checksum trailer (see module docstring).

    A write that fails (a full disk, a quota) is an ``OSError`` naming ``path`` and saying that
    the checkpoint already there, if any, is intact (the temporary file is removed)."""
    try:
        with atomic_path(path, prefix=".checkpoint-", suffix=".tmp") as tmp:
            with open(tmp, "wb") as f:
                writer = _HashingWriter(f)
                torch.save(state, writer)
                f.write(b"\n#packed-bert-checkpoint v1 sha256=%s bytes=%020d\n"
                        % (writer.sha256.hexdigest().encode(), writer.size))
                f.flush()
                os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
        errno_ = getattr(exc, "errno", None) or _errno_in(exc)
        if errno_ is None:
            raise
        before = ("the previous checkpoint there is intact" if os.path.exists(path)
                  else "no earlier checkpoint was there")
        raise OSError(errno_, f"{os.strerror(errno_)}: the checkpoint was not written ({before}); free space "
                              f"or choose another --output-dir, then --resume", path) from None


def _errno_in(exc: BaseException):
    """The errno of the OSError behind ``exc`` (torch.save wraps a failed write), or None."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def verify_checkpoint(path: str) -> Tuple[str, int]:
    """(sha256, payload bytes) of a complete, intact checkpoint; CheckpointError otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < _TRAILER_SIZE:
                raise CheckpointError(f"{path}: not a complete checkpoint ({size} bytes, no checksum trailer): "
                                      f"truncated; not loaded")
            f.seek(size - _TRAILER_SIZE)
            match = _TRAILER_RE.search(f.read(_TRAILER_SIZE))
            if match is None:
                raise CheckpointError(f"{path}: no checksum trailer: the file is truncated, corrupted at its end, or "
                                      f"not a checkpoint of this project; not loaded")
            expected, payload = match.group(1).decode(), int(match.group(2))
            if payload != size - _TRAILER_SIZE:
                raise CheckpointError(f"{path}: the payload is {size - _TRAILER_SIZE} bytes but its trailer says "
                                      f"{payload}: truncated or spliced; not loaded")
            f.seek(0)
            digest, remaining = hashlib.sha256(), payload
            while remaining:
                block = f.read(min(remaining, 1 << 22))
                if not block:
                    break
                digest.update(block)
                remaining -= len(block)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: not readable (permission denied)") from None
    if digest.hexdigest() != expected:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 {digest.hexdigest()[:12]}..., trailer says "
                              f"{expected[:12]}...): the checkpoint is corrupted; not loaded")
    return expected, payload


def _plain_data_globals() -> List[Any]:
    """What a checkpoint of ours holds besides tensors and Python's plain data: numpy arrays,
    scalars and dtypes (the numpy RNG state, a task's saved outputs). Nothing that runs code."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed += [getattr(dtypes, name) for name in dir(dtypes) if name.endswith("DType")]
    return allowed


def safe_torch_load(path: str, *, mmap: bool = False) -> Any:
    """``torch.load`` of tensors and plain data only (``weights_only``, numpy allowed): a pickle
    naming anything else (a class, a function: what a malicious file uses to run code) is
    refused in one line naming it, instead of torch's multi-line advice to load it unsafely."""
    import pickle

    import inspect

    # mmap (torch >= 2.1) only saves reading; torch 2.0 reads the file.
    options = {"mmap": True} if mmap and "mmap" in inspect.signature(torch.load).parameters else {}
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        # torch < 2.5 (the Poplar SDK's 2.0.1) has no allowlist for the numpy arrays our checkpoints
        # hold (the RNG states): there the checkpoint is loaded as before this check existed, after
        # its checksum; the refusal of foreign pickles needs torch >= 2.5.
        return torch.load(path, map_location="cpu", weights_only=False, **options)
    try:
        with safe_globals(_plain_data_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, **options)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "weights only load failed" not in text.lower():
            raise
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        other = re.search(r"WeightsUnpickler error: ([^\n]{1,80})", text)
        what = f" ({found.group(1)})" if found else f" ({other.group(1).strip()})" if other else ""
        raise CheckpointError(f"{path}: not loaded: it holds Python objects beyond tensors and plain data{what}, and "
                              f"unpickling them could run any code; use a checkpoint this project wrote or weights "
                              f"in safetensors from a source you trust") from None


def load_checkpoint(path: str) -> Dict[str, Any]:
    """The state saved by :func:`save_checkpoint`, after verifying its checksum (tensors and
    plain data only: a checksum is no proof of who wrote the file)."""
    verify_checkpoint(path)
    try:
        return safe_torch_load(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - intact bytes that still do not unpickle
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: checksum is intact but torch.load failed ({first}); "
                              f"written by an incompatible version?") from None


# ----------------------------------------------------------------------------- resume compatibility
# (Which differing keys a resume may accept is declared on the config fields:
# bert_packed.config.resume_harmless_keys.)

def config_differences(saved: Dict[str, Dict[str, Any]], current: Dict[str, Dict[str, Any]]) -> List[str]:
    """Dotted keys whose values differ between two ``Config.to_dict()``s (sorted)."""
    keys = set()
    for section in set(saved) | set(current):
        a, b = saved.get(section) or {}, current.get(section) or {}
        keys.update(f"{section}.{key}" for key in set(a) | set(b) if a.get(key, _MISSING) != b.get(key, _MISSING))
    return sorted(keys)


_MISSING = object()
