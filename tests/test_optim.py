"""LAMB against an independent numpy implementation of the published update; schedule; packing adjustments."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bert_packed.optim import (
    Lamb,
    OptimConfigError,
    adjust_for_packing,
    adjust_gradient_accumulation,
    adjust_lamb_betas,
    build_optimizer,
    build_schedule,
    parameter_groups,
)
from test_model_fixtures import tiny_config


def published_lamb(weights, gradients, *, lr, beta1, beta2, eps, weight_decay, bias_correction, max_weight_norm):
    """You et al. 2019, Algorithm 2 (LAMB), per layer, in float64 numpy; phi(z) = min(z, max_weight_norm)."""
    w = np.array(weights, dtype=np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(gradients, start=1):
        g = np.asarray(g, dtype=np.float64)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t) if bias_correction else m
        v_hat = v / (1 - beta2**t) if bias_correction else v
        r = m_hat / (np.sqrt(v_hat) + eps)
        u = r + weight_decay * w
        w_norm = np.linalg.norm(w)
        phi = w_norm if max_weight_norm is None else min(w_norm, max_weight_norm)
        u_norm = np.linalg.norm(u)
        ratio = phi / u_norm if phi > 0 and u_norm > 0 else 1.0
        w = w - lr * ratio * u
    return w


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_weight_norm", [None, 0.5, 0.0])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_matches_the_published_update(bias_correction, max_weight_norm, weight_decay):
    rng = np.random.default_rng(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    initial = [rng.normal(size=s).astype(np.float32) for s in shapes]
    initial[1] = np.zeros(5, dtype=np.float32)  # a fresh zero bias: ||w|| = 0 -> ratio 1
    steps = [[rng.normal(size=s).astype(np.float32) * 0.1 for s in shapes] for _ in range(4)]
    params = [nn.Parameter(torch.from_numpy(w.copy())) for w in initial]
    options = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=weight_decay, bias_correction=bias_correction, max_weight_norm=max_weight_norm)
    optimizer = Lamb(params, **options)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        optimizer.step()
    for i, p in enumerate(params):
        expected = published_lamb(
            initial[i],
            [grads[i] for grads in steps],
            lr=0.01,
            beta1=0.9,
            beta2=0.99,
            eps=1e-6,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_weight_norm=max_weight_norm,
        )
        assert np.abs(p.detach().numpy() - expected).max() <= 1e-6


def test_parameter_groups_exclude_biases_and_layernorm_from_weight_decay():
    from bert_packed.modeling import BertForPreTraining

    model = BertForPreTraining(tiny_config())
    decay, no_decay = parameter_groups(model, weight_decay=0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(not names[id(p)].endswith("bias") and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert all(names[id(p)].endswith("bias") or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied weight once
    assert isinstance(build_optimizer(model, "lamb", lr=1e-3), Lamb)
    assert isinstance(build_optimizer(model, "adamw", lr=1e-3), torch.optim.AdamW)
    with pytest.raises(OptimConfigError, match="unknown optimizer 'sgd'"):
        build_optimizer(model, "sgd", lr=1e-3)


def test_linear_schedule_warms_up_then_decays_to_zero():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build_schedule(optimizer, "linear", total_steps=10, warmup_fraction=0.2)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [2.0 * 1 / 2, 2.0 * 2 / 2] + [2.0 * (10 - s) / 8 for s in range(2, 10)]
    assert np.allclose(lrs, expected)
    constant = build_schedule(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), "constant", total_steps=5, warmup_steps=0)
    assert constant.get_last_lr() == [1.0]
    with pytest.raises(OptimConfigError, match="not both"):
        build_schedule(optimizer, "linear", total_steps=10, warmup_steps=1, warmup_fraction=0.1)
    with pytest.raises(OptimConfigError, match="unknown lr schedule"):
        build_schedule(optimizer, "cosine", total_steps=10)


def test_packing_adjustments():
    assert adjust_gradient_accumulation(2048, 1.17) == 1750  # Graphcore's packed phase-1 value
    assert adjust_gradient_accumulation(2048, 2.0) == 1024
    assert adjust_gradient_accumulation(1, 3.0) == 1
    b1, b2 = adjust_lamb_betas((0.81, 0.999), 2.0)
    assert b1 == pytest.approx(0.6561) and b2 == pytest.approx(0.999**2)
    assert adjust_for_packing("none", gradient_accumulation=8, betas=(0.9, 0.99), packing_factor=2.0) == (8, (0.9, 0.99))
    assert adjust_for_packing("gradient_accumulation", gradient_accumulation=8, betas=(0.9, 0.99), packing_factor=2.0) == (4, (0.9, 0.99))
    assert adjust_for_packing("betas", gradient_accumulation=8, betas=(0.9, 0.99), packing_factor=2.0)[1] == pytest.approx((0.81, 0.9801))
    with pytest.raises(OptimConfigError, match="packing_factor"):
        adjust_lamb_betas((0.9, 0.99), 0.5)
    with pytest.raises(OptimConfigError, match="unknown packing adjustment"):
        adjust_for_packing("lr", gradient_accumulation=8, betas=(0.9, 0.99), packing_factor=2.0)


@pytest.mark.parametrize("p", [2, 3])
def test_betas_to_the_power_p_reproduce_p_steps_with_the_same_gradient(p):
    """The paper's Appendix D: one update with beta**p leaves the same moments as p updates
    with an unchanged gradient (checked on our optimizer's state)."""
    g = torch.randn(6)
    start_m = torch.randn(6) * 0.1
    start_v = torch.rand(6) * 0.1

    def moments(betas, num_steps):
        param = nn.Parameter(torch.randn(6))
        optimizer = Lamb([param], lr=0.0, betas=betas, bias_correction=False)
        param.grad = torch.zeros(6)
        optimizer.step()  # create the state, then overwrite it
        state = optimizer.state[param]
        state["exp_avg"].copy_(start_m)
        state["exp_avg_sq"].copy_(start_v)
        for _ in range(num_steps):
            param.grad = g.clone()
            optimizer.step()
        return state["exp_avg"], state["exp_avg_sq"]

    m_steps, v_steps = moments((0.9, 0.999), p)
    m_once, v_once = moments(adjust_lamb_betas((0.9, 0.999), p), 1)
    assert torch.allclose(m_steps, m_once, atol=1e-6) and torch.allclose(v_steps, v_once, atol=1e-6)


def test_bad_lamb_settings_are_one_line_errors():
    with pytest.raises(OptimConfigError, match="betas"):
        Lamb([nn.Parameter(torch.zeros(1))], betas=(1.0, 0.9))
    with pytest.raises(OptimConfigError, match="eps"):
        Lamb([nn.Parameter(torch.zeros(1))], eps=0.0)
