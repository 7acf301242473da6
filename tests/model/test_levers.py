"""GPU levers of the model, checked on the CPU against the model without them (docs/cuda.md, "Levers"):

- ``fused_qkv``: one GEMM with the stacked Q/K/V weights computes what the three projections compute
  (outputs and gradients within fp32 rounding, LAMB's steps too), and Hugging Face checkpoints
  load and export unchanged;
- ``vocab_padding_multiple``: a padded vocabulary gives the same loss, logits and gradients on the
  real rows, its padding rows stay zero through training, and its export is the unpadded model's.
"""
from __future__ import annotations

import pytest
import torch

from bert_packed.model.modeling import BertConfig, ModelConfigError
from bert_packed.tasks.pretraining.model import BertForPreTraining
from bert_packed.optim import build_optimizer, grad_norm_, step_unless_non_finite
from test_model_fixtures import VOCAB_SIZE, packed_and_unpacked, random_packed_problem, tiny_config

# fp32 on the CPU: a fused GEMM or a wider decoder may add in another order (a few ulps of the
# loss's order of magnitude); anything structurally wrong differs by orders more.
TOL = 2e-5


def _batch(seed=7, S=128):
    samples, assignment = random_packed_problem(seed, num_packs=4, max_sequence_length=S, max_sequences_per_pack=16,
                                                max_predictions=20)
    packed, _ = packed_and_unpacked(samples, assignment, max_sequence_length=S, max_sequences_per_pack=16,
                                    max_masked_tokens_per_pack=100, max_predictions=20)
    return packed


def _pair(**lever):
    """(reference, with the lever) holding the same weights: the lever's model loads the reference's
    state dict (a lever changes shapes, so the same seed draws other weights)."""
    torch.manual_seed(0)
    reference = BertForPreTraining(tiny_config())
    model = BertForPreTraining(tiny_config(**lever))
    model.load_state_dict(reference.state_dict())
    return reference, model


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out["loss"].backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _as_reference(name, grads, config):
    """``grads`` of a lever model in the reference's names and shapes."""
    out = {}
    for key, grad in grads.items():
        if grad.shape[0] == config.padded_vocab_size != config.vocab_size:
            out[key] = grad[: config.vocab_size]
        else:
            out[key] = grad
    return out


def _assert_close_grads(reference_grads, lever_grads, config):
    lever_grads = _as_reference("", lever_grads, config)
    assert set(lever_grads) == set(reference_grads)
    for name, grad in reference_grads.items():
        scale = max(1.0, grad.abs().max().item())
        assert (lever_grads[name] - grad).abs().max().item() <= TOL * scale, name


# ----------------------------------------------------------------------------- fused QKV


def test_fused_qkv_runs_one_projection_gemm_instead_of_three():
    _, fused = _pair(fused_qkv=True)
    batch = _batch()
    for model, expected in ((BertForPreTraining(tiny_config()), 3), (fused, 1)):
        calls = []

        def count(module, args, kwargs=None):
            calls.append(1)

        hooks = []
        for layer in model.bert.encoder.layer:
            block = layer.attention.self
            hooks += [p.register_forward_pre_hook(count) for p in (block.query, block.key, block.value)]
        original = torch.nn.functional.linear
        linear_calls = []

        def linear(x, weight, *rest):
            if weight.shape[0] == 3 * 32:
                linear_calls.append(1)
            return original(x, weight, *rest)

        torch.nn.functional.linear = linear
        try:
            model(**batch)
        finally:
            torch.nn.functional.linear = original
            for hook in hooks:
                hook.remove()
        layers = len(model.bert.encoder.layer)
        assert (len(calls), len(linear_calls)) == ((3 * layers, 0) if expected == 3 else (0, layers))


@pytest.mark.parametrize("attention", ["dense", "sdpa", "bucketed"])
def test_fused_qkv_gives_the_same_outputs_and_gradients(attention):
    reference, fused = _pair(fused_qkv=True)
    for model in (reference, fused):
        model.config.attention_implementation = attention
    batch = _batch()
    ref_out, ref_grads = _loss_and_grads(reference, batch)
    out, grads = _loss_and_grads(fused, batch)
    assert abs(out["loss"].item() - ref_out["loss"].item()) <= TOL
    assert (out["mlm_logits"] - ref_out["mlm_logits"]).abs().max().item() <= TOL
    _assert_close_grads(ref_grads, grads, fused.config)


def test_fused_qkv_keeps_hugging_face_names_shapes_and_export():
    transformers = pytest.importorskip("transformers")
    config = tiny_config(fused_qkv=True)
    torch.manual_seed(1)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf_dict()))
    ours = BertForPreTraining(config)
    ours.load_hf_state_dict(hf.state_dict())
    buffers = {name for name, _ in hf.named_buffers()}
    expected = {k: v for k, v in hf.state_dict().items() if k not in buffers}
    exported = ours.hf_state_dict()
    assert list(exported) == list(expected)  # names and order
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name


def test_fused_qkv_trains_like_three_projections_with_lamb():
    # One trust ratio per projection as before: the parameters are still the three.
    reference, fused = _pair(fused_qkv=True)
    assert list(dict(fused.named_parameters())) == list(dict(reference.named_parameters()))
    optimizers = [build_optimizer(m, "lamb", lr=1e-2, weight_decay=0.01, max_weight_norm=None) for m in (reference, fused)]
    for step in range(3):
        batch = _batch(seed=step)
        for model, optimizer in zip((reference, fused), optimizers):
            _loss_and_grads(model, batch)
            _, found_inf = grad_norm_(model.parameters(), 1.0)
            step_unless_non_finite(optimizer, found_inf)
    moved = max((p - q).abs().max().item() for p, q in zip(reference.parameters(), _pair()[0].parameters()))
    assert moved > 1e-3
    # LAMB divides by sqrt(v) + eps, which magnifies a last-bit gradient difference where a
    # gradient is tiny; measured 1e-8 here.
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, name


