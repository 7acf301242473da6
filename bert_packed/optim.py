"""Optimisation for packed BERT: LAMB in plain torch and the LR schedule.

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

The packing adjustments of the hyperparameters (gradient accumulation / p, or LAMB's betas
** p) are step arithmetic: ``bert_packed.loop.plan``.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from bert_packed.errors import OptimConfigError

__all__ = [
    "OptimConfigError",
    "Lamb",
    "parameter_groups",
    "build_optimizer",
    "adamw",
    "grad_norm_",
    "step_unless_non_finite",
    "linear_schedule",
    "build_schedule",
]

OPTIMIZERS = ("lamb", "adamw")
SCHEDULES = ("linear", "constant")


class Lamb(torch.optim.Optimizer):
    """LAMB (see the module docstring for the update).

    Per-group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``,
    ``max_weight_norm`` (None = no clamp; 0 = trust ratio 1 for this group), ``foreach``.
    The update is computed in float32 whatever the parameter dtype.

    ``foreach=True``: the multi-tensor path, each operation one ``torch._foreach_*`` call over
    all tensors of a group (one kernel launch per operation for all tensors on a GPU).
    ``False``: the per-tensor reference implementation, the published algorithm written out;
    the two agree to float32 rounding (tested within 1e-6 over 5 steps). ``None`` (default):
    foreach on every device. On the CPU a foreach operation is a loop over the tensors inside one
    call, yet it still measured 1.5-1.9x faster than the per-tensor step on all-MiniLM-L6-v2's
    105 tensors on a quiet 2-core machine, 1.5x with a ``found_inf`` flag (docs/benchmarks/trainer.md;
    an earlier measurement under heavy load had it slower, and that was the load).
    ``clip_and_step(max_norm)``: the gradient clipping and this update as one ``torch.compile``d
    function (the ``cuda.compile_optimizer`` lever), equal to ``grad_norm_`` then ``step(found_inf=)``
    to float32 rounding.
    ``state["step"]`` is a float32 0-dim tensor on the parameter's device (the
    step count can then stay on the device when an update is skipped, see ``step``); an int
    from an older checkpoint is converted on the next step.
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
        foreach: Optional[bool] = None,
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
            foreach=None if foreach is None else bool(foreach),
        )
        super().__init__(params, defaults)
        self._lr_tensors: Dict[int, torch.Tensor] = {}  # clip_and_step: each group's rate on the device
        self._compiled = None  # clip_and_step's compiled function, made on first use

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: Optional[torch.Tensor] = None, _clip=None):
        """One update of every parameter that has a gradient.

        ``found_inf``: a 0-dim tensor on the parameters' device, nonzero when this step's
        gradients are not finite (e.g. ``grad_norm_(...)[1]``). Then nothing changes (weights,
        moments, step counts), and the foreach path decides it on the device without reading
        the flag on the host (no synchronisation): the coefficients of the moment and weight
        updates are selected by the flag and the gradient is read through ``nan_to_num``, so
        ``w - 0 * u`` is exactly ``w``. The per-tensor reference path decides it on the device the
        same way, one tensor at a time.
        """
        if _clip is not None:  # clip_and_step, come through step() so that a schedule sees the update
            return self._clip_and_update(*_clip)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = self._params_with_state(group)
            if not params:
                continue
            if group.get("foreach") is not False:  # None (default) or True
                self._multi_tensor_step(group, params, found_inf)
            else:
                self._single_tensor_step(group, params, found_inf)
        return loss

    def _params_with_state(self, group) -> List[torch.Tensor]:
        """The group's parameters that have a gradient, each with its state (created on first use)."""
        params = [p for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise OptimConfigError("LAMB does not support sparse gradients")
        for param in params:
            state = self.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
            elif not torch.is_tensor(state["step"]):  # an int from an older checkpoint
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=param.device)
            elif state["step"].device != param.device:
                # torch's Optimizer.load_state_dict moves every state tensor to its parameter's
                # device except "step", which stays where the checkpoint was loaded (the CPU): a
                # resumed GPU run then mixed devices in the first foreach update (seen on an H200).
                state["step"] = state["step"].to(param.device)
        return params

    def clip_and_step(self, max_norm: Optional[float] = None, *, compiled: bool = True
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Clipping and the update as one function: ``grad_norm_`` over this optimizer's parameters
        (every trained parameter of a model built by ``parameter_groups``), then ``step(found_inf=)``
        with its flag; returns ``(norm, found_inf)`` as ``grad_norm_`` does. ``compiled``: the
        function goes through ``torch.compile`` once (inductor fuses the foreach chains into a few
        kernels; the learning rate enters as a 0-dim tensor on the device, filled each step, so a
        schedule does not recompile it); ``False`` runs the same function eagerly, the reference.
        Nothing is read on the host either way."""
        return self.step(_clip=(max_norm, compiled))

    def _clip_and_update(self, max_norm: Optional[float], compiled: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        groups = []
        for index, group in enumerate(self.param_groups):
            params = self._params_with_state(group)
            if not params:
                continue
            lr = self._lr_tensors.get(index)
            if lr is None or lr.device != params[0].device:
                lr = self._lr_tensors[index] = torch.zeros((), dtype=torch.float32, device=params[0].device)
            lr.fill_(group["lr"])  # a device write, no host read
            states = [self.state[p] for p in params]
            groups.append(([s["step"] for s in states], params, [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], lr, _hyperparameters(group)))
        if not groups:
            zero = torch.zeros(())
            return zero, zero.clone()
        if not compiled:
            return _clip_and_update(groups, max_norm)
        if self._compiled is None:
            self._compiled = torch.compile(_clip_and_update, dynamic=False)
        return self._compiled(groups, max_norm)

    def _single_tensor_step(self, group, params, found_inf) -> None:
        """The published update, one tensor at a time: the reference the foreach path is tested
        against (``foreach=False``). Nothing is read on the host: the bias corrections come
        from the step count on the device, and a skipped step (``found_inf``) is decided there as
        on the foreach path (beta := 1 keeps the moments, the weight update is multiplied by 0,
        the step count does not move)."""
        beta1, beta2 = group["betas"]
        skip = None if found_inf is None else (found_inf != 0).to(torch.float32)
        for param in params:
            grad = param.grad.float()
            state = self.state[param]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if skip is None:
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            else:
                state["step"] += 1.0 - skip
                grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
                keep_beta1, keep_beta2 = beta1 + (1.0 - beta1) * skip, beta2 + (1.0 - beta2) * skip
                exp_avg.mul_(keep_beta1).add_(grad * (1.0 - keep_beta1))
                exp_avg_sq.mul_(keep_beta2).add_(grad * grad * (1.0 - keep_beta2))
            if group["bias_correction"]:
                # 1 - beta^t in float64 on the device; t at least 1 (a skipped first step leaves 0).
                step = state["step"].double().clamp(min=1.0)
                m_hat = exp_avg / (1.0 - torch.pow(beta1, step)).float()
                v_hat = exp_avg_sq / (1.0 - torch.pow(beta2, step)).float()
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
            scale = -group["lr"] * trust if skip is None else -group["lr"] * trust * (1.0 - skip)
            param.add_((update * scale).to(param.dtype))

    def _multi_tensor_step(self, group, params, found_inf) -> None:
        """The same update as ``_single_tensor_step``, one ``torch._foreach_*`` call per operation
        (``_lamb_update``)."""
        states = [self.state[p] for p in params]
        _lamb_update([s["step"] for s in states], params, [p.grad for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], lr=group["lr"], found_inf=found_inf,
                     **_hyperparameters(group))


def _hyperparameters(group) -> Dict:
    """A LAMB group's constant settings, as ``_lamb_update`` takes them."""
    return dict(betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"],
                bias_correction=group["bias_correction"], max_weight_norm=group["max_weight_norm"])


def _clip_and_update(groups, max_norm: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``Lamb.clip_and_step``'s function: the global gradient norm and clip (``_norm_and_clip``),
    then every group's update with the step's ``found_inf``. ``groups``: (steps, params, exp_avgs,
    exp_avg_sqs, lr, hyperparameters) per group, ``lr`` a 0-dim tensor."""
    norm, found_inf = _norm_and_clip([p.grad for _, params, *_ in groups for p in params], max_norm)
    for steps, params, exp_avgs, exp_avg_sqs, lr, hyper in groups:
        _lamb_update(steps, params, [p.grad for p in params], exp_avgs, exp_avg_sqs, lr=lr, found_inf=found_inf,
                     **hyper)
    return norm, found_inf


def _lamb_update(steps, params, grads, exp_avgs, exp_avg_sqs, *, lr, betas, eps, weight_decay, bias_correction,
                 max_weight_norm, found_inf) -> None:
    """LAMB's multi-tensor update of ``params`` (see ``Lamb``): one ``torch._foreach_*`` call per operation.

    Written as ``m_hat / (sqrt(v_hat) + eps) = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)``; the
    per-tensor bias corrections and trust ratios are 0-dim tensors (no host read). ``lr``: a
    number or a 0-dim tensor on the parameters' device."""
    beta1, beta2 = betas
    grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
    fp32 = all(p.dtype == torch.float32 for p in params)
    weights = list(params) if fp32 else [p.float() for p in params]
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        # Skipped step (found_inf != 0): beta := 1 keeps the moments (1 * m + 0 * g), lr := 0
        # keeps the weights, the step counts do not move. The gradient is read without its
        # non-finite values, so that 0 * g is 0 (nan_to_num allocates: only on this path).
        skip = (found_inf != 0).to(torch.float32)
        keep = 1.0 - skip
        grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
        torch._foreach_add_(steps, [keep] * len(steps))
    if found_inf is None:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m + (1 - beta1)(g - m)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    else:
        # The same three updates with the flag folded into 0-dim coefficients, as few passes
        # over the tensors as the plain step plus one: m + (1 - beta1) keep (g - m), and
        # v (beta2 + (1 - beta2) skip) + (c g)^2 with c = sqrt((1 - beta2) keep).
        torch._foreach_lerp_(exp_avgs, grads, [(1.0 - beta1) * keep] * len(grads))
        scaled = torch._foreach_mul(grads, [((1.0 - beta2) * keep).sqrt()] * len(grads))
        torch._foreach_mul_(exp_avg_sqs, [beta2 + (1.0 - beta2) * skip] * len(exp_avg_sqs))
        torch._foreach_addcmul_(exp_avg_sqs, scaled, scaled)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    if bias_correction:
        # 1 - beta^t of every tensor at once, in float64 like the reference's Python floats.
        # At least 1: a skipped first update leaves t at 0, where 1 - beta^0 = 0 would make the
        # (discarded) update 0/0 = NaN and NaN * 0 would reach the weights; otherwise t >= 1.
        step_vector = torch.stack(steps).double().clamp(min=1.0)
        bc1 = (1.0 - torch.pow(beta1, step_vector)).float().unbind()
        sqrt_bc2 = (1.0 - torch.pow(beta2, step_vector)).sqrt().float().unbind()
        torch._foreach_div_(denominators, list(sqrt_bc2))
        torch._foreach_add_(denominators, eps)
        updates = torch._foreach_div(exp_avgs, denominators)
        torch._foreach_div_(updates, list(bc1))
    else:
        torch._foreach_add_(denominators, eps)
        updates = torch._foreach_div(exp_avgs, denominators)
    if weight_decay != 0.0:
        torch._foreach_add_(updates, weights, alpha=weight_decay)
    weight_norms = torch.stack(torch._foreach_norm(weights))
    if max_weight_norm is not None:
        weight_norms = weight_norms.clamp(max=max_weight_norm)
    update_norms = torch.stack(torch._foreach_norm(updates))
    trust = torch.where((weight_norms > 0) & (update_norms > 0), weight_norms / update_norms,
                        torch.ones_like(weight_norms))
    scale = -lr * trust if found_inf is None else -lr * trust * keep
    torch._foreach_mul_(updates, list(scale.unbind()))
    if fp32:
        torch._foreach_add_(params, updates)
    else:
        for param, update in zip(params, updates):
            param.add_(update.to(param.dtype))


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


IMPLEMENTATIONS = ("auto", "fused", "foreach", "single_tensor")


def adamw(groups: List[Dict], *, lr: float, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
          implementation: str = "auto") -> torch.optim.AdamW:
    """``torch.optim.AdamW`` on its fastest path.

    ``"auto"``: ``fused=True`` where this torch has the fused kernel for the parameters' device
    (CPU since torch 2.4, CUDA): one pass over each tensor per step instead of about eight, and
    it honours a ``found_inf`` flag on the device (``step_unless_non_finite``); else
    ``foreach=True`` (torch 2.0.1 on the CPU: one ``torch._foreach_*`` call per operation).
    torch's own default on the CPU is the per-tensor loop (``"single_tensor"``), the reference.
    """
    if implementation not in IMPLEMENTATIONS:
        raise OptimConfigError(f"unknown optimizer implementation {implementation!r}; choose one of: "
                               f"{', '.join(IMPLEMENTATIONS)}")
    options = dict(lr=lr, betas=tuple(betas), eps=eps)
    if implementation in ("auto", "fused"):
        try:  # copies: torch writes its defaults into the group dicts it is given
            return torch.optim.AdamW([dict(g) for g in groups], fused=True, **options)
        except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device / torch
            if implementation == "fused":
                raise OptimConfigError("this torch has no fused AdamW for the parameters' device") from None
    return torch.optim.AdamW([dict(g) for g in groups], foreach=implementation != "single_tensor",
                             **options)


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
    implementation: str = "auto",
) -> torch.optim.Optimizer:
    """``"lamb"`` (ours) or ``"adamw"`` (torch's) over ``parameter_groups(model, weight_decay)``.

    LAMB: ``max_weight_norm`` clamps the trust ratio's ``||w||`` of the decayed weights (None =
    unclamped); ``bias_max_weight_norm`` that of biases and LayerNorm parameters. Its default 0
    switches their trust ratio off (a plain Adam-style step), Graphcore's choice: with the trust
    ratio a LayerNorm gain's step is proportional to its own norm, so the gains can grow
    geometrically (the tiny config reached norms of 1e17 and NaN at step ~2000). None keeps the
    published LAMB for them too.

    ``implementation``: ``"auto"`` (default) picks the fastest path: LAMB's multi-tensor
    (foreach) update off the CPU and its per-tensor one on the CPU (``Lamb(foreach=None)``),
    AdamW fused where available (see ``adamw``), else foreach; ``"single_tensor"`` is the
    per-tensor reference of either; ``"foreach"``/``"fused"`` force one.
    """
    if implementation not in IMPLEMENTATIONS:
        raise OptimConfigError(f"unknown optimizer implementation {implementation!r}; choose one of: "
                               f"{', '.join(IMPLEMENTATIONS)}")
    if name == "lamb":
        if implementation == "fused":
            raise OptimConfigError("LAMB has no fused implementation; use auto, foreach or single_tensor")
        groups = parameter_groups(model, weight_decay, bias_max_weight_norm=bias_max_weight_norm)
        return Lamb(groups, lr=lr, betas=tuple(betas), eps=eps, bias_correction=bias_correction,
                    max_weight_norm=max_weight_norm,
                    foreach={"auto": None, "foreach": True, "single_tensor": False}[implementation])
    if name == "adamw":
        return adamw(parameter_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, implementation=implementation)
    raise OptimConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")


