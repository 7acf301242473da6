"""Block-sparse packed attention: FlexAttention with a per-pack document mask.

In a pack, token i may attend to token j iff both belong to the same sequence
(``sequence_ids`` equal and non-zero). The dense implementation adds a [B, S, S] mask
to every score and so still computes every score; FlexAttention computes scores only
for the 128x128 tiles that hold at least one allowed pair, skips the others, and
skips even the mask function on tiles that are entirely allowed. On Wikipedia-length
packs at S=512, depth 3, it computes about 91 % of the tiles (128-token tiles are coarse
next to sequences of ~250 tokens); on padded rows it skips the padding, about half
(measured with benchmarks/cuda_throughput.py --tiles-only; see docs/benchmarks/cuda.md).

Registered in the attention registry as ``"flex"``. The model calls ``prepare`` once
per forward (the block mask is built once per batch and shared by all layers) and
``attend`` once per layer.

The block mask is built here with plain vectorised tensor ops from ``sequence_ids``
(one [B, S, S] comparison, then a per-tile any/all reduction) rather than with
``create_block_mask``, whose vmap over the mask function is the cost that users
report dominating document-mask FlexAttention; the result is the same BlockMask
(tested against ``create_block_mask``). All shapes depend only on [B, S] and the block
size, so ``torch.compile`` sees the same graph every step (no recompiles).

This module needs torch >= 2.5 (``torch.nn.attention.flex_attention``); it is
imported only when the ``flex`` implementation is asked for, never by the IPU path.
Limits, each raising :class:`FlexAttentionError` with one line:

- attention dropout: FlexAttention has no post-softmax dropout (pytorch issue 141784),
  and dropping keys before the softmax is a different model, so ``dropout_p > 0`` in
  training is refused (set ``attention_probs_dropout_prob: 0`` or use ``dense``/``sdpa``);
- backward on CPU: torch implements FlexAttention's backward only on GPUs;
- on CPU the forward runs torch's unfused reference (correct, not fast): it is there so
  the implementation can be checked anywhere.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Tuple

import torch

from bert_packed.model.attention import AttentionError, AttentionImplementation, register_attention

NAME = "flex"
DEFAULT_BLOCK_SIZE = 128  # FlexAttention's default tile; the CUDA kernels are tuned for it


class FlexAttentionError(AttentionError):
    """The flex attention implementation cannot apply here (one-line message with the fix)."""


def _flex_module():
    """Import torch's FlexAttention, or raise one clear line naming the fix."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError as exc:  # torch < 2.5 (e.g. the Poplar SDK's torch 2.0.1)
        raise FlexAttentionError(
            f"attention 'flex' needs torch >= 2.5 (torch.nn.attention.flex_attention); found torch "
            f"{torch.__version__}: use attention_implementation 'dense' or 'sdpa'"
        ) from exc
    return module


def is_available() -> bool:
    """True when this torch has FlexAttention (its forward runs on CPU and GPU, backward on GPU)."""
    try:
        _flex_module()
    except FlexAttentionError:
        return False
    return True


def document_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """Token-level mask of a packed batch.

    sequence_ids: int [B, S], 1..K = sequence of the pack, 0 = padding.
    Returns bool [B, S, S]: ``[b, i, j]`` is True iff query i may attend to key j, i.e.
    both tokens belong to the same (non-padding) sequence. Padding queries attend to
    nothing (FlexAttention then returns 0 for them).
    """
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    return same & (sequence_ids != 0)[:, :, None]


