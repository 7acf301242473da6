"""Issue 26 (round 1): what a first POD16 run would still hit, and a mock that refuses exactly
what PopTorch refuses.

Checked against graphcore/poptorch and graphcore/popart, sdk-release-3.4 (the commits are in
ipu/mock_popart/session_options.json): poptorch ``popart_compiler/source/SessionOptions.cpp``
(the option tables), ``poptorch/source/SessionOptionsParser.cpp`` (dispatch by value type),
``popart_compiler/source/Compiler.cpp`` (the pipeline rule), ``python/options.py``
(``randomSeed``), ``python/optim.py`` and ``python/_optimizer_attributes.py`` (constants); popart
``willow/src/sessionoptions.cpp`` and ``ir.cpp`` (the executable-cache key),
``willow/src/optimizervalue.cpp`` (``validReplacement``), ``willow/src/patterns``.
"""
import glob
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import ipu.mock_poptorch as poptorch
import run
from backends import get_backend_class
from backends.mock import MockBackend
from bert_packed.model.build import bert_config, build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.config import ConfigError, load_config, resolve_run
from bert_packed.loop.plan import make_plan
from bert_packed.optim import build_optimizer as build_host_optimizer
from bert_packed.tasks.registry import get_task
from ipu import memory, offline
from ipu.host_batch import stack_host_batch
from ipu import options as ipu_options
from ipu.mock_popart import extract_session_options as extract
from ipu.mock_popart import session_options
from ipu.pipeline import check_pipeline_depth, forward_stage_ipus, heads_ipu
from ipu_helpers import TINY_MODEL, Toy, random_micro_batches

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, generator=g)


def compile_toy(opts, optimizer_fn=None):
    model = Toy()
    optimizer = optimizer_fn(model) if optimizer_fn else None
    wrapped = poptorch.trainingModel(model, opts, optimizer=optimizer)
    wrapped(*data(opts.Training.gradient_accumulation))
    return wrapped


# -- 1. session options: PopTorch's tables, replayed ----------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("outlineThreshold", 10, "Unknown uint64 option outlineThreshold"),             # a double given as an int
    ("enableStochasticRounding", 1, "Unknown uint64 option enableStochasticRounding"),  # a bool given as an int
    ("accumulationFactor", 4.0, "Unknown floating point option accumulationFactor"),
    ("syntheticDataMode", True, "Unknown bool option syntheticDataMode"),
    ("partialsTypeMatMuls", 16, "Unknown uint64 option partialsTypeMatMuls"),
    ("scheduleNonWeightUpdateGradientConsumersEarly", "true",
     "Unknown string option scheduleNonWeightUpdateGradientConsumersEarly"),
])
def test_a_session_option_of_the_wrong_value_type_fails_the_compile(key, value, message):
    opts = poptorch.Options()
    opts._Popart.set(key, value)  # PopTorch stores anything; its C++ parser refuses at compile time
    with pytest.raises(poptorch.Error, match=re.escape(message)) as info:
        compile_toy(opts)
    assert info.value.type == "poptorch_cpp_error"


@pytest.mark.parametrize("key, value, message", [
    ("syntheticDataMode", 4, "Value for SyntheticDataMode out of range"),
    ("accumulateOuterFragmentSettings.schedule", 4, "Value for popart::AccumulateOuterFragmentSchedule out of range"),
    ("subgraphCopyingStrategy", 2, "Value for SubgraphCopyingStrategy out of range"),
    ("autoRecomputation", 5, "Value for RecomputationType out of range"),
    ("virtualGraphMode", 4, "Value for VirtualGraphMode out of range"),
])
def test_an_enum_value_out_of_range_fails_the_compile(key, value, message):
    opts = poptorch.Options()
    opts._Popart.set(key, value)
    with pytest.raises(poptorch.Error, match=re.escape(message)):
        compile_toy(opts)
    opts = poptorch.Options()
    opts._Popart.set(key, value - 1)  # the largest valid value compiles
    compile_toy(opts)


def test_poptorchs_own_deprecated_post_and_loss_is_out_of_popart_range():
    """PopTorch 3.4 still offers MeanReductionStrategy.PostAndLoss (2), but PopART's enum has only
    Running and Post, so the table refuses it: derived from the sources, not written here."""
    opts = poptorch.Options()
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(poptorch.MeanReductionStrategy.PostAndLoss)
    with pytest.raises(poptorch.Error, match="Value for MeanReductionStrategy out of range"):
        compile_toy(opts)


def test_an_unknown_pattern_name_fails_the_compile():
    opts = poptorch.Options()
    opts._Popart.setPatterns({"TiedGathr": True})
    with pytest.raises(poptorch.Error, match=re.escape("Unknown pattern TiedGathr.")) as info:
        compile_toy(opts)
    assert info.value.type == "popart_exception"
    opts = poptorch.Options()
    opts._Popart.setPatterns({"TiedGather": True}, level=4)  # PatternsLevel::All is 3
    with pytest.raises(poptorch.Error, match="PatternsLevel::All"):
        compile_toy(opts)
    opts = poptorch.Options()
    opts._Popart.set("patterns", {"TiedGather": True})  # without patterns_level
    with pytest.raises(poptorch.Error, match="should not be set without first setting 'patterns_level'"):
        compile_toy(opts)
    opts = poptorch.Options()  # the names enablePattern handles itself, and Graphcore BERT's
    opts._Popart.setPatterns({"InPlace": True, "UpdateInplacePrioritiesForIpu": True, "TiedGather": True,
                              "TiedGatherAccumulate": True, "LambSerialisedWeight": False})
    compile_toy(opts)


