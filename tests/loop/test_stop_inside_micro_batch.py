"""Ctrl-C inside a micro-batch that runs for minutes (issue 49, item 4): the cpu backend and the
mock run the model's layers eagerly on the host and report each one (``Backend.layer_done``,
model hooks from ``loop.within_step.watch_layers``); a stop abandons the step between two
layers, keeps the last checkpoint and says where ``--resume`` continues."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import bert_packed.loop.within_step as within_step
from backends.cpu import CPUBackend
from bert_packed.backend import StepAbandoned
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.config import load_config
from bert_packed.loop.stops import Interrupted
from bert_packed.loop.within_step import StepWatch
from bert_packed.loop.train import train
from hostile import TINY, run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
LAYERS = 8
# Every encoder layer's training forward takes 0.2 s in step 1 (a first micro-batch of over a
# second: the layer reports stay, ``LAYERS_FROM_SECONDS``), 2.5 s from step 2 on: a micro-batch
# of 20 s that does not depend on how busy the machine is (a model made slow by its size would
# be 3-13x slower on a loaded 2-core host than on an idle one).
SLOW_LAYERS = f"""
import time, torch
import backends.cpu as cpu
from bert_packed.model import modeling
calls = [0]
real_step, real_forward = cpu.CPUBackend.train_step, modeling.BertLayer.forward
def train_step(self, micro_batches):
    calls[0] += 1
    return real_step(self, micro_batches)
def forward(self, *args):
    if torch.is_grad_enabled():
        time.sleep(2.5 if calls[0] >= 2 else 0.2)
    return real_forward(self, *args)
