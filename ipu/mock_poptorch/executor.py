"""``poptorch.trainingModel`` / ``inferenceModel`` on the CPU: PopTorch's batching semantics, run eagerly.

One call of a wrapped model is one PopTorch *run*. The host passes the whole run's data: every
batched input has ``B_host = micro_batch x device_iterations x (replication / input_group_size)
x gradient_accumulation`` rows, laid out ``[device_iterations, gradient_accumulation, replica,
micro_batch, ...]`` (PopART's order). The mock then does what the device does:

* for each device iteration: for each accumulation step, for each replica: forward + backward
  of that micro-batch; each replica accumulates its gradients in the optimizer's ``accum_type``
  as PopART does: ``MeanReductionStrategy.Post`` sums them (and all-reduces the replicas with a
  sum), ``Running`` keeps the running mean ``a = (1 - 1/(n+1)) a + g/(n+1)`` (and mean-reduces
  the replicas), so an fp16 accumulator overflows exactly when the device's would; Post then
  divides by accumulation x *global* replicas (``ReductionType.Mean``), the loss scale is undone
  in fp32, and one optimizer update follows: ``device_iterations`` updates per call.
* the device holds its OWN copy of the weights: runs update it, the host model changes only
  through ``copyWeightsToHost`` (or implicitly, as in PopTorch: ``detachFromDevice``,
  ``copyWeightsToHostIfNeeded`` and touching the wrapped model's parameters); copies need an
  attached executable, attaching uploads the host weights.
* fp16 models keep fp16 *storage* (weights, activations at module outputs, activation and weight
  gradients are rounded to fp16) with fp32 arithmetic, so the mock needs no fp16 CPU kernels
  (torch 2.0.1 has few) and gives the same numbers on every torch version.
* outputs come back per ``OutputMode`` (All / EveryN / Final / Sum), with PopTorch's shapes.
* training needs exactly one final loss (PopTorch's messages when there are none or several);
  pipeline annotations are recorded at "compile" time (the first call) and checked; the options
  go through PopTorch's session-option parser replayed on tables generated from its sources
  (``ipu/mock_popart/session_options.py``); ``useOfflineIpuTarget`` executables compile, never run.
* ``setOptimizer`` after compiling refuses a change to a value compiled as a constant, as
  PopART's ``Optimizer::validReplacement`` does (``poptorch.optim.describe``/``check_replacement``).
* the optimizer state lives on the device, as PopTorch's ``ipu_state``: a PopTorch optimizer's
  ``state_dict()`` reads it back when the device has run, a loaded one is written when the
  executable attaches (PopTorch's ``_read/_write_optim_state_dict_if_needed``).
* random numbers: a run draws them (dropout) from the executable's own seed and generator, never
  from the host's; ``rng_state`` reads and sets them as PopTorch 3.4 does (compiled executables
  only, read back at detach and set again at attach, PopART's ``enableLoadAndOffloadRNGState``).
* the executable cache: with ``enableExecutableCaching`` a compile computes the key from what
  PopART hashes (``cache_key``: the hashed session options, patterns, data flow, device, the
  traced graph's structure and the optimizer's constants) and "loads" a cached executable when
  one with that key exists (``loaded_from_cache``). The mock keeps its cache in memory, per
  process, and writes no files.

Numerics are eager PyTorch on the CPU; nothing here is a statement about IPU speed. The memory
estimate (``set_memory_estimator``) is a model, reported as such.
"""
import contextlib
import copy
import gc
import hashlib
import json
import math
import os
import time
import types
import warnings
import weakref

import torch

from ..mock_popart import session_options as _session_options
from . import ops
from . import optim as _optim
from .enums import AutoStage, ConnectionType, MeanReductionStrategy, OutputMode, ReductionType
from .errors import Error
from .options import Options, PipelinedExecution

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."

# The IPU system the mock pretends to be attached to (an IPU-POD16 by default); a run that asks
# for more IPUs fails at compile time as it would on the real system.
DEFAULT_NUM_AVAILABLE_IPUS = 16

_cycle_estimator = None  # fn(info dict) -> int; set by set_cycle_estimator (see ipu/estimates.py)
_memory_estimator = None  # fn(info dict) -> {"per_ipu_bytes": [...], "limit_bytes": int, "table": str} or None
# The mock's executable cache: (absolute cachePath, key digest) -> the key. PopART writes
# <cachePath>/<hash>.popef (popx/executablex.cpp); the mock only remembers, in this process.
_EXECUTABLE_CACHE = {}
TILES_PER_IPU = 1472  # GC200
# The mock device's RNG state: torch's CPU generator state, as PopART's vector of uint32 words.
_RNG_WORDS = torch.get_rng_state().numel() // 4


def _derived_generator_state(seed):
    """The generator state ``setRandomSeed(seed)`` derives on the (mock) device: torch's generator
    seeded from a hash of ``seed``, so it never equals the host's ``torch.manual_seed(seed)``."""
    digest = hashlib.sha256(f"mock-ipu-random-seed:{int(seed)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little")).get_state()


def clear_executable_cache():
    """Forget every cached executable (the mock's cache lives in this process only)."""
    _EXECUTABLE_CACHE.clear()


def set_cycle_estimator(fn):
    """Install the function ``cycleCount()`` uses: ``fn(info) -> int`` (estimated cycles of a run)."""
    global _cycle_estimator
    _cycle_estimator = fn


def set_memory_estimator(fn):
    """Install the per-IPU memory estimate the compile checks (see ipu/memory.py): ``fn(info)``
    returns ``{"per_ipu_bytes", "limit_bytes", "table"}`` or None when it cannot estimate."""
    global _memory_estimator
    _memory_estimator = fn


class _RoundToHalf(torch.autograd.Function):
    """fp16 storage on an fp32 tensor: round to the nearest fp16 value (overflow -> inf), both
    the value and, in backward, its gradient. Only dtype conversions, which every torch has."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.float16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.float16).to(grad.dtype)


def _round_half(obj):
    return _map(obj, lambda t: _RoundToHalf.apply(t) if t.dtype == torch.float32 else t)


def _is_half(tensor):
    return tensor.dtype == torch.float16


def num_available_ipus():
    return int(os.environ.get("MOCK_POPTORCH_NUM_IPUS", DEFAULT_NUM_AVAILABLE_IPUS))


_ATTACHED = weakref.WeakSet()  # executors holding IPUs of the (mock) system


def _acquire(executor):
    """Attach ``executor``'s IPUs; fails as Poplar does when the others hold too many."""
    def held():
        return sum(e.pipeline["num_ipus"] for e in _ATTACHED if e is not executor and e._attached)

    needed, available = executor.pipeline["num_ipus"], num_available_ipus()
    if held() + needed > available:
        gc.collect()  # executables nobody references any more have released their IPUs
    if held() + needed > available:
        raise Error(f"Failed to acquire {needed} IPUs: {held()} of the (mock) system's {available} are attached to "
                    f"another executable (detachFromDevice() it first)", type="poplar_error")
    _ATTACHED.add(executor)


def _raise_backward(*args, **kwargs):
    raise Error("backward() cannot be called explicitly on outputs of a PopTorch model. If you're "
                "using a trainingModel, the backwards pass is performed automatically when invoking "
                "the model. If you're using an inferenceModel, you should use a trainingModel instead.")


