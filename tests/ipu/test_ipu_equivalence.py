"""Mock-IPU training == cpu training on the same global batches (fp32, <= 1e-5).

The mock runs the whole IPU path (options, pipeline annotations, PopTorch's host-batch split,
Mean reduction over accumulation and replicas with the backend's loss multiplier, PopTorch
LAMB, setOptimizer); the cpu backend is the eager reference over the same micro-batches.

About the pipeline depth: PopART requires, for pipelined training, a gradient accumulation of
at least the number of pipeline stages, forward and backward: 2 x F - 1 for F forward stages.
Graphcore's layout on 4 IPUs has F = 5 (IPU 0, 1, 2, 3, then the tied heads back on IPU 0), so
the smallest legal accumulation is 9; GA 4 with that pipeline is rejected (tested below, as the
real SDK would). The exact batch split rf 2 x GA 4 x di 2 is tested on one IPU per replica.
"""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import ipu.mock_poptorch as poptorch
from backends.cpu import CPUBackend
from backends.mock import MockBackend
from bert_packed.config import ConfigError, load_config
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.loop.plan import make_plan
from ipu import options as ipu_options
from ipu import pipeline
from ipu.host_batch import stack_host_batch
from ipu.pipeline import TrainingWrapper
from ipu_helpers import TINY_MODEL, random_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METRICS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "num_sequences", "num_mlm_tokens")


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def fp32_config(layers_per_ipu, ga, extra=()):
    return load_config("phase2", TINY_MODEL + [
        f"model.num_hidden_layers={sum(layers_per_ipu)}", f"ipu.layers_per_ipu={list(layers_per_ipu)}",
        "model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0",
        "data.max_sequence_length=32", "train.micro_batch_size=1", f"train.gradient_accumulation={ga}",
        # Constant LR: PopTorch changes hyperparameters only between calls (setOptimizer), so
        # with device_iterations 2 a per-step schedule would differ from the cpu by design.
        "optimizer.schedule=constant", "optimizer.warmup_fraction=0.0", "train.steps=8",
        "ipu.replication_factor=2", "ipu.device_iterations=2", "ipu.output_mode=all",
        "ipu.half_precision=false", "ipu.enable_half_partials=false", "ipu.loss_scaling=1.0",
        "ipu.available_memory_proportion=[0.2]"] + list(extra))


def train_both(config, num_calls):
    """Per-step metrics and final models of mock and cpu on the same micro-batches."""
    torch.manual_seed(0)
    model = build_model(config)
    reference = copy.deepcopy(model)
    betas = (config.optimizer.beta1, config.optimizer.beta2)
    mock, cpu = MockBackend(), CPUBackend()
    optimizer, scheduler = build_optimizer(config, model, betas)
    mock.prepare(model, optimizer, make_plan(config, mock), scheduler=scheduler)
    ref_optimizer, ref_scheduler = build_optimizer(config, reference, betas)
    cpu.prepare(reference, ref_optimizer, make_plan(config, cpu), scheduler=ref_scheduler)
    n, num_steps = mock.micro_batches_per_step, mock.steps_per_call
    batches = random_micro_batches(1, n * num_steps * num_calls, config)
    mock_steps, cpu_steps = [], []
    for call in range(num_calls):
        call_batches = batches[call * n * num_steps:(call + 1) * n * num_steps]
        result = mock.train_step([dict(b) for b in call_batches])
        mock_steps += result if isinstance(result, list) else [result]
        for s in range(num_steps):
            cpu_steps.append(cpu.train_step([dict(b) for b in call_batches[s * n:(s + 1) * n]]))
    return mock, model, reference, mock_steps, cpu_steps


def assert_same_training(mock, model, reference, mock_steps, cpu_steps):
    # The device holds its own weights: the host model has the trained ones after sync_to_host
    # (what the loop calls before checkpointing), not before.
    mock.sync_to_host()
    assert len(mock_steps) == len(cpu_steps)
    for step, (m, c) in enumerate(zip(mock_steps, cpu_steps)):
        for name in METRICS:
            assert abs(m[name] - c[name]) <= 1e-5 * max(1.0, abs(c[name])), (step, name, m[name], c[name])
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(build_model_like(model).parameters(), model.parameters()))


def cpu_backend_for(model, config):
    backend = CPUBackend()
    backend.prepare(model, None, make_plan(config, backend))
    return backend


def build_model_like(model):
    torch.manual_seed(0)
    return type(model)(model.config)


