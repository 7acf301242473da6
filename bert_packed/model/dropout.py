"""Dropout for the model, with a cheaper way to draw its masks on the CPU.

``dropout(x, p, training)`` is ``F.dropout``'s function, and ``Dropout`` is ``nn.Dropout``
(a subclass: same state, same ``repr``) calling it. They differ from torch's only inside
``host_dropout()``, the context the cpu backend runs its training forward in
(``cpu.fast_dropout``, on by default): there a CPU tensor's mask comes from raw random bits.

Why: torch's CPU dropout draws its mask with ``bernoulli_(1 - p)``, which costs about 5.6 ns
per element on the project's CPU (mt19937 and a double-precision compare per element), and
then divides and multiplies the mask in further passes; forward and backward together about
7.9 ns per element. A BERT step drops out every hidden state twice per layer (and once after
the embeddings) and every attention probability once, so that was 11 % of a packed
fine-tuning step (the NER profile in docs/benchmarks/trainer.md). Here one 64-bit draw from
the same generator gives the bits of two elements: an element is kept when its 32 bits, read
as a signed integer, are at least ``round(p * 2**32) - 2**31``, i.e. with probability
``1 - p`` to within ``2**-32`` (torch's own bernoulli compares a double); kept elements are
scaled by ``1 / (1 - p)``, dropped ones are 0, and the backward multiplies the gradient by the
same mask, as ``F.dropout``. Forward and backward about 4.3 ns per element (1.8x).

What stays torch's: tensors not on the CPU (CUDA's fused dropout is already cheap), a model
being compiled (inductor draws its own random numbers), ``p`` of 0 or 1, evaluation, and
everything outside ``host_dropout()``: the IPU and the mock (PopTorch lowers ``F.dropout`` to
PopART's dropout), and any user code. The masks are a function of torch's default CPU
generator, so a seeded run repeats exactly and checkpoints resume bit for bit; they are not
the masks ``bernoulli_`` would have drawn from the same seed (a different, equally valid
dropout sequence).

Only torch 2.0 operations.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Dropout", "dropout", "host_dropout", "uses_host_masks"]

_state = threading.local()


@contextlib.contextmanager
def host_dropout(enabled: bool = True):
    """Within this context (on this thread), CPU dropout masks come from raw random bits (see
    the module docstring); ``enabled=False`` is torch's ``F.dropout`` (the default outside)."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    if check is None:  # torch 2.0: torch._dynamo is imported (and found) once something compiles
        check = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return bool(check()) if check is not None else False


def uses_host_masks(x: torch.Tensor, p: float, training: bool) -> bool:
    """Whether ``dropout(x, p, training)`` draws its mask from raw bits here (else ``F.dropout``)."""
    return (training and 0.0 < p < 1.0 and getattr(_state, "enabled", False) and x.device.type == "cpu"
            and not _compiling())


def _keep_mask(shape, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``1 / (1 - p)`` where kept (probability 1 - p), 0 where dropped; ``dtype``, ``shape``."""
    numel = torch.Size(shape).numel()
    words = torch.empty((numel + 1) // 2, dtype=torch.int64).random_(-2**63, None)  # full 64-bit range
    bits = words.view(torch.int32)[:numel].view(shape)
    threshold = int(round(p * 2**32)) - 2**31
    return (bits >= threshold).to(dtype).mul_(1.0 / (1.0 - p))


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``; inside ``host_dropout()`` a CPU tensor's mask comes from raw
    random bits (same keep probability and scaling, see the module docstring)."""
    if not uses_host_masks(x, p, training):
        return F.dropout(x, p=p, training=training)
    return x * _keep_mask(x.shape, p, x.dtype)


class Dropout(nn.Dropout):
    """``nn.Dropout`` through :func:`dropout` (the same module otherwise: ``p``, ``repr``, no
    state; ``inplace=True`` keeps torch's in-place dropout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return dropout(x, self.p, self.training)
