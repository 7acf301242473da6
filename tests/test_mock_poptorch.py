"""The IPU-free poptorch mock behaves like PopTorch where it matters (research/poptorch-api.md §0, §9).

Each test states the PopTorch behaviour it checks; expected values are computed independently
with plain torch, never by the mock.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu.mock_poptorch as poptorch


class Toy(nn.Module):
    """Linear regression with an MSE loss: outputs (prediction [mb], loss scalar)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1, bias=False)

    def forward(self, x, y):
        out = self.lin(x).squeeze(-1)
        return out, F.mse_loss(out, y)


def options(di=1, rf=1, ga=1):
    opts = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    return opts


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, generator=g)


# -- options ------------------------------------------------------------------------------------

def test_setters_return_self_and_values_read_back():
    opts = poptorch.Options()
    assert opts.deviceIterations(3) is opts
    assert opts.replicationFactor(2).autoRoundNumIPUs(True) is opts
    assert opts.Training.gradientAccumulation(5) is opts.Training
    assert opts.Precision.enableStochasticRounding(True) is opts.Precision
    assert (opts.device_iterations, opts.replication_factor, opts.Training.gradient_accumulation) == (3, 2, 5)
    settings = poptorch.TensorLocationSettings()
    assert settings.useOnChipStorage(False).useReplicatedTensorSharding(True) is settings


def test_defaults_are_poptorchs():
    opts = poptorch.Options()
    assert (opts.device_iterations, opts.replication_factor, opts.Training.gradient_accumulation) == (1, 1, 1)
    assert opts.output_mode == poptorch.OutputMode.Default
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Mean


def test_options_freeze_after_use_by_an_executor_and_a_dataloader():
    opts = options()
    poptorch.trainingModel(Toy(), opts)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.deviceIterations(2)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.Training.gradientAccumulation(2)
    loader_opts = options()
    poptorch.DataLoader(loader_opts, torch.utils.data.TensorDataset(*data(8)), batch_size=2)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        loader_opts.replicationFactor(2)
    assert opts.clone()._is_frozen


def test_options_reject_unknown_keys_wrong_types_and_bad_reductions():
    opts = poptorch.Options()
    with pytest.raises(AttributeError, match="Invalid option"):
        opts.set(no_such_option=1)
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.deviceIterations("2")
    with pytest.raises(ValueError):
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.NoReduction)
    with pytest.raises(ValueError):
        opts.outputMode(poptorch.OutputMode.EveryN)  # needs a period


# -- batching -----------------------------------------------------------------------------------

def test_host_batch_must_be_a_multiple_of_di_rf_ga():
    model = poptorch.trainingModel(Toy(), options(di=2, rf=2, ga=3))
    x, y = data(2 * 2 * 3 * 2 + 1)
    with pytest.raises(poptorch.Error, match=r"Invalid batch dimension.*= 12"):
        model(x, y)


