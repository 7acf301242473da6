"""Model annotations (``BeginBlock``, ``Block``, ``recomputationCheckpoint``, ...) and the loss marker.

On the IPU these are recorded while PopTorch traces the model; outside a PopTorch executor they
are no-ops, so an annotated model still runs eagerly on the CPU (as with real PopTorch). The
mock executor installs a ``_Recorder`` for the duration of each forward; the annotations write
into it, and the executor checks what was recorded (stages, losses).
"""
import contextlib

import torch

from .errors import Error

# Loss functions PopTorch lowers to a loss (identityloss) node; calls to them are recorded so the
# executor can enforce "exactly one final loss" like PopTorch's RemoveSurplusIdentityLosses pass.
LOSS_FUNCTION_NAMES = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                       "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
                       "huber_loss", "soft_margin_loss", "hinge_embedding_loss")


class _Recorder:
    """What one traced/executed forward did: blocks entered (in order) and losses produced."""

    def __init__(self):
        self.blocks = []         # [(user_id, ipu_id)] in execution order
        self.losses = []         # [(kind, tensor)] in call order; kind "identity_loss" or a function name
        self.num_checkpoints = 0
        self.serialization_factors = []  # factor of every serializedMatMul, in call order
        self._auto_id = 0

    def next_auto_id(self):
        block_id = str(self._auto_id)
        self._auto_id += 1
        return block_id


_ACTIVE = None  # the _Recorder of the forward being run by a mock executor, else None


def _active():
    return _ACTIVE


