"""The attention registry and what every implementation shares (the package's docstring says
what an implementation is); ``bert_packed.model.attention`` re-exports it."""
from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.profiler import record_function


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
]

# Every module of this package is an implementation that registers itself when imported
# (``register_attention`` at its end): adding one is adding its module. ``dense`` and ``sdpa``
# are imported with the package; the others may need CUDA-only or newer-torch features, so they
# are found on disk and imported on demand, and an ImportError just means "not available here".
_PACKAGE = __name__.rpartition(".")[0]
_EAGER_MODULES = ("dense", "sdpa")


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


def _lazy_modules() -> List[str]:
    """The package's implementation modules not imported with it (found on disk, not listed)."""
    return [f"{_PACKAGE}.{info.name}" for info in pkgutil.iter_modules([os.path.dirname(__file__)])
            if not info.ispkg and info.name not in _EAGER_MODULES + ("registry",)]


def _import_lazy_modules() -> None:
    for module in _lazy_modules():
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


def prepare_additive_mask(sequence_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The ``prepare`` of ``dense`` and ``sdpa``: the additive block-diagonal mask, built once per
    forward in the dtype the scores will have (autocast's, if it is on)."""
    return block_diagonal_additive_mask(sequence_ids, dtype=attention_compute_dtype(dtype, sequence_ids.device))
