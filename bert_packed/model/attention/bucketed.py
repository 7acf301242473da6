"""Packed attention computed per sequence, batched in length buckets (``"bucketed"``).

Why: the block-diagonal mask of ``dense``/``sdpa`` computes every pack's full S x S score
matrix, although with ~4.5 sequences per pack about 3/4 of it lies in masked blocks between
sequences; softmax, the attention-dropout bernoulli and both matmuls pay for those masked
scores too. A loop of one sdpa call per sequence computes only the real scores but pays
Python and dispatch overhead per sequence. Here the sequences of the whole micro-batch are
gathered into a few padded length buckets and each bucket is one
``F.scaled_dot_product_attention`` call, so the number of calls per layer is the number of
non-empty buckets, not the number of sequences.

Layout, built once per forward by :func:`prepare` (shared by every layer):

- the bucket lengths are a fixed set derived from S alone (:func:`bucket_lengths`: 32, 48,
  64, 96, 128, ... up to S, i.e. powers of two and 1.5 x powers of two), so each sequence
  is padded to at most ~1.5x its length (~2.25x its scores, worst case) and the bucket
  *shapes* along the length axis never depend on the batch;
- the number of sequences in each bucket does depend on the batch: this implementation is
  for eager execution (CPU, or CUDA beside ``varlen``). ``prepare`` reads the bucket sizes
  on the host (one synchronisation per forward, not per layer); a graph compiler would see
  a new shape per batch, so ``torch.compile`` and the IPU keep ``dense`` (static upper
  bounds per bucket, from K and S, would cost more score work than the dense mask saves);
- a sequence is the set of tokens of a row with one non-zero ``sequence_ids`` value, in
  token order; the tokens need not be contiguous (a stable sort groups them);
- inside a bucket an additive key-padding mask (finite :func:`mask_value`, so masked keys
  get probability exactly 0) hides the padding slots; every bucket row holds at least one
  real token, so no query row is fully masked; padded query rows are computed and dropped;
- results are concatenated and gathered back to the packed ``[B, N, S, D]`` layout;
  padding tokens (``sequence_ids == 0``) get zeros (finite, and in no bucket: they never
  reach a real token, as with the dense mask).

Attention dropout is sdpa's own (``dropout_p``; on a CPU ``F.dropout`` in the written-out
form, :func:`attend_bucket`): each real probability is kept with
probability 1 - p and scaled by 1 / (1 - p), as in ``dense``; masked key slots have
probability 0 before and after dropout, and no sequence shares a score row with another, so
nothing crosses sequences with dropout on either.

Only torch 2.0 operations (``scaled_dot_product_attention`` without ``scale=``).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from bert_packed.model.attention import (
    AttentionImplementation,
    attention_compute_dtype,
    dense_attend,
    mask_value,
    profiler_scope,
    register_attention,
)

NAME = "bucketed"
SMALLEST_BUCKET = 32


def bucket_lengths(seq_len: int, smallest: int = SMALLEST_BUCKET) -> List[int]:
    """The padded lengths sequences are bucketed into for packs of length ``seq_len``.

    Powers of two and 1.5 x powers of two from ``smallest``, capped by and always ending
    with ``seq_len``: a sequence of length n lands in the first bucket >= n, so it is padded
    to less than 1.5 n (or to ``smallest``). Fewer, larger buckets would mean fewer sdpa
    calls but more padded scores; this ratio keeps both small at S = 128 (5 buckets).
    """
    lengths = set()
    power = smallest
    while power < seq_len:
        lengths.add(power)
        if power * 3 // 2 < seq_len:
            lengths.add(power * 3 // 2)
        power *= 2
    lengths.add(seq_len)
    return sorted(lengths)


class Bucket(NamedTuple):
    """One sdpa call: ``rows`` sequences padded to ``length`` tokens.

    ``tokens``: int64 ``[rows * length]`` flat token index (into ``B*S``) of every slot
    (padding slots point at any token; they are masked as keys and dropped as queries);
    ``mask``: additive ``[rows, 1, 1, length]`` key-padding mask in the scores' dtype.
    """

    rows: int
    length: int
    tokens: torch.Tensor
    mask: torch.Tensor


class BucketPlan(NamedTuple):
    """What :func:`attend` needs: the buckets; ``tokens``, all buckets' gather indices in
    one (``[num_rows]``: one gather per tensor and layer, so one zero-fill and one
    scatter-add in its backward, whatever the number of buckets); and ``inverse``, for
    every token of ``B*S`` its row in the concatenated bucket outputs (padding tokens: the
    extra zero row at the end)."""

    buckets: List[Bucket]
    tokens: torch.Tensor
    inverse: torch.Tensor
    num_rows: int


def _segments(sequence_ids: torch.Tensor):
    """Group the real tokens of ``[B, S]`` by (row, sequence id).

    Returns ``order`` (flat token indices of the real tokens, grouped by segment, in token
    order within one), ``lengths`` and ``starts`` (per segment slot ``b * slots + id``, into
    ``order``) and ``segment_of`` (the segment slot of each entry of ``order``).
    """
    batch_size, seq_len = sequence_ids.shape
    flat = sequence_ids.reshape(-1)
    slots = int(flat.max().item()) + 1 if flat.numel() else 1  # host sync, once per forward
    row = torch.arange(batch_size, device=flat.device).repeat_interleave(seq_len)
    key = row * slots + flat
    real = flat > 0
    big = batch_size * slots  # padding sorts last
    _, order = torch.sort(torch.where(real, key, torch.full_like(key, big)), stable=True)
    num_real = int(real.sum().item())
    order = order[:num_real]
    segment_of = key[order]
    lengths = torch.bincount(segment_of, minlength=big)
    starts = torch.cumsum(lengths, 0) - lengths
    return order, lengths, starts, segment_of


def _build_bucket(order, lengths, starts, segments, length: int, dtype: torch.dtype) -> Bucket:
    """The gather index and key-padding mask of the ``segments`` padded to ``length``."""
    slot = torch.arange(length, device=order.device)
    valid = slot[None, :] < lengths[segments][:, None]  # [rows, length]
    position = torch.where(valid, starts[segments][:, None] + slot[None, :], torch.zeros_like(valid, dtype=torch.long))
    tokens = order[position].reshape(-1)
    mask = torch.zeros(valid.shape, dtype=dtype, device=order.device).masked_fill(~valid, mask_value(dtype))
    return Bucket(int(segments.numel()), length, tokens, mask[:, None, None, :])


def prepare(sequence_ids: torch.Tensor, *, dtype: torch.dtype, lengths_set: Optional[Sequence[int]] = None) -> BucketPlan:
    """The :class:`BucketPlan` of a ``[B, S]`` batch (built once per forward).

    ``dtype``: the activations' dtype; the masks take the dtype the scores will have (the
    autocast dtype under autocast), which sdpa requires of a float mask.
    """
    with profiler_scope("packing/mask"):
        batch_size, seq_len = sequence_ids.shape
        dtype = attention_compute_dtype(dtype, sequence_ids.device)
        order, lengths, starts, segment_of = _segments(sequence_ids)
        boundaries = torch.tensor(list(lengths_set or bucket_lengths(seq_len)), device=order.device)
        which = torch.bucketize(lengths, boundaries)  # first boundary >= length
        which = torch.where(lengths > 0, which, torch.full_like(which, len(boundaries)))  # empty slots: no bucket
        row_in_bucket = torch.zeros_like(lengths)
        offset_of = torch.zeros_like(lengths)  # first output row of each segment
        buckets, total = [], 0
        for j, length in enumerate(boundaries.tolist()):
            segments = torch.nonzero(which == j)[:, 0]
            if segments.numel() == 0:
                continue
            bucket = _build_bucket(order, lengths, starts, segments, length, dtype)
            row_in_bucket[segments] = torch.arange(bucket.rows, device=order.device)
            offset_of[segments] = total + row_in_bucket[segments] * length
            buckets.append(bucket)
            total += bucket.rows * length
        rank = torch.arange(order.numel(), device=order.device) - starts[segment_of]
        inverse = torch.full((batch_size * seq_len,), total, dtype=torch.long, device=order.device)
        inverse[order] = offset_of[segment_of] + rank
        tokens = torch.cat([b.tokens for b in buckets]) if buckets else inverse[:0]
        return BucketPlan(buckets, tokens, inverse, total)


def attend_bucket(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  dropout_p: float) -> torch.Tensor:
    """One bucket's attention: sdpa, except with dropout on a CPU, the written-out form.

    With dropout sdpa has no fused CPU kernel and runs its math path, which adds checks of
    the mask (``aten::all``, ``where``) to the same matmul, softmax and dropout: with the
    written-out :func:`dense_attend` per bucket, the whole bucketed attention's forward +
    backward was about 1.1x faster (median of 25 paired repeats, [4, 12, 128, 32] packs at
    dropout 0.1, 1 thread, busy machine). Same semantics: dropout on the
    probabilities, each kept with probability 1 - p and scaled by 1 / (1 - p).
    """
    if dropout_p > 0.0 and query.device.type == "cpu":
        return dense_attend(query, key, value, mask, dropout_p=dropout_p, training=True)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prepared: BucketPlan, *,
           dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Attention of ``[B, N, S, D]`` query/key/value within each sequence; same shape back.

    One gather per tensor lays out every bucket's tokens; per bucket a slice of it
    (``[rows, N, length, D]``) goes through one attention call (:func:`attend_bucket`) with the
    key-padding mask and dropout;
    one gather then puts every token's output back in its packed place. Scale 1/sqrt(D)
    (sdpa's default), as in BERT.

    The "packing/attention" profiler scope holds the gathers, the work packing adds (as it
    holds the mask's addition in ``dense``); the sdpa calls are attention an unpacked batch
    pays too.
    """
    batch_size, num_heads, seq_len, head_dim = query.shape
    p = dropout_p if training else 0.0
    if not prepared.buckets:
        # Padding only: zeros, but still computed from the inputs, so that the Q/K/V projections
        # get a (zero) gradient as with the dense mask, not none (DDP and accumulation expect one).
        return (query + key + value) * 0.0

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, N, S, D] -> [B*S, N, D] (free for the model's layout)
        return t.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim)

    sizes = [bucket.rows * bucket.length for bucket in prepared.buckets]
    with profiler_scope("packing/attention"):
        # split, not slicing: split's backward is one cat, a slice's a zero-filled full tensor per bucket
        gathered = [torch.split(tokens(t).index_select(0, prepared.tokens), sizes) for t in (query, key, value)]
    outputs = []
    for bucket, q_b, k_b, v_b in zip(prepared.buckets, *gathered):
        q_b, k_b, v_b = (t.view(bucket.rows, bucket.length, num_heads, head_dim).transpose(1, 2) for t in (q_b, k_b, v_b))
        out = attend_bucket(q_b, k_b, v_b, bucket.mask, p)
        outputs.append(out.transpose(1, 2).reshape(bucket.rows * bucket.length, num_heads, head_dim))
    with profiler_scope("packing/attention"):
        outputs.append(query.new_zeros(1, num_heads, head_dim))  # the padding tokens' output
        context = torch.cat(outputs).index_select(0, prepared.inverse)
    return context.view(batch_size, seq_len, num_heads, head_dim).transpose(1, 2)


register_attention(
    NAME,
    AttentionImplementation(
        name=NAME,
        prepare=prepare,
        attend=attend,
        description="sequences gathered into length buckets, one sdpa per bucket (eager: batch-dependent shapes)",
        static_shapes=False,
    ),
)