def test_fused_qkv_round_trips_through_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from bert_packed.io import hf_io

    config = tiny_config(fused_qkv=True, vocab_padding_multiple=64)
    torch.manual_seed(2)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf_dict()))
    hf.save_pretrained(tmp_path / "in")
    ours = BertForPreTraining(config)
    summary = hf_io.load_weights(ours, hf_io.read_pretrained(str(tmp_path / "in")).state_dict, source="in")
    assert "newly initialised" not in summary and "not used" not in summary, summary
    hf_io.save_pretrained(ours, str(tmp_path / "out"))
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "out")
    for name, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    # Our own (padded) checkpoint passes the loader's completeness check too.
    hf_io.check_layers(config.num_hidden_layers, ours.state_dict(), "ours")


# ----------------------------------------------------------------------------- padded vocabulary


def test_padded_vocabulary_shapes_and_zero_padding():
    config = tiny_config(vocab_padding_multiple=64)
    assert config.vocab_size == VOCAB_SIZE and config.padded_vocab_size == 128
    model = BertForPreTraining(config)
    embeddings = model.bert.embeddings.word_embeddings.weight
    assert tuple(embeddings.shape) == (128, 32)
    assert model.cls.predictions.decoder.weight is embeddings  # still tied
    assert not embeddings[VOCAB_SIZE:].any() and not model.cls.predictions.bias[VOCAB_SIZE:].any()
    assert tiny_config(vocab_padding_multiple=1).padded_vocab_size == VOCAB_SIZE
    assert tiny_config(vocab_padding_multiple=33).padded_vocab_size == 99  # already a multiple


def test_padded_vocabulary_gives_the_same_loss_and_gradients():
    reference, padded = _pair(vocab_padding_multiple=64)
    batch = _batch()
    ref_out, ref_grads = _loss_and_grads(reference, batch)
    out, grads = _loss_and_grads(padded, batch)
    assert out["mlm_logits"].shape == ref_out["mlm_logits"].shape  # padding's logits are cut
    assert abs(out["loss"].item() - ref_out["loss"].item()) <= TOL
    assert out["mlm_accuracy"].item() == ref_out["mlm_accuracy"].item()
    assert (out["mlm_logits"] - ref_out["mlm_logits"]).abs().max().item() <= TOL
    _assert_close_grads(ref_grads, grads, padded.config)
    # Nothing reaches the padding rows.
    assert not grads["bert.embeddings.word_embeddings.weight"][VOCAB_SIZE:].any()
    assert not grads["cls.predictions.bias"][VOCAB_SIZE:].any()


def test_padded_vocabulary_trains_like_the_unpadded_one_and_exports_it():
    reference, padded = _pair(vocab_padding_multiple=64)
    optimizers = [build_optimizer(m, "lamb", lr=1e-2, weight_decay=0.01, max_weight_norm=None) for m in (reference, padded)]
    for step in range(3):
        batch = _batch(seed=step)
        for model, optimizer in zip((reference, padded), optimizers):
            _loss_and_grads(model, batch)
            _, found_inf = grad_norm_(model.parameters(), 1.0)
            step_unless_non_finite(optimizer, found_inf)
    assert not padded.bert.embeddings.word_embeddings.weight[VOCAB_SIZE:].any()  # padding rows stay zero
    exported, expected = padded.hf_state_dict(), reference.hf_state_dict()
    assert list(exported) == list(expected)
    for name, value in expected.items():
        assert exported[name].shape == value.shape, name
        # Measured 5e-10 (a wider decoder GEMM may round its sums differently); LAMB's division by
        # sqrt(v) + eps can magnify a last-bit gradient difference where the gradient is tiny.
        assert (exported[name] - value).abs().max().item() <= 1e-6, name
    # A padded checkpoint loads into an unpadded model and back (its padding rows are zero).
    unpadded = BertForPreTraining(tiny_config())
    unpadded.load_state_dict(padded.state_dict())
    again = BertForPreTraining(tiny_config(vocab_padding_multiple=64))
    again.load_state_dict(unpadded.state_dict())
    assert all(torch.equal(again.state_dict()[k], v) for k, v in padded.state_dict().items())


def test_a_checkpoint_with_nonzero_rows_past_the_vocabulary_is_not_cut_silently():
    padded = BertForPreTraining(tiny_config(vocab_padding_multiple=64))
    state = padded.state_dict()
    state["bert.embeddings.word_embeddings.weight"] = state["bert.embeddings.word_embeddings.weight"].clone()
    state["bert.embeddings.word_embeddings.weight"][-1] = 1.0  # a real row, not padding
    with pytest.raises(RuntimeError, match="size mismatch"):
        BertForPreTraining(tiny_config()).load_state_dict(state)


@pytest.mark.parametrize("multiple", [0, -64, 2.5, True])
def test_vocab_padding_multiple_must_be_a_positive_integer(multiple):
    with pytest.raises(ModelConfigError, match="vocab_padding_multiple must be a positive integer"):
        BertConfig(vocab_padding_multiple=multiple)
