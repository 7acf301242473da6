"""``poptorch.trainingModel`` / ``inferenceModel`` on the CPU: PopTorch's batching semantics, run eagerly.

One call of a wrapped model is one PopTorch *run*. The host passes the whole run's data: every
batched input has ``B_host = micro_batch x device_iterations x (replication / input_group_size)
x gradient_accumulation`` rows, laid out ``[device_iterations, gradient_accumulation, replica,
micro_batch, ...]`` (PopART's order). The mock then does what the device does:

* for each device iteration: for each accumulation step, for each replica: forward + backward
  of that micro-batch; gradients are summed over accumulation steps and replicas (all replicas
  hold the same weights, so summing into one ``.grad`` *is* the all-reduce), divided by
  ``ga x replicas`` for ``ReductionType.Mean`` (PopTorch's default) or not for ``Sum``, and one
  optimizer update follows. So one call makes ``device_iterations`` optimizer updates.
* outputs come back per ``OutputMode`` (All / EveryN / Final / Sum), with PopTorch's shapes.
* training needs exactly one final loss (PopTorch's messages when there are none or several);
  pipeline annotations are recorded at "compile" time (the first call) and checked.

Numerics are eager PyTorch on the CPU; nothing here is a statement about IPU speed or memory.
"""
import os
import warnings

import torch

from . import ops
from .enums import OutputMode, ReductionType, AutoStage
from .errors import Error
from .options import Options, PipelinedExecution

# The IPU system the mock pretends to be attached to (an IPU-POD16 by default); a run that asks
# for more IPUs fails at compile time as it would on the real system.
DEFAULT_NUM_AVAILABLE_IPUS = 16

_cycle_estimator = None  # fn(info dict) -> int; set by set_cycle_estimator (see ipu/backend.py)


def set_cycle_estimator(fn):
    """Install the function ``cycleCount()`` uses: ``fn(info) -> int`` (estimated cycles of a run)."""
    global _cycle_estimator
    _cycle_estimator = fn