def test_mock_equals_cpu_rf2_ga4_di2():
    config = fp32_config([4], ga=4)
    mock, model, reference, mock_steps, cpu_steps = train_both(config, num_calls=2)
    assert mock.micro_batches_per_step == 8 and mock.steps_per_call == 2
    assert_same_training(mock, model, reference, mock_steps, cpu_steps)
    # Evaluation (an inference executable on the same weights) agrees as well.
    batch = random_micro_batches(7, 1, config)[0]
    mock_eval, cpu_eval = mock.eval_step(dict(batch)), cpu_backend_for(reference, config).eval_step(dict(batch))
    for name in METRICS:
        assert abs(mock_eval[name] - cpu_eval[name]) <= 1e-5 * max(1.0, abs(cpu_eval[name])), name


def test_mock_equals_cpu_with_output_mode_sum():
    """phase2's OutputMode.Sum (one value per replica, summed over the call) with one step per call."""
    config = fp32_config([4], ga=4, extra=["ipu.output_mode=sum", "ipu.device_iterations=1"])
    mock, model, reference, mock_steps, cpu_steps = train_both(config, num_calls=2)
    assert_same_training(mock, model, reference, mock_steps, cpu_steps)


def test_mock_clips_gradients_as_the_cpu_does():
    """optimizer.max_grad_norm reaches PopTorch's optimizer (the fine-tuning configs clip at 1.0,
    as the Trainer does) and the mock clips as the cpu backend: the same steps with AdamW, whose
    update depends on the clip factor of every step; without a clip PopTorch gets none."""
    config = fp32_config([4], ga=4, extra=["optimizer.name=adamw", "optimizer.eps=1e-8",
                                           "optimizer.max_grad_norm=0.05"])
    mock, model, reference, mock_steps, cpu_steps = train_both(config, num_calls=2)
    assert mock.optimizer.max_grad_norm == 0.05
    assert min(float(step["grad_norm"]) for step in cpu_steps) > 0.05  # clipped at every step
    assert_same_training(mock, model, reference, mock_steps, cpu_steps)
    unclipped = fp32_config([4], ga=4)
    torch.manual_seed(0)
    model = build_model(unclipped)
    backend = MockBackend()
    backend.prepare(model, build_optimizer(unclipped, model)[0], make_plan(unclipped, backend))
    assert unclipped.optimizer.max_grad_norm is None and backend.optimizer.max_grad_norm == math.inf


def test_mock_equals_cpu_rf2_di2_four_ipu_pipeline():
    config = fp32_config([1, 1, 1, 1], ga=9)
    mock, model, reference, mock_steps, cpu_steps = train_both(config, num_calls=1)
    plan = mock.training_model.pipeline
    assert plan["stage_ipus"] == [0, 1, 2, 3, 0] and plan["num_ipus"] == 8
    assert_same_training(mock, model, reference, mock_steps, cpu_steps)


def test_ga4_is_too_shallow_for_the_four_ipu_pipeline():
    config = fp32_config([1, 1, 1, 1], ga=4)
    torch.manual_seed(0)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (0.9, 0.999))
    # The backend says it as a config error before anything runs ...
    with pytest.raises(ConfigError, match=r"at least 9 micro-batches per replica \(got 4\)"):
        MockBackend().prepare(model, optimizer, make_plan(config, MockBackend), scheduler=scheduler)
    # ... and the mock itself rejects it as PopTorch would, for code that bypasses the backend.
    opts = ipu_options.build_options(poptorch, config.ipu, seed=config.train.seed,
                                     gradient_accumulation=config.train.gradient_accumulation)
    wrapped = poptorch.trainingModel(TrainingWrapper(pipeline.parallelize(model, config.ipu, poptorch), poptorch),
                                     opts, optimizer=pipeline.build_optimizer(optimizer, poptorch, config.ipu))
    host = stack_host_batch(random_micro_batches(0, 16, config), num_steps=2, gradient_accumulation=4, num_replicas=2)
    with pytest.raises(poptorch.Error, match=r"number of pipeline stages \(9\)"):
        wrapped(**host)


def _generated_data_available():
    try:
        from packing import Histogram  # noqa: F401  (generated data packs with the packing library)
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _generated_data_available(), reason="the packing library is not in this tree yet")
def test_run_py_mock_phase2_with_size_overrides_only(tmp_path):
    """`python run.py --backend mock --config phase2.yaml` with --set size overrides (fp16 as configured)."""
    command = [sys.executable, "run.py", "--backend", "mock", "--config", "phase2.yaml", "--steps", "2",
               "--output-dir", str(tmp_path), "--no-progress"]
    sizes = TINY_MODEL + ["model.num_hidden_layers=4", "ipu.layers_per_ipu=[1,1,1,1]",
                          "train.gradient_accumulation=9", "train.micro_batch_size=1",
                          "data.max_sequence_length=32", "data.num_sequences=300"]
    for item in sizes:
        command += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    losses = [json.loads(line)["loss"] for line in lines]
    assert all(0 < loss < 20 for loss in losses)  # finite fp16 training on the mock


