"""Config system: precedence, rejection of unknown keys / wrong types, validation, CLI."""
import os
import subprocess
import sys

import pytest

from backends import get_backend_class
from bert_packed.config import (CONFIG_DIR, Config, ConfigError, dump, gradient_accumulation, load_config,
                                resolve_config_path, validate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert validate(config, get_backend_class("cuda")) == []
    assert validate(load_config("phase2"), get_backend_class("cpu")) == []  # its YAML ipu section is not nagged about


def test_dump_round_trips(tmp_path):
    config = load_config("phase2", ["train.steps=11"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump(config))
    again = load_config(str(path))
    assert again.to_dict() == config.to_dict()


def test_cli_prints_resolved_config_and_rejects_bad_ones():
    run = lambda *args: subprocess.run([sys.executable, "-m", "bert_packed.config", *args], cwd=ROOT,
                                       capture_output=True, text=True)
    ok = run("phase2", "--set", "train.steps=5")
    assert ok.returncode == 0, ok.stderr
    assert "layers_per_ipu: [3, 7, 7, 7]" in ok.stdout and "steps: 5" in ok.stdout
    bad = run("phase2", "--set", "train.nope=1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: --set: unknown key train.nope")
