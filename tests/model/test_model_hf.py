"""Hugging Face parity: same parameter names/shapes, same logits and losses, packed == HF per sequence."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from bert_packed.tasks.classification.model import BertForSequenceClassification  # noqa: E402
from bert_packed.model.modeling import BertConfig
from bert_packed.tasks.pretraining.model import BertForPreTraining  # noqa: E402
from test_model_fixtures import packed_and_unpacked, random_packed_problem, tiny_config  # noqa: E402

MAX_PREDICTIONS = 20


def hf_pair(config: BertConfig, cls=None, seed=0):
    """A randomly initialised transformers model and ours loaded from its state dict."""
    torch.manual_seed(seed)
    hf_cls = cls or transformers.BertForPreTraining
    hf_config = transformers.BertConfig(**config.to_hf_dict(), attn_implementation="eager")
    hf = hf_cls(hf_config).eval()
    ours = (BertForPreTraining if hf_cls is transformers.BertForPreTraining else BertForSequenceClassification)(config).eval()
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def test_parameter_names_and_shapes_match_transformers():
    config = tiny_config()
    hf = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf_dict()))
    ours = BertForPreTraining(config)
    buffers = {name for name, _ in hf.named_buffers()}
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k not in buffers}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert our_shapes == hf_shapes
    # Decoder tied to the word embeddings (one tensor), decoder bias == predictions.bias.
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias


def test_export_loads_back_into_transformers():
    config = tiny_config()
    torch.manual_seed(3)
    ours = BertForPreTraining(config)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf_dict()))
    result = hf.load_state_dict(ours.hf_state_dict(), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {name for name, _ in hf.named_buffers()}
    for name, value in ours.hf_state_dict().items():
        assert torch.equal(hf.state_dict()[name], value), name


def _hf_inputs(unpacked):
    """HF inputs for the unpacked batch: padding mask, MLM labels (-100 off the masked positions)."""
    input_ids = unpacked["input_ids"]
    attention_mask = (unpacked["sequence_ids"] > 0).long()
    labels = torch.full_like(input_ids, -100)
    valid = unpacked["mlm_sequence_ids"] > 0
    rows = torch.arange(input_ids.shape[0])[:, None].expand_as(valid)
    labels[rows[valid], unpacked["mlm_positions"][valid]] = unpacked["mlm_labels"][valid]
    return dict(
        input_ids=input_ids,
        token_type_ids=unpacked["segment_ids"],
        attention_mask=attention_mask,
        labels=labels,
        next_sentence_label=unpacked["nsp_labels"][:, 0],
    )


@pytest.mark.parametrize("attention", ["dense", "bucketed"])
@pytest.mark.parametrize("S, num_packs", [(128, 6), (512, 3)])
def test_logits_and_loss_match_transformers_unpacked_and_packed(S, num_packs, attention):
    config = tiny_config(attention_implementation=attention)
    hf, ours = hf_pair(config)
    samples, assignment = random_packed_problem(7, num_packs=num_packs, max_sequence_length=S, max_sequences_per_pack=16, max_predictions=MAX_PREDICTIONS)
    packed, unpacked = packed_and_unpacked(
        samples, assignment, max_sequence_length=S, max_sequences_per_pack=16, max_masked_tokens_per_pack=150, max_predictions=MAX_PREDICTIONS
    )
    with torch.no_grad():
        reference = hf(**_hf_inputs(unpacked))
        alone = ours(**unpacked)
        together = ours(**packed)

    valid = unpacked["mlm_sequence_ids"] > 0
    hf_mlm = torch.gather(reference.prediction_logits, 1, unpacked["mlm_positions"][:, :, None].expand(-1, -1, config.vocab_size))
    assert (alone["mlm_logits"][valid] - hf_mlm[valid]).abs().max().item() <= 1e-5
    assert (alone["nsp_logits"][:, 0] - reference.seq_relationship_logits).abs().max().item() <= 1e-5
    # HF's loss is token-normalised MLM + mean NSP: ours with token normalisation.
    assert abs(alone["loss"].item() - reference.loss.item()) <= 1e-5

    # Packed: every sequence's logits equal HF's on that sequence alone.
    packed_valid = packed["mlm_sequence_ids"] > 0
    # Used masked slots, read pack by pack, come in the same order as the unpacked rows' slots.
    assert (together["mlm_logits"][packed_valid] - hf_mlm[valid]).abs().max().item() <= 1e-5
    present = packed["nsp_weights"] > 0
    assert (together["nsp_logits"][present] - reference.seq_relationship_logits).abs().max().item() <= 1e-5
    assert abs(together["loss"].item() - reference.loss.item()) <= 1e-5


def test_sequence_classification_matches_transformers_per_sequence():
    config = tiny_config(num_labels=3)
    hf, ours = hf_pair(config, cls=transformers.BertForSequenceClassification)
    samples, assignment = random_packed_problem(8, num_packs=5, max_sequence_length=128, max_sequences_per_pack=16)
    packed, unpacked = packed_and_unpacked(
        samples, assignment, max_sequence_length=128, max_sequences_per_pack=16, max_masked_tokens_per_pack=150, max_predictions=MAX_PREDICTIONS
    )
    rng = np.random.default_rng(0)
    num_sequences = unpacked["input_ids"].shape[0]
    labels = torch.from_numpy(rng.integers(0, 3, num_sequences))
    present = packed["nsp_weights"] > 0
    packed_labels = torch.zeros_like(packed["nsp_labels"])
    packed_labels[present] = labels  # present slots in pack order == unpacked row order
    fields = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions")
    with torch.no_grad():
        reference = hf(
            input_ids=unpacked["input_ids"],
            token_type_ids=unpacked["segment_ids"],
            attention_mask=(unpacked["sequence_ids"] > 0).long(),
            labels=labels,
        )
        out = ours(**{k: packed[k] for k in fields}, labels=packed_labels, label_weights=packed["nsp_weights"])
    assert (out["logits"][present] - reference.logits).abs().max().item() <= 1e-5
    assert abs(out["loss"].item() - reference.loss.item()) <= 1e-5
    expected_accuracy = (reference.logits.argmax(-1) == labels).float().mean().item()
    assert abs(out["accuracy"].item() - expected_accuracy) <= 1e-6
    assert out["num_sequences"].item() == num_sequences


def test_config_round_trips_through_transformers():
    config = tiny_config(hidden_act="gelu_new", layer_norm_eps=1e-3)
    hf_config = transformers.BertConfig(**config.to_hf_dict())
    back = BertConfig.from_hf(hf_config, max_sequences_per_pack=16, max_masked_tokens_per_pack=100)
    assert back == config


def test_old_checkpoint_names_and_bare_encoder_load():
    config = tiny_config()
    hf, ours = hf_pair(config, seed=5)
    old_style = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in hf.state_dict().items()}
    fresh = BertForPreTraining(config)
    fresh.load_hf_state_dict(old_style)
    for name, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    from bert_packed.model.modeling import BertModel

    encoder = BertModel(config)
    result = encoder.load_hf_state_dict(hf.state_dict(), strict=False)
    assert not result.missing_keys  # every encoder weight found under "bert."
    assert torch.equal(encoder.embeddings.word_embeddings.weight, hf.bert.embeddings.word_embeddings.weight)