def num_available_ipus():
    return int(os.environ.get("MOCK_POPTORCH_NUM_IPUS", DEFAULT_NUM_AVAILABLE_IPUS))


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
        if getattr(model, "_poptorch_executor", None) is not None:
            raise RuntimeError("Model has already been wrapped in 'poptorch.trainingModel'. Call "
                               "model.destroy() on the model to unwrap before wrapping again.")
        options = Options() if options is None else options
        options._freeze()  # the user's object can no longer change: the executable is fixed
        self._options = options.clone()
        self._training = training
        if not training and self._options.Training.gradient_accumulation != 1:
            raise Error("You must set Options.Training.gradientAccumulation to 1 for inference "
                        "(for pipelined inference use Options.deviceIterations instead)")
        if self._options.output_mode == OutputMode.Default:
            self._output_mode = OutputMode.Final if training else OutputMode.All
        else:
            self._output_mode = OutputMode(self._options.output_mode)
        if training and optimizer is None:
            from .optim import SGD
            optimizer = SGD(model.parameters(), lr=0.01)
        self._user_model = model
        self._optimizer = optimizer
        self._device_hyperparameters = self._read_hyperparameters(optimizer)
        self._compiled = False
        self._attached = False
        self._signature = None
        self._final_loss_index = None
        self._num_loss_calls = None
        self.pipeline = None     # filled at compile: blocks, stages, IPUs (see _plan_pipeline)
        self._has_run = False
        self._last_run_info = None
        self._accumulators = {}  # parameter -> summed gradient of the current accumulation
        model._poptorch_executor = self

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

    def isCompiled(self):
        return self._compiled

    def isAttachedToDevice(self):
        return self._compiled and self._attached

    def detachFromDevice(self):
        if not self._compiled:
            raise Error("Cannot detach: the model has not been compiled")
        if not self._attached:
            raise Error("Device is not attached")
        self._attached = False

    def attachToDevice(self):
        if not self._compiled:
            raise Error("Cannot attach: the model has not been compiled")
        if self._attached:
            raise Error("Device is already attached")
        self._attached = True

    def copyWeightsToHost(self):
        if not self._compiled:
            raise Error("Model has not been compiled yet: nothing to copy")
        # Host and "device" share the parameter tensors in the mock: nothing to move.

    def copyWeightsToDevice(self):
        if not self._compiled:
            raise Error("Model has not been compiled yet: nothing to copy")

    def destroy(self):
        self._compiled = False
        self._attached = False
        self._user_model._poptorch_executor = None

    # -- optimizer: the device only sees hyperparameters pushed by setOptimizer -------------
    @staticmethod
    def _read_hyperparameters(optimizer):
        if optimizer is None:
            return None
        return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    def setOptimizer(self, optimizer):
        """Push new hyperparameters (e.g. after ``scheduler.step()``) to the device.

        As in PopTorch, changing ``param_groups[i]["lr"]`` on the host without calling this
        leaves the device on the old values; the mock reproduces that.
        """
        if not self._training:
            raise Error("setOptimizer is only valid for training models")
        self._optimizer = optimizer
        self._device_hyperparameters = self._read_hyperparameters(optimizer)

    def _optimizer_step(self):
        host_values = self._read_hyperparameters(self._optimizer)
        for group, values in zip(self._optimizer.param_groups, self._device_hyperparameters):
            group.update(values)
        try:
            self._optimizer.step()
        finally:
            for group, values in zip(self._optimizer.param_groups, host_values):
                group.update(values)

    # -- batching ---------------------------------------------------------------------------
    def _check_batch(self, args, kwargs):
        o = self._options
        factor = _batch_factor(o)
        signature = []
        for path, tensor in _flatten(args, "args") + _flatten(kwargs, "kwargs"):
            if tensor.dim() == 0:
                signature.append((path, (), tensor.dtype))
                continue
            if tensor.shape[0] % factor:
                raise Error(
                    f"Invalid batch dimension: In the input {path}, the batch dimension "
                    f"({tensor.shape[0]}) must be a multiple of Options.deviceIterations"
                    f"({o.device_iterations}) * (Options.replicationFactor({o.replication_factor}) / "
                    f"Options.inputReplicaGrouping.input_group_size({o.input_group_size})) * "
                    f"Options.Training.gradientAccumulation({o.Training.gradient_accumulation}) = "
                    f"{factor} because it is used to calculate the batch size which will be executed "
                    f"on the device in any given iteration. For a full explanation see the batching "
                    f"semantics page of the documentation.")
            signature.append((path, (tensor.shape[0] // factor,) + tuple(tensor.shape[1:]), tensor.dtype))
        return signature

    def _micro_batch(self, obj, iteration, accumulation, replica):
        """The inputs replica ``replica`` sees at (device iteration, accumulation step)."""
        o = self._options
        shape = (o.device_iterations, o.Training.gradient_accumulation, o.replication_factor // o.input_group_size)
        data_replica = replica // o.input_group_size

        def take(tensor):
            if tensor.dim() == 0:
                return tensor
            if tensor.requires_grad:
                tensor = tensor.detach()
            view = tensor.reshape(shape + (-1,) + tuple(tensor.shape[1:]))
            return view[iteration, accumulation, data_replica]
        return _map(obj, take)

    # -- compile: trace once, check annotations and the loss --------------------------------
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
        self._signature = self._check_batch(args, kwargs)
        micro_args = self._micro_batch(args, 0, 0, 0)
        micro_kwargs = self._micro_batch(kwargs, 0, 0, 0)
        # Trace with the micro batch; keep the host RNG untouched so the run that follows draws
        # the same random numbers (dropout) as an eager run would.
        rng_state = torch.get_rng_state()
        recorder = ops._Recorder()
        try:
            with ops.recording(recorder), torch.set_grad_enabled(self._training):
                outputs = self._user_model(*micro_args, **micro_kwargs)
            if self._training:
                self._final_loss_index = self._find_final_loss(recorder, outputs)
                self._num_loss_calls = len(recorder.losses)
            self.pipeline = self._plan_pipeline(recorder)
        finally:
            torch.set_rng_state(rng_state)
        if not _flatten(outputs, "output"):
            raise Error("Your compiled model is empty (All the operations have been optimised out)")
        self._compiled = True
        self._attached = True

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
        limit = o._values.get("ipus_per_replica")  # set by popdist.poptorch.Options under PopRun
        if limit is not None and num_ipus_per_replica > limit:
            raise Error(f"The model is placed on {num_ipus_per_replica} IPUs but each replica has only "
                        f"{limit} IPUs (ipus_per_replica)")
        num_ipus = num_ipus_per_replica * o.replication_factor
        if num_ipus & (num_ipus - 1):
            if not o.auto_round_num_ipus:
                raise Error(f"The number of IPUs requested ({num_ipus} = {num_ipus_per_replica} per replica x "
                            f"replication factor {o.replication_factor}) must be a power of two; call "
                            f"Options.autoRoundNumIPUs(True) to round it up")
            num_ipus = 1 << (num_ipus - 1).bit_length()
        available = num_available_ipus()
        if num_ipus > available:
            raise Error(f"Failed to acquire {num_ipus} IPUs: the (mock) IPU system has {available} "
                        f"(set MOCK_POPTORCH_NUM_IPUS to model a larger one)", type="poplar_error")
        num_stages = len(merged) if isinstance(strategy, PipelinedExecution) else 1
        if num_stages > 1:
            ga = o.Training.gradient_accumulation
            # PopART: training doubles the stages (forward and backward, the last forward one
            # merged with the first backward one), and every stage needs a micro-batch in flight.
            depth = 2 * num_stages - 1 if self._training else num_stages
            if self._training and ga > 1:
                if ga < depth:
                    raise Error(f"For pipelining, depth (gradient accumulation factor) must equal at least "
                                f"the number of pipeline stages ({depth})", type="popart_exception")
            elif o.device_iterations < depth:
                raise Error(f"For pipelining, depth (batchesPerStep) must equal at least the number of "
                            f"pipeline stages ({depth})", type="popart_exception")
        return {"blocks": blocks, "num_stages": num_stages, "stage_ipus": merged,
                "num_ipus_per_replica": num_ipus_per_replica, "num_ipus": num_ipus,
                "num_recomputation_checkpoints": recorder.num_checkpoints}

    # -- run --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not self._compiled:
            self._compile(args, kwargs)
        elif not self._attached:
            self.attachToDevice()
        signature = self._check_batch(args, kwargs)
        if signature != self._signature:
            raise Error("One or more input data types have changed since the last time the model was run: "
                        "the inputs passed at runtime don't match the inputs used to compile the model. "
                        f"Compiled with {self._signature}, called with {signature}")
        o = self._options
        num_iterations, num_accumulations = o.device_iterations, o.Training.gradient_accumulation
        num_replicas = o.replication_factor
        outputs = []  # one nested structure per micro-batch, in [iteration, accumulation, replica] order
        for iteration in range(num_iterations):
            if self._training:
                self._zero_grads()
            for accumulation in range(num_accumulations):
                for replica in range(num_replicas):
                    micro_args = self._micro_batch(args, iteration, accumulation, replica)
                    micro_kwargs = self._micro_batch(kwargs, iteration, accumulation, replica)
                    outputs.append(self._run_micro_batch(micro_args, micro_kwargs))
            if self._training:
                self._reduce_gradients(num_accumulations * num_replicas)
                self._optimizer_step()
                self._zero_grads()
        self._has_run = True
        self._last_run_info = {"signature": self._signature, "pipeline": self.pipeline, "training": self._training,
                               "device_iterations": num_iterations, "gradient_accumulation": num_accumulations,
                               "replication_factor": num_replicas, "model": self._user_model}
        return self._assemble_outputs(outputs)

    def _run_micro_batch(self, args, kwargs):
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
        self._accumulate_gradients()
        return _map(out, torch.Tensor.detach)

    def _loss_scaling(self):
        """The optimizer's static loss scale: the loss is multiplied by it, the gradients divided."""
        return float(getattr(self._optimizer, "loss_scaling", 1.0) or 1.0)

    def _accumulate_gradients(self):
        """Move this micro-batch's gradients into the accumulators, in the optimizer's
        ``accum_type`` (PopART accumulates in that type, not in the weights' fp16)."""
        dtype = getattr(self._optimizer, "accum_type", torch.float32)
        for param in self._parameters():
            if param.grad is None:
                continue
            grad = param.grad.to(dtype)
            param.grad = None
            accumulator = self._accumulators.get(param)
            self._accumulators[param] = grad if accumulator is None else accumulator.add_(grad)

    def _parameters(self):
        return [p for p in self._user_model.parameters() if p.requires_grad]

    def _zero_grads(self):
        self._accumulators = {}
        for param in self._parameters():
            param.grad = None

    def _reduce_gradients(self, num_micro_batches):
        """Gradients summed over accumulation and replicas -> PopTorch's reduction, loss scale undone."""
        scale = self._loss_scaling()
        if self._options.Training.accumulation_and_replication_reduction_type == ReductionType.Mean:
            scale *= num_micro_batches
        for param, accumulator in self._accumulators.items():
            param.grad = (accumulator / scale if scale != 1.0 else accumulator).to(param.dtype)
        self._accumulators = {}

    def _assemble_outputs(self, outputs):
        """Per output, stack the micro-batch values by OutputMode with PopTorch's shapes."""
        o = self._options
        num_replicas = o.replication_factor
        num_runs = len(outputs) // num_replicas  # (iteration, accumulation) pairs
        mode = self._output_mode
        per_micro_batch = [_leaves(out) for out in outputs]

        def index(run, replica):
            return run * num_replicas + replica

        if mode == OutputMode.All:
            selected = [[index(r, p)] for r in range(num_runs) for p in range(num_replicas)]
        elif mode == OutputMode.EveryN:
            period = o.output_return_period
            selected = [[index(r, p)] for r in range(num_runs) if (r + 1) % period == 0 for p in range(num_replicas)]
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
        if not self._options.log_cycle_count:
            raise Error("Cycle count logging is disabled. Please set option logCycleCount to True to enable.")
        if not self._has_run:
            raise Error("Please run the model at least once before obtaining cycle count.")
        if _cycle_estimator is None:
            raise Error("The mock has no cycle estimator installed (poptorch.set_cycle_estimator)")
        return int(_cycle_estimator(self._last_run_info))


def trainingModel(model, options=None, optimizer=None):
    return PoplarExecutor(model, options=options, training=True, optimizer=optimizer)


def inferenceModel(model, options=None):
    return PoplarExecutor(model, options=options, training=False)


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

