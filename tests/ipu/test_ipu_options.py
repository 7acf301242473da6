"""The config's ipu section reaches PopTorch: options, pipeline, precision and optimizer.

Built through the same code as ``--backend ipu`` (ipu/options.py, ipu/pipeline.py,
backends/ipu.py), with the mock standing in for poptorch.
"""
import dataclasses

import numpy as np
import pytest
import torch
import yaml

import ipu.mock_popdist as mock_popdist
import ipu.mock_poptorch as poptorch
from backends.mock import MockBackend
from bert_packed.config import ConfigError, load_config, resolve_config_path
from ipu.config import IPUConfig
from bert_packed.optim import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.loop.plan import make_plan
from ipu import options as ipu_options
from bert_packed.model.attention import no_profiler_scopes
from ipu.host_batch import stack_host_batch
from ipu_helpers import TINY_MODEL, random_micro_batches

# Only sizes shrink; every ipu value stays phase2's (24 layers keep layers_per_ipu [3, 7, 7, 7]).
SIZE_ONLY = [s for s in TINY_MODEL]


def prepared(overrides):
    """A MockBackend prepared for phase2 + overrides, compiled on one run's data (not run)."""
    config = load_config("phase2", SIZE_ONLY + overrides)
    torch.manual_seed(0)
    model = build_model(config)
    optimizer = build_optimizer(model, "lamb", lr=1e-3)
    backend = MockBackend()
    backend.prepare(model, optimizer, make_plan(config, backend))
    batch = random_micro_batches(0, 1, config)[0]
    num = backend.micro_batches_per_step * backend.steps_per_call
    host = stack_host_batch([batch] * num, num_steps=backend.steps_per_call,
                            gradient_accumulation=config.train.gradient_accumulation,
                            num_replicas=config.ipu.replication_factor)
    serialized = []
    original = poptorch.serializedMatMul
    poptorch.serializedMatMul = lambda lhs, rhs, mode, factor=0, **k: serialized.append(factor) or original(lhs, rhs, mode, factor)
    try:
        with no_profiler_scopes():
            backend.training_model.compile(**host)
    finally:
        poptorch.serializedMatMul = original
    return config, backend, serialized


def encoder_layers_per_ipu(plan):
    counts = [0] * plan["num_ipus_per_replica"]
    for block_id, ipu_id, _ in plan["blocks"]:
        if block_id.startswith("Encoder"):
            counts[ipu_id] += 1
    return counts


# One check per IPUConfig field: (config value, options, backend, serialisation factors seen).
CHECKS = {
    "layers_per_ipu": lambda v, o, b, s: encoder_layers_per_ipu(b.training_model.pipeline) == v
    and b.training_model.pipeline["blocks"][0][:2] == ("Embedding", 0)
    and b.training_model.pipeline["blocks"][-1][:2] == ("Heads", 0),
    "replication_factor": lambda v, o, b, s: o.replication_factor == v,
    "device_iterations": lambda v, o, b, s: o.device_iterations == v,
    "output_mode": lambda v, o, b, s: o.output_mode == {"all": 2, "sum": 3, "final": 0, "default": 4}[v],
    "available_memory_proportion": lambda v, o, b, s: o.available_memory_proportion
    == {i: p for i, p in enumerate(v if len(v) > 1 else v * len(b.settings.layers_per_ipu))},
    "enable_half_partials": lambda v, o, b, s: o._Popart.options["partialsTypeMatMuls"] == ("half" if v else "float"),
    "half_precision": lambda v, o, b, s: all(p.dtype == (torch.float16 if v else torch.float32)
                                             for p in b.model.parameters()),
    "accumulator_dtype": lambda v, o, b, s: b.optimizer.accum_type == (
        torch.float16 if v == "fp16" or (v == "auto" and b.settings.half_precision) else torch.float32)
    and o.Training.meanAccumulationAndReplicationReductionStrategy == (
        poptorch.MeanReductionStrategy.Running if b.optimizer.accum_type == torch.float16
        else poptorch.MeanReductionStrategy.Post),
    "stochastic_rounding": lambda v, o, b, s: o._Popart.options["enableStochasticRounding"] == v,
    "loss_scaling": lambda v, o, b, s: b.optimizer.loss_scaling == v,
    "executable_cache_dir": lambda v, o, b, s: o._Popart.options.get("cachePath") == v
    and o._Popart.options.get("enableEngineCaching", False) == bool(v),
    "synthetic_data": lambda v, o, b, s: o._Popart.options.get("syntheticDataMode", 0) == (2 if v else 0),
    "log_cycle_count": lambda v, o, b, s: o._Popart.options["instrumentWithHardwareCycleCounter"] == v,
    "optimizer_state_offchip": lambda v, o, b, s: o.TensorLocations.location_optimizer["onChip"] == int(not v),
    "replicated_tensor_sharding": lambda v, o, b, s:
    o.TensorLocations.location_optimizer["useReplicatedTensorSharding"] == int(v and o.replication_factor > 1),
    "recompute_checkpoint_every_layer": lambda v, o, b, s:
    b.training_model.pipeline["num_recomputation_checkpoints"] == (sum(b.settings.layers_per_ipu) if v else 0),
    "auto_round_num_ipus": lambda v, o, b, s: o.auto_round_num_ipus == v,
    "embedding_serialization_factor": lambda v, o, b, s: s == ([v] if v > 1 else []),
}


