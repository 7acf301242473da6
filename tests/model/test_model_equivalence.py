"""Packed == unpacked: the promise of the papers, checked on a tiny fp32 model with dropout off.

For packs of 1..16 sequences with random lengths at S = 128 and S = 512:
hidden states per sequence, MLM/NSP losses and accuracies (both normalisations), every
parameter gradient, one LAMB step, gradient accumulation over micro-batches with
different sequence counts, and isolation between the sequences of a pack.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bert_packed.model.losses import add_step_normalizers
from bert_packed.model.modeling import BertModel
from bert_packed.tasks.pretraining.model import BertForPreTraining
from bert_packed.optim import Lamb, parameter_groups
from test_model_fixtures import packed_and_unpacked, random_packed_problem, tiny_config

MAX_PREDICTIONS = 20  # masked tokens per unpacked sequence (the generator masks 15 %, capped)
K = 16

SHAPES = [pytest.param(128, 8, id="S128"), pytest.param(512, 4, id="S512")]


def problem(S, num_packs, seed=0):
    """Packed and unpacked batches of the same sequences; M = (max masked per sequence) x K is ample."""
    samples, assignment = random_packed_problem(
        seed, num_packs=num_packs, max_sequence_length=S, max_sequences_per_pack=K, max_predictions=MAX_PREDICTIONS
    )
    packed, unpacked = packed_and_unpacked(
        samples,
        assignment,
        max_sequence_length=S,
        max_sequences_per_pack=K,
        max_masked_tokens_per_pack=masked_slots(samples, assignment),
        max_predictions=MAX_PREDICTIONS,
    )
    return samples, assignment, packed, unpacked


def masked_slots(samples, assignment):
    valid = (samples["masked_lm_positions"] > 0).sum(axis=1)[assignment.sequence_indices]
    per_pack = np.add.reduceat(valid, assignment.pack_offsets[:-1]) if len(valid) else np.zeros(1)
    return int(per_pack.max()) + 3  # some unused slots too


def sequence_spans(packed):
    """(pack, start, length) of every sequence in pack order (the unpacked row order)."""
    spans = []
    sequence_ids = packed["sequence_ids"].numpy()
    for b in range(sequence_ids.shape[0]):
        for k in range(1, K + 1):
            where = np.flatnonzero(sequence_ids[b] == k)
            if len(where):
                spans.append((b, int(where[0]), len(where)))
    return spans


def model_inputs(batch):
    return {k: batch[k] for k in ("input_ids", "segment_ids", "position_ids", "sequence_ids")}


def gradients(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_gradients_close(actual, expected, rtol=1e-5):
    assert actual.keys() == expected.keys()
    for name in expected:
        scale = expected[name].norm().item()
        error = (actual[name] - expected[name]).norm().item()
        # The absolute term covers gradients that are 0 in exact arithmetic (attention key
        # biases: softmax is shift-invariant), where only rounding noise (~1e-12) remains.
        assert error <= rtol * scale + 1e-9, f"{name}: relative gradient error {error / max(scale, 1e-30):.2e}"


# ----------------------------------------------------------------------------- hidden states


@pytest.mark.parametrize("attention", ["dense", "bucketed"])
@pytest.mark.parametrize("S, num_packs", SHAPES)
def test_hidden_states_in_a_pack_equal_the_sequence_alone(S, num_packs, attention):
    torch.manual_seed(0)
    _, _, packed, unpacked = problem(S, num_packs)
    model = BertModel(tiny_config(attention_implementation=attention)).eval()
    with torch.no_grad():
        packed_out = model(**model_inputs(packed))
        alone_out = model(**model_inputs(unpacked))
    spans = sequence_spans(packed)
    assert len(spans) == unpacked["input_ids"].shape[0]
    assert max(np.bincount([b for b, _, _ in spans])) > 1, "no pack with several sequences: weak test"
    worst = 0.0
    for i, (b, start, length) in enumerate(spans):
        diff = (packed_out[b, start : start + length] - alone_out[i, :length]).abs().max().item()
        worst = max(worst, diff)
    assert worst <= 1e-5, f"max abs difference {worst:.2e}"


# ----------------------------------------------------------------------------- losses, gradients, LAMB


def with_some_correct_labels(model, packed, unpacked):
    """Relabel about half the masked tokens / NSP labels with the model's own prediction, so
    accuracies are far from 0 and mistakes in counting them show up. Done identically in
    both layouts (the unpacked prediction, moved to the packed slots)."""
    with torch.no_grad():
        out = model(**unpacked)
    rng = np.random.default_rng(1)
    mlm_pred = out["mlm_logits"].argmax(-1)
    nsp_pred = out["nsp_logits"].argmax(-1)
    flip = torch.from_numpy(rng.random(mlm_pred.shape) < 0.5)
    unpacked["mlm_labels"] = torch.where(flip, mlm_pred, unpacked["mlm_labels"])
    flip_nsp = torch.from_numpy(rng.random(nsp_pred.shape) < 0.5)
    unpacked["nsp_labels"] = torch.where(flip_nsp, nsp_pred, unpacked["nsp_labels"])
    # Move labels to the packed layout: sequence i of the unpacked batch is (pack, slot) in order.
    packed["mlm_labels"] = packed["mlm_labels"].clone()
    packed["nsp_labels"] = packed["nsp_labels"].clone()
    i = 0
    for b in range(packed["input_ids"].shape[0]):
        for k in range(1, K + 1):
            slots = (packed["mlm_sequence_ids"][b] == k).nonzero()[:, 0]
            if packed["nsp_weights"][b, k - 1] == 0:
                continue
            n = int((unpacked["mlm_sequence_ids"][i] == 1).sum())
            packed["mlm_labels"][b, slots] = unpacked["mlm_labels"][i, :n]
            packed["nsp_labels"][b, k - 1] = unpacked["nsp_labels"][i, 0]
            i += 1
    assert i == unpacked["input_ids"].shape[0]


METRICS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "num_sequences", "num_mlm_tokens", "num_mlm_correct", "num_nsp_correct")


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("S, num_packs", SHAPES)
def test_losses_metrics_gradients_and_lamb_step_equal(S, num_packs, normalization):
    torch.manual_seed(0)
    _, _, packed, unpacked = problem(S, num_packs, seed=2)
    model = BertForPreTraining(tiny_config(mlm_loss_normalization=normalization))
    with_some_correct_labels(model, packed, unpacked)

    results = {}
    for name, batch in (("packed", packed), ("unpacked", unpacked)):
        trained = copy.deepcopy(model)
        out = trained(**batch)
        out["loss"].backward()
        grads = gradients(trained)
        optimizer = Lamb(parameter_groups(trained, weight_decay=0.01), lr=1e-3, eps=1e-6)
        optimizer.step()
        results[name] = (out, grads, dict(trained.named_parameters()))

    out_p, grads_p, weights_p = results["packed"]
    out_u, grads_u, weights_u = results["unpacked"]
    assert 0.2 < out_u["mlm_accuracy"].item() < 0.8 and 0.2 < out_u["nsp_accuracy"].item() < 0.9
    for key in METRICS:
        assert abs(out_p[key].item() - out_u[key].item()) <= 1e-5 * max(1.0, abs(out_u[key].item())), key
    assert_gradients_close(grads_p, grads_u)
    for name in weights_u:
        diff = (weights_p[name] - weights_u[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: weights differ by {diff:.2e} after one LAMB step"


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_gradient_accumulation_over_packed_micro_batches_equals_the_unpacked_step(normalization):
    """Three packed micro-batches with different sequence counts, normalised by the step's
    global counts and summed == one unpacked batch of all the sequences."""
    torch.manual_seed(0)
    S = 128
    _, _, packed, unpacked = problem(S, 9, seed=3)
    model = BertForPreTraining(tiny_config(mlm_loss_normalization=normalization))

    splits = [(0, 2), (2, 7), (7, 9)]  # 2, 5 and 2 packs
    micro_batches = [{k: v[a:b] for k, v in packed.items()} for a, b in splits]
    counts = [int(mb["nsp_weights"].sum()) for mb in micro_batches]
    assert len(set(counts)) == len(counts), f"micro-batches should differ in sequence count, got {counts}"
    add_step_normalizers(micro_batches, normalization)

    accumulated = copy.deepcopy(model)
    totals = {key: 0.0 for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")}
    for mb in micro_batches:
        out = accumulated(**mb)
        out["loss"].backward()  # gradients add up across micro-batches
        for key in totals:
            totals[key] += out[key].item()

    reference = copy.deepcopy(model)
    out_u = reference(**unpacked)
    out_u["loss"].backward()
    for key in totals:
        assert abs(totals[key] - out_u[key].item()) <= 1e-5, key
    assert_gradients_close(gradients(accumulated), gradients(reference))

    # The unpacked step may itself be accumulated in uneven micro-batches: same gradient.
    split_reference = copy.deepcopy(model)
    unpacked_micro = [{k: v[a:b] for k, v in unpacked.items()} for a, b in ((0, 5), (5, unpacked["input_ids"].shape[0]))]
    add_step_normalizers(unpacked_micro, normalization)
    for mb in unpacked_micro:
        split_reference(**mb)["loss"].backward()
    assert_gradients_close(gradients(split_reference), gradients(reference))


# ----------------------------------------------------------------------------- isolation


@pytest.mark.parametrize("attention", ["dense", "sdpa", "bucketed"])
@pytest.mark.parametrize("S, num_packs", SHAPES)
def test_changing_one_sequence_leaves_the_others_bit_identical(S, num_packs, attention):
    torch.manual_seed(0)
    _, _, packed, _ = problem(S, num_packs, seed=4)
    model = BertForPreTraining(tiny_config(attention_implementation=attention)).eval()
    rng = np.random.default_rng(5)
    with torch.no_grad():
        base = model(**packed)
        hidden = model.bert(**model_inputs(packed))
    spans = sequence_spans(packed)
    checked = 0
    for b in range(packed["input_ids"].shape[0]):
        pack_spans = [(start, length) for pb, start, length in spans if pb == b]
        if len(pack_spans) < 2:
            continue
        victim = int(rng.integers(len(pack_spans)))
        start, length = pack_spans[victim]
        changed = {k: v.clone() for k, v in packed.items()}
        token = start + int(rng.integers(length))  # any token of the sequence, [CLS] included
        changed["input_ids"][b, token] = (changed["input_ids"][b, token] + 7) % 99
        with torch.no_grad():
            out = model(**changed)
            hidden_changed = model.bert(**model_inputs(changed))
        victim_id = victim + 1
        others = (packed["sequence_ids"][b] != victim_id) & (packed["sequence_ids"][b] != 0)
        assert not torch.equal(hidden_changed[b, start : start + length], hidden[b, start : start + length])
        assert torch.equal(hidden_changed[b][others], hidden[b][others])
        other_slots = (packed["mlm_sequence_ids"][b] != victim_id) & (packed["mlm_sequence_ids"][b] != 0)
        assert torch.equal(out["mlm_logits"][b][other_slots], base["mlm_logits"][b][other_slots])
        other_sequences = (torch.arange(1, K + 1) != victim_id) & (packed["nsp_weights"][b] > 0)
        assert torch.equal(out["nsp_logits"][b][other_sequences], base["nsp_logits"][b][other_sequences])
        # Other packs of the batch are untouched too.
        rest = torch.arange(packed["input_ids"].shape[0]) != b
        assert torch.equal(hidden_changed[rest], hidden[rest])
        checked += 1
    assert checked >= 2
