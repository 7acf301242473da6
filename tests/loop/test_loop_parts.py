"""The loop's parts on their own (bert_packed/loop): the prefetcher, and numbers read only where
the loop must look at them, with every step still checked for divergence."""
import json
import threading

import pytest
import torch

from backends.cpu import CPUBackend
from bert_packed.loop import train as train_module
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.config import load_config
from bert_packed.tasks.pretraining.data import build_data_source
from bert_packed.loop.logger import to_host
from bert_packed.loop.prefetch import Prefetcher
from bert_packed.loop.train import DivergenceError, train

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
TINY = ["data.num_sequences=300", "data.packing_algorithm=lpfhp", "train.micro_batch_size=4"]


def _source():
    return build_data_source(load_config("tiny", TINY), micro_batch_size=4)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_the_prefetcher_serves_the_sources_stream_and_its_consumed_position(depth):
    plain = iter(_source())
    expected = [next(plain) for _ in range(6)]
    source = _source()
    feed = Prefetcher(source, depth)
    try:
        got = [next(feed) for _ in range(4)]
        # The worker is ahead; the position is the one after the 4th micro-batch handed out.
        resumed = _source()
        resumed.load_state_dict(feed.state_dict())
        continuation = iter(resumed)
        got += [next(continuation) for _ in range(2)]
    finally:
        feed.close()
    for a, b in zip(expected, got):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert not any(t.name == "packed-bert-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("depth", [0, 2])
def test_the_prefetcher_applies_the_transform_in_its_worker(depth):
    """The backend's ``stage_batch`` hook: applied to every micro-batch handed out, in the worker
    thread when there is one; the position is still the source's."""
    threads = []

    def stage(batch):
        threads.append(threading.current_thread().name)
        return {**batch, "staged": True}

    plain = iter(_source())
    expected = [next(plain) for _ in range(3)]
    feed = Prefetcher(_source(), depth, transform=stage)
    try:
        got = [next(feed) for _ in range(3)]
        position = feed.state_dict()
    finally:
        feed.close()
    assert all(b["staged"] and all((b[k] == e[k]).all() for k in e) for b, e in zip(got, expected))
    resumed = _source()
    resumed.load_state_dict(position)
    assert all((next(iter(resumed))[k] == next(plain)[k]).all() for k in expected[0])
    assert set(threads) == {"packed-bert-prefetch" if depth else threading.current_thread().name}


def test_to_host_works_out_deferred_numbers_once():
    from bert_packed.backend import Deferred, StepMetrics

    calls = []
    seconds = Deferred(lambda: calls.append(1) or 2.5)
    read = to_host([StepMetrics({"loss": torch.tensor(1.5), "device_seconds": seconds}), {"lr": 0.1}])
    assert read == [{"loss": 1.5, "device_seconds": 2.5}, {"lr": 0.1}]
    assert float(seconds) == 2.5 and StepMetrics({"x": seconds})["x"] == 2.5 and calls == [1]


def test_a_data_error_in_the_worker_reaches_the_loop():
    class Broken:
        packing_factor = 1.0

        def __iter__(self):
            yield {"x": 1}
            raise ValueError("bad row 7")

        def state_dict(self):
            return {}

    feed = Prefetcher(Broken(), 2)
    assert next(feed) == {"x": 1}
    with pytest.raises(ValueError, match="bad row 7"):
        next(feed)
    feed.close()


def test_to_host_reads_every_tensor_in_one_go():
    steps = [{"loss": torch.tensor(1.5), "lr": 0.1}, {"loss": torch.tensor(float("nan")), "n": torch.tensor(3.0)}]
    read = to_host(steps)
    assert read[0] == {"loss": 1.5, "lr": 0.1} and read[1]["n"] == 3.0 and read[1]["loss"] != read[1]["loss"]
    assert all(not isinstance(v, torch.Tensor) for step in read for v in step.values())


class DeviceNumbers(CPUBackend):
    """The cpu backend returning its numbers as tensors (as a device backend does), with a NaN
    loss reported at ``bad_step`` (the weights stay finite: only the guard is under test)."""

    bad_step = None

    def train_step(self, micro_batches):
        metrics = super().train_step(micro_batches)
        self.calls = getattr(self, "calls", 0) + 1
        out = {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}
        if self.calls == self.bad_step:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_numbers_are_read_only_at_log_evaluation_and_checkpoint_steps(tmp_path, monkeypatch):
    reads = []
    monkeypatch.setattr(train_module, "to_host", lambda steps: reads.append(len(steps)) or to_host(steps))
    config = load_config("tiny", TINY + ["train.steps=10", "train.log_every=5", "train.checkpoint_every=0"])
    train(config, DeviceNumbers(), output_dir=str(tmp_path), show_progress=False)
    assert reads == [5, 5]  # two reads of five steps each, not ten
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [5, 10]


def test_divergence_between_reads_stops_at_the_step_where_it_happened(tmp_path):
    backend = DeviceNumbers()
    backend.bad_step = 5
    config = load_config("tiny", TINY + ["train.steps=12", "train.log_every=10", "train.checkpoint_every=2"])
    with pytest.raises(DivergenceError) as error:
        train(config, backend, output_dir=str(tmp_path), show_progress=False)
    assert str(error.value) == (f"step 5: non-finite loss nan: training diverged and was stopped; last good "
                                f"checkpoint {tmp_path / CHECKPOINT_NAME} (step 4)")
    assert load_checkpoint(str(tmp_path / CHECKPOINT_NAME))["step"] == 4
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert (summary["status"], summary["last_step"], summary["checkpoint_step"]) == ("diverged", 4, 4)


@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_the_cpu_step_never_reads_a_number_on_the_host(optimizer, monkeypatch):
    """No host synchronisation inside a step: nothing in train_step turns a tensor into a python
    number (item, float, bool, tolist); the loss and gradient norm come back as device tensors."""
    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.loop.plan import make_plan

    config = load_config("tiny", TINY + [f"optimizer.name={optimizer}", "optimizer.max_grad_norm=1.0"])
    torch.manual_seed(0)
    model = build_model(config)
    opt, schedule = build_optimizer(config, model)
    if optimizer == "adamw" and not opt.defaults.get("fused"):  # torch 2.0.1: no fused AdamW on the CPU
        pytest.skip("foreach AdamW reads its skip flag on the host (optim.step_unless_non_finite)")
    backend = CPUBackend()
    backend.prepare(model, opt, make_plan(config, backend), scheduler=schedule)
    batches = iter(_source())

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host inside train_step")

    results = []
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, refuse)
        for _ in range(3):
            results.append(backend.train_step([next(batches)]))
    assert all(isinstance(m.raw["loss"], torch.Tensor) and isinstance(m.raw["grad_norm"], torch.Tensor)
               for m in results)
    read = to_host(results)
    assert all(value == value for step in read for value in step.values())  # finite numbers, read once


