"""The ``ipu`` backend: Graphcore IPUs through PopTorch, and the code path it shares with the
``mock`` backend (``backends/mock.py``, the same class on the IPU-free poptorch stand-in).

``PopTorchBackend`` is written once against a ``poptorch`` module; ``IPUBackend`` passes the
Poplar SDK's. PopTorch is not on PyPI: it ships as a wheel in the Poplar SDK (see docs/ipu.md).
The IPU knowledge it uses lives in ``ipu/``: the config section (``ipu.config``), PopTorch
options (``ipu.options``), pipeline stages and the PopTorch optimizer (``ipu.pipeline``), the
host layout of a call (``ipu.host_batch``), the memory estimate (``ipu.memory``), the cycle and
memory estimates of an executable (``ipu.estimates``) and ``--compile-only`` (``ipu.offline``).

One PopTorch call = ``device_iterations`` optimizer steps. The loop hands ``train_step`` the
micro-batches of those steps as a flat list (step-major; within a step replica-major:
``micro_batches[s*n + r*GA + j]`` is replica r's j-th micro-batch of step s, n = GA x R). They are
stacked into PopTorch's host layout ``[device_iterations, GA, replica, micro_batch, ...]``.

Loss normalisation (docs/internals.md): every pack carries the step's global counts
(``mlm_normalizer``/``nsp_normalizer``), so the model's loss on a micro-batch is its *share* of
the step loss and the step's gradient is the SUM of the micro-batch gradients. PopTorch reduces
with ``ReductionType.Mean`` (Graphcore's choice and the default): the device gradient is the
mean over the GA x R_total micro-batches. We keep Mean and multiply the loss PopTorch
differentiates by ``GA x R_total``, so the mean of the scaled gradients equals the sum of the
unscaled ones: the same step as the cpu backend. Why not ``ReductionType.Sum`` with no scale:
with the global normaliser each micro-batch's gradient is ~1/(GA x R) of an ordinary one
(1/4096 at phase 2), which in fp16 underflows; scaled, each micro-batch's loss and gradient
have the magnitude of an ordinary per-micro-batch mean, which is what fp16 loss scaling is
tuned for. The reported metrics are the unscaled shares, summed over micro-batches.
"""
from __future__ import annotations

import copy
import os
import re
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from bert_packed.model.attention import no_profiler_scopes
from bert_packed.backend import Backend, OfflineCompile, Profiling
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.config import Config, ConfigError, check_section
from bert_packed.model.losses import metric_keys, step_normalizers
from ipu import config as ipu_section
from ipu import memory
from ipu import options as ipu_options
from ipu import pipeline
from ipu.estimates import estimate_run_cycles
from ipu.host_batch import stack_host_batch


def annotate(model, ipu_config, poptorch):
    """``model`` annotated for the pipeline, cast to the configured precision, in training mode."""
    model = pipeline.parallelize(model, ipu_config, poptorch)
    if ipu_config.half_precision:
        model.half()
    return model.train()


