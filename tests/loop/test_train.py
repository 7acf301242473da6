"""The training loop end to end on the cpu backend: loss falls, metrics/summary files,
exact resume after a real kill, and torchrun data parallel == one process."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from backends.cpu import CPUBackend
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.config import load_config
from bert_packed.loop.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One thread per process: the machine running tests is shared, and spinning OpenMP
# threads make step times erratic; results do not depend on it.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
METRIC_FIELDS = {"step", "loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "sequences", "packs",
                 "tokens", "seconds", "sequences_per_second", "tokens_per_second"}


def _lines(directory):
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_tiny_run_learns_and_writes_metrics_and_summary(tmp_path):
    # lr 0.02, not tiny's 0.05: at 0.05 the held-out loss reaches its floor (~4.5) by step 30, so
    # steps 30 and 60 compare noise (which of the two was lower changed with scipy's NNLS packing);
    # at 0.02 it is still falling at step 60, by ~0.2.
    config = load_config("tiny", ["train.eval_every=30", "train.eval_batches=2", "optimizer.learning_rate=0.02"])
    summary = train(config, CPUBackend(), output_dir=str(tmp_path), show_progress=False)
    lines = _lines(tmp_path)
    assert [line["step"] for line in lines] == list(range(1, 61))
    assert all(METRIC_FIELDS <= set(line) for line in lines)
    first = sum(line["mlm_loss"] for line in lines[:3]) / 3
    last = sum(line["mlm_loss"] for line in lines[-10:]) / 10
    assert last < first - 0.3, (first, last)  # log(256) = 5.55 at the start; the tokens are learnable
    assert lines[29]["eval_mlm_loss"] > lines[59]["eval_mlm_loss"]  # same held-out batches both times
    # Throughput counts real sequences: more sequences than packs (about 2 per pack at depth 3).
    assert all(line["packs"] == 8 and line["sequences"] > line["packs"] for line in lines)
    assert all(line["sequences_per_second"] == pytest.approx(line["sequences"] / line["seconds"]) for line in lines)
    with open(tmp_path / "summary.json") as f:
        on_disk = json.load(f)
    assert on_disk["last"] == lines[-1] and on_disk["total_sequences"] == sum(l["sequences"] for l in lines)
    assert on_disk["packing_factor"] == pytest.approx(summary["packing_factor"]) and on_disk["packing_factor"] > 1.5


def test_an_evaluated_step_is_logged_even_between_log_steps(tmp_path):
    # eval_every=3 with log_every=2: steps 3 and 9 are off the logging grid, yet their eval_* fields
    # exist only in that step's line, so the line must be written.
    config = load_config("tiny", ["train.steps=10", "train.log_every=2", "train.eval_every=3",
                                  "train.eval_batches=1", "train.checkpoint_every=0"])
    train(config, CPUBackend(), output_dir=str(tmp_path), show_progress=False)
    lines = _lines(tmp_path)
    assert [line["step"] for line in lines] == [2, 3, 4, 6, 8, 9, 10]
    assert [line["step"] for line in lines if "eval_loss" in line] == [3, 6, 9, 10]


def test_packing_adjustment_divides_gradient_accumulation(tmp_path):
    config = load_config("tiny", ["train.steps=1", "train.gradient_accumulation=8",
                                  "train.packing_adjustment=gradient_accumulation"])
    summary = train(config, CPUBackend(), output_dir=str(tmp_path), show_progress=False)
    p = summary["packing_factor"]
    assert summary["gradient_accumulation"] == round(8 / p) < 8
    assert summary["packs_per_step"] == round(8 / p) * 8


def test_train_leaves_the_callers_config_as_given(tmp_path):
    # The packing adjustment is applied to the run's copy: training twice from one config
    # object must not divide the accumulation twice.
    config = load_config("tiny", ["train.steps=1", "train.gradient_accumulation=8",
                                  "train.packing_adjustment=gradient_accumulation"])
    first = train(config, CPUBackend(), output_dir=str(tmp_path / "a"), show_progress=False)
    assert config.train.gradient_accumulation == 8
    second = train(config, CPUBackend(), output_dir=str(tmp_path / "b"), show_progress=False)
    assert second["gradient_accumulation"] == first["gradient_accumulation"] < 8


def _run_py(*args, output_dir, **kwargs):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--no-progress",
                             "--output-dir", str(output_dir), *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.slow
def test_resume_after_kill_continues_exactly(tmp_path):
    # Bigger micro-batches make each step take long enough to kill mid-run reliably.
    args = ["--config", "tiny", "--set", "train.steps=40", "--set", "train.micro_batch_size=32",
            "--set", "train.checkpoint_every=4", "--set", "model.hidden_dropout_prob=0.1"]  # dropout: RNG matters
    full = _run_py(*args, output_dir=tmp_path / "full")
    killed = _run_py(*args, output_dir=tmp_path / "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and killed.poll() is None:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= 10:
            break
        time.sleep(0.01)
    assert killed.poll() is None, "the run ended before it could be killed; make its steps longer"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / "summary.json").exists()
    checkpoint_step = load_checkpoint(str(tmp_path / "killed" / CHECKPOINT_NAME))["step"]
    assert 8 <= checkpoint_step < 40

    resumed = _run_py(*args, "--resume", output_dir=tmp_path / "killed")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert full.wait(timeout=300) == 0, full.stderr.read()
    expected, got = _lines(tmp_path / "full"), _lines(tmp_path / "killed")
    assert [line["step"] for line in got] == list(range(1, 41))
    keys = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "sequences", "tokens", "learning_rate")
    for a, b in zip(expected[checkpoint_step:], got[checkpoint_step:]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]  # bitwise: same data, same RNG
    final_a = load_checkpoint(str(tmp_path / "full" / CHECKPOINT_NAME))
    final_b = load_checkpoint(str(tmp_path / "killed" / CHECKPOINT_NAME))
    assert final_a["step"] == final_b["step"] == 40
    for name, tensor in final_a["model"].items():
        assert torch.equal(tensor, final_b["model"][name]), name


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path):
    args = ["--config", "tiny", "--set", "train.steps=4", "--set", "train.global_batch_size=16",
            "--set", "train.micro_batch_size=4", "--set", "train.checkpoint_every=4"]
    one = _run_py(*args, output_dir=tmp_path / "one")
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--standalone", os.path.join(ROOT, "run.py"), "--no-progress",
                            "--backend", "cpu", "--output-dir", str(tmp_path / "two"), *args],
                           cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert one.wait(timeout=300) == 0, one.stderr.read()
    assert two.wait(timeout=300) == 0, two.stderr.read()
    a, b = _lines(tmp_path / "one"), _lines(tmp_path / "two")
    with open(tmp_path / "two" / "summary.json") as f:
        summary = json.load(f)
    assert summary["world_size"] == 2 and summary["gradient_accumulation"] == 2 and summary["packs_per_step"] == 16
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert (x["sequences"], x["tokens"]) == (y["sequences"], y["tokens"])  # the same global batch
        for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
            assert abs(x[key] - y[key]) <= 1e-5, (x["step"], key, x[key], y[key])
    weights_a = load_checkpoint(str(tmp_path / "one" / CHECKPOINT_NAME))["model"]
    weights_b = load_checkpoint(str(tmp_path / "two" / CHECKPOINT_NAME))["model"]
    for name, tensor in weights_a.items():
        assert (tensor - weights_b[name]).abs().max().item() <= 1e-5, name
