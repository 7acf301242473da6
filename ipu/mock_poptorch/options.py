"""``poptorch.Options`` and its sub-objects, IPU-free (mirrors PopTorch SDK 3.4 ``python/options.py``).

What is faithful (and tested): every setter returns ``self`` so calls chain; values read back as
snake_case attributes (``opts.device_iterations``, ``opts.Training.gradient_accumulation``);
``set`` rejects unknown keys and values of the wrong type; once an executor or DataLoader used
the options they are frozen and any change raises ``AttributeError("Can't modify frozen Options")``.
Keys are PopTorch's own (``meanAccumulationAndReplicationReductionStrategy``, ``onChip``,
``patterns_level``, ...) and the PopART session options live in ``opts._Popart.options`` as in
PopTorch, so code that reads them back works on both. When a model compiles, everything PopTorch
would hand its C++ side (``_backend_dict``, PopTorch's ``toDict``) goes through PopTorch's
session-option parser, replayed on tables generated from the real sources
(``ipu/mock_popart/session_options.py``): an unknown name, a value of the wrong type, an enum
out of range or an unknown pattern fails the compile as it does in PopTorch.
What is not: PopART/Poplar never see these values; the mock executor reads the ones that change
numerics or shapes (iterations, replication, accumulation, reduction and its strategy, output
mode, execution strategy, cycle counting, connection type) and keeps the rest for inspection.
"""
import copy
import json
import os

import torch

from .enums import (AutoStage, ConnectionType, MeanReductionStrategy, OutputMode,
                    ReductionType, SyncPattern, CommGroupType)

_FROZEN_MESSAGE = "Can't modify frozen Options"


class _OptionsDict:
    """A typed bag of values with PopTorch's frozen-after-use rule."""

    def __init__(self, **defaults):
        object.__setattr__(self, "_values", dict(defaults))
        object.__setattr__(self, "_is_frozen", False)

    def _check_not_frozen(self):
        if self._is_frozen:
            raise AttributeError(_FROZEN_MESSAGE)

    def set(self, **kwargs):
        self._check_not_frozen()
        for option, value in kwargs.items():
            if option not in self._values:  # PopTorch: an assert in OptionsDict.set
                raise AssertionError(f"Invalid option {option}, valid options are {self._values.keys()}")
            default = self._values[option]
            if default is not None and not isinstance(value, type(default)):
                raise AssertionError(f"Unexpected type {type(value)} for option {option}. "
                                     f"Expected {type(default)}")
            self._values[option] = value
        return self

    def createOrSet(self, **kwargs):
        self._check_not_frozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value
        return self

    def deleteIfExists(self, option):
        self._check_not_frozen()
        self._values.pop(option, None)

    def exists(self, option):
        return option in self._values

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"Unknown option '{name}'")

    def __setattr__(self, name, value):
        self._check_not_frozen()
        object.__setattr__(self, name, value)

    def _sub_options(self):
        return [v for v in self.__dict__.values() if isinstance(v, (_OptionsDict, _PopartOptions))]

    def _freeze(self):
        object.__setattr__(self, "_is_frozen", True)
        for sub in self._sub_options():
            sub._freeze()

    def _unfreeze(self):
        object.__setattr__(self, "_is_frozen", False)
        for sub in self._sub_options():
            sub._unfreeze()

    def toDict(self):
        out = dict(self._values)
        for name, sub in self.__dict__.items():
            if isinstance(sub, (_OptionsDict, _PopartOptions)):
                out[name] = sub.toDict()
        return out

    def __repr__(self):
        return f"{type(self).__name__}({json.dumps(self.toDict(), default=str)})"


class _JitOptions(_OptionsDict):
    def __init__(self):
        super().__init__()

    def traceModel(self, trace_model):
        # SDK >= 3.1: tracing is gone (dispatcher only).
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class _TrainingOptions(_OptionsDict):
    def __init__(self, popart_options):
        # PopTorch's keys and enum-typed defaults (options.py _TrainingOptions.__init__).
        super().__init__(gradient_accumulation=1,
                         accumulation_and_replication_reduction_type=ReductionType.Mean,
                         meanAccumulationAndReplicationReductionStrategy=MeanReductionStrategy.Post)
        object.__setattr__(self, "_popart", popart_options)

    def gradientAccumulation(self, gradient_accumulation):
        self.set(gradient_accumulation=gradient_accumulation)
        return self

    def accumulationAndReplicationReductionType(self, reduction_type):
        if reduction_type not in (ReductionType.Sum, ReductionType.Mean):
            raise ValueError("Reduction type must be ReductionType.Sum or ReductionType.Mean")
        self.set(accumulation_and_replication_reduction_type=ReductionType(reduction_type))
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(self, mean_reduction_strategy):
        """``Running``: the accumulator holds the running mean of the micro-batch gradients (and
        replicas are mean-reduced), so it never exceeds the largest one; ``Post``: it holds the
        sum, divided by accumulation x replicas at the update (PopART optimizerdecompose.cpp).
        PopTorch picks Running itself when the optimizer's ``accum_type`` is float16."""
        self.set(meanAccumulationAndReplicationReductionStrategy=MeanReductionStrategy(mean_reduction_strategy))
        return self

    def setAutomaticLossScaling(self, enabled):
        self._popart.set("automaticLossScalingSettings.enabled", bool(enabled))
        return self


