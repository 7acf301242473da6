"""Collation against a per-pack Python reference; validation rejects inconsistent batches."""
from __future__ import annotations

import numpy as np
import pytest

from bert_packed.collate import (
    BatchError,
    PackSlice,
    collate,
    collate_unpacked,
    masked_tokens_per_pack,
    sample_lengths,
    slice_assignment,
    validate_batch,
)
from test_model_fixtures import random_packed_problem, tiny_config

S, K, M = 128, 16, 120


def reference_collate(samples, assignment):
    """The packed batch written pack by pack, sequence by sequence (independent of collate)."""
    num_packs = len(assignment.pack_offsets) - 1
    out = {name: np.zeros((num_packs, S), np.int64) for name in ("input_ids", "segment_ids", "position_ids", "sequence_ids")}
    out.update({name: np.zeros((num_packs, M), np.int64) for name in ("mlm_positions", "mlm_labels", "mlm_sequence_ids")})
    out.update({"cls_positions": np.zeros((num_packs, K), np.int64), "nsp_labels": np.zeros((num_packs, K), np.int64)})
    out["nsp_weights"] = np.zeros((num_packs, K), np.float32)
    lengths = sample_lengths(samples)
    for p in range(num_packs):
        column, slot = 0, 0
        members = assignment.sequence_indices[assignment.pack_offsets[p] : assignment.pack_offsets[p + 1]]
        for k, i in enumerate(members):
            n = lengths[i]
            out["input_ids"][p, column : column + n] = samples["input_ids"][i, :n]
            out["segment_ids"][p, column : column + n] = samples["segment_ids"][i, :n]
            out["position_ids"][p, column : column + n] = np.arange(n)
            out["sequence_ids"][p, column : column + n] = k + 1
            out["cls_positions"][p, k] = column
            out["nsp_labels"][p, k] = samples["next_sentence_labels"][i]
            out["nsp_weights"][p, k] = 1
            for position, label in zip(samples["masked_lm_positions"][i], samples["masked_lm_ids"][i]):
                if position > 0:
                    out["mlm_positions"][p, slot] = column + position
                    out["mlm_labels"][p, slot] = label
                    out["mlm_sequence_ids"][p, slot] = k + 1
                    slot += 1
            column += n
    return out


def packed_problem(seed=0, num_packs=20):
    return random_packed_problem(seed, num_packs=num_packs, max_sequence_length=S, max_sequences_per_pack=K)


def test_collate_equals_the_per_pack_reference():
    samples, assignment = packed_problem()
    batch = collate(samples, assignment, max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)
    expected = reference_collate(samples, assignment)
    assert batch.keys() == expected.keys()
    for name in expected:
        assert batch[name].dtype == expected[name].dtype, name
        assert np.array_equal(batch[name], expected[name]), name
    validate_batch(batch, tiny_config(max_masked_tokens_per_pack=M))


def test_unpacked_batch_is_a_pack_of_one():
    samples, _ = packed_problem(1, num_packs=5)
    batch = collate_unpacked(samples, max_sequence_length=S, max_masked_tokens_per_pack=20)
    n = samples["input_ids"].shape[0]
    assert batch["input_ids"].shape == (n, S) and batch["nsp_weights"].shape == (n, 1)
    assert np.array_equal(batch["input_ids"], samples["input_ids"])
    assert np.array_equal(batch["sequence_ids"], samples["input_mask"])
    assert np.all(batch["cls_positions"] == 0)
    validate_batch(batch, tiny_config())


def test_slices_of_an_assignment_collate_to_slices_of_the_batch():
    samples, assignment = packed_problem(2)
    whole = collate(samples, assignment, max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)
    part = collate(samples, slice_assignment(assignment, 5, 12), max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)
    for name in whole:
        assert np.array_equal(part[name], whole[name][5:12]), name


