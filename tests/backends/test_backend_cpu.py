"""The cpu reference backend: one train_step over several micro-batches is the same
optimizer step as one big batch (global-count normalisation), and the registry's errors."""
import copy

import numpy as np
import pytest
import torch

from backends import available_backends, get_backend
from bert_packed.backend import Backend
from bert_packed.config import ConfigError, load_config
from bert_packed.tasks.pretraining.data import build_data_source
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.loop.plan import make_plan
from helpers import count_raw_bit_masks


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _setup(config, seed=0):
    torch.manual_seed(seed)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (config.optimizer.beta1, config.optimizer.beta2))
    backend = get_backend("cpu")
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    return backend, model


def _concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_accumulated_step_equals_one_big_batch(normalization):
    config = load_config("tiny", [f"model.mlm_loss_normalization={normalization}"])
    iterator = iter(build_data_source(config, micro_batch_size=4))
    micro = [next(iterator) for _ in range(3)]
    accumulated, model_a = _setup(config)
    whole, model_b = _setup(config)
    m_a = accumulated.train_step(micro)
    m_b = whole.train_step([_concat(micro)])
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "num_sequences", "num_mlm_tokens"):
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-5, abs=1e-6), key
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_train_step_updates_and_eval_step_does_not():
    config = load_config("tiny")
    backend, model = _setup(config)
    batch = next(iter(build_data_source(config, micro_batch_size=4)))
    before = copy.deepcopy(model.state_dict())
    metrics = backend.eval_step(batch)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert metrics["num_sequences"] == batch["nsp_weights"].sum()
    backend.train_step([batch])
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_profile_reports_median_ms():
    config = load_config("tiny")
    backend, model = _setup(config)
    batch = next(iter(build_data_source(config, micro_batch_size=2)))
    cost = backend.profile(model, batch, num_repeats=2)
    assert cost["unit"] == "ms" and cost["cost"] > 0 and set(cost) == {"cost", "unit", "breakdown"}


def test_registry():
    assert available_backends() == ["cpu", "cuda", "ipu", "mock"]
    assert isinstance(get_backend("cpu"), Backend)
    with pytest.raises(ConfigError, match="unknown backend 'tpu'; available: cpu, cuda, ipu, mock"):
        get_backend("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="backend 'cuda' is not available"):
            get_backend("cuda")


_FAULTS_SCRIPT = """
import resource, sys
import torch
from backends import cpu
if sys.argv[1] == "on":
    assert cpu.reuse_freed_memory()
faults = []
for _ in range(8):  # a step's large temporary, allocated, touched and freed again and again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = torch.ones(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold (32 MiB)
    del tensor
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _page_faults_per_allocation(mode):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], cwd=root, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert result.returncode == 0, result.stderr
    return [int(n) for n in result.stdout.split()]


def test_freed_memory_is_reused_without_page_faults():
    """glibc: with cpu.reuse_freed_memory a large tensor freed and allocated again reuses pages
    already touched (0 faults once the heap has grown); without it, every allocation of 64 MiB
    is mapped afresh (16,384 faults of 4 KiB; fewer where transparent huge pages back it)."""
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    reused = _page_faults_per_allocation("on")
    assert max(reused[-3:]) < 100, reused
    fresh = _page_faults_per_allocation("off")
    assert min(fresh[-3:]) > 10 * max(1, max(reused[-3:])), (fresh, reused)


def test_reuse_freed_memory_follows_the_config(monkeypatch):
    from backends import cpu

    calls = []
    monkeypatch.setattr(cpu, "reuse_freed_memory", lambda: calls.append(1) or True)
    for value, expected in (("false", []), ("true", [1])):
        calls.clear()
        _setup(load_config("tiny", [f"cpu.reuse_freed_memory={value}"]))
        assert calls == expected


@pytest.mark.parametrize("fast, expected", [("true", 7), ("false", 0)])
def test_training_forward_draws_dropout_masks_from_raw_bits_with_fast_dropout(monkeypatch, fast, expected):
    """cpu.fast_dropout (default true): the training forward's dropouts (the embeddings', then per
    layer the attention probabilities' and two outputs': 1 + 3 x 2 layers = 7 on tiny with dropout)
    draw their masks from raw bits; evaluation draws none; false keeps torch's F.dropout."""
    shapes = count_raw_bit_masks(monkeypatch)
    config = load_config("tiny", ["model.hidden_dropout_prob=0.1", "model.attention_probs_dropout_prob=0.1",
                                  f"cpu.fast_dropout={fast}"])
    assert config.model.num_hidden_layers == 2
    backend, model = _setup(config)
    batch = next(iter(build_data_source(config, micro_batch_size=2)))
    backend.eval_step(batch)
    assert shapes == []
    metrics = backend.train_step([batch])
    assert len(shapes) == expected and np.isfinite(float(metrics["loss"]))
    from bert_packed.model.dropout import uses_host_masks

    assert not uses_host_masks(torch.ones(2), 0.1, True)  # the context ended with the step
