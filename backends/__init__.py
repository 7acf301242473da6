"""Backend registry: look a backend up by name; implementations are imported lazily so
that e.g. ``cpu`` never imports poptorch or CUDA-only code.

    backend = get_backend("cpu")          # an instance, ready for prepare(...)
"""
from __future__ import annotations

import importlib

from bert_packed.config import ConfigError

# name -> (module, class). Only the chosen one is imported.
BACKENDS = {
    "cpu": ("backends.cpu", "CPUBackend"),
    "cuda": ("backends.cuda", "CUDABackend"),
    "ipu": ("backends.ipu", "IPUBackend"),
    "mock": ("backends.mock", "MockBackend"),
}

# Why a backend can't run, shown to the user with the fix.
_UNAVAILABLE_HINTS = {
    "cuda": "no CUDA GPU visible to torch (torch.cuda.is_available() is False); use --backend cpu",
    "ipu": "no IPU found (needs the Poplar SDK's poptorch and IPU hardware); use --backend mock to run the IPU code path",
}


def available_backends():
    return sorted(BACKENDS)


def get_backend_class(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    module_name, class_name = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"backend {name!r} could not be imported ({exc}); use --backend cpu") from None
    return getattr(module, class_name)


def get_backend(name: str, *, check_available: bool = True):
    """An instance of backend ``name``; ConfigError (one line) if unknown or unavailable."""
    cls = get_backend_class(name)
    if check_available and not cls.is_available():
        reason = getattr(cls, "unavailable_reason", None)
        hint = (reason() if callable(reason) else None) or _UNAVAILABLE_HINTS.get(name, "not available on this machine")
        raise ConfigError(f"backend {name!r} is not available: {hint}")
    return cls()
