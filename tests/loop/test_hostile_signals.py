"""Hostile inputs that need a real process: Ctrl-C (SIGINT) and SIGTERM stop training at the
next step boundary with a final checkpoint and one line, and the run resumes from it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from hostile import TINY, run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _start(out):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), *TINY, "--steps", "5000",
                             "--output-dir", str(out)], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_steps(process, metrics, count, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach {count} steps: {process.poll()}")


@pytest.mark.slow
def test_sigint_and_sigterm_stop_at_a_step_boundary_with_a_checkpoint(tmp_path, capsys):
    # Both signals at once, in two runs side by side (the process start-up dominates the time).
    runs = {signum: (tmp_path / signal.Signals(signum).name, None) for signum in (signal.SIGINT, signal.SIGTERM)}
    runs = {signum: (out, _start(out)) for signum, (out, _) in runs.items()}
    for signum, (out, process) in runs.items():
        _wait_for_steps(process, out / "metrics.jsonl", 3)
        process.send_signal(signum)
    for signum, (out, process) in runs.items():
        assert process.wait(timeout=120) == 128 + signum
        lines = process.stderr.read().strip().splitlines()
        step = load_checkpoint(str(out / CHECKPOINT_NAME))["step"]
        assert lines == [f"stopped: {signal.Signals(signum).name} at step {step} of 5000: checkpoint "
                         f"{out / CHECKPOINT_NAME} written; continue with --resume"]
        with open(out / "metrics.jsonl") as f:
            assert [json.loads(line)["step"] for line in f] == list(range(1, step + 1))
        with open(out / "summary.json") as f:
            assert json.load(f)["status"] == "interrupted"
        # No temp files: exactly the run's outputs.
        assert sorted(os.listdir(out)) == [".lock", CHECKPOINT_NAME, "metrics.jsonl", "summary.json"]
    out = runs[signal.SIGINT][0]  # and a stopped run continues from its checkpoint
    step = load_checkpoint(str(out / CHECKPOINT_NAME))["step"]
    run_ok(capsys, TINY + ["--steps", str(step + 2), "--resume", "--output-dir", str(out)])
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, step + 3))


def _run_with(code_before, argv, signum_hint=""):
    """``python run.py ARGV`` as __main__ after ``code_before``: (status, stderr lines)."""
    script = (f"import os, runpy, signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"{code_before}\nsys.argv = ['run.py'] + {argv!r}\nrunpy.run_path('run.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=300)
    return result.returncode, [line for line in result.stderr.strip().splitlines() if not line.startswith("note:")]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow
def test_a_signal_while_the_final_export_is_written_is_handled_the_same(tmp_path, signum):
    # Was: SIGTERM here killed the process outright (no summary.json, the export's temporary
    # file left behind) while Ctrl-C at the same moment was handled. The signal arrives while
    # the weights' temporary file is being written.
    patch = ("import safetensors.torch as st\nreal = st.save_file\n"
             "def save_file(state, path, metadata=None):\n"
             "    real(state, path, metadata=metadata)\n"
             f"    os.kill(os.getpid(), {int(signum)})\n"
             "    time.sleep(5)\n"
             "st.save_file = save_file\n")
    out = tmp_path / "run"
    code, lines = _run_with(patch, TINY + ["--steps", "4", "--set", "train.checkpoint_every=2", "--output-dir",
                                           str(out)])
    name = signal.Signals(signum).name
    assert (code, lines) == (128 + signum, [
        f"stopped: {name} after the last step (4), while the end-of-run outputs (final evaluation, predictions, "
        f"OUT/hf) were written: they are incomplete; the checkpoint {out / CHECKPOINT_NAME} holds step 4 (python -m "
        f"bert_packed.finetune export {out} --output DIR writes its Hugging Face export)"])
    with open(out / "summary.json") as f:
        assert json.load(f)["status"] == "interrupted"
    left = [os.path.join(folder, n) for folder, _, names in os.walk(out) for n in names if n.startswith(".")]
    assert left == [str(out / ".lock")], left  # no temporary file
    assert load_checkpoint(str(out / CHECKPOINT_NAME))["step"] == 4


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_run_is_set_up_leaves_no_trace(tmp_path, signum):
    # Was: SIGTERM before the first step killed the process and left the output directory and
    # its lock file; Ctrl-C removed them. Now both: one line, 128 + N, nothing left.
    patch = ("import bert_packed.tasks.registry as task_module\nreal = task_module.get_task\n"
             "def get_task(config):\n"
             f"    os.kill(os.getpid(), {int(signum)})\n"
             "    time.sleep(5)\n"
             "    return real(config)\n"
             "task_module.get_task = get_task\nimport bert_packed.loop.train as train_module\n"
             "train_module.get_task = get_task\n")
    out = tmp_path / "run"
    code, lines = _run_with(patch, TINY + ["--steps", "4", "--output-dir", str(out)])
    assert (code, lines) == (128 + signum, ["interrupted (nothing half-written was kept)"])
    assert not out.exists()


def test_sigterm_while_torch_loads_is_the_ctrl_c_line(tmp_path):
    # Was: SIGTERM during run.py's imports (seconds) killed the process without a word.
    patch = ("import builtins\nreal = builtins.__import__\n"
             "def imp(name, *args, **kwargs):\n"
             "    if name == 'backends':\n"
             "        os.kill(os.getpid(), signal.SIGTERM)\n"
             "        time.sleep(5)\n"
             "    return real(name, *args, **kwargs)\n"
             "builtins.__import__ = imp\n")
    out = tmp_path / "run"
    code, lines = _run_with(patch, ["--config", "tiny", "--output-dir", str(out)])
    assert (code, lines) == (128 + signal.SIGTERM, ["interrupted (nothing half-written was kept)"])
    assert not out.exists()