class _PopartOptions:
    """Raw PopART session options (``opts._Popart.set(key, value)``), read back from ``.options``
    as in PopTorch. Values are stored as given; keys are checked when a model compiles."""

    def __init__(self):
        object.__setattr__(self, "_is_frozen", False)
        object.__setattr__(self, "options", {})
        self.set("instrumentWithHardwareCycleCounter", False)
        self.set("rearrangeAnchorsOnHost", False)

    def _check_not_frozen(self):
        if self._is_frozen:
            raise AttributeError(_FROZEN_MESSAGE)

    def _freeze(self):
        object.__setattr__(self, "_is_frozen", True)

    def _unfreeze(self):
        object.__setattr__(self, "_is_frozen", False)

    def set(self, key, value):  # noqa: A003 (PopTorch's signature: positional key, value)
        self._check_not_frozen()
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options):
        return self.set("engineOptions", engine_options)

    def setPatterns(self, patterns, level=2):
        if not isinstance(level, int) or not isinstance(patterns, dict):
            raise AssertionError("setPatterns takes a dict of pattern names and an int level")
        self.set("patterns_level", level)
        return self.set("patterns", patterns)

    def toDict(self):
        return dict(self.options)


class _PrecisionOptions(_OptionsDict):
    """No keys of its own in PopTorch: every setter writes a PopART option."""

    def __init__(self, popart_options):
        super().__init__()
        object.__setattr__(self, "_popart", popart_options)

    def setPartialsType(self, dtype):
        if dtype not in (torch.float, torch.half):
            raise ValueError("Partials type must be torch.float or torch.half")
        name = "half" if dtype == torch.half else "float"
        self._popart.set("partialsTypeMatMuls", name)
        self._popart.set("convolutionOptions", {"partialsType": name})
        return self

    def enableStochasticRounding(self, enabled):
        self._popart.set("enableStochasticRounding", bool(enabled))
        return self

    def enableFloatingPointExceptions(self, enabled):
        self._popart.set("enableFloatingPointChecks", bool(enabled))
        return self


class TensorLocationSettings(_OptionsDict):
    """Where a class of tensors lives (on chip or in Streaming Memory) and whether replicas shard
    it. Keys as PopTorch stores them (``onChip``, ``useReplicatedTensorSharding``: ints)."""

    def __init__(self):
        super().__init__()

    def useOnChipStorage(self, use=True):
        if use is None:
            self.deleteIfExists("onChip")
        else:
            if not isinstance(use, bool):
                raise AssertionError("useOnChipStorage takes a bool")
            self.createOrSet(onChip=int(use))
        return self

    def useReplicatedTensorSharding(self, use=True):
        if not isinstance(use, bool):
            raise AssertionError("useReplicatedTensorSharding takes a bool")
        self.createOrSet(useReplicatedTensorSharding=int(use))
        return self

    def minElementsForOffChip(self, min_elements):
        if not isinstance(min_elements, int):
            raise AssertionError("min_elements must be an int")
        self.createOrSet(minElementsForOffChip=min_elements)
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements):
        if not isinstance(min_elements, int):
            raise AssertionError("min_elements must be an int")
        self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)
        return self

    def useIOTilesToLoad(self, use=True):
        self.createOrSet(useIOTilesToLoad=int(bool(use)))
        return self

    def useIOTilesToStore(self, use=True):
        self.createOrSet(useIOTilesToStore=int(bool(use)))
        return self


