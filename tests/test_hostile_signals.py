"""Hostile inputs that need a real process: Ctrl-C (SIGINT) and SIGTERM stop training at the
next step boundary with a final checkpoint and one line, and the run resumes from it."""
import json
import os
import signal
import subprocess
import sys
import time

from bert_packed.checkpoint import CHECKPOINT_NAME, load_checkpoint
from hostile import TINY, run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
