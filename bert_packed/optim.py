"""Optimisation for packed BERT: LAMB in plain torch, the LR schedule, packing adjustments.

LAMB (You et al., "Large Batch Optimization for Deep Learning", Algorithm 2), per tensor w
with gradient g at step t:

    m = beta1 m + (1 - beta1) g            v = beta2 v + (1 - beta2) g^2
    m_hat = m / (1 - beta1^t)              v_hat = v / (1 - beta2^t)     (if bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
    trust = phi(||w||) / ||u||,  phi(z) = min(z, max_weight_norm)        (1 if either norm is 0)
    w = w - lr * trust * u

This is also PopTorch's ``poptorch.optim.LAMB`` update, so the CPU/CUDA and IPU paths train
the same way; ``max_weight_norm=None`` leaves ``||w||`` unclamped, and a group with
``max_weight_norm=0`` gets trust ratio 1 (plain Adam-style update, as Graphcore's BERT does
for biases).

Packing changes how many sequences one optimizer step sees (about p times more, p = the
packing factor). The seeds offer two adjustments, both here (``adjust_for_packing``):
divide gradient accumulation by p (same sequences per update, same hyperparameters), or
keep the batch and raise LAMB's betas to the power p (the momentum after one packed
update then matches p unpacked updates with nearly equal gradients; paper Appendix D).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "OptimConfigError",
    "Lamb",
    "parameter_groups",
    "build_optimizer",
    "linear_schedule",
    "build_schedule",
    "PACKING_ADJUSTMENTS",
    "adjust_gradient_accumulation",
    "adjust_lamb_betas",
    "adjust_for_packing",
]

OPTIMIZERS = ("lamb", "adamw")
SCHEDULES = ("linear", "constant")
PACKING_ADJUSTMENTS = ("none", "gradient_accumulation", "betas")


class OptimConfigError(ValueError):
    """An optimiser / schedule setting is invalid (one-line message)."""


class Lamb(torch.optim.Optimizer):
    """LAMB (see the module docstring for the update).

    Per-group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``,
    ``max_weight_norm`` (None = no clamp; 0 = trust ratio 1 for this group).
    The update is computed in float32 whatever the parameter dtype.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_weight_norm: Optional[float] = None,
    ):
        if not lr >= 0.0 or not math.isfinite(lr):
            raise OptimConfigError(f"LAMB lr must be a finite number >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise OptimConfigError(f"LAMB betas must be in [0, 1), got {tuple(betas)}")
        if not 0.0 < eps < math.inf:
            raise OptimConfigError(f"LAMB eps must be a finite number > 0, got {eps}")
        if not 0.0 <= weight_decay < math.inf:
            raise OptimConfigError(f"LAMB weight_decay must be a finite number >= 0, got {weight_decay}")
        if max_weight_norm is not None and not 0.0 <= max_weight_norm < math.inf:
            raise OptimConfigError(f"LAMB max_weight_norm must be null or a finite number >= 0, got {max_weight_norm}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_weight_norm=max_weight_norm,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise OptimConfigError("LAMB does not support sparse gradients")
                grad = param.grad.float()
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                step = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if group["bias_correction"]:
                    m_hat = exp_avg / (1.0 - beta1**step)
                    v_hat = exp_avg_sq / (1.0 - beta2**step)
                else:
                    m_hat, v_hat = exp_avg, exp_avg_sq
                weight = param.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"] != 0.0:
                    update = update.add(weight, alpha=group["weight_decay"])
                weight_norm = weight.norm()
                if group["max_weight_norm"] is not None:
                    weight_norm = weight_norm.clamp(max=group["max_weight_norm"])
                update_norm = update.norm()
                # trust = phi(||w||) / ||u||, or 1 when either norm is 0 (fresh zero biases,
                # or max_weight_norm = 0 to switch the trust ratio off for a group).
                trust = torch.where(
                    (weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, torch.ones_like(weight_norm)
                )
                param.add_((update * (-group["lr"] * trust)).to(param.dtype))
        return loss


def _no_decay(name: str, param: nn.Parameter) -> bool:
    # Biases and LayerNorm scales/offsets are not decayed (BERT's original exclusion list).
    return name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name or param.ndim < 2


def parameter_groups(model: nn.Module, weight_decay: float, *, bias_max_weight_norm: Optional[float] = None) -> List[Dict]:
    """Two groups: decayed weights, and biases + LayerNorm parameters without weight decay.

    ``bias_max_weight_norm`` sets ``max_weight_norm`` for the no-decay group only (0 turns
    its trust ratio off, as Graphcore's BERT does; None keeps the published LAMB).
    Tied parameters appear once.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if _no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    if bias_max_weight_norm is not None:
        groups[1]["max_weight_norm"] = float(bias_max_weight_norm)
    return [group for group in groups if group["params"]]


def build_optimizer(
    model: nn.Module,
    name: str = "lamb",
    *,
    lr: float,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    max_weight_norm: Optional[float] = None,
    bias_max_weight_norm: Optional[float] = 0.0,
) -> torch.optim.Optimizer:
    """``"lamb"`` (ours) or ``"adamw"`` (torch's) over ``parameter_groups(model, weight_decay)``.

    LAMB: ``max_weight_norm`` clamps the trust ratio's ``||w||`` of the decayed weights (None =
    unclamped); ``bias_max_weight_norm`` that of biases and LayerNorm parameters. Its default 0
    switches their trust ratio off (a plain Adam-style step), Graphcore's choice: with the trust
    ratio a LayerNorm gain's step is proportional to its own norm, so the gains can grow
    geometrically (the tiny config reached norms of 1e17 and NaN at step ~2000). None keeps the
    published LAMB for them too.
    """
    if name == "lamb":
        groups = parameter_groups(model, weight_decay, bias_max_weight_norm=bias_max_weight_norm)
    else:
        groups = parameter_groups(model, weight_decay)
    if name == "lamb":
        return Lamb(groups, lr=lr, betas=tuple(betas), eps=eps, bias_correction=bias_correction, max_weight_norm=max_weight_norm)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    raise OptimConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")


def linear_schedule(step: int, *, warmup_steps: int, total_steps: int, decay: bool = True) -> float:
    """LR multiplier at ``step`` (0-based): linear warm-up from 0 to 1 over ``warmup_steps``,
    then linear decay to 0 at ``total_steps`` (or constant 1 if ``decay`` is False)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not decay:
        return 1.0
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def build_schedule(
    optimizer: torch.optim.Optimizer,
    schedule: str = "linear",
    *,
    total_steps: int,
    warmup_steps: Optional[int] = None,
    warmup_fraction: Optional[float] = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with warm-up then ``"linear"`` decay to 0 or ``"constant"``.

    Give the warm-up as ``warmup_steps`` or as ``warmup_fraction`` of ``total_steps`` (not
    both). Call ``scheduler.step()`` after every optimizer step.
    """
    if schedule not in SCHEDULES:
        raise OptimConfigError(f"unknown lr schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise OptimConfigError(f"total_steps must be >= 1, got {total_steps}")
    if warmup_steps is not None and warmup_fraction is not None:
        raise OptimConfigError("give warmup_steps or warmup_fraction, not both")
    if warmup_fraction is not None:
        if not 0.0 <= warmup_fraction <= 1.0:
            raise OptimConfigError(f"warmup_fraction must be in [0, 1], got {warmup_fraction}")
        warmup_steps = int(math.ceil(warmup_fraction * total_steps))
    warmup_steps = int(warmup_steps or 0)
    if warmup_steps < 0:
        raise OptimConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    decay = schedule == "linear"
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_schedule(step, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay)
    )


# ----------------------------------------------------------------------------- packing adjustments


def _check_packing_factor(packing_factor: float) -> float:
    packing_factor = float(packing_factor)
    if not packing_factor >= 1.0:
        raise OptimConfigError(f"packing_factor (sequences per pack) must be >= 1, got {packing_factor}")
    return packing_factor


def adjust_gradient_accumulation(gradient_accumulation: int, packing_factor: float) -> int:
    """Micro-batches per step so a packed step sees about as many sequences as an unpacked one.

    ``round(gradient_accumulation / p)``, at least 1 (e.g. 2048 at p = 1.17 -> 1750, the
    value of Graphcore's packed phase-1 config; 2048 at p = 2.0 -> 1024).
    """
    packing_factor = _check_packing_factor(packing_factor)
    if gradient_accumulation < 1:
        raise OptimConfigError(f"gradient_accumulation must be >= 1, got {gradient_accumulation}")
    return max(1, int(round(gradient_accumulation / packing_factor)))


def adjust_lamb_betas(betas: Sequence[float], packing_factor: float) -> Tuple[float, float]:
    """``(beta1 ** p, beta2 ** p)``: the paper's heuristic for keeping the batch of packs."""
    packing_factor = _check_packing_factor(packing_factor)
    return (float(betas[0]) ** packing_factor, float(betas[1]) ** packing_factor)


def adjust_for_packing(
    method: str,
    *,
    gradient_accumulation: int,
    betas: Sequence[float],
    packing_factor: float,
) -> Tuple[int, Tuple[float, float]]:
    """Apply one of ``PACKING_ADJUSTMENTS``; returns ``(gradient_accumulation, betas)``.

    ``"none"``: unchanged; ``"gradient_accumulation"``: divide it by p; ``"betas"``: betas ** p.
    """
    if method == "none":
        return int(gradient_accumulation), (float(betas[0]), float(betas[1]))
    if method == "gradient_accumulation":
        return adjust_gradient_accumulation(gradient_accumulation, packing_factor), (float(betas[0]), float(betas[1]))
    if method == "betas":
        return int(gradient_accumulation), adjust_lamb_betas(betas, packing_factor)
    raise OptimConfigError(f"unknown packing adjustment {method!r}; choose one of: {', '.join(PACKING_ADJUSTMENTS)}")