def test_what_poptorch_passes_through_is_accepted():
    opts = poptorch.Options()
    opts.TensorLocations.numIOTiles(64)  # PopTorch passes it on as the PopART option numIOTiles
    compile_toy(opts)
    opts._unfreeze()
    opts._Popart.set("numIOTiles", 32)  # both ways at once: PopTorch's toDict refuses to merge
    with pytest.raises(AssertionError, match="Can't merge dictionaries"):
        compile_toy(opts)
    opts = poptorch.Options()
    for key, value in [("numIOTiles", 32), ("replicatedCollectivesSettings.prepareScheduleForMergingCollectives", True),
                       ("replicatedCollectivesSettings.mergeAllReduceCollectives", True),
                       ("batchSerializationSettings.factor", 2),
                       ("batchSerializationSettings.concatOnVirtualGraphChange", False),
                       ("batchSerializationSettings.concatOnExecutionPhaseChange", False),
                       ("batchSerializationSettings.concatOnPipelineStageChange", False),
                       ("batchSerializationSettings.transformContext", 1),
                       ("batchSerializationSettings.method", 2), ("batchSerializationSettings.batchSchedule", 3),
                       ("automaticLossScalingSettings.binEdgeLocation", 0.5),
                       ("hardwareInstrumentations", {0, 1}), ("gclOptions", {"useSynclessCollectives": "true"})]:
        opts._Popart.set(key, value)
    compile_toy(opts)
    # ... and not what PopTorch's table lacks, though PopART has it.
    opts = poptorch.Options()
    opts._Popart.set("replicatedCollectivesSettings.mergeReduceScatterCollectives", True)
    with pytest.raises(poptorch.Error, match="Unknown bool option replicatedCollectivesSettings.mergeReduceScatter"):
        compile_toy(opts)


def _valid_value(table):
    return {"bool": True, "uint64": 0, "double": 1.0, "string": "x", "container": ["0"]}[table]


def test_every_popart_option_of_the_tables_is_accepted_with_its_type():
    """Every option of PopTorch's tables that sets a PopART field compiles when given a value of
    its type (each a fresh compile), and is refused when given a value of another type."""
    tables = session_options.tables()["tables"]
    refused, accepted_wrongly = [], []
    for table, entries in tables.items():
        for name, entry in entries.items():
            if not entry["popart_field"] or name in poptorch.Options()._backend_dict():
                continue  # PopTorch-level keys (set through Options, not _Popart)
            opts = poptorch.Options()
            opts._Popart.set(name, _valid_value(table))
            try:
                compile_toy(opts)
            except poptorch.Error as exc:
                refused.append(f"{name}: {exc}")
            wrong = "x" if table != "string" else 1.5
            if name in tables["string"] and table != "string":
                continue
            opts = poptorch.Options()
            opts._Popart.set(name, wrong)
            try:
                compile_toy(opts)
                accepted_wrongly.append(name)
            except poptorch.Error:
                pass
    assert not refused, refused
    assert not accepted_wrongly, accepted_wrongly
    assert sum(len(t) for t in tables.values()) > 100  # the whole tables, not a sample


def test_the_tables_record_their_sources():
    data = session_options.tables()
    for name, source in data["sources"].items():
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]), name
        assert source["ref"] == "sdk-release-3.4" and source["repository"] == f"graphcore/{name}"
    assert data["generated_by"] == "ipu/mock_popart/extract_session_options.py"
    assert os.path.isfile(os.path.join(ROOT, data["generated_by"]))


SNIPPET = r'''
SessionOptionsImpl::SessionOptionsImpl() {
  // registerSetter(bool_options, "commented_out", ...);
  registerSetter(uint64_options, "gradient_accumulation",
      [&](std::uint64_t value) { popart_options.accumulationFactor = value; });
  registerSetter(
      uint64_options, "accumulateOuterFragmentSettings.schedule",
      [&](std::uint64_t value) {
        ERROR_ON_MSG(
            value > static_cast<std::uint64_t>(
                        popart::AccumulateOuterFragmentSchedule::
                            OverlapMemoryOptimized),
            "Value for popart::AccumulateOuterFragmentSchedule out of range");
      });
  string_options["logDir"] = [&](const std::string &log_dir) {};
#define ADD_POPART_ENUM_OPTION(name, EnumType)                                 \
  registerSetter(uint64_options, #name, [&](std::uint64_t value) {             \
  })
  ADD_POPART_ENUM_OPTION(syntheticDataMode, SyntheticDataMode);
  ADD_POPART_BOOL_OPTION(enableStochasticRounding);
  ADD_POPART_DOUBLE_OPTION(outlineThreshold);
}
'''
ENUMS = r'''
enum class SyntheticDataMode {
  /// Use real data.
  Off = 0,
  Zeros, RandomNormal, RandomUniform,
  N
};
enum class AccumulateOuterFragmentSchedule { Scheduler = 0, Serial, OverlapCycleOptimized, OverlapMemoryOptimized };
enum class PopartOutputMode : std::uint8_t { Final = 0, EveryN, All, Sum, N };
'''


