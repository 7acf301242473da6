"""``cpu.precision=bf16``: the cpu backend's forward under bf16 autocast with fp32 master weights
(issue 35), on CPUs with native bf16 instructions; refused in one line on a CPU without them."""
import os
import subprocess
import sys

import pytest
import torch

import backends.cpu as cpu_module
from backends import get_backend
from backends.cpu import CPUBackend, native_bf16
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.config import ConfigError, load_config
from bert_packed.tasks.pretraining.data import build_data_source
from bert_packed.loop.plan import make_plan
from bert_packed.loop.train import Interrupted, train
from helpers import assert_one_line_error, stop_after

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BATCHES = {}


def _batches(config, count=4):
    if "tiny" not in _BATCHES:
        iterator = iter(build_data_source(config, micro_batch_size=config.train.micro_batch_size))
        _BATCHES["tiny"] = [next(iterator) for _ in range(count)]
    return _BATCHES["tiny"]


def _steps(overrides, num_steps=3):
    """Losses of ``num_steps`` steps of the tiny config on the cpu backend (seed 0), and the model."""
    config = load_config("tiny", list(overrides))
    torch.manual_seed(0)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (config.optimizer.beta1, config.optimizer.beta2))
    backend = CPUBackend()
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    losses, norms = [], []
    for batch in _batches(config)[:num_steps]:
        metrics = backend.train_step([batch])
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms, model, backend


def test_the_default_is_fp32_and_bf16_is_a_choice():
    assert load_config("tiny").sections["cpu"].precision == "fp32"
    assert load_config("tiny", ["cpu.precision=bf16"]).sections["cpu"].precision == "bf16"
    assert load_config("tiny").sections["cuda"].precision == "bf16"  # the cuda section keeps its own


