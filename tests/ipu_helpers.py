"""Helpers of the IPU-path tests and the mock benchmarks: tiny configs and random packs.

The packs are built here (not from the data pipeline) so the IPU tests depend only on the model,
the config and the backends; they follow the batch contract of docs/internals.md.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

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


# The fp16 mock-vs-cpu comparison (tests/ipu/test_ipu_readiness.py, benchmarks/ipu_fp16_mock_curve.py):
# phase2 shrunk, replication 2 x accumulation 8 on a 4-stage pipeline (embeddings on IPU 0, one
# layer on each of IPU 1 and 2, the heads back on IPU 0), fp16 with loss scaling, constant LR.
FP16_CURVE = TINY_MODEL + [
    "model.num_hidden_layers=2", "ipu.layers_per_ipu=[0,1,1]", "model.hidden_dropout_prob=0.0",
    "data.max_sequence_length=32", "train.micro_batch_size=1", "optimizer.schedule=constant",
    "optimizer.warmup_fraction=0.0", "optimizer.learning_rate=0.02", "ipu.device_iterations=1",
    "ipu.output_mode=sum", "train.gradient_accumulation=8", "ipu.replication_factor=2",
    "ipu.loss_scaling=1024.0"]


def prepared_pair(config, reference_config=None, backend_cls=None):
    """``(backend, model, cpu, reference)``: a ``backend_cls`` (default MockBackend) prepared on
    ``config`` and a CPUBackend on ``reference_config`` (default ``config``), with identical
    initial weights (seed 0) and each its own optimizer from its config."""
    import copy

    import torch

    from backends.cpu import CPUBackend
    from backends.mock import MockBackend
    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.loop.plan import make_plan

    reference_config = reference_config or config
    torch.manual_seed(0)
    model = build_model(config)
    reference = copy.deepcopy(model)
    backend, cpu = (backend_cls or MockBackend)(), CPUBackend()
    backend.prepare(model, build_optimizer(config, model)[0], make_plan(config, backend))
    cpu.prepare(reference, build_optimizer(reference_config, reference)[0], make_plan(reference_config, cpu))
    return backend, model, cpu, reference


def mock_and_cpu_loss_curves(overrides=(), steps: int = 50, num_batches: int = 4, seed: int = 1):
    """Per-step losses of the mock (phase2 + FP16_CURVE + ``overrides``) and of the cpu fp32
    reference on the same global batches (``num_batches`` of them, cycled, so the loss falls).

    The cpu takes each step's packs as ONE micro-batch of all of them: with the step's global
    counts in every pack that is the same step (docs/internals.md), and 16x fewer forwards.
    Returns (mock_losses, cpu_losses, mock_backend).
    """
    from bert_packed.config import load_config

    config = load_config("phase2", FP16_CURVE + list(overrides))
    per_step = config.train.gradient_accumulation * config.ipu.replication_factor
    reference_config = load_config("phase2", FP16_CURVE + list(overrides) + [
        "train.gradient_accumulation=1", f"train.micro_batch_size={per_step * config.train.micro_batch_size}",
        "ipu.half_precision=false"])
    mock, _, cpu, _ = prepared_pair(config, reference_config)
    batches = random_micro_batches(seed, per_step * num_batches, config)
    mock_losses, cpu_losses = [], []
    for step in range(steps):
        step_batches = batches[(step % num_batches) * per_step:(step % num_batches + 1) * per_step]
        mock_losses.append(mock.train_step([dict(b) for b in step_batches])["loss"])
        merged = {k: np.concatenate([b[k] for b in step_batches]) for k in step_batches[0]}
        cpu_losses.append(cpu.train_step([merged])["loss"])
    return np.array(mock_losses), np.array(cpu_losses), mock


class Toy(torch.nn.Module):
    """Linear regression with an MSE loss, outputs (prediction [mb], loss scalar): the smallest
    model the mock's and PopTorch's training-model rules can be checked on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1, bias=False)

    def forward(self, x, y):
        out = self.lin(x).squeeze(-1)
        return out, torch.nn.functional.mse_loss(out, y)
