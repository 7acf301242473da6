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
import threading

import numpy as np
import pytest
import torch

import backends.cuda as cuda_module
from backends import get_backend, get_backend_class
from backends.cpu import CPUBackend
from backends.cuda import CUDABackend, RecompileError, num_compiled_graphs
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.config import ConfigError, load_config
from bert_packed.loop.logger import to_host
from bert_packed.loop.train import Interrupted, train
from bert_packed.tasks.pretraining.data import build_data_source
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.loop.plan import make_plan
from helpers import stop_after

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    from bert_packed.loop.train import train

    out = str(tmp_path / "run")
    config = load_config("tiny", ["train.steps=6", "cuda.precision=fp16", "train.gradient_accumulation=2"])
    train(config, CPUDeviceCUDABackend(), output_dir=out, show_progress=False)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["recompiles_after_warmup"] == 0 and r["loss_scale"] > 0 for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows)


# ----------------------------------------------------------------------------- cuda.device=cpu (CI)


CPU_FP32 = ["cuda.device=cpu", "cuda.precision=fp32"]


def test_cuda_device_cpu_builds_the_backend_without_a_gpu():
    config = load_config("tiny", ["cuda.device=cpu"])
    assert CUDABackend.is_available(config) and CUDABackend.unavailable_reason(config) is None
    backend = get_backend("cuda", config=config)
    assert type(backend) is CUDABackend
    assert backend.device == torch.device("cpu") and backend.dist_backend == "gloo"
    default = load_config("tiny")
    assert default.cuda.device == "cuda"
    if not torch.cuda.is_available():
        assert not CUDABackend.is_available(default)
        with pytest.raises(ConfigError, match="cuda.device=cpu"):
            get_backend("cuda", config=default)


def test_a_bad_cuda_device_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="device must be one of"):
        load_config("tiny", ["cuda.device=tpu"])


