"""The cuda backend: its CPU-testable parts here, its GPU parts marked ``cuda``.

``CUDABackend(device="cpu")`` runs the backend's own code (autocast, GradScaler, compile
and recompile counting, config checks) on the CPU, compared against the cpu backend, the
fp32 reference. What needs the GPU itself (kernels, NCCL, CUDA events, FlexAttention
backward) is in the ``cuda``-marked tests at the bottom.
"""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from backends import get_backend_class
from backends.cpu import CPUBackend
from backends.cuda import CUDABackend, RecompileError, num_compiled_graphs
from bert_packed.config import ConfigError, load_config
from bert_packed.data import build_data_source
from bert_packed.build import build_model, build_optimizer
from bert_packed.loop.plan import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_BATCHES = {}


def setup(backend, overrides=(), seed=0):
    """tiny config + its first micro-batches + model/optimizer prepared on ``backend``.

    Returns (config, batches, model); generated data is built once per data setting
    (packing it is the slow part) and every test reads the same first micro-batches.
    """
    config = load_config("tiny", list(overrides))
    key = tuple(sorted(o for o in overrides if o.startswith("data.")))
    if key not in _BATCHES:
        source = build_data_source(config, split="train", micro_batch_size=config.train.micro_batch_size)
        _BATCHES[key] = list(itertools.islice(iter(source), 8))
    torch.manual_seed(seed)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (config.optimizer.beta1, config.optimizer.beta2))
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    return config, _BATCHES[key], model


def micro_batches(batches, num_steps, per_step=1):
    """``num_steps`` steps of ``per_step`` micro-batches each, in order."""
    it = iter(batches)
    return [[next(it) for _ in range(per_step)] for _ in range(num_steps)]


def flat_params(model):
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


