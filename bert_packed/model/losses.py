"""Per-sequence losses and metrics for packed BERT, vectorised over the K sequence slots.

Every loss and metric is a *sum over the step* divided by a *count over the step*:

* MLM, ``token`` normalisation (canonical BERT): sum of the masked-token cross-entropies
  divided by the number of masked tokens;
* MLM, ``sequence`` normalisation (the paper's Listing 1): each sequence's mean
  cross-entropy over its own masked tokens, summed, divided by the number of sequences
  that have at least one masked token;
* NSP: sum of the per-sequence cross-entropies divided by the number of sequences.

Accuracies use the same numerators with "correct" in place of the cross-entropy. The
functions below return per-pack numerators ``[B]`` and per-pack counts ``[B]``; the model
divides them by a normaliser (the step's global count when the batch carries
``mlm_normalizer`` / ``nsp_normalizer``, else the batch's own count). With the global
count, summing the losses (and gradients) of all micro-batches and replicas of one
optimizer step gives exactly the loss (and gradient) of the unpacked step.

No Python loop over sequences and no data-dependent shapes: sequences are selected with a
``[B, K, M]`` one-hot comparison, which is fixed-shape and compiles for the IPU.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "MLM_LOSS_NORMALIZATIONS",
    "mlm_loss_terms",
    "nsp_loss_terms",
    "normalize",
    "step_counts",
    "add_step_normalizers",
    "add_sequence_normalizer",
    "metric_keys",
    "step_normalizers",
]

MLM_LOSS_NORMALIZATIONS = ("token", "sequence")


def _sequence_selection(sequence_ids: torch.Tensor, max_sequences_per_pack: int, dtype: torch.dtype) -> torch.Tensor:
    """One-hot ``[B, K, M]``: entry (b, k, m) is 1 where slot m belongs to sequence k+1 of pack b."""
    slots = torch.arange(1, max_sequences_per_pack + 1, device=sequence_ids.device)
    return (sequence_ids[:, None, :] == slots[None, :, None]).to(dtype)


def mlm_loss_terms(
    logits: torch.Tensor,
    labels: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    max_sequences_per_pack: int,
    normalization: str,
) -> Dict[str, torch.Tensor]:
    """Per-pack MLM loss and accuracy numerators and counts.

    Args:
        logits: ``[B, M, V]`` scores at the masked slots.
        labels: ``[B, M]`` original tokens (any valid id in unused slots).
        sequence_ids: ``[B, M]`` owning sequence 1..K, 0 for an unused slot.
        max_sequences_per_pack: K.
        normalization: ``"token"`` or ``"sequence"``.

    Returns a dict of ``[B]`` float tensors: ``loss_sum`` and ``correct_sum`` (numerators),
    ``count`` (the denominator's share of this pack: masked tokens for ``token``, sequences
    with at least one masked token for ``sequence``), ``num_tokens`` (masked tokens) and
    ``num_correct`` (correctly predicted masked tokens).
    """
    if normalization not in MLM_LOSS_NORMALIZATIONS:
        raise ValueError(f"mlm_loss_normalization must be one of {MLM_LOSS_NORMALIZATIONS}, got {normalization!r}")
    num_packs, num_slots, vocab_size = logits.shape
    dtype = torch.float32
    valid = (sequence_ids > 0).to(dtype)  # [B, M]
    # Cross entropy in the logits' own precision, the per-token losses then in fp32 (Graphcore's
    # BERT): no fp32 copy of the [B, M, V] logits, the largest activation of IPU 0 in fp16.
    # (CUDA autocast runs cross_entropy in fp32 itself.)
    nll = F.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1), reduction="none").float()
    nll = nll.view(num_packs, num_slots) * valid
    correct = (logits.argmax(dim=-1) == labels).to(dtype) * valid
    num_tokens = valid.sum(dim=1)
    num_correct = correct.sum(dim=1)
    if normalization == "token":
        return {"loss_sum": nll.sum(dim=1), "correct_sum": num_correct, "count": num_tokens, "num_tokens": num_tokens, "num_correct": num_correct}

    # "sequence": un-pack the per-token terms into [B, K] per-sequence means (Listing 1).
    selection = _sequence_selection(sequence_ids, max_sequences_per_pack, dtype)  # [B, K, M]
    tokens_per_sequence = selection.sum(dim=-1)  # [B, K]
    # A sequence without masked tokens contributes 0 / 1 = 0 and is not counted below.
    denominator = tokens_per_sequence.clamp(min=1.0)
    nll_per_sequence = torch.bmm(selection, nll[:, :, None])[..., 0] / denominator
    correct_per_sequence = torch.bmm(selection, correct[:, :, None])[..., 0] / denominator
    return {
        "loss_sum": nll_per_sequence.sum(dim=1),
        "correct_sum": correct_per_sequence.sum(dim=1),
        "count": (tokens_per_sequence > 0).to(dtype).sum(dim=1),
        "num_tokens": num_tokens,
        "num_correct": num_correct,
    }


def nsp_loss_terms(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-pack NSP (or any per-sequence classification) numerators and counts.

    Args:
        logits: ``[B, K, C]`` one row of class scores per sequence slot.
        labels: ``[B, K]`` class per sequence (any valid class in empty slots).
        weights: ``[B, K]`` 1.0 where sequence k exists, 0.0 for an empty slot.

    Returns ``[B]`` float tensors ``loss_sum``, ``correct_sum``, ``count`` (sequences).
    """
    num_packs, num_slots, num_classes = logits.shape
    weights = weights.float()
    nll = F.cross_entropy(logits.reshape(-1, num_classes).float(), labels.reshape(-1), reduction="none")
    nll = nll.view(num_packs, num_slots) * weights
    correct = (logits.argmax(dim=-1) == labels).float() * weights
    return {"loss_sum": nll.sum(dim=1), "correct_sum": correct.sum(dim=1), "count": weights.sum(dim=1)}


