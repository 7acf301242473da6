"""``poptorch.optim``: the optimizers PopTorch compiles onto the IPU, with host ``step()``s.

On the IPU the Python ``step()`` never runs (PopART's built-in update does); the mock runs these
``step()``s instead, written to PopART's documented update (``popart/adam.hpp``), so the mock
executor applies the same arithmetic the device would (in fp32 here).

Arguments passed as ``None`` take PopTorch's defaults and are "constant" (compiled in); arguments
passed explicitly are "variable" (changeable via ``setOptimizer``), as in PopTorch
(``optim.py`` ``_parseArgs``: every constructor argument that is not None, positional or keyword,
is variable; ``variable_attrs.markAsConstant`` / ``markAsVariable`` override). ``describe`` turns
an optimizer into what PopTorch sends PopART (``_optimizer_attributes.convertOptimizerToDict``:
each value with its const-ness), and ``check_replacement`` refuses a ``setOptimizer`` that
changes a compiled constant, with PopART's messages (``OptimizerValue::validReplacement``).

Every optimizer here is also PopTorch's ``Optimizer`` (``optim.py``): its ``state_dict()`` is
``{"ipu_state", "ipu_param", "state", "param_groups"}``, where the optimizer state lives in
``ipu_state`` (read from the device by the executor; the host's torch ``state`` stays empty, as
the host never steps), and ``load_state_dict`` refuses a state without the two ``ipu_*`` keys.
"""
import inspect
import math

import torch


class VariableAttributes:
    """Which optimizer attributes are variable (updatable after compilation); PopTorch's class."""

    def __init__(self, variable_attributes, allowed_attributes):
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr):
        return attr not in self._variable_attributes

    def markAsConstant(self, attr):
        assert attr in self._allowed_attributes, (f"Unknown attribute {attr}, allowed values: "
                                                  f"{self._allowed_attributes}")
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr):
        assert attr in self._allowed_attributes, (f"Unknown attribute {attr}, allowed values: "
                                                  f"{self._allowed_attributes}")
        self._variable_attributes.append(attr)


_ACCUM_TYPES_ERROR = "Accumulation types must be either torch.float32 or torch.float16"


class Optimizer:
    """PopTorch's optimizer base (``optim.py`` ``Optimizer``), literally: the IPU's optimizer
    state travels in ``ipu_state`` / ``ipu_param`` next to torch's own state dict (which keeps
    ``param_groups`` for LR schedulers). ``ipu_state_is_dirty``: the host holds a state the device
    must receive (a loaded checkpoint); ``host_state_is_dirty``: the device has run since the
    host's copy was read. A ``PoplarExecutor`` replaces ``state_dict`` by its own reader."""

    def __init__(self):
        self._state_dict = {"ipu_state": None, "ipu_param": None}
        self.ipu_state_is_dirty = False
        self.host_state_is_dirty = False

    def state_dict(self):
        return self.get_state_dict()

    def load_state_dict(self, state):
        # torch's first (param_groups: the learning rates schedulers see), then the IPU's.
        torch.optim.Optimizer.load_state_dict(self, state)
        self.set_state_dict(state)

    def get_state_dict(self):
        return {**self._state_dict, **torch.optim.Optimizer.state_dict(self)}

    def set_state_dict(self, state):
        if not state:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not ("ipu_state" in state and "ipu_param" in state):
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        self._state_dict = state
        self.ipu_state_is_dirty = True
        self.host_state_is_dirty = False

    def has_state(self):
        return self._state_dict.get("ipu_state") is not None and self._state_dict.get("ipu_param") is not None


class LAMB(Optimizer, torch.optim.Optimizer):
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

    _child_vars = ["loss_scaling"]
    _group_vars = ["lr", "weight_decay", "betas", "eps", "max_weight_norm"]

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, bias_correction=None,
                 loss_scaling=None, max_weight_norm=None, accum_type=None,
                 first_order_momentum_accum_type=None, second_order_momentum_accum_type=None, max_grad_norm=None):
        # PopTorch's _parseArgs(locals()): every argument given (not None) is variable.
        variables = [name for name, value in locals().items() if name != "self" and value is not None]
        defaults = dict(lr=1e-3 if lr is None else lr,
                        betas=(0.9, 0.999) if betas is None else betas,
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=65500.0 if max_weight_norm is None else max_weight_norm)
        Optimizer.__init__(self)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.bias_correction = True if bias_correction is None else bias_correction
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.max_weight_norm = defaults["max_weight_norm"]
        self.max_grad_norm = math.inf if max_grad_norm is None else max_grad_norm
        self.accum_type = accum_type or torch.float32
        self.first_order_momentum_accum_type = first_order_momentum_accum_type or torch.float32
        self.second_order_momentum_accum_type = second_order_momentum_accum_type or torch.float32
        for dtype in (self.accum_type, self.first_order_momentum_accum_type, self.second_order_momentum_accum_type):
            assert dtype in (torch.float16, torch.float32), _ACCUM_TYPES_ERROR
        self.variable_attrs = VariableAttributes(variables, list(self.defaults) + LAMB._child_vars)

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