# ---------------------------------------------------------------------------------------------
# Nested structures of tensors (args, kwargs, outputs)
# ---------------------------------------------------------------------------------------------

def _flatten(obj, path="input"):
    """[(path, tensor)] of every tensor in a nested tuple/list/dict, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, (list, tuple)):
        return [item for i, o in enumerate(obj) for item in _flatten(o, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [item for k in obj for item in _flatten(obj[k], f"{path}[{k!r}]")]
    return []


def _leaves(obj):
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _leaves(o)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    return [obj]


def _rebuild(obj, leaves):
    """Same structure as ``obj`` with its leaves replaced, in order, from the iterator ``leaves``."""
    if isinstance(obj, tuple):
        return tuple(_rebuild(o, leaves) for o in obj)
    if isinstance(obj, list):
        return [_rebuild(o, leaves) for o in obj]
    if isinstance(obj, dict):
        return {k: _rebuild(v, leaves) for k, v in obj.items()}
    return next(leaves)


def _map(obj, fn):
    """Same structure as ``obj`` with ``fn`` applied to every tensor (other leaves kept)."""
    return _rebuild(obj, iter([fn(x) if isinstance(x, torch.Tensor) else x for x in _leaves(obj)]))


def _batch_factor(options):
    """Host rows per micro-batch row: one run carries device_iterations x (replicas / input
    group size) x gradient_accumulation micro-batches."""
    return (options.device_iterations * (options.replication_factor // options.input_group_size)
            * options.Training.gradient_accumulation)


def _graph_nodes(tensor):
    """Every autograd node ``tensor`` depends on (its own grad_fn included)."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return seen


