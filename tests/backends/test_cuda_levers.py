"""The cuda backend's levers on the CPU (``cuda.device=cpu``; docs/cuda.md, "Levers"):

- ``cuda.fp8``: torchao's float8 training in its emulation mode (FP8 rounding, fp32 arithmetic)
  stays within a stated tolerance of the fp32 step, and of the bf16 loss curve over 24 steps;
- ``cuda.compile_optimizer``: the compiled clipping + LAMB update trains like the eager one;
- the model levers (``model.fused_qkv``, ``model.vocab_padding_multiple``) train through the backend
  like the model without them;
- every lever that cannot run is refused at start-up with one line.
"""
import pytest
import torch

from backends.cuda import CUDABackend, float8_layer
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.config import ConfigError, load_config
from bert_packed.loop.plan import make_plan
from bert_packed.model.modeling import hf_state_dict
from test_cuda_backend import flat_params, micro_batches, run_steps, setup

FP32 = ["cuda.device=cpu", "cuda.precision=fp32", "optimizer.max_grad_norm=1.0"]


def _torchao():
    """Skip without a torchao whose float8 training imports here (none, or one built for a newer torch
    than this one, e.g. torch 2.0.1's CI)."""
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as exc:  # an old torch fails inside torchao, not always with ImportError
        pytest.skip(f"torchao float8 training not importable: {type(exc).__name__}")