def _torch_optimizer(base, extra_defaults, group_vars, extra_group_vars=()):
    """A PopTorch optimizer class: the torch one plus PopTorch-only keyword arguments."""
    torch_names = list(inspect.signature(base.__init__).parameters)[2:]  # after self, params

    class _Optimizer(Optimizer, base):
        _child_vars = ["loss_scaling"]
        _group_vars = list(group_vars)

        def __init__(self, params, *args, **kwargs):
            given = dict(zip(torch_names, args), **kwargs)
            # PopTorch's _parseArgs(locals()): every argument given (not None) is variable.
            variables = ["params"] + [name for name, value in given.items() if value is not None]
            extras = {name: given.pop(name, None) for name in extra_defaults}
            Optimizer.__init__(self)
            base.__init__(self, params, **{k: v for k, v in given.items() if v is not None})
            for name, default in extra_defaults.items():
                setattr(self, name, default if extras[name] is None else extras[name])
            for name in extra_group_vars:  # SGD's velocity_scaling with the combined variant
                if getattr(self, "use_combined_accum", False):
                    self.defaults[name] = getattr(self, name)
                    for group in self.param_groups:
                        group.setdefault(name, getattr(self, name))
            for name in ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
                         "second_order_momentum_accum_type"):
                if hasattr(self, name):
                    assert getattr(self, name) in (torch.float16, torch.float32), _ACCUM_TYPES_ERROR
            self.variable_attrs = VariableAttributes(variables, list(self.defaults) + ["loss_scaling"])

    _Optimizer.__name__ = base.__name__
    _Optimizer.__qualname__ = base.__name__
    return _Optimizer


_COMMON = {"loss_scaling": 1.0, "accum_type": torch.float32, "max_grad_norm": math.inf}
SGD = _torch_optimizer(torch.optim.SGD, dict(_COMMON, velocity_scaling=1.0, use_combined_accum=False,
                                             velocity_accum_type=torch.float32),
                       ["lr", "momentum", "dampening", "weight_decay", "nesterov", "velocity_scaling"],
                       extra_group_vars=("velocity_scaling",))
Adam = _torch_optimizer(torch.optim.Adam, dict(_COMMON, first_order_momentum_accum_type=torch.float32,
                                               second_order_momentum_accum_type=torch.float32),
                        ["lr", "betas", "eps", "weight_decay", "amsgrad"])
AdamW = _torch_optimizer(torch.optim.AdamW, dict(_COMMON, bias_correction=True,
                                                 first_order_momentum_accum_type=torch.float32,
                                                 second_order_momentum_accum_type=torch.float32),
                         ["lr", "betas", "weight_decay", "eps", "amsgrad"])
RMSprop = _torch_optimizer(torch.optim.RMSprop, dict(_COMMON, use_tf_variant=False,
                                                     first_order_momentum_accum_type=torch.float32,
                                                     second_order_momentum_accum_type=torch.float32),
                           ["lr", "momentum", "weight_decay", "alpha", "eps", "centered"])


# -- what PopART compiles: values and their const-ness (_optimizer_attributes.py) ----------------

# PopTorch attribute -> the name PopART's validReplacement reports (adam.cpp, sgd.cpp, adaptive.cpp).
POPART_NAMES = {"loss_scaling": "loss scaling", "lr": "learning rates", "weight_decay": "weight decays",
                "beta1": "beta1s", "beta2": "beta2s", "eps": "eps", "max_weight_norm": "mwn",
                "momentum": "momentums", "velocity_scaling": "velocity scalings", "nesterov": "nesterov",
                "alpha": "alphas"}
# The values each PopART optimizer's validReplacement checks (adam.cpp, sgd.cpp, adaptive.cpp).
_CHECKED = {"SGD": ("loss_scaling", "lr", "weight_decay", "momentum", "velocity_scaling", "nesterov"),
            "ADAM": ("loss_scaling", "lr", "weight_decay", "beta1", "beta2", "eps", "max_weight_norm"),
            "RMSPROP": ("loss_scaling", "lr", "weight_decay", "alpha", "momentum", "eps")}
_FAMILY = {"SGD1": "SGD", "SGD2": "SGD", "ADAM": "ADAM", "ADAMW": "ADAM", "ADAMW_NO_BIAS": "ADAM", "LAMB": "ADAM",
           "LAMB_NO_BIAS": "ADAM", "RMSPROP": "RMSPROP", "RMSPROP_CENTERED": "RMSPROP"}
_ATTRIBUTES = ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
               "second_order_momentum_accum_type", "use_tf_variant", "max_grad_norm", "bias_correction",
               "use_combined_accum")


