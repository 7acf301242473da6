"""The ``varlen`` attention (torch.nn.attention.varlen): its batch layout on CPU, its kernel on a GPU.

torch has no CPU kernel for varlen_attn, so the CPU tests check everything around it (the
cumulative lengths, the [B, N, S, D] <-> [T, N, D] layout, the refusals) by running
``attend`` with an independent per-segment reference in place of the kernel.
"""
import itertools
import math

import numpy as np
import pytest
import torch

from bert_packed.model.attention import get_attention

varlen = pytest.importorskip("bert_packed.model.attention.varlen")


def random_sequence_ids(seed, batch_size, seq_len, max_sequences):
    """[B, S] ids: 1..k contiguous runs, then padding; row 1 is all padding."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch_size, seq_len), dtype=np.int64)
    for b in range(batch_size):
        if b == 1:
            continue
        k = int(rng.integers(1, max_sequences + 1))
        used = int(rng.integers(k, seq_len + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), k - 1, replace=False)) if k > 1 else []
        for j, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, used])):
            ids[b, lo:hi] = j + 1
    return torch.from_numpy(ids)


def segments_by_hand(sequence_ids):
    """Flat (start, end) of every run of equal ids in every row (the contract, written out)."""
    batch_size, seq_len = sequence_ids.shape
    out = []
    for b in range(batch_size):
        row = sequence_ids[b].tolist()
        start = 0
        for t in range(1, seq_len + 1):
            if t == seq_len or row[t] != row[t - 1]:
                out.append((b * seq_len + start, b * seq_len + t))
                start = t
    return out


def reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k):
    """Softmax attention within each [cu[k], cu[k+1]) of the flat [T, N, D] tensors (float64)."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k
    out = torch.zeros_like(query, dtype=torch.float64)
    cu = cu_q.tolist()
    assert all(b - a <= max_q for a, b in zip(cu, cu[1:]))
    for lo, hi in zip(cu, cu[1:]):
        if hi == lo:
            continue
        q, k, v = (t[lo:hi].double().transpose(0, 1) for t in (query, key, value))  # [N, len, D]
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        out[lo:hi] = (probs @ v).transpose(0, 1)
    return out.to(query.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cumulative_lengths_cut_exactly_at_sequence_and_row_boundaries(seed):
    ids = random_sequence_ids(seed, 4, 48, 6)
    cu = varlen.cumulative_lengths(ids)
    assert cu.dtype == torch.int32 and cu.shape == (4 * 48 + 1,), "fixed shape: B*S + 1 whatever the data"
    assert cu[0] == 0 and cu[-1] == 4 * 48 and bool((cu[1:] >= cu[:-1]).all())
    values = cu.tolist()
    nonempty = [(a, b) for a, b in zip(values, values[1:]) if b > a]
    assert nonempty == segments_by_hand(ids)


def test_attend_layout_equals_dense_on_real_tokens(monkeypatch):
    monkeypatch.setattr(varlen, "_varlen_kernel", lambda: reference_varlen)
    torch.manual_seed(0)
    ids = random_sequence_ids(3, 3, 40, 5)
    q, k, v = (torch.randn(3, 2, 40, 8) for _ in range(3))
    impl = get_attention("varlen")
    out = impl.attend(q, k, v, impl.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=False)
    dense = get_attention("dense")
    expected = dense.attend(q, k, v, dense.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=False)
    assert out.shape == q.shape and torch.isfinite(out).all()
    real = ids > 0
    torch.testing.assert_close(out.transpose(1, 2)[real], expected.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    # Padding attends to its row's padding, as in dense: same values there too.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed,max_sequences", [(0, 6), (1, 6), (2, 9), (3, 60)])
def test_bounded_lengths_have_k_plus_one_slots_a_row_and_the_same_segments(seed, max_sequences):
    ids = random_sequence_ids(seed, 5, 48, 6)  # at most 6 sequences a row, padding as a 7th segment
    cu = varlen.cumulative_lengths(ids, max_sequences + 1)
    slots = min(max_sequences + 1, 48)
    assert cu.dtype == torch.int32 and cu.shape == (5 * slots + 1,), "fixed shape: B*(K+1) + 1 whatever the data"
    assert cu[0] == 0 and cu[-1] == 5 * 48 and bool((cu[1:] >= cu[:-1]).all())
    values = cu.tolist()
    assert [(a, b) for a, b in zip(values, values[1:]) if b > a] == segments_by_hand(ids)
    unbounded = varlen.cumulative_lengths(ids).tolist()
    assert [(a, b) for a, b in zip(unbounded, unbounded[1:]) if b > a] == segments_by_hand(ids)


def test_a_row_with_more_segments_than_the_bound_stops_instead_of_merging_sequences():
    ids = torch.tensor([[1, 1, 2, 3, 0, 0], [1, 2, 2, 2, 2, 0]])  # row 0: 4 segments
    assert varlen.cumulative_lengths(ids, 4).shape == (9,)
    with pytest.raises(RuntimeError):
        varlen.cumulative_lengths(ids, 3)
    with pytest.raises(varlen.VarlenAttentionError, match="positive int"):
        varlen.cumulative_lengths(ids, 0)


def test_the_model_passes_its_k_and_equals_dense(monkeypatch):
    """A whole encoder forward with the bounded layout (the reference kernel in place of the GPU
    one): the kernel sees B*(K+1) + 1 boundaries and the output equals dense attention's."""
    from bert_packed.model.modeling import BertConfig, BertModel

    seen = []

    def spy(query, key, value, cu_q, cu_k, max_q, max_k):
        seen.append(cu_q.shape[0])
        return reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k)

    monkeypatch.setattr(varlen, "_varlen_kernel", lambda: spy)
    import dataclasses

    from bert_packed.model.attention import ATTENTION_IMPLEMENTATIONS

    # The GPU-only check stands aside; prepare and attend are the real ones.
    monkeypatch.setitem(ATTENTION_IMPLEMENTATIONS, "varlen", dataclasses.replace(get_attention("varlen"), check=None))
    torch.manual_seed(0)
    config = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=40, max_sequences_per_pack=5, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    dense_model = BertModel(BertConfig(**config)).eval()
    varlen_model = BertModel(BertConfig(**config, attention_implementation="varlen")).eval()
    varlen_model.load_state_dict(dense_model.state_dict())
    ids = random_sequence_ids(7, 3, 40, 5)
    inputs = (torch.randint(1, 50, (3, 40)), torch.zeros(3, 40, dtype=torch.long),
              torch.arange(40).repeat(3, 1), ids)
    with torch.no_grad():
        expected, out = dense_model(*inputs), varlen_model(*inputs)
    assert seen == [3 * 6 + 1] * 2  # two layers, K = 5: six slots a row
    real = ids > 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)