class Recorder(nn.Module):
    """Records the first feature of every row it sees, per forward call (= per micro-batch)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen = []

    def forward(self, x):
        self.seen.append(x[:, 0].tolist())
        return poptorch.identity_loss((x * self.w).sum(), reduction="none")


def test_host_batch_is_split_in_poptorch_order_di_ga_rf_mb():
    di, ga, rf, mb = 2, 3, 2, 2
    model = Recorder()
    wrapped = poptorch.trainingModel(model, options(di, rf, ga), optimizer=poptorch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.arange(di * ga * rf * mb, dtype=torch.float32)[:, None].repeat(1, 2)
    wrapped(x)
    runs = model.seen[1:]  # the first forward is the compile trace (micro-batch 0)
    expected = [[float(((i * ga + g) * rf + r) * mb + m) for m in range(mb)]
                for i in range(di) for g in range(ga) for r in range(rf)]
    assert runs == expected


# -- training semantics -------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["Mean", "Sum"])
def test_one_update_per_accumulation_with_gradients_reduced_over_replicas(reduction):
    di, ga, rf, mb, lr = 2, 3, 2, 2, 0.1
    model = Toy()
    reference = copy.deepcopy(model)
    opts = options(di, rf, ga)
    opts.Training.accumulationAndReplicationReductionType(getattr(poptorch.ReductionType, reduction))
    optimizer = poptorch.optim.SGD(model.parameters(), lr=lr)
    calls = []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    x, y = data(di * ga * rf * mb)
    poptorch.trainingModel(model, opts, optimizer=optimizer)(x, y)
    assert len(calls) == di  # one update per device iteration = per gradient accumulation

    # Plain torch: micro-batch (i, g, r) is row block ((i*ga + g)*rf + r); per iteration the
    # gradients of its ga*rf micro-batches are summed (Sum) or averaged (Mean), then one SGD step.
    xs, ys = x.view(di, ga, rf, mb, 3), y.view(di, ga, rf, mb)
    for i in range(di):
        reference.zero_grad()
        for g in range(ga):
            for r in range(rf):
                F.mse_loss(reference.lin(xs[i, g, r]).squeeze(-1), ys[i, g, r]).backward()
        with torch.no_grad():
            for p in reference.parameters():
                grad = p.grad / (ga * rf) if reduction == "Mean" else p.grad
                p -= lr * grad
    torch.testing.assert_close(model.lin.weight, reference.lin.weight, rtol=0, atol=1e-6)


def test_lamb_matches_a_plain_torch_transcription_of_popart_lamb():
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(4, 3))
    grads = [torch.randn(4, 3) for _ in range(3)]
    opt = poptorch.optim.LAMB([w], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, max_weight_norm=1.0)
    ref, m, v = w.detach().clone(), torch.zeros(4, 3), torch.zeros(4, 3)
    for t, g in enumerate(grads, 1):
        w.grad = g.clone()
        opt.step()
        m, v = 0.8 * m + 0.2 * g, 0.9 * v + 0.1 * g * g
        u = (m / (1 - 0.8 ** t)) / ((v / (1 - 0.9 ** t)).sqrt() + 1e-6) + 0.1 * ref
        ref = ref - 0.01 * (min(ref.norm().item(), 1.0) / u.norm().item()) * u
    torch.testing.assert_close(w.detach(), ref, rtol=0, atol=1e-6)


def test_device_keeps_old_hyperparameters_until_set_optimizer():
    model = Toy()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0)
    wrapped = poptorch.trainingModel(model, options(), optimizer=optimizer)
    x, y = data(2)
    wrapped(x, y)
    before = model.lin.weight.detach().clone()
    optimizer.param_groups[0]["lr"] = 0.5  # host change only: PopTorch needs setOptimizer
    wrapped(x, y)
    torch.testing.assert_close(model.lin.weight.detach(), before, rtol=0, atol=0)
    wrapped.setOptimizer(optimizer)
    wrapped(x, y)
    assert not torch.equal(model.lin.weight.detach(), before)


# -- outputs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, period", [("All", None), ("EveryN", 2), ("Final", None), ("Sum", None)])
def test_outputs_per_output_mode(mode, period):
    di, ga, rf, mb = 2, 2, 2, 3
    model = Toy()
    opts = options(di, rf, ga).outputMode(getattr(poptorch.OutputMode, mode), period)
    wrapped = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.0))
    x, y = data(di * ga * rf * mb)
    out, loss = wrapped(x, y)
    with torch.no_grad():  # lr = 0: every micro-batch sees the initial weights
        preds = model.lin(x).squeeze(-1).view(di * ga, rf, mb)
        losses = ((preds - y.view(di * ga, rf, mb)) ** 2).mean(-1)  # [runs, rf]
    if mode == "All":
        expected_out, expected_loss = preds.reshape(-1), losses.reshape(-1)
    elif mode == "EveryN":
        expected_out, expected_loss = preds[1::2].reshape(-1), losses[1::2].reshape(-1)
    elif mode == "Final":
        expected_out, expected_loss = preds[-1].reshape(-1), losses[-1]
    else:
        expected_out, expected_loss = preds.sum(0).reshape(-1), losses.sum(0)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)


def test_scalar_output_stays_0d_when_one_value_per_run_and_long_becomes_int32():
    class CountModel(Toy):
        def forward(self, x, y):
            out, loss = super().forward(x, y)
            return loss, (x[:, 0] > 0).long().sum()

    wrapped = poptorch.trainingModel(CountModel(), options(di=1, rf=1, ga=2))
    loss, count = wrapped(*data(4))
    assert loss.dim() == 0 and count.dim() == 0  # Final: the last micro-batch, b_dim = 1
    assert count.dtype == torch.int32


def test_backward_on_outputs_raises():
    _, loss = poptorch.trainingModel(Toy(), options())(*data(2))
    with pytest.raises(poptorch.Error, match="backward\\(\\) cannot be called explicitly"):
        loss.backward()


# -- exactly one loss ---------------------------------------------------------------------------

def test_no_loss_is_an_error():
    class NoLoss(Toy):
        def forward(self, x, y):
            return (self.lin(x).squeeze(-1) - y).pow(2).mean()

    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        poptorch.trainingModel(NoLoss(), options())(*data(2))


def test_two_independent_losses_are_an_error_unless_wrapped_in_identity_loss():
    class TwoLosses(Toy):
        wrap = False

        def forward(self, x, y):
            out = self.lin(x).squeeze(-1)
            total = F.mse_loss(out, y) + F.l1_loss(out, y)
            return poptorch.identity_loss(total, reduction="none") if self.wrap else total

    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph. Graph must have one "
                                             "final loss. Wrap final graph loss in poptorch.identity_loss."):
        poptorch.trainingModel(TwoLosses(), options())(*data(2))
    model = TwoLosses()
    model.wrap = True
    loss = poptorch.trainingModel(model, options())(*data(2))
    assert torch.isfinite(loss)


def test_wrapping_twice_and_changing_inputs_are_errors():
    model = Toy()
    wrapped = poptorch.trainingModel(model, options())
    with pytest.raises(RuntimeError, match="already been wrapped"):
        poptorch.trainingModel(model, options())
    wrapped(*data(2))
    with pytest.raises(poptorch.Error, match="don't match the inputs used to compile"):
        wrapped(*data(4))
    wrapped.destroy()
    poptorch.trainingModel(model, options())  # allowed again after destroy()


def test_inference_rejects_gradient_accumulation_and_returns_all_by_default():
    with pytest.raises(poptorch.Error, match="gradientAccumulation to 1 for inference"):
        poptorch.inferenceModel(Toy(), options(ga=2))
    out, _ = poptorch.inferenceModel(Toy(), options(di=2, rf=2))(*data(8))
    assert out.shape == (8,)


# -- pipeline annotations ----------------------------------------------------------------------

class Staged(nn.Module):
    """Four linear layers, each a block on ``ipus[i]``, plus a loss."""

    def __init__(self, ipus):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in ipus)
        for i, (layer, ipu) in enumerate(zip(self.layers, ipus)):
            poptorch.BeginBlock(layer, f"L{i}", ipu_id=ipu)

    def forward(self, x, y):
        for layer in self.layers:
            x = poptorch.recomputationCheckpoint(layer(x))
        return F.mse_loss(x.sum(-1), y)


def pipelined(auto_stage=poptorch.AutoStage.SameAsIpu, **kwargs):
    opts = options(**kwargs)
    return opts.setExecutionStrategy(poptorch.PipelinedExecution(auto_stage))


def test_stages_are_recorded_and_merged_per_ipu():
    wrapped = poptorch.trainingModel(Staged([0, 0, 1, 0]), pipelined(poptorch.AutoStage.AutoIncrement, ga=5))
    wrapped(*data(5))
    plan = wrapped.pipeline
    assert [(b, i) for b, i, _ in plan["blocks"]] == [("L0", 0), ("L1", 0), ("L2", 1), ("L3", 0)]
    assert plan["stage_ipus"] == [0, 1, 0] and plan["num_stages"] == 3
    assert plan["num_ipus_per_replica"] == 2 and plan["num_recomputation_checkpoints"] == 4


def test_stages_must_ascend():
    # SameAsIpu: stage = ipu, so returning to IPU 0 after IPU 1 is an out-of-order stage.
    with pytest.raises(poptorch.Error, match="Pipeline stages must be in ascending order"):
        poptorch.trainingModel(Staged([0, 1, 0]), pipelined(ga=5))(*data(5))


def test_pipeline_depth_needs_enough_accumulation():
    # 2 forward stages -> 3 in training (forward + backward, merged at the turn).
    with pytest.raises(poptorch.Error, match=r"must equal at least the number of pipeline stages \(3\)"):
        poptorch.trainingModel(Staged([0, 1]), pipelined(ga=2))(*data(2))
    poptorch.trainingModel(Staged([0, 1]), pipelined(ga=3))(*data(3))


def test_ipu_count_must_be_a_power_of_two_unless_auto_rounded():
    with pytest.raises(poptorch.Error, match="must be a power of two"):
        poptorch.trainingModel(Staged([0, 1, 2]), pipelined(ga=5))(*data(5))
    opts = pipelined(ga=5).autoRoundNumIPUs(True)
    wrapped = poptorch.trainingModel(Staged([0, 1, 2]), opts)
    wrapped(*data(5))
    assert wrapped.pipeline["num_ipus"] == 4


def test_no_more_ipus_than_the_system_or_a_replica_has(monkeypatch):
    monkeypatch.setenv("MOCK_POPTORCH_NUM_IPUS", "4")
    with pytest.raises(poptorch.Error, match="Failed to acquire 8 IPUs"):
        poptorch.trainingModel(Staged([0, 1, 2, 3]), pipelined(ga=7, rf=2))(*data(14))
    opts = pipelined(ga=3)
    opts.createOrSet(ipus_per_replica=1)  # what popdist.poptorch.Options(ipus_per_replica=1) records
    with pytest.raises(poptorch.Error, match="each replica has only 1 IPUs"):
        poptorch.trainingModel(Staged([0, 1]), opts)(*data(3))


def test_block_annotation_errors():
    layer = nn.Linear(2, 2)
    poptorch.BeginBlock(layer, "A", ipu_id=0)
    with pytest.raises(poptorch.Error, match="already been assigned to a block"):
        poptorch.BeginBlock(layer, "B", ipu_id=1)
    with pytest.raises(poptorch.Error, match="has no ipu_id"):
        poptorch.trainingModel(Staged([None]), pipelined())(*data(1))
    with pytest.raises(ValueError, match="All inputs must be tensors"):
        poptorch.recomputationCheckpoint(torch.ones(1), 2)


def test_annotated_model_runs_eagerly_outside_an_executor():
    model = Staged([0, 1])
    x, y = data(4)
    assert torch.isfinite(model(x, y))  # BeginBlock hooks are no-ops on the CPU
    assert not poptorch.isRunningOnIpu()


# -- cycle counts -------------------------------------------------------------------------------

def test_cycle_count_needs_log_cycle_count_and_a_run():
    wrapped = poptorch.trainingModel(Toy(), options())
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled"):
        wrapped.cycleCount()
    wrapped = poptorch.trainingModel(Toy(), options().logCycleCount(True))
    with pytest.raises(poptorch.Error, match="Please run the model at least once"):
        wrapped.cycleCount()


def test_cycle_count_is_the_installed_estimate(monkeypatch):
    seen = []
    monkeypatch.setattr(poptorch.executor, "_cycle_estimator", lambda info: seen.append(info) or 1234)
    wrapped = poptorch.trainingModel(Toy(), options(di=2, ga=3).logCycleCount(True))
    wrapped(*data(12))
    assert wrapped.cycleCount() == 1234
    assert seen[0]["device_iterations"] == 2 and seen[0]["gradient_accumulation"] == 3


def test_no_hardware_claims():
    assert poptorch.ipuHardwareIsAvailable() is False
    with pytest.raises(poptorch.Error):
        poptorch.ipuHardwareVersion()


@pytest.mark.parametrize("accum_type, finite", [(torch.float32, True), (torch.float16, False)])
def test_gradients_accumulate_in_the_optimizers_accum_type(accum_type, finite):
    # fp16 weights, loss scaling 30000: one micro-batch's gradient fits fp16 (max 65504), the
    # sum of four does not; PopART accumulates in accum_type, and so does the mock.
    model = Toy().half()
    with torch.no_grad():
        model.lin.weight.fill_(0.5)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=30000.0, accum_type=accum_type)
    wrapped = poptorch.trainingModel(model, options(ga=4), optimizer=optimizer)
    x = torch.full((4, 3), 0.5, dtype=torch.half)
    y = torch.zeros(4, dtype=torch.half)
    grads = []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (grads.append(model.lin.weight.grad.clone()), step(*a, **k))[1]
    wrapped(x, y)
    # d/dw mean((0.75)^2) per row = 2 * 0.75 * 0.5 = 0.75 per input; Mean over 4 micro-batches = 0.75.
    if finite:
        torch.testing.assert_close(grads[0].float(), torch.full((1, 3), 0.75), rtol=1e-3, atol=0)
    else:
        assert not torch.isfinite(grads[0]).all()
