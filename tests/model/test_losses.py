"""Per-sequence losses and metrics against a plain per-sequence Python reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bert_packed.model.losses import add_step_normalizers, mlm_loss_terms, normalize, nsp_loss_terms, step_counts

K, M, V = 5, 12, 11


def random_terms(seed: int, num_packs: int = 6):
    """Random MLM logits/labels with slots owned by sequences 1..k per pack (some slots unused)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    logits = torch.randn(num_packs, M, V, generator=gen)
    labels = torch.randint(0, V, (num_packs, M), generator=gen)
    sequence_ids = np.zeros((num_packs, M), dtype=np.int64)
    nsp_weights = np.zeros((num_packs, K), dtype=np.float32)
    for b in range(num_packs):
        k = int(rng.integers(1, K + 1))
        nsp_weights[b, :k] = 1
        used = int(rng.integers(0, M + 1))
        sequence_ids[b, :used] = np.sort(rng.integers(1, k + 1, used))  # some sequences may get no masked token
    # Make some predictions right so accuracies are non-trivial.
    right = torch.from_numpy(rng.random((num_packs, M)) < 0.4)
    labels = torch.where(right, logits.argmax(-1), labels)
    return logits, labels, torch.from_numpy(sequence_ids), torch.from_numpy(nsp_weights)


def reference_mlm(logits, labels, sequence_ids, normalization):
    """(loss, accuracy) with an explicit loop over packs and sequences."""
    per_token, per_sequence = [], []
    for b in range(logits.shape[0]):
        for k in range(1, K + 1):
            slots = [m for m in range(M) if sequence_ids[b, m] == k]
            if not slots:
                continue
            nll = [F.cross_entropy(logits[b, m][None], labels[b, m][None]).item() for m in slots]
            hit = [float(logits[b, m].argmax() == labels[b, m]) for m in slots]
            per_token += list(zip(nll, hit))
            per_sequence.append((np.mean(nll), np.mean(hit)))
    rows = per_token if normalization == "token" else per_sequence
    return float(np.mean([r[0] for r in rows])), float(np.mean([r[1] for r in rows]))


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_mlm_terms_match_a_per_sequence_loop(normalization):
    logits, labels, sequence_ids, _ = random_terms(0)
    terms = mlm_loss_terms(logits, labels, sequence_ids, max_sequences_per_pack=K, normalization=normalization)
    loss = normalize(terms["loss_sum"], terms["count"], None).item()
    accuracy = normalize(terms["correct_sum"], terms["count"], None).item()
    expected_loss, expected_accuracy = reference_mlm(logits, labels, sequence_ids, normalization)
    assert abs(loss - expected_loss) <= 1e-5
    assert abs(accuracy - expected_accuracy) <= 1e-6
    assert terms["num_tokens"].sum().item() == (sequence_ids > 0).sum().item()


def test_token_and_sequence_normalisation_differ_when_sequences_differ_in_masked_counts():
    logits, labels, sequence_ids, _ = random_terms(1)
    token = mlm_loss_terms(logits, labels, sequence_ids, max_sequences_per_pack=K, normalization="token")
    sequence = mlm_loss_terms(logits, labels, sequence_ids, max_sequences_per_pack=K, normalization="sequence")
    assert abs(normalize(token["loss_sum"], token["count"], None) - normalize(sequence["loss_sum"], sequence["count"], None)) > 1e-4


def test_nsp_terms_match_a_loop():
    gen = torch.Generator().manual_seed(2)
    _, _, _, weights = random_terms(2)
    logits = torch.randn(weights.shape[0], K, 2, generator=gen)
    labels = torch.randint(0, 2, weights.shape, generator=gen)
    terms = nsp_loss_terms(logits, labels, weights)
    present = weights > 0
    expected = F.cross_entropy(logits[present], labels[present]).item()
    assert abs(normalize(terms["loss_sum"], terms["count"], None).item() - expected) <= 1e-6
    expected_accuracy = (logits[present].argmax(-1) == labels[present]).float().mean().item()
    assert abs(normalize(terms["correct_sum"], terms["count"], None).item() - expected_accuracy) <= 1e-6


def test_empty_step_gives_zero_not_nan():
    logits = torch.randn(2, M, V)
    terms = mlm_loss_terms(logits, torch.zeros(2, M, dtype=torch.long), torch.zeros(2, M, dtype=torch.long), max_sequences_per_pack=K, normalization="sequence")
    assert normalize(terms["loss_sum"], terms["count"], None).item() == 0.0


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_step_normalizers_make_micro_batch_losses_sum_to_the_step_loss(normalization):
    logits, labels, sequence_ids, weights = random_terms(3, num_packs=9)
    whole = mlm_loss_terms(logits, labels, sequence_ids, max_sequences_per_pack=K, normalization=normalization)
    step_loss = normalize(whole["loss_sum"], whole["count"], None).item()
    micro = [
        {"input_ids": torch.zeros(b - a, 4, dtype=torch.long), "mlm_sequence_ids": sequence_ids[a:b], "nsp_weights": weights[a:b]}
        for a, b in ((0, 1), (1, 5), (5, 9))
    ]
    add_step_normalizers(micro, normalization)
    total = 0.0
    for (a, b), mb in zip(((0, 1), (1, 5), (5, 9)), micro):
        terms = mlm_loss_terms(logits[a:b], labels[a:b], sequence_ids[a:b], max_sequences_per_pack=K, normalization=normalization)
        assert mb["mlm_normalizer"].shape == (b - a,) and mb["mlm_normalizer"].dtype == torch.float32
        total += normalize(terms["loss_sum"], terms["count"], mb["mlm_normalizer"]).item()
    assert abs(total - step_loss) <= 1e-5
    # Counts are what the loop reference counts.
    mlm_count, nsp_count = step_counts(micro, normalization)
    expected = (sequence_ids > 0).sum().item() if normalization == "token" else len({(b, int(s)) for b, row in enumerate(sequence_ids) for s in row if s > 0})
    assert mlm_count == expected and nsp_count == weights.sum().item()


def test_normalizers_on_numpy_batches_and_given_totals():
    batch = {"input_ids": np.zeros((3, 8), np.int64), "mlm_sequence_ids": np.ones((3, 4), np.int64), "nsp_weights": np.ones((3, 2), np.float32)}
    add_step_normalizers([batch], "token", totals=(100.0, 7.0))
    assert isinstance(batch["mlm_normalizer"], np.ndarray) and batch["mlm_normalizer"].tolist() == [100.0] * 3
    assert batch["nsp_normalizer"].tolist() == [7.0] * 3
    with pytest.raises(ValueError, match="mlm_loss_normalization"):
        step_counts([batch], "pack")
