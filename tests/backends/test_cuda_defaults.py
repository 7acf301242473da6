"""What ``python run.py --backend cuda --config phase2`` runs by itself: the defaults the cuda
backend resolves on a GPU (attention, compile, micro-batch fitted to the GPU's memory), checked on
the CPU by giving validation a GPU's memory; the IPU, the mock and ``cuda.device=cpu`` keep theirs."""
import pytest

import run
from backends import cuda as cuda_backend
from backends import cuda_config, get_backend_class
from bert_packed.config import load_config, resolve_run

GIB = 2**30
H200 = int(139.8 * GIB)


@pytest.fixture
def gpu(monkeypatch):
    """Validation sees a GPU of the given memory (nothing else needs one: validation builds nothing)."""
    def set_memory(memory):
        monkeypatch.setattr(cuda_backend, "gpu_memory_bytes", lambda config: memory)
    set_memory(H200)
    return set_memory


def _validated(name, overrides=(), backend="cuda", world_size=1):
    """(the resolved config, the notes) of config ``name`` resolved for ``backend``."""
    resolved = resolve_run(load_config(name, list(overrides)), get_backend_class(backend), world_size)
    return resolved.config, list(resolved.warnings)


def test_phase2_on_a_gpu_compiles_flex_at_the_micro_batch_that_fits(gpu):
    config, notes = _validated("phase2")
    t = config.train
    assert config.model.attention_implementation == "flex"
    assert config.cuda.compile is True
    # Graphcore's 2 x 1024 packs per step, split into the largest micro-batches that fit 139.8 GiB.
    assert (t.micro_batch_size, t.gradient_accumulation) == (128, 16)
    assert t.micro_batch_size * t.gradient_accumulation == 2 * 1024
    assert any("train.micro_batch_size=128 x train.gradient_accumulation=16" in n and "2 x 1024" in n for n in notes)
    assert config.model.hidden_dropout_prob == 0.1  # the recipe is kept


def test_a_smaller_gpu_gets_a_smaller_micro_batch_with_the_same_packs_per_step(gpu):
    gpu(16 * GIB)
    config, _ = _validated("phase2")
    t = config.train
    assert t.micro_batch_size * t.gradient_accumulation == 2048
    assert 2 <= t.micro_batch_size < 128
    # The estimate the fit uses: BERT-Large's parameters exactly, and activations near the H200's
    # measured 0.44 GiB per pack (compiled flex, bf16).
    assert cuda_config.parameter_count(config.model) == 336_226_108
    assert 0.35 * GIB < cuda_config.pack_activation_bytes(config, "flex") < 0.5 * GIB
    assert cuda_config.pack_activation_bytes(config, "dense") > 1.5 * cuda_config.pack_activation_bytes(config, "flex")


def test_validating_twice_keeps_the_resolution_and_its_note(gpu):
    config = load_config("phase2")
    first = resolve_run(config, get_backend_class("cuda"))
    again = resolve_run(config, get_backend_class("cuda"))
    assert (again.config.train.micro_batch_size, again.config.train.gradient_accumulation) == (128, 16)
    assert again.warnings == first.warnings


@pytest.mark.parametrize("overrides,expected", [
    (["train.micro_batch_size=16"], ("flex", True, 16, 1024)),          # the command line's micro-batch wins
    (["train.gradient_accumulation=4"], ("flex", True, 2, 4)),
    (["cuda.fit_micro_batch=false"], ("flex", True, 2, 1024)),
    (["cuda.compile=false"], ("sdpa", False, 64, 32)),  # eager: sdpa measured fastest; it keeps the scores
    (["model.attention_probs_dropout_prob=0.1"], ("sdpa", True, 64, 32)),  # flex has no attention dropout
    (["model.attention_implementation=dense"], ("dense", True, 64, 32)),   # a named attention is kept
    (["model.attention_implementation=bucketed"], ("bucketed", False, 128, 16)),  # cannot compile: eager
])
def test_what_the_user_names_is_kept(gpu, overrides, expected):
    config, _ = _validated("phase2", overrides)
    t = config.train
    assert (config.model.attention_implementation, config.cuda.compile, t.micro_batch_size,
            t.gradient_accumulation) == expected


def test_a_global_batch_is_split_per_process(gpu):
    config, _ = _validated("phase2", ["train.global_batch_size=4096"], world_size=4)
    t = config.train
    assert t.global_batch_size == 4096 and 4096 % (t.micro_batch_size * 4) == 0
    assert t.micro_batch_size == 128


def test_without_a_visible_gpu_the_micro_batch_is_kept_and_said(gpu):
    gpu(None)
    config, notes = _validated("phase2")
    assert (config.train.micro_batch_size, config.model.attention_implementation, config.cuda.compile) == (2, "flex", True)
    assert any("no GPU visible" in n for n in notes)


def test_cuda_on_the_cpu_keeps_the_eager_dense_step(gpu):
    config, notes = _validated("phase2", ["cuda.device=cpu"])
    assert (config.model.attention_implementation, config.cuda.compile, config.train.micro_batch_size) == (
        "dense", False, 2)
    assert notes == [] or not any("micro_batch" in n for n in notes)
    tiny, _ = _validated("tiny", ["cuda.device=cpu"])
    assert (tiny.model.attention_implementation, tiny.cuda.compile, tiny.train.micro_batch_size) == ("dense", False, 8)


@pytest.mark.parametrize("backend", ["mock", "ipu"])
def test_the_ipu_and_the_mock_resolve_phase2_as_before(backend):
    """phase2 says ``auto`` now; the IPU's resolution is the dense mask it named before."""
    auto, _ = _validated("phase2", backend=backend)
    named, _ = _validated("phase2", ["model.attention_implementation=dense"], backend=backend)
    assert auto.model.attention_implementation == "dense"
    assert auto.to_dict() == named.to_dict()


def test_print_config_shows_what_runs_on_a_gpu(gpu, capsys):
    assert run.main(["--print-config", "phase2", "--backend", "cuda"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "attention_implementation: flex" in out and "micro_batch_size: 128" in out
    assert "gradient_accumulation: 16" in out
    cuda_part = out[out.index("\ncuda:"):]
    assert "\n  compile: true" in cuda_part
    assert "warning: train.micro_batch_size=128" in captured.err


def test_a_bad_fit_switch_is_one_line_error(capsys):
    assert run.main(["--print-config", "phase2", "--backend", "cuda", "--set", "cuda.fit_micro_batch=maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "fit_micro_batch" in err[0]


def test_auto_resolved_for_the_cpu_is_resolved_afresh_for_a_gpu(gpu):
    """One config validated for the cpu (bucketed), then for a GPU: the GPU resolves the user's
    ``auto``, not the CPU's choice (which cannot compile and would have kept the step eager)."""
    config = load_config("phase2")
    resolved = resolve_run(config, get_backend_class("cpu")).config
    assert resolved.model.attention_implementation == "bucketed"
    resolved = resolve_run(config, get_backend_class("cuda")).config
    assert (resolved.model.attention_implementation, resolved.cuda.compile) == ("flex", True)


def test_the_resolved_run_says_what_runs(gpu):
    config = load_config("phase2")
    resolved = resolve_run(config, get_backend_class("cuda"), 1)
    assert (resolved.attention, resolved.micro_batch_size, resolved.gradient_accumulation) == ("flex", 128, 16)
    assert resolved.matches(get_backend_class("cuda"), 1) and not resolved.matches(get_backend_class("cuda"), 2)
    assert any("train.micro_batch_size=128" in w for w in resolved.warnings)
