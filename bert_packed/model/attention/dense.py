"""``dense``: softmax attention written out (scores, the additive block-diagonal mask, softmax,
dropout, weighted sum). Runs everywhere, the IPU included (only torch 2.0 operations)."""
from __future__ import annotations

import math

import torch

from bert_packed.model.attention.registry import AttentionImplementation, prepare_additive_mask, profiler_scope, register_attention
from bert_packed.model.dropout import dropout

def dense_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prepared: torch.Tensor,
    *,
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """Softmax attention written out: scores, additive mask, softmax, dropout, weighted sum.

    Shapes: query/key/value ``[B, N, S, D]``, ``prepared`` the ``[B, 1, S, S]`` mask;
    returns ``[B, N, S, D]``. Only torch 2.0 operations (the IPU path compiles this).
    """
    # Scaling the query (B*N*S*D values) is cheaper than scaling the scores (B*N*S*S).
    query = query * (1.0 / math.sqrt(query.shape[-1]))
    scores = torch.matmul(query, key.transpose(-1, -2))
    with profiler_scope("packing/attention"):
        scores = scores + prepared
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0 and training:
        probs = dropout(probs, dropout_p, training=True)
    return torch.matmul(probs, value)


register_attention(
    "dense",
    AttentionImplementation(
        name="dense",
        prepare=prepare_additive_mask,
        attend=dense_attend,
        description="explicit additive block-diagonal mask; runs everywhere, including the IPU",
        keeps_scores=True,
    ),
)