def test_the_extraction_reads_the_table_forms_of_the_source():
    enums = extract.parse_enums(ENUMS)
    assert enums["SyntheticDataMode"]["N"] == 4 and enums["PopartOutputMode"]["N"] == 4
    tables = extract.parse_poptorch_tables(SNIPPET, enums)
    assert "commented_out" not in tables["bool"] and "name" not in tables["uint64"]  # comments, #define skipped
    assert tables["uint64"]["gradient_accumulation"]["popart_field"] == "accumulationFactor"
    assert tables["uint64"]["accumulateOuterFragmentSettings.schedule"]["range"] == {
        "enum": "AccumulateOuterFragmentSchedule", "max": 3,
        "message": "Value for popart::AccumulateOuterFragmentSchedule out of range"}
    assert tables["uint64"]["syntheticDataMode"]["range"]["max"] == 3
    assert set(tables["bool"]) == {"enableStochasticRounding"} and set(tables["double"]) == {"outlineThreshold"}
    assert "logDir" in tables["string"]
    names = extract.parse_pattern_names({"a.cpp": 'static PatternCreator<ElementWiseGradOpPattern<AbsGradOp, SignOp>>\n'
                                                  '    sinGradOpPattern("AbsGradOp", true, true);\n'
                                                  '// static PatternCreator<X> x("Commented");'})
    assert names == ["AbsGradOp"]
    hashed = extract.parse_hashed_fields("std::size_t hash<popart::SessionOptions>::operator()(\n"
                                         "    const popart::SessionOptions &so) const {\n"
                                         "  boost::hash_combine(seed, so.activationTensorLocationSettings\n"
                                         "                          .minElementsForOffChip);\n"
                                         "  auto a = so.weightTensorLocationSettings.location.serialize();\n"
                                         "  for (auto kv : so.engineOptions) {}\n  return seed;\n}\n")
    assert hashed == ["activationTensorLocationSettings.minElementsForOffChip", "engineOptions",
                      "weightTensorLocationSettings"]


@pytest.mark.skipif(not (os.environ.get("POPTORCH_SRC") and os.environ.get("POPART_SRC")),
                    reason="needs Graphcore's PopTorch and PopART sources, which ipu/mock_popart/session_options.json "
                           "is extracted from: `git clone --bare https://github.com/graphcore/poptorch` (and "
                           "graphcore/popart), then set POPTORCH_SRC and POPART_SRC to the two clones")
def test_the_data_file_is_what_the_script_extracts(tmp_path):
    out = tmp_path / "session_options.json"
    extract.main(["--poptorch", os.environ["POPTORCH_SRC"], "--popart", os.environ["POPART_SRC"],
                  "--output", str(out)], out=lambda line: None)
    assert json.loads(out.read_text()) == session_options.tables()


# -- 1b. optimizer constants: setOptimizer cannot change what was compiled in ----------------------

def lamb(model, **kwargs):
    return poptorch.optim.LAMB(model.parameters(), lr=0.1, **kwargs)


def test_set_optimizer_refuses_to_change_a_compiled_constant():
    wrapped = compile_toy(poptorch.Options(), lamb)  # weight_decay not given: PopTorch compiles it in
    optimizer = wrapped._optimizer
    assert optimizer.variable_attrs.isConstant("weight_decay") and not optimizer.variable_attrs.isConstant("lr")
    optimizer.param_groups[0]["lr"] = 0.05
    wrapped.setOptimizer(optimizer)  # lr was given: variable
    optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(poptorch.Error, match=r"Problem with weight decays\..*Values are constant but do not match") \
            as info:
        wrapped.setOptimizer(optimizer)
    assert info.value.type == "popart_exception"


def test_mark_as_constant_makes_a_given_value_constant_and_checks_the_name():
    model = Toy()
    optimizer = lamb(model, weight_decay=0.0, loss_scaling=8.0)
    optimizer.variable_attrs.markAsConstant("lr")
    with pytest.raises(AssertionError, match="Unknown attribute no_such"):  # PopTorch asserts
        optimizer.variable_attrs.markAsConstant("no_such")
    wrapped = poptorch.trainingModel(model, poptorch.Options(), optimizer=optimizer)
    wrapped(*data(1))
    optimizer.param_groups[0]["weight_decay"] = 0.01  # given: variable
    optimizer.loss_scaling = 16.0                     # given: variable
    wrapped.setOptimizer(optimizer)
    optimizer.param_groups[0]["lr"] = 0.2
    with pytest.raises(poptorch.Error, match="Problem with learning rates"):
        wrapped.setOptimizer(optimizer)


def test_const_ness_is_poptorchs_every_argument_given_is_variable():
    model = Toy()
    sgd = poptorch.optim.SGD(model.parameters(), 0.1)  # lr given positionally
    assert not sgd.variable_attrs.isConstant("lr") and sgd.variable_attrs.isConstant("loss_scaling")
    adam = poptorch.optim.Adam(model.parameters(), loss_scaling=4.0)  # lr not given: a constant 1e-3
    assert adam.variable_attrs.isConstant("lr") and not adam.variable_attrs.isConstant("loss_scaling")
    described = poptorch.optim.describe(adam)
    assert described["defaults"]["lr"] == (1e-3, True) and described["defaults"]["loss_scaling"] == (4.0, False)


def test_a_constant_change_while_detached_fails_at_the_next_run():
    wrapped = compile_toy(poptorch.Options(), lamb)
    wrapped.detachFromDevice()
    optimizer = wrapped._optimizer
    optimizer.param_groups[0]["eps"] = 1e-3  # eps not given: constant
    wrapped.setOptimizer(optimizer)  # detached: PopTorch pushes it at the next attach or run
    with pytest.raises(poptorch.Error, match="Problem with eps"):
        wrapped(*data(1))


def test_the_projects_schedule_only_changes_variables():
    """The backend's LAMB (ipu/pipeline.py build_optimizer) gives lr, so the schedule's changes
    pass PopART's check; its constants never change during a run."""
    config = load_config("phase2", TINY_MODEL + ["model.num_hidden_layers=2", "ipu.layers_per_ipu=[2]",
                                                 "ipu.replication_factor=1", "train.gradient_accumulation=2",
                                                 "ipu.executable_cache_dir=null", "optimizer.warmup_fraction=0.5",
                                                 "train.steps=4"])
    torch.manual_seed(0)
    model = build_model(config)
    host_optimizer, scheduler = build_optimizer(config, model)
    backend = MockBackend()
    backend.prepare(model, host_optimizer, make_plan(config, backend), scheduler=scheduler)
    rates = [backend.train_step(random_micro_batches(step, 2, config))["learning_rate"] for step in range(4)]
    assert len(set(rates)) > 1  # the rate moved, and setOptimizer accepted every move