def optimizer_type(optimizer):
    """PopTorch's ``_OptimizerType`` name of ``optimizer`` (``_toPoptorchOptimizer``)."""
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD1" if getattr(optimizer, "use_combined_accum", False) else "SGD2"
    if isinstance(optimizer, torch.optim.AdamW):
        return "ADAMW" if getattr(optimizer, "bias_correction", True) else "ADAMW_NO_BIAS"
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "RMSPROP_CENTERED" if optimizer.param_groups[0]["centered"] else "RMSPROP"
    if isinstance(optimizer, LAMB):
        return "LAMB" if optimizer.bias_correction else "LAMB_NO_BIAS"
    raise AssertionError("Unsupported optimizer type. Types supported SGD1, SGD2, ADAM, ADAMW, ADAMW_NO_BIAS, "
                         "RMSPROP, RMSPROP_CENTERED, LAMB, LAMB_NO_BIAS")


def _is_constant_by_value(name, value, kind, auto_loss_scaling):
    """PopTorch's const rule for an optimizer without ``variable_attrs`` (a plain torch one)."""
    if name in ("betas", "alpha", "nesterov"):
        return True
    if name == "lr":
        return False
    if name == "loss_scaling":
        return value == 1.0 and not auto_loss_scaling
    reference = {"weight_decay": 1e-2 if kind.startswith("ADAMW") else 0.0, "momentum": 0.0,
                 "velocity_scaling": 1.0, "dampening": 0.0, "eps": 1e-08, "max_weight_norm": 65500.0}
    return value == reference.get(name)


def describe(optimizer, *, auto_loss_scaling=False):
    """What PopTorch hands PopART for ``optimizer``: its type, attributes (fixed at compile
    time), and every hyperparameter as ``(value, is_const)``, for the defaults and each group."""
    kind = optimizer_type(optimizer)
    variable_attrs = getattr(optimizer, "variable_attrs", None)
    if variable_attrs is not None and auto_loss_scaling:
        variable_attrs.markAsVariable("loss_scaling")  # PopTorch: ALS needs a variable loss scale
    group_vars = getattr(type(optimizer), "_group_vars", None) or [
        k for k in optimizer.defaults if k in POPART_NAMES or k == "betas"]

    def pair(name, value):
        const = (variable_attrs.isConstant(name) if variable_attrs is not None
                 else _is_constant_by_value(name, value, kind, auto_loss_scaling))
        return value, bool(const)

    def read(source):
        values = {}
        for name in group_vars:
            if name not in source:
                continue
            value = source[name]
            if name == "betas":
                value_const = pair("betas", tuple(value))
                values["beta1"] = (float(value[0]), value_const[1])
                values["beta2"] = (float(value[1]), value_const[1])
            elif name in POPART_NAMES:
                values[name] = pair(name, value)
        return values

    defaults = read(optimizer.defaults)
    defaults["loss_scaling"] = pair("loss_scaling", getattr(optimizer, "loss_scaling", 1.0))
    attributes = {name: str(getattr(optimizer, name)) for name in _ATTRIBUTES if hasattr(optimizer, name)}
    return {"type": kind, "attributes": attributes, "defaults": defaults,
            "groups": [read(group) for group in optimizer.param_groups]}


def check_replacement(compiled, new, *, error, tensor_names=None):
    """Refuse ``new`` where PopART's ``Optimizer::validReplacement`` would: another optimizer
    type, or a value compiled as a constant that changes (or changes const-ness)."""
    if compiled["type"] != new["type"]:
        raise error(f"Can not replace optimizer of type {compiled['type']} with new optimizer of type "
                    f"{new['type']}", type="popart_exception")

    def check(old_pair, new_pair):
        (old_value, old_const), (new_value, new_const) = old_pair, new_pair
        if old_const != new_const:
            return "Can not replace a constant value with a non constant value."
        if old_const and float(old_value) - float(new_value) != 0.0:
            return "Values are constant but do not match."
        return None

    checked = _CHECKED[_FAMILY[compiled["type"]]]
    for name, old_pair in compiled["defaults"].items():
        if name not in new["defaults"] or name not in checked:
            continue
        problem = check(old_pair, new["defaults"][name])
        if problem:
            prefix = "" if name == "loss_scaling" else "Default value is not a valid replacement. "
            raise error(f"Problem with {POPART_NAMES[name]}. {prefix}{problem}", type="popart_exception")
    for index, (old_group, new_group) in enumerate(zip(compiled["groups"], new["groups"])):
        for name, old_pair in old_group.items():
            if name not in checked:
                continue
            problem = check(old_pair, new_group.get(name, old_pair))
            if problem:
                tensor = (tensor_names or {}).get(index, f"group {index}")
                raise error(f"Problem with {POPART_NAMES[name]}. OptimizerValue for tensor {tensor} is not a valid "
                            f"replacement.{problem}", type="popart_exception")
