"""FlexAttention document-mask attention ("flex"): mask construction, CPU forward, errors.

What runs on CPU: the block mask (ours vs torch's create_block_mask), the forward
(torch's unfused reference, and the compiled one in a slow test), the error paths.
Backward and the fused kernels need a GPU: those tests are marked ``cuda``.
"""
import math
import os

import pytest
import torch

flex_module = pytest.importorskip("torch.nn.attention.flex_attention", reason="needs torch >= 2.5 (FlexAttention)")

from bert_packed.model.attention import flex as fa  # noqa: E402
from bert_packed.model.attention import AttentionError, get_attention  # noqa: E402


def pack_ids(lengths_per_pack, seq_len):
    """sequence_ids [B, S] for packs holding sequences of the given lengths, in order."""
    ids = torch.zeros(len(lengths_per_pack), seq_len, dtype=torch.long)
    for b, lengths in enumerate(lengths_per_pack):
        start = 0
        for k, length in enumerate(lengths):
            ids[b, start:start + length] = k + 1
            start += length
        assert start <= seq_len
    return ids


def random_pack_ids(generator, batch_size, seq_len, max_sequences_per_pack):
    packs = []
    for _ in range(batch_size):
        num = int(torch.randint(1, max_sequences_per_pack + 1, (1,), generator=generator))
        cuts = torch.sort(torch.randint(1, seq_len, (num,), generator=generator)).values.tolist()
        lengths, previous = [], 0
        for cut in cuts:
            if cut > previous:
                lengths.append(cut - previous)
                previous = cut
        packs.append(lengths)  # the tail after the last cut is padding
    return pack_ids(packs, seq_len)


def reference_attention(query, key, value, sequence_ids):
    """Float64 softmax attention restricted to each sequence, written out independently."""
    q, k, v = (t.double() for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    same = sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :]
    allowed = same & (sequence_ids != 0)[:, None, :, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows -> 0
    return probs @ v


# ----------------------------------------------------------------------------- mask construction


def test_document_mask_matches_pairwise_definition():
    ids = pack_ids([[3, 2], [5], [1, 1, 1]], 6)
    mask = fa.document_mask(ids)
    for b in range(ids.shape[0]):
        for i in range(6):
            for j in range(6):
                expected = bool(ids[b, i] == ids[b, j] and ids[b, i] != 0)
                assert bool(mask[b, i, j]) == expected, (b, i, j)


def test_block_structure_hand_computed():
    # Sequences of 128, 128 and 256 tokens in a 512-token pack, 128-token tiles:
    # seq 1 -> tile (0,0), seq 2 -> tile (1,1), seq 3 -> tiles (2..3, 2..3): 6 of 16, all full.
    # Second pack: 100 + 100 tokens then padding: seq 1 lies in tile 0, seq 2 spans tiles 0
    # and 1, so tiles (0..1, 0..1) are partial and the padding-only tiles 2..3 are skipped.
    ids = pack_ids([[128, 128, 256], [100, 100]], 512)
    partial, full = fa.block_structure(ids, 128)
    expected_full = torch.zeros(2, 4, 4, dtype=torch.bool)
    expected_full[0, 0, 0] = expected_full[0, 1, 1] = True
    expected_full[0, 2:, 2:] = True
    expected_partial = torch.zeros(2, 4, 4, dtype=torch.bool)
    expected_partial[1, :2, :2] = True
    assert torch.equal(full, expected_full)
    assert torch.equal(partial, expected_partial)
    assert fa.active_block_fraction(ids, 128) == pytest.approx((6 + 4) / 32)


@pytest.mark.parametrize(
    "seq_len,block_size,seed",
    [(256, 128, 0), (200, 64, 1), (96, 32, 2)],  # 200 % 64 != 0: the edge tile is never full
)
def test_block_mask_equals_create_block_mask(seq_len, block_size, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = random_pack_ids(generator, 3, seq_len, 4)
    ours = fa.build_block_mask(ids, block_size)

    def same_sequence(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] != 0)

    theirs = flex_module.create_block_mask(same_sequence, ids.shape[0], None, seq_len, seq_len, device="cpu",
                                           BLOCK_SIZE=block_size)
    assert ours.seq_lengths == theirs.seq_lengths
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    # Indices beyond each row's count are unused padding; compare the used prefixes.
    for count_name, index_name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                                   ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        counts = getattr(ours, count_name)
        for idx in torch.nonzero(torch.ones_like(counts)):
            n = int(counts[tuple(idx)])
            assert torch.equal(getattr(ours, index_name)[tuple(idx)][:n], getattr(theirs, index_name)[tuple(idx)][:n])


def test_unpacked_batch_is_key_padding_mask():
    # One sequence per row: the document mask is the usual key-padding mask (for real queries).
    ids = pack_ids([[5], [8], [2]], 8)
    mask = fa.document_mask(ids)
    real = ids != 0
    expected = real[:, :, None] & real[:, None, :]
    assert torch.equal(mask, expected)


# ----------------------------------------------------------------------------- forward on CPU


def test_flex_forward_equals_reference_on_cpu():
    generator = torch.Generator().manual_seed(3)
    ids = random_pack_ids(generator, 3, 128, 3)
    q, k, v = (torch.randn(3, 2, 128, 16, generator=generator) for _ in range(3))
    impl = get_attention("flex")
    out = impl.attend(q, k, v, impl.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=False)
    ref = reference_attention(q, k, v, ids)
    real = (ids != 0)[:, None, :, None].expand_as(out)
    assert out.shape == q.shape
    torch.testing.assert_close(out[real].double(), ref[real], atol=1e-5, rtol=1e-5)
    assert torch.all(out[~real] == 0), "padding queries attend to nothing"


def test_flex_matches_dense_registry_entry_on_real_tokens():
    generator = torch.Generator().manual_seed(4)
    ids = random_pack_ids(generator, 2, 64, 4)
    q, k, v = (torch.randn(2, 4, 64, 8, generator=generator) for _ in range(3))
    flex, dense = get_attention("flex"), get_attention("dense")
    out_flex = flex.attend(q, k, v, flex.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=False)
    out_dense = dense.attend(q, k, v, dense.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=False)
    real = (ids != 0)[:, None, :, None].expand_as(out_flex)
    torch.testing.assert_close(out_flex[real], out_dense[real], atol=1e-5, rtol=1e-5)


def test_other_sequences_do_not_leak():
    # Changing the tokens of sequence 2 must leave sequence 1's outputs bit-identical.
    generator = torch.Generator().manual_seed(5)
    ids = pack_ids([[40, 50, 30]], 128)
    q, k, v = (torch.randn(1, 2, 128, 8, generator=generator) for _ in range(3))
    prepared = fa.prepare(ids)
    before = fa.attend(q, k, v, prepared)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 40:90] += 3.0
    v2[:, :, 40:90] -= 2.0
    after = fa.attend(q, k2, v2, prepared)
    assert torch.equal(before[:, :, :40], after[:, :, :40])
    assert torch.equal(before[:, :, 90:], after[:, :, 90:])
    assert not torch.equal(before[:, :, 40:90], after[:, :, 40:90])