# -- 3. the pipeline rule: accumulation >= 2 x forward stages - 1, whatever the device iterations --

class Staged(nn.Module):
    def __init__(self, ipus):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in ipus)
        for i, (layer, ipu) in enumerate(zip(self.layers, ipus)):
            poptorch.BeginBlock(layer, f"L{i}", ipu_id=ipu)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x.sum(-1), y)


def test_pipelined_training_without_accumulation_is_refused_whatever_the_device_iterations():
    opts = poptorch.Options().deviceIterations(5)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    with pytest.raises(poptorch.Error, match=re.escape(
            "poptorch.Options().Training.gradientAccumulation must be greater than or equal to the number of "
            "pipeline stages (3) when using poptorch.PipelinedExecution. Please note that a model with 2 pipeline "
            "stages in PopTorch will have an additional 1 stages when training.")):
        poptorch.trainingModel(Staged([0, 1]), opts)(*data(5))
    # The project's layout returns to IPU 0 for the heads: [1, 1] is 3 forward stages, 5 in training.
    with pytest.raises(ConfigError, match=r"at least 5 micro-batches per replica \(got 1\)"):
        check_pipeline_depth([1, 1], gradient_accumulation=1, device_iterations=5)
    check_pipeline_depth([1, 1], gradient_accumulation=5, device_iterations=1)


def _shipped_ipu_configs():
    names = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        with open(path) as f:
            if "ipu" in (yaml.safe_load(f) or {}):  # the configs that name the IPU backends
                names.append(os.path.splitext(os.path.basename(path))[0])
    return names


@pytest.mark.parametrize("name", _shipped_ipu_configs())
def test_every_shipped_ipu_config_passes_poptorchs_pipeline_rule(name):
    """The model's own heads placement (a task head that shares no weight goes to the last IPU,
    as in Graphcore's fine-tuning layouts; finetune_squad's QA head on IPU 0 made 9 stages)."""
    config = load_config(name)
    with torch.device("meta"):
        layout = get_task(config).model_class()(bert_config(config)).pipeline_layout()
    heads = heads_ipu(config.ipu.layers_per_ipu, layout.head_tied_to_embeddings)
    for backend in ("ipu", "mock"):
        resolved = resolve_run(config, get_backend_class(backend)).config
        # The accumulation the run uses; a packing adjustment divides it by p <= sequences per pack.
        accumulation = make_plan(resolved, get_backend_class(backend),
                                 packing_factor=resolved.data.max_sequences_per_pack).gradient_accumulation
        check_pipeline_depth(resolved.ipu.layers_per_ipu, accumulation, resolved.ipu.device_iterations, heads)
        stages = len(forward_stage_ipus(resolved.ipu.layers_per_ipu, heads))
        assert stages == 1 or accumulation >= 2 * stages - 1


def test_the_configs_of_the_check_are_the_shipped_ones():
    assert {"phase1", "phase2", "finetune_squad", "finetune_squad_large", "demo"} <= set(_shipped_ipu_configs())


# The fields of each task's batch, from a packed pre-training batch (same packs and [CLS] slots).
TASK_FIELDS = {
    "pretraining": lambda b: b,
    "classification": lambda b: {**{k: b[k] for k in ("input_ids", "segment_ids", "position_ids", "sequence_ids",
                                                      "cls_positions")},
                                 "labels": b["nsp_labels"], "label_weights": b["nsp_weights"]},
    "squad": lambda b: {**{k: b[k] for k in ("input_ids", "segment_ids", "position_ids", "sequence_ids",
                                             "cls_positions")},
                        "start_positions": b["cls_positions"], "end_positions": b["cls_positions"] + 1,
                        "label_weights": b["nsp_weights"]},
}


@pytest.mark.parametrize("name, task, heads", [
    ("phase2", "pretraining", 0),                 # Graphcore: "Pooler --> IPU 0", "Classifier --> IPU 0"
    ("finetune_squad", "squad", 3),               # Graphcore: "QA Outputs --> IPU {ipu}" (the last layer's)
    ("finetune_squad_large", "squad", 7),
    ("finetune_glue_base", "classification", 3),  # optimum-graphcore: "Classifier Output --> IPU {ipu}"
])
def test_the_compiled_pipeline_puts_the_heads_where_graphcore_does(name, task, heads):
    """What the mock recorded when it compiled the training executable of a shipped config's
    layout (tiny widths): the embeddings on IPU 0, each encoder layer on its IPU, and the heads
    block on IPU 0 when it holds the MLM decoder tied to the embeddings (pre-training), else
    after the last layer on the last IPU (graphcore/examples nlp/bert/pytorch modeling.py,
    optimum-graphcore models/bert/modeling_bert.py)."""
    layers = load_config(name).ipu.layers_per_ipu
    config = load_config(name, TINY_MODEL + [
        f"model.num_hidden_layers={sum(layers)}", "ipu.replication_factor=1", "ipu.device_iterations=1",
        "train.global_batch_size=null", "train.gradient_accumulation=15", "train.micro_batch_size=1",
        "ipu.executable_cache_dir=null", "ipu.half_precision=false", "data.max_sequences_per_pack=3",
        "ipu.embedding_serialization_factor=1", "ipu.available_memory_proportion=[0.6]"])
    assert get_task(config).name == task
    torch.manual_seed(0)
    model = get_task(config).model_class()(bert_config(config))
    optimizer, _ = build_optimizer(config, model)
    backend = MockBackend()
    plan = make_plan(config, backend)
    backend.prepare(model, optimizer, plan)
    batch = TASK_FIELDS[task](random_micro_batches(0, 1, config)[0])
    host = stack_host_batch(backend._normalise([batch] * plan.micro_batches_per_step), num_steps=1,
                            gradient_accumulation=plan.gradient_accumulation, num_replicas=1)
    backend.training_model.compile(**host)
    blocks = {block: ipu for block, ipu, _ in backend.training_model.pipeline["blocks"]}
    assert blocks["Embedding"] == 0
    assert [blocks[f"Encoder{i}"] for i in range(sum(layers))] == [i for i, n in enumerate(layers) for _ in range(n)]
    assert blocks["Heads"] == heads
    stages = backend.training_model.pipeline["stage_ipus"]
    assert stages == forward_stage_ipus(layers, heads)
    assert stages[-1] == heads and (heads != 0 or stages.count(0) == 2)  # pre-training: a last stage on IPU 0


