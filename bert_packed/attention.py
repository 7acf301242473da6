"""Attention implementations for packed BERT: one signature, a small registry.

A pack holds several sequences side by side; token i may attend to token j only if both
belong to the same sequence (equal, non-zero ``sequence_ids``). Every implementation
enforces exactly that block-diagonal rule, so packed and unpacked runs compute the same
thing. An unpacked batch is a pack with one sequence: the same rule is then the usual
key-padding mask.

An implementation is two plain functions:

* ``prepare(sequence_ids, *, dtype) -> prepared`` runs once per forward (the mask or
  block mask is built once per batch, not once per layer);
* ``attend(query, key, value, prepared, *, dropout_p, training) -> context`` runs in
  every layer, on ``[B, num_heads, S, head_dim]`` tensors, and returns the same shape.

and an optional ``check(*, device, dtype, dropout_p, needs_grad)`` that raises
``AttentionError`` when the implementation cannot do what is asked (for example a
FlexAttention backward on a CPU, or attention dropout it does not support): asking for
something impossible is an error, never a silent fallback that could leak attention
across sequences.

Registered here: ``dense`` (explicit additive mask, softmax, matmul; runs everywhere,
including the IPU through PopTorch with torch 2.0) and ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention`` with the same mask). The CUDA
block-sparse implementation lives in ``bert_packed/flex_attention.py`` and registers
itself with ``register_attention``; it is imported lazily on lookup so that this module
imports on a CPU-only torch 2.0.
"""
from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.profiler import record_function

__all__ = [
    "AttentionError",
    "AttentionImplementation",
    "ATTENTION_IMPLEMENTATIONS",
    "register_attention",
    "get_attention",
    "list_attention_implementations",
    "available_attention_implementations",
    "block_diagonal_additive_mask",
    "profiler_scope",
    "set_profiler_scopes",
    "dense_attend",
    "sdpa_attend",
]

# Modules that register further implementations when imported. They may need CUDA-only
# or newer-torch features, so they are imported on demand and an ImportError just means
# "not available here".
_LAZY_MODULES = ("bert_packed.flex_attention",)


_PROFILER_SCOPES = True


def set_profiler_scopes(enabled: bool) -> None:
    """Turn the "packing/..." ``record_function`` scopes on or off (on by default).

    A graph compiler that should not see profiler ops (e.g. a PopTorch trace) can switch
    them off; eager runs keep them, they cost about a microsecond each.
    """
    global _PROFILER_SCOPES
    _PROFILER_SCOPES = bool(enabled)


def profiler_scope(name: str):
    """``torch.profiler.record_function(name)``, or a no-op when scopes are switched off."""
    return record_function(name) if _PROFILER_SCOPES else contextlib.nullcontext()


class AttentionError(ValueError):
    """An attention implementation was asked for something it cannot do (one-line message)."""


@dataclass(frozen=True)
class AttentionImplementation:
    """One attention implementation: see the module docstring for the contract.

    ``check`` (optional) is called once per forward, before ``prepare``; it raises
    ``AttentionError`` if this device / dtype / dropout / gradient combination is unsupported.
    """

    name: str
    prepare: Callable[..., Any]
    attend: Callable[..., torch.Tensor]
    check: Optional[Callable[..., None]] = None
    description: str = ""


ATTENTION_IMPLEMENTATIONS: Dict[str, AttentionImplementation] = {}


def register_attention(name: str, impl: AttentionImplementation) -> None:
    """Add ``impl`` to the registry under ``name`` (re-registering the same name replaces it)."""
    if not isinstance(impl, AttentionImplementation):
        raise TypeError(f"register_attention({name!r}, ...) needs an AttentionImplementation, got {type(impl).__name__}")
    ATTENTION_IMPLEMENTATIONS[name] = impl


def _import_lazy_modules() -> None:
    for module in _LAZY_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            # Missing module or a torch too old / without CUDA: those implementations are
            # simply not offered here.
            pass


