"""``poptorch.optim``: the optimizers PopTorch compiles onto the IPU, with host ``step()``s.

On the IPU the Python ``step()`` never runs (PopART's built-in update does); the mock runs these
``step()``s instead, written to PopART's documented update (``popart/adam.hpp``), so the mock
executor applies the same arithmetic the device would (in fp32 here).

Arguments passed as ``None`` take PopTorch's defaults and are "constant" (compiled in); arguments
passed explicitly are "variable" (changeable via ``setOptimizer``), as in PopTorch.
"""
import math

import torch


class VariableAttributes:
    """Which optimizer attributes are variable (updatable after compilation)."""

    def __init__(self, variable, allowed):
        self._variable = set(variable)
        self._allowed = set(allowed)

    def _check(self, attr):
        if attr not in self._allowed:
            raise ValueError(f"Unknown optimizer attribute '{attr}', expected one of {sorted(self._allowed)}")

    def markAsConstant(self, attr):
        self._check(attr)
        self._variable.discard(attr)

    def markAsVariable(self, attr):
        self._check(attr)
        self._variable.add(attr)

    def isConstant(self, attr):
        return attr not in self._variable


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (PopART ``AdamMode::Lamb``; ``LambNoBias`` without bias correction).

    Per parameter ``w`` with (already loss-scale-corrected) gradient ``g`` at step ``t``::

        m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
        m^, v^ = m/(1-b1^t), v/(1-b2^t)            (only with bias_correction)
        u = m^ / (sqrt(v^) + eps) + weight_decay * w
        r1 = min(||w||, max_weight_norm); r2 = ||u||
        w -= lr * (r1 / r2 if r1 > 0 and r2 > 0 else 1) * u

    ``max_weight_norm`` is read per parameter group, as on the device (a group with
    ``max_weight_norm=0`` gets trust ratio 1: Graphcore's BERT does that for biases).
    """

    _ATTRIBUTES = ("lr", "betas", "eps", "weight_decay", "max_weight_norm")

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, bias_correction=None,
                 loss_scaling=None, max_weight_norm=None, accum_type=None,
                 first_order_momentum_accum_type=None, second_order_momentum_accum_type=None):
        given = {name for name, value in (("lr", lr), ("betas", betas), ("eps", eps),
                                          ("weight_decay", weight_decay),
                                          ("max_weight_norm", max_weight_norm)) if value is not None}
        defaults = dict(lr=1e-3 if lr is None else lr,
                        betas=(0.9, 0.999) if betas is None else tuple(betas),
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=65500.0 if max_weight_norm is None else max_weight_norm)
        for dtype in (accum_type, first_order_momentum_accum_type, second_order_momentum_accum_type):
            if dtype not in (None, torch.float16, torch.float32):
                raise ValueError("accumulation types must be torch.float16 or torch.float32")
        super().__init__(params, defaults)
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        self.loss_scaling = 1.0 if loss_scaling is None else float(loss_scaling)
        self.accum_type = accum_type or torch.float32
        self.first_order_momentum_accum_type = first_order_momentum_accum_type or torch.float32
        self.second_order_momentum_accum_type = second_order_momentum_accum_type or torch.float32
        self.variable_attrs = VariableAttributes(given | {"lr"}, self._ATTRIBUTES)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.float()
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.first_order_momentum_accum_type)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.second_order_momentum_accum_type)
                state["step"] += 1
                step = state["step"]
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                if self.bias_correction:
                    exp_avg = exp_avg / (1.0 - beta1 ** step)
                    exp_avg_sq = exp_avg_sq / (1.0 - beta2 ** step)
                weight = param.float()
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"]) + group["weight_decay"] * weight
                weight_norm = min(float(weight.norm()), float(group["max_weight_norm"]))
                update_norm = float(update.norm())
                trust_ratio = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
                param.copy_(weight - group["lr"] * trust_ratio * update)
        return loss


def _torch_optimizer(base, extra_defaults):
    """A PopTorch optimizer class: the torch one plus PopTorch-only keyword arguments."""

    class _Optimizer(base):
        def __init__(self, params, *args, **kwargs):
            extras = {name: kwargs.pop(name, None) for name in extra_defaults}
            torch_kwargs = {k: v for k, v in kwargs.items() if v is not None}
            super().__init__(params, *args, **torch_kwargs)
            for name, default in extra_defaults.items():
                setattr(self, name, default if extras[name] is None else extras[name])
            given = set(torch_kwargs) | {"lr"}
            self.variable_attrs = VariableAttributes(given, set(self.defaults) | set(extra_defaults))

    _Optimizer.__name__ = base.__name__
    _Optimizer.__qualname__ = base.__name__
    return _Optimizer


_COMMON = {"loss_scaling": 1.0, "accum_type": torch.float32, "max_grad_norm": math.inf}
SGD = _torch_optimizer(torch.optim.SGD, dict(_COMMON, velocity_scaling=1.0, use_combined_accum=False,
                                             velocity_accum_type=torch.float32))
Adam = _torch_optimizer(torch.optim.Adam, dict(_COMMON, first_order_momentum_accum_type=torch.float32,
                                               second_order_momentum_accum_type=torch.float32))
AdamW = _torch_optimizer(torch.optim.AdamW, dict(_COMMON, bias_correction=True,
                                                 first_order_momentum_accum_type=torch.float32,
                                                 second_order_momentum_accum_type=torch.float32))
RMSprop = _torch_optimizer(torch.optim.RMSprop, dict(_COMMON, use_tf_variant=False,
                                                     first_order_momentum_accum_type=torch.float32,
                                                     second_order_momentum_accum_type=torch.float32))