# -- 2. --compile-only fills the cache the real run loads -------------------------------------------

CACHED = TINY_MODEL + ["model.num_hidden_layers=4", "ipu.layers_per_ipu=[1,1,1,1]", "ipu.replication_factor=2",
                       "train.gradient_accumulation=9", "train.micro_batch_size=1", "data.max_sequence_length=32",
                       "train.steps=2"]


def test_compile_only_fills_the_executable_cache_the_real_run_loads(tmp_path):
    poptorch.executor.clear_executable_cache()
    config = load_config("phase2", CACHED + [f"ipu.executable_cache_dir={tmp_path / 'cache'}"])
    result = offline.compile_only(config, MockBackend(), str(tmp_path / "compile"))
    compiled = result["executable"]
    assert compiled.options.connection_type == poptorch.ConnectionType.Never and not compiled.loaded_from_cache
    assert not any(k.startswith(("autoReport", "debug.")) for k in compiled.options._Popart.options["engineOptions"])

    torch.manual_seed(0)  # the real run, as the training loop does it: build, prepare, first step
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model)
    backend = MockBackend()
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    per_call = backend.micro_batches_per_step * backend.steps_per_call
    backend.train_step(random_micro_batches(0, per_call, config))
    run = backend.training_model
    assert run.cache_key == compiled.cache_key  # everything PopART hashes, as far as the mock sees it
    assert run.loaded_from_cache


def test_the_options_popart_hashes_are_identical_between_compile_only_and_the_run():
    config = load_config("phase2", CACHED)
    run_options = dict(seed=config.train.seed, gradient_accumulation=config.train.gradient_accumulation)
    parse = [session_options.parse(ipu_options.build_options(poptorch, config.ipu, **run_options, **kw)._backend_dict(),
                                   error=poptorch.Error) for kw in ({}, {"offline": True})]
    real, cache_fill = (session_options.cache_view(p) for p in parse)
    assert cache_fill == real and real["session"]["engineOptions"] == ipu_options.ENGINE_OPTIONS
    assert {k: v for k, v in parse[0]["poptorch"].items() if k not in ("connection_type", "ipu_version")} == \
        {k: v for k, v in parse[1]["poptorch"].items() if k not in ("connection_type", "ipu_version")}
    # The report compile differs exactly in the engine options PopART hashes, so it is never cached.
    report = ipu_options.build_options(poptorch, config.ipu, **run_options, offline=True, profile_dir="report")
    view = session_options.cache_view(session_options.parse(report._backend_dict(), error=poptorch.Error))
    assert view["session"]["engineOptions"] != real["session"]["engineOptions"]
    assert report._Popart.options["enableEngineCaching"] is False


def test_the_report_mode_writes_no_cache_entry_and_keeps_the_report_options(tmp_path):
    poptorch.executor.clear_executable_cache()
    config = load_config("phase2", CACHED + [f"ipu.executable_cache_dir={tmp_path / 'cache'}"])
    result = offline.compile_only(config, MockBackend(), str(tmp_path / "compile"), mode="report")
    engine = result["executable"].options._Popart.options["engineOptions"]
    assert engine["debug.allowOutOfMemory"] == "true" and engine["autoReport.directory"] == result["report_dir"]
    assert not poptorch.executor._EXECUTABLE_CACHE


def test_an_offline_target_of_another_ipu_count_misses_the_cache(capsys):
    """PopTorch compiles offline for exactly the IPUs used and reserves a power of two online;
    the device's IPU count is part of the key (popart devicemanager.cpp std::hash<DeviceInfo>)."""
    opts = [poptorch.Options().autoRoundNumIPUs(True) for _ in range(2)]
    opts[1].useOfflineIpuTarget(2)
    keys = []
    for o in opts:
        o.Training.gradientAccumulation(5)
        o.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
        wrapped = poptorch.trainingModel(Staged([0, 1, 2]), o)
        wrapped.compile(*data(5))
        keys.append(wrapped.cache_key["device"]["num_ipus"])
    assert keys == [4, 3]
    config = load_config("phase2", ["ipu.layers_per_ipu=[8,8,8]", "ipu.replication_factor=1"])
    assert "the real run reserves 4" in offline._ipu_count_note(config)
    assert offline._ipu_count_note(load_config("phase2")) is None


def test_compile_only_uses_the_accumulation_the_run_derives(tmp_path):
    config = load_config("phase2", CACHED + ["train.global_batch_size=36", "ipu.executable_cache_dir=null"])
    result = offline.compile_only(config, MockBackend(), str(tmp_path / "compile"))
    assert result["executable"].options.Training.gradient_accumulation == 36 // (1 * 2)
    with pytest.raises(ConfigError, match="finetune.task=squad"):
        offline.compile_only(load_config("finetune_squad"), MockBackend(), str(tmp_path))


