"""Attention implementations for packed BERT: one signature, a small registry.

A pack holds several sequences side by side; token i may attend to token j only if both
belong to the same sequence (equal, non-zero ``sequence_ids``). Every implementation
enforces exactly that block-diagonal rule, so packed and unpacked runs compute the same
thing. An unpacked batch is a pack with one sequence: the same rule is then the usual
key-padding mask.

An implementation is two plain functions:

* ``prepare(sequence_ids, *, dtype) -> prepared`` runs once per forward (the mask or
  block mask is built once per batch, not once per layer); ``dtype`` is the activations'
  dtype, and an implementation that builds a float mask builds it in the dtype the scores
  will have (autocast's when autocast is on: :func:`attention_compute_dtype`). One that
  sets ``takes_max_sequences`` is also given ``max_sequences=K``, the model's
  ``max_sequences_per_pack`` (validated batches hold at most K sequences a row), as a static
  bound on the sequences of a row;
* ``attend(query, key, value, prepared, *, dropout_p, training) -> context`` runs in
  every layer, on ``[B, num_heads, S, head_dim]`` tensors, and returns the same shape.

and an optional ``check(*, device, dtype, dropout_p, needs_grad)`` that raises
``AttentionError`` when the implementation cannot do what is asked (for example a
FlexAttention backward on a CPU, or attention dropout it does not support): asking for
something impossible is an error, never a silent fallback that could leak attention
across sequences.

One module of this package per implementation, each registering itself: ``dense.py``
(explicit additive mask, softmax, matmul; runs everywhere, including the IPU through PopTorch
with torch 2.0) and ``sdpa.py`` (``torch.nn.functional.scaled_dot_product_attention`` with the
same mask), imported with the package. Every query
row of their mask allows at least one key (padding attends to padding), so no kernel
ever sees a fully masked row, and masked pairs get a finite value in the scores' dtype:
padding rows stay finite in fp32, bf16 and fp16. The GPU implementations live in
``bert_packed/model/attention/flex.py`` (block-sparse FlexAttention) and
``bert_packed/model/attention/varlen.py`` (torch's variable-length Flash attention) and
register themselves with ``register_attention``; they are found on disk and imported lazily
on lookup, so that this package imports on a CPU-only torch 2.0. ``bert_packed/model/attention/bucketed.py``
(``bucketed``: the sequences of a batch in a few padded length buckets, one sdpa call per
bucket, so the masked scores between sequences are never computed) registers the same way;
its shapes depend on the batch, so it is for eager CPU/CUDA runs, not the IPU or torch.compile.
"""
from bert_packed.model.attention.registry import (  # noqa: F401  (the registry's names, from the package)
    ATTENTION_IMPLEMENTATIONS,
    AttentionError,
    AttentionImplementation,
    prepare_additive_mask,
    attention_compute_dtype,
    available_attention_implementations,
    block_diagonal_additive_mask,
    block_diagonal_allowed,
    find_attention,
    get_attention,
    list_attention_implementations,
    mask_value,
    no_profiler_scopes,
    profiler_scope,
    register_attention,
    set_profiler_scopes,
)
# The implementations every machine has, registered as they are imported; the others are found
# on disk by the registry and imported on lookup.
from bert_packed.model.attention.dense import dense_attend  # noqa: F401
from bert_packed.model.attention.sdpa import sdpa_attend  # noqa: F401
from bert_packed.model.attention.registry import __all__ as _registry_names

__all__ = list(_registry_names) + ["dense_attend", "sdpa_attend"]