class _TensorLocationOptions(_OptionsDict):
    def __init__(self):
        super().__init__(location_activation={}, location_weight={}, location_optimizer={},
                         location_accumulator={})

    def numIOTiles(self, num_tiles):
        if num_tiles % 2 or not 32 <= num_tiles <= 192:
            raise AssertionError("numIOTiles must be an even number between 32 and 192.")
        self.createOrSet(numIOTiles=num_tiles)
        return self

    def _set_location(self, name, location):
        if not isinstance(location, TensorLocationSettings):
            raise AssertionError("location must be a poptorch.TensorLocationSettings")
        self.createOrSet(**{name: location.toDict()})
        return self

    def setActivationLocation(self, location):
        return self._set_location("location_activation", location)

    def setWeightLocation(self, location):
        return self._set_location("location_weight", location)

    def setOptimizerLocation(self, location):
        return self._set_location("location_optimizer", location)

    def setAccumulatorLocation(self, location):
        return self._set_location("location_accumulator", location)


class _DistributedOptions(_OptionsDict):
    """Multi-process (PopRun) identity of this host process."""

    def __init__(self):
        super().__init__(num_distributed_processes=1, distributed_process_id=0)

    def configureProcessId(self, process_id, num_processes):
        if not 0 <= process_id < num_processes:
            raise AssertionError(f"process_id {process_id} must be in [0, {num_processes})")
        self.set(distributed_process_id=process_id, num_distributed_processes=num_processes)
        return self

    @property
    def processId(self):
        return self.distributed_process_id

    @property
    def numProcesses(self):
        return self.num_distributed_processes


# ---------------------------------------------------------------------------------------------
# Execution strategies and stages
# ---------------------------------------------------------------------------------------------

class Stage:
    """A pipeline stage made of named blocks (``poptorch.Stage("Embedding", "Encoder0").ipu(0)``)."""

    def __init__(self, *block_ids):
        self.blocks = [str(b) for b in block_ids]
        self._ipu = None

    def ipu(self, ipu):
        self._ipu = ipu
        return self


class _ExecutionStrategy:
    execution_mode = None

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], AutoStage):
            self.auto_stage = args[0]
            self.stages = None
        elif not args:
            self.auto_stage = AutoStage.SameAsIpu
            self.stages = None
        else:
            self.auto_stage = None
            self.stages = [a if isinstance(a, Stage) else Stage(*(a if isinstance(a, (list, tuple)) else [a]))
                           for a in args]

    def stage_of_block(self, block_id, ipu_id, position):
        """Stage id of the block that ran ``position``-th (0-based), or None if unmapped."""
        if self.stages is not None:
            for index, stage in enumerate(self.stages):
                if block_id in stage.blocks:
                    return index
            return None
        if self.auto_stage == AutoStage.SameAsIpu:
            return ipu_id
        return position

    def backendOptions(self):
        """What PopTorch's ``toDict`` takes from the strategy (options.py ``backendOptions``)."""
        return {"execution_mode": self.execution_mode}


class PipelinedExecution(_ExecutionStrategy):
    execution_mode = 0


class ShardedExecution(_ExecutionStrategy):
    execution_mode = 1