def list_attention_implementations() -> List[str]:
    """Names of all registered implementations (lazy modules imported first)."""
    _import_lazy_modules()
    return sorted(ATTENTION_IMPLEMENTATIONS)


def get_attention(name: str) -> AttentionImplementation:
    """The implementation registered as ``name``; ``AttentionError`` listing the known names otherwise."""
    impl = ATTENTION_IMPLEMENTATIONS.get(name)
    if impl is None:
        _import_lazy_modules()
        impl = ATTENTION_IMPLEMENTATIONS.get(name)
    if impl is None:
        known = ", ".join(list_attention_implementations())
        raise AttentionError(f"unknown attention implementation {name!r}; choose one of: {known}")
    return impl


def available_attention_implementations(
    device: torch.device, *, dtype: torch.dtype = torch.float32, dropout_p: float = 0.0, needs_grad: bool = True
) -> List[str]:
    """Names of the implementations whose ``check`` accepts this device and mode."""
    names = []
    for name in list_attention_implementations():
        impl = ATTENTION_IMPLEMENTATIONS[name]
        if impl.check is not None:
            try:
                impl.check(device=torch.device(device), dtype=dtype, dropout_p=dropout_p, needs_grad=needs_grad)
            except AttentionError:
                continue
        names.append(name)
    return names


# ----------------------------------------------------------------------------- the mask


def block_diagonal_additive_mask(sequence_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask ``[B, 1, S, S]`` from ``sequence_ids`` ``[B, S]`` (0 = padding).

    Entry (i, j) is 0 where token j is in the same non-padding sequence as token i and a
    large negative number elsewhere. Why a finite value instead of -inf: a padding query
    row masks every key, and a row of -inf would turn the softmax into NaN, which then
    reaches real tokens through ``0 * NaN`` in the next layer. Half of the dtype's minimum
    stays finite after adding any realistic score, and ``exp`` of it is exactly 0, so the
    masked keys contribute exact zeros (this is what makes other sequences bit-identical
    when one sequence changes).
    """
    with profiler_scope("packing/mask"):
        keys = sequence_ids[:, None, :]  # [B, 1, S]
        allowed = (sequence_ids[:, :, None] == keys) & (keys != 0)  # [B, S, S]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=sequence_ids.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min / 2)
        return mask[:, None]  # broadcast over heads


def _prepare_additive_mask(sequence_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    return block_diagonal_additive_mask(sequence_ids, dtype=dtype)


# ----------------------------------------------------------------------------- dense


def dense_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prepared: torch.Tensor,
    *,
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """Softmax attention written out: scores, additive mask, softmax, dropout, weighted sum.

    Shapes: query/key/value ``[B, N, S, D]``, ``prepared`` the ``[B, 1, S, S]`` mask;
    returns ``[B, N, S, D]``. Only torch 2.0 operations (the IPU path compiles this).
    """
    # Scaling the query (B*N*S*D values) is cheaper than scaling the scores (B*N*S*S).
    query = query * (1.0 / math.sqrt(query.shape[-1]))
    scores = torch.matmul(query, key.transpose(-1, -2))
    with profiler_scope("packing/attention"):
        scores = scores + prepared
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0 and training:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, value)


register_attention(
    "dense",
    AttentionImplementation(
        name="dense",
        prepare=_prepare_additive_mask,
        attend=dense_attend,
        description="explicit additive block-diagonal mask; runs everywhere, including the IPU",
    ),
)


# ----------------------------------------------------------------------------- sdpa


def sdpa_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prepared: torch.Tensor,
    *,
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the same additive block-diagonal mask.

    The mask is applied inside the fused kernel and cannot be timed on its own, so there is
    no "packing/attention" scope here (an unpacked batch pays for the same padding mask).
    """
    return F.scaled_dot_product_attention(query, key, value, attn_mask=prepared, dropout_p=dropout_p if training else 0.0)


register_attention(
    "sdpa",
    AttentionImplementation(
        name="sdpa",
        prepare=_prepare_additive_mask,
        attend=sdpa_attend,
        description="torch scaled_dot_product_attention with the additive block-diagonal mask",
    ),
)