# ----------------------------------------------------------------------------- device-side step pieces


def grad_norm_(parameters: Iterable[torch.Tensor], max_norm: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(norm, found_inf)``: the global L2 norm of the gradients before clipping and a 0-dim
    float flag (1.0 when the norm is not finite: a NaN/inf gradient, or one too large for
    float32), both on the gradients' device, computed with ``torch._foreach_norm`` (one call
    for all tensors). With ``max_norm`` the gradients are scaled in place by
    ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule).

    Nothing is read on the host: the caller passes ``found_inf`` to ``step_unless_non_finite``
    and reads ``norm`` whenever it logs (one transfer per log interval, not per step).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        zero = torch.zeros(())
        return zero, zero.clone()
    return _norm_and_clip(grads, max_norm)


def _norm_and_clip(grads: List[torch.Tensor], max_norm: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``grad_norm_`` of a non-empty list of gradients."""
    grads32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads32)))
    found_inf = (~torch.isfinite(norm)).to(torch.float32)
    if max_norm is not None:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, [coefficient.to(g.dtype) for g in grads])
    return norm, found_inf


def step_unless_non_finite(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` that changes nothing when ``found_inf`` (a 0-dim device tensor) is
    nonzero, decided on the device where the optimizer can: ``Lamb`` (``step(found_inf=)``)
    and torch's fused optimizers (their ``found_inf`` attribute, as ``GradScaler`` sets it).
    Other optimizers (e.g. foreach AdamW on torch 2.0.1) read the flag on the host first."""
    if isinstance(optimizer, Lamb):
        optimizer.step(found_inf=found_inf)
    elif getattr(optimizer, "defaults", {}).get("fused"):
        optimizer.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not found_inf.item():
        optimizer.step()


def linear_schedule(step: int, *, warmup_steps: int, total_steps: int, decay: bool = True,
                    warmup_from_zero: bool = False) -> float:
    """LR multiplier at ``step`` (0-based): linear warm-up from 0 to 1 over ``warmup_steps``,
    then linear decay to 0 at ``total_steps`` (or constant 1 if ``decay`` is False).

    The warm-up's first step runs at ``1 / warmup_steps`` (no step is spent at rate 0), or with
    ``warmup_from_zero`` at 0, ``step / warmup_steps`` as transformers'
    ``get_linear_schedule_with_warmup`` (the Trainer's schedule: its first step leaves the
    weights as they are and only fills AdamW's moments)."""
    if step < warmup_steps:
        return (step if warmup_from_zero else step + 1) / warmup_steps
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
    warmup_from_zero: bool = False,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with warm-up then ``"linear"`` decay to 0 or ``"constant"``.

    Give the warm-up as ``warmup_steps`` or as ``warmup_fraction`` of ``total_steps`` (not
    both; a fraction is rounded up, ``ceil(fraction * total_steps)``, as the Trainer's
    ``warmup_ratio``). ``warmup_from_zero``: see ``linear_schedule``. Call
    ``scheduler.step()`` after every optimizer step.
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
        optimizer, lambda step: linear_schedule(step, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay,
                                                warmup_from_zero=warmup_from_zero)
    )