# ----------------------------------------------------------------------------- errors


def test_attention_dropout_in_training_is_refused():
    ids = pack_ids([[10]], 16)
    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(fa.FlexAttentionError, match="attention_probs_dropout_prob=0.1"):
        fa.attend(q, q, q, fa.prepare(ids), dropout_p=0.1, training=True)
    # In eval, dropout does not apply: allowed.
    fa.attend(q, q, q, fa.prepare(ids), dropout_p=0.1, training=False)


def test_backward_on_cpu_is_refused_with_one_line():
    ids = pack_ids([[10]], 16)
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(fa.FlexAttentionError) as info:
        fa.attend(q, q, q, fa.prepare(ids))
    message = str(info.value)
    assert "\n" not in message and "GPU" in message and "dense" in message
    assert isinstance(info.value, AttentionError) and isinstance(info.value, ValueError)
    # Under no_grad the same inputs are fine.
    with torch.no_grad():
        fa.attend(q, q, q, fa.prepare(ids))


def test_check_hook_reports_cpu_training_and_dropout():
    impl = get_attention("flex")
    impl.check(device=torch.device("cpu"), dtype=torch.float32, dropout_p=0.0, needs_grad=False)
    with pytest.raises(AttentionError, match="cannot train on CPU"):
        impl.check(device=torch.device("cpu"), dtype=torch.float32, dropout_p=0.0, needs_grad=True)
    with pytest.raises(AttentionError, match="no attention dropout"):
        impl.check(device=torch.device("cuda"), dtype=torch.bfloat16, dropout_p=0.1, needs_grad=True)
    # On a GPU, training without dropout passes the check (the check needs no GPU).
    impl.check(device=torch.device("cuda"), dtype=torch.bfloat16, dropout_p=0.0, needs_grad=True)


def test_bad_shapes_are_refused():
    with pytest.raises(fa.FlexAttentionError, match=r"\[B, S\]"):
        fa.build_block_mask(torch.zeros(16, dtype=torch.long))
    with pytest.raises(fa.FlexAttentionError, match="block_size"):
        fa.block_structure(torch.zeros(1, 16, dtype=torch.long), 0)


# ----------------------------------------------------------------------------- compiled (slow on CPU)


