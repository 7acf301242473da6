"""Shared helpers for the model tests: random unpacked BERT samples, random packings, tiny configs.

The helpers build data the way a real loader would (NVIDIA field names, [CLS] at position
0, masked positions inside each sequence) and packings with 1..K sequences of random
lengths per pack. The tests at the bottom check the helpers themselves.
"""
from __future__ import annotations

import numpy as np
import torch

from bert_packed.collate import PackSlice, collate, collate_unpacked, sample_lengths
from bert_packed.model.modeling import BertConfig

VOCAB_SIZE = 99
CLS_ID = 2
SEP_ID = 3


def tiny_config(**overrides) -> BertConfig:
    """A tiny BERT (fast on 2 CPU cores), dropout off, fp32-exact comparisons possible."""
    values = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=512,
        max_sequences_per_pack=16,
        max_masked_tokens_per_pack=100,
    )
    values.update(overrides)
    return BertConfig(**values)


def random_pack_lengths(rng: np.random.Generator, num_packs: int, max_sequence_length: int, max_sequences_per_pack: int):
    """Per pack: a random number of sequences (1..K) with random lengths >= 2 summing to <= S."""
    packs = []
    for _ in range(num_packs):
        k = int(rng.integers(1, max_sequences_per_pack + 1))
        total = int(rng.integers(2 * k, max_sequence_length + 1))
        # Every sequence gets 2 tokens ([CLS] + one), the rest is split at random.
        parts = 2 + rng.multinomial(total - 2 * k, rng.dirichlet(np.ones(k)))
        packs.append([int(p) for p in parts])
    return packs


def make_samples(rng: np.random.Generator, lengths, *, width: int, max_predictions: int, mask_probability: float = 0.15):
    """Unpacked samples (NVIDIA fields, rows padded to ``width``) for the given lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    num = len(lengths)
    input_ids = np.zeros((num, width), dtype=np.int64)
    input_mask = np.zeros((num, width), dtype=np.int64)
    segment_ids = np.zeros((num, width), dtype=np.int64)
    positions = np.zeros((num, max_predictions), dtype=np.int64)
    labels = np.zeros((num, max_predictions), dtype=np.int64)
    for i, length in enumerate(lengths):
        input_ids[i, :length] = rng.integers(4, VOCAB_SIZE, length)
        input_ids[i, 0] = CLS_ID
        input_mask[i, :length] = 1
        segment_ids[i, length // 2 : length] = 1
        num_masked = min(max_predictions, length - 1, max(1, int(round(mask_probability * length))))
        chosen = np.sort(rng.choice(np.arange(1, length), num_masked, replace=False))
        positions[i, :num_masked] = chosen
        labels[i, :num_masked] = input_ids[i, chosen]
        input_ids[i, chosen] = 1  # [MASK]
    return {
        "input_ids": input_ids,
        "input_mask": input_mask,
        "segment_ids": segment_ids,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "next_sentence_labels": rng.integers(0, 2, num).astype(np.int64),
    }


def random_packed_problem(seed: int, *, num_packs: int, max_sequence_length: int, max_sequences_per_pack: int, max_predictions: int = 20):
    """Samples plus an assignment (shuffled sample order) with 1..K sequences per pack."""
    rng = np.random.default_rng(seed)
    pack_lengths = random_pack_lengths(rng, num_packs, max_sequence_length, max_sequences_per_pack)
    lengths = np.array([length for pack in pack_lengths for length in pack], dtype=np.int64)
    # Store the samples in a shuffled order so the assignment's indices are not just 0..n-1.
    permutation = rng.permutation(len(lengths))
    samples = make_samples(rng, lengths[permutation], width=max_sequence_length, max_predictions=max_predictions)
    inverse = np.argsort(permutation)  # pack-order sequence i is sample inverse[i]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pack_lengths])]).astype(np.int64)
    return samples, PackSlice(offsets, inverse.astype(np.int64))


def to_torch(batch):
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


def packed_and_unpacked(samples, assignment, *, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack, max_predictions):
    """(packed batch, unpacked batch of the same sequences in assignment order), both torch.

    The unpacked rows are padded only to the longest sequence (each sequence is alone in its
    row; how much padding follows it does not matter, and it keeps the S = 512 tests fast).
    """
    packed = collate(
        samples,
        assignment,
        max_sequence_length=max_sequence_length,
        max_sequences_per_pack=max_sequences_per_pack,
        max_masked_tokens_per_pack=max_masked_tokens_per_pack,
    )
    longest = int(sample_lengths(samples).max())
    unpacked = collate_unpacked(samples, assignment.sequence_indices, max_sequence_length=longest, max_masked_tokens_per_pack=max_predictions)
    return to_torch(packed), to_torch(unpacked)


# ----------------------------------------------------------------------------- self-tests


def test_random_packs_respect_limits():
    rng = np.random.default_rng(0)
    for S, K in ((128, 16), (512, 16), (16, 3)):
        packs = random_pack_lengths(rng, 200, S, K)
        counts = [len(p) for p in packs]
        assert min(counts) >= 1 and max(counts) <= K
        assert all(sum(p) <= S and min(p) >= 2 for p in packs)
        assert len(set(counts)) > 1  # really random depths


def test_samples_have_masks_inside_sequences():
    samples, assignment = random_packed_problem(1, num_packs=10, max_sequence_length=128, max_sequences_per_pack=16)
    lengths = sample_lengths(samples)
    valid = samples["masked_lm_positions"] > 0
    assert np.all(samples["masked_lm_positions"] < lengths[:, None])
    assert np.all(valid.sum(axis=1) >= 1)
    assert np.all(samples["input_ids"][:, 0] == CLS_ID)
    assert sorted(assignment.sequence_indices.tolist()) == list(range(len(lengths)))
