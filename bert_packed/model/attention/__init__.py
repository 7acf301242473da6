"""Attention implementations for packed BERT: one signature, a small registry.

A pack holds several sequences side by side; token i may attend to token j only if both
belong to the same sequence (equal, non-zero ``sequence_ids``). Every implementation
enforces exactly that block-diagonal rule, so packed and unpacked runs compute the same
thing. An unpacked batch is a pack with one sequence: the same rule is then the usual
key-padding mask.

An implementation is two plain functions:

* ``prepare(sequence_ids, *, dtype) -> prepared`` runs once per forward (the mask or
  block mask is built once per batch, not once per layer); ``dtype`` is the activations'
  dtype, and an implementation that builds a float mask builds it in the dtype the scores
  will have (autocast's when autocast is on: :func:`attention_compute_dtype`). One that
  sets ``takes_max_sequences`` is also given ``max_sequences=K``, the model's
  ``max_sequences_per_pack`` (validated batches hold at most K sequences a row), as a static
  bound on the sequences of a row;
* ``attend(query, key, value, prepared, *, dropout_p, training) -> context`` runs in
  every layer, on ``[B, num_heads, S, head_dim]`` tensors, and returns the same shape.

and an optional ``check(*, device, dtype, dropout_p, needs_grad)`` that raises
``AttentionError`` when the implementation cannot do what is asked (for example a
FlexAttention backward on a CPU, or attention dropout it does not support): asking for
something impossible is an error, never a silent fallback that could leak attention
across sequences.

Registered here: ``dense`` (explicit additive mask, softmax, matmul; runs everywhere,
including the IPU through PopTorch with torch 2.0) and ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention`` with the same mask). Every query
row of their mask allows at least one key (padding attends to padding), so no kernel
ever sees a fully masked row, and masked pairs get a finite value in the scores' dtype:
padding rows stay finite in fp32, bf16 and fp16. The GPU implementations live in
``bert_packed/model/attention/flex.py`` (block-sparse FlexAttention) and
``bert_packed/model/attention/varlen.py`` (torch's variable-length Flash attention) and
register themselves with ``register_attention``; they are imported lazily on lookup so
that this module imports on a CPU-only torch 2.0. ``bert_packed/model/attention/bucketed.py``
(``bucketed``: the sequences of a batch in a few padded length buckets, one sdpa call per
bucket, so the masked scores between sequences are never computed) registers the same way;
its shapes depend on the batch, so it is for eager CPU/CUDA runs, not the IPU or torch.compile.
"""
from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from bert_packed.model.dropout import dropout

__all__ = [
    "AttentionError",
    "AttentionImplementation",
    "ATTENTION_IMPLEMENTATIONS",
    "register_attention",
    "get_attention",
    "find_attention",
    "list_attention_implementations",
    "available_attention_implementations",
    "attention_compute_dtype",
    "mask_value",
    "block_diagonal_allowed",
    "block_diagonal_additive_mask",
    "profiler_scope",
    "set_profiler_scopes",
    "dense_attend",
    "sdpa_attend",
]

# Modules that register further implementations when imported. They may need CUDA-only
# or newer-torch features, so they are imported on demand and an ImportError just means
# "not available here".
_LAZY_MODULES = ("bert_packed.model.attention.flex", "bert_packed.model.attention.varlen", "bert_packed.model.attention.bucketed")


_PROFILER_SCOPES = True


def set_profiler_scopes(enabled: bool) -> None:
    """Turn the "packing/..." ``record_function`` scopes on or off (on by default).

    A graph compiler that should not see profiler ops (e.g. a PopTorch trace) can switch
    them off; eager runs keep them, they cost about a microsecond each.
    """
    global _PROFILER_SCOPES
    _PROFILER_SCOPES = bool(enabled)


@contextlib.contextmanager
def no_profiler_scopes():
    """Run without the model's "packing/..." record_function scopes: for a graph compiler that
    traces the model (PopTorch, torch.compile), host profiler markers have no place in the graph."""
    previous = _PROFILER_SCOPES
    set_profiler_scopes(False)
    try:
        yield
    finally:
        set_profiler_scopes(previous)


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
    # Capabilities, declared once here and read by whoever decides before anything runs (the
    # backends' validation, the resolution of ``auto``, memory estimates):
    # False when the tensors' shapes depend on the batch's contents (``bucketed``): a graph
    # compiled for fixed shapes (torch.compile, PopTorch on the IPU) cannot run it.
    static_shapes: bool = True
    # Torch device types it trains on (None: every one); ``training_needs`` names what the others
    # lack (e.g. "FlexAttention backward"), for the refusal.
    trains_on: Optional[Tuple[str, ...]] = None
    training_needs: str = ""
    # False when it has no attention dropout: training then needs attention_probs_dropout_prob 0.
    dropout: bool = True
    # True when it keeps the [heads, S, S] scores of a pack in memory (a dense mask's), which an
    # activation-memory estimate counts.
    keeps_scores: bool = False
    # True when ``prepare`` takes ``max_sequences=K`` (see the module docstring).
    takes_max_sequences: bool = False

    def trains_on_device(self, device_type: str) -> bool:
        """Whether a training step on torch device type ``device_type`` can run it."""
        return self.trains_on is None or device_type in self.trains_on


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


