"""Config system: precedence, rejection of unknown keys / wrong types, validation, CLI."""
import os
import subprocess
import sys

import pytest

from backends import get_backend_class
from bert_packed.config import CONFIG_DIR, Config, ConfigError, dump, load_config, resolve_config_path, validate
from bert_packed.loop.plan import gradient_accumulation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  steps: 7\n  micro_batch_size: 3\n")
    config = load_config(str(path), ["train.steps=9"])
    assert config.name == "mine"
    assert config.train.steps == 9                     # CLI beats YAML
    assert config.train.micro_batch_size == 3          # YAML beats default
    assert config.train.seed == Config().train.seed    # default where nobody said anything


def test_name_resolves_with_or_without_extension():
    assert resolve_config_path("phase2") == resolve_config_path("phase2.yaml")
    assert resolve_config_path("phase2").endswith(os.path.join("configs", "phase2.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads_and_validates(name):
    config = load_config(name)
    for backend in ("cpu", "mock"):
        validate(config, get_backend_class(backend))


def test_phase2_is_graphcore_pod16_layout():
    c = load_config("phase2")
    assert (c.model.hidden_size, c.model.num_hidden_layers, c.data.max_sequence_length) == (1024, 24, 512)
    assert c.data.max_sequences_per_pack == 3 and c.data.max_masked_tokens_per_pack == 76 + 3 - 1
    assert c.ipu.layers_per_ipu == [3, 7, 7, 7] and c.ipu.ipus_per_replica * c.ipu.replication_factor == 16
    assert (c.train.micro_batch_size, c.train.gradient_accumulation, c.train.steps) == (2, 1024, 2137)
    assert (c.optimizer.name, c.optimizer.learning_rate, c.optimizer.warmup_fraction) == ("lamb", 0.002828, 0.128)


@pytest.mark.parametrize("override, fragment", [
    ("train.stepz=3", "unknown key train.stepz"),
    ("trian.steps=3", "unknown section 'trian'"),
    ("train.steps=many", "train.steps: expected int"),
    ("train.steps=2.5", "train.steps: expected int"),
    ("train.tensorboard=3", "expected bool"),
    ("ipu.layers_per_ipu=7", "expected list of int"),
    ("data.length_mapping=stretch", "must be one of scale, truncate"),
    ("steps=3", "expected section.key=value"),
])
def test_bad_overrides_are_one_line_errors(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_int_is_accepted_for_float_and_yaml_types_are_parsed():
    config = load_config("tiny", ["optimizer.learning_rate=1", "ipu.available_memory_proportion=[0.2, 0.3]"])
    assert config.optimizer.learning_rate == 1.0 and isinstance(config.optimizer.learning_rate, float)
    assert config.ipu.available_memory_proportion == [0.2, 0.3]


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError, match="unknown key model.hiden_size"):
        load_config(str(path))


def test_unknown_config_name_lists_available():
    with pytest.raises(ConfigError, match="unknown config 'nope'.*available: .*phase2"):
        load_config("nope")


def test_layers_per_ipu_must_sum_to_layers_on_ipu_backends_only():
    config = load_config("phase2", ["model.num_hidden_layers=2"])
    for backend in ("ipu", "mock"):
        with pytest.raises(ConfigError, match=r"layers_per_ipu=\[3, 7, 7, 7\] sums to 24 but model.num_hidden_layers=2"):
            validate(config, get_backend_class(backend))
    assert validate(config, get_backend_class("cpu")) == []  # the ipu section does not apply to cpu
    config = load_config("phase2", ["model.num_hidden_layers=2", "ipu.layers_per_ipu=[1, 1]",
                                     "ipu.available_memory_proportion=[0.2]"])
    validate(config, get_backend_class("mock"))
    assert any("ipu.{" in w and "layers_per_ipu" in w for w in validate(config, get_backend_class("cpu")))  # asked for, ignored: warned


def test_global_batch_must_divide_into_micro_batches_and_replicas():
    config = load_config("tiny", ["train.global_batch_size=10", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="global_batch_size=10 is not divisible by micro_batch_size x replicas"):
        validate(config, get_backend_class("cpu"))
    config = load_config("tiny", ["train.global_batch_size=16", "train.micro_batch_size=4"])
    validate(config, get_backend_class("cpu"), world_size=2)
    assert gradient_accumulation(config, get_backend_class("cpu"), world_size=2) == 2
    assert gradient_accumulation(config, get_backend_class("cpu"), world_size=1) == 4


def test_warning_for_settings_of_another_backend():
    config = load_config("tiny", ["cuda.precision=fp16"])
    (warning,) = validate(config, get_backend_class("cpu"))
    assert "cuda.{precision}" in warning and "backend 'cpu'" in warning
    # (cuda.fit_micro_batch=false: without a GPU to fit the micro-batch to, the cuda backend says so)
    config = load_config("tiny", ["cuda.precision=fp16", "cuda.fit_micro_batch=false"])
    assert validate(config, get_backend_class("cuda")) == []
    assert validate(load_config("phase2"), get_backend_class("cpu")) == []  # its YAML ipu section is not nagged about


def test_dump_round_trips(tmp_path):
    config = load_config("phase2", ["train.steps=11"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump(config))
    again = load_config(str(path))
    assert again.to_dict() == config.to_dict()


@pytest.mark.slow
def test_cli_prints_resolved_config_and_rejects_bad_ones():
    run = lambda *args: subprocess.run([sys.executable, "-m", "bert_packed.config", *args], cwd=ROOT,
                                       capture_output=True, text=True)
    ok = run("phase2", "--set", "train.steps=5")
    assert ok.returncode == 0, ok.stderr
    assert "layers_per_ipu: [3, 7, 7, 7]" in ok.stdout and "steps: 5" in ok.stdout
    bad = run("phase2", "--set", "train.nope=1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: --set: unknown key train.nope")


# ----------------------------------------------------------------------------- maximums (issue 27)


def _numeric_fields():
    """(section, field, base type) of every int/float field of every registered section (lists:
    their items), found by type, so a new field is covered without being named here."""
    import dataclasses
    import typing

    found = []
    for name, obj in Config().sections.items():
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            tp = hints[f.name]
            while typing.get_origin(tp) in (typing.Union, list):
                tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
            if tp in (int, float):
                found.append((name, f, tp))
    return found


NUMERIC = _numeric_fields()


def test_the_sections_checked_include_every_owner():
    sections = {name for name, _, _ in NUMERIC}
    assert {"model", "data", "optimizer", "train", "finetune", "ipu", "cpu", "cuda"} <= sections
    keys = {f"{name}.{f.name}" for name, f, _ in NUMERIC}
    # The tasks' own keys are in the finetune section: classification's, SQuAD's.
    assert {"finetune.num_labels", "finetune.n_best_size", "finetune.doc_stride", "finetune.epochs"} <= keys


@pytest.mark.parametrize("name, f, tp", NUMERIC, ids=[f"{n}.{f.name}" for n, f, _ in NUMERIC])
def test_every_number_has_a_maximum_or_a_reason_for_none(name, f, tp):
    meta = f.metadata
    upper = meta.get("le", meta.get("lt"))
    if upper is None:
        assert meta.get("unbounded"), f"{name}.{f.name}: declare a maximum (le=/lt=, with why=) or unbounded='reason'"
        return
    assert "unbounded" not in meta
    if upper > 1:  # not a fraction or probability: a sanity limit, which says why
        assert meta.get("why"), f"{name}.{f.name}: a maximum of {upper} needs why='the reason'"


BOUNDED = [(n, f, tp) for n, f, tp in NUMERIC if "le" in f.metadata or "lt" in f.metadata]


@pytest.mark.parametrize("name, f, tp", BOUNDED, ids=[f"{n}.{f.name}" for n, f, _ in BOUNDED])
def test_each_maximum_is_enforced_with_its_reason(name, f, tp):
    from bert_packed.config import check_section

    meta = f.metadata
    is_list = isinstance(getattr(Config().sections[name], f.name), list)
    limit = meta.get("le", meta.get("lt"))
    at_limit = limit if "le" in meta else (limit - 1 if tp is int else limit * (1 - 1e-9))
    above = limit + 1 if tp is int else (limit * 2 if limit else 1.0)
    config = Config()
    obj = config.sections[name]
    setattr(obj, f.name, [at_limit] if is_list else at_limit)
    check_section(name, obj)  # the maximum itself is allowed
    setattr(obj, f.name, [above] if is_list else above)
    with pytest.raises(ConfigError) as info:
        check_section(name, obj)
    message = str(info.value)
    key = f"{name}.{f.name}[0]" if is_list else f"{name}.{f.name}"
    assert message.startswith(f"{key} must be ") and message.endswith(f", got {above}")
    if meta.get("why"):
        assert f"({meta['why']})" in message


@pytest.mark.parametrize("meta, value, ok, message", [
    # A sanity maximum names only the side violated, with its reason (and not the hint).
    ({"ge": 1, "le": 10, "why": "ten is plenty"}, 11, 10, "k must be <= 10 (ten is plenty), got 11"),
    ({"ge": 1, "le": 10, "why": "ten is plenty"}, 0, 1, "k must be >= 1, got 0"),
    ({"ge": 1.0, "le": 127, "why": "int8", "hint": "(per pack)"}, 1000.0, 1.5, "k must be <= 127 (int8), got 1000.0"),
    # A domain interval is shown whole.
    ({"ge": 0.0, "lt": 1.0}, 1.0, 0.0, "k must be in [0, 1), got 1.0"),
    ({"gt": 0.0, "le": 65504.0, "why": "fp16"}, 1e30, 65504.0, "k must be <= 65504 (fp16), got 1e+30"),
    ({"ge": 0, "hint": "(0 = off)"}, -1, 0, "k must be >= 0 (0 = off), got -1"),
])
def test_bound_messages(meta, value, ok, message):
    from bert_packed.limits import bound_message

    assert bound_message("k", value, meta) == message
    assert bound_message("k", ok, meta) is None