def test_every_ipu_config_field_has_a_check():
    assert {f.name for f in dataclasses.fields(IPUConfig)} == set(CHECKS)


def test_phase2_ipu_section_is_all_in_the_options():
    section = yaml.safe_load(open(resolve_config_path("phase2")))["ipu"]
    config, backend, serialized = prepared([])
    opts = backend.training_model.options
    for key, value in section.items():
        assert CHECKS[key](value, opts, backend, serialized), f"ipu.{key}={value!r} not carried"
    assert opts.Training.gradient_accumulation == config.train.gradient_accumulation == 1024
    assert opts._execution_strategy.auto_stage == poptorch.AutoStage.AutoIncrement
    assert backend.training_model.pipeline["stage_ipus"] == [0, 1, 2, 3, 0]


def test_phase2_options_carry_graphcores_memory_settings():
    """Issue 12 point 1, as phase2.yaml builds them: fp16 gradient accumulators with fp32 LAMB
    moments and PopTorch's Running mean reduction, Graphcore BERT's PopART patterns, session and
    engine options, and the executable cache on by default."""
    config, backend, _ = prepared([])
    opts, optimizer = backend.training_model.options, backend.optimizer
    assert optimizer.accum_type == torch.float16
    assert optimizer.first_order_momentum_accum_type == optimizer.second_order_momentum_accum_type == torch.float32
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy == poptorch.MeanReductionStrategy.Running
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Mean
    popart = opts._Popart.options
    assert popart["patterns"] == {"TiedGather": True, "TiedGatherAccumulate": True,
                                  "UpdateInplacePrioritiesForIpu": True}
    assert popart["scheduleNonWeightUpdateGradientConsumersEarly"] is True and popart["outlineThreshold"] == 10.0
    assert popart["engineOptions"]["opt.useAutoloader"] == "true"
    assert popart["engineOptions"]["target.syncReplicasIndependently"] == "true"
    assert popart["enableEngineCaching"] is True and popart["cachePath"] == config.ipu.executable_cache_dir


def test_every_other_value_is_carried_too():
    """Flip every field away from phase2's value; each check must follow."""
    flipped = ["ipu.layers_per_ipu=[12,12]", "ipu.replication_factor=2", "ipu.device_iterations=2",
               "ipu.output_mode=all", "ipu.available_memory_proportion=[0.3]", "ipu.enable_half_partials=false",
               "ipu.half_precision=false", "ipu.stochastic_rounding=false", "ipu.loss_scaling=128.0",
               "ipu.accumulator_dtype=fp16", "ipu.executable_cache_dir=null", "ipu.synthetic_data=true", "ipu.log_cycle_count=true",
               "ipu.optimizer_state_offchip=false", "ipu.replicated_tensor_sharding=false",
               "ipu.recompute_checkpoint_every_layer=false", "ipu.auto_round_num_ipus=false",
               "ipu.embedding_serialization_factor=1", "train.gradient_accumulation=5", "train.steps=10"]
    config, backend, serialized = prepared(flipped)
    opts = backend.training_model.options
    for field in dataclasses.fields(IPUConfig):
        value = getattr(config.ipu, field.name)
        assert CHECKS[field.name](value, opts, backend, serialized), f"ipu.{field.name}={value!r} not carried"


def test_training_output_mode_must_return_every_micro_batch():
    config = load_config("phase2", SIZE_ONLY + ["ipu.output_mode=final"])
    model = build_model(config)
    with pytest.raises(ConfigError, match="output_mode=final"):
        MockBackend().prepare(model, build_optimizer(model, "lamb", lr=1e-3), make_plan(config, MockBackend))


def test_layers_per_ipu_must_match_the_model():
    config = load_config("phase2", SIZE_ONLY + ["model.num_hidden_layers=2"])
    model = build_model(config)
    with pytest.raises(ConfigError, match="layers_per_ipu"):
        MockBackend().prepare(model, build_optimizer(model, "lamb", lr=1e-3), make_plan(config, MockBackend))


# -- PopRun / popdist ---------------------------------------------------------------------------

