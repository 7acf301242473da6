"""``bucketed`` attention (per sequence, in length buckets) == the dense block-diagonal mask.

Forward and backward on random packs (sequences of length 1, full-length ones, empty packs,
unused sequence ids), attention dropout's keep probability on real scores and no gradient
across sequences with dropout on, the bucket layout, and the IPU's refusal.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bert_packed.model.attention import bucketed as bucketed_attention
from bert_packed.model.attention import get_attention, mask_value
from bert_packed.model.attention.bucketed import bucket_lengths
from backends import get_backend_class
from bert_packed.config import ConfigError, load_config, validate
from ipu.config import validate as validate_ipu_section
from test_ipu_torch20 import TORCH_2_0, _Recorder


def random_sequence_ids(rng, batch_size, S, K):
    """[B, S] ids: per pack 0..K sequences of random lengths (1 and S included), padding last;
    sometimes an unused id in between (an empty slot) or a pack of padding only."""
    ids = np.zeros((batch_size, S), dtype=np.int64)
    for b in range(batch_size):
        kind = rng.integers(6)
        if kind == 0:
            continue  # an empty pack
        if kind == 1:
            ids[b] = 1  # one full-length sequence
            continue
        count = int(rng.integers(1, K + 1))
        lengths = rng.choice([1, 1, 2, 3, S // 4, S // 2, S], count) if kind == 2 else rng.integers(1, S // 2 + 1, count)
        start, slot = 0, 1
        for length in lengths:
            length = int(min(length, S - start))
            if length <= 0:
                break
            if kind == 3 and rng.random() < 0.3:
                slot += 1  # leave a slot unused
            ids[b, start:start + length] = slot
            start, slot = start + length, slot + 1
    return torch.from_numpy(ids)


def run(name, q, k, v, sequence_ids, dropout_p=0.0, training=False):
    impl = get_attention(name)
    return impl.attend(q, k, v, impl.prepare(sequence_ids, dtype=q.dtype), dropout_p=dropout_p, training=training)


CASES = [(1, 8, 2), (3, 16, 4), (4, 64, 8), (2, 128, 16), (3, 100, 5), (2, 512, 16)]


@pytest.mark.parametrize("B, S, K", CASES, ids=[f"B{b}-S{s}-K{k}" for b, s, k in CASES])
def test_forward_and_backward_equal_dense_on_random_packs(B, S, K):
    rng = np.random.default_rng(S + K)
    for trial in range(4):
        sequence_ids = random_sequence_ids(rng, B, S, K)
        torch.manual_seed(trial)
        heads, head_dim = int(rng.integers(1, 4)), int(rng.choice([4, 8, 16]))
        leaves = [torch.randn(B, heads, S, head_dim, requires_grad=True) for _ in range(3)]
        real = (sequence_ids > 0)[:, None, :, None].expand(B, heads, S, head_dim)
        upstream = torch.randn(B, heads, S, head_dim) * real  # padding outputs feed nothing real
        expected = run("dense", *leaves, sequence_ids)
        expected_grads = torch.autograd.grad(expected, leaves, upstream)
        out = run("bucketed", *leaves, sequence_ids)
        grads = torch.autograd.grad(out, leaves, upstream)
        assert torch.cat([(out[real] - expected[real]).abs(), torch.zeros(1)]).max().item() <= 1e-5
        assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding: zeros, finite
        for grad, reference in zip(grads, expected_grads):
            assert (grad - reference).abs().max().item() <= 1e-5


def test_a_batch_of_padding_only_gives_zeros_and_zero_gradients():
    leaves = [torch.randn(2, 2, 16, 4, requires_grad=True) for _ in range(3)]
    out = run("bucketed", *leaves, torch.zeros(2, 16, dtype=torch.long), dropout_p=0.1, training=True)
    assert torch.equal(out, torch.zeros_like(out))
    for grad in torch.autograd.grad(out.sum(), leaves):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_bucket_lengths_come_from_S_alone():
    assert bucket_lengths(128) == [32, 48, 64, 96, 128]
    assert bucket_lengths(512) == [32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert bucket_lengths(100) == [32, 48, 64, 96, 100]
    assert bucket_lengths(16) == [16]


def test_each_sequence_lands_in_the_smallest_bucket_that_holds_it():
    sequence_ids = torch.tensor([[1] * 5 + [2] * 33 + [3] * 90, [1] * 128, [0] * 128])
    plan = bucketed_attention.prepare(sequence_ids, dtype=torch.float32)
    assert [(b.rows, b.length) for b in plan.buckets] == [(1, 32), (1, 48), (1, 96), (1, 128)]
    first = plan.buckets[0]
    assert first.tokens[:5].tolist() == [0, 1, 2, 3, 4]
    assert (first.mask[0, 0, 0, :5] == 0).all() and (first.mask[0, 0, 0, 5:] == mask_value(torch.float32)).all()
    assert plan.num_rows == 32 + 48 + 96 + 128
    assert (plan.inverse[256:] == plan.num_rows).all()  # the padding row reads the zero row


def test_masks_take_the_autocast_dtype():
    sequence_ids = torch.tensor([[1, 1, 2, 0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = bucketed_attention.prepare(sequence_ids, dtype=torch.float32)
    assert all(b.mask.dtype == torch.bfloat16 for b in plan.buckets)


def one_hot_values(B, heads, S):
    """query = key = 0 (uniform probabilities over a sequence's keys), value[t] = e_t: the
    output row of query i is then its (dropped-out) probability row over the S keys."""
    zeros = torch.zeros(B, heads, S, S)
    value = torch.eye(S).expand(B, heads, S, S).clone()
    return zeros, zeros.clone(), value


def test_dropout_keeps_every_real_score_with_the_keep_probability_and_none_across_sequences():
    rng = np.random.default_rng(3)
    B, heads, S, p = 8, 4, 64, 0.3
    sequence_ids = random_sequence_ids(rng, B, S, 6)
    torch.manual_seed(0)
    probs = run("bucketed", *one_hot_values(B, heads, S), sequence_ids, dropout_p=p, training=True)
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    real_pair = (same & (sequence_ids[:, :, None] > 0))[:, None].expand(B, heads, S, S)
    lengths = same.sum(-1)  # [B, S]: the length of each query's sequence
    kept = probs * lengths[:, None, :, None] * (1 - p)  # 1 where kept, 0 where dropped
    across = ~real_pair & (sequence_ids > 0)[:, None, :, None]  # a real query, another sequence's key
    assert across.any() and (probs[across] == 0).all()  # exactly nothing across sequences
    values = kept[real_pair]
    assert ((values - 1).abs() < 1e-5).logical_or(values == 0).all()
    mean, count = values.mean().item(), values.numel()
    assert count > 20_000
    assert abs(mean - (1 - p)) < 4 * (p * (1 - p) / count) ** 0.5 + 1e-3, mean


def test_no_gradient_crosses_sequences_with_dropout_on():
    rng = np.random.default_rng(4)
    B, heads, S, head_dim = 3, 2, 64, 8
    sequence_ids = random_sequence_ids(rng, B, S, 6)
    sequence_ids[0, :40] = torch.tensor([1] * 10 + [2] * 20 + [3] * 10)  # at least one pack of several
    torch.manual_seed(1)
    leaves = [torch.randn(B, heads, S, head_dim, requires_grad=True) for _ in range(3)]
    out = run("bucketed", *leaves, sequence_ids, dropout_p=0.5, training=True)
    checked = 0
    for b in range(B):
        for sid in sequence_ids[b].unique().tolist():
            if sid == 0:
                continue
            mine = sequence_ids[b] == sid
            weights = torch.zeros_like(out)
            weights[b, :, mine] = torch.randn(heads, int(mine.sum()), head_dim)
            grads = torch.autograd.grad(out, leaves, weights, retain_graph=True)
            others = torch.ones(B, S, dtype=torch.bool)
            others[b] = ~mine
            for grad in grads:
                assert (grad.transpose(1, 2)[others] == 0).all()  # exactly zero, not just small
            checked += int(any(grad[b, :, mine].abs().sum() > 0 for grad in grads))  # not vacuous
    assert checked >= 3


def test_the_ipu_refuses_bucketed_attention_in_one_line():
    config = load_config("phase2", ["model.attention_implementation=bucketed"])
    with pytest.raises(ConfigError, match=r"^model.attention_implementation=bucketed has shapes that depend on each batch"):
        validate_ipu_section(config)
    validate_ipu_section(load_config("phase2"))


@pytest.mark.parametrize("backend, section", [("cpu", "cpu"), ("cuda", "cuda")])
def test_compile_refuses_bucketed_attention_at_start_up(backend, section):
    """Every batch would compile a new graph: the run would stop at the first step after warm-up."""
    base = ["model.attention_implementation=bucketed", "cuda.device=cpu"]
    with pytest.raises(ConfigError, match=rf"^{section}.compile cannot compile model.attention_implementation=bucketed"):
        validate(load_config("tiny", base + [f"{section}.compile=true"]), get_backend_class(backend))
    validate(load_config("tiny", base), get_backend_class(backend))


# Calls of bucketed attention beyond the IPU path's list, checked by hand against the torch 2.0
# reference (pytorch.org/docs/2.0): the CPU/CUDA backends' CI also runs on torch 2.0.1.
BUCKETED_2_0 = {
    "torch.sort": {"stable", "dim", "descending"}, "torch.bucketize": {"right", "out_int32"},
    "torch.bincount": {"weights", "minlength"}, "torch.cumsum": {"dim", "dtype"}, "torch.nonzero": set(),
    "torch.functional.split": {"dim"}, "torch.full_like": {"dtype", "device"}, "Tensor.repeat_interleave": set(),
}


def test_bucketed_attention_calls_only_torch_2_0_apis():
    sequence_ids = torch.tensor([[1] * 5 + [2] * 40 + [0] * 19, [1] * 64])
    leaves = [torch.randn(2, 2, 64, 8, requires_grad=True) for _ in range(3)]
    with _Recorder() as recorder:
        out = run("bucketed", *leaves, sequence_ids, dropout_p=0.1, training=True)
        out.sum().backward()
    allowed = {**TORCH_2_0, **BUCKETED_2_0}
    unknown = {name: sorted(kw) for name, kw in recorder.calls.items()
               if name not in allowed or not kw <= allowed[name]}
    assert not unknown, f"calls not checked against torch 2.0: {unknown}"