class PopTorchBackend(Backend, Profiling, OfflineCompile):
    """The backend contract (``bert_packed.backend``, with profiling and ahead-of-time compiling)
    on PopTorch. Subclasses choose the ``poptorch`` module."""

    name = "ipu"
    config_section = "ipu"
    cost_unit = "cycles"
    cost_note = "IPU hardware cycle counter"
    deterministic_cost = True

    def __init__(self, poptorch=None, popart=None, popdist=None) -> None:
        super().__init__()
        self.poptorch = poptorch
        self.popart = popart
        self.popdist = ipu_options.init_popdist(popdist)
        self.model = self.settings = self.scheduler = None
        self.host_optimizer = self.optimizer = None
        self.training_model = self.inference_model = None
        self._pending_rng_state = None  # a checkpoint's device RNG state, set after the compile
        self.predict_models = {}  # predict_step's executables, one per tuple of output names

    # -- before anything is built -------------------------------------------------------------
    @classmethod
    def validate_config(cls, config, world_size: int) -> List[str]:
        return ipu_section.validate(config, world_size)

    @classmethod
    def replicas_per_process(cls, config) -> int:
        return config.ipu.replication_factor

    @classmethod
    def steps_per_call_for(cls, config) -> int:
        return config.ipu.device_iterations

    @classmethod
    def process_shard(cls):
        """(instance index, number of instances) under PopRun, else None (see ipu.options.data_shard)."""
        popdist = ipu_options.init_popdist(ipu_options.import_popdist())
        return None if popdist is None else ipu_options.data_shard(popdist)

    def ipus_present(self, num_ipus: int) -> bool:
        """Whether the system has ``num_ipus`` IPUs (PopTorch's check; busy ones count)."""
        return bool(self.poptorch.ipuHardwareIsAvailable(num_ipus))

    def missing_ipus_hint(self) -> str:
        return "check `gc-info -l`"

    def _check_ipus_present(self, ipu) -> None:
        """Refuse a run that needs more IPUs than the system has before anything is written or
        compiled (PopTorch would only fail when the first step compiles)."""
        needed = ipu.replication_factor * ipu.ipus_per_replica
        rounded = 1 << (needed - 1).bit_length() if ipu.auto_round_num_ipus else needed
        if not self.ipus_present(rounded):
            counted = f", rounded up to {rounded} (ipu.auto_round_num_ipus)" if rounded != needed else ""
            raise ConfigError(f"the run needs {needed} IPUs (ipu.replication_factor={ipu.replication_factor} x "
                              f"{ipu.ipus_per_replica} per replica, ipu.layers_per_ipu){counted}, more than this system "
                              f"has ({self.missing_ipus_hint()}); lower ipu.replication_factor")

    # -- setup --------------------------------------------------------------------------------
    def prepare(self, model, optimizer, plan, *, scheduler=None, state=None, offline: bool = False,
                report_dir: Optional[str] = None) -> None:
        """Annotate, cast and wrap ``model`` for PopTorch; replace ``optimizer`` by PopTorch's.

        ``state`` (a checkpoint's ``state_dict()``): its optimizer state is loaded into PopTorch's
        optimizer before the training executable is created (PopTorch compiles the optimizer's
        hyperparameters as they are at ``trainingModel()``, and writes a loaded ``ipu_state`` to
        the device when it attaches); its device RNG state is set on the executable once it is
        compiled, before its first run (PopTorch's ``rng_state`` needs a compiled executable).
        ``offline``: compile for a GC200 without attaching to one (``compile_offline``);
        ``report_dir``: Poplar writes its reports (memory, even when out of memory) there.

        The loop's ``scheduler`` keeps driving ``optimizer`` (the host one); after every call the
        new learning rates are copied over and pushed with ``setOptimizer`` (PopTorch only sees
        hyperparameter changes pushed that way, and only between calls).
        """
        poptorch, ipu = self.poptorch, plan.settings
        self.check_plan(model, plan, offline=offline)
        self.plan, self.settings, self.scheduler, self.host_optimizer = plan, ipu, scheduler, optimizer
        ga = plan.gradient_accumulation
        self.model = annotate(model, ipu, poptorch)
        self.optimizer = pipeline.build_optimizer(optimizer, poptorch, ipu, max_grad_norm=plan.max_grad_norm)
        self._pending_rng_state = None
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self._pending_rng_state = state.get("rng_state")
        num_total = ipu_options.num_total_replicas(ipu, self.popdist)
        wrapper = pipeline.TrainingWrapper(self.model, poptorch, loss_multiplier=ga * num_total)
        opts = ipu_options.build_options(poptorch, ipu, seed=plan.seed, gradient_accumulation=ga, training=True,
                                         popdist=self.popdist, popart=self.popart, offline=offline,
                                         profile_dir=report_dir)
        self.training_model = poptorch.trainingModel(wrapper, opts, optimizer=self.optimizer)

    def check_plan(self, model, plan, *, offline: bool = False) -> None:
        """Every mistake ``prepare`` would refuse, found without building anything (``compile_only``
        calls it before it writes its estimate): the section's bounds, the IPUs present (unless
        ``offline``), the output mode, PopRun's process group, the pipeline layout against the
        model, steps per call and pipeline depth."""
        ipu = plan.settings
        check_section(self.config_section, ipu)
        if not offline:
            self._check_ipus_present(ipu)
        if ipu.output_mode in ("final", "default"):
            raise ConfigError(f"ipu.output_mode={ipu.output_mode} returns only the last micro-batch per replica "
                              f"in training, so the step's loss can't be reported; use sum or all")
        if self.popdist is not None and self.popdist.getNumInstances() > 1 and not (
                torch.distributed.is_available() and torch.distributed.is_initialized()):
            # The loss normalisers are the step's counts over ALL instances; without a process
            # group they would be per instance and the step num_instances times too large.
            raise ConfigError("PopRun with several instances needs torch.distributed initialised (for the "
                              "step's global counts); see docs/ipu.md, or run one instance")
        layout = model.pipeline_layout()
        pipeline.layer_ipus(ipu.layers_per_ipu, len(layout.layers))
        if plan.steps % plan.steps_per_call:
            raise ConfigError(f"train.steps={plan.steps} is not a multiple of ipu.device_iterations="
                              f"{plan.steps_per_call} (one PopTorch call runs that many steps); change either")
        pipeline.check_pipeline_depth(ipu.layers_per_ipu, plan.gradient_accumulation, plan.steps_per_call,
                                      pipeline.heads_ipu(ipu.layers_per_ipu, layout.head_tied_to_embeddings))

    def state_dict(self) -> Dict[str, Any]:
        """PopTorch's optimizer state (read from the device) and the training executable's random
        seed and RNG state (``rng_state``: dropout, stochastic rounding), once it has compiled."""
        state = {"optimizer": self.optimizer.state_dict()}
        executor = self.training_model
        if executor is not None and executor.isCompiled():
            state["rng_state"] = executor.rng_state
        elif self._pending_rng_state is not None:  # resumed, not run yet: keep the checkpoint's
            state["rng_state"] = self._pending_rng_state
        return state

    def _restore_rng_state(self, host) -> None:
        """A resumed run's device RNG state onto the training executable: compile it (PopTorch
        sets ``rng_state`` only on a compiled executable), then set it before the first run."""
        executor = self.training_model
        if not executor.isCompiled():
            with no_profiler_scopes():
                executor.compile(**host)
        try:
            executor.rng_state = self._pending_rng_state
        except self.poptorch.Error as exc:
            raise ConfigError(f"the checkpoint's device RNG state does not fit this executable ({exc}); resume "
                              f"with the checkpoint's ipu settings") from None
        self._pending_rng_state = None

    def memory_estimate(self, config) -> Dict[str, Any]:
        """``ipu.memory`` per-IPU estimate of ``config``'s training layout (all replicas counted
        for sharding, PopRun instances included)."""
        with torch.device("meta"):  # the model's sizes, no weights
            bert_config = build_model(config).config
        layout = memory.layout_from_config(config, replicas=ipu_options.num_total_replicas(config.ipu, self.popdist))
        return memory.estimate_memory(bert_config, layout)

    def memory_report(self, config, output_dir: str) -> Dict[str, Any]:
        from ipu.offline import report_memory

        return report_memory(config, self, output_dir)

    def compile_only(self, config, output_dir: str, *, mode: str = "cache") -> Dict[str, Any]:
        from ipu.offline import compile_only

        return compile_only(config, self, output_dir, mode=mode)

    def compile_offline(self, model, optimizer, plan, config, report_dir: Optional[str] = None):
        """Compile the training executable for a GC200 without an IPU (``useOfflineIpuTarget``).
        ``report_dir`` None: exactly the real run's options, so the executable cache it fills
        serves the real run; a directory: Poplar writes its memory report there even when the
        layout does not fit (``debug.allowOutOfMemory`` + ``autoReport.all``; not cached).
        Returns the executable."""
        from bert_packed.data import empty_batch

        self.prepare(model, optimizer, plan, offline=True, report_dir=report_dir)
        d = config.data
        batch = empty_batch(plan.micro_batch_size, d.max_sequence_length, d.max_sequences_per_pack,
                            d.max_masked_tokens_per_pack)
        batches = self._normalise([batch] * plan.micro_batches_per_step) * plan.steps_per_call
        host = stack_host_batch(batches, num_steps=plan.steps_per_call,
                                gradient_accumulation=plan.gradient_accumulation,
                                num_replicas=plan.replicas_per_process)
        with no_profiler_scopes():
            self.training_model.compile(**host)
        return self.training_model

    def sync_to_host(self) -> None:
        """The trained weights into the host model (before checkpointing or host evaluation).

        ``copyWeightsToHostIfNeeded`` copies only when the device has newer weights and is safe
        in every state: a detached training executable already copied them when it detached
        (PopTorch refuses copies to or from a detached executable).
        """
        if self.training_model is not None and self.training_model.isCompiled():
            self.training_model.copyWeightsToHostIfNeeded()

    # -- training -----------------------------------------------------------------------------
    def _normalise(self, step_batches, model=None):
        """The step's global counts in every pack (kept if the loop already filled them)."""
        model = model or self.model
        if all(all(name in b for name in model.normalizer_fields) for b in step_batches):
            return step_batches
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        # Under PopRun the counts are summed over all instances.
        return step_normalizers(model, step_batches, all_reduce=torch.distributed.all_reduce if distributed else None)

    @staticmethod
    def _switch_to(executor, other) -> None:
        """Only one executable holds the IPUs. PopTorch's way to move between two: detach the
        other (a training executable copies its weights to the host as it detaches), attach this
        one (attaching uploads the host weights; a first call compiles and uploads instead).
        Weights are never copied to or from a detached executable: PopTorch refuses that."""
        if other is not None and other.isAttachedToDevice():
            other.detachFromDevice()
        if executor.isCompiled() and not executor.isAttachedToDevice():
            executor.attachToDevice()

    def train_step(self, micro_batches):
        n, num_steps = self.micro_batches_per_step, self.steps_per_call
        if len(micro_batches) != n * num_steps:
            raise ConfigError(f"train_step got {len(micro_batches)} micro-batches; the IPU path needs "
                              f"device_iterations x gradient_accumulation x replicas = {num_steps} x {n}")
        batches = []
        for s in range(num_steps):
            batches += self._normalise(micro_batches[s * n:(s + 1) * n])
        host = stack_host_batch(batches, num_steps=num_steps, gradient_accumulation=self.plan.gradient_accumulation,
                                num_replicas=self.plan.replicas_per_process)
        self._switch_to(self.training_model, self.inference_model)
        if self._pending_rng_state is not None:
            self._restore_rng_state(host)
        learning_rate = float(self.optimizer.param_groups[0]["lr"])
        with no_profiler_scopes():
            outputs = self.training_model(**host)
        per_step = self._step_metrics(outputs[1:], num_steps)
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # The host optimizer never steps (the device does), which torch's scheduler
                # would otherwise report as "scheduler.step() before optimizer.step()".
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                for _ in range(num_steps):
                    self.scheduler.step()
            pipeline.sync_learning_rates(self.host_optimizer, self.optimizer)
            self.training_model.setOptimizer(self.optimizer)
        for metrics in per_step:
            metrics["learning_rate"] = learning_rate
        return per_step if num_steps > 1 else per_step[0]

    def _step_metrics(self, outputs, num_steps) -> List[Dict[str, float]]:
        """Per-step metrics from the wrapper's outputs under the configured OutputMode.

        ``all``: one value per micro-batch in [step, GA, replica] order -> sum each step's.
        ``sum``: per replica, summed over steps and accumulation -> the call's total; with
        several steps per call their mean is reported for each (the split is not returned).
        """
        values = {}
        for name, tensor in zip(metric_keys(self.model), outputs):
            flat = tensor.detach().double().reshape(-1)
            if self.settings.output_mode == "all":
                values[name] = flat.reshape(num_steps, -1).sum(dim=1).tolist()
            else:
                values[name] = [float(flat.sum()) / num_steps] * num_steps
        return [{name: values[name][s] for name in values} for s in range(num_steps)]

    # -- evaluation ---------------------------------------------------------------------------
    def _inference_options(self):
        """One replica, one step per call, every output returned, sharded (not pipelined)."""
        poptorch = self.poptorch
        opts = ipu_options.build_options(poptorch, self.settings, seed=self.plan.seed, training=False, popdist=None,
                                         popart=self.popart, device_iterations=1, replication_factor=1)
        opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.AutoStage.AutoIncrement))
        opts.outputMode(poptorch.OutputMode.All)
        return opts

    @torch.no_grad()
    def eval_step(self, batch):
        """Metrics of one micro-batch on one replica, forward only (its own executable).

        Sharded (not pipelined) execution: a pipelined inference run needs at least as many
        micro-batches as stages, and evaluation gets one.
        """
        poptorch = self.poptorch
        if self.inference_model is None:
            opts = self._inference_options()
            self.inference_model = poptorch.inferenceModel(pipeline.EvalWrapper(self.model), opts)
        batch = self._normalise([batch])[0]
        host = stack_host_batch([batch], num_steps=1, gradient_accumulation=1, num_replicas=1)
        self._switch_to(self.inference_model, self.training_model)
        was_training = self.model.training
        self.model.eval()
        try:
            with no_profiler_scopes():
                outputs = self.inference_model(**host)
        finally:
            self.model.train(was_training)
        return {name: float(t.double().sum()) for name, t in zip(metric_keys(self.model), outputs)}

    @torch.no_grad()
    def predict_step(self, batch, names=("logits",)):
        """The model's ``names`` outputs for one micro-batch (e.g. per-sequence logits), as float32
        numpy arrays: forward only on one replica, an executable of its own per set of names."""
        poptorch = self.poptorch
        executors = self.predict_models
        names = tuple(names)
        if names not in executors:
            opts = self._inference_options()
            executors[names] = poptorch.inferenceModel(pipeline.PredictWrapper(self.model, names), opts)
        executor = executors[names]
        host = stack_host_batch([batch], num_steps=1, gradient_accumulation=1, num_replicas=1)
        self._switch_to(executor, self.training_model)
        self._switch_to(executor, self.inference_model)
        was_training = self.model.training
        self.model.eval()
        try:
            with no_profiler_scopes():
                outputs = executor(**host)
        finally:
            self.model.train(was_training)
            if executor.isAttachedToDevice():  # free the IPUs: training re-attaches its own executable
                executor.detachFromDevice()
        return {name: t.detach().float().numpy() for name, t in zip(names, outputs)}

    # -- profiling ----------------------------------------------------------------------------
    def profile(self, model, batch, *, num_repeats: int = 5, profile_dir: Optional[str] = None,
                config=None) -> Dict[str, Any]:
        """Cycles of one micro-batch forward+backward of ``model`` on ``batch`` (one replica).

        Through the IPU path: options with ``logCycleCount(True)``, the pipeline annotations, one
        run of the smallest accumulation the pipeline accepts (2 x stages - 1 micro-batches, the
        same ``batch`` repeated), ``cycleCount()`` divided by the micro-batches of the run. On
        the mock with a model on the meta device (nothing to execute) the same cost model is
        asked directly with the same shapes and layout.
        """
        config = config or Config()
        ipu = config.ipu
        ga = 2 * len(pipeline.forward_stage_ipus(ipu.layers_per_ipu)) - 1
        precision = "fp16" if ipu.half_precision else "fp32"
        on_meta = any(p.is_meta for p in model.parameters())
        result = {"unit": self.cost_unit}
        if profile_dir:
            result["profile_dir"] = profile_dir
        if on_meta:
            if not self.prices_from_shapes:
                raise ConfigError("profile() needs a model with real weights on IPU hardware (got the meta device)")
            signature = [(f"kwargs[{name!r}]", tuple(np.asarray(v).shape), None) for name, v in batch.items()]
            estimate = estimate_run_cycles({
                "model": model, "signature": signature, "pipeline": None, "training": True,
                "device_iterations": 1, "gradient_accumulation": 1, "layers_per_ipu": list(ipu.layers_per_ipu),
                "precision": precision})
            result.update(cost=float(estimate["total"]), breakdown=estimate["breakdown"], cycle_count_logged=False)
            return result
        # A copy: the annotations and casts below must not leak into the caller's model.
        model = annotate(copy.deepcopy(model), ipu, self.poptorch)
        opts = ipu_options.build_options(self.poptorch, ipu, seed=config.train.seed, gradient_accumulation=ga,
                                         training=True, popdist=None, popart=self.popart, log_cycle_count=True,
                                         profile_dir=profile_dir, device_iterations=1, replication_factor=1)
        optimizer = self.poptorch.optim.SGD(model.parameters(), lr=0.0)  # measure, don't train
        executor = self.poptorch.trainingModel(pipeline.TrainingWrapper(model, self.poptorch), opts, optimizer=optimizer)
        batch = self._normalise([dict(batch)], model)[0]
        host = stack_host_batch([batch] * ga, num_steps=1, gradient_accumulation=ga, num_replicas=1)
        costs = []
        try:
            for _ in range(max(1, num_repeats)):
                with no_profiler_scopes():
                    executor(**host)
                costs.append(executor.cycleCount() / ga)
        finally:
            executor.destroy()
        result.update(cost=float(np.median(costs)), breakdown=None, cycle_count_logged=True)
        if self.prices_from_shapes:  # the mock: its cycle count came from the cost model
            info = dict(executor._last_run_info, precision=precision)
            result["breakdown"] = estimate_run_cycles(info)["breakdown"]
        return result

    def profile_options(self, config, output_dir: str) -> Dict[str, Any]:
        # PopVision reports (engine option autoReport.directory) go next to the report.
        return {"config": config, "profile_dir": os.path.join(output_dir, "popvision")}

    def cost_scope(self, config) -> Optional[str]:
        ipu = config.ipu
        if len(ipu.layers_per_ipu) == 1:
            return None
        # The IPU's throughput is set by its slowest pipeline stage, so that is what is priced.
        return (f"Pipelined over {len(ipu.layers_per_ipu)} IPUs (layers_per_ipu {ipu.layers_per_ipu}): "
                "costs and breakdown are the bottleneck stage's, per micro-batch. Mask construction and loss "
                "unpacking run on IPU 0 with the embeddings and heads; where IPU 0 is not the bottleneck they "
                "cost no throughput and show as 0 %.")