def test_mask_slot_rule():
    assert masked_tokens_per_pack(76, 3) == 78
    assert masked_tokens_per_pack(20, 1) == 20


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_sequence_length=S, max_sequences_per_pack=2, max_masked_tokens_per_pack=M), "sequences but max_sequences_per_pack is 2"),
        (dict(max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=3), "masked tokens but max_masked_tokens_per_pack is 3"),
        (dict(max_sequence_length=40, max_sequences_per_pack=K, max_masked_tokens_per_pack=M), "tokens but max_sequence_length is 40"),
    ],
)
def test_collate_rejects_packs_over_the_limits(kwargs, message):
    samples, assignment = packed_problem(3)
    with pytest.raises(BatchError, match=message):
        collate(samples, assignment, **kwargs)


def test_collate_rejects_bad_assignments():
    samples, _ = packed_problem(4, num_packs=3)
    n = samples["input_ids"].shape[0]
    with pytest.raises(BatchError, match="outside the"):
        collate(samples, PackSlice(np.array([0, 1]), np.array([n])), max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)
    with pytest.raises(BatchError, match="pack_offsets"):
        collate(samples, PackSlice(np.array([0, 2]), np.array([0])), max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)


def _good_batch():
    samples, assignment = packed_problem(5, num_packs=6)
    return collate(samples, assignment, max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)


def _first_multi_sequence_pack(batch):
    return int(np.argmax(batch["nsp_weights"].sum(axis=1) >= 2))


CORRUPTIONS = {
    "missing": (lambda b: b.pop("cls_positions"), "missing field"),
    "dtype": (lambda b: b.__setitem__("input_ids", b["input_ids"].astype(np.float32)), "integer"),
    "shape": (lambda b: b.__setitem__("mlm_labels", b["mlm_labels"][:, :-1]), "shape"),
    "vocab": (lambda b: b["input_ids"].__setitem__((0, 0), 10_000), "vocab_size"),
    "positions": (lambda b: b["position_ids"].__setitem__((0, 1), 5), "positions must restart"),
    "gap": (lambda b: b["sequence_ids"].__setitem__((0, 1), 0), "not contiguous"),
    "cls": (lambda b: b["cls_positions"].__setitem__((0, 0), 1), "cls_positions"),
    "weights": (lambda b: b["nsp_weights"].__setitem__((0, K - 1), 1.0), "nsp_weights"),
    "owner": (lambda b: b["mlm_sequence_ids"].__setitem__((0, 0), b["mlm_sequence_ids"][0, 0] % 2 + 1), "masked slot 0"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_validate_batch_rejects_inconsistent_batches_with_one_line(name):
    batch = _good_batch()
    pack = _first_multi_sequence_pack(batch)
    # Put a multi-sequence pack first so every corruption has something to break.
    batch = {k: np.concatenate([v[pack : pack + 1], v]) for k, v in batch.items()}
    validate_batch(batch, tiny_config(max_masked_tokens_per_pack=M))
    corrupt, message = CORRUPTIONS[name]
    corrupt(batch)
    with pytest.raises(BatchError, match=message) as error:
        validate_batch(batch, tiny_config(max_masked_tokens_per_pack=M))
    assert "\n" not in str(error.value)


def test_validate_batch_accepts_tensors():
    torch = pytest.importorskip("torch")
    batch = {k: torch.from_numpy(v) for k, v in _good_batch().items()}
    validate_batch(batch, tiny_config(max_masked_tokens_per_pack=M))


def test_classification_collate_puts_each_label_in_its_sequence_slot():
    samples, assignment = packed_problem(6, num_packs=8)
    n = samples["input_ids"].shape[0]
    samples = {k: samples[k] for k in ("input_ids", "input_mask", "segment_ids")}
    samples["labels"] = np.arange(n) % 3
    from bert_packed.tasks.classification.data import collate_classification

    batch = collate_classification(samples, assignment, max_sequence_length=S, max_sequences_per_pack=K)
    for p in range(assignment.num_packs):
        members = assignment.sequence_indices[assignment.pack_offsets[p] : assignment.pack_offsets[p + 1]]
        assert batch["labels"][p, : len(members)].tolist() == (members % 3).tolist()
        assert batch["label_weights"][p].tolist() == [1.0] * len(members) + [0.0] * (K - len(members))
    pretraining = collate(packed_problem(6, num_packs=8)[0], assignment, max_sequence_length=S, max_sequences_per_pack=K, max_masked_tokens_per_pack=M)
    for name in ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions"):
        assert np.array_equal(batch[name], pretraining[name]), name