def normalize(per_pack_sum: torch.Tensor, count: torch.Tensor, normalizer: Optional[torch.Tensor]) -> torch.Tensor:
    """``sum_b per_pack_sum[b] / normalizer[b]`` (a scalar).

    ``normalizer`` ``[B]`` is the step's global count carried by every pack; ``None`` means
    "this batch is the whole step" and uses the batch's own count. Dividing per pack, not by
    one scalar, keeps the value right when PopTorch splits the host batch into micro-batches.
    A count of 0 (no masked token anywhere) is treated as 1 so the loss is 0, not NaN.
    """
    if normalizer is None:
        normalizer = count.sum().expand_as(per_pack_sum)
    return (per_pack_sum / normalizer.to(per_pack_sum.dtype).clamp(min=1.0)).sum()


# ----------------------------------------------------------------------------- step counts


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def step_counts(micro_batches: Sequence[Mapping[str, object]], normalization: str = "token") -> Tuple[float, float]:
    """Global ``(mlm_count, nsp_count)`` of one optimizer step over ``micro_batches``.

    ``mlm_count`` is the number of masked tokens (``token``) or of sequences with at least
    one masked token (``sequence``); ``nsp_count`` the number of sequences. For data
    parallelism, all-reduce (sum) these two numbers across ranks and pass them to
    ``add_step_normalizers(..., totals=...)``.
    """
    if normalization not in MLM_LOSS_NORMALIZATIONS:
        raise ValueError(f"mlm_loss_normalization must be one of {MLM_LOSS_NORMALIZATIONS}, got {normalization!r}")
    mlm_count = 0.0
    nsp_count = 0.0
    for batch in micro_batches:
        mlm_sequence_ids = _as_numpy(batch["mlm_sequence_ids"])
        if normalization == "token":
            mlm_count += float((mlm_sequence_ids > 0).sum())
        else:
            num_slots = int(_as_numpy(batch["nsp_weights"]).shape[1])
            slots = np.arange(1, num_slots + 1)
            present = (mlm_sequence_ids[:, :, None] == slots[None, None, :]).any(axis=1)  # [B, K]
            mlm_count += float(present.sum())
        nsp_count += float(_as_numpy(batch["nsp_weights"]).sum())
    return mlm_count, nsp_count


