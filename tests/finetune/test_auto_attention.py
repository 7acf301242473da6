"""``model.attention_implementation: auto`` (the fine-tuning configs): each backend resolves it
once, at validation, to what it runs best; a model built without validation gets ``dense``."""
import pytest

from backends import get_backend_class
from bert_packed.model.build import bert_config
from bert_packed.config import load_config, resolve_run

AUTO_CONFIGS = ["finetune_classification", "finetune_token_classification", "finetune_glue_base"]


@pytest.mark.parametrize("name", AUTO_CONFIGS)
@pytest.mark.parametrize("backend,overrides,expected", [
    ("cpu", [], "bucketed"),
    ("cpu", ["cpu.compile=true"], "dense"),
    ("cuda", ["cuda.device=cpu"], "dense"),
    ("mock", [], "dense"),
])
def test_each_backend_resolves_auto_once_at_validation(name, backend, overrides, expected):
    config = load_config(name, overrides)
    assert config.model.attention_implementation == "auto"
    config = resolve_run(config, get_backend_class(backend)).config
    assert config.model.attention_implementation == expected
    assert config.to_dict()["model"]["attention_implementation"] == expected  # config.yaml names it
    assert bert_config(config).attention_implementation == expected


def test_one_config_validated_for_two_backends_resolves_for_each():
    """The shipped-config test validates one config object for cpu, then mock: auto must not
    carry the CPU's choice to the IPU's refusal."""
    config = load_config("finetune_classification")
    for backend, expected in (("cpu", "bucketed"), ("mock", "dense"), ("cpu", "bucketed")):
        resolved = resolve_run(config, get_backend_class(backend)).config
        assert resolved.model.attention_implementation == expected, backend


def test_a_named_implementation_is_kept_and_auto_without_a_backend_is_dense():
    config = load_config("finetune_classification", ["model.attention_implementation=sdpa"])
    config = resolve_run(config, get_backend_class("cpu")).config
    assert config.model.attention_implementation == "sdpa"
    assert bert_config(load_config("finetune_classification")).attention_implementation == "dense"


def test_the_pretraining_and_squad_configs_keep_dense():
    for name in ("phase1", "demo", "finetune_squad"):  # phase2 asks for auto: tests/backends/test_cuda_defaults.py
        config = load_config(name)
        config = resolve_run(config, get_backend_class("cpu")).config
        assert config.model.attention_implementation == "dense", name


def test_a_misspelt_auto_is_one_line_naming_the_choices():
    from bert_packed.errors import ConfigError

    config = load_config("finetune_classification", ["model.attention_implementation=atuo"])
    with pytest.raises(ConfigError) as info:
        bert_config(config)
    assert "'atuo'" in str(info.value) and "or auto (the backend chooses)" in str(info.value)
    assert "\n" not in str(info.value)
