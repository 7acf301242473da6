"""profile() of the IPU path: cycles through logCycleCount/cycleCount, estimated on the mock."""
import numpy as np
import pytest
import torch

from backends.mock import MockBackend
from bert_packed.config import load_config
from bert_packed.tasks.pretraining.model import build_model
from ipu.cost_model import estimate_cycles
from ipu_helpers import TINY_MODEL, random_micro_batches


def expected_cycles(config, batch):
    B, S = batch["input_ids"].shape
    return estimate_cycles(config.model, micro_batch_size=B, sequence_length=S,
                           max_sequences_per_pack=batch["nsp_weights"].shape[1], packed=True,
                           num_ipus_per_replica=len(config.ipu.layers_per_ipu), training=True,
                           layers_per_ipu=list(config.ipu.layers_per_ipu), precision="fp32",
                           max_masked_tokens_per_pack=batch["mlm_positions"].shape[1])


@pytest.fixture
def setup():
    config = load_config("phase2", TINY_MODEL + ["model.num_hidden_layers=2", "ipu.layers_per_ipu=[1,1]",
                                                 "ipu.half_precision=false", "train.micro_batch_size=1"])
    batch = random_micro_batches(0, 1, config)[0]
    return config, batch


def test_mock_profile_runs_the_ipu_path_and_returns_the_estimate(setup):
    config, batch = setup
    torch.manual_seed(0)
    model = build_model(config)
    before = [p.detach().clone() for p in model.parameters()]
    result = MockBackend().profile(model, batch, num_repeats=1, config=config, profile_dir="unused")
    expected = expected_cycles(config, batch)
    assert result["unit"] == "estimated cycles" and result["cycle_count_logged"] is True
    assert result["cost"] == pytest.approx(expected["total"], rel=1e-9)
    assert result["breakdown"] == expected["breakdown"] and result["profile_dir"] == "unused"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # caller's model untouched
    assert not any(getattr(m, "_poptorch_block_hook", None) for m in model.modules())


def test_mock_profile_of_a_meta_model_needs_no_compute(setup):
    config, batch = setup
    with torch.device("meta"):
        model = build_model(config)
    result = MockBackend().profile(model, batch, config=config)
    assert result["cost"] == pytest.approx(expected_cycles(config, batch)["total"], rel=1e-9)
    assert np.isfinite(result["cost"]) and result["cost"] > 0