def add_step_normalizers(
    micro_batches: Sequence[MutableMapping[str, object]],
    normalization: str = "token",
    *,
    totals: Optional[Tuple[float, float]] = None,
    all_reduce: Optional[Callable[[torch.Tensor], object]] = None,
) -> List[MutableMapping[str, object]]:
    """Set ``mlm_normalizer`` and ``nsp_normalizer`` (float32 ``[B]``) in every micro-batch.

    All packs of the step get the same value: the step's global count (``totals`` =
    ``(mlm_count, nsp_count)`` if given, else ``step_counts(micro_batches, normalization)``
    of these micro-batches, summed over processes by ``all_reduce`` when given: a function
    that sums a float64 tensor in place across data-parallel ranks / replicas' hosts).
    The fields take the type of ``input_ids`` (torch tensor on its device, or numpy).
    Modifies the dicts in place and returns the list.
    """
    if totals is None:
        totals = _summed(step_counts(micro_batches, normalization), all_reduce)
    mlm_count, nsp_count = totals
    return _set_per_pack(micro_batches, {"mlm_normalizer": mlm_count, "nsp_normalizer": nsp_count})


def add_sequence_normalizer(
    micro_batches: Sequence[MutableMapping[str, object]],
    weight_field: str = "label_weights",
    field: str = "normalizer",
    *,
    all_reduce: Optional[Callable[[torch.Tensor], object]] = None,
) -> List[MutableMapping[str, object]]:
    """Set ``field`` (float32 ``[B]``) in every micro-batch to the step's sequence count.

    The count is ``weight_field`` summed over ``micro_batches`` (and over processes by
    ``all_reduce``, as in ``add_step_normalizers``): with it each micro-batch's loss is its
    share of the step's per-sequence mean. Modifies the dicts in place and returns the list.
    """
    (count,) = _summed((float(sum(float(_as_numpy(b[weight_field]).sum()) for b in micro_batches)),), all_reduce)
    return _set_per_pack(micro_batches, {field: count})


def _summed(counts: Tuple[float, ...], all_reduce: Optional[Callable[[torch.Tensor], object]]) -> Tuple[float, ...]:
    """``counts`` summed over processes by ``all_reduce`` (in place on a float64 tensor), if given."""
    if all_reduce is None:
        return counts
    total = torch.tensor(counts, dtype=torch.float64)  # host numbers: the counts come from the numpy batches
    all_reduce(total)
    return tuple(total.numpy().tolist())


def _set_per_pack(micro_batches: Sequence[MutableMapping[str, object]],
                  values: Mapping[str, float]) -> List[MutableMapping[str, object]]:
    """Set every ``values`` field (float32 ``[B]``, every pack the same value) in every micro-batch,
    as a torch tensor on ``input_ids``' device or as numpy like ``input_ids``."""
    for batch in micro_batches:
        reference = batch["input_ids"]
        num_packs = int(reference.shape[0])
        for name, value in values.items():
            if isinstance(reference, torch.Tensor):
                batch[name] = torch.full((num_packs,), value, dtype=torch.float32, device=reference.device)
            else:
                batch[name] = np.full((num_packs,), value, dtype=np.float32)
    return list(micro_batches)


# ----------------------------------------------------------------------------- per model

# Pre-training's keys, for a model that declares none.
PRETRAINING_METRICS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
PRETRAINING_COUNTS = ("num_sequences", "num_mlm_tokens")


def metric_keys(model) -> Tuple[str, ...]:
    """The output keys every backend sums over micro-batches and replicas: the model's
    ``metric_names`` (normalised by the step's global counts, so their sum is the step's mean)
    then its ``count_names`` (this batch's counts); see ``modeling.BertPreTrainedModel``."""
    return tuple(model.metric_names) + tuple(model.count_names)


def step_normalizers(model, micro_batches, *, all_reduce=None) -> List[MutableMapping[str, object]]:
    """Copies of one step's ``micro_batches`` carrying the step's global counts as ``model``
    wants them (its ``add_step_normalizers``)."""
    return model.add_step_normalizers([dict(b) for b in micro_batches], all_reduce=all_reduce)