class Options(_OptionsDict):
    """``poptorch.Options()``: defaults as in PopTorch SDK 3.4 (options.py 1146-1198)."""

    def __init__(self):
        super().__init__(replication_factor=1, input_group_size=1, input_cgt=CommGroupType.Consecutive,
                         broadcast_buffers=True, device_iterations=1, log_dir=".", max_repeat_logs=4,
                         auto_round_num_ipus=False, anchored_tensors={}, output_mode=int(OutputMode.Default),
                         output_return_period=1, connection_type=int(ConnectionType.Always),
                         sync_pattern=int(SyncPattern.Full), available_memory_proportion={})
        self._Popart = _PopartOptions()
        self.Jit = _JitOptions()
        self.Precision = _PrecisionOptions(self._Popart)
        self.Training = _TrainingOptions(self._Popart)
        self.Distributed = _DistributedOptions()
        self.TensorLocations = _TensorLocationOptions()
        object.__setattr__(self, "_execution_strategy", PipelinedExecution())
        object.__setattr__(self, "_show_compilation_progress_bar", True)
        path = os.environ.get("POPTORCH_CACHE_DIR", "")
        if path:  # as PopTorch: the environment turns the executable cache on
            self.enableExecutableCaching(path)

    # -- batching ---------------------------------------------------------------------------
    def deviceIterations(self, device_iterations):
        self.set(device_iterations=device_iterations)
        return self

    def replicationFactor(self, replication_factor):
        self.set(replication_factor=replication_factor)
        return self

    def inputReplicaGrouping(self, input_group_size, input_group_type):
        self.set(input_group_size=input_group_size, input_cgt=CommGroupType(input_group_type))
        return self

    def outputMode(self, output_mode, output_return_period=None):
        if not isinstance(output_mode, OutputMode):
            raise AssertionError("output_mode must be a poptorch.OutputMode")
        if output_mode == OutputMode.EveryN:
            if not (output_return_period and output_return_period > 0):
                raise AssertionError("EveryN anchor must have output_return_period set to valid positive integer")
        # Any other mode ignores a period (PopTorch logs that and goes on).
        self.set(output_mode=int(output_mode), output_return_period=output_return_period or 1)
        return self

    def defaultOutputMode(self):
        return self.output_mode == OutputMode.Default

    # -- execution --------------------------------------------------------------------------
    def setExecutionStrategy(self, strategy):
        self._check_not_frozen()
        if not isinstance(strategy, _ExecutionStrategy):
            raise TypeError("strategy must be a poptorch execution strategy (e.g. PipelinedExecution)")
        object.__setattr__(self, "_execution_strategy", strategy)
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion):
        proportions = {}
        for key, value in available_memory_proportion.items():
            if not key.startswith("IPU"):
                raise AssertionError(f"Invalid key '{key}': keys must be of the form 'IPU<n>'")
            proportions[int(key[3:])] = float(value)
        self.createOrSet(available_memory_proportion=proportions)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus=True):
        self.set(auto_round_num_ipus=bool(auto_round_num_ipus))
        return self

    def useIpuModel(self, use_model):
        self.createOrSet(use_model=bool(use_model))
        return self

    def connectionType(self, connection_type):
        self.set(connection_type=int(connection_type))
        return self

    def useOfflineIpuTarget(self, ipu_version=2):
        """Compile for an IPU of ``ipu_version`` without attaching to one (``ConnectionType.Never``):
        the model can be ``compile()``d, never run (Graphcore's ``--compile-only``)."""
        self.connectionType(ConnectionType.Never)
        self.createOrSet(ipu_version=ipu_version)
        return self

    def broadcastBuffers(self, broadcast_buffers=True):
        self.set(broadcast_buffers=bool(broadcast_buffers))
        return self

    # -- caching, data, logging -------------------------------------------------------------
    def enableExecutableCaching(self, path):
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    def enableSyntheticData(self, enabled):
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def logCycleCount(self, log_cycle_count):
        self._Popart.set("instrumentWithHardwareCycleCounter", bool(log_cycle_count))
        return self

    def enableProfiling(self, profile_dir=None):
        self._Popart.setEngineOptions({"debug.allowOutOfMemory": "true",
                                       "autoReport.directory": profile_dir or ".",
                                       "autoReport.all": "true"})
        return self

    def logDir(self, log_dir):
        self.set(log_dir=log_dir)
        return self

    def modelName(self, name):
        self.createOrSet(model_name=name)
        return self

    def showCompilationProgressBar(self, show=True):
        object.__setattr__(self, "_show_compilation_progress_bar", bool(show))
        return self

    def randomSeed(self, random_seed):
        if not isinstance(random_seed, int):
            raise AssertionError("random_seed must be an integer")
        torch.manual_seed(random_seed)  # PopTorch seeds the host too
        self.createOrSet(random_seed=random_seed)
        return self

    # -- container --------------------------------------------------------------------------
    def clone(self):
        """An unfrozen deep copy (PopTorch: ``copy.deepcopy`` with ``_is_frozen`` reset)."""
        was_frozen = self._is_frozen
        self._unfreeze()
        try:
            cloned = copy.deepcopy(self)
        finally:
            if was_frozen:
                self._freeze()
        return cloned

    def _backend_dict(self):
        """PopTorch's ``Options.toDict()``: one flat dict, in its order, as the C++ side gets it
        (execution strategy, ``_Popart`` options, then the values of ``Options``, ``Training``,
        ``Distributed`` and ``TensorLocations``; Jit and Precision hold none)."""
        out = self._execution_strategy.backendOptions()
        out.update(self._Popart.options)
        for values in (self._values, self.Training._values, self.Distributed._values,
                       self.TensorLocations._values):
            if set(out).intersection(values):  # PopTorch's OptionsDict.update
                raise AssertionError("Can't merge dictionaries, they have some keys in common")
            out.update(values)
        return out

    def toDict(self):
        out = super().toDict()
        strategy = self._execution_strategy
        out["execution_strategy"] = {"type": type(strategy).__name__,
                                     "auto_stage": None if strategy.auto_stage is None else strategy.auto_stage.name}
        return out

