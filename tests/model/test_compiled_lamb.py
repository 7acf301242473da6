"""The ``cuda.compile_optimizer`` lever on the CPU: ``Lamb.clip_and_step`` (gradient clipping and the
LAMB update as one ``torch.compile``d function) against the eager ``grad_norm_`` + ``step(found_inf=)``
the backends run by default: same weights, moments, step counts, norms and skip flags over several
steps with a changing learning rate, a clipped step and a non-finite one, and no recompile."""
from __future__ import annotations

import copy

import pytest
import torch

from torch import nn

from bert_packed.optim import build_optimizer, build_schedule, grad_norm_, step_unless_non_finite

# float32; inductor may fuse and reorder the foreach chains (e.g. a * b / c as a * (b / c)),
# and LAMB's division by sqrt(v) + eps magnifies a last-bit difference where a gradient is tiny.
TOL = 1e-6
NUM_STEPS = 6
BAD_STEP = 3  # this step's gradient holds a NaN: nothing may change


def _model():
    """Both LAMB groups of ``build_optimizer`` (decayed matrices with the trust ratio; biases and a
    LayerNorm without), few tensors: compiling the update on 2 CPU cores takes seconds, not minutes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _gradients(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(p.shape, generator=generator) * 0.5 for p in model.parameters()] for _ in range(NUM_STEPS)]
    grads[BAD_STEP][0][0, 0] = float("nan")
    return grads


def _run(model, optimizer, grads, update):
    schedule = build_schedule(optimizer, "linear", total_steps=NUM_STEPS, warmup_steps=2)
    history = []
    for step_grads in grads:
        for param, grad in zip(model.parameters(), step_grads):
            param.grad = grad.clone()
        norm, found_inf = update(model, optimizer)
        history.append((norm.item(), found_inf.item()))
        schedule.step()  # a new learning rate every step (no warning: clip_and_step goes through step())
        optimizer.zero_grad(set_to_none=True)
    return history


def _eager(model, optimizer):
    norm, found_inf = grad_norm_(model.parameters(), 1.0)
    step_unless_non_finite(optimizer, found_inf)
    return norm, found_inf


# Compiled: about 25 s of CPU time (inductor's C++ build), hence slow.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_clip_and_step_equals_the_eager_clip_then_step(compiled):
    model = _model()
    grads = _gradients(model)
    results = []
    for update in (_eager, lambda m, o: o.clip_and_step(1.0, compiled=compiled)):
        copied = copy.deepcopy(model)
        optimizer = build_optimizer(copied, "lamb", lr=0.01, weight_decay=0.01, max_weight_norm=None)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        history = _run(copied, optimizer, grads, update)
        results.append((copied, optimizer, history, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs))
    (reference, ref_opt, ref_history, _), (fused, fused_opt, history, new_graphs) = results
    assert [flag for _, flag in history] == [flag for _, flag in ref_history] == [float(i == BAD_STEP)
                                                                                    for i in range(NUM_STEPS)]
    for (norm, _), (ref_norm, _) in zip(history, ref_history):
        assert norm == pytest.approx(ref_norm, rel=1e-6, nan_ok=True)
    assert all(norm > 1.0 for norm, _ in ref_history if norm == norm)  # clipping acted on every good step
    moved = max((p - q).abs().max().item() for p, q in zip(reference.parameters(), model.parameters()))
    assert moved > 1e-3
    assert len(ref_opt.param_groups) == 2
    for param, ref_param in zip(fused.parameters(), reference.parameters()):
        assert (param - ref_param).abs().max().item() <= TOL
        state, ref_state = fused_opt.state[param], ref_opt.state[ref_param]
        assert state["step"].item() == ref_state["step"].item() == NUM_STEPS - 1  # the bad step did not count
        assert (state["exp_avg"] - ref_state["exp_avg"]).abs().max().item() <= TOL
        assert (state["exp_avg_sq"] - ref_state["exp_avg_sq"]).abs().max().item() <= TOL
    if compiled:
        # One graph (or a few, where dynamo breaks it) compiled on the first step; the changing
        # learning rate and the skip flag are tensors, so no step after it compiles again.
        assert 1 <= new_graphs <= 3
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        _run(fused, fused_opt, grads[:2], lambda m, o: o.clip_and_step(1.0))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