# ----------------------------------------------------------------------------- availability


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_run_py_backend_cuda_fails_with_one_clear_line():
    proc = subprocess.run([sys.executable, "run.py", "--backend", "cuda", "--config", "tiny", "--steps", "1",
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: backend 'cuda' is not available") and "--backend cpu" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU reason")
def test_unavailable_reason_names_the_cause():
    reason = CUDABackend.unavailable_reason()
    assert not CUDABackend.is_available()
    assert reason and "\n" not in reason and "--backend cpu" in reason
    if torch.version.cuda is None:
        assert "CPU-only build" in reason


# ----------------------------------------------------------------------------- precision (on CPU)


def run_steps(backend, overrides, num_steps=2):
    config, batches, model = setup(backend, overrides)
    batches = micro_batches(batches, num_steps)
    before = flat_params(model)
    metrics = [backend.train_step(b) for b in batches]
    return metrics, before, flat_params(model)


def test_fp32_step_is_the_cpu_backend_step():
    # Same step code, no autocast, no compile: bit-identical to the reference.
    ref_metrics, ref_before, ref_after = run_steps(CPUBackend(), ["cuda.precision=fp32"])
    metrics, before, after = run_steps(CUDABackend(device="cpu"), ["cuda.precision=fp32"])
    assert torch.equal(before, ref_before)
    assert torch.equal(after, ref_after)
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    assert metrics[-1]["recompiles_after_warmup"] == 0.0


def _cosine(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_step_close_to_fp32(precision):
    ref_metrics, ref_before, ref_after = run_steps(CPUBackend(), [], num_steps=1)
    metrics, before, after = run_steps(CUDABackend(device="cpu"), [f"cuda.precision={precision}"], num_steps=1)
    assert torch.equal(before, ref_before)
    # bf16 keeps 8 mantissa bits, fp16 11: the loss agrees to well under 2 %.
    assert metrics[0]["loss"] == pytest.approx(ref_metrics[0]["loss"], rel=2e-2)
    # The update goes the same way (LAMB normalises, so compare directions).
    assert _cosine(after - before, ref_after - ref_before) > 0.95
    if precision == "fp16":
        assert metrics[0]["loss_scale"] == 65536.0  # no overflow: the scale is kept
    else:
        assert "loss_scale" not in metrics[0]


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    # A loss scale beyond fp32's range makes every scaled gradient inf: GradScaler must
    # skip the update (parameters unchanged) and halve the scale.
    backend = CUDABackend(device="cpu")
    config, batches, model = setup(backend, ["cuda.precision=fp16", "cuda.loss_scale_init=1.0e+38"])
    before = flat_params(model)
    metrics = backend.train_step(micro_batches(batches, 1)[0])
    assert torch.equal(flat_params(model), before)
    assert metrics["loss_scale"] == pytest.approx(0.5e38)
    assert all(p.grad is None for p in model.parameters()), "gradients cleared after a skipped step"


# ----------------------------------------------------------------------------- compile and recompiles


class EagerCompileBackend(CUDABackend):
    """Counts dynamo graphs exactly as with inductor, without inductor's CPU compile time."""

    def wrap_model(self, model):
        if not self.plan.settings.compile:
            return model
        return torch.compile(model, backend="eager", dynamic=False)


def test_compiled_training_has_no_recompiles_after_warmup():
    torch._dynamo.reset()
    backend = EagerCompileBackend(device="cpu")
    config, batches, model = setup(backend, ["cuda.compile=true", "cuda.precision=fp32"])
    graphs_start = num_compiled_graphs()
    metrics = [backend.train_step(b) for b in micro_batches(batches, 4)]
    assert num_compiled_graphs() > graphs_start, "the model was compiled"
    assert [m["recompiles_after_warmup"] for m in metrics] == [0.0] * 4
    # An eval in between compiles its own (eval-mode) graph; training must not recompile after it.
    backend.eval_step(batches[4])
    assert backend.train_step([batches[5]])["recompiles_after_warmup"] == 0.0


def test_a_shape_change_after_warmup_is_a_recompile_error():
    torch._dynamo.reset()
    backend = EagerCompileBackend(device="cpu")
    config, batches, model = setup(backend, ["cuda.compile=true", "cuda.precision=fp32", "cuda.num_warmup_steps=1"])
    batches = micro_batches(batches, 2)
    backend.train_step(batches[0])
    smaller = [{k: v[:-1] for k, v in batches[1][0].items()}]  # B - 1 packs: a new shape
    with pytest.raises(RecompileError) as info:
        backend.train_step(smaller)
    assert "\n" not in str(info.value) and "cuda.max_recompiles_after_warmup" in str(info.value)


def test_recompile_budget_is_configurable():
    torch._dynamo.reset()
    backend = EagerCompileBackend(device="cpu")
    config, batches, model = setup(backend, ["cuda.compile=true", "cuda.precision=fp32", "cuda.num_warmup_steps=1",
                                            "cuda.max_recompiles_after_warmup=5"])
    batches = micro_batches(batches, 2)
    backend.train_step(batches[0])
    metrics = backend.train_step([{k: v[:-1] for k, v in batches[1][0].items()}])
    assert metrics["recompiles_after_warmup"] >= 1.0


class CPUDeviceCUDABackend(CUDABackend):
    """The cuda backend on the CPU, for running the real training loop through it."""

    @staticmethod
    def is_available():
        return True

    def __init__(self):
        super().__init__(device="cpu")


def test_training_loop_runs_through_the_backend_and_logs_its_metrics(tmp_path):
    from bert_packed.train import train

    out = str(tmp_path / "run")
    config = load_config("tiny", ["train.steps=6", "cuda.precision=fp16", "train.gradient_accumulation=2"])
    train(config, CPUDeviceCUDABackend(), output_dir=out, show_progress=False)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["recompiles_after_warmup"] == 0 and r["loss_scale"] > 0 for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows)


# ----------------------------------------------------------------------------- configuration errors


def test_flex_with_attention_dropout_is_refused_at_prepare():
    with pytest.raises(ConfigError) as info:
        setup(CUDABackend(device="cpu"), ["model.attention_implementation=flex",
                                          "model.attention_probs_dropout_prob=0.1"])
    message = str(info.value)
    assert "\n" not in message and "attention_probs_dropout_prob=0.1" in message and "sdpa" in message


@pytest.mark.parametrize("override,expected", [
    ("cuda.num_warmup_steps=-1", "must be >= 0"),
    ("cuda.loss_scale_init=0", "loss_scale_init"),
])
def test_bad_cuda_settings_are_refused(override, expected):
    with pytest.raises(ConfigError, match=expected):
        setup(CUDABackend(device="cpu"), [override])


def test_bad_compile_mode_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="compile_mode must be one of"):
        load_config("tiny", ["cuda.compile_mode=fast"])


def test_profile_off_gpu_reports_ms():
    backend = CUDABackend(device="cpu")
    config, batches, model = setup(backend, [])
    result = backend.profile(model, batches[0], num_repeats=2)
    assert result["unit"] == "ms" and result["cost"] > 0


# ----------------------------------------------------------------------------- GPU


# S = 128 = one FlexAttention tile (the tiny config's S = 64 is shorter than a tile).
S128 = ["data.max_sequence_length=128", "model.max_position_embeddings=128"]