def test_loop_optimizer_checkpoints_carry_poptorch_state():
    """The checkpoint holds PopTorch's optimizer state dict: the device's state in ``ipu_state``
    (torch's own ``state`` stays empty: the host never steps); loaded before the compile it is
    written to the device at attach, so the next step equals the uninterrupted one."""
    config = fp32_config([2], ga=2, extra=["ipu.replication_factor=1", "ipu.device_iterations=1"])
    torch.manual_seed(0)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (0.9, 0.999))
    mock = MockBackend()
    mock.prepare(model, optimizer, make_plan(config, mock), scheduler=scheduler)
    mock.train_step(random_micro_batches(0, 2, config))
    saved = mock.state_dict()["optimizer"]  # what the loop writes into its checkpoint
    steps = {k: v for k, v in saved["ipu_state"].items() if k.startswith("step___")}
    assert not saved["state"] and len(steps) == sum(1 for p in model.parameters() if p.requires_grad)
    assert all(int(v) == 1 for v in steps.values())
    mock.sync_to_host()
    torch.manual_seed(0)
    restored_model = build_model(config)
    restored_model.load_state_dict(model.state_dict())
    restored_optimizer, _ = build_optimizer(config, restored_model, (0.9, 0.999))
    restored = MockBackend()
    restored.prepare(restored_model, restored_optimizer, make_plan(config, restored), state={"optimizer": saved})
    batches = random_micro_batches(1, 2, config)
    assert restored.train_step([dict(b) for b in batches])["loss"] == mock.train_step([dict(b) for b in batches])["loss"]
    after = [backend.state_dict()["optimizer"]["ipu_state"] for backend in (mock, restored)]
    assert after[0].keys() == after[1].keys()
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0]), "the moments went on from the checkpoint's"
    assert all(int(after[1][k]) == 2 for k in steps)


def test_poptorch_refuses_an_optimizer_state_without_its_ipu_part():
    """python/optim.py set_state_dict: a torch optimizer's state dict (e.g. the cpu backend's)
    is refused, before anything compiles."""
    config = fp32_config([2], ga=2, extra=["ipu.replication_factor=1", "ipu.device_iterations=1"])
    model = build_model(config)
    optimizer, _ = build_optimizer(config, model, (0.9, 0.999))
    with pytest.raises(RuntimeError, match="Only IPU optimizer states can be loaded onto the IPU."):
        MockBackend().prepare(model, optimizer, make_plan(config, MockBackend), state={"optimizer": optimizer.state_dict()})


def test_steps_must_fill_whole_calls():
    config = fp32_config([2], ga=2, extra=["train.steps=3"])  # device_iterations 2
    model = build_model(config)
    optimizer, _ = build_optimizer(config, model, (0.9, 0.999))
    with pytest.raises(ConfigError, match="not a multiple of ipu.device_iterations"):
        MockBackend().prepare(model, optimizer, make_plan(config, MockBackend))


def test_the_mock_keeps_poptorchs_dropout(monkeypatch):
    """PopTorch lowers F.dropout to PopART's dropout: the mock (like the IPU) never draws the cpu
    backend's raw-bit masks, while the cpu backend on the same config does (the check can fail)."""
    from helpers import count_raw_bit_masks

    shapes = count_raw_bit_masks(monkeypatch)
    config = fp32_config((2,), 1, ["model.hidden_dropout_prob=0.1", "ipu.replication_factor=1",
                                     "ipu.device_iterations=1"])
    torch.manual_seed(0)
    model = build_model(config)
    mock = MockBackend()
    optimizer, scheduler = build_optimizer(config, model, (config.optimizer.beta1, config.optimizer.beta2))
    mock.prepare(model, optimizer, make_plan(config, mock), scheduler=scheduler)
    batches = random_micro_batches(1, mock.micro_batches_per_step * mock.steps_per_call, config)
    mock.train_step([dict(b) for b in batches])
    assert shapes == []
    reference = build_model(config)
    cpu = CPUBackend()
    ref_optimizer, ref_scheduler = build_optimizer(config, reference, (config.optimizer.beta1, config.optimizer.beta2))
    cpu.prepare(reference, ref_optimizer, make_plan(config, cpu), scheduler=ref_scheduler)
    cpu.train_step([dict(b) for b in batches[:mock.micro_batches_per_step]])
    assert len(shapes) > 0