@pytest.mark.parametrize("attention,missing", [("flex", "FlexAttention backward"), ("varlen", "varlen_attn")])
def test_gpu_only_attention_is_refused_on_cuda_device_cpu_with_one_line(tmp_path, capsys, attention, missing):
    import run

    out = tmp_path / "run"
    code = run.main(["--backend", "cuda", "--config", "tiny", "--no-progress", "--output-dir", str(out),
                     "--set", "cuda.device=cpu", "--set", f"model.attention_implementation={attention}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: cuda.device=cpu cannot train model.attention_implementation={attention}")
    assert missing in err[0] and not out.exists()


def _rows(directory):
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_cuda_device_cpu_trains_the_tiny_config_like_the_cpu_backend(tmp_path):
    """CI's check of the cuda backend's own code: run.py --backend cuda on cuda.device=cpu (fp32,
    sdpa, gradient accumulation, evaluation through the inner model) against the cpu backend's
    dense reference: every logged number and the final weights within 1e-5."""
    import run

    common = ["--config", "tiny", "--no-progress", "--set", "train.steps=6", "--set", "train.gradient_accumulation=2",
              "--set", "train.eval_every=3", "--set", "train.eval_batches=1", "--set", "train.checkpoint_every=6"]
    reference, cuda = tmp_path / "cpu", tmp_path / "cuda"
    assert run.main(common + ["--backend", "cpu", "--output-dir", str(reference)]) == 0
    assert run.main(common + ["--backend", "cuda", "--output-dir", str(cuda), "--set", "cuda.device=cpu",
                              "--set", "cuda.precision=fp32", "--set", "model.attention_implementation=sdpa"]) == 0
    expected, got = _rows(reference), _rows(cuda)
    assert [r["step"] for r in got] == list(range(1, 7)) and "eval_loss" in got[2] and "eval_loss" in got[5]
    for a, b in zip(expected, got):
        for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm", "learning_rate", "eval_loss", "eval_mlm_accuracy"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])
    weights_a = load_checkpoint(str(reference / CHECKPOINT_NAME))["model"]
    weights_b = load_checkpoint(str(cuda / CHECKPOINT_NAME))["model"]
    assert max((t - weights_b[name]).abs().max().item() for name, t in weights_a.items()) <= 1e-5


def test_flex_evaluates_on_cuda_device_cpu_like_the_cpu_backend():
    """flex cannot train on a CPU (torch refuses its backward there); its forward can: the
    backend's eval on cuda.device=cpu with flex equals the cpu backend's dense eval within 1e-5
    on trained weights."""
    reference = CPUBackend()
    config, batches, model = setup(reference, [])
    for step in micro_batches(batches, 3):
        reference.train_step(step)
    overrides = CPU_FP32 + ["model.attention_implementation=flex"]
    backend = get_backend("cuda", config=load_config("tiny", overrides))
    _, _, flex_model = setup(backend, overrides)
    flex_model.load_state_dict(model.state_dict())
    for batch in batches[3:6]:
        expected, got = reference.eval_step(batch), backend.eval_step(batch)
        assert set(got) == set(expected)
        for key in expected:
            assert abs(got[key] - expected[key]) <= 1e-5, (key, got[key], expected[key])


# ----------------------------------------------------------------------------- no host synchronisation


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_cuda_step_never_reads_a_number_on_the_host(precision, monkeypatch):
    """Nothing in CUDABackend.train_step turns a tensor into a python number (as the cpu step's
    test): the metric sums, gradient norm, fp16 skip flag and loss scale come back as tensors.
    fp16's one host read is the previous step's skip flag from its host copy (the schedule
    hold-back), never in the first step."""
    overrides = ["cuda.device=cpu", f"cuda.precision={precision}", "optimizer.max_grad_norm=1.0",
                 "train.gradient_accumulation=2"]
    backend = get_backend("cuda", config=load_config("tiny", overrides))
    config, batches, model = setup(backend, overrides)
    steps = micro_batches(batches, 3, per_step=2)
    reads = []

    def guarded(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if backend.schedule is not None and self is backend.schedule.flag:
                reads.append(len(results))
                return original(self, *args, **kwargs)
            raise AssertionError(f"a tensor was read on the host inside train_step ({name})")

        return read

    results = []
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, guarded(name))
        for step in steps:
            results.append(backend.train_step(step))
    assert all(isinstance(m.raw[key], torch.Tensor) for m in results for key in ("loss", "grad_norm"))
    if precision == "fp16":
        assert all(isinstance(m.raw[k], torch.Tensor) for m in results for k in ("loss_scale", "skipped_step"))
        assert reads == [1, 2]  # steps 2 and 3 read steps 1 and 2's flags
    else:
        assert reads == []
    read = to_host(results)
    assert all(np.isfinite(value) for step in read for value in step.values())


def test_an_fp16_skipped_step_does_not_advance_the_schedule(monkeypatch):
    """The update after a skipped one gets the learning rate the skipped one was meant to have,
    and the schedule ends one step short: the rates the optimizer used are recorded at each
    update (without the hold-back they would be lr(0), lr(1), lr(2))."""
    overrides = ["cuda.device=cpu", "cuda.precision=fp16", "cuda.loss_scale_init=1.0e+38",
                 "optimizer.schedule=linear", "optimizer.warmup_fraction=0.5", "train.steps=6"]
    backend = get_backend("cuda", config=load_config("tiny", overrides))
    config, batches, model = setup(backend, overrides)
    used = []
    real_step = cuda_module.step_unless_non_finite

    def recording_step(optimizer, found_inf):
        used.append(optimizer.param_groups[0]["lr"])
        return real_step(optimizer, found_inf)

    monkeypatch.setattr(cuda_module, "step_unless_non_finite", recording_step)
    steps = micro_batches(batches, 3)
    first = backend.train_step(steps[0])  # every scaled gradient overflows: skipped
    backend.scaler.update(1024.0)  # a scale that does not overflow for the next two
    results = [first] + [backend.train_step(step) for step in steps[1:]]
    read = to_host(results)
    assert [r["skipped_step"] for r in read] == [1.0, 0.0, 0.0]
    schedule = backend.scheduler.lr_lambdas[0]
    base = backend.scheduler.base_lrs[0]
    assert used == [base * schedule(0), base * schedule(0), base * schedule(1)]
    assert [r["learning_rate"] for r in read] == used  # the logged rate is the one each update used
    backend.sync_to_host()
    assert backend.scheduler.last_epoch == 2


# ----------------------------------------------------------------------------- checkpoints: device state


class FakeCUDAGenerator:
    """torch.cuda's generator functions on a machine without one: a state that only
    ``set_rng_state`` changes, and a record of every call that sets it."""

    def __init__(self, state):
        self.state, self.set_calls = state.clone(), []

    def get_rng_state(self, device="cuda"):
        return self.state.clone()

    def set_rng_state(self, state, device="cuda"):
        self.set_calls.append((state.clone(), str(device)))
        self.state = state.clone()


def test_the_checkpoint_carries_the_cuda_generator_and_a_resume_restores_it(tmp_path, monkeypatch):
    fake = FakeCUDAGenerator(torch.arange(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    monkeypatch.setattr(CUDABackend, "rng_device", property(lambda self: torch.device("cuda", 0)))
    config = load_config("tiny", CPU_FP32 + ["train.steps=4", "train.checkpoint_every=2"])
    with pytest.raises(Interrupted):
        train(config, stop_after(get_backend("cuda", config=config), 2), output_dir=str(tmp_path),
              show_progress=False)
    saved = load_checkpoint(str(tmp_path / CHECKPOINT_NAME))
    assert saved["step"] == 2 and fake.set_calls == []  # a fresh run restores nothing
    assert [rank["cuda_rng"].tolist() for rank in saved["backend_state"]] == [list(range(16))]  # one per rank
    fake.state = torch.zeros(16, dtype=torch.uint8)
    train(config, get_backend("cuda", config=config), output_dir=str(tmp_path), resume=True, show_progress=False)
    assert [(state.tolist(), device) for state, device in fake.set_calls] == [(list(range(16)), "cuda:0")]


@pytest.mark.parametrize("device,precision", [
    ("cpu", "fp32"), ("cpu", "fp16"),
    pytest.param("cuda", "fp32", marks=pytest.mark.cuda), pytest.param("cuda", "bf16", marks=pytest.mark.cuda),
    pytest.param("cuda", "fp16", marks=pytest.mark.cuda),
])
def test_a_resumed_run_with_dropout_reproduces_the_uninterrupted_one(tmp_path, device, precision):
    """Hidden and attention dropout (sdpa), a warm-up + linear schedule; fp16 with a loss scale that
    overflows now and then, so the scaler's state and the schedule hold-back are in play. A run
    stopped at step 4 and resumed logs steps 5-8 and ends with weights bit-identical to the
    uninterrupted run: on cuda.device=cpu (CI) and on a GPU (fp32 without TF32, bf16, fp16), where
    the checkpoint carries the CUDA generator."""
    overrides = [f"cuda.device={device}", f"cuda.precision={precision}", "cuda.loss_scale_init=1.0e+6",
                 "cuda.allow_tf32=false",
                 "model.hidden_dropout_prob=0.1", "model.attention_probs_dropout_prob=0.1",
                 "model.attention_implementation=sdpa", "train.steps=8", "train.checkpoint_every=4"]
    config = load_config("tiny", overrides)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    train(config, get_backend("cuda", config=config), output_dir=str(full), show_progress=False)
    with pytest.raises(Interrupted):
        train(config, stop_after(get_backend("cuda", config=config), 3), output_dir=str(stopped),
              show_progress=False)
    assert load_checkpoint(str(stopped / CHECKPOINT_NAME))["step"] == 3
    train(config, get_backend("cuda", config=config), output_dir=str(stopped), resume=True, show_progress=False)
    expected, got = _rows(full), _rows(stopped)
    assert [r["step"] for r in got] == list(range(1, 9))
    keys = ["loss", "mlm_loss", "nsp_loss", "grad_norm", "learning_rate"]
    if precision == "fp16":
        keys += ["loss_scale", "skipped_step"]
        assert 0 < sum(r["skipped_step"] for r in expected) < 8
    for a, b in zip(expected[3:], got[3:]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    weights_a = load_checkpoint(str(full / CHECKPOINT_NAME))
    weights_b = load_checkpoint(str(stopped / CHECKPOINT_NAME))
    if device == "cpu":
        assert "cuda_rng" not in weights_a["backend_state"]  # on the CPU the generator is the loop's
    else:
        assert all("cuda_rng" in rank for rank in weights_a["backend_state"])
    for name, tensor in weights_a["model"].items():
        assert torch.equal(tensor, weights_b["model"][name]), name


# ----------------------------------------------------------------------------- data parallel (2 CPU processes)


DRIVER = os.path.join(ROOT, "tests", "ddp_driver.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
# 2 ranks x micro-batch 4 x 2 accumulation = the 1-process run's 4 x 4.
DDP_ARGS = ["cuda.precision=fp32", "train.global_batch_size=16", "train.micro_batch_size=4", "train.steps=6"]


def _torchrun_driver(output_dir, record, mode, stop_at, overrides):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           DRIVER, str(output_dir), str(record), mode, str(stop_at), *overrides],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = []
    for rank in range(2):
        with open(f"{record}.{rank}") as f:
            records.append(json.load(f))
    return records


@pytest.mark.slow
def test_compiled_ddp_on_two_processes_equals_one_process(tmp_path):
    """The cuda backend under torchrun (2 CPU processes, gloo) trains through a compiled
    DistributedDataParallel (dynamo splits the graph at the 1 MiB buckets of a model made big
    enough to have several): ``no_sync`` on the accumulation micro-batch (every bucket all-reduced
    once per step, by the summing hook), no recompiles, and the same steps as one eager process
    over the same global batch (within 1e-5: the micro-batches' gradients are added in another
    order). DDP's averaging would be 2x off."""
    overrides = DDP_ARGS + ["train.checkpoint_every=3", "model.hidden_size=256", "model.intermediate_size=1024",
                            "model.num_attention_heads=4", "cuda.ddp_bucket_cap_mb=1"]
    records = _torchrun_driver(tmp_path / "two", tmp_path / "record", "fresh", 0, overrides + ["cuda.compile=true"])
    config = load_config("tiny", CPU_FP32 + overrides)
    train(config, get_backend("cuda", config=config), output_dir=str(tmp_path / "one"), show_progress=False)
    for record in records:
        assert record["ddp"] and record["compiled_graphs"] >= 1 and len(record["buckets"]) == 6
        assert len(record["buckets"][0]) > 1
        assert all(sorted(step) == list(range(len(record["buckets"][0]))) for step in record["buckets"])
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(one) == len(two) == 6 and all(r["recompiles_after_warmup"] == 0 for r in two)
    for a, b in zip(one, two):
        assert (a["sequences"], a["tokens"]) == (b["sequences"], b["tokens"])
        for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])
    weights_a = load_checkpoint(str(tmp_path / "one" / CHECKPOINT_NAME))["model"]
    weights_b = load_checkpoint(str(tmp_path / "two" / CHECKPOINT_NAME))["model"]
    assert max((t - weights_b[name]).abs().max().item() for name, t in weights_a.items()) <= 1e-5


@pytest.mark.slow
def test_ddp_resume_under_torchrun_is_bit_exact_and_restores_each_ranks_generator(tmp_path):
    """2 processes with dropout: stopped at step 2 (every rank SIGTERMs itself) and resumed, the
    run logs steps 3-6 and ends with weights bit-identical to the uninterrupted one; the checkpoint
    holds each rank's (fake) CUDA generator and each rank gets its own back."""
    overrides = DDP_ARGS + ["model.hidden_dropout_prob=0.1", "train.checkpoint_every=2"]
    _torchrun_driver(tmp_path / "full", tmp_path / "full_record", "fresh", 0, overrides)
    _torchrun_driver(tmp_path / "stopped", tmp_path / "stop_record", "fresh", 2, overrides)
    saved = load_checkpoint(str(tmp_path / "stopped" / CHECKPOINT_NAME))
    assert saved["step"] == 2 and saved["world_size"] == 2
    assert [rank["cuda_rng"].tolist() for rank in saved["backend_state"]] == [[10] * 16, [11] * 16]
    records = _torchrun_driver(tmp_path / "stopped", tmp_path / "resume_record", "resume", 0, overrides)
    for rank, record in enumerate(records):
        assert record["restored"] == [[10 + rank] * 16] and record["devices"] == [f"cuda:{rank}"]
    expected, got = _rows(tmp_path / "full"), _rows(tmp_path / "stopped")
    assert [r["step"] for r in got] == list(range(1, 7))
    keys = ("loss", "mlm_loss", "nsp_loss", "grad_norm", "learning_rate", "sequences")
    for a, b in zip(expected[2:], got[2:]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    weights_a = load_checkpoint(str(tmp_path / "full" / CHECKPOINT_NAME))["model"]
    weights_b = load_checkpoint(str(tmp_path / "stopped" / CHECKPOINT_NAME))["model"]
    for name, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[name]), name


# ----------------------------------------------------------------------------- page-locked micro-batches


def test_staged_arrays_carry_their_page_locked_tensor_to_the_copy(monkeypatch):
    """The staging mechanics on a machine without page-locked memory (pin_memory faked by a copy):
    a staged array holds the same values in new memory, and the copy to the device starts from the
    page-locked tensor itself (so CUDA's host allocator keeps that block until the copy is done);
    an unstaged array is copied from its own memory."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: True)
    batch = {"input_ids": np.arange(12, dtype=np.int32).reshape(3, 4), "weights": np.ones(3, np.float32)}
    staged = {key: cuda_module._pinned(value) for key, value in batch.items()}
    for key, value in batch.items():
        assert isinstance(staged[key], np.ndarray) and np.array_equal(staged[key], value)
        assert not np.shares_memory(staged[key], value)
        source = cuda_module._host_tensor(staged[key])
        assert source is staged[key].base and source.data_ptr() == staged[key].ctypes.data
        plain = cuda_module._host_tensor(value)
        assert plain.data_ptr() == value.ctypes.data


def test_the_loop_stages_micro_batches_in_its_prefetch_thread(tmp_path):
    """``stage_batch`` runs on every training micro-batch in the prefetch worker, and
    ``train_step`` gets the staged batches."""
    class Staging(CUDABackend):
        def __init__(self):
            super().__init__(device="cpu")
            self.threads, self.staged, self.seen = set(), [], []

        def stage_batch(self, batch):  # copies, all kept (so no id is reused)
            self.threads.add(threading.current_thread().name)
            self.staged.append({key: value.copy() for key, value in batch.items()})
            return self.staged[-1]

        def train_step(self, micro_batches):
            staged = {id(b["input_ids"]) for b in self.staged}
            self.seen.extend(id(b["input_ids"]) in staged for b in micro_batches)
            return super().train_step(micro_batches)

    backend = Staging()
    config = load_config("tiny", CPU_FP32 + ["train.steps=3", "train.gradient_accumulation=2"])
    train(config, backend, output_dir=str(tmp_path), show_progress=False)
    assert backend.threads == {"packed-bert-prefetch"} and backend.seen == [True] * 6


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
    ("cuda.ddp_bucket_cap_mb=0.5", "ddp_bucket_cap_mb"),
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
def test_fp16_with_loss_scaling_is_stable_for_200_steps_on_gpu(tmp_path):
    """fp16 autocast + dynamic loss scaling from the default initial scale (65536, which overflows at
    first): 200 steps, every loss finite, few skipped steps, a scale that settled, a falling loss."""
    out = str(tmp_path / "run")
    _run_py(["--backend", "cuda", "--config", "tiny", "--steps", "200", "--output-dir", out,
             "--set", "cuda.precision=fp16", "--set", "model.attention_implementation=sdpa",
             *(a for o in S128 for a in ("--set", o))])
    rows = _metrics(out)
    assert len(rows) == 200
    losses = np.array([r["loss"] for r in rows])
    assert np.isfinite(losses).all()
    skipped = sum(r["skipped_step"] for r in rows)
    assert skipped <= 20, f"{skipped} of 200 steps skipped"
    assert not any(r["skipped_step"] for r in rows[100:]), "overflows after the scale settled"
    assert 1.0 <= rows[-1]["loss_scale"] <= 65536.0 * 2 ** 10
    assert losses[-20:].mean() < losses[:20].mean()


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
    from bert_packed.config import validate
    from bert_packed.loop.plan import gradient_accumulation

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
