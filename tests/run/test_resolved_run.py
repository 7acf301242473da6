"""One source of truth for the configuration (issue 48): ``resolve_run`` leaves the config it is
given as it was and returns the resolved run, whose ``config`` (``auto`` resolved by the backend,
the backend's defaults filled in) is what runs and what the run's files record; the same user
config resolved for two backends gets each its own answer; what a run records is what it recorded
before (the checkpoint of tests/fixtures/before_issue48) and what ``--print-config`` shows."""
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import run
from backends import cuda as cuda_backend
from backends import get_backend, get_backend_class
from bert_packed.config import load_config, resolve_run

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "before_issue48"
QUIET = ["--no-progress", "--set", "train.tensorboard=false", "--set", "train.num_threads=1"]


def _state(config):
    """Everything a Config holds, copied: what resolving must leave as it was."""
    return copy.deepcopy((config.name, config.to_dict(), config.cli_keys, config.unregistered, config.shape_from,
                          sorted(vars(config))))


@pytest.fixture
def gpu(monkeypatch):
    """Validation sees an H200's memory: the cuda backend then fills in compile and fits the micro-batch."""
    monkeypatch.setattr(cuda_backend, "gpu_memory_bytes", lambda config: int(139.8 * 2**30))


# (backend, config, overrides, what the resolved config says: (section, key) -> value)
CASES = [
    ("cpu", "finetune_classification", [], {("model", "attention_implementation"): "bucketed"}),
    ("cpu", "tiny", ["model.attention_implementation=auto", "cpu.compile=true"],
     {("model", "attention_implementation"): "dense"}),
    ("mock", "finetune_classification", [], {("model", "attention_implementation"): "dense"}),
    ("cuda", "finetune_classification", ["cuda.device=cpu"],
     {("model", "attention_implementation"): "dense", ("cuda", "compile"): False}),
    # The IPU section fitted to a 2-IPU layout: the memory proportions follow it.
    ("mock", "phase2", ["ipu.layers_per_ipu=[12,12]"],
     {("ipu", "available_memory_proportion"): [0.1, 0.15], ("model", "attention_implementation"): "dense"}),
    ("ipu", "phase2", ["ipu.layers_per_ipu=[12,12]"], {("ipu", "available_memory_proportion"): [0.1, 0.15]}),
]


@pytest.mark.parametrize("backend,name,overrides,expected", CASES)
def test_resolving_leaves_the_given_config_as_it_was(backend, name, overrides, expected):
    config = load_config(name, overrides)
    before = _state(config)
    resolved = resolve_run(config, get_backend_class(backend))
    assert _state(config) == before
    values = resolved.config.to_dict()
    assert {key: values[key[0]][key[1]] for key in expected} == expected
    assert resolved.attention == values["model"]["attention_implementation"]
    assert resolved.config is not config


def test_a_gpu_resolution_fills_in_the_copy_only(gpu):
    config = load_config("phase2")
    before = _state(config)
    resolved = resolve_run(config, get_backend_class("cuda"))
    assert _state(config) == before
    assert (config.model.attention_implementation, config.cuda.compile, config.train.micro_batch_size) == (
        "auto", None, 2)
    r = resolved.config
    assert (r.model.attention_implementation, r.cuda.compile, r.train.micro_batch_size,
            r.train.gradient_accumulation) == ("flex", True, 128, 16)
    assert (resolved.micro_batch_size, resolved.gradient_accumulation) == (128, 16)


def test_one_user_config_resolved_for_backends_in_turn_gets_each_its_own_answer(gpu):
    config = load_config("finetune_classification")
    answers = [(b, resolve_run(config, get_backend_class(b)).attention) for b in ("cpu", "mock", "cpu", "cuda", "cpu")]
    assert answers == [("cpu", "bucketed"), ("mock", "dense"), ("cpu", "bucketed"), ("cuda", "sdpa"),
                       ("cpu", "bucketed")]  # finetune_classification has attention dropout: sdpa on a GPU
    assert config.model.attention_implementation == "auto"


def test_resolving_twice_gives_the_same_run_and_notes():
    """The IPU layout's note came back on a second validation only through a cache on the mutated
    config (``fitted_notes``); from the user's config every resolution says it."""
    config = load_config("phase2", ["ipu.layers_per_ipu=[12,12]"])
    first, again = (resolve_run(config, get_backend_class("mock")) for _ in range(2))
    assert first.warnings == again.warnings and any("available_memory_proportion" in w for w in first.warnings)
    assert first.config.to_dict() == again.config.to_dict() and first.config is not again.config


