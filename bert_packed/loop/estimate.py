"""How long a step will take, said before the run starts: the model's training FLOPs per pack
against a rate the backend gives (on the host CPU: measured here in a fraction of a second).

A user who types ``python run.py --backend mock --config phase2`` should learn at once that
one step is hours of CPU work, and how to make it small, rather than after ten silent minutes.
The estimate is rough on purpose (a factor of a few either way): it only has to tell seconds
from hours. It never refuses anything.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from bert_packed.config import Config

# Eager fp32 training of BERT on a CPU reaches a fraction of the machine's large-matmul rate:
# small per-head matmuls, softmax, layer norms, GELU and the optimizer are memory-bound.
# Conservative (a longer estimate) on purpose: measured 5-25% for the configs in configs/.
HOST_EFFICIENCY = 0.1
# Warn when one step is estimated to take at least this long (seconds).
WARN_FROM_SECONDS = 600.0
# What README suggests for a first try of a large config on a CPU.
SMALL_OVERRIDES = ("--set model.num_hidden_layers=2 --set model.hidden_size=128 --set model.num_attention_heads=2 "
                   "--set model.intermediate_size=512 --set train.gradient_accumulation=2 --steps 3")


def training_flops_per_pack(config: Config) -> float:
    """Forward + backward FLOPs (3 x forward) of one pack of ``data.max_sequence_length`` tokens:
    the encoder's matmuls and attention over the whole row, plus, when pre-training, the MLM
    head over the pack's masked-token slots (its vocabulary projection dominates small models)."""
    m, d = config.model, config.data
    H, L, I, S = m.hidden_size, m.num_hidden_layers, m.intermediate_size, d.max_sequence_length
    per_token_layer = 8 * H * H + 4 * H * I + 4 * S * H  # Q, K, V, out; the MLP; scores and context
    forward = S * L * per_token_layer
    if not config.finetune.task:  # pre-training: the MLM head on its masked slots
        forward += 2 * d.max_masked_tokens_per_pack * (H * H + H * m.vocab_size)
    return 3.0 * forward


def host_flops_per_second(seconds: float = 0.05) -> float:
    """What eager BERT training gets of this machine (FLOP/s): one thread's fp32 matmul rate,
    timed for about ``seconds`` (best call), times torch's thread count and ``HOST_EFFICIENCY``.
    One thread is timed because a short multi-threaded matmul on a busy machine measures thread
    wake-ups (10x too slow on a shared 2-core host), not arithmetic."""
    import torch

    threads = torch.get_num_threads()
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    flops_per_call = 2.0 * 256 * 512 * 512
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm-up
        best, deadline = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < deadline or best == float("inf"):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return flops_per_call / max(best, 1e-9) * threads * HOST_EFFICIENCY


def slow_step_warning(config: Config, *, packs_per_step: int, steps: int, rate: Callable[[], Optional[float]],
                      backend_name: str) -> Optional[str]:
    """One warning line when a step of ``packs_per_step`` packs of ``config`` would take at
    least ``WARN_FROM_SECONDS`` at ``rate()`` FLOP/s (the backend's ``compute_rate``; None: no
    estimate), with the overrides that make a small run; else None. ``rate`` is only asked
    (a measurement) when the step is large enough to matter even at 1 GFLOP/s."""
    flops = training_flops_per_pack(config) * packs_per_step
    if flops < WARN_FROM_SECONDS * 1e9:
        return None
    per_second = rate()
    if not per_second or flops / per_second < WARN_FROM_SECONDS:
        return None
    from bert_packed.loop.within_step import duration_text

    per_step = flops / per_second
    return (f"{config.name} on {backend_name}: ~{duration_text(per_step)} per step, ~{duration_text(per_step * steps)} "
            f"for {steps} steps (estimated: {packs_per_step} packs of {training_flops_per_pack(config):.2g} "
            f"training FLOPs at ~{per_second / 1e9:.0f} GFLOP/s); for a first try make it small, e.g. "
            f"{SMALL_OVERRIDES}")