def test_run_py_compile_only_report_mode(tmp_path, capsys):
    args = ["--backend", "mock", "--config", "phase2", "--output-dir", str(tmp_path), "--compile-only", "report"]
    for item in CACHED + ["ipu.executable_cache_dir=null"]:
        args += ["--set", item]
    assert run.main(args) == 0
    assert "mode report" in capsys.readouterr().out
    assert run.main(["--backend", "cpu", "--config", "phase2", "--compile-only"]) == 2
    assert capsys.readouterr().err.strip() == "error: --compile-only compiles ahead of time: use --backend ipu or mock, " \
                                              "not 'cpu'"


# -- 4. evaluation and prediction leave the training RNG untouched (host and device) ---------------------------------------------

def _train_eval_train(evaluate):
    config = load_config("phase2", TINY_MODEL + [
        "model.num_hidden_layers=2", "ipu.layers_per_ipu=[2]", "ipu.replication_factor=1",
        "train.gradient_accumulation=2", "model.hidden_dropout_prob=0.2", "ipu.half_precision=false",
        "ipu.executable_cache_dir=null", "train.steps=2"])
    torch.manual_seed(0)
    model = build_model(config)
    backend = MockBackend()
    backend.prepare(model, build_host_optimizer(model, "lamb", lr=1e-3), make_plan(config, backend))
    batches = random_micro_batches(3, 5, config)
    first = backend.train_step([dict(b) for b in batches[:2]])
    state, device = torch.get_rng_state(), list(backend.training_model.rng_state)
    if evaluate:
        backend.eval_step(dict(batches[4]))  # builds its inference options: randomSeed
        backend.predict_step(dict(batches[4]), names=("nsp_logits",))  # another executable
    # Neither the host's generator nor the training executable's (read back at its detach) moved.
    unchanged = torch.equal(torch.get_rng_state(), state) and backend.training_model.rng_state == device
    second = backend.train_step([dict(b) for b in batches[2:4]])
    backend.sync_to_host()
    return first["loss"], second["loss"], [p.detach().clone() for p in model.parameters()], unchanged


def test_evaluation_leaves_the_training_rng_stream_untouched():
    plain, with_eval = _train_eval_train(False), _train_eval_train(True)
    assert plain[0] == with_eval[0]
    assert plain[1] == with_eval[1]  # the step after the evaluation: dropout drew the same numbers
    for p, q in zip(plain[2], with_eval[2]):
        assert torch.equal(p, q)
    assert with_eval[3]


def test_poptorchs_random_seed_still_seeds_the_host_but_build_options_does_not():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    poptorch.Options().randomSeed(5)  # PopTorch's own behaviour (options.py): torch.manual_seed
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(5).get_state())
    torch.set_rng_state(before)
    config = load_config("phase2", TINY_MODEL)
    opts = ipu_options.build_options(poptorch, config.ipu, seed=config.train.seed, training=False, device_iterations=1,
                                     replication_factor=1)
    assert opts.random_seed == config.train.seed and torch.equal(torch.get_rng_state(), before)


# -- issue item 1: PopTorch's optimizer state, before and after the compile ------------------------
# (the whole resume, stopped by SIGTERM: tests/ipu/test_ipu_resume.py)

def test_a_poptorch_optimizers_state_lives_in_ipu_state():
    """python/optim.py ``Optimizer``: ``state_dict()`` is torch's plus ``ipu_state``/``ipu_param``;
    after runs the state is read from the device (torch's own ``state`` stays empty)."""
    model = Toy()
    optimizer = lamb(model)
    fresh = optimizer.state_dict()
    assert fresh["ipu_state"] is None and fresh["ipu_param"] is None and fresh["state"] == {}
    wrapped = poptorch.trainingModel(model, poptorch.Options(), optimizer=optimizer)
    wrapped(*data(1))
    saved = optimizer.state_dict()
    assert saved["state"] == {} and set(saved["ipu_state"]) == {"step___lin.weight", "exp_avg___lin.weight",
                                                                "exp_avg_sq___lin.weight"}
    assert int(saved["ipu_state"]["step___lin.weight"]) == 1 and float(saved["ipu_param"]["lr___group0"]) == pytest.approx(0.1)
    wrapped(*data(1))
    assert int(optimizer.state_dict()["ipu_state"]["step___lin.weight"]) == 2  # read again: the device ran


@pytest.mark.parametrize("state, message", [
    (lambda optimizer: torch.optim.Optimizer.state_dict(optimizer), "Only IPU optimizer states can be loaded"),
    (lambda optimizer: {"state": {}, "param_groups": optimizer.param_groups, "ipu_state": {}},
     "Only IPU optimizer states can be loaded"),
])
def test_poptorch_refuses_to_load_a_state_without_its_ipu_part(state, message):
    optimizer = lamb(Toy())
    with pytest.raises(RuntimeError, match=message):
        optimizer.load_state_dict(state(optimizer))


def test_a_state_loaded_before_the_compile_continues_the_saved_run():
    """Loaded before ``trainingModel()`` (what the backend's prepare does with a checkpoint), the
    state reaches the device when the executable attaches, and the learning rate compiled is the
    loaded one: the next run equals the one the saved run would have made."""
    model = Toy()
    optimizer = lamb(model)
    wrapped = poptorch.trainingModel(model, poptorch.Options(), optimizer=optimizer)
    wrapped(*data(1, seed=1))
    optimizer.param_groups[0]["lr"] = 0.05
    wrapped.setOptimizer(optimizer)
    saved, weights = optimizer.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    expected = wrapped(*data(1, seed=2))[0]
    expected_weights = model.lin.weight.detach().clone()

    other = Toy()
    other.load_state_dict(weights)
    restored = lamb(other)  # built with lr 0.1, as a resumed run builds it
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == 0.05
    again = poptorch.trainingModel(other, poptorch.Options(), optimizer=restored)
    assert torch.equal(again(*data(1, seed=2))[0], expected)
    assert torch.equal(other.lin.weight.detach(), expected_weights)
    assert int(restored.state_dict()["ipu_state"]["step___lin.weight"]) == 2