@pytest.mark.parametrize("value, message", [
    ("fp16", "cpu.precision must be one of fp32, bf16, got 'fp16'"),  # no loss scaling on the cpu backend
    ("BF16", "cpu.precision must be one of fp32, bf16, got 'BF16'"),
    ("", "cpu.precision is empty; give a value"),
    ("1", "cpu.precision"),
])
def test_a_bad_precision_is_one_line(value, message, tmp_path):
    result = subprocess.run([sys.executable, "run.py", "--config", "tiny", "--steps", "1", "--output-dir",
                             str(tmp_path / "out"), "--no-progress", "--set", f"cpu.precision={value}"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert_one_line_error(result, message)


def test_bf16_runs_the_matrix_products_in_bf16_and_keeps_fp32_weights():
    _, _, model, backend = _steps(["cpu.precision=bf16"], num_steps=1)
    seen = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    handle = linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    try:
        backend.train_step([_batches(load_config("tiny"))[1]])
    finally:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master weights
    assert all(p.grad is None for p in model.parameters())  # cleared after the update
    _, _, fp32_model, fp32_backend = _steps([], num_steps=1)
    seen.clear()
    linear = next(m for m in fp32_model.modules() if isinstance(m, torch.nn.Linear))
    handle = linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    try:
        fp32_backend.train_step([_batches(load_config("tiny"))[1]])
    finally:
        handle.remove()
    assert set(seen) == {torch.float32}


@pytest.mark.skipif(native_bf16() is False, reason="this CPU has no native bf16 instructions")
def test_bf16_loss_follows_fp32_within_a_tenth_of_a_percent_with_finite_gradients():
    fp32, fp32_norms, _, _ = _steps([])
    bf16, bf16_norms, _, _ = _steps(["cpu.precision=bf16"])
    assert bf16 != fp32  # autocast took effect
    # bf16 keeps 8 mantissa bits; the tiny config's products are short, so over three steps the
    # loss agrees within 0.1 % (measured: at most 1.4e-5 relative) and the gradient norm within 1 %
    # (measured: 1e-3).
    assert bf16 == pytest.approx(fp32, rel=1e-3)
    assert all(torch.isfinite(torch.tensor(bf16_norms)))
    assert bf16_norms == pytest.approx(fp32_norms, rel=1e-2)


def test_bf16_gradients_are_fp32_and_finite():
    config = load_config("tiny", ["cpu.precision=bf16"])
    torch.manual_seed(0)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (config.optimizer.beta1, config.optimizer.beta2))
    backend = CPUBackend()
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    batch = backend.to_device(_batches(config)[0])
    with backend.autocast():
        loss = model(**batch)["loss"]
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and {g.dtype for g in grads} == {torch.float32}
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def _rows(path):
    import json

    with open(path / "metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "loss" in row and "step" in row and not row.get("eval")]


@pytest.mark.skipif(native_bf16() is False, reason="this CPU has no native bf16 instructions")
def test_bf16_checkpoints_stay_fp32_and_a_resume_reproduces_the_run(tmp_path):
    """With dropout (sdpa) and a warm-up: a run stopped at step 3 and resumed logs steps 4-6 as the
    uninterrupted run does and ends with bit-identical fp32 weights."""
    overrides = ["cpu.precision=bf16", "model.hidden_dropout_prob=0.1", "model.attention_probs_dropout_prob=0.1",
                 "model.attention_implementation=sdpa", "train.steps=6", "train.checkpoint_every=3"]
    config = load_config("tiny", overrides)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    train(config, get_backend("cpu"), output_dir=str(full), show_progress=False)
    with pytest.raises(Interrupted):
        train(config, stop_after(get_backend("cpu"), 3), output_dir=str(stopped), show_progress=False)
    saved = load_checkpoint(str(stopped / CHECKPOINT_NAME))
    assert saved["step"] == 3
    floats = [t for t in saved["model"].values() if t.is_floating_point()]
    assert floats and {t.dtype for t in floats} == {torch.float32}
    train(config, get_backend("cpu"), output_dir=str(stopped), resume=True, show_progress=False)
    expected, got = _rows(full), _rows(stopped)
    assert [r["step"] for r in got] == list(range(1, 7))
    keys = ["loss", "mlm_loss", "nsp_loss", "grad_norm", "learning_rate"]
    for a, b in zip(expected[3:], got[3:]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    weights_a = load_checkpoint(str(full / CHECKPOINT_NAME))["model"]
    weights_b = load_checkpoint(str(stopped / CHECKPOINT_NAME))["model"]
    for name, tensor in weights_a.items():
        assert tensor.dtype == weights_b[name].dtype
        assert torch.equal(tensor, weights_b[name]), name


def test_bf16_is_refused_in_one_line_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu_module, "native_bf16", lambda: False)
    config = load_config("tiny", ["cpu.precision=bf16"])
    with pytest.raises(ConfigError, match=r"cpu.precision=bf16 needs a CPU with native bf16 instructions .*"
                                          r"use cpu.precision=fp32"):
        CPUBackend.validate_config(config, world_size=1)
    assert CPUBackend.validate_config(load_config("tiny"), world_size=1) == []  # fp32 is never refused


def test_run_py_refuses_bf16_without_native_support_with_exit_2(tmp_path):
    """The whole command line, with torch's query and the kernel's flags both saying 'no bf16'."""
    script = ("import sys, runpy, backends.cpu as c; c.native_bf16 = lambda: False; "
              "sys.argv = ['run.py'] + sys.argv[1:]; runpy.run_path('run.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script, "--config", "tiny", "--steps", "1", "--output-dir",
                             str(tmp_path / "out"), "--no-progress", "--set", "cpu.precision=bf16"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert_one_line_error(result, "cpu.precision=bf16", "native bf16")


@pytest.mark.parametrize("flags, expected", [("avx512f avx512_bf16 amx_tile", True), ("avx2 avx512f", False),
                                             ("fp asimd bf16 i8mm", True), ("", None)])
def test_native_bf16_reads_the_kernels_flags_where_torch_has_no_query(monkeypatch, tmp_path, flags, expected):
    """torch 2.0 has no bf16 query: the CPU flags of /proc/cpuinfo decide (x86 ``flags``, Arm ``Features``)."""
    import builtins

    monkeypatch.setattr(torch, "cpu", type("NoQueries", (), {})())
    key = "Features" if "asimd" in flags else "flags"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\n{key}\t\t: {flags}\n" if flags else "processor\t: 0\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                         *a, **k))
    assert native_bf16() is expected


def test_native_bf16_follows_torchs_query_on_x86(monkeypatch):
    monkeypatch.setattr(cpu_module.platform, "machine", lambda: "x86_64")
    queries = type("Queries", (), {"_is_avx512_bf16_supported": staticmethod(lambda: False),
                                   "_is_amx_tile_supported": staticmethod(lambda: False)})()
    monkeypatch.setattr(torch, "cpu", queries)
    assert native_bf16() is False
    queries = type("Queries", (), {"_is_avx512_bf16_supported": staticmethod(lambda: False),
                                   "_is_amx_tile_supported": staticmethod(lambda: True)})()
    monkeypatch.setattr(torch, "cpu", queries)
    assert native_bf16() is True
