"""The test suite itself (issue 49): one Ctrl-C stops it, even inside a training run a test
started in-process; every test starts from the same process-wide state (tests/conftest.py)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from bert_packed.loop.stops import StopSignals

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A test file for a child pytest with this suite's conftest (``-p conftest``): the first test trains
# in-process (run.main, as many tests do) until the parent's SIGINT, the second must never run.
CHILD_TESTS = '''
import os
import run

def test_a_long_run_in_process(tmp_path):
    out = os.environ["RUN_OUTPUT"]
    assert run.main(["--config", "tiny", "--no-progress", "--steps", "100000", "--set", "train.log_every=1",
                     "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
                     "--output-dir", out]) == 0

def test_after_it(tmp_path):
    open(os.environ["RUN_OUTPUT"] + ".second-test-ran", "w").close()
'''


def _foreground_sigint():
    """SIGINT as a terminal's foreground process has it (a suite started in the background has it
    ignored, and the child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_one_ctrl_c_stops_the_suite_inside_an_in_process_training_run(tmp_path):
    # Was: the run caught SIGINT, stopped with a checkpoint and returned 130; the test failed and
    # pytest went on with the next one (the suite carried on for minutes).
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    out = tmp_path / "run"
    env = {**os.environ, "RUN_OUTPUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                              "-p", "no:randomly", "-p", "no:hypothesispytest", "test_child.py"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=_foreground_sigint)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().count("\n") >= 2:
            assert child.poll() is None, child.communicate()[0]
            assert time.monotonic() < deadline, "the run in the child did not start"
            time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        steps_then = (out / "metrics.jsonl").read_text().count("\n")
        output, _ = child.communicate(timeout=600)  # a hang guard, not a timing: pytest's own wrap-up takes seconds
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 2, output  # pytest's "interrupted"
    assert "KeyboardInterrupt: SIGINT during test_child.py::test_a_long_run_in_process" in output, output
    assert not os.path.exists(str(out) + ".second-test-ran"), output
    # The run stopped in the step it was in (the run's own stop would also finish that step).
    assert (out / "metrics.jsonl").read_text().count("\n") <= steps_then + 1


def test_the_loop_leaves_a_handler_its_caller_installed():
    """A program that embeds train() and handles Ctrl-C itself keeps its signal; the interpreter's
    default handlers (a plain script, run.py) are the run's while it lasts and come back after."""
    def callers(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, callers)
    try:
        with StopSignals(print):
            assert signal.getsignal(signal.SIGINT) is callers
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, callers)  # the run's
        assert signal.getsignal(signal.SIGINT) is callers
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with StopSignals(print) as stop:
            assert signal.getsignal(signal.SIGINT) == stop._handle
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


THREADS_AT_COLLECTION = torch.get_num_threads()  # before any test of this worker ran


@pytest.mark.parametrize("order", ["first", "second"])
def test_every_test_starts_with_the_same_seeds_and_switches(order):
    """Each one draws what seed 0 draws and sees the switches as they were, whatever ran before
    it (the other one leaves all of them changed, as a training run changes the seeds and the
    thread count)."""
    assert np.random.rand(3).tolist() == np.random.RandomState(0).rand(3).tolist()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0)))
    assert torch.get_num_threads() == THREADS_AT_COLLECTION
    assert "PACKED_BERT_TEST_LEAK" not in os.environ
    torch.manual_seed(1234)
    np.random.seed(1234)
    torch.set_num_threads(THREADS_AT_COLLECTION + 1)
    os.environ["PACKED_BERT_TEST_LEAK"] = order
