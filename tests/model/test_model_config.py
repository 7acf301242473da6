"""Model configuration: validation with one-line errors, dict round trips, profiler scopes."""
from __future__ import annotations

import pytest
import torch

from bert_packed.attention import set_profiler_scopes
from bert_packed.modeling import BertConfig, BertForPreTraining, ModelConfigError
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