def test_the_loop_trains_the_resolved_config_and_changes_neither(tmp_path):
    config = load_config("tiny", ["model.attention_implementation=auto", "train.steps=1", "train.tensorboard=false",
                                  "train.hf_export=false", "train.num_threads=1"])
    cpu = get_backend_class("cpu")
    resolved = resolve_run(config, cpu)
    given, kept = _state(config), _state(resolved.config)
    from bert_packed.loop.train import train

    summary = train(config, get_backend("cpu"), output_dir=str(tmp_path / "a"), show_progress=False,
                    resolved=resolved)
    assert summary["config_resolved"]["model"]["attention_implementation"] == "bucketed"
    assert _state(config) == given and _state(resolved.config) == kept
    # Without the caller's resolution the loop resolves the same way.
    summary = train(config, get_backend("cpu"), output_dir=str(tmp_path / "b"), show_progress=False)
    assert summary["config_resolved"]["model"]["attention_implementation"] == "bucketed"
    assert _state(config) == given


@pytest.mark.parametrize("backend,attention", [("cpu", "bucketed"), ("mock", "dense")])
def test_a_run_records_what_print_config_shows(backend, attention, tmp_path, capsys):
    """The checkpoint's configuration as given (what a resume compares) and summary.json's resolved
    one name the attention ``auto`` resolved to, as ``--print-config`` prints it."""
    argv = ["--config", "demo", "--backend", backend, "--set", "model.attention_implementation=auto",
            "--set", "train.checkpoint_every=1", "--set", "train.hf_export=false"] + QUIET
    assert run.main(argv + ["--steps", "1", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    out = tmp_path / "run"
    assert run.main(argv + ["--steps", "1", "--output-dir", str(out)]) == 0
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert checkpoint["config_given"] == printed
    assert printed["model"]["attention_implementation"] == attention
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config_resolved"] == checkpoint["config"]
    assert summary["config_resolved"]["model"]["attention_implementation"] == attention
    # and it resumes: the resolved configuration is compared with the resolved one
    assert run.main(argv + ["--steps", "2", "--output-dir", str(out), "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_a_run_records_the_configuration_a_run_from_before_recorded(tmp_path):
    """tests/fixtures/before_issue48/run: tiny, 2 steps, on the cpu, by the code before the
    configuration was resolved into a copy. Today's run of it records the same configuration."""
    out = tmp_path / "today"
    argv = ["--config", "tiny", "--no-progress", "--set", "train.tensorboard=false", "--set",
            "train.checkpoint_every=2", "--steps", "2", "--output-dir", str(out)]
    assert run.main(argv) == 0
    before = torch.load(FIXTURES / "run" / "checkpoint.pt", map_location="cpu", weights_only=False)
    today = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert today["config"] == before["config"] and today["config_given"] == before["config_given"]
    assert today["plan"] == before["plan"]


HOSTILE = [
    (["--backend", "cpu", "--set", "model.attention_implementation=flex"],
     "backend 'cpu' cannot train model.attention_implementation=flex"),
    (["--backend", "mock", "--set", "model.attention_implementation=bucketed"],
     "model.attention_implementation=bucketed has shapes that depend on each batch"),
    (["--backend", "cuda", "--set", "cuda.device=cpu", "--set", "model.attention_implementation=bucketed", "--set",
      "cuda.compile=true"], "cuda.compile cannot compile model.attention_implementation=bucketed"),
    (["--backend", "cpu", "--set", "model.attention_implementation=atuo"],
     "unknown attention implementation 'atuo'"),
    (["--backend", "mock", "--set", "ipu.layers_per_ipu=[1]"], "ipu.layers_per_ipu=[1] sums to 1"),
    (["--backend", "cpu", "--set", "model.attention_implementation="], "model.attention_implementation is empty"),
]


@pytest.mark.parametrize("args,message", HOSTILE)
def test_hostile_settings_are_refused_in_one_line_leaving_nothing(args, message, tmp_path, capsys):
    config_file = tmp_path / "my.yaml"
    shutil.copy(Path(run.__file__).parent / "configs" / "demo.yaml", config_file)
    data = config_file.read_bytes()
    out = tmp_path / "out"
    assert run.main(["--config", str(config_file), "--steps", "1", "--output-dir", str(out), *QUIET, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert config_file.read_bytes() == data and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my.yaml"]
