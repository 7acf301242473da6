"""Small helpers for the IPU-path tests and the mock smoke runs: tiny configs and random packs.

The packs are built here (not from the data pipeline) so the IPU tests depend only on the model,
the config and the backends; they follow the batch contract of docs/internals.md.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

# Size overrides that shrink phase2.yaml to something a CPU trains in milliseconds per step.
TINY_MODEL = ["model.hidden_size=32", "model.num_attention_heads=2", "model.intermediate_size=64",
              "model.vocab_size=128", "model.max_position_embeddings=64",
              "data.max_sequence_length=64", "data.max_masked_tokens=10"]


def random_packed_batch(rng: np.random.Generator, *, micro_batch_size: int, max_sequence_length: int,
                        max_sequences_per_pack: int, max_masked_tokens_per_pack: int,
                        vocab_size: int) -> Dict[str, np.ndarray]:
    """One packed micro-batch ``[B, ...]`` with 1..K sequences per pack, natural token order.

    Each sequence starts with its [CLS] (id 1), positions restart at 0, about 15 % of its tokens
    (at least one, never the [CLS]) are masked, up to the pack's M slots.
    """
    B, S, K, M = micro_batch_size, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack
    batch = {name: np.zeros((B, S), np.int64) for name in ("input_ids", "segment_ids", "position_ids", "sequence_ids")}
    batch.update({name: np.zeros((B, M), np.int64) for name in ("mlm_positions", "mlm_labels", "mlm_sequence_ids")})
    batch.update({"cls_positions": np.zeros((B, K), np.int64), "nsp_labels": np.zeros((B, K), np.int64),
                  "nsp_weights": np.zeros((B, K), np.float32)})
    for b in range(B):
        num_sequences = int(rng.integers(1, K + 1))
        used = int(rng.integers(S // 2, S + 1))  # real tokens; the rest of the pack is padding
        inner = rng.choice(np.arange(1, used // 2), size=num_sequences - 1, replace=False) * 2
        bounds = [0] + sorted(int(i) for i in inner) + [used]  # every sequence >= 2 tokens
        slot = 0
        for k in range(num_sequences):
            start, stop = bounds[k], bounds[k + 1]
            length = stop - start
            batch["input_ids"][b, start] = 1
            batch["input_ids"][b, start + 1:stop] = rng.integers(5, vocab_size, size=length - 1)
            batch["segment_ids"][b, start + length // 2:stop] = 1
            batch["position_ids"][b, start:stop] = np.arange(length)
            batch["sequence_ids"][b, start:stop] = k + 1
            batch["cls_positions"][b, k] = start
            batch["nsp_labels"][b, k] = int(rng.integers(0, 2))
            batch["nsp_weights"][b, k] = 1.0
            num_masked = min(max(1, round(0.15 * (length - 1))), M - slot)
            if num_masked <= 0 or length < 2:
                continue
            positions = np.sort(rng.choice(np.arange(start + 1, stop), size=min(num_masked, length - 1), replace=False))
            for p in positions:
                batch["mlm_positions"][b, slot] = p
                batch["mlm_labels"][b, slot] = batch["input_ids"][b, p]
                batch["mlm_sequence_ids"][b, slot] = k + 1
                batch["input_ids"][b, p] = 4  # [MASK]
                slot += 1
    return batch


def random_micro_batches(seed: int, num: int, config) -> List[Dict[str, np.ndarray]]:
    """``num`` micro-batches shaped by ``config`` (train.micro_batch_size, data.*, model.vocab_size)."""
    rng = np.random.default_rng(seed)
    d = config.data
    return [random_packed_batch(rng, micro_batch_size=config.train.micro_batch_size,
                                max_sequence_length=d.max_sequence_length,
                                max_sequences_per_pack=d.max_sequences_per_pack,
                                max_masked_tokens_per_pack=d.max_masked_tokens_per_pack,
                                vocab_size=config.model.vocab_size) for _ in range(num)]
