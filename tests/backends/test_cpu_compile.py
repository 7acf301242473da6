"""The cpu backend's compiled step (issue 23): ``cpu.compile`` compiles the fixed-shape packed
model once; it trains like the eager model and never recompiles after warm-up."""
import json

import pytest
import torch

from backends.cpu import CPUBackend
from bert_packed.config import load_config
from bert_packed.loop.train import train

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # one_thread: see tests/conftest.py; slow: compiles (minutes)
STEPS = 50
TINY = ["data.num_sequences=600", "data.packing_algorithm=lpfhp", "train.micro_batch_size=4",
        f"train.steps={STEPS}", "train.eval_every=25", "train.eval_batches=2", "train.checkpoint_every=0",
        "train.hf_export=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 50 steps (with two evaluations) eager and compiled: metrics.jsonl and final weights."""
    out = {}
    for compiled in (False, True):
        directory = tmp_path_factory.mktemp(f"compiled{compiled}")
        config = load_config("tiny", TINY + [f"cpu.compile={str(compiled).lower()}"])
        backend = CPUBackend()
        train(config, backend, output_dir=str(directory), show_progress=False)
        with open(directory / "metrics.jsonl") as f:
            out[compiled] = ([json.loads(line) for line in f],
                             {k: v.detach().clone() for k, v in backend.model.state_dict().items()})
    return out


def test_the_compiled_packed_step_equals_the_eager_one(runs):
    (eager, eager_weights), (compiled, compiled_weights) = runs[False], runs[True]
    assert [line["step"] for line in eager] == [line["step"] for line in compiled] == list(range(1, STEPS + 1))
    for a, b in zip(eager[:5], compiled[:5]):  # the first steps: within 1e-5
        for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key)
    for key in ("eval_loss", "eval_mlm_loss"):  # 50 steps on: still the same training
        assert compiled[-1][key] == pytest.approx(eager[-1][key], rel=1e-3)
    worst = max(float((eager_weights[k] - compiled_weights[k]).abs().max()) for k in eager_weights
                if eager_weights[k].is_floating_point())
    assert worst < 1e-3


def test_no_recompile_after_warm_up_over_50_steps(runs):
    compiled, _ = runs[True]
    assert all(line["recompiles_after_warmup"] == 0 for line in compiled)
    assert "recompiles_after_warmup" not in runs[False][0][0]  # eager runs do not report it


def test_a_recompile_after_warm_up_is_an_error(tmp_path):
    from backends.cpu import RecompileError
    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.tasks.pretraining.data import build_data_source
    from bert_packed.loop.plan import make_plan

    config = load_config("tiny", TINY + ["cpu.compile=true", "cpu.num_warmup_steps=1"])
    torch._dynamo.reset()
    model = build_model(config)
    optimizer, schedule = build_optimizer(config, model)
    backend = CPUBackend()
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=schedule)
    backend.forward_module = backend.train_module = torch.compile(model, backend="eager", dynamic=False)
    batches = iter(build_data_source(config, micro_batch_size=4))
    backend.train_step([next(batches)])  # warm-up: compiles
    smaller = {k: v[:2] for k, v in next(batches).items()}  # another shape: a new graph
    with pytest.raises(RecompileError, match=r"compiled 1 new graph\(s\) after the 1 warm-up steps .* "
                                             r"cpu.max_recompiles_after_warmup / cpu.num_warmup_steps"):
        backend.train_step([smaller])