def _cosine(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


# ----------------------------------------------------------------------------- fp8 (torchao emulation)


def test_fp8_converts_the_encoder_linears_and_keeps_the_parameters():
    _torchao()
    backend = CUDABackend(device="cpu")
    config, _, model = setup(backend, FP32 + ["cuda.fp8=true"])
    converted = {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    expected = {name for name, module in model.named_modules() if float8_layer(module, name)}
    # 2 layers x (query, key, value, attention output, intermediate, output); the heads stay.
    assert converted == expected and len(converted) == 12
    assert not any(name.startswith("cls.") or "pooler" in name for name in converted)
    # The same Parameters: the optimizer built before the conversion updates the model.
    assert {id(p) for p in model.parameters()} == {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    assert "bert.encoder.layer.0.attention.self.query.weight" in model.state_dict()  # checkpoint names unchanged


def test_fp8_emulated_step_is_within_tolerance_of_fp32():
    _torchao()
    ref_metrics, ref_before, ref_after = run_steps(CUDABackend(device="cpu"), FP32, num_steps=1)
    metrics, before, after = run_steps(CUDABackend(device="cpu"), FP32 + ["cuda.fp8=true"], num_steps=1)
    assert torch.equal(before, ref_before)
    # e4m3 forward / e5m2 gradients keep 3 / 2 mantissa bits per element, scaled per tensor. Measured
    # on the tiny model's first step: loss 1.4e-6 relative (a fresh model's loss is about log V
    # whatever its layers compute), gradient norm 2e-5, update direction cosine 0.994. Bounds:
    # 1e-4, 1e-2 and 0.98.
    assert float(metrics[0]["loss"]) == pytest.approx(float(ref_metrics[0]["loss"]), rel=1e-4)
    assert float(metrics[0]["grad_norm"]) == pytest.approx(float(ref_metrics[0]["grad_norm"]), rel=1e-2)
    assert float(metrics[0]["grad_norm"]) != float(ref_metrics[0]["grad_norm"])  # FP8 rounding did act
    assert _cosine(after - before, ref_after - ref_before) > 0.98  # the update goes the same way


@pytest.mark.slow
def test_fp8_emulated_loss_curve_follows_bf16():
    """24 steps of the tiny config (its 8 cached micro-batches, 3 times): the FP8 (emulated) curve
    within twice the bf16 curve's own distance from fp32, plus a margin of 0.05."""
    _torchao()
    curves = {}
    for name, overrides in {"fp32": ["cuda.precision=fp32"], "bf16": ["cuda.precision=bf16"],
                            "fp8": ["cuda.precision=bf16", "cuda.fp8=true"]}.items():
        backend = CUDABackend(device="cpu")
        config, batches, model = setup(backend, ["cuda.device=cpu", *overrides])
        steps = micro_batches(batches * 3, 24)
        curves[name] = torch.tensor([float(backend.train_step(step)["loss"]) for step in steps])
    assert curves["fp8"][-5:].mean() < curves["fp8"][:5].mean() * 0.9  # it trains
    bf16_gap = (curves["bf16"] - curves["fp32"]).abs().max().item()
    fp8_gap = (curves["fp8"] - curves["fp32"]).abs().max().item()
    assert fp8_gap <= 2 * bf16_gap + 0.05, (fp8_gap, bf16_gap)


def test_fp8_without_torchao_is_refused_with_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    config = load_config("tiny", ["cuda.device=cpu", "cuda.fp8=true"])
    with pytest.raises(ConfigError, match="pip install torchao, or set cuda.fp8=false"):
        CUDABackend.validate_config(config, 1)


# ----------------------------------------------------------------------------- compiled LAMB + clipping


@pytest.mark.slow
def test_compiled_optimizer_trains_like_the_eager_step():
    ref_metrics, ref_before, ref_after = run_steps(CUDABackend(device="cpu"), FP32, num_steps=3)
    metrics, before, after = run_steps(CUDABackend(device="cpu"), FP32 + ["cuda.compile_optimizer=true"], num_steps=3)
    assert torch.equal(before, ref_before)
    assert (after - before).abs().max().item() > 1e-3  # the steps moved the weights
    # float32 with inductor's fused order of operations: the same weights to 1e-5.
    assert (after - ref_after).abs().max().item() <= 1e-5
    for step, ref_step in zip(metrics, ref_metrics):
        assert float(step["grad_norm"]) == pytest.approx(float(ref_step["grad_norm"]), rel=1e-5)
        assert float(step["learning_rate"]) == float(ref_step["learning_rate"])


@pytest.mark.slow
def test_the_compiled_optimizer_step_reads_nothing_on_the_host(monkeypatch):
    """What whole-step capture (CUDA graphs) needs, checked on the CPU: after the first step (which
    compiles), a step with cuda.compile_optimizer turns no tensor into a Python number."""
    overrides = FP32 + ["cuda.compile_optimizer=true", "train.gradient_accumulation=2"]
    backend = CUDABackend(device="cpu")
    _, batches, _ = setup(backend, overrides)
    steps = micro_batches(batches, 3, per_step=2)
    backend.train_step(steps[0])  # compiles

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"a tensor was read on the host inside train_step ({name})")
        return read

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, refuse(name))
        results = [backend.train_step(step) for step in steps[1:]]
    assert all(isinstance(m.raw[key], torch.Tensor) for m in results for key in ("loss", "grad_norm"))
    assert all(torch.isfinite(m.raw["grad_norm"]) for m in results)


@pytest.mark.parametrize("overrides,needle", [
    (["optimizer.name=adamw"], "needs optimizer.name=lamb and cuda.precision bf16 or fp32 (here adamw, bf16)"),
    (["cuda.precision=fp16"], "(here lamb, fp16)"),
])
def test_compile_optimizer_where_it_cannot_apply_is_refused_with_one_line(tmp_path, capsys, overrides, needle):
    import run

    out = tmp_path / "run"
    args = ["--backend", "cuda", "--config", "tiny", "--no-progress", "--output-dir", str(out),
            "--set", "cuda.device=cpu", "--set", "cuda.compile_optimizer=true"]
    for override in overrides:
        args += ["--set", override]
    code = run.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: cuda.compile_optimizer compiles LAMB's update") and needle in err[0], err[0]
    assert not out.exists()


# ----------------------------------------------------------------------------- the model levers through the backend


def _trained(overrides, initial, batches, num_steps=2):
    """A backend that trained ``num_steps`` from the weights ``initial`` (a state dict in any layout)."""
    config = load_config("tiny", list(overrides))
    model = build_model(config)
    model.load_state_dict(initial)  # a lever changes the shapes, so the seed alone gives other weights
    optimizer, scheduler = build_optimizer(config, model)
    backend = CUDABackend(device="cpu")
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    metrics = [backend.train_step(step) for step in micro_batches(batches, num_steps)]
    return backend, metrics


def test_model_levers_train_through_the_backend_like_the_plain_model():
    _, batches, model = setup(CUDABackend(device="cpu"), FP32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    reference, ref_metrics = _trained(FP32, initial, batches)
    levers, metrics = _trained(FP32 + ["model.fused_qkv=true", "model.vocab_padding_multiple=96"], initial, batches)
    assert levers.model.bert.embeddings.word_embeddings.num_embeddings == 288  # 256 rounded up to 96s
    # Compare in Hugging Face's layout (the export): the same tensors, within fp32 rounding.
    ref_state, state = hf_state_dict(reference.model), hf_state_dict(levers.model)
    assert list(state) == list(ref_state)
    assert max((state[k] - v).abs().max().item() for k, v in ref_state.items()) <= 1e-5
    for step, ref_step in zip(metrics, ref_metrics):
        assert float(step["loss"]) == pytest.approx(float(ref_step["loss"]), rel=1e-5)


@pytest.mark.parametrize("value", ["0", "-64", "2.5", "2000"])
def test_a_bad_vocab_padding_multiple_is_refused_with_one_line(tmp_path, capsys, value):
    import run

    out = tmp_path / "run"
    code = run.main(["--backend", "cuda", "--config", "tiny", "--no-progress", "--output-dir", str(out),
                     "--set", "cuda.device=cpu", "--set", f"model.vocab_padding_multiple={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "vocab_padding_multiple" in err[0], err[0]
    assert not out.exists()
