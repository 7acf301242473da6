"""LAMB against an independent numpy implementation of the published update; the multi-tensor
(foreach) LAMB and fused/foreach AdamW against the per-tensor references; the device-side
non-finite skip and gradient norm; schedule; packing adjustments."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from bert_packed.loop.plan import adjust_for_packing, adjust_gradient_accumulation, adjust_lamb_betas
from bert_packed.optim import (
    Lamb,
    OptimConfigError,
    adamw,
    build_optimizer,
    build_schedule,
    grad_norm_,
    parameter_groups,
    step_unless_non_finite,
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


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_weight_norm", [None, 0.5, 0.0])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_matches_the_published_update(bias_correction, max_weight_norm, weight_decay, foreach):
    rng = np.random.default_rng(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    initial = [rng.normal(size=s).astype(np.float32) for s in shapes]
    initial[1] = np.zeros(5, dtype=np.float32)  # a fresh zero bias: ||w|| = 0 -> ratio 1
    steps = [[rng.normal(size=s).astype(np.float32) * 0.1 for s in shapes] for _ in range(4)]
    params = [nn.Parameter(torch.from_numpy(w.copy())) for w in initial]
    options = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=weight_decay, bias_correction=bias_correction, max_weight_norm=max_weight_norm)
    optimizer = Lamb(params, foreach=foreach, **options)
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


def _model_and_gradients(num_steps, seed=0, scale=0.1):
    """A tiny BERT (both parameter groups: decayed matrices, biases + LayerNorm) and a seeded
    random gradient for every parameter and step."""
    from bert_packed.tasks.pretraining.model import BertForPreTraining

    torch.manual_seed(seed)
    model = BertForPreTraining(tiny_config())
    generator = torch.Generator().manual_seed(seed + 1)
    grads = [[torch.randn(p.shape, generator=generator) * scale for p in model.parameters()]
             for _ in range(num_steps)]
    return model, grads


def _train(model, optimizer, grads, found_inf=None):
    for step_grads in grads:
        for param, grad in zip(model.parameters(), step_grads):
            param.grad = grad.clone()
        optimizer.step() if found_inf is None else step_unless_non_finite(optimizer, found_inf)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_weight_norm", [None, 0.5])
def test_foreach_lamb_equals_the_per_tensor_reference_over_5_steps(bias_correction, max_weight_norm):
    # Both groups of build_optimizer: decayed weights with the trust ratio (clamped or not) and
    # biases + LayerNorm with bias_max_weight_norm 0 (trust ratio 1).
    import copy

    model, grads = _model_and_gradients(5)
    results, states = [], []
    for implementation in ("single_tensor", "foreach"):
        copied = copy.deepcopy(model)
        optimizer = build_optimizer(copied, "lamb", lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                                    bias_correction=bias_correction, max_weight_norm=max_weight_norm,
                                    implementation=implementation)
        assert optimizer.defaults["foreach"] is (implementation == "foreach")
        assert [g.get("max_weight_norm") for g in optimizer.param_groups] == [max_weight_norm, 0.0]
        results.append(_train(copied, optimizer, grads))
        states.append([optimizer.state[p] for p in copied.parameters()])
    moved = max((a - p.detach()).abs().max().item() for a, p in zip(results[1], model.parameters()))
    assert moved > 1e-3  # the 5 steps did change the weights
    assert max((a - b).abs().max().item() for a, b in zip(*results)) <= 1e-6
    for reference, fast in zip(*states):
        assert fast["step"].item() == reference["step"].item() == 5
        assert torch.allclose(fast["exp_avg"], reference["exp_avg"], rtol=0, atol=1e-6)
        assert torch.allclose(fast["exp_avg_sq"], reference["exp_avg_sq"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("implementation", ["auto", "foreach"])
def test_fast_adamw_equals_the_per_tensor_reference_over_5_steps(implementation):
    import copy

    model, grads = _model_and_gradients(5)
    reference_model, fast_model = copy.deepcopy(model), copy.deepcopy(model)
    options = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    reference = build_optimizer(reference_model, "adamw", implementation="single_tensor", **options)
    fast = build_optimizer(fast_model, "adamw", implementation=implementation, **options)
    assert not reference.defaults["foreach"] and not reference.defaults.get("fused")
    assert fast.defaults["foreach"] or fast.defaults.get("fused")
    if implementation == "auto" and tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 4):
        assert fast.defaults.get("fused")  # the CPU has a fused AdamW since torch 2.4
    expected, got = _train(reference_model, reference, grads), _train(fast_model, fast, grads)
    assert max((a - p.detach()).abs().max().item() for a, p in zip(got, model.parameters())) > 1e-3
    assert max((a - b).abs().max().item() for a, b in zip(expected, got)) <= 1e-6
    # Same parameter groups and weight decay as before (what ipu/pipeline.build_optimizer reads).
    assert [g["weight_decay"] for g in fast.param_groups] == [0.01, 0.0]
    assert {"lr", "betas", "eps", "weight_decay"} <= set(fast.defaults)


@pytest.mark.parametrize("name,implementation", [("lamb", "foreach"), ("lamb", "single_tensor"), ("adamw", "auto"),
                                                 ("adamw", "foreach")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("steps_before", [2, 0])
def test_a_non_finite_gradient_leaves_weights_moments_and_step_unchanged(name, implementation, bad, steps_before):
    # steps_before 0: the very first update is skipped (fp16 loss scaling typically skips its
    # first steps), when the step counts are 0 and a bias correction 1 - beta^0 would divide by 0.
    import copy

    model, grads = _model_and_gradients(3)
    optimizer = build_optimizer(model, name, lr=0.01, implementation=implementation)
    _train(model, optimizer, grads[:steps_before])
    weights = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict()["state"])
    poisoned = [g.clone() for g in grads[2]]
    poisoned[3].view(-1)[5] = bad
    for param, grad in zip(model.parameters(), poisoned):
        param.grad = grad
    norm, found_inf = grad_norm_(model.parameters(), max_norm=1.0)
    assert found_inf.item() == 1.0 and not torch.isfinite(norm)
    step_unless_non_finite(optimizer, found_inf)
    assert all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
    after = optimizer.state_dict()["state"]
    for key, before in state.items():
        for field, value in before.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key][field])), (key, field)
    # A finite step after the skipped one is the step that would have been taken without it.
    clean_model, clean_grads = _model_and_gradients(3)
    clean = build_optimizer(clean_model, name, lr=0.01, implementation=implementation)
    expected = _train(clean_model, clean, clean_grads[:steps_before] + clean_grads[2:])
    for param, grad in zip(model.parameters(), grads[2]):
        param.grad = grad.clone()
    _, found_inf = grad_norm_(model.parameters())
    assert found_inf.item() == 0.0
    step_unless_non_finite(optimizer, found_inf)
    assert max((e - p.detach()).abs().max().item() for e, p in zip(expected, model.parameters())) <= 1e-6


def test_grad_norm_equals_torch_clip_grad_norm():
    model, grads = _model_and_gradients(1, scale=1.0)
    params = list(model.parameters())
    for param, grad in zip(params, grads[0]):
        param.grad = grad.clone()
    expected_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads[0]]))
    norm, found_inf = grad_norm_(params)
    assert torch.allclose(norm, expected_norm, rtol=1e-5) and found_inf.item() == 0.0
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads[0]))  # no max_norm: untouched
    norm, _ = grad_norm_(params, max_norm=0.5)
    clipped = [p.grad.clone() for p in params]
    for param, grad in zip(params, grads[0]):
        param.grad = grad.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert torch.allclose(norm, torch_norm, rtol=1e-5)
    assert all(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-8) for a, p in zip(clipped, params))
    assert torch.allclose(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in clipped])), torch.tensor(0.5),
                          rtol=1e-4)


def test_lamb_resumes_from_an_int_step_of_an_older_checkpoint():
    param = nn.Parameter(torch.ones(3))
    optimizer = Lamb([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0]["step"] = 1  # as the per-tensor LAMB stored it
    resumed_param = nn.Parameter(param.detach().clone())
    resumed = Lamb([resumed_param], lr=0.1)
    resumed.load_state_dict(saved)
    for p, o in ((param, optimizer), (resumed_param, resumed)):
        p.grad = torch.full((3,), 0.5)
        o.step()
    assert torch.equal(param, resumed_param) and resumed.state[resumed_param]["step"].item() == 2


def test_parameter_groups_exclude_biases_and_layernorm_from_weight_decay():
    from bert_packed.tasks.pretraining.model import BertForPreTraining

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
    with pytest.raises(OptimConfigError, match="unknown optimizer implementation"):
        build_optimizer(model, "adamw", lr=1e-3, implementation="fast")
    with pytest.raises(OptimConfigError, match="no fused"):
        build_optimizer(model, "lamb", lr=1e-3, implementation="fused")


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


@pytest.mark.parametrize("total_steps, fraction", [(10, 0.2), (32, 0.1), (7, 0.0), (5, 1.0)])
def test_warmup_from_zero_is_transformers_linear_schedule(total_steps, fraction):
    """The fine-tuning configs' schedule: the Trainer's (ceil(ratio x steps) warm-up steps, the first
    at rate 0), rate for rate against transformers' own scheduler."""
    transformers = pytest.importorskip("transformers")
    rates = {}
    for side in ("ours", "theirs"):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
        if side == "ours":
            scheduler = build_schedule(optimizer, "linear", total_steps=total_steps, warmup_fraction=fraction,
                                       warmup_from_zero=True)
        else:
            warmup = math.ceil(fraction * total_steps)
            scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
        rates[side] = []
        for _ in range(total_steps):
            rates[side].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    assert rates["ours"] == rates["theirs"]


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


