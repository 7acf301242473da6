"""Packed attention through torch's variable-length attention (``torch.nn.attention.varlen``).

``varlen_attn`` is a Flash-attention kernel over a flat token list ``[T, heads, head_dim]``
cut into sequences by cumulative lengths ``cu_seq`` (int32, one more entry than
sequences): each sequence attends only to itself, so nothing between sequences is ever
computed. That is exactly packed BERT's block-diagonal rule, and it is the kernel GPU
users reach for with padding-free training, so it is both an attention implementation
here and a peer row in benchmarks/cuda_throughput.py.

Registered as ``"varlen"``. ``prepare`` turns ``sequence_ids`` ``[B, S]`` into the
cumulative lengths once per forward, with fixed shapes and no host synchronisation (so
``torch.compile`` sees one graph and the GPU never waits for the CPU):

- a segment is a run of equal ``sequence_ids`` within a row; the trailing padding of a row
  is a segment of its own (it attends to itself, as in ``dense``; its outputs are unused);
- with the model's bound K (``max_sequences_per_pack``; a validated row holds at most K
  sequences, so at most K + 1 segments with its padding): row b gets K + 1 slots, slot j the
  flat start of its j-th segment, the unused slots the row's end ``(b + 1) * S``, then
  ``cu_seq[B*(K+1)] = B*S``: B*(K+1) + 1 entries. A row with more segments than that stops
  the run (``torch._assert_async``: an error on the CPU, a device-side assert on a GPU)
  rather than merging two sequences;
- without a bound (``prepare`` called on its own), every flat position t contributes the
  start of its segment, ``cu_seq[t] = start(segment of t)`` (a running maximum of segment
  starts), and ``cu_seq[B*S] = B*S``: B*S + 1 entries.

Consecutive equal entries are empty sequences. The kernel launches work for every entry,
so the bound matters: on an H200 (BERT-Large, S=512, K=3) the unbounded form made ``varlen``
the slowest packed row, 0.49x Hugging Face's padding-free varlen through the same kernel,
with about 170x more (mostly empty) sequences than the bounded form's B*4. Both forms have
fixed shapes whatever the data, and ``max_q = max_k = S`` is a static upper bound (it sizes
the kernel's grid; no ``.item()``).

The rule needs each sequence's tokens to be contiguous in its row, as the collators lay
them out (natural token order, sequences one after another, padding last).

Limits, each a one-line :class:`VarlenAttentionError`: CUDA only (there is no CPU
kernel), fp16/bf16 only (Flash; under autocast the projections are already in the
autocast dtype), no attention dropout (``varlen_attn`` has none), torch >= 2.10.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from bert_packed.model.attention import (
    AttentionError,
    AttentionImplementation,
    attention_compute_dtype,
    register_attention,
)

NAME = "varlen"


class VarlenAttentionError(AttentionError):
    """The varlen implementation cannot apply here (one-line message with the fix)."""


def _varlen_kernel():
    """torch's ``varlen_attn``, or one clear line naming the fix (tests substitute a reference)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:  # torch < 2.10 (e.g. the Poplar SDK's torch 2.0.1)
        raise VarlenAttentionError(
            f"attention 'varlen' needs torch.nn.attention.varlen (torch >= 2.10); found torch {torch.__version__}: "
            f"use attention_implementation 'flex', 'sdpa' or 'dense'"
        ) from exc
    return varlen_attn