class PoplarExecutor:
    """A model wrapped for the (mock) IPU. Call it like the model, with a whole run's data."""

    def __init__(self, model, options=None, training=True, optimizer=None):
        if options is not None and not isinstance(options, Options):
            raise Error(f"Invalid type: 'options' is of type {type(options)} (Expected poptorch.Options)")
        if options is None:
            options = Options()
        else:
            options._freeze()  # the user's object can no longer change: the executable is fixed
            options = options.clone()
        self._options = options
        self._training = training
        # Not PopTorch's: the mock runs micro-batches one by one on the host, so it can report each
        # one (set_micro_batch_callback): the training loop's progress and stop inside a step.
        self._micro_batch_callback = None
        if options.defaultOutputMode():
            options.outputMode(OutputMode.Final if training else OutputMode.All)
        if not training and options.Training.gradient_accumulation != 1:
            message = ("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its "
                       "default value (1) when running a poptorch.inferenceModel().")
            if type(options._execution_strategy) is PipelinedExecution:
                message += (" Use poptorch.Options().deviceIterations to process a sufficient number of batches "
                            "each run for pipelined execution instead.")
            raise Error(message)
        if training and optimizer is None:
            from .optim import SGD
            optimizer = SGD(model.parameters(), lr=0.01)
        self._user_model = model
        self._optimizer = None
        self._device_hyperparameters = None
        self._compiled = False
        self._attached = False
        self._device_state = None  # name -> tensor: the IPU's copy of the weights and buffers
        self._dirty_host_weights = False
        self._host_weights_version = 0
        self._quiet = 0            # >0: our own accesses to the model, no implicit weight copies
        self._half = False         # fp16 storage emulated (model has fp16 weights)
        self._meta = False         # weights on the meta device: compile (trace shapes) only
        self._emulating = False    # inside a run: rounding hooks active
        self._hooks = []
        self._signature = None
        self._final_loss_index = None
        self._num_loss_calls = None
        self.pipeline = None     # filled at compile: blocks, stages, IPUs (see _plan_pipeline)
        self.memory_estimate = None  # filled at compile when an estimator is installed
        self._has_run = False
        self._last_run_info = None
        self._accumulators = {}  # replica -> accumulated gradients of all parameters, flat (accum_type)
        self._trainable_cache = None
        self._session = None              # the parsed session options (PopART's view), at compile
        self._optimizer_description = None  # what the last setOptimizer would send PopART
        self._compiled_optimizer = None   # ... and what the executable was compiled with
        self._pending_optimizer = None    # set while detached: pushed at attach or the next run
        self.cache_key = None             # what PopART hashes into the executable-cache key
        self.loaded_from_cache = False
        # The optimizer's state on the device: parameter name -> that parameter's state (the
        # host optimizer's torch ``state`` stays empty, as in PopTorch; see ``rng_state`` too).
        self._device_optimizer_state = {}
        # The executable's random numbers (PopTorch's names): the host's cached [seed, *state],
        # read back lazily after a run; the device's own seed and generator (see _DeviceRng).
        self._host_rng_state_is_dirty = False
        self._cached_rng_state = [options.random_seed] if options.exists("random_seed") else None
        self._device_rng = None            # [seed, torch generator state]: the device's, from compile on
        self._requires_random_seed = False
        if training:
            self.setOptimizer(optimizer)
        options._freeze()
        if training:
            _wrap_user_model(model, self)

    # -- properties and plumbing ------------------------------------------------------------
    @property
    def model(self):
        return self._user_model

    @property
    def options(self):
        return self._options

    def __getattr__(self, name):
        # Unknown attributes go to the wrapped model, as in PopTorch.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._user_model, name)

    @contextlib.contextmanager
    def _internal(self):
        """The executor's own accesses to the model's tensors (no implicit copyWeightsToHost)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _state_tensors(self):
        with self._internal():
            return list(self._user_model.named_parameters()) + list(self._user_model.named_buffers())

    def isCompiled(self):
        return self._compiled

    def isAttachedToDevice(self):
        return self._compiled and self._attached

    # -- attach / detach and weight copies (PopTorch _poplar_executor.py) --------------------
    def _require_attached(self, what):
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        if not self._attached:
            # PopART runs the WeightsToHost/FromHost program on the engine, which needs the
            # device: on a detached executable Poplar fails to load the engine.
            raise Error(f"{what}() on a detached executable: the weights can only move to or from an "
                        f"executable attached to the IPUs (use detachFromDevice() on the other executable "
                        f"and attachToDevice() on this one; attaching uploads the host weights)",
                        type="poplar_error")

    def detachFromDevice(self):
        """Detach: a training executable first copies its weights to the host if they changed."""
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        if not self._attached:
            raise Error("Device is not attached")
        _ = self.rng_state  # PopTorch reads every state back before detaching
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._read_optim_state_dict_if_needed()
        self._attached = False

    def attachToDevice(self):
        """Attach and upload the host weights (PopTorch's ``_on_device_attach``)."""
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        if self._options.connection_type == ConnectionType.Never:
            raise AssertionError("Trying to attach to an offline device (ConnectionType.Never)")
        if self._attached:
            raise Error("Device is already attached")
        _acquire(self)
        self._attached = True
        self._on_device_attach()

    def _on_device_attach(self, upload_weights=True):
        """PopTorch's ``_on_device_attach``: upload the weights, the optimizer's hyperparameters,
        the optimizer state the host holds (a loaded checkpoint, or the copy read at detach),
        and the cached random seed and RNG state."""
        if upload_weights:
            self.copyWeightsToDevice()
        self._push_optimizer()
        optimizer = self._optimizer
        if isinstance(optimizer, _optim.Optimizer):
            if optimizer.has_state():
                optimizer.ipu_state_is_dirty = True
                self._write_optim_state_dict_if_needed()
            else:
                optimizer.host_state_is_dirty = True
                optimizer.ipu_state_is_dirty = False
        if self._cached_rng_state is not None:
            self._copy_rng_state_to_device()

    def copyWeightsToHostIfNeeded(self):
        """True if the host weights were out of date and have been updated."""
        if self._dirty_host_weights:
            self.copyWeightsToHost()
            return True
        return False

    def copyWeightsToHost(self):
        self._require_attached("copyWeightsToHost")
        self._dirty_host_weights = False
        with torch.no_grad():
            for name, tensor in self._state_tensors():
                tensor.copy_(self._device_state[name])
        self._host_weights_version += 1

    def copyWeightsToDevice(self):
        self._require_attached("copyWeightsToDevice")
        self._dirty_host_weights = False
        if self._optimizer is not None:
            self._optimizer.state_dict()  # as PopTorch: the device's optimizer state to the host first
        self._device_state = {name: tensor.detach().clone() for name, tensor in self._state_tensors()}

    def destroy(self):
        if not self._compiled:
            self._unwrap()
            return
        if self._training and self._attached:
            self.copyWeightsToHostIfNeeded()
            self._optimizer.state_dict()  # the optimizer state back to the host
        self._compiled = False
        self._attached = False
        self._device_state = None
        self._unwrap()

    def _unwrap(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        base = getattr(type(self._user_model), "_poptorch_base_class", None)
        if self._training and base is not None:
            self._user_model.__class__ = base

    # -- random numbers: the executable's own seed and RNG state (PopTorch ``rng_state``) ----
    @property
    def rng_state(self):
        """``[seed, *rng_state]`` of the executable (PopTorch 3.4 ``PoplarExecutor.rng_state``):
        read from the device after a run, else the cached value (``[Options.randomSeed]`` until
        the first run, None without one)."""
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        if self._host_rng_state_is_dirty:
            self._host_rng_state_is_dirty = False
            self._cached_rng_state = [self._get_random_seed()] + self._get_rng_words()
        return self._cached_rng_state

    @rng_state.setter
    def rng_state(self, state):
        """Set the seed and RNG state, e.g. a checkpoint's; needs a compiled executable (PopTorch
        keeps it and sets it on the device now if attached, else at the next attach)."""
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        self._host_rng_state_is_dirty = False
        self._cached_rng_state = list(state)
        if self.isAttachedToDevice():
            self._copy_rng_state_to_device()

    def _check_rng_offload(self, verb):
        # PopTorch turns PopART's enableLoadAndOffloadRNGState on unless the user set it.
        if not self._session["session"].get("enableLoadAndOffloadRNGState", True):
            raise Error(f"Trying to {verb} the RNG state, but the session option enableLoadAndOffloadRNGState must "
                        f"be set to True.", type="popart_exception")

    def _get_random_seed(self):
        """``Compiler::getRandomSeed``: 0 for a graph without random behaviour."""
        return self._device_rng[0] if self._requires_random_seed else 0

    def _get_rng_words(self):
        """``Session::getRNGState``: the generator state as unsigned 32-bit words."""
        self._check_rng_offload("get")
        return [word & 0xFFFFFFFF for word in self._device_rng[1].view(torch.int32).tolist()]

    def _copy_rng_state_to_device(self):
        """``Compiler::setRngState(seed, state)``: the seed (a graph without random behaviour
        ignores it), which derives a new generator state; then the state, if given."""
        seed, words = self._cached_rng_state[0], self._cached_rng_state[1:]
        if self._requires_random_seed:
            self._device_rng = [int(seed), _derived_generator_state(int(seed))]
        if words:
            self._check_rng_offload("set")
            if len(words) != _RNG_WORDS:
                raise Error(f"Devicex::setRngStateValue received rngState of size {len(words)}; was expecting size "
                            f"{_RNG_WORDS}", type="popart_exception")
            signed = [word - (1 << 32) if word >= (1 << 31) else word for word in words]
            self._device_rng[1] = torch.tensor(signed, dtype=torch.int32).view(torch.uint8)

    @contextlib.contextmanager
    def _device_random_numbers(self):
        """A run draws its random numbers (dropout) from the executable's generator, never from
        the host's torch generator, which it leaves as it was."""
        host = torch.get_rng_state()
        torch.set_rng_state(self._device_rng[1])
        try:
            yield
        finally:
            self._device_rng[1] = torch.get_rng_state()
            torch.set_rng_state(host)

    # -- optimizer: the device only sees hyperparameters pushed by setOptimizer -------------
    @staticmethod
    def _read_hyperparameters(optimizer):
        if optimizer is None:
            return None
        return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    def setOptimizer(self, optimizer):
        """Push new hyperparameters (e.g. after ``scheduler.step()``) to the device.

        As in PopTorch, changing ``param_groups[i]["lr"]`` on the host without calling this
        leaves the device on the old values; the mock reproduces that. An fp16 ``accum_type``
        selects ``MeanReductionStrategy.Running`` before compilation and is refused after a
        compilation with another strategy (PopTorch ``_optimizer_attributes.py``).
        """
        if not self._training:
            raise Error("setOptimizer is only valid for training models")
        if getattr(optimizer, "accum_type", None) == torch.float16 and not getattr(optimizer, "use_combined_accum",
                                                                                   False):
            training = self._options.Training
            if not self._compiled:
                training._unfreeze()
                training.setMeanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running)
                if self._options._is_frozen:
                    training._freeze()
            elif training.meanAccumulationAndReplicationReductionStrategy != MeanReductionStrategy.Running:
                raise ValueError("Invalid optimizer: the new optimizer would require changing options.Training."
                                 "meanAccumulationAndReplicationReductionStrategy to poptorch.MeanReductionStrategy."
                                 "Running but the executable is already compiled.")
        if self._compiled and optimizer is not self._optimizer:
            # As PopTorch: the old optimizer keeps the state read back from the device and stops
            # reading; a brand-new optimizer's state (if it has one) goes to the device.
            if isinstance(self._optimizer, _optim.Optimizer):
                self._read_optim_state_dict_if_needed()
                self._optimizer.state_dict = self._optimizer.get_state_dict
            if isinstance(optimizer, _optim.Optimizer):
                optimizer.ipu_state_is_dirty = True
        if isinstance(optimizer, _optim.Optimizer):
            # PopTorch instruments state_dict() to read the device's state back when it is newer.
            optimizer.state_dict = types.MethodType(PoplarExecutor._get_optim_state_dict, self)
        self._optimizer = optimizer
        auto_loss_scaling = bool(self._options._Popart.options.get("automaticLossScalingSettings.enabled", False))
        self._optimizer_description = _optim.describe(optimizer, auto_loss_scaling=auto_loss_scaling)
        self._pending_optimizer = (self._read_hyperparameters(optimizer), self._optimizer_description)
        if not self._compiled or self._attached:
            self._push_optimizer()
        if self._compiled and self._attached:
            self._write_optim_state_dict_if_needed()

    # -- the optimizer state: on the device, read and written as PopTorch does -----------------
    def _get_optim_state_dict(self):
        self._read_optim_state_dict_if_needed()
        return self._optimizer.get_state_dict()

    def _read_optim_state_dict_if_needed(self):
        """PopTorch's: when the device has run since the host's copy was read, read it."""
        optimizer = self._optimizer
        if not isinstance(optimizer, _optim.Optimizer) or not optimizer.host_state_is_dirty:
            return
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        assert not optimizer.ipu_state_is_dirty, "Both host and ipu states cannot be dirty at the same time."
        optimizer.set_state_dict({**self._read_optimizer_state(), **torch.optim.Optimizer.state_dict(optimizer)})
        optimizer.ipu_state_is_dirty = False

    def _write_optim_state_dict_if_needed(self):
        """PopTorch's: a state loaded on the host (``load_state_dict``) goes to the device."""
        if not self._compiled:
            raise Error(NO_EXECUTABLE_ERR)
        optimizer = self._optimizer
        if isinstance(optimizer, _optim.Optimizer) and optimizer.ipu_state_is_dirty:
            assert not optimizer.host_state_is_dirty, "Both host and ipu states cannot be dirty at the same time."
            if optimizer.has_state():
                self.copyWeightsToHostIfNeeded()
                self._write_optimizer_state(optimizer.state_dict())
            optimizer.ipu_state_is_dirty = False

    def _read_optimizer_state(self):
        """``poptorch_core.readOptimizerState``: ``ipu_state`` (the optimizer's state tensors,
        ``<key>___<parameter>``) and ``ipu_param`` (the hyperparameters the device holds,
        ``<name>___group<i>``). Copies: the device keeps its own. (A None entry, torch's SGD
        without momentum, is no tensor: nothing to read.)"""
        state = {f"{key}___{name}": value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
                 for name, entries in self._device_optimizer_state.items() for key, value in entries.items()
                 if value is not None}
        params = {}
        for i, group in enumerate(self._device_hyperparameters or []):
            for key, value in group.items():
                if key == "betas":
                    params[f"beta1___group{i}"], params[f"beta2___group{i}"] = (torch.tensor(float(v)) for v in value)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    params[f"{key}___group{i}"] = torch.tensor(float(value))
        params["loss_scaling"] = torch.tensor(self._loss_scaling())
        return {"ipu_state": state, "ipu_param": params}

    def _write_optimizer_state(self, state_dict):
        """``poptorch_core.writeOptimizerState``: every state tensor of the executable from
        ``ipu_state`` (a missing one is kept, with PopTorch's warning; unknown ones are ignored).
        The mock allocates a parameter's state at its first update, not at compile time, so
        before one the tensors expected are those of the trainable parameters named in
        ``ipu_state``. ``ipu_param`` is not applied: the hyperparameters come from setOptimizer."""
        names = {name for name, _ in self._trainable()}
        given = {}
        for key, value in state_dict["ipu_state"].items():
            entry, _, name = key.partition("___")
            if name in names:
                # An integer scalar was a Python number on the device (LAMB's step count).
                restored = value.item() if value.dim() == 0 and not value.is_floating_point() else value.clone()
                given.setdefault(name, {})[entry] = restored
        for name, entries in self._device_optimizer_state.items():
            for entry, value in entries.items():
                if entry not in given.get(name, {}):
                    if value is not None:
                        warnings.warn(f"writeOptimizerState: ignoring missing state {entry}___{name}")
                    given.setdefault(name, {})[entry] = value
        self._device_optimizer_state = given

    def _push_optimizer(self):
        """The last ``setOptimizer``'s values to the device (PopTorch: at once when attached, else at
        the next attach or run); PopART refuses a change to a compiled constant."""
        if self._pending_optimizer is None:
            return
        hyperparameters, description = self._pending_optimizer
        if self._compiled_optimizer is not None:
            with self._internal():
                names = {id(p): n for n, p in self._user_model.named_parameters()}
            first = {i: names.get(id(g["params"][0]), f"group {i}") if g["params"] else f"group {i}"
                     for i, g in enumerate(self._optimizer.param_groups)}
            _optim.check_replacement(self._compiled_optimizer, description, error=Error, tensor_names=first)
        self._device_hyperparameters = hyperparameters
        self._pending_optimizer = None

    def _optimizer_step(self):
        """The update with the DEVICE's hyperparameters and optimizer state (torch's ``step``
        reads both from the optimizer: they are swapped in and back out)."""
        optimizer = self._optimizer
        host_values = self._read_hyperparameters(optimizer)
        for group, values in zip(optimizer.param_groups, self._device_hyperparameters):
            group.update(values)
        for name, param in self._trainable():
            if name in self._device_optimizer_state:
                optimizer.state[param] = self._device_optimizer_state[name]
        self._clip_gradients(float(getattr(optimizer, "max_grad_norm", math.inf)))
        try:
            optimizer.step()
        finally:
            for group, values in zip(optimizer.param_groups, host_values):
                group.update(values)
            for name, param in self._trainable():
                if param in optimizer.state:
                    self._device_optimizer_state[name] = optimizer.state.pop(param)

    def _clip_gradients(self, max_norm):
        """The optimizer's ``max_grad_norm`` (PopART's clip-norm settings): every trainable
        gradient scaled by ``max_norm / max(norm, max_norm)``, the norm over all of them (fp32)."""
        if not math.isfinite(max_norm):
            return
        grads = [param.grad for _, param in self._trainable() if param.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        scale = max_norm / torch.clamp(norm, min=max_norm)
        for grad in grads:
            grad.mul_(scale.to(grad.dtype))

    # -- batching ---------------------------------------------------------------------------
    def _check_batch(self, args, kwargs):
        """Per input (path, micro-batch shape, dtype); PopTorch's _narrow_tensor assertion."""
        o = self._options
        factor = _batch_factor(o)
        signature = []
        for path, tensor in _flatten(args, "args") + _flatten(kwargs, "kwargs"):
            batch = 1 if tensor.dim() == 0 else tensor.shape[0]  # a 0-d input counts as a batch of 1
            if batch % factor:
                raise AssertionError(
                    f"Invalid batch dimension: In the input {tensor.shape}, the batch dimension ({batch}) must be "
                    f"a multiple of Options.deviceIterations({o.device_iterations}) * "
                    f"(Options.replicationFactor({o.replication_factor}) / "
                    f"Options.inputReplicaGrouping.input_group_size({o.input_group_size})) * "
                    f"Options.Training.gradientAccumulation({o.Training.gradient_accumulation}) = {factor} because "
                    f"it is used to calculate the batch size which will be executed on the device in any given "
                    f"iteration. For a full explanation see the batching semantics page of the documentation.")
            shape = () if tensor.dim() == 0 else (batch // factor,) + tuple(tensor.shape[1:])
            signature.append((path, shape, tensor.dtype))
        return signature

    def _micro_batch(self, obj, iteration, accumulation, replica):
        """The inputs replica ``replica`` sees at (device iteration, accumulation step)."""
        o = self._options
        shape = (o.device_iterations, o.Training.gradient_accumulation, o.replication_factor // o.input_group_size)
        data_replica = replica // o.input_group_size

        def take(tensor):
            if self._meta:
                tensor = tensor.to("meta")  # a model without weights traces on shapes alone
            if tensor.dim() == 0:
                return tensor.float() if self._half and _is_half(tensor) else tensor
            if tensor.requires_grad:
                tensor = tensor.detach()
            if self._half and _is_half(tensor):
                tensor = tensor.float()  # fp16 values, fp32 arithmetic
            view = tensor.reshape(shape + (-1,) + tuple(tensor.shape[1:]))
            return view[iteration, accumulation, data_replica]
        return _map(obj, take)

    # -- compile: trace once, check annotations, options and the loss --------------------------
    def compile(self, *args, **kwargs):
        if self._compiled:
            warnings.warn("Call to compile() ignored: the executable is already compiled")
            return
        self._compile(args, kwargs)

    def _compile(self, args, kwargs):
        for path, tensor in _flatten(args, "args") + _flatten(kwargs, "kwargs"):
            if tensor.requires_grad:
                warnings.warn("Input tensor has requires_grad=True set. This tensor will be detached "
                              "because backward pass via inputs is not supported.")
        # What PopTorch's SessionOptionsParser does with Options.toDict() (tables from its sources).
        self._session = _session_options.parse(self._options._backend_dict(), error=Error)
        self._signature = self._check_batch(args, kwargs)
        named = self._state_tensors()
        self._half = any(_is_half(t) for _, t in named)
        self._meta = any(t.is_meta for _, t in named)
        if self._half and not self._hooks:
            self._install_rounding()
        # The upload that compiling does: the device starts from the host weights. (An offline
        # executable never runs: it needs no copy.)
        offline = self._options.connection_type == ConnectionType.Never
        self._device_state = {name: tensor.detach() if offline else tensor.detach().clone() for name, tensor in named}
        micro_args = self._micro_batch(args, 0, 0, 0)
        micro_kwargs = self._micro_batch(kwargs, 0, 0, 0)
        # Trace with the micro batch; keep the host RNG untouched so the run that follows draws
        # the same random numbers (dropout) as an eager run would.
        rng_state = torch.get_rng_state()
        recorder = ops._Recorder()
        try:
            with self._on_device(), ops.recording(recorder), torch.set_grad_enabled(self._training):
                outputs = self._user_model(*micro_args, **micro_kwargs)
            # PopART's RandomSetup: the graph needs a random seed when it has random operations
            # (the trace drew random numbers: dropout in training) or stochastic rounding is on.
            random_ops = not torch.equal(torch.get_rng_state(), rng_state)
            self._requires_random_seed = random_ops or bool(
                self._session["session"].get("enableStochasticRounding", False))
            if self._training:
                self._final_loss_index = self._find_final_loss(recorder, outputs)
                self._num_loss_calls = len(recorder.losses)
            self.pipeline = self._plan_pipeline(recorder)
            self._check_output_mode()
        finally:
            torch.set_rng_state(rng_state)
            for _, tensor in named:
                tensor.grad = None
        if not _flatten(outputs, "output"):
            raise Error("Your compiled model is empty (All the operations have been optimised out)")
        self._estimate_memory()
        if self._training:
            self._compiled_optimizer = self._optimizer_description  # PopTorch compiles the last setOptimizer's
            self._pending_optimizer = None
        self._use_executable_cache(named, outputs)
        # PopART seeds a new executable from the clock (Executablex); PopTorch then sets the
        # Options.randomSeed value, if there is one, when it attaches.
        seed = time.time_ns() & 0xFFFFFFFFFFFFFFFF
        self._device_rng = [seed, _derived_generator_state(seed)]
        self._host_rng_state_is_dirty = False
        self._compiled = True
        if self._options.connection_type != ConnectionType.Never:
            _acquire(self)
            self._attached = True  # the compiled engine is loaded with the weights uploaded above
            self._on_device_attach(upload_weights=False)

    def _use_executable_cache(self, named, outputs):
        """PopART's executable cache (ir.cpp ``std::hash<IrBundle>``, executablex.cpp): with caching
        on and a hardware target (a real or offline IPU, not the IPU Model), a compile whose key
        is cached loads it, else its executable is saved under the key."""
        o, session = self._options, self._session["session"]
        info = {"ir": {"training": self._training, "inputs": [(p, list(s), str(d)) for p, s, d in self._signature],
                       "outputs": len(_flatten(outputs, "output")), "final_loss": self._final_loss_index,
                       "weights": [(n, list(t.shape), str(t.dtype)) for n, t in named],
                       "execution_mode": self._options._execution_strategy.execution_mode,
                       "blocks": [list(b) for b in self.pipeline["blocks"]],
                       "recomputation_checkpoints": self.pipeline["num_recomputation_checkpoints"],
                       "serialization_factors": self.pipeline["serialization_factors"],
                       "available_memory_proportion": sorted(self._session["memory_proportions"].items())},
                "data_flow": {"batches_per_step": o.device_iterations, "output_mode": o.output_mode,
                              "output_return_period": o.output_return_period},
                "device": {"hardware": not o._values.get("use_model", False),
                           "arch": f"ipu{o._values.get('ipu_version', 2)}",
                           "num_ipus": self.pipeline["num_ipus"], "tiles_per_ipu": TILES_PER_IPU},
                "optimizer": self._constant_optimizer_values(),
                "version": "mock"}
        info.update(_session_options.cache_view(self._session))
        self.cache_key = info
        if not (session.get("enableEngineCaching") and session.get("cachePath") and info["device"]["hardware"]):
            return
        digest = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]
        entry = (os.path.abspath(session["cachePath"]), digest)
        self.loaded_from_cache = entry in _EXECUTABLE_CACHE
        _EXECUTABLE_CACHE[entry] = info

    def _constant_optimizer_values(self):
        """The optimizer as PopART hashes it: type and attributes, every value's const-ness and
        the values of the constants only (optimizervalue.cpp ``std::hash<OptimizerValue>``)."""
        description = self._compiled_optimizer
        if description is None:
            return None

        def constants(values):
            return {k: [bool(c), v if c else None] for k, (v, c) in sorted(values.items())}
        return {"type": description["type"], "attributes": description["attributes"],
                "defaults": constants(description["defaults"]),
                "groups": [constants(g) for g in description["groups"]]}

    def _estimate_memory(self):
        """The installed per-IPU memory estimate; warns, with the figures, above an IPU's memory
        (the real compile would fail with out-of-memory unless debug.allowOutOfMemory)."""
        if _memory_estimator is None or not self._training:
            return
        info = {"model": self._user_model, "signature": self._signature, "pipeline": self.pipeline,
                "training": self._training, "options": self._options, "optimizer": self._optimizer}
        with self._internal():
            estimate = _memory_estimator(info)
        self.memory_estimate = estimate
        if not estimate:
            return
        over = [i for i, b in enumerate(estimate["per_ipu_bytes"]) if b > estimate["limit_bytes"]]
        if over:
            figures = ", ".join(f"IPU{i} {b / 2**20:,.0f} MiB" for i, b in enumerate(estimate["per_ipu_bytes"]))
            warnings.warn(f"estimated memory above the {estimate['limit_bytes'] / 2**20:,.0f} MiB of an IPU on "
                          f"IPU{', IPU'.join(map(str, over))} ({figures}); the real compile would run out of "
                          f"memory. Estimate (a model, not Poplar's report):\n{estimate.get('table', '')}")

    def _install_rounding(self):
        """fp16 storage of activations: every leaf module's outputs are rounded to fp16 in runs."""
        def hook(module, inputs, output):
            return _round_half(output) if self._emulating else None
        for module in self._user_model.modules():
            if not list(module.children()):
                self._hooks.append(module.register_forward_hook(hook))

    @contextlib.contextmanager
    def _on_device(self):
        """During a run the model's tensors hold the DEVICE copy (fp32 working copies of fp16
        storage); afterwards the device copy is stored back and the host's returns."""
        named = self._state_tensors()
        host = {}
        for name, tensor in named:
            host[name] = tensor.data
            device = self._device_state[name]
            tensor.data = device.float() if _is_half(device) else device
            if isinstance(tensor, torch.nn.Parameter):
                tensor.grad = None
        self._quiet += 1
        self._emulating = self._half
        try:
            yield
        finally:
            self._emulating = False
            self._quiet -= 1
            for name, tensor in named:
                device = tensor.data
                self._device_state[name] = device.half() if _is_half(self._device_state[name]) else device
                tensor.data = host[name]
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.grad = None

    def _round_weights(self):
        """After an update: weights stored in fp16 are rounded to fp16 (working copies are fp32)."""
        with torch.no_grad():
            for name, param in self._trainable():
                if _is_half(self._device_state[name]):
                    param.copy_(param.to(torch.float16).to(param.dtype))

    @staticmethod
    def _find_final_loss(recorder, outputs):
        """Index (in call order) of the one final loss, as PopTorch's RemoveSurplusIdentityLosses.

        Losses are outputs of ``poptorch.identity_loss`` or of torch loss functions that the
        returned outputs depend on; a loss is final when no other loss depends on it.
        """
        reachable = set()
        for _, tensor in _flatten(outputs, "output"):
            if tensor.grad_fn is not None:
                reachable |= _graph_nodes(tensor)
        candidates = [(i, t) for i, (_, t) in enumerate(recorder.losses)
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.grad_fn in reachable]
        graphs = {i: _graph_nodes(t) for i, t in candidates}
        final = [i for i, t in candidates
                 if not any(t.grad_fn in graphs[j] for j, _ in candidates if j != i)]
        if not final:
            raise Error("Couldn't find a loss in graph!")
        if len(final) > 1:
            raise Error("Multiple independent losses found in graph. Graph must have one final loss. "
                        "Wrap final graph loss in poptorch.identity_loss.")
        return final[0]

    def _plan_pipeline(self, recorder):
        """Check the recorded blocks against the execution strategy and the IPU system.

        Returns {"blocks": [(id, ipu, stage)], "num_stages": forward pipeline stages after PopART
        merges consecutive stages on one IPU, "num_ipus_per_replica", "num_ipus"}.
        """
        o = self._options
        strategy = o._execution_strategy
        blocks = []
        for position, (user_id, ipu_id) in enumerate(recorder.blocks):
            if ipu_id is None and (strategy.stages is None or strategy.auto_stage is not None):
                raise Error(f"Block '{user_id}' has no ipu_id: BeginBlock(..., ipu_id=N) is required "
                            f"with {type(strategy).__name__}(AutoStage.{(strategy.auto_stage or AutoStage.SameAsIpu).name})")
            stage = strategy.stage_of_block(user_id, ipu_id, position)
            if stage is None:
                raise Error(f"Block '{user_id}' is not in any stage of the execution strategy")
            blocks.append((user_id, ipu_id, stage))
        for (prev_id, _, prev_stage), (block_id, _, stage) in zip(blocks, blocks[1:]):
            if stage < prev_stage:
                raise Error(f"Pipeline stages must be in ascending order: block '{block_id}' (stage {stage}) "
                            f"runs after block '{prev_id}' (stage {prev_stage}). Use "
                            f"PipelinedExecution(AutoStage.AutoIncrement) to revisit an IPU in a later stage.")
        stage_ipus = {}
        for block_id, ipu_id, stage in blocks:
            if stage_ipus.setdefault(stage, ipu_id) != ipu_id:
                raise Error(f"Stage {stage} is placed on IPUs {stage_ipus[stage]} and {ipu_id}: a pipeline "
                            f"stage must live on one IPU")
        merged = []  # one entry per forward pipeline stage: its IPU
        for _, ipu_id, _ in blocks:
            if not merged or merged[-1] != ipu_id:
                merged.append(ipu_id)
        num_ipus_per_replica = max([ipu for _, ipu, _ in blocks], default=0) + 1
        limit = getattr(o, "_popdist_ipus_per_replica", None)  # popdist.poptorch.Options under PopRun
        if limit is not None and num_ipus_per_replica > limit:
            raise Error(f"The model is placed on {num_ipus_per_replica} IPUs but each replica has only "
                        f"{limit} IPUs (ipus_per_replica)")
        num_ipus = num_ipus_per_replica * o.replication_factor
        offline = o.connection_type == ConnectionType.Never
        if offline:
            # PopTorch (CompilerImpl::createDevice): an offline device of exactly the IPUs the
            # model uses, whatever the system has: no rounding to a power of two, no cycle counter.
            if self._options._Popart.options.get("instrumentWithHardwareCycleCounter"):
                raise Error("Cycle count logging is only supported on actual IPU hardware.",
                            type="poptorch_cpp_error")
        elif num_ipus & (num_ipus - 1):
            if not o.auto_round_num_ipus:
                raise Error(f"The number of IPUs requested ({num_ipus} = {num_ipus_per_replica} per replica x "
                            f"replication factor {o.replication_factor}) must be a power of two; call "
                            f"Options.autoRoundNumIPUs(True) to round it up")
            num_ipus = 1 << (num_ipus - 1).bit_length()
        available = num_available_ipus()
        if not offline and num_ipus > available:
            raise Error(f"Failed to acquire {num_ipus} IPUs: the (mock) IPU system has {available} "
                        f"(set MOCK_POPTORCH_NUM_IPUS to model a larger one)", type="poplar_error")
        num_stages = len(merged) if isinstance(strategy, PipelinedExecution) else 1
        if isinstance(strategy, PipelinedExecution):
            # PopTorch (popart_compiler Compiler.cpp, CompilerImpl::numPipelineStages): training
            # has 2 x forward stages - 1 pipeline stages (the last forward one runs with the first
            # backward one), and needs at least that many micro-batches per update; inference
            # needs as many device iterations as stages.
            if self._training:
                stages = 2 * num_stages - 1
                if o.Training.gradient_accumulation < stages:
                    raise Error(f"poptorch.Options().Training.gradientAccumulation must be greater than or equal to "
                                f"the number of pipeline stages ({stages}) when using poptorch.PipelinedExecution. "
                                f"Please note that a model with {(stages + 1) // 2} pipeline stages in PopTorch will "
                                f"have an additional {(stages - 1) // 2} stages when training.",
                                type="poptorch_cpp_error")
            elif o.device_iterations < num_stages:
                raise Error(f"poptorch.Options().deviceIterations must be greater than or equal to the number of "
                            f"pipeline stages ({num_stages}) when using PopTorch.PipelinedExecution.",
                            type="poptorch_cpp_error")
        return {"blocks": blocks, "num_stages": num_stages, "stage_ipus": merged,
                "num_ipus_per_replica": num_ipus_per_replica, "num_ipus": num_ipus,
                "num_recomputation_checkpoints": recorder.num_checkpoints,
                "serialization_factors": list(recorder.serialization_factors)}

    def _check_output_mode(self):
        """PopART's anchor checks for EveryN (dataflow.cpp, irlowering.cpp)."""
        o = self._options
        if OutputMode(o.output_mode) != OutputMode.EveryN:
            return
        period = o.output_return_period
        if self.pipeline["num_stages"] > 1:
            raise Error("AnchorReturnType::EVERYN is not valid for pipelined models", type="popart_exception")
        if period > o.device_iterations:
            raise Error("Return period must be <= to the number of batches per step", type="popart_exception")
        if o.device_iterations % period:
            raise Error("Return period must be a factor of the number of batches per step", type="popart_exception")

    def set_micro_batch_callback(self, fn):
        """Mock only (no PopTorch API): ``fn(i, n)`` is called after micro-batch i of the n of a
        training call ran (forward and backward); it may raise to abandon the call before the
        update of the step it belongs to."""
        self._micro_batch_callback = fn

    # -- run --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._options.connection_type == ConnectionType.Never:
            raise AssertionError("Trying to run a model on an offline device (ConnectionType.Never): use "
                                 "model.compile(inputs) instead of model(inputs)")
        if not self._compiled:
            self._compile(args, kwargs)
        if self._meta:
            raise Error("The model's weights are on the meta device: it can be compiled (shapes), not run")
        if not self._attached:
            self.attachToDevice()
        self._push_optimizer()  # a setOptimizer made while detached (attaching pushed it already)
        if self._training:
            self._write_optim_state_dict_if_needed()
        if not self._training:
            # As PopTorch: an inference model of a module that a trainingModel also wraps picks up
            # the trained weights (implicit copyWeightsToHost on the training side, then upload).
            sync = getattr(self._user_model, "copyWeightsToHostIfNeeded", None)
            if callable(sync):
                sync()
                version = self._user_model._host_weights_version
                if version is not None and version != self._host_weights_version:
                    self.copyWeightsToDevice()
                    self._host_weights_version = version
        signature = self._check_batch(args, kwargs)
        if signature != self._signature:
            raise Error("One or more input data types have changed since the last time the model was run: "
                        "the inputs passed at runtime don't match the inputs used to compile the model. "
                        f"Compiled with {self._signature}, called with {signature}")
        o = self._options
        num_iterations, num_accumulations = o.device_iterations, o.Training.gradient_accumulation
        num_replicas = o.replication_factor
        outputs = []  # one nested structure per micro-batch, in [iteration, accumulation, replica] order
        with self._on_device(), self._device_random_numbers():
            for iteration in range(num_iterations):
                self._accumulators = {}
                for accumulation in range(num_accumulations):
                    for replica in range(num_replicas):
                        micro_args = self._micro_batch(args, iteration, accumulation, replica)
                        micro_kwargs = self._micro_batch(kwargs, iteration, accumulation, replica)
                        outputs.append(self._run_micro_batch(micro_args, micro_kwargs, replica, accumulation))
                        if self._training and self._micro_batch_callback is not None:
                            self._micro_batch_callback(
                                len(outputs) - 1, num_iterations * num_accumulations * num_replicas)
                if self._training:
                    self._reduce_gradients()
                    self._optimizer_step()
                    self._round_weights()
                    for _, param in self._trainable():
                        param.grad = None
        self._host_rng_state_is_dirty = True
        if self._training:
            self._dirty_host_weights = True
            if isinstance(self._optimizer, _optim.Optimizer):
                self._optimizer.host_state_is_dirty = True  # the device's optimizer state moved on
        self._has_run = True
        self._last_run_info = {"signature": self._signature, "pipeline": self.pipeline, "training": self._training,
                               "device_iterations": num_iterations, "gradient_accumulation": num_accumulations,
                               "replication_factor": num_replicas, "model": self._user_model}
        return self._assemble_outputs(outputs)

    def _trainable(self):
        if self._trainable_cache is None:
            with self._internal():
                self._trainable_cache = [(name, p) for name, p in self._user_model.named_parameters() if p.requires_grad]
        return self._trainable_cache

    def _run_micro_batch(self, args, kwargs, replica, accumulation):
        if not self._training:
            with torch.no_grad(), ops.recording(ops._Recorder()):
                return _map(self._user_model(*args, **kwargs), torch.Tensor.detach)
        recorder = ops._Recorder()
        with ops.recording(recorder):
            out = self._user_model(*args, **kwargs)
        if len(recorder.losses) != self._num_loss_calls:
            raise Error("The model's graph changed since compilation (a different number of losses)")
        loss = recorder.losses[self._final_loss_index][1]
        (loss * self._loss_scaling()).backward(torch.ones_like(loss))
        self._accumulate_gradients(replica, accumulation)
        return _map(out, torch.Tensor.detach)

    def _loss_scaling(self):
        """The optimizer's static loss scale: the loss is multiplied by it, the gradients divided."""
        return float(getattr(self._optimizer, "loss_scaling", 1.0) or 1.0)

    def _running_mean(self):
        training = self._options.Training
        return (training.accumulation_and_replication_reduction_type == ReductionType.Mean
                and training.meanAccumulationAndReplicationReductionStrategy == MeanReductionStrategy.Running)

    def _accumulate_gradients(self, replica, count):
        """This micro-batch's gradients (fp16 where the weight is stored in fp16) into replica
        ``replica``'s accumulator, in the optimizer's ``accum_type``; ``count`` micro-batches
        are already in it. Arithmetic in fp32, the result rounded to ``accum_type`` (PopART's
        AccumulateOp: Add for Post, Mean ``a = (1-b) a + b g`` with ``b = 1/(count+1)`` for Running).
        All parameters' gradients are kept as one flat tensor (elementwise, so the same numbers)."""
        dtype = getattr(self._optimizer, "accum_type", None) or torch.float32
        grads = []
        for name, param in self._trainable():
            grad = param.grad
            param.grad = None
            if grad is None:
                grad = torch.zeros_like(param)
            if _is_half(self._device_state[name]):
                grad = grad.to(torch.float16)  # the device's weight gradient is fp16 (overflow -> inf)
            grads.append(grad.reshape(-1).float())
        grad = torch.cat(grads)
        previous = self._accumulators.get(replica)
        if self._running_mean():
            b = 1.0 / (count + 1)
            value = grad * b if previous is None else previous.float() * (1.0 - b) + grad * b
        else:
            value = grad if previous is None else previous.float() + grad
        self._accumulators[replica] = value.to(dtype)

    def _reduce_gradients(self):
        """Replicas' accumulators all-reduced (Post: sum, Running: mean, in ``accum_type``), then
        the gradient the optimizer sees: Post and ``ReductionType.Mean`` divide by accumulation x
        GLOBAL replicas (all PopRun instances), and the loss scale is undone (fp32)."""
        o = self._options
        running = self._running_mean()
        num_processes = o.Distributed.num_distributed_processes
        divisor = self._loss_scaling()
        if o.Training.accumulation_and_replication_reduction_type == ReductionType.Mean and not running:
            divisor *= o.Training.gradient_accumulation * o.replication_factor * num_processes
        replicas = [self._accumulators[r] for r in sorted(self._accumulators)]
        total = replicas[0]
        for accumulator in replicas[1:]:
            total = (total.float() + accumulator.float()).to(total.dtype)
        if running:
            total = (total.float() / len(replicas)).to(total.dtype)
        if num_processes > 1:
            total = self._all_reduce_instances(total, running)
        grads = (total.float() / divisor).split([p.numel() for _, p in self._trainable()])
        for (_, param), grad in zip(self._trainable(), grads):
            param.grad = grad.view_as(param).to(param.dtype)
        self._accumulators = {}

    @staticmethod
    def _all_reduce_instances(total, running):
        """Sum (Post) or mean (Running) over PopRun instances, through torch.distributed."""
        distributed = torch.distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            raise Error("The mock reduces gradients over PopRun instances through torch.distributed: initialise "
                        "a process group in every instance")
        reduced = total.float()
        distributed.all_reduce(reduced)
        if running:
            reduced /= distributed.get_world_size()
        return reduced.to(total.dtype)

    def _assemble_outputs(self, outputs):
        """Per output, stack the micro-batch values by OutputMode with PopTorch's shapes."""
        o = self._options
        num_replicas = o.replication_factor
        num_accumulations = o.Training.gradient_accumulation
        num_runs = len(outputs) // num_replicas  # (iteration, accumulation) pairs
        mode = OutputMode(o.output_mode)
        per_micro_batch = [_leaves(out) for out in outputs]

        def index(run, replica):
            return run * num_replicas + replica

        if mode == OutputMode.All:
            selected = [[index(r, p)] for r in range(num_runs) for p in range(num_replicas)]
        elif mode == OutputMode.EveryN:
            # PopART returns every N-th device iteration ("batch"), all its micro-batches.
            period = o.output_return_period
            selected = [[index(r, p)] for r in range(num_runs) if (r // num_accumulations + 1) % period == 0
                        for p in range(num_replicas)]
        elif mode == OutputMode.Final:
            selected = [[index(num_runs - 1, p)] for p in range(num_replicas)]
        else:  # Sum over iterations and accumulation steps, per replica
            selected = [[index(r, p) for r in range(num_runs)] for p in range(num_replicas)]

        def combine(leaf_index):
            values = []
            for group in selected:
                items = [per_micro_batch[i][leaf_index] for i in group]
                if not isinstance(items[0], torch.Tensor):
                    return items[-1]
                values.append(items[0] if len(items) == 1 else torch.stack(items).sum(0))
            if len(values) == 1:
                result = values[0]
            elif values[0].dim() == 0:
                result = torch.stack(values)
            else:
                result = torch.cat(values)
            if result.dtype == torch.long:
                result = result.int()
            elif result.dtype == torch.double:
                result = result.float()
            result.backward = _raise_backward
            return result

        if not per_micro_batch or not per_micro_batch[0]:
            return None
        combined = [combine(i) for i in range(len(per_micro_batch[0]))]
        return _rebuild(outputs[0], iter(combined))

    # -- cycle counts -----------------------------------------------------------------------
    def cycleCount(self):
        """Estimated GC200 cycles of the last run (first replica), from the installed cost model.

        Real PopTorch returns hardware-counter cycles; the mock returns a *model estimate* (see
        ``set_cycle_estimator``) and never a measurement.
        """
        if not self._options._Popart.options.get("instrumentWithHardwareCycleCounter"):
            raise Error("Cycle count logging is disabled. Please set option logCycleCount to True to enable.")
        if not self._compiled or not self._has_run:
            raise Error("Please run the model at least once before obtaining cycle count.")
        if _cycle_estimator is None:
            raise Error("The mock has no cycle estimator installed (poptorch.set_cycle_estimator)")
        return int(_cycle_estimator(self._last_run_info))


def _wrap_user_model(model, executor):
    """PopTorch's ``PoptorchModel``: the wrapped module's class gains ``copyWeightsToHostIfNeeded``
    and copies the device weights to the host whenever its parameters, buffers or forward are
    touched after a run (so ``model.state_dict()`` after training sees the trained weights)."""
    parent = weakref.ref(executor)
    base = type(model)

    class PoptorchModel(base):
        _poptorch_base_class = base

        def copyWeightsToHostIfNeeded(self):
            p = parent()
            return p.copyWeightsToHostIfNeeded() if p is not None else False

        def __getattribute__(self, name):
            if name == "_host_weights_version":
                p = parent()
                return None if p is None else p._host_weights_version
            if name in ("_buffers", "_parameters", "forward"):
                p = parent()
                if p is not None and not p._quiet and p._attached:
                    p.copyWeightsToHostIfNeeded()
            return object.__getattribute__(self, name)

        def __getattr__(self, name):
            attribute = super().__getattr__(name)
            if isinstance(attribute, torch.nn.Parameter):
                self.copyWeightsToHostIfNeeded()
            return attribute

    PoptorchModel.__name__ = base.__name__
    PoptorchModel.__qualname__ = base.__qualname__
    model.__class__ = PoptorchModel


def trainingModel(model, options=None, optimizer=None):
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    if getattr(type(model), "_poptorch_base_class", None) is not None:
        raise RuntimeError("Model has already been wrapped in 'poptorch.trainingModel'. Call "
                           "model.destroy() on the model to unwrap before wrapping again.")
    return PoplarExecutor(model, options=options, training=True, optimizer=optimizer)


def inferenceModel(model, options=None):
    """As PopTorch: a shallow copy of ``model`` (same parameters; ``eval()`` on the original
    does not reach it). A module a trainingModel wraps keeps its implicit weight sync."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    return PoplarExecutor(copy.copy(model), options=options, training=False)


class DataLoader(torch.utils.data.DataLoader):
    """``poptorch.DataLoader``: yields whole runs (``batch_size`` x the options' batch factor) and,
    with several PopRun instances, only this instance's share of a map-style dataset."""

    def __init__(self, options, dataset, batch_size=1, shuffle=None, num_workers=0, drop_last=True,
                 persistent_workers=None, auto_distributed_partitioning=True, mode=None,
                 async_options=None, rebatched_worker_size=None, **kwargs):
        options._freeze()
        self._options = options
        self.combinedBatchSize = batch_size * _batch_factor(options)
        num_processes = options.Distributed.num_distributed_processes
        if num_processes > 1 and auto_distributed_partitioning and hasattr(dataset, "__len__"):
            if shuffle and not options.exists("random_seed"):
                raise Error("When using distributed execution with shuffle=True you must set "
                            "Options.randomSeed()")
            per_process = len(dataset) // num_processes
            start = options.Distributed.distributed_process_id * per_process
            dataset = torch.utils.data.Subset(dataset, range(start, start + per_process))
        super().__init__(dataset, batch_size=self.combinedBatchSize, shuffle=bool(shuffle),
                         num_workers=num_workers, drop_last=drop_last,
                         persistent_workers=bool(num_workers > 0 if persistent_workers is None else persistent_workers),
                         **kwargs)

    @property
    def options(self):
        return self._options

    def terminate(self):
        pass

