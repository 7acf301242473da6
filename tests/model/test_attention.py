"""Attention registry: every implementation available here equals `dense`; clear errors otherwise."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bert_packed.model import attention
from bert_packed.model.attention import (
    AttentionError,
    AttentionImplementation,
    available_attention_implementations,
    block_diagonal_additive_mask,
    get_attention,
    list_attention_implementations,
    register_attention,
)
from bert_packed.model.modeling import ModelConfigError
from bert_packed.tasks.pretraining.model import BertForPreTraining
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
    sequence_ids = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    mask = block_diagonal_additive_mask(sequence_ids, dtype=torch.float32)[:, 0]
    allowed = mask == 0
    real_query = (sequence_ids > 0)[:, :, None].expand_as(allowed)
    same = (sequence_ids[:, :, None] == sequence_ids[:, None, :]) & (sequence_ids[:, None, :] > 0)
    # Real tokens attend exactly to their own sequence (never to padding or another sequence).
    assert torch.equal(allowed[real_query], same[real_query])
    # Padding attends to the padding of its row only, so no query row is ever fully masked.
    assert torch.equal(allowed[~real_query], (sequence_ids[:, None, :] == 0).expand_as(allowed)[~real_query])
    assert allowed.any(dim=-1).all()
    assert torch.isfinite(mask).all() and (mask[~allowed] < -1e30).all()


# ----------------------------------------------------------------------------- precision of the mask

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_mask_is_finite_in_its_dtype_and_masks_completely(dtype):
    sequence_ids = packed_sequence_ids(3, 4, 64, 5)
    mask = block_diagonal_additive_mask(sequence_ids, dtype=dtype)
    assert mask.dtype == dtype
    assert torch.isfinite(mask).all(), "fp16's -inf would give NaN on fully masked rows in some kernels"
    # Headroom: a masked score stays finite after adding a large score, and exp of it after
    # the softmax's max-subtraction is exactly 0.
    masked = mask[mask != 0]
    assert torch.isfinite(masked + torch.tensor(-1000.0, dtype=dtype)).all()
    assert (torch.exp((masked - 1000.0).float()) == 0).all()


def _skip_without_cpu_kernels(dtype):
    try:  # torch 2.0 (the Poplar SDK's) has no fp16 matmul on CPU
        torch.ones(1, 2, 2, dtype=dtype) @ torch.ones(1, 2, 2, dtype=dtype)
    except RuntimeError:
        pytest.skip(f"torch {torch.__version__} has no CPU matmul in {dtype}")


def _autocast_or_skip(dtype):
    context = torch.autocast("cpu", dtype=dtype)
    try:
        context.__enter__()
    except RuntimeError:  # torch 2.0: CPU autocast is bf16 only
        pytest.skip(f"CPU autocast to {dtype} not supported by torch {torch.__version__}")
    if attention.attention_compute_dtype(torch.float32, torch.device("cpu")) != dtype:
        context.__exit__(None, None, None)
        pytest.skip(f"CPU autocast to {dtype} not supported by torch {torch.__version__}")
    return context


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["dense", "sdpa"])
def test_float_mask_takes_the_autocast_dtype(name, dtype):
    # The model passes the embeddings' dtype (fp32 under autocast); the scores are in the
    # autocast dtype, and so must the mask be (an fp32 mask cast to fp16 by autocast is -inf).
    sequence_ids = packed_sequence_ids(4, 2, 32, 3)
    impl = get_attention(name)
    assert impl.prepare(sequence_ids, dtype=torch.float32).dtype == torch.float32
    context = _autocast_or_skip(dtype)
    try:
        prepared = impl.prepare(sequence_ids, dtype=torch.float32)
        q, k, v = (torch.nn.functional.linear(torch.randn(2, 2, 32, 8), torch.randn(8, 8)) for _ in range(3))
        out = impl.attend(q, k, v, prepared, dropout_p=0.0, training=False)
    finally:
        context.__exit__(None, None, None)
    assert prepared.dtype == q.dtype == dtype
    assert torch.isfinite(prepared).all() and torch.isfinite(out).all()


def _cpu_implementations(needs_grad):
    return available_attention_implementations(torch.device("cpu"), needs_grad=needs_grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_padding_rows_give_finite_outputs_and_gradients_in_every_precision(dtype):
    """A pack with a fully padded row and rows ending in padding, through every implementation
    that runs on this CPU: every output (padding rows included) and every gradient is finite,
    and real tokens still equal the fp32 per-sequence reference."""
    _skip_without_cpu_kernels(dtype)
    torch.manual_seed(5)
    sequence_ids = packed_sequence_ids(5, 3, 64, 4)
    sequence_ids[1] = 0  # a row that is all padding: every key of every query is padding
    q32, k32, v32 = (torch.randn(3, 2, 64, 8) * 2 for _ in range(3))
    expected = reference_attention(q32, k32, v32, sequence_ids)
    real = sequence_ids > 0
    # Inputs x2: scores with std ~4. The tolerances are the low precisions' own rounding of such
    # scores (bf16 keeps 8 bits, fp16 11); a leak across sequences would be O(1).
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 0.2, torch.float16: 0.03}[dtype]
    trainable = set(_cpu_implementations(needs_grad=True))
    names = _cpu_implementations(needs_grad=False)
    assert {"dense", "sdpa"} <= set(names)
    for name in names:
        impl = get_attention(name)
        q, k, v = (t.to(dtype).requires_grad_(name in trainable) for t in (q32, k32, v32))
        with torch.set_grad_enabled(name in trainable):
            out = impl.attend(q, k, v, impl.prepare(sequence_ids, dtype=dtype), dropout_p=0.0, training=False)
        assert out.dtype == dtype and torch.isfinite(out).all(), f"{name} {dtype}: non-finite output"
        error = (out.float().transpose(1, 2)[real] - expected.transpose(1, 2)[real]).abs().max().item()
        assert error <= tolerance, f"{name} {dtype}: {error:.2e}"
        if name in trainable:
            out.float().square().sum().backward()
            for t in (q, k, v):
                assert torch.isfinite(t.grad).all(), f"{name} {dtype}: non-finite gradient"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["dense", "sdpa", "bucketed"])
def test_model_under_autocast_with_a_padding_row_has_finite_loss_and_gradients(name, dtype):
    samples, assignment = random_packed_problem(6, num_packs=3, max_sequence_length=64, max_sequences_per_pack=4)
    packed, _ = packed_and_unpacked(
        samples, assignment, max_sequence_length=64, max_sequences_per_pack=4, max_masked_tokens_per_pack=40, max_predictions=20
    )
    packed = {key: torch.cat([value, torch.zeros_like(value[:1])]) for key, value in packed.items()}  # + an empty row
    torch.manual_seed(6)
    model = BertForPreTraining(tiny_config(attention_implementation=name))
    context = _autocast_or_skip(dtype)
    try:
        out = model(**packed)
    finally:
        context.__exit__(None, None, None)
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


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


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_padding_rows_finite_on_gpu_kernels_under_autocast(dtype):
    """The GPU kernels (sdpa's cuDNN / memory-efficient, flex, varlen) under autocast, as the
    model calls them: a fully padded row and padded tails give finite outputs and gradients,
    and real tokens match the fp32 reference (sdpa's memory-efficient kernel has returned NaN
    for fully masked rows: pytorch issue 110213)."""
    torch.manual_seed(7)
    sequence_ids = packed_sequence_ids(7, 4, 512, 6)
    sequence_ids[1] = 0
    sequence_ids = sequence_ids.cuda()
    q32, k32, v32 = (torch.randn(4, 16, 512, 64, device="cuda") for _ in range(3))
    expected = reference_attention(q32.cpu(), k32.cpu(), v32.cpu(), sequence_ids.cpu()).cuda()
    real = sequence_ids > 0
    for name in available_attention_implementations(torch.device("cuda"), dtype=dtype, needs_grad=True):
        impl = get_attention(name)
        q, k, v = (t.to(dtype).requires_grad_() for t in (q32, k32, v32))
        with torch.autocast("cuda", dtype=dtype):
            prepared = impl.prepare(sequence_ids, dtype=torch.float32)  # the embeddings' dtype, as in the model
            out = impl.attend(q, k, v, prepared, dropout_p=0.0, training=True)
        assert torch.isfinite(out).all(), f"{name} {dtype}"
        assert (out.float() - expected).transpose(1, 2)[real].abs().max() < 5e-2, f"{name} {dtype}"
        out.float().square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), f"{name} {dtype}: gradients"