def test_collated_packs_keep_sequences_contiguous():
    # varlen's segments are runs of equal ids: check the real data pipeline lays packs out so.
    from bert_packed.config import load_config
    from bert_packed.tasks.pretraining.data import build_data_source

    config = load_config("tiny", ["data.max_sequences_per_pack=4", "data.packing_algorithm=lpfhp", "data.num_sequences=300"])
    source = build_data_source(config, split="train", micro_batch_size=8)
    for batch in itertools.islice(iter(source), 4):
        ids = torch.as_tensor(batch["sequence_ids"])
        runs_per_row = [sum(1 for a, b in segments_by_hand(ids[r:r + 1])) for r in range(ids.shape[0])]
        expected = [len(set(row.tolist())) for row in ids]  # sequences + (padding, if any)
        assert runs_per_row == expected


@pytest.mark.parametrize("kwargs,expected", [
    (dict(device=torch.device("cpu"), dtype=torch.bfloat16), "only on a CUDA GPU"),
    (dict(device=torch.device("cuda"), dtype=torch.bfloat16, dropout_p=0.1), "no attention dropout"),
    (dict(device=torch.device("cuda"), dtype=torch.float32), "needs fp16 or bf16"),
])
def test_check_refuses_with_one_line(kwargs, expected):
    pytest.importorskip("torch.nn.attention.varlen")
    with pytest.raises(varlen.VarlenAttentionError) as info:
        varlen.check(**kwargs)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_not_offered_on_cpu():
    from bert_packed.model.attention import available_attention_implementations

    assert "varlen" not in available_attention_implementations(torch.device("cpu"), needs_grad=False)


@pytest.mark.cuda
@pytest.mark.parametrize("max_sequences", [None, 6])
def test_varlen_equals_dense_forward_and_gradients_bf16_on_gpu(max_sequences):
    pytest.importorskip("torch.nn.attention.varlen")
    torch.manual_seed(0)
    ids = random_sequence_ids(4, 4, 512, 6).cuda()
    q32, k32, v32 = (torch.randn(4, 16, 512, 64, device="cuda") for _ in range(3))
    impl, dense = get_attention("varlen"), get_attention("dense")
    q, k, v = (t.bfloat16().requires_grad_() for t in (q32, k32, v32))
    prepared = impl.prepare(ids, dtype=torch.bfloat16, max_sequences=max_sequences)
    out = impl.attend(q, k, v, prepared, dropout_p=0.0, training=True)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = dense.attend(*ref_inputs, dense.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=True)
    real = ids > 0
    assert (out.float() - ref).transpose(1, 2)[real].abs().max() < 3e-2
    grad = torch.randn_like(ref)
    out.backward(grad.bfloat16())
    ref.backward(grad)
    for ours, theirs in zip((q, k, v), ref_inputs):
        scale = theirs.grad.abs().max()
        assert torch.isfinite(ours.grad).all()
        assert (ours.grad.float() - theirs.grad).transpose(1, 2)[real].abs().max() <= 3e-2 * scale