# -- issue item 5: the executable's random numbers (PopTorch rng_state) ---------------------------

class Noisy(nn.Module):
    """Dropout in training: a graph with random operations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 1, bias=False)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y):
        out = self.lin(self.drop(x)).squeeze(-1)
        return out, F.mse_loss(out, y)


def noisy_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randn(n, generator=g)


def noisy(opts):
    """A training executable whose runs change nothing but the RNG (SGD with lr 0)."""
    model = Noisy()
    return poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.0))


def test_rng_state_needs_a_compiled_executable():
    wrapped = noisy(poptorch.Options().randomSeed(7))
    with pytest.raises(poptorch.Error, match=re.escape(poptorch.executor.NO_EXECUTABLE_ERR)):
        wrapped.rng_state
    with pytest.raises(poptorch.Error, match=re.escape(poptorch.executor.NO_EXECUTABLE_ERR)):
        wrapped.rng_state = [7]
    wrapped.compile(*noisy_data(1))
    assert wrapped.rng_state == [7]  # the cached Options.randomSeed until the first run
    unseeded = noisy(poptorch.Options())
    unseeded.compile(*noisy_data(1))
    assert unseeded.rng_state is None  # no seed given: PopART took the clock's


def test_the_device_draws_its_own_random_numbers_and_rng_state_replays_them():
    host = torch.manual_seed(123).get_state()
    wrapped = noisy(poptorch.Options().randomSeed(7))
    torch.set_rng_state(host)
    first = wrapped(*noisy_data(4))[0]
    assert torch.equal(torch.get_rng_state(), host)  # the run drew from the device's generator
    state = wrapped.rng_state
    assert state[0] == 7 and len(state) > 1 and all(0 <= word < 2**32 for word in state[1:])
    second = wrapped(*noisy_data(4))[0]
    assert not torch.equal(first, second)  # the stream moved on: other dropout masks
    wrapped.rng_state = state
    assert torch.equal(wrapped(*noisy_data(4))[0], second)
    # Another executable with the same seed draws the same numbers; with another seed, others.
    assert torch.equal(noisy(poptorch.Options().randomSeed(7))(*noisy_data(4))[0], first)
    assert not torch.equal(noisy(poptorch.Options().randomSeed(8))(*noisy_data(4))[0], first)


def test_rng_state_survives_detach_and_attach():
    wrapped = noisy(poptorch.Options().randomSeed(7))
    wrapped(*noisy_data(4))
    state = list(wrapped.rng_state)
    expected = wrapped(*noisy_data(4))[0]
    wrapped.rng_state = state
    wrapped.detachFromDevice()  # PopTorch reads the state back before detaching ...
    wrapped.attachToDevice()    # ... and sets it again when it attaches
    assert torch.equal(wrapped(*noisy_data(4))[0], expected)


def test_rng_state_needs_popart_offload_and_the_right_size():
    opts = poptorch.Options().randomSeed(7)
    opts._Popart.set("enableLoadAndOffloadRNGState", False)  # PopTorch turns it on unless set
    wrapped = noisy(opts)
    wrapped(*noisy_data(4))
    message = "Trying to get the RNG state, but the session option enableLoadAndOffloadRNGState must be set to True."
    with pytest.raises(poptorch.Error, match=re.escape(message)) as info:
        wrapped.detachFromDevice()  # it reads the RNG state first
    assert info.value.type == "popart_exception"
    wrapped = noisy(poptorch.Options().randomSeed(7))
    wrapped(*noisy_data(4))
    size = len(wrapped.rng_state) - 1
    with pytest.raises(poptorch.Error, match=re.escape(
            f"Devicex::setRngStateValue received rngState of size 3; was expecting size {size}")):
        wrapped.rng_state = [7, 1, 2, 3]


def test_a_graph_without_random_operations_has_seed_0():
    """Compiler::getRandomSeed: 0 when PopART's RandomSetup found nothing random (no dropout in
    eval mode, no stochastic rounding)."""
    model = Noisy().eval()
    wrapped = poptorch.inferenceModel(model, poptorch.Options().randomSeed(7))
    wrapped(noisy_data(1)[0], noisy_data(1)[1])
    assert wrapped.rng_state[0] == 0
    opts = poptorch.Options().randomSeed(7)
    opts.Precision.enableStochasticRounding(True)
    wrapped = poptorch.inferenceModel(model, opts)
    wrapped(noisy_data(1)[0], noisy_data(1)[1])
    assert wrapped.rng_state[0] == 7


def _dropout_steps(config, state=None, weights=None, count=2):
    torch.manual_seed(0)
    model = build_model(config)
    if weights is not None:
        model.load_state_dict(weights)
    optimizer, scheduler = build_optimizer(config, model)
    backend = MockBackend()
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler, state=state)
    losses = [backend.train_step(random_micro_batches(step, 2, config))["loss"] for step in range(count)]
    return backend, model, losses


def test_the_backend_checkpoints_the_device_rng_and_restores_it_after_the_compile():
    """PopTorchBackend.state_dict() holds the training executable's rng_state; prepare(state=)
    sets it on the compiled executable before its first run, so dropout goes on as it would have."""
    config = load_config("phase2", TINY_MODEL + [
        "model.num_hidden_layers=2", "ipu.layers_per_ipu=[2]", "ipu.replication_factor=1",
        "train.gradient_accumulation=2", "model.hidden_dropout_prob=0.2", "ipu.half_precision=false",
        "ipu.executable_cache_dir=null", "train.steps=4", "optimizer.schedule=constant",
        "optimizer.warmup_fraction=0"])
    backend, model, _ = _dropout_steps(config, count=1)
    backend.sync_to_host()
    state, weights = backend.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert state["rng_state"] == backend.training_model.rng_state and len(state["rng_state"]) > 1
    expected = backend.train_step(random_micro_batches(0, 2, config))["loss"]
    _, _, resumed = _dropout_steps(config, state=state, weights=weights, count=1)
    assert resumed == [expected]
    without = {k: v for k, v in state.items() if k != "rng_state"}
    _, _, fresh = _dropout_steps(config, state=without, weights=weights, count=1)
    assert fresh != [expected]  # without it, dropout starts over from the seed
    with pytest.raises(ConfigError, match="the checkpoint's device RNG state does not fit this executable"):
        _dropout_steps(config, state={**state, "rng_state": [7, 1, 2]}, weights=weights, count=1)


def test_every_process_resumes_its_own_device_rng_state(tmp_path, monkeypatch):
    """Under PopRun each instance's executable has its own RNG state (its replicas' hardware
    generators): the checkpoint keeps one per process and each resumes its own."""
    from bert_packed.loop import checkpointer as module

    class Backend:
        name = "mock"

        def sync_to_host(self):
            pass

        def state_dict(self):
            return {"optimizer": {"ipu_state": {}}, "rng_state": [7, 1, 2]}

    class Stateful:
        def state_dict(self):
            return {}

    def two_processes(obj):  # what gather returns with a second process whose device differs
        other = {**obj, "rng_state": [7, 3, 4]} if isinstance(obj, dict) and "rng_state" in obj else obj
        return [obj, other]

    monkeypatch.setattr(module, "gather", two_processes)
    writer = module.Checkpointer(str(tmp_path), Backend(), world_size=2, is_main=True, given={})
    assert writer.write(3, model=Toy(), scheduler=None, source=Stateful(), task=Stateful(), totals={}, config={},
                        plan={}) == []
    state = module.load_checkpoint(writer.path)
    assert [module.Checkpointer.backend_state(state, rank)["rng_state"] for rank in (0, 1)] == [[7, 1, 2], [7, 3, 4]]
    assert module.Checkpointer.backend_state(state, 1)["optimizer"] == {"ipu_state": {}}
    older = {"optimizer": {}, "backend_state": {"rng_state": [5]}}  # one dict for all processes
    assert module.Checkpointer.backend_state(older, 1) == {"optimizer": {}, "rng_state": [5]}


# -- 5. memory per tile -----------------------------------------------------------------------------

def test_the_largest_tensors_of_phase2_against_one_tile():
    config = load_config("phase2")
    with torch.device("meta"):
        bert = build_model(config).config
    estimate = memory.estimate_memory(bert, memory.layout_from_config(config))
    rows = {(r["ipu"], r["tensor"]): r for r in estimate["largest_tensors"]}
    V, H, I, A = 30522, 1024, 4096, 16
    B, S, M = 2, 512, 76 + 3 - 1
    tile = 624 * 1024
    expected = {(0, "word_embeddings"): V * H * 2, (0, "word_embeddings_accumulator"): V * H * 2,
                (0, "decoder_weight_gradient"): H * (V // 2) * 2, (0, "mlm_logits"): B * M * V * 2}
    for ipu in range(4):  # [3, 7, 7, 7]: layers on every IPU
        expected[(ipu, "attention_scores")] = B * A * S * S * 2
        expected[(ipu, "ffn_intermediate")] = B * S * I * 2
        expected[(ipu, "ffn_weight")] = H * I * 2
    for key, size in expected.items():
        assert rows[key]["bytes"] == size, key
        assert rows[key]["per_tile_bytes"] == pytest.approx(size / 1472)
        assert rows[key]["tile_fraction"] == pytest.approx(size / 1472 / tile)
    assert rows[(0, "mlm_logits")]["budget_fraction"] == pytest.approx(B * M * V * 2 / 1472 / (0.1 * tile))
    assert rows[(1, "attention_scores")]["budget_fraction"] == pytest.approx(B * A * S * S * 2 / 1472 / (0.15 * tile))
    assert [rows[(k, "pipeline_stash")]["bytes"] for k in range(4)] == [r["stash"] for r in estimate["ipus"]]
    for name in ("word_embeddings", "decoder_weight_gradient", "mlm_logits", "attention_scores"):
        assert rows[(0, name)]["mitigation"] and name in estimate["tile_table"]
    # Serialisation divides the decoder's weight-gradient piece; the table shows each IPU's average.
    one = load_config("phase2", ["ipu.embedding_serialization_factor=1"])
    unserialised = {(r["ipu"], r["tensor"]): r for r in memory.largest_tensors(bert, memory.layout_from_config(one))}
    assert unserialised[(0, "decoder_weight_gradient")]["bytes"] == 2 * rows[(0, "decoder_weight_gradient")]["bytes"]
    for k, row in enumerate(estimate["ipus"]):
        assert f"| {k} | {row['total'] / 2**20:,.0f} | {row['total'] / 1472 / 1024:,.0f} |" in estimate["tile_table"]


def test_a_tensor_beyond_the_matmul_share_of_a_tile_shows():
    """Attention scores at S=2048 with 8 sequences per micro-batch: 1 GiB, 3x an IPU's matmul share."""
    config = load_config("phase2", ["data.max_sequence_length=2048", "model.max_position_embeddings=2048",
                                    "train.micro_batch_size=8"])
    with torch.device("meta"):
        bert = build_model(config).config
    rows = memory.largest_tensors(bert, memory.layout_from_config(config))
    scores = [r for r in rows if r["tensor"] == "attention_scores" and r["ipu"] == 1][0]
    assert scores["bytes"] == 8 * 16 * 2048 * 2048 * 2 and scores["tile_fraction"] > 1.0
