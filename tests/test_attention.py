"""Attention registry: every implementation available here equals `dense`; clear errors otherwise."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bert_packed import attention
from bert_packed.attention import (
    AttentionError,
    AttentionImplementation,
    available_attention_implementations,
    block_diagonal_additive_mask,
    get_attention,
    list_attention_implementations,
    register_attention,
)
from bert_packed.modeling import BertForPreTraining, ModelConfigError
from test_model_fixtures import packed_and_unpacked, random_packed_problem, tiny_config


def packed_sequence_ids(seed: int, batch_size: int, S: int, K: int) -> torch.Tensor:
    """Random [B, S] sequence ids: 1..K contiguous runs then padding."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch_size, S), dtype=np.int64)
    for b in range(batch_size):
        k = int(rng.integers(1, K + 1))
        used = int(rng.integers(2 * k, S + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), k - 1, replace=False)) if k > 1 else np.array([], dtype=np.int64)
        edges = np.concatenate([[0], cuts, [used]])
        for j in range(k):
            ids[b, edges[j] : edges[j + 1]] = j + 1
    return torch.from_numpy(ids)


def reference_attention(query, key, value, sequence_ids):
    """Independent reference: per (pack, sequence) plain softmax attention over that sequence only."""
    out = torch.zeros_like(query)
    for b in range(query.shape[0]):
        for k in sequence_ids[b].unique().tolist():
            if k == 0:
                continue
            idx = (sequence_ids[b] == k).nonzero()[:, 0]
            q, kk, v = query[b][:, idx], key[b][:, idx], value[b][:, idx]
            probs = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
            out[b][:, idx] = probs @ v
    return out


@pytest.mark.parametrize("S", [128, 512])
def test_dense_equals_per_sequence_reference(S):
    torch.manual_seed(0)
    sequence_ids = packed_sequence_ids(0, 3, S, 16)
    q, k, v = (torch.randn(3, 2, S, 8) for _ in range(3))
    impl = get_attention("dense")
    out = impl.attend(q, k, v, impl.prepare(sequence_ids, dtype=torch.float32), dropout_p=0.0, training=False)
    real = sequence_ids > 0
    expected = reference_attention(q, k, v, sequence_ids)
    assert (out.transpose(1, 2)[real] - expected.transpose(1, 2)[real]).abs().max().item() <= 1e-5
    assert torch.isfinite(out).all()  # padding rows too: no NaN to leak into the next layer


@pytest.mark.parametrize("S", [128, 512])
def test_every_available_implementation_equals_dense(S):
    torch.manual_seed(1)
    sequence_ids = packed_sequence_ids(1, 3, S, 16)
    q, k, v = (torch.randn(3, 2, S, 16) for _ in range(3))
    dense = get_attention("dense")
    expected = dense.attend(q, k, v, dense.prepare(sequence_ids, dtype=torch.float32), dropout_p=0.0, training=False)
    names = available_attention_implementations(torch.device("cpu"), needs_grad=False)
    assert {"dense", "sdpa"} <= set(names)
    real = sequence_ids > 0
    for name in names:
        impl = get_attention(name)
        with torch.no_grad():
            out = impl.attend(q, k, v, impl.prepare(sequence_ids, dtype=torch.float32), dropout_p=0.0, training=False)
        diff = (out.transpose(1, 2)[real] - expected.transpose(1, 2)[real]).abs().max().item()
        assert diff <= 1e-5, f"{name}: {diff:.2e}"


def test_every_available_implementation_gives_the_dense_model_outputs_and_gradients():
    samples, assignment = random_packed_problem(3, num_packs=4, max_sequence_length=128, max_sequences_per_pack=16)
    packed, _ = packed_and_unpacked(
        samples, assignment, max_sequence_length=128, max_sequences_per_pack=16, max_masked_tokens_per_pack=100, max_predictions=20
    )
    torch.manual_seed(2)
    reference_model = BertForPreTraining(tiny_config())
    reference = reference_model(**packed)
    reference["loss"].backward()
    for name in available_attention_implementations(torch.device("cpu"), needs_grad=False):
        model = BertForPreTraining(tiny_config(attention_implementation=name))
        model.load_state_dict(reference_model.state_dict())
        grad_ok = name in available_attention_implementations(torch.device("cpu"), needs_grad=True)
        with torch.set_grad_enabled(grad_ok):
            out = model(**packed)
        assert (out["mlm_logits"] - reference["mlm_logits"]).abs().max().item() <= 1e-5, name
        assert (out["nsp_logits"] - reference["nsp_logits"]).abs().max().item() <= 1e-5, name
        if grad_ok:
            out["loss"].backward()
            for (pname, p), (_, p_ref) in zip(model.named_parameters(), reference_model.named_parameters()):
                error = (p.grad - p_ref.grad).norm().item()
                assert error <= 1e-5 * p_ref.grad.norm().item() + 1e-9, f"{name}: {pname}"  # key.bias: 0 in theory


def test_mask_allows_exactly_same_sequence_pairs():
    sequence_ids = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    mask = block_diagonal_additive_mask(sequence_ids, dtype=torch.float32)[:, 0]
    allowed = mask == 0
    same = (sequence_ids[:, :, None] == sequence_ids[:, None, :]) & (sequence_ids[:, None, :] > 0)
    assert torch.equal(allowed, same)
    assert torch.isfinite(mask).all() and (mask[~allowed] < -1e30).all()


def test_unknown_implementation_is_a_clear_error():
    with pytest.raises(AttentionError, match="unknown attention implementation 'nope'.*dense"):
        get_attention("nope")
    with pytest.raises(ModelConfigError, match="attention implementation 'nope'"):
        tiny_config(attention_implementation="nope")


def test_registered_implementation_is_used_and_checked():
    calls = []

    def refuse(*, device, dtype, dropout_p, needs_grad):
        calls.append(needs_grad)
        if needs_grad:
            raise AttentionError("test-only: no backward here; use dense")

    dense = get_attention("dense")
    register_attention("test_refusing", AttentionImplementation("test_refusing", dense.prepare, dense.attend, check=refuse))
    try:
        assert "test_refusing" in list_attention_implementations()
        assert "test_refusing" not in available_attention_implementations("cpu", needs_grad=True)
        assert "test_refusing" in available_attention_implementations("cpu", needs_grad=False)
        model = BertForPreTraining(tiny_config(attention_implementation="test_refusing"))
        samples, assignment = random_packed_problem(4, num_packs=2, max_sequence_length=32, max_sequences_per_pack=4)
        packed, _ = packed_and_unpacked(
            samples, assignment, max_sequence_length=32, max_sequences_per_pack=4, max_masked_tokens_per_pack=40, max_predictions=20
        )
        with torch.no_grad():
            model(**packed)
        with pytest.raises(AttentionError, match="no backward"):
            model(**packed)
        assert calls[-2:] == [False, True]
    finally:
        attention.ATTENTION_IMPLEMENTATIONS.pop("test_refusing", None)


def test_register_rejects_non_implementations():
    with pytest.raises(TypeError):
        register_attention("bad", lambda q, k, v: q)
