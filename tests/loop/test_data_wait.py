"""summary.json ``data_wait_fraction`` (issue 46): the share of the training loop's wall time spent
waiting for the next micro-batches, and one warning line when it passes 5 %."""
import time

import pytest

import bert_packed.loop.data_wait as data_wait
from backends.cpu import CPUBackend
from bert_packed.config import load_config
from bert_packed.loop.data_wait import DataWait
from bert_packed.loop.train import train


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_share_is_the_waited_part_of_the_loops_wall_time():
    clock = _Clock()
    wait = DataWait(clock)
    assert wait.fraction() is None and wait.warning() is None  # before the loop
    wait.start()
    clock.now += 40.0
    wait.add(1.0)
    wait.add(1.0)
    assert wait.fraction() == pytest.approx(2.0 / 40.0) and wait.warning() is None  # exactly 5 %: no warning
    clock.now += 10.0
    wait.stop()
    clock.now += 1000.0  # after the loop (final evaluation, export): not the loop's time
    assert wait.wall_seconds() == pytest.approx(50.0) and wait.fraction() == pytest.approx(0.04)
    wait.start()  # a second loop (another invocation) counts on its own
    clock.now += 40.0
    wait.add(12.0)
    assert wait.fraction() == pytest.approx(0.3)
    assert wait.warning().startswith("the training loop waited for data 30.0 % of its time (12.0 s of 40.0 s; "
                                     "summary.json data_wait_fraction)")
    wait.start()
    clock.now += 20.0
    wait.add(10.0)
    assert wait.fraction() == pytest.approx(0.5) and wait.warning() is None  # a 20 s loop is a smoke test


class _SlowData(CPUBackend):
    """Each micro-batch takes 50 ms to arrive."""

    def stage_batch(self, batch):
        time.sleep(0.05)
        return super().stage_batch(batch)


class _SlowStep(CPUBackend):
    """Each step takes 200 ms more than its compute; the data keeps ahead."""

    def train_step(self, micro_batches):
        time.sleep(0.2)
        return super().train_step(micro_batches)


@pytest.fixture
def short_loops_warn(monkeypatch):
    monkeypatch.setattr(data_wait, "MIN_LOOP_SECONDS", 0.0)


def _warnings(err):
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_a_slow_input_pipeline_is_measured_and_warned_about(tmp_path, capsys, short_loops_warn):
    # No prefetch: the loop waits for every micro-batch (100 ms of data per step, a step of a few ms).
    config = load_config("tiny", ["train.steps=8", "train.gradient_accumulation=2", "train.prefetch_micro_batches=0"])
    summary = train(config, _SlowData(), output_dir=str(tmp_path), show_progress=False)
    share = summary["data_wait_fraction"]
    assert 0.05 < share <= 1.0
    # The loop's wall time holds at least its steps and its waits.
    assert share <= summary["data_seconds"] / (summary["data_seconds"] + summary["train_seconds"]) + 1e-9
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"warning: the training loop waited for data {100 * share:.1f} % ")
    with open(tmp_path / "summary.json") as handle:
        import json

        assert json.load(handle)["data_wait_fraction"] == share


def test_data_that_keeps_ahead_is_a_small_share_and_no_warning(tmp_path, capsys, short_loops_warn):
    # 20 steps of 200 ms: only the first micro-batch is waited for (tens of ms on a loaded host).
    config = load_config("tiny", ["train.steps=20", "train.gradient_accumulation=2"])
    summary = train(config, _SlowStep(), output_dir=str(tmp_path), show_progress=False)
    assert 0.0 <= summary["data_wait_fraction"] < 0.05
    assert _warnings(capsys.readouterr().err) == []
