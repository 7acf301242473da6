"""The cpu reference backend: one train_step over several micro-batches is the same
optimizer step as one big batch (global-count normalisation), and the registry's errors."""
import copy

import numpy as np
import pytest
import torch

from backends import available_backends, get_backend
from bert_packed.backend import Backend
from bert_packed.config import ConfigError, load_config
from bert_packed.data import build_data_source
from bert_packed.build import build_model, build_optimizer
from bert_packed.loop.plan import make_plan


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