def cumulative_lengths(sequence_ids: torch.Tensor, max_segments: Optional[int] = None) -> torch.Tensor:
    """int32 cumulative segment boundaries of the flattened batch (see the module docstring):
    ``[B*M + 1]`` with ``M = min(max_segments, S)`` segments a row, or ``[B*S + 1]`` without a bound.

    ``sequence_ids``: int ``[B, S]``. Segment k of the kernel is flat tokens
    ``cu[k] .. cu[k+1]-1``; many segments are empty (``cu[k] == cu[k+1]``).
    """
    if sequence_ids.dim() != 2:
        raise VarlenAttentionError(f"sequence_ids must be [B, S], got shape {tuple(sequence_ids.shape)}")
    if max_segments is not None and (isinstance(max_segments, bool) or not isinstance(max_segments, int)
                                     or max_segments < 1):
        raise VarlenAttentionError(f"max_segments must be a positive int, got {max_segments!r}")
    batch_size, seq_len = sequence_ids.shape
    device = sequence_ids.device
    starts = torch.ones(sequence_ids.shape, dtype=torch.bool, device=device)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    positions = torch.arange(batch_size * seq_len, device=device)
    total = torch.full((1,), batch_size * seq_len, dtype=positions.dtype, device=device)
    if max_segments is None:
        segment_start = torch.cummax(torch.where(starts.reshape(-1), positions, 0), dim=0).values
        return torch.cat([segment_start, total]).to(torch.int32)
    slots = min(max_segments, seq_len)
    segment = torch.cumsum(starts.to(torch.int64), dim=1) - 1  # [B, S]: the segment of each token in its row
    torch._assert_async(segment[:, -1].max() < slots)  # more segments than the bound: stop, never merge two
    row_end = (torch.arange(1, batch_size + 1, device=device) * seq_len)[:, None]  # [B, 1]
    # Column `slots` is a spare that takes every non-start (with the row's end, so all writes
    # there agree); it is dropped after the scatter.
    table = row_end.repeat(1, slots + 1)
    index = torch.where(starts, segment.clamp(max=slots), slots)
    table.scatter_(1, index, torch.where(starts, positions.view(batch_size, seq_len), row_end))
    return torch.cat([table[:, :slots].reshape(-1), total]).to(torch.int32)


def check(*, device: torch.device, dtype: torch.dtype = torch.float32, dropout_p: float = 0.0,
          needs_grad: bool = False) -> None:
    """Raise :class:`VarlenAttentionError` (one line) if varlen cannot run this forward."""
    _varlen_kernel()
    if dropout_p > 0:
        raise VarlenAttentionError(
            f"attention 'varlen' has no attention dropout (torch's varlen_attn lacks it); got "
            f"attention_probs_dropout_prob={dropout_p}: set it to 0 or use attention 'sdpa' or 'dense'"
        )
    device = torch.device(device)
    if device.type != "cuda":
        raise VarlenAttentionError(
            f"attention 'varlen' runs only on a CUDA GPU (torch's varlen_attn is a Flash kernel), not on "
            f"{device.type}: use attention 'dense' or 'sdpa' here"
        )
    compute = attention_compute_dtype(dtype, device)
    if compute not in (torch.float16, torch.bfloat16):
        raise VarlenAttentionError(
            f"attention 'varlen' needs fp16 or bf16 (Flash kernel), but attention runs in {compute}: set "
            f"cuda.precision to bf16 or fp16, or use attention 'flex' or 'sdpa'"
        )


def prepare(sequence_ids: torch.Tensor, *, dtype: Any = None,
            max_sequences: Optional[int] = None) -> Tuple[torch.Tensor, int]:
    """``(cu_seq, max_len)`` of the batch, built once per forward (``dtype`` unused: no float mask);
    ``max_sequences`` (the model's K) bounds a row's segments by K + 1, its padding included."""
    with torch.profiler.record_function("packing/mask"):
        bound = None if max_sequences is None else max_sequences + 1
        return cumulative_lengths(sequence_ids, bound), int(sequence_ids.shape[1])


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prepared, *,
           dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Attention of query/key/value ``[B, heads, S, head_dim]`` within each segment; same shape back.

    Scale 1/sqrt(head_dim) (``varlen_attn``'s default), as in BERT.
    """
    cu_seq, max_len = prepared
    batch_size, num_heads, seq_len, head_dim = query.shape

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, N, S, D] -> [B*S, N, D]
        return t.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim)

    with torch.profiler.record_function("packing/attention"):
        out = _varlen_kernel()(tokens(query), tokens(key), tokens(value), cu_seq, cu_seq, max_len, max_len)
    return out.view(batch_size, seq_len, num_heads, head_dim).transpose(1, 2)


register_attention(
    NAME,
    AttentionImplementation(
        name=NAME,
        prepare=prepare,
        attend=attend,
        check=check,
        description="torch's variable-length (Flash) attention over the pack's sequences (CUDA, fp16/bf16)",
        trains_on=(torch.device("cuda").type,),  # a torch device type
        training_needs="varlen_attn (Flash) kernel",
        dropout=False,
        takes_max_sequences=True,
    ),
)