INSTALL_HINT = ("poptorch is not installed: install the Poplar SDK (graphcore.ai/downloads), "
                "`source <sdk>/enable.sh` and `pip install <sdk>/poptorch-*.whl` (torch 2.0.1), "
                "or run the same code path without IPUs with --backend mock")


def _import_poptorch():
    try:
        import poptorch
    except ImportError:
        return None
    return poptorch


class IPUBackend(PopTorchBackend):
    """``--backend ipu``: the real PopTorch. Its name "ipu" and cost unit "cycles" come from PopTorchBackend."""

    @staticmethod
    def is_available(config=None) -> bool:
        poptorch = _import_poptorch()
        return poptorch is not None and bool(poptorch.ipuHardwareIsAvailable())

    @classmethod
    def unavailable_reason(cls, config=None) -> str:
        if _import_poptorch() is None:
            return INSTALL_HINT
        return "poptorch is installed but no IPU is visible (check `gc-info -l`); use --backend mock"

    def __init__(self) -> None:
        poptorch = _import_poptorch()
        if poptorch is None:
            raise ConfigError(INSTALL_HINT)
        try:
            import popart
        except ImportError:
            popart = None  # only used for enum values; the ints are the fallback
        super().__init__(poptorch=poptorch, popart=popart, popdist=ipu_options.import_popdist())
