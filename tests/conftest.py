"""Shared test configuration: hardware markers skip with a reason where the hardware is absent."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Test modules live in folders that mirror the packages (tests/packing, tests/data, ...); the shared
# helpers sit in tests/ itself, and a few test modules share fixtures with a neighbouring folder
# (test_model_fixtures, test_packing_split, test_ipu_torch20): every folder is importable by name.
TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(TESTS)):
    _path = os.path.join(TESTS, _folder)
    if os.path.isdir(_path) and not _folder.startswith((".", "_")) and _path not in sys.path:
        sys.path.append(_path)

from run import register_config_sections  # noqa: E402

register_config_sections()  # the backends' sections (ipu, cuda, cpu) and the tasks' keys, as run.py does


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _ipu_available():
    try:
        import poptorch  # noqa: F401  (the real one, from the Poplar SDK)
    except ImportError:
        return False
    return bool(poptorch.ipuHardwareIsAvailable())


def pytest_collection_modifyitems(config, items):
    skip_cuda = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    skip_ipu = None if _ipu_available() else pytest.mark.skip(reason="needs IPU hardware and the Poplar SDK")
    for item in items:
        # The markers themselves, not keywords: a checkout folder or a test id named "ipu" is no hardware mark.
        if skip_cuda is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)
        if skip_ipu is not None and item.get_closest_marker("ipu") is not None:
            item.add_marker(skip_ipu)


@pytest.fixture
def one_thread():
    """Tiny models on the shared 2-core machine: one intra-op thread avoids OpenMP spin
    stalls (several times faster than two); results are the same."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
