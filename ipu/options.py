"""``poptorch.Options`` from the ``ipu`` config section (and the step plan's accumulation and seed).

Written against a ``poptorch`` module passed in, so the same lines configure the real PopTorch
(``--backend ipu``) and the IPU-free mock (``--backend mock``). The choices follow Graphcore's
PopTorch BERT (``ipu_options.py``): pipelined execution with ``AutoStage.AutoIncrement`` (so the
heads can return to IPU 0 as a last stage), Mean reduction over accumulation and replicas,
optimizer state in Streaming Memory with replicated tensor sharding, half partials and
stochastic rounding for fp16 training.

Multi-host: under PopRun (``poprun --num-instances N --num-replicas R ...``) the popdist
environment is set; then the options come from ``popdist.poptorch.Options(ipus_per_replica=...)``,
which sets this instance's replicas and ``Distributed`` process id, and ``data_shard`` tells the
data pipeline which share of the data this instance reads.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple

import torch

from bert_packed.config import ConfigError

# config ipu.output_mode -> poptorch.OutputMode member name ("default" leaves PopTorch's default)
OUTPUT_MODES = {"all": "All", "sum": "Sum", "final": "Final"}


def import_popdist() -> Optional[Any]:
    """The ``popdist`` module of the Poplar SDK when running under PopRun, else None."""
    try:
        import popdist  # noqa: F401  (Poplar SDK only)
        import popdist.poptorch  # noqa: F401
    except ImportError:
        return None
    return popdist if popdist.isPopdistEnvSet() else None


def init_popdist(popdist: Optional[Any]) -> Optional[Any]:
    """``popdist.init()`` once per process under PopRun, as Graphcore's PopRun examples do
    (nlp/bert/pytorch/args.py ``init_popdist``) before any popdist query or Options; returns
    ``popdist`` (None without PopRun)."""
    if popdist is not None and not getattr(popdist, "_packed_bert_initialised", False):
        popdist.init()
        popdist._packed_bert_initialised = True
    return popdist


def data_shard(popdist: Optional[Any] = None) -> Tuple[int, int]:
    """``(instance_index, num_instances)``: which share of the data this host process reads.

    Every PopRun instance feeds its own replicas, so instance i reads every num_instances-th
    pack group starting at i (``(0, 1)`` without PopRun).
    """
    if popdist is None:
        return 0, 1
    return int(popdist.getInstanceIndex()), int(popdist.getNumInstances())


def num_total_replicas(ipu, popdist: Optional[Any] = None) -> int:
    """Replicas over all PopRun instances (what PopTorch's Mean reduction averages over);
    ``ipu``: the ``ipu`` config section."""
    if popdist is None:
        return ipu.replication_factor
    return int(popdist.getNumTotalReplicas())


# Graphcore's PopART settings for BERT (examples nlp/bert/pytorch/ipu_options.py and
# optimum-graphcore ipu_configuration.py), set for every executable:
PATTERNS = {"TiedGather": True, "TiedGatherAccumulate": True, "UpdateInplacePrioritiesForIpu": True}
POPART_OPTIONS = {
    # Schedule gradient consumers (the accumulation) early: their inputs die sooner.
    "scheduleNonWeightUpdateGradientConsumersEarly": True,
    # Outline (share code for) repeated subgraphs above this estimated saving: less code memory.
    "outlineThreshold": 10.0,
}
ENGINE_OPTIONS = {"opt.useAutoloader": "true", "target.syncReplicasIndependently": "true"}
# Poplar writes its memory report even when the graph does not fit (compile-only, profiling).
REPORT_ENGINE_OPTIONS = {"debug.allowOutOfMemory": "true", "autoReport.all": "true"}


def _set_popart_options(opts, ipu, *, training: bool, popart: Optional[Any], profile_dir: Optional[str]) -> None:
    """The PopART session and engine options of :func:`build_options` (Graphcore BERT's, the
    pipelined accumulation's, and the report settings of a ``profile_dir`` compile)."""
    if training and ipu.ipus_per_replica > 1:
        # Graphcore BERT's PopART settings for pipelined accumulation: no host streams for the
        # accumulators, the outer (weight-update) fragment scheduled to save memory, except on
        # IPU 0 (embeddings + heads, the fullest), and subgraph copies just in time.
        opts._Popart.set("disableGradAccumulationTensorStreams", True)
        opts._Popart.set("accumulateOuterFragmentSettings.schedule",
                         int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized) if popart else 3)
        opts._Popart.set("accumulateOuterFragmentSettings.excludedVirtualGraphs", ["0"])
        opts._Popart.set("subgraphCopyingStrategy",
                         int(popart.SubgraphCopyingStrategy.JustInTime) if popart else 1)
    for key, value in POPART_OPTIONS.items():
        opts._Popart.set(key, value)
    # TiedGather(Accumulate): the MLM decoder and the word embedding share one weight and one
    # accumulator instead of a transposed copy of the 30522 x 1024 table on IPU 0.
    opts._Popart.setPatterns(dict(PATTERNS))
    engine = dict(ENGINE_OPTIONS)
    if profile_dir:
        engine.update(REPORT_ENGINE_OPTIONS, **{"autoReport.directory": profile_dir})
        # PopART hashes every engine option into the executable-cache key (sessionoptions.cpp
        # std::hash<SessionOptions>), so a report compile can never serve the real run; and a
        # report compile that loaded from the cache would write no report. Never cache it.
        opts.enableExecutableCaching(None)
    opts._Popart.setEngineOptions(engine)


def build_options(poptorch, ipu, *, seed: int, gradient_accumulation: int = 1, training: bool = True,
                  popdist: Optional[Any] = None, popart: Optional[Any] = None, log_cycle_count: Optional[bool] = None,
                  profile_dir: Optional[str] = None, device_iterations: Optional[int] = None,
                  replication_factor: Optional[int] = None, offline: bool = False):
    """A ``poptorch.Options`` for ``ipu`` (the ``ipu`` config section, an ``ipu.config.IPUConfig``).

    ``seed`` and ``gradient_accumulation`` (per replica, already packing-adjusted: the step
    plan's) come from the run; keyword overrides exist for the backend's own uses (profiling,
    evaluation, compile-only). ``profile_dir`` makes Poplar write its reports there (with
    ``debug.allowOutOfMemory``, so a layout that does not fit still reports) and turns the
    executable cache off for that executable (its engine options differ from the real run's, so
    its cache key does too); ``offline`` compiles for a GC200 without attaching to one, with
    exactly the options of the real run otherwise (``useOfflineIpuTarget`` is no part of
    PopART's cache key, so the real run loads what it compiled). The host's torch generator is
    left as it was (see ``host_rng_preserved``).
    """
    rf = ipu.replication_factor if replication_factor is None else replication_factor
    if popdist is not None:
        opts = popdist.poptorch.Options(ipus_per_replica=ipu.ipus_per_replica)
        local = int(popdist.getNumLocalReplicas())
        if rf != local:
            raise ConfigError(f"ipu.replication_factor={rf} but PopRun gives this instance {local} replicas; "
                              f"use --set ipu.replication_factor={local} (replicas per instance)")
    else:
        opts = poptorch.Options()
        opts.replicationFactor(rf)
    opts.autoRoundNumIPUs(ipu.auto_round_num_ipus)
    opts.deviceIterations(ipu.device_iterations if device_iterations is None else device_iterations)
    # The device's seed. PopTorch's randomSeed also calls torch.manual_seed (options.py,
    # sdk-release-3.4), which would re-seed the host's generator in the middle of a run: every
    # evaluation or prediction executable builds its options, and on the mock the host generator
    # is the one dropout draws from. The loop seeds the host itself; keep its stream untouched.
    with host_rng_preserved():
        opts.randomSeed(int(seed))

    if training:
        opts.Training.gradientAccumulation(int(gradient_accumulation))
        # Mean over accumulation and replicas (PopTorch's default, made explicit): the backend
        # scales each micro-batch's loss by the number of micro-batches so that the mean of the
        # gradients is the global-count-normalised gradient (see backends/ipu.py).
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
        # The strategy PopTorch picks itself from the optimizer's accum_type, stated: a running
        # mean for fp16 accumulators (bounded by the largest micro-batch gradient), the sum
        # divided at the end for fp32 ones (faster; no overflow risk in fp32).
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running if ipu.fp16_accumulators else poptorch.MeanReductionStrategy.Post)

    if ipu.output_mode != "default":
        opts.outputMode(getattr(poptorch.OutputMode, OUTPUT_MODES[ipu.output_mode]))

    # New stage for every block, so the heads' block on IPU 0 after the last encoder IPU is a
    # later pipeline stage instead of an out-of-order stage 0 (AutoStage.SameAsIpu).
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    proportions = ipu.available_memory_proportion
    if len(proportions) == 1:
        proportions = proportions * ipu.ipus_per_replica
    opts.setAvailableMemoryProportion({f"IPU{i}": float(p) for i, p in enumerate(proportions)})

    opts.Precision.setPartialsType(torch.half if ipu.enable_half_partials else torch.float)
    opts.Precision.enableStochasticRounding(bool(ipu.stochastic_rounding))

    if ipu.executable_cache_dir:
        opts.enableExecutableCaching(ipu.executable_cache_dir)
    if ipu.synthetic_data:
        opts.enableSyntheticData(True)
    opts.logCycleCount(bool(ipu.log_cycle_count if log_cycle_count is None else log_cycle_count))
    if offline:
        opts.useOfflineIpuTarget(2)  # 2 = Mk2 (GC200), the IPU-M2000's processor

    # Optimizer state (LAMB's two moments: 2x the weights) in Streaming Memory, sharded over
    # the replicas so each only streams its 1/R share; sharding needs more than one replica.
    sharded = bool(ipu.replicated_tensor_sharding) and num_total_replicas(ipu, popdist) > 1
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings()
        .useOnChipStorage(not ipu.optimizer_state_offchip)
        .useReplicatedTensorSharding(sharded))

    _set_popart_options(opts, ipu, training=training, popart=popart, profile_dir=profile_dir)
    return opts


@contextlib.contextmanager
def host_rng_preserved():
    """Run the body (PopTorch's ``Options.randomSeed``) without changing torch's host generators:
    the CPU one, and CUDA's where CUDA is initialised."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