@contextlib.contextmanager
def recording(recorder):
    """Route annotations and loss calls of the enclosed forward into ``recorder``."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = recorder
    functional = torch.nn.functional
    originals = {name: getattr(functional, name) for name in LOSS_FUNCTION_NAMES if hasattr(functional, name)}

    def wrap(name, fn):
        def loss_fn(*args, **kwargs):
            out = fn(*args, **kwargs)
            if _ACTIVE is not None:
                _ACTIVE.losses.append((name, out))
            return out
        return loss_fn

    for name, fn in originals.items():
        setattr(functional, name, wrap(name, fn))
    try:
        yield recorder
    finally:
        for name, fn in originals.items():
            setattr(functional, name, fn)
        _ACTIVE = previous


def isRunningOnIpu():
    """True only inside a forward run by a (mock) PopTorch executor."""
    return _ACTIVE is not None


# ---------------------------------------------------------------------------------------------
# Blocks (pipeline stage annotations)
# ---------------------------------------------------------------------------------------------

class _BlockHook:
    def __init__(self, user_id, ipu_id):
        self.user_id = user_id
        self.ipu_id = ipu_id

    def __call__(self, module, inputs):
        recorder = _active()
        if recorder is not None:
            user_id = self.user_id if self.user_id is not None else recorder.next_auto_id()
            recorder.blocks.append((user_id, self.ipu_id))
        return None


def BeginBlock(layer_to_call, user_id=None, ipu_id=None):
    """Start a new block at ``layer_to_call``: the module and everything run after it belongs to
    the block until the next one starts. Registers a forward pre-hook in place and returns the
    same module (PopTorch >= 2.1 semantics)."""
    if not isinstance(layer_to_call, torch.nn.Module):
        raise Error("BeginBlock only supports torch.nn.Module instances in this mock; "
                    "use poptorch.Block for other callables")
    if getattr(layer_to_call, "_poptorch_block_hook", None) is not None:
        raise Error("module has already been assigned to a block: call poptorch.removeBlocks first")
    hook = _BlockHook(user_id, ipu_id)
    handle = layer_to_call.register_forward_pre_hook(hook)
    layer_to_call._poptorch_block_hook = (hook, handle)
    return layer_to_call


def removeBlocks(module):
    """Strip every BeginBlock annotation from ``module`` and its children."""
    for sub in module.modules():
        entry = getattr(sub, "_poptorch_block_hook", None)
        if entry is not None:
            entry[1].remove()
            sub._poptorch_block_hook = None


class Block:
    """``with poptorch.Block("Encoder", ipu_id=1): ...`` starts a block for the enclosed code."""

    def __init__(self, user_id=None, ipu_id=None):
        self.user_id = user_id
        self.ipu_id = ipu_id

    @staticmethod
    def useAutoId():
        recorder = _active()
        if recorder is not None:
            recorder._auto_id = 0

    @staticmethod
    def start(user_id=None, ipu_id=None):
        _BlockHook(user_id, ipu_id)(None, None)

    def __enter__(self):
        Block.start(self.user_id, self.ipu_id)
        return self

    def __exit__(self, *exc):
        return False


def BlockFunction(user_id=None, ipu_id=None):
    def decorator(fn):
        def wrapper(*args, **kwargs):
            with Block(user_id, ipu_id):
                return fn(*args, **kwargs)
        return wrapper
    return decorator


# ---------------------------------------------------------------------------------------------
# Tensor annotations: identities on the CPU
# ---------------------------------------------------------------------------------------------

def recomputationCheckpoint(*tensors):
    """Mark tensors to keep for recomputation; numerically the identity.

    One tensor -> that tensor; several -> a tuple; a single list/tuple -> the same container type.
    """
    container = None
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        container = type(tensors[0])
        tensors = tuple(tensors[0])
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("All inputs must be tensors")
    recorder = _active()
    if recorder is not None:
        recorder.num_checkpoints += len(tensors)
    if container is not None:
        return container(tensors)
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def set_available_memory(tensor, available_memory_proportion):
    if not isinstance(tensor, torch.Tensor):
        raise Error("set_available_memory must be applied to a single tensor")
    if not 0.0 < float(available_memory_proportion) <= 1.0:
        raise Error("available_memory_proportion must be in (0, 1]")
    return tensor


def serializedMatMul(lhs, rhs, mode, factor=0, keep_precision=False):
    """``lhs @ rhs``. PopTorch asserts the argument types; inside an executable the compile
    applies PopART's MatMulOp checks: a factor that is 0 or does not divide the serialised
    dimension is an error (willow/src/op/matmul.cpp)."""
    from .enums import MatMulSerializationMode

    if not isinstance(keep_precision, bool) or not isinstance(factor, int):
        raise AssertionError("serializedMatMul: factor must be an int and keep_precision a bool")
    if not isinstance(mode, MatMulSerializationMode):
        raise AssertionError("serializedMatMul: mode must be a poptorch.MatMulSerializationMode")
    if _active() is not None and mode != MatMulSerializationMode.Disabled:
        if factor == 0:
            raise Error(f"Invalid serialisation factor {factor}. Serialisation factor must be a non-zero "
                        f"positive integer.", type="popart_exception")
        if mode == MatMulSerializationMode.InputChannels:
            size, what = lhs.shape[-2], "input channels dim"
            rule = "input_channels dim should be a multiple of the serialisation factor "
        elif mode == MatMulSerializationMode.ReducingDim:
            size, what = lhs.shape[-1], "reducing dimension"
            rule = "reducing_dim dim should be a multiple of the serialisation factor "
        else:
            size, what = rhs.shape[-1], "output channels dim"
            rule = "output_channels dim should be a multiple of the serialisation factor "
        if size % factor:
            raise Error(f"Invalid serialisation factor {factor} for {what} {size}. {rule}", type="popart_exception")
        _active().serialization_factors.append(factor)
    return torch.matmul(lhs, rhs)


def identity_loss(x, reduction):
    """Mark ``x`` as the final loss. ``reduction`` is "sum", "mean" or "none" (as PopTorch)."""
    if reduction not in ("sum", "mean", "none"):
        raise AssertionError("reduction must be one of 'sum', 'mean' or 'none'")
    if reduction == "sum":
        out = x.sum()
    elif reduction == "mean":
        out = x.mean()
    else:
        out = x.clone()  # a new autograd node, so the marker is distinguishable from its input
    recorder = _active()
    if recorder is not None:
        recorder.losses.append(("identity_loss", out))
    return out


def ipu_print_tensor(tensor, title=""):
    return tensor


def nop(tensor):
    return tensor