@pytest.mark.slow
def test_compiled_mask_and_flex_form_one_graph_without_recompiles_on_cpu():
    """Block-mask construction and the attention compile into one graph (no graph break,
    so a compiled model keeps it inside), and new packs of the same [B, S] change tensor
    contents, not shapes: dynamo compiles exactly once."""
    from torch._dynamo.utils import counters

    def mask_and_attend(ids, q, k, v):
        return flex_module.flex_attention(q, k, v, block_mask=fa.prepare(ids))

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mask_and_attend, dynamic=False)
    graphs_after = []
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        ids = random_pack_ids(generator, 2, 128, 3)
        q, k, v = (torch.randn(2, 2, 128, 16, generator=generator) for _ in range(3))
        out = compiled(ids, q, k, v)
        ref = reference_attention(q, k, v, ids)
        real = (ids != 0)[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[real].double(), ref[real], atol=1e-4, rtol=1e-4)
        graphs_after.append(counters["stats"]["unique_graphs"])
    assert graphs_after == [1, 1, 1], f"unique graphs after each call: {graphs_after}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


# ----------------------------------------------------------------------------- GPU


def _cuda_inputs(seed, batch_size=4, seq_len=512, num_heads=4, head_dim=64, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    ids = random_pack_ids(generator, batch_size, seq_len, 3).cuda()
    q, k, v = (torch.randn(batch_size, num_heads, seq_len, head_dim, generator=generator)
               .to("cuda", dtype).requires_grad_() for _ in range(3))
    return ids, q, k, v


@pytest.mark.cuda
def test_flex_equals_dense_forward_and_gradients_bf16_on_gpu():
    ids, q, k, v = _cuda_inputs(7)
    flex, dense = get_attention("flex"), get_attention("dense")
    out_flex = flex.attend(q, k, v, flex.prepare(ids, dtype=q.dtype), dropout_p=0.0, training=True)
    real = (ids != 0)[:, None, :, None]
    weights = torch.randn(out_flex.shape, device="cuda", dtype=torch.float32)
    grads_flex = torch.autograd.grad((out_flex.float() * weights * real).sum(), (q, k, v))

    # Reference: dense attention in float32 from the same bf16 inputs.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out_ref = dense.attend(q32, k32, v32, dense.prepare(ids, dtype=torch.float32), dropout_p=0.0, training=True)
    grads_ref = torch.autograd.grad((out_ref * weights * real).sum(), (q32, k32, v32))

    # bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4 %): errors are judged against
    # each tensor's scale, 2 % of its largest entry; attending across sequences would be
    # off by O(100 %).
    mask = real.expand_as(out_flex)
    error = (out_flex.float()[mask] - out_ref[mask]).abs().max()
    assert error <= 2e-2 * out_ref[mask].abs().max(), f"output error {error}"
    for name, got, want in zip("qkv", grads_flex, grads_ref):
        error = (got.float() - want).abs().max()
        assert error <= 2e-2 * want.abs().max(), f"d{name} error {error} vs scale {want.abs().max()}"


@pytest.mark.cuda
def test_flex_skips_blocks_and_does_not_recompile_on_gpu():
    from torch._dynamo.utils import counters

    ids, q, k, v = _cuda_inputs(8)
    fa.attend(q, k, v, fa.prepare(ids), training=True).sum().backward()  # warm-up compile
    warm = counters["stats"]["unique_graphs"]
    for seed in (9, 10):
        ids2, q2, k2, v2 = _cuda_inputs(seed)
        fa.attend(q2, k2, v2, fa.prepare(ids2), training=True).sum().backward()
    assert counters["stats"]["unique_graphs"] == warm
    assert fa.active_block_fraction(pack_ids([[128, 128, 256]], 512).cuda()) == pytest.approx(6 / 16)


def test_whole_model_with_flex_equals_dense_in_eval_on_cpu():
    """BertForPreTraining through the registry: flex and dense give the same losses."""
    import itertools

    from bert_packed.config import load_config
    from bert_packed.tasks.pretraining.data import build_data_source
    from bert_packed.tasks.pretraining.model import build_model

    config = load_config("tiny", ["data.num_sequences=300"])
    batches = list(itertools.islice(iter(build_data_source(config, split="train", micro_batch_size=4)), 2))
    torch.manual_seed(0)
    model = build_model(config).eval()
    losses = {}
    for attention in ("dense", "flex"):
        model.config.attention_implementation = attention
        with torch.no_grad():
            losses[attention] = [model(**{k: torch.as_tensor(v) for k, v in b.items()})["mlm_loss"] for b in batches]
    for dense, flex in zip(losses["dense"], losses["flex"]):
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_dense_model_never_imports_flex():
    """The IPU path (torch 2.0, dense attention) must not import this module or torch's
    FlexAttention: checked in a fresh interpreter that builds and runs a dense model."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from bert_packed.model.modeling import BertConfig\n"
        "from bert_packed.tasks.pretraining.model import BertForPreTraining\n"
        "model = BertForPreTraining(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,"
        " num_attention_heads=2, intermediate_size=32, max_sequences_per_pack=2, max_masked_tokens_per_pack=4,"
        " attention_implementation='dense'))\n"
        "model.bert(torch.ones(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long),"
        " torch.arange(8)[None], torch.ones(1, 8, dtype=torch.long))\n"
        "print(sorted(m for m in ('bert_packed.model.attention.flex', 'torch.nn.attention.flex_attention')"
        " if m in sys.modules))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
