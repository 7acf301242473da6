"""Model configuration: validation with one-line errors, dict round trips, profiler scopes."""
from __future__ import annotations

import pytest
import torch

from bert_packed.model.attention import set_profiler_scopes
from bert_packed.model.modeling import BertConfig, ModelConfigError
from bert_packed.tasks.pretraining.model import BertForPreTraining
from test_model_fixtures import packed_and_unpacked, random_packed_problem, tiny_config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=30, num_attention_heads=4), "not divisible"),
        (dict(mlm_loss_normalization="pack"), "mlm_loss_normalization"),
        (dict(hidden_act="swish"), "hidden_act"),
        (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
        (dict(max_sequences_per_pack=0), "max_sequences_per_pack"),
        (dict(num_hidden_layers=2.5), "num_hidden_layers"),
        (dict(attention_implementation="magic"), "magic"),
    ],
)
def test_bad_config_values_are_one_line_errors(overrides, message):
    with pytest.raises(ModelConfigError, match=message) as error:
        tiny_config(**overrides)
    assert "\n" not in str(error.value)


def test_dict_round_trip_and_unknown_keys():
    config = tiny_config(mlm_loss_normalization="sequence")
    assert BertConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ModelConfigError, match="unknown field"):
        BertConfig.from_dict({**config.to_dict(), "hidden_layers": 3})


def _scopes(model, batch):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(**batch)["loss"].backward()
    return {event.key for event in prof.key_averages() if event.key.startswith("packing/")}


def test_packing_work_is_labelled_with_profiler_scopes_and_can_be_switched_off():
    samples, assignment = random_packed_problem(0, num_packs=2, max_sequence_length=64, max_sequences_per_pack=4)
    packed, _ = packed_and_unpacked(samples, assignment, max_sequence_length=64, max_sequences_per_pack=4, max_masked_tokens_per_pack=40, max_predictions=20)
    model = BertForPreTraining(tiny_config())
    assert _scopes(model, packed) == {"packing/mask", "packing/attention", "packing/loss_unpacking"}
    set_profiler_scopes(False)
    try:
        assert _scopes(model, packed) == set()
    finally:
        set_profiler_scopes(True)


# -- one source for the model's rules (issue 48): the model section's declarations drive BertConfig's checks


def _below_minimum(meta):
    """A value under the declared minimum (None when the field declares none)."""
    if meta.get("ge") is not None:
        return meta["ge"] - 1 if isinstance(meta["ge"], int) else meta["ge"] - 0.5
    if meta.get("gt") is not None:
        return meta["gt"] - (1 if isinstance(meta["gt"], int) else 0.5)
    return None


def test_every_declared_minimum_of_the_model_section_is_bert_configs():
    """A value the model section's declaration refuses, BertConfig refuses too, naming the field:
    the rule is the declaration's, not a second copy (layer_norm_eps and initializer_range had none)."""
    import dataclasses

    from bert_packed.config import ModelConfig

    names = {f.name for f in dataclasses.fields(BertConfig)}
    checked = []
    for f in dataclasses.fields(ModelConfig):
        bad = _below_minimum(f.metadata)
        if f.name not in names or bad is None:
            continue
        with pytest.raises(ModelConfigError, match=rf"^model config: {f.name} must be "):
            tiny_config(**{f.name: bad})
        checked.append(f.name)
    assert {"vocab_size", "hidden_size", "layer_norm_eps", "initializer_range", "hidden_dropout_prob",
            "pad_token_id", "classifier_dropout"} <= set(checked)


def test_a_rule_declared_on_the_model_section_reaches_bert_config(monkeypatch):
    """Changing the declaration changes BertConfig's check: there is no copy to forget."""
    from bert_packed import config as config_module
    from bert_packed.model import modeling

    tiny_config(layer_norm_eps=0.5)
    rules = dict(config_module.model_rules())
    rules["layer_norm_eps"] = config_module.limits.value_rule(float, {"ge": 0.0, "lt": 0.25})
    monkeypatch.setattr(modeling, "_FIELD_RULES", {})
    monkeypatch.setattr(modeling, "model_rules", lambda: rules)
    with pytest.raises(ModelConfigError, match=r"layer_norm_eps must be a number in \[0, 0.25\), got 0.5"):
        tiny_config(layer_norm_eps=0.5)


def test_sanity_maximums_stay_the_configs_and_meaningful_ones_are_everyones():
    """A maximum with a reason bounds a run's config (10^30 layers), not a model built in code or
    read from a checkpoint; a maximum that is the value's meaning (dropout < 1) bounds all."""
    from bert_packed.limits import HIDDEN

    wide = tiny_config(hidden_size=HIDDEN["le"] + 4, num_attention_heads=4, intermediate_size=8)
    assert wide.hidden_size > HIDDEN["le"]
    with pytest.raises(ModelConfigError, match=r"attention_probs_dropout_prob must be a number in \[0, 1\), got 1.0"):
        tiny_config(attention_probs_dropout_prob=1.0)


def test_the_shape_rules_are_one_function_for_the_config_and_the_model():
    from backends import get_backend_class
    from bert_packed.config import ConfigError, load_config, validate

    for overrides, fragment in ((["model.hidden_size=30", "model.num_attention_heads=4"],
                                 "hidden_size=30 is not divisible by {p}num_attention_heads=4; pick a head count "
                                 "that divides it"),
                                (["model.pad_token_id=300", "model.vocab_size=300"],
                                 "pad_token_id=300 is outside the vocabulary [0, 300) ({p}vocab_size)")):
        config = load_config("tiny", overrides)
        with pytest.raises(ConfigError) as in_config:
            validate(config, get_backend_class("cpu"))
        assert str(in_config.value) == "model." + fragment.format(p="model.")
        values = {k.split("=")[0][len("model."):]: int(k.split("=")[1]) for k in overrides}
        with pytest.raises(ModelConfigError) as in_model:
            tiny_config(**values)
        assert str(in_model.value) == "model config: " + fragment.format(p="")


def test_the_model_sections_loss_choices_are_the_losses():
    import dataclasses

    from bert_packed.config import ModelConfig
    from bert_packed.model.losses import MLM_LOSS_NORMALIZATIONS

    field = {f.name: f for f in dataclasses.fields(ModelConfig)}["mlm_loss_normalization"]
    assert tuple(field.metadata["choices"]) == tuple(MLM_LOSS_NORMALIZATIONS)