def block_structure(sequence_ids: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> Tuple[torch.Tensor, torch.Tensor]:
    """Classify the block_size x block_size tiles of the document mask.

    Returns ``(partial, full)``, two bool tensors [B, num_blocks, num_blocks] with
    num_blocks = ceil(S / block_size): ``full`` tiles have every pair allowed (no mask
    function needed), ``partial`` tiles have some but not all pairs allowed. Tiles that
    are neither are skipped entirely. A tile running past S is never full, so the mask
    function (which knows S) decides its edge.
    """
    if block_size < 1:
        raise FlexAttentionError(f"flex block_size must be >= 1, got {block_size}")
    batch_size, seq_len = sequence_ids.shape
    num_blocks = -(-seq_len // block_size)
    pad = num_blocks * block_size - seq_len
    allowed = document_mask(sequence_ids)
    if pad:
        allowed = torch.nn.functional.pad(allowed, (0, pad, 0, pad))
    tiles = allowed.view(batch_size, num_blocks, block_size, num_blocks, block_size)
    num_allowed = tiles.sum(dim=(2, 4), dtype=torch.int32)
    full = num_allowed == block_size * block_size
    partial = (num_allowed > 0) & ~full
    return partial, full


def _ordered(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[B, Qb, Kb] bool -> (count [B, 1, Qb], indices [B, 1, Qb, Kb]) in BlockMask's layout.

    BlockMask stores, per query tile, how many key tiles are active and their indices
    first (stable order keeps ascending tile order, which is what create_block_mask does).
    """
    as_int = blocks.to(torch.int32)
    counts = as_int.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), indices[:, None].contiguous()


def build_block_mask(sequence_ids: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE):
    """The FlexAttention BlockMask of a packed batch (shared by every layer and head).

    sequence_ids: int [B, S] on the device the attention runs on. The mask function
    closes over a copy padded to a whole number of tiles, so the kernel's edge tile never
    indexes past the end.
    """
    flex = _flex_module()
    if sequence_ids.dim() != 2:
        raise FlexAttentionError(f"sequence_ids must be [B, S], got shape {tuple(sequence_ids.shape)}")
    seq_len = sequence_ids.shape[1]
    partial, full = block_structure(sequence_ids, block_size)
    num_blocks = partial.shape[-1]
    ids = torch.nn.functional.pad(sequence_ids, (0, num_blocks * block_size - seq_len))

    def same_sequence(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] != 0)

    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return flex.BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=block_size,
        mask_mod=same_sequence,
        seq_lengths=(seq_len, seq_len),
    )


def active_block_fraction(sequence_ids: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Fraction of score tiles FlexAttention computes (partial + full) for this batch.

    1.0 means no saving over dense attention; the saving in score work is 1 - this.
    """
    partial, full = block_structure(sequence_ids, block_size)
    return float((partial | full).float().mean())


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    # Compiled once per process: without torch.compile, flex_attention runs an unfused
    # reference that materialises every score (no block skipping). dynamic=False: shapes
    # are fixed [B, S] packs, and a static graph is what lets the backend assert zero
    # recompiles after warm-up.
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def _eager_flex_attention(query, key, value, block_mask):
    # CPU only: torch warns that the unfused path is slow, which here is the point
    # (a correctness path); keep that warning out of the user's log.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return _flex_module().flex_attention(query, key, value, block_mask=block_mask)


def check(*, device: torch.device, dtype: torch.dtype = torch.float32, dropout_p: float = 0.0,
          needs_grad: bool = False) -> None:
    """Raise :class:`FlexAttentionError` (one line) if flex cannot run this forward.

    Called by the model once per forward before :func:`prepare`; ``dropout_p`` is the
    attention dropout that will actually be applied (0 in eval).
    """
    _flex_module()
    if dropout_p > 0:
        raise FlexAttentionError(
            f"attention 'flex' has no attention dropout (FlexAttention lacks it); got "
            f"attention_probs_dropout_prob={dropout_p}: set it to 0 or use attention 'sdpa' or 'dense'"
        )
    if torch.device(device).type == "cpu" and needs_grad:
        raise FlexAttentionError(
            "attention 'flex' cannot train on CPU (torch has no FlexAttention backward there): "
            "run on a GPU (--backend cuda) or use attention 'dense' or 'sdpa' on CPU"
        )


def prepare(sequence_ids: torch.Tensor, *, dtype: Any = None, block_size: int = DEFAULT_BLOCK_SIZE):
    """Build the batch's BlockMask once per forward; every layer and head reuses it.

    ``dtype`` is accepted for the registry's signature and unused (the mask is boolean).
    """
    with torch.profiler.record_function("packing/mask"):
        return build_block_mask(sequence_ids, block_size)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prepared, *,
           dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Attention of query/key/value [B, heads, S, head_dim] within each packed sequence.

    ``prepared`` is the BlockMask from :func:`prepare`. Returns [B, heads, S, head_dim];
    rows of padding tokens are 0. Scale 1/sqrt(head_dim), as in BERT.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    check(device=query.device, dtype=query.dtype, dropout_p=dropout_p if training else 0.0, needs_grad=needs_grad)
    with torch.profiler.record_function("packing/attention"):
        if torch.compiler.is_compiling():
            # Inside a compiled model: traced and fused with the rest of the graph.
            return _flex_module().flex_attention(query, key, value, block_mask=prepared)
        if query.device.type == "cpu":
            # Not differentiating (checked above): torch refuses any CPU input that
            # merely has requires_grad set, even under no_grad, so detach them.
            return _eager_flex_attention(query.detach(), key.detach(), value.detach(), prepared)
        return _compiled_flex_attention()(query, key, value, block_mask=prepared)


register_attention(
    NAME,
    AttentionImplementation(
        name=NAME,
        prepare=prepare,
        attend=attend,
        check=check,
        description="FlexAttention document mask: skips the tiles between sequences (GPU; CPU forward only)",
        trains_on=(torch.device("cuda").type,),  # a torch device type
        training_needs="FlexAttention backward",
        dropout=False,
    ),
)