def test_foreach_lamb_on_bfloat16_parameters_equals_the_reference():
    # The update is computed in float32 and written back in the parameters' dtype on both paths.
    generator = torch.Generator().manual_seed(3)
    initial = [torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)]
    grads = [[torch.randn(t.shape, generator=generator) for t in initial] for _ in range(5)]
    results = []
    for foreach in (False, True):
        params = [nn.Parameter(t.clone().to(torch.bfloat16)) for t in initial]
        optimizer = Lamb(params, lr=0.05, foreach=foreach)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(torch.bfloat16)
            optimizer.step()
        assert all(p.dtype == torch.bfloat16 for p in params)
        assert optimizer.state[params[0]]["exp_avg"].dtype == torch.float32
        results.append([p.detach().float() for p in params])
    assert max((a - b).abs().max().item() for a, b in zip(*results)) <= 1e-2  # one bf16 ulp at |w| ~ 1
    assert max((a - p).abs().max().item() for a, p in zip(results[1], initial)) > 0.05


def test_lamb_default_is_foreach_on_the_cpu_and_per_tensor_when_asked(monkeypatch):
    def refuse(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"the {name} path ran")
        return fail

    param = nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    with monkeypatch.context() as patch:
        patch.setattr(Lamb, "_single_tensor_step", refuse("per-tensor"))
        Lamb([param], lr=0.1).step()  # foreach=None on CPU parameters: the multi-tensor path
        Lamb([param], lr=0.1, foreach=True).step()
    patch_multi = refuse("multi-tensor")
    monkeypatch.setattr(Lamb, "_multi_tensor_step", patch_multi)
    Lamb([param], lr=0.1, foreach=False).step()
    with pytest.raises(AssertionError, match="multi-tensor"):
        Lamb([param], lr=0.1).step()