@pytest.fixture
def poprun():
    mock_popdist.configure(num_instances=2, instance_index=1, num_local_replicas=2, ipus_per_replica=4)
    yield mock_popdist
    mock_popdist.reset()


def test_poprun_options_come_from_popdist(poprun):
    config = load_config("phase2", SIZE_ONLY + ["ipu.replication_factor=2"])
    opts = ipu_options.build_options(poptorch, config.ipu, seed=config.train.seed, gradient_accumulation=config.train.gradient_accumulation, popdist=poprun)
    assert opts.replication_factor == 2
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    # Kept for the mock's placement check, but no option value: PopTorch's parser would refuse it.
    assert opts._popdist_ipus_per_replica == 4 and "ipus_per_replica" not in opts._backend_dict()
    assert ipu_options.data_shard(poprun) == (1, 2)
    assert ipu_options.num_total_replicas(config.ipu, poprun) == 4
    # Sharding the optimizer state is over all 4 replicas of the two instances.
    assert opts.TensorLocations.location_optimizer["useReplicatedTensorSharding"] == 1


def test_poprun_replicas_must_match_the_config(poprun):
    config = load_config("phase2", SIZE_ONLY)  # replication_factor 4 != 2 local replicas
    with pytest.raises(ConfigError, match="PopRun gives this instance 2 replicas"):
        ipu_options.build_options(poptorch, config.ipu, seed=config.train.seed, gradient_accumulation=config.train.gradient_accumulation, popdist=poprun)


def test_poprun_with_several_instances_needs_a_process_group(poprun, monkeypatch):
    monkeypatch.setattr(ipu_options, "import_popdist", lambda: poprun)
    config = load_config("phase2", SIZE_ONLY + ["ipu.replication_factor=2"])
    model = build_model(config)
    backend = MockBackend()
    assert backend.process_shard() == (1, 2)
    with pytest.raises(ConfigError, match="torch.distributed"):
        backend.prepare(model, build_optimizer(model, "lamb", lr=1e-3), make_plan(config, backend))


def test_mock_dataloader_shards_by_instance(poprun):
    opts = poprun.poptorch.Options(ipus_per_replica=4)
    dataset = torch.utils.data.TensorDataset(torch.arange(16.0))
    loader = poptorch.DataLoader(opts, dataset, batch_size=2)
    assert loader.combinedBatchSize == 4
    rows = torch.cat([b[0] for b in loader])
    assert rows.tolist() == list(np.arange(8.0, 16.0))  # instance 1 of 2 reads the second half


# -- the real-poptorch backend on a machine without the SDK -------------------------------------

def test_ipu_backend_without_poptorch_says_how_to_install(monkeypatch):
    import builtins

    import backends
    import backends.ipu as ipu_backend

    real_import = builtins.__import__

    def no_poptorch(name, *args, **kwargs):
        if name == "poptorch":
            raise ImportError("No module named 'poptorch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_poptorch)
    assert ipu_backend.IPUBackend.is_available() is False
    with pytest.raises(ConfigError, match=r"pip install <sdk>/poptorch-\*\.whl.*--backend mock"):
        ipu_backend.IPUBackend()
    with pytest.raises(ConfigError, match="--backend mock"):
        backends.get_backend("ipu")


@pytest.mark.parametrize("layers_per_ipu, stages", [([3, 7, 7, 7], [0, 1, 2, 3, 0]), ([0, 4], [0, 1, 0]),
                                                    ([4], [0]), ([2, 2], [0, 1, 0])])
def test_forward_stages_of_the_graphcore_layout(layers_per_ipu, stages):
    from ipu.pipeline import forward_stage_ipus
    assert forward_stage_ipus(layers_per_ipu) == stages


def test_demo_style_pipeline_without_accumulation_is_a_config_error():
    """PopTorch's rule (Compiler.cpp): accumulation >= 2 x forward stages - 1; device iterations
    do not stand in for it (PopTorch refuses accumulation 1 whatever deviceIterations is)."""
    from ipu.pipeline import check_pipeline_depth
    with pytest.raises(ConfigError, match=r"at least 5 micro-batches .*train.gradient_accumulation.*"
                                          r"layers_per_ipu=\[2\]"):
        check_pipeline_depth([1, 1], gradient_accumulation=1, device_iterations=1)
    with pytest.raises(ConfigError, match=r"at least 5 micro-batches per replica \(got 1\)"):
        check_pipeline_depth([1, 1], gradient_accumulation=1, device_iterations=5)
    with pytest.raises(ConfigError, match=r"at least 5 micro-batches per replica \(got 4\)"):
        check_pipeline_depth([1, 1], gradient_accumulation=4, device_iterations=1)
    check_pipeline_depth([1, 1], gradient_accumulation=5, device_iterations=1)
    check_pipeline_depth([2], gradient_accumulation=1, device_iterations=1)  # one IPU: no pipeline
