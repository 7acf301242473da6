"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with the same additive
block-diagonal mask as ``dense``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bert_packed.model.attention.registry import AttentionImplementation, prepare_additive_mask, register_attention

def sdpa_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prepared: torch.Tensor,
    *,
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the same additive block-diagonal mask.

    Why an additive mask in the scores' dtype rather than a boolean one: no sdpa kernel takes
    a boolean mask as such. torch (2.5 to 2.13, ``aten/.../transformers/attention.cpp``)
    converts a boolean mask to an additive one of the query's dtype inside every call (so
    once per layer here; -inf, or -65504 for cuDNN), and CUDA's Flash kernel accepts no
    mask at all (``sdp_utils.cpp``, ``check_for_attn_mask``): with any mask, sdpa runs the
    cuDNN, memory-efficient or math kernel on a GPU. Building the additive mask once per
    forward in the right dtype is the cheapest form; the mask must match the query's dtype
    exactly (or sdpa refuses it), which :func:`attention_compute_dtype` ensures under autocast.
    Packed attention reaches Flash-class kernels only without a dense mask: ``flex``
    (block-sparse) or ``varlen`` (cumulative sequence lengths).

    The mask is applied inside the fused kernel and cannot be timed on its own, so there is
    no "packing/attention" scope here (an unpacked batch pays for the same padding mask).
    """
    return F.scaled_dot_product_attention(query, key, value, attn_mask=prepared, dropout_p=dropout_p if training else 0.0)


register_attention(
    "sdpa",
    AttentionImplementation(
        name="sdpa",
        prepare=prepare_additive_mask,
        attend=sdpa_attend,
        description="torch scaled_dot_product_attention with the additive block-diagonal mask",
        keeps_scores=True,  # no kernel without scores takes a mask (sdpa_attend)
    ),
)
