"""Packed == unpacked for sequence classification, for all three problem types:
the same per-sequence logits and losses as transformers' unpacked BertForSequenceClassification
(<= 1e-5, fp32), and the same weights after a short fp32 training run on the cpu backend with
the sequence-weighted loss (packed rows vs one sequence per row, with gradient accumulation)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from backends.cpu import CPUBackend
from bert_packed.collate import one_per_pack, sample_lengths
from bert_packed.config import Config
from bert_packed.tasks.classification.data import collate_classification
from bert_packed.tasks.classification.model import BertForSequenceClassification
from bert_packed.loop.plan import make_plan
from bert_packed.optim import build_optimizer
from test_model_fixtures import random_packed_problem, tiny_config, to_torch

TOL = 1e-5
PROBLEMS = ["single_label_classification", "multi_label_classification", "regression"]
FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions")


def labelled_problem(seed: int, problem_type: str, num_labels: int, *, num_packs: int = 4, K: int = 5, S: int = 96):
    samples, assignment = random_packed_problem(seed, num_packs=num_packs, max_sequence_length=S, max_sequences_per_pack=K)
    rng = np.random.default_rng(seed + 100)
    n = len(samples["input_ids"])
    if problem_type == "single_label_classification":
        samples["labels"] = rng.integers(0, num_labels, n)
    elif problem_type == "multi_label_classification":
        samples["labels"] = (rng.random((n, num_labels)) < 0.4).astype(np.float32)
    else:
        samples["labels"] = rng.normal(size=n).astype(np.float32) if num_labels == 1 else \
            rng.normal(size=(n, num_labels)).astype(np.float32)
    return samples, assignment


def batches(samples, assignment, S, K):
    """Packed batch (K per row) and the unpacked batch (one per row) of the same sequences."""
    packed = collate_classification(samples, assignment, max_sequence_length=S, max_sequences_per_pack=K)
    longest = int(sample_lengths(samples).max())
    unpacked = collate_classification(samples, one_per_pack(assignment.sequence_indices),
                                      max_sequence_length=longest, max_sequences_per_pack=1)
    return to_torch(packed), to_torch(unpacked)


@pytest.mark.parametrize("problem_type, num_labels", [(PROBLEMS[0], 3), (PROBLEMS[1], 4), (PROBLEMS[2], 1), (PROBLEMS[2], 2)])
def test_packed_logits_and_per_sequence_losses_match_transformers_unpacked(problem_type, num_labels, one_thread):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(num_labels=num_labels, problem_type=problem_type)
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(**config.to_hf_dict(), attn_implementation="eager")
    hf = transformers.BertForSequenceClassification(hf_config).eval()
    ours = BertForSequenceClassification(config).eval()
    ours.load_hf_state_dict(hf.state_dict())
    samples, assignment = labelled_problem(1, problem_type, num_labels)
    packed, unpacked = batches(samples, assignment, 96, 5)
    present = packed["label_weights"] > 0
    n = int(present.sum())
    hf_labels = unpacked["labels"][:, 0]
    with torch.no_grad():
        reference = hf(input_ids=unpacked["input_ids"], token_type_ids=unpacked["segment_ids"],
                       attention_mask=(unpacked["sequence_ids"] > 0).long(), labels=hf_labels)
        together = ours(**packed)
        alone = ours(**unpacked)
        # Each sequence's own loss: transformers on that row alone vs ours with only its slot weighted.
        per_sequence = []
        slots = torch.nonzero(present)[:6]
        for i, (b, k) in enumerate(slots.tolist()):
            weights = torch.zeros_like(packed["label_weights"])
            weights[b, k] = 1.0
            ours_loss = ours(**{**packed, "label_weights": weights})["loss"]
            row = i  # packed slots in pack order are the unpacked rows in order
            hf_loss = hf(input_ids=unpacked["input_ids"][row:row + 1], token_type_ids=unpacked["segment_ids"][row:row + 1],
                         attention_mask=(unpacked["sequence_ids"][row:row + 1] > 0).long(),
                         labels=hf_labels[row:row + 1]).loss
            per_sequence.append(abs(ours_loss.item() - hf_loss.item()))
    assert hf.config.problem_type == problem_type
    assert (together["logits"][present] - reference.logits).abs().max().item() <= TOL
    assert (alone["logits"][:, 0] - reference.logits).abs().max().item() <= TOL
    assert abs(together["loss"].item() - reference.loss.item()) <= TOL  # sequence-weighted mean
    assert max(per_sequence) <= TOL
    assert together["num_sequences"].item() == n == len(reference.logits)
    if problem_type == "regression":
        assert "accuracy" not in together and reference.loss.item() > 0  # never a silent zero loss


def train_weights(model, micro_batches_per_step):
    """Parameters after one cpu-backend AdamW step per entry of ``micro_batches_per_step``."""
    model = copy.deepcopy(model)
    config = Config()
    optimizer = build_optimizer(model, "adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    backend = CPUBackend()
    backend.prepare(model, optimizer, make_plan(config, backend))
    losses = [backend.train_step(step)["loss"] for step in micro_batches_per_step]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


@pytest.mark.parametrize("problem_type, num_labels", [(PROBLEMS[0], 3), (PROBLEMS[1], 3), (PROBLEMS[2], 1)])
def test_packed_and_unpacked_training_reach_the_same_weights(problem_type, num_labels, one_thread):
    """Three optimizer steps over the same sequences: packed rows (one micro-batch) vs one
    sequence per row split over two micro-batches (accumulation). Same loss, same weights."""
    config = tiny_config(num_labels=num_labels, problem_type=problem_type)
    torch.manual_seed(1)
    model = BertForSequenceClassification(config)
    packed_steps, unpacked_steps = [], []
    for step in range(3):
        samples, assignment = labelled_problem(10 + step, problem_type, num_labels, num_packs=3)
        packed, unpacked = batches(samples, assignment, 96, 5)
        packed_steps.append([{k: v.numpy() for k, v in packed.items()}])
        half = unpacked["input_ids"].shape[0] // 2
        unpacked_steps.append([{k: v[:half].numpy() for k, v in unpacked.items()},
                               {k: v[half:].numpy() for k, v in unpacked.items()}])
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    packed_weights, packed_losses = train_weights(model, packed_steps)
    unpacked_weights, unpacked_losses = train_weights(model, unpacked_steps)
    assert (packed_weights - before).abs().max().item() > 1e-4  # the run did move the weights
    np.testing.assert_allclose(packed_losses, unpacked_losses, rtol=0, atol=TOL)
    assert (packed_weights - unpacked_weights).abs().max().item() <= TOL