def find_attention(name: str) -> Optional[AttentionImplementation]:
    """The implementation registered as ``name``, or None (an unknown name is refused where the
    model is configured, with the list of known ones: :func:`get_attention`)."""
    try:
        return get_attention(name)
    except AttentionError:
        return None


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


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type`` ("cpu"/"cuda"), or None when autocast is off.

    torch >= 2.4 has one device-generic pair of functions; torch 2.0 (the Poplar SDK's) has
    one per device. Other device types (e.g. a graph compiler's) are treated as "no autocast".
    """
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return None


def attention_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the attention scores are computed in for activations of ``dtype`` on ``device``.

    Under autocast the Q/K/V projections come out in the autocast dtype (bf16/fp16), so the
    scores and ``scaled_dot_product_attention``'s inputs have that dtype, not the fp32 of the
    embeddings; without autocast it is ``dtype`` itself (fp32 on CPU, fp16 on the IPU).
    """
    return _autocast_dtype(torch.device(device).type) or dtype


def mask_value(dtype: torch.dtype) -> float:
    """The additive value of a masked (query, key) pair in ``dtype``: half of its most negative finite number.

    Finite in every precision (fp16: -32752, bf16: about -1.7e38), so it stays finite after
    any realistic score is added to it, and ``exp`` of it after the softmax's max-subtraction
    is exactly 0: masked keys contribute exact zeros.
    """
    return torch.finfo(dtype).min / 2


def block_diagonal_allowed(sequence_ids: torch.Tensor) -> torch.Tensor:
    """Which key each query may attend to: bool ``[B, S, S]`` from ``sequence_ids`` ``[B, S]`` (0 = padding).

    A real token attends exactly to the tokens of its own sequence. Padding tokens attend to
    the padding of their row, never to a real token, and no real token attends to them. Why
    padding gets keys at all: a query row with every key masked has no defined softmax, and
    kernels disagree on it (the math path returns 0, sdpa's CUDA memory-efficient kernel has
    returned NaN, pytorch issue 110213), and a NaN in a padding row reaches the real tokens
    of the next layer through ``0 * NaN`` in the attention-weighted sum of values. With at
    least one allowed key per row (the token itself) every kernel computes an ordinary
    softmax, and the real tokens' outputs are the same as if padding attended to nothing.
    """
    return sequence_ids[:, :, None] == sequence_ids[:, None, :]


def block_diagonal_additive_mask(sequence_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask ``[B, 1, S, S]`` in ``dtype`` from ``sequence_ids`` ``[B, S]`` (0 = padding).

    Entry (i, j) is 0 where :func:`block_diagonal_allowed` allows query i to attend to key j
    and :func:`mask_value` (finite) elsewhere. ``dtype`` must be the dtype of the attention
    scores (see :func:`attention_compute_dtype`): an fp32 mask added to bf16 scores would
    promote the whole ``[B, N, S, S]`` score tensor to fp32, and autocast casting an fp32
    mask value to fp16 would turn it into -inf.
    """
    with profiler_scope("packing/mask"):
        allowed = block_diagonal_allowed(sequence_ids)  # [B, S, S]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=sequence_ids.device)
        mask = mask.masked_fill(~allowed, mask_value(dtype))
        return mask[:, None]  # broadcast over heads


def _prepare_additive_mask(sequence_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    # Built once per forward in the dtype the scores will have (autocast's, if it is on).
    return block_diagonal_additive_mask(sequence_ids, dtype=attention_compute_dtype(dtype, sequence_ids.device))


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
        probs = dropout(probs, dropout_p, training=True)
    return torch.matmul(probs, value)


register_attention(
    "dense",
    AttentionImplementation(
        name="dense",
        prepare=_prepare_additive_mask,
        attend=dense_attend,
        description="explicit additive block-diagonal mask; runs everywhere, including the IPU",
        keeps_scores=True,
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

    Why an additive mask in the scores' dtype rather than a boolean one: no sdpa kernel takes
    a boolean mask as such. torch (2.5 to 2.13, ``aten/.../transformers/attention.cpp``)
    converts a boolean mask to an additive one of the query's dtype inside every call (so
    once per layer here; -inf, or -65504 for cuDNN), and CUDA's Flash kernel accepts no
    mask at all (``sdp_utils.cpp``, ``check_for_attn_mask``): with any mask, sdpa runs the
    cuDNN, memory-efficient or math kernel on a GPU. Building the additive mask once per
    forward in the right dtype is the cheapest form; the mask must match the query's dtype
    exactly (or sdpa refuses it), which :func:`attention_compute_dtype` ensures under autocast.
    Packed attention reaches Flash-class kernels only without a dense mask: ``flex``
    (block-sparse) or ``varlen`` (cumulative sequence lengths).

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
        keeps_scores=True,  # no kernel without scores takes a mask (sdpa_attend)
    ),
)