def test_real_divergence_between_reads_is_stopped_where_one_read_per_step_stops_it(tmp_path):
    """lr 1000 on the cpu backend: the same step is named whether numbers are read every step or
    every 7th, and the checkpoint kept is the last one before it, with finite weights."""
    base = TINY + ["train.steps=30", "optimizer.learning_rate=1000", "optimizer.warmup_fraction=0"]
    stops = {}
    for log_every in (1, 7):
        out = tmp_path / f"every{log_every}"
        config = load_config("tiny", base + [f"train.log_every={log_every}", "train.checkpoint_every=3"])
        with pytest.raises(DivergenceError) as error:
            train(config, CPUBackend(), output_dir=str(out), show_progress=False)
        stops[log_every] = int(str(error.value).split(":")[0].split()[1])
        saved = load_checkpoint(str(out / CHECKPOINT_NAME))
        assert saved["step"] == (stops[log_every] - 1) // 3 * 3
        assert all(torch.isfinite(t).all() for t in saved["model"].values() if t.is_floating_point())
    assert stops[1] == stops[7] and stops[1] > 1


def test_a_run_refused_before_its_first_step_leaves_no_trace(tmp_path, capsys):
    """A data mistake found while the task reads its files (after the output directory was made
    and locked) leaves neither the directory nor its lock file behind; an existing directory
    keeps exactly what it held."""
    import run

    bad = tmp_path / "train.csv"
    bad.write_text("text,label\nfine,1\n")  # no tokenizer: refused in the task's setup
    args = ["--config", "finetune_classification", "--no-progress", "--set", f"finetune.train_file={bad}"]
    assert run.main(args + ["--output-dir", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert run.main(args + ["--output-dir", str(existing)]) == 2
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
    assert "needs a tokenizer" in capsys.readouterr().err
