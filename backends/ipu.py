"""The ``ipu`` backend: Graphcore IPUs through the Poplar SDK's PopTorch (ipu/backend.py).

Only the import differs from ``backends/mock.py``. PopTorch is not on PyPI: it ships as a wheel
in the Poplar SDK (see docs/ipu.md).
"""
from __future__ import annotations

from bert_packed.config import ConfigError
from ipu.backend import PopTorchBackend
from ipu import options as ipu_options

INSTALL_HINT = ("poptorch is not installed: install the Poplar SDK (graphcore.ai/downloads), "
                "`source <sdk>/enable.sh` and `pip install <sdk>/poptorch-*.whl` (torch 2.0.1), "
                "or run the same code path without IPUs with --backend mock")


def _import_poptorch():
    try:
        import poptorch
    except ImportError:
        return None
    return poptorch


class IPUBackend(PopTorchBackend):
    # name "ipu" and cost_unit "cycles" come from PopTorchBackend.

    @staticmethod
    def is_available(config=None) -> bool:
        poptorch = _import_poptorch()
        return poptorch is not None and bool(poptorch.ipuHardwareIsAvailable())

    @classmethod
    def unavailable_reason(cls, config=None) -> str:
        if _import_poptorch() is None:
            return INSTALL_HINT
        return "poptorch is installed but no IPU is visible (check `gc-info -l`); use --backend mock"

    def __init__(self) -> None:
        poptorch = _import_poptorch()
        if poptorch is None:
            raise ConfigError(INSTALL_HINT)
        try:
            import popart
        except ImportError:
            popart = None  # only used for enum values; the ints are the fallback
        super().__init__(poptorch=poptorch, popart=popart, popdist=ipu_options.import_popdist())
