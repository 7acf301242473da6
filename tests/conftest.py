"""Shared test configuration: hardware markers skip with a reason where the hardware is absent;
every test starts from the same process-wide state (seeds, torch's switches, the environment,
the working directory, the signal handlers) whatever ran before it in the same worker, so the
suite gives the same answer in any order and with any number of workers (pytest-xdist); one
Ctrl-C stops the run even when the code under test turns it into an error of its own."""
import os
import random
import signal
import sys
import threading

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


# -- The same start for every test ----------------------------------------------------------------


def _torch_switches() -> dict:
    """torch's process-wide settings a test may change (``train.num_threads``, a backend's
    precision, a test of determinism), each with the call that puts it back."""
    import torch

    return {
        "torch.get_num_threads()": (torch.get_num_threads(), torch.set_num_threads),
        "torch.are_deterministic_algorithms_enabled()": (
            (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
            lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
        "torch.get_default_dtype()": (torch.get_default_dtype(), torch.set_default_dtype),
        "torch.is_grad_enabled()": (torch.is_grad_enabled(), torch.set_grad_enabled),
        "torch.is_anomaly_enabled()": (torch.is_anomaly_enabled(), torch.set_anomaly_enabled),
        "torch.get_float32_matmul_precision()": (torch.get_float32_matmul_precision(),
                                                 torch.set_float32_matmul_precision),
        "torch.backends.mkldnn.enabled": (torch.backends.mkldnn.enabled,
                                          lambda value: setattr(torch.backends.mkldnn, "enabled", value)),
    }


# Set by pytest itself, and by torch on its first compile (its cache folder, for the process).
OWN_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def _process_state() -> dict:
    state = {name: value for name, value in _torch_switches().items()}
    state["os.environ"] = ({k: v for k, v in os.environ.items() if k not in OWN_VARIABLES}, _restore_environ)
    state["os.getcwd()"] = (os.getcwd(), os.chdir)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            state[f"signal.getsignal({signal.Signals(signum).name})"] = (
                signal.getsignal(signum), lambda handler, signum=signum: signal.signal(signum, handler))
    return state


def _restore_environ(saved: dict) -> None:
    for key in [k for k in os.environ if k not in saved and k not in OWN_VARIABLES]:
        del os.environ[key]
    os.environ.update(saved)


LEAKS = []  # (test id, what it left changed): put back, and listed at the end of the run


@pytest.fixture(autouse=True)
def _same_start(request):
    """Seeds every test the same way (Python's, numpy's and torch's global generators: a test
    that draws without its own seed draws the same numbers in any order) and puts back what the
    test changed of the process: ``train()`` seeds the global generators and sets
    ``train.num_threads`` for its run, a test may set an environment variable or change
    directory without monkeypatch."""
    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    before = _process_state()
    yield
    after = _process_state()
    for name, (value, restore) in before.items():
        if name in after and after[name][0] != value:
            if isinstance(value, dict):  # the environment: which variables
                now = after[name][0]
                name += " " + ", ".join(sorted(k for k in set(value) | set(now) if value.get(k) != now.get(k)))
            LEAKS.append((request.node.nodeid, name))
            restore(value)


def pytest_terminal_summary(terminalreporter):
    if LEAKS:
        terminalreporter.section("global state a test left changed (put back for the next test)")
        for nodeid, name in LEAKS:
            terminalreporter.write_line(f"{nodeid}: {name}")


# -- One Ctrl-C stops the run ------------------------------------------------------------------------
# The code under test turns a KeyboardInterrupt into its own outcome on purpose (run.main returns
# 130, a training run stops with a checkpoint and raises Interrupted): a test that called it fails
# and pytest would go on with the next one. The suite's SIGINT handler remembers the signal, so
# pytest stops after the test it arrived in whatever that test's code made of it; the training
# loop leaves a handler it did not expect alone (bert_packed/loop/stops.py), so the signal
# reaches this one.
SIGINTS = []


def _sigint(signum, frame):
    SIGINTS.append(signum)
    raise KeyboardInterrupt


def pytest_configure(config):
    # Only where Ctrl-C would stop pytest anyway: a run started in the background ignores SIGINT.
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _sigint)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if SIGINTS:
        raise KeyboardInterrupt(f"SIGINT during {item.nodeid}")


@pytest.fixture
def sigint_to_the_code():
    """For a test that sends itself SIGINT to see what the code makes of a Ctrl-C: the
    interpreter's own handler for the test (the suite's, which stops the run, is put back after)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