def _run_py(args, env=None, timeout=900):
    proc = subprocess.run([sys.executable, "run.py", *args, "--no-progress"], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.cuda
@pytest.mark.parametrize("attention,precision,compile_", [
    ("flex", "bf16", True), ("sdpa", "bf16", True), ("dense", "fp16", False), ("flex", "fp32", False),
])
def test_short_training_run_on_gpu(tmp_path, attention, precision, compile_):
    out = str(tmp_path / "run")
    _run_py(["--backend", "cuda", "--config", "tiny", "--steps", "30", "--output-dir", out,
             "--set", f"model.attention_implementation={attention}", "--set", f"cuda.precision={precision}",
             "--set", f"cuda.compile={str(compile_).lower()}", *(a for o in S128 for a in ("--set", o))])
    rows = _metrics(out)
    assert len(rows) == 30
    losses = [r["loss"] for r in rows]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), "training reduces the loss"
    assert rows[-1]["recompiles_after_warmup"] == 0
    assert rows[-1]["device_seconds"] > 0


@pytest.mark.cuda
def test_gpu_step_matches_cpu_reference_bf16():
    ref_metrics, ref_before, ref_after = run_steps(CPUBackend(), S128, num_steps=1)
    metrics, before, after = run_steps(CUDABackend(), ["model.attention_implementation=flex", *S128], num_steps=1)
    assert torch.equal(before, ref_before)
    assert metrics[0]["loss"] == pytest.approx(ref_metrics[0]["loss"], rel=2e-2)
    assert _cosine(after - before, ref_after - ref_before) > 0.95


@pytest.mark.cuda
def test_flex_model_equals_dense_model_forward_and_gradients_bf16():
    """Whole BertForPreTraining: flex vs dense attention on the same packs, bf16 autocast."""
    losses, grads = {}, {}
    for attention in ("dense", "flex"):
        backend = CUDABackend()
        config, batches, model = setup(backend, [f"model.attention_implementation={attention}", *S128])
        batch = backend.to_device(batches[0])
        with backend.autocast():
            out = model(**batch)
        out["loss"].backward()
        losses[attention] = float(out["loss"])
        grads[attention] = torch.cat([p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None])
    assert losses["flex"] == pytest.approx(losses["dense"], rel=1e-2)
    assert _cosine(grads["flex"].double(), grads["dense"].double()) > 0.99
    # Elementwise, against the gradient's scale (bf16: 0.4 % steps; a leak would be O(100 %)).
    assert (grads["flex"] - grads["dense"]).abs().max() <= 3e-2 * grads["dense"].abs().max()


@pytest.mark.cuda
def test_profile_uses_cuda_events():
    backend = CUDABackend()
    config, batches, model = setup(backend, [])
    result = backend.profile(model, batches[0], num_repeats=3)
    assert result["unit"] == "ms" and 0 < result["cost"] < 10_000


# The 2-GPU test's settings: 2 ranks x micro-batch 8 (tiny's) = 16 sequences-rows per pass, so
# the global batch must be a multiple of 16; one process then accumulates 2 micro-batches.
TWO_GPU_OVERRIDES = ["train.global_batch_size=16", "cuda.precision=fp32", "cuda.allow_tf32=false"]


def test_two_gpu_test_config_is_valid_for_one_and_two_processes():
    """The 2-GPU test's config passes validation for 2 processes (it did not: global batch 8
    for 2 ranks x micro-batch 8) and for the 1-process reference, with the same global batch."""
    from bert_packed.config import gradient_accumulation, validate

    config = load_config("tiny", TWO_GPU_OVERRIDES)
    validate(config, get_backend_class("cuda"), world_size=2)
    validate(config, get_backend_class("cuda"), world_size=1)
    micro = config.train.micro_batch_size
    cuda = get_backend_class("cuda")
    assert gradient_accumulation(config, cuda, 2) * micro * 2 == gradient_accumulation(config, cuda, 1) * micro == 16


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="data parallel needs 2 GPUs")
def test_two_gpu_data_parallel_equals_one_process(tmp_path):
    """torchrun 2 ranks (NCCL) with the same global batch as one process: same losses."""
    common = ["--backend", "cuda", "--config", "tiny", "--steps", "3", *(a for o in TWO_GPU_OVERRIDES for a in ("--set", o))]
    single, double = str(tmp_path / "one"), str(tmp_path / "two")
    _run_py(common + ["--output-dir", single])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "run.py",
                           *common, "--output-dir", double, "--no-progress"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(_metrics(single), _metrics(double)):
        assert a["sequences"] == b["sequences"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
