"""What an attention implementation can do is declared once, on its registration (issue 48): the
devices it trains on, attention dropout, fixed shapes, the scores it keeps. The backends' refusals and
estimates read those declarations; a new implementation states them and needs no line in a backend."""
import dataclasses

import pytest
import torch

from backends import cuda_config, get_backend_class
from backends.cuda import CUDABackend
from bert_packed.model import attention
from bert_packed.config import ConfigError, load_config, validate


def _register(monkeypatch, name, **capabilities):
    dense = attention.get_attention("dense")
    impl = dataclasses.replace(dense, name=name, **capabilities)
    monkeypatch.setitem(attention.ATTENTION_IMPLEMENTATIONS, name, impl)
    return impl


def test_the_gpu_only_implementations_declare_it():
    for name, needs in (("flex", "FlexAttention backward"), ("varlen", "varlen_attn")):
        impl = attention.find_attention(name)
        if impl is None:
            pytest.skip(f"{name} is not available with torch {torch.__version__}")
        assert impl.trains_on == ("cuda",) and needs in impl.training_needs and not impl.dropout
        assert impl.trains_on_device("cuda") and not impl.trains_on_device("cpu")
    for name in ("dense", "sdpa", "bucketed"):
        impl = attention.get_attention(name)
        assert impl.trains_on is None and impl.dropout and impl.trains_on_device("cpu")
    assert attention.find_attention("no-such-attention") is None


def test_a_new_gpu_only_implementation_is_refused_on_the_cpu_by_its_declaration(monkeypatch):
    """No table in the backend to extend: the declaration alone makes cuda.device=cpu refuse it."""
    _register(monkeypatch, "gpu_only_test", trains_on=("cuda",), training_needs="test kernel's backward")
    config = load_config("tiny", ["cuda.device=cpu", "model.attention_implementation=gpu_only_test"])
    with pytest.raises(ConfigError) as info:
        validate(config, get_backend_class("cuda"))
    message = str(info.value)
    assert message.startswith("cuda.device=cpu cannot train model.attention_implementation=gpu_only_test: torch "
                              "has no test kernel's backward on a CPU; use attention ")
    assert "'dense'" in message and "'sdpa'" in message and "gpu_only_test'" not in message and "\n" not in message
    # The same implementation declared for every device is accepted there.
    _register(monkeypatch, "gpu_only_test")
    validate(load_config("tiny", ["cuda.device=cpu", "model.attention_implementation=gpu_only_test"]),
             get_backend_class("cuda"))


def test_an_implementation_without_dropout_is_refused_with_dropout_at_prepare(monkeypatch):
    """What flex's refusal was (a name in the backend) now holds for any implementation declaring no dropout."""
    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.loop.plan import make_plan

    _register(monkeypatch, "no_dropout_test", dropout=False)
    config = load_config("tiny", ["cuda.device=cpu", "model.attention_implementation=no_dropout_test",
                                  "model.attention_probs_dropout_prob=0.1"])
    backend = CUDABackend(device="cpu")
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model)
    with pytest.raises(ConfigError, match=r"^model.attention_implementation=no_dropout_test has no attention "
                                          r"dropout but model.attention_probs_dropout_prob=0.1; "):
        backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)


def test_the_memory_estimate_counts_scores_by_the_declaration(monkeypatch):
    config = load_config("phase2", ["cuda.precision=bf16"])
    dense = cuda_config.pack_activation_bytes(config, "dense")
    _register(monkeypatch, "scoreless_test", keeps_scores=False)
    assert cuda_config.pack_activation_bytes(config, "scoreless_test") < dense / 1.5
    _register(monkeypatch, "scoreless_test", keeps_scores=True)
    assert cuda_config.pack_activation_bytes(config, "scoreless_test") == dense


@pytest.mark.parametrize("name", ["flex", "varlen"])
def test_the_cpu_backend_refuses_a_gpu_only_attention_before_writing_anything(tmp_path, capsys, name):
    """It used to get as far as the first forward; the declaration refuses it at start-up."""
    import run

    if attention.find_attention(name) is None:
        pytest.skip(f"{name} is not available with torch {torch.__version__}")
    out = tmp_path / "run"
    code = run.main(["--backend", "cpu", "--config", "tiny", "--no-progress", "--output-dir", str(out),
                     "--set", f"model.attention_implementation={name}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: backend 'cpu' cannot train model.attention_implementation={name}: torch has "
                             f"no ") and "on a CPU; use attention 'dense' or 'sdpa' there, or a GPU" in err[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
