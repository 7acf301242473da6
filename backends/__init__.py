"""Backend registry: look a backend up by name; implementations are imported lazily so
that e.g. ``cpu`` never imports poptorch or CUDA-only code.

    backend = get_backend("cpu")                  # an instance, ready for prepare(...)
    backend = get_backend("cuda", config=config)  # built for the config (e.g. cuda.device)

``register_config_sections()`` registers the backends' config sections (``ipu``, ``cuda``,
``cpu``) with ``bert_packed.config``, which names no backend itself; ``run.py`` calls it before
loading a config.
"""
from __future__ import annotations

import importlib

from backends.cpu_config import CPUConfig
from backends.cuda_config import CUDAConfig
from bert_packed.backend import OfflineCompile
from bert_packed.config import ConfigError, register_section
from ipu.config import IPUConfig

# name -> (module, class, the config section it reads). Only the chosen one is imported.
BACKENDS = {
    "cpu": ("backends.cpu", "CPUBackend", "cpu"),
    "cuda": ("backends.cuda", "CUDABackend", "cuda"),
    "ipu": ("backends.ipu", "IPUBackend", "ipu"),
    "mock": ("backends.mock", "MockBackend", "ipu"),
}
SECTIONS = {"ipu": IPUConfig, "cuda": CUDAConfig, "cpu": CPUConfig}


def register_config_sections() -> None:
    """Register each backend's config section with ``bert_packed.config`` (its readers: the
    backends that read it). Again is a no-op."""
    for section, cls in SECTIONS.items():
        register_section(section, cls, readers=tuple(n for n, entry in BACKENDS.items() if entry[2] == section))


def available_backends():
    return sorted(BACKENDS)


def get_backend_class(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    module_name, class_name, _ = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"backend {name!r} could not be imported ({exc}); use --backend cpu") from None
    return getattr(module, class_name)


def get_backend(name: str, *, config=None, check_available: bool = True):
    """An instance of backend ``name`` (for ``config`` when given: ``Backend.for_config``);
    ConfigError (one line) if unknown or unavailable (for that config)."""
    cls = get_backend_class(name)
    if check_available and not cls.is_available(config):
        raise ConfigError(f"backend {name!r} is not available: {cls.unavailable_reason(config)}")
    return cls() if config is None else cls.for_config(config)


def offline_compilers():
    """Names of the backends that compile ahead of time (``run.py --compile-only``: the
    ``OfflineCompile`` capability)."""
    return [name for name in available_backends() if issubclass(get_backend_class(name), OfflineCompile)]