cpu.CPUBackend.train_step, modeling.BertLayer.forward = train_step, forward
"""
ARGS = TINY + ["--set", f"model.num_hidden_layers={LAYERS}", "--set", "train.checkpoint_every=1"]


def _steps(directory):
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def test_one_sigint_inside_a_slow_micro_batch_stops_in_seconds_and_keeps_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    script = (f"import runpy, sys\n{SLOW_LAYERS}\nsys.argv = ['run.py'] + {ARGS + ['--steps', '3', '--output-dir', str(out)]!r}\n"
              f"runpy.run_path('run.py', run_name='__main__')\n")
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    checkpoint = out / CHECKPOINT_NAME
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # step 1 (fast) is checkpointed: step 2's first micro-batch begins
    assert checkpoint.exists(), process.poll()
    time.sleep(0.3)
    saved = checkpoint.read_bytes()
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    code = process.wait(timeout=60)
    waited = time.monotonic() - sent
    lines = process.stderr.read().strip().splitlines()
    assert code == 130, lines
    assert waited < 10, (waited, lines)  # the micro-batch alone takes 20 s; the next layer begins within 2.5 s
    assert len(lines) == 1 and re.fullmatch(
        rf"stopped: SIGINT during step 2 of 3, in micro-batch 1 of 1 \(forward, layer [1-{LAYERS}] of {LAYERS}\): the "
        rf"unfinished step was dropped; the checkpoint {re.escape(str(checkpoint))} \(step 1\) is kept: --resume "
        rf"continues from step 2", lines[0]), lines
    assert checkpoint.read_bytes() == saved and load_checkpoint(str(checkpoint))["step"] == 1
    assert _steps(out) == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["last_step"], summary["checkpoint_step"]) == ("interrupted", 1, 1)
    assert sorted(os.listdir(out)) == [".lock", CHECKPOINT_NAME, "metrics.jsonl", "summary.json"]
    # --resume continues from step 2 (that it equals the uninterrupted run: the backward-pass test below).
    run_ok(capsys, ARGS + ["--steps", "3", "--resume", "--output-dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["resumed_from_step"], summary["checkpoint_step"]) == ("completed", 1, 3)
    assert _steps(out) == [1, 2, 3]


class FakeStop:
    signum = None


def _watch(lines, stop, now, status=None):
    return StepWatch(lines.append, stop, total_steps=100, can_abandon=True, status=status, clock=lambda: now[0])


def test_a_stop_inside_a_long_micro_batch_abandons_at_the_next_layer():
    now, lines, stop = [0.0], [], FakeStop()
    watch = _watch(lines, stop, now)
    watch.start(7, 1, 10)
    now[0] = 40.0
    watch(0, 10)
    watch(1, 10)  # two micro-batches done: 20 s each
    now[0] = 55.0
    watch.layer("forward", 3, 4)  # no stop requested: nothing happens
    stop.signum = signal.SIGINT
    now[0] = 58.0
    with pytest.raises(StepAbandoned) as abandoned:
        watch.layer("backward", 1, 4)
    assert (abandoned.value.done, abandoned.value.count) == (2, 10)
    assert abandoned.value.where == "in micro-batch 3 of 10 (backward, layer 2 of 4)"


def test_a_stop_near_the_end_of_the_step_lets_its_last_layers_run():
    now, lines, stop = [0.0], [], FakeStop()
    watch = _watch(lines, stop, now)
    watch.start(1, 1, 2)
    now[0] = 1.0
    watch(0, 2)
    stop.signum = signal.SIGTERM
    now[0] = 1.9  # the second micro-batch's backward at layer 1 of 4: ~0.2 s left
    watch.layer("backward", 0, 4)
    assert lines == []


def test_the_first_layer_of_a_call_waits_for_the_next_one_to_judge():
    now, stop = [0.0], FakeStop()
    watch = _watch([], stop, now)
    watch.start(1, 1, 4)
    stop.signum = signal.SIGINT
    now[0] = 30.0
    watch.layer("forward", 0, 4)  # nothing done yet: no estimate
    with pytest.raises(StepAbandoned) as abandoned:
        watch.layer("forward", 1, 4)
    assert abandoned.value.where == "in micro-batch 1 of 4 (forward, layer 2 of 4)"


def test_a_stop_while_thousands_of_micro_batches_are_read_drops_the_step_once_reading_is_slow():
    now, stop = [0.0], FakeStop()
    watch = _watch([], stop, now)
    watch.read(0, 4096)
    stop.signum = signal.SIGINT
    now[0] = 1.5
    watch.read(1, 4096)  # a quick read: the step runs and the stop comes at its end (with a checkpoint)
    now[0] = 2.5
    with pytest.raises(StepAbandoned) as abandoned:
        watch.read(700, 4096)
    assert (abandoned.value.done, abandoned.value.where) == (0, "while its micro-batches were read (701 of 4096)")


def test_a_stop_while_the_mock_traces_its_compile_abandons_there():
    now, stop = [0.0], FakeStop()
    watch = _watch([], stop, now)
    watch.start(1, 1, 4096)
    now[0] = 10.0
    watch.layer("trace", 0, 24)
    stop.signum = signal.SIGINT
    now[0] = 12.0
    with pytest.raises(StepAbandoned) as abandoned:
        watch.layer("trace", 5, 24)
    assert (abandoned.value.done, abandoned.value.where) == (0, "while tracing the model to compile it (layer 6 of 24)")


def test_inside_a_slow_micro_batch_a_pipe_gets_a_line_with_the_layer_and_the_memory(monkeypatch):
    monkeypatch.setattr(within_step, "memory_text", lambda: "RSS 5.2 GiB")
    now, lines = [0.0], []
    watch = _watch(lines, FakeStop(), now)
    watch.start(1, 1, 4096)
    for at, phase, layer in ((1.0, "trace", 3), (16.0, "trace", 20), (20.0, "forward", 2), (31.5, "backward", 22)):
        now[0] = at
        watch.layer(phase, layer, 24)
    assert lines == ["step 1: tracing the model to compile it: layer 21 of 24, 16 s so far, RSS 5.2 GiB",
                     "step 1: micro-batch 1 of 4096: backward, layer 23 of 24, 32 s so far, RSS 5.2 GiB"]


def test_micro_batches_shorter_than_the_interval_keep_their_own_lines(monkeypatch):
    """Layer lines are for a micro-batch still running after a progress interval; shorter ones
    keep the micro-batch lines (with the step's time left), whichever hook comes first."""
    monkeypatch.setattr(within_step, "memory_text", lambda: "RSS 1.0 GiB")
    now, lines = [0.0], []
    watch = _watch(lines, FakeStop(), now)
    watch.start(1, 1, 100)
    for index in range(60):  # 0.7 s each, 4 layers
        for layer in range(4):
            now[0] = 0.7 * index + 0.175 * layer
            watch.layer("forward", layer, 4)
        now[0] = 0.7 * (index + 1)
        watch(index, 100)
    assert lines[0].startswith("step 1: micro-batch 1 of 100 took 0.70 s: ~1 min per step")
    assert len(lines) == 3 and all(re.fullmatch(r"step 1: micro-batch \d+/100, \d+ s so far, ~.* left in this step", line)
                                   for line in lines[1:]), lines


def test_on_a_terminal_the_layer_goes_to_the_bar_status(monkeypatch):
    monkeypatch.setattr(within_step, "memory_text", lambda: "")  # a system that does not say
    now, lines, shown = [0.0], [], []
    watch = _watch(lines, FakeStop(), now, status=shown.append)
    watch.start(3, 1, 8)
    for at in (0.5, 1.2, 1.4, 2.5):
        now[0] = at
        watch.layer("forward", 4, 12)
    assert lines == [] and shown == ["step 3: micro-batch 1 of 8: forward, layer 5 of 12"] * 2


def test_memory_text_reads_this_process():
    text = within_step.memory_text()
    if not os.path.exists("/proc/self/statm"):
        assert text == ""
        return
    gib = float(re.fullmatch(r"RSS (\d+\.\d) GiB", text).group(1))
    assert 0 < gib < 1024


class SignalledInLayer(CPUBackend):
    """Sends itself ``signum`` when call ``call`` (1-based) reaches ``phase`` of layer ``index``
    in micro-batch ``micro_batch`` (0-based)."""

    def __init__(self, call, micro_batch, phase, index, signum=signal.SIGINT):
        super().__init__()
        self.at, self.signum, self.calls, self.micro_batch = (call, micro_batch, phase, index), signum, 0, 0

    def train_step(self, micro_batches):
        self.calls, self.micro_batch = self.calls + 1, 0
        return super().train_step(micro_batches)

    def micro_batch_done(self, index, count):
        self.micro_batch = index + 1
        super().micro_batch_done(index, count)

    def layer_done(self, phase, index, count):
        if (self.calls, self.micro_batch, phase, index) == self.at:
            self.at = None  # once (a layer reports once per part of it)
            os.kill(os.getpid(), self.signum)  # the handler runs before the next line
        return super().layer_done(phase, index, count)


ACCUMULATING = ["train.steps=4", "train.gradient_accumulation=3", "train.packing_adjustment=none",
                "train.micro_batch_size=4", "train.checkpoint_every=2", "data.num_sequences=300",
                "data.num_eval_sequences=60", "data.packing_algorithm=lpfhp", "model.num_hidden_layers=3"]


def test_a_stop_in_a_backward_pass_drops_the_step_and_the_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch,
                                                                                                sigint_to_the_code):
    monkeypatch.setattr(within_step, "ABANDON_FROM_SECONDS", 0.0)  # every step counts as long
    monkeypatch.setattr(within_step, "LAYERS_FROM_SECONDS", 0.0)  # and every micro-batch
    config = load_config("tiny", ACCUMULATING)
    train(config, CPUBackend(), output_dir=str(tmp_path / "full"), show_progress=False)
    cut = tmp_path / "cut"
    with pytest.raises(Interrupted) as stopped:
        train(config, SignalledInLayer(call=3, micro_batch=1, phase="backward", index=1), output_dir=str(cut),
              show_progress=False)
    assert stopped.value.exit_code == 130
    # The signal arrives as the backward reaches layer 2 (index 1): the step is abandoned there.
    assert str(stopped.value) == (f"SIGINT during step 3 of 4, in micro-batch 2 of 3 (backward, layer 2 of 3): the "
                                  f"unfinished step was dropped; the checkpoint {cut / CHECKPOINT_NAME} (step 2) is "
                                  f"kept: --resume continues from step 3")
    assert load_checkpoint(str(cut / CHECKPOINT_NAME))["step"] == 2 and _steps(cut) == [1, 2]
    train(config, CPUBackend(), output_dir=str(cut), resume=True, show_progress=False)
    assert _steps(cut) == [1, 2, 3, 4]
    a, b = (load_checkpoint(str(tmp_path / name / CHECKPOINT_NAME)) for name in ("full", "cut"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_stop_in_a_fast_step_still_finishes_it_with_a_checkpoint(tmp_path, monkeypatch, sigint_to_the_code):
    """Layers of milliseconds: the rest of the step is short, so it is finished and checkpointed
    (today's step-boundary stop), not dropped."""
    monkeypatch.setattr(within_step, "LAYERS_FROM_SECONDS", 0.0)  # the layers keep reporting
    config = load_config("tiny", ACCUMULATING)
    with pytest.raises(Interrupted) as stopped:
        train(config, SignalledInLayer(call=3, micro_batch=0, phase="forward", index=1), output_dir=str(tmp_path),
              show_progress=False)
    assert str(stopped.value).startswith("SIGINT at step 3 of 4: checkpoint")
    assert load_checkpoint(str(tmp_path / CHECKPOINT_NAME))["step"] == 3
