"""The layer reports of the backends that run a micro-batch eagerly on the host (issue 49, item
4): ``Backend.layer_done`` in the order the layers run, only in training, never in a compiled
graph, and without changing a number of the step."""
import numpy as np
import pytest
import torch

from backends import get_backend
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.config import load_config
from bert_packed.tasks.pretraining.data import build_data_source
from bert_packed.loop.plan import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

LAYERS = 3


def _prepared(name, overrides=(), seed=0):
    config = load_config("tiny", [f"model.num_hidden_layers={LAYERS}", f"ipu.layers_per_ipu=[{LAYERS}]",
                                  "train.gradient_accumulation=2", *overrides])
    torch.manual_seed(seed)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (config.optimizer.beta1, config.optimizer.beta2))
    backend = get_backend(name)
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    batches = iter(build_data_source(config, micro_batch_size=4))
    return backend, model, [next(batches) for _ in range(2)]


def _recorded(backend):
    calls = []
    backend.layer_hook = lambda phase, index, count: calls.append((phase, index, count))
    return calls


def _layers(calls):
    """The calls, each layer's repeats (one per part of it) merged."""
    return [call for i, call in enumerate(calls) if i == 0 or call != calls[i - 1]]


def _micro_batch(phase_first="forward"):
    return ([(phase_first, i, LAYERS) for i in range(LAYERS)] if phase_first == "trace" else
            [("forward", i, LAYERS) for i in range(LAYERS)] + [("backward", i, LAYERS) for i in reversed(range(LAYERS))])


def test_the_cpu_backend_reports_each_layer_of_forward_and_backward_and_none_in_evaluation():
    backend, _, batches = _prepared("cpu")
    calls = _recorded(backend)
    backend.eval_step(batches[0])
    assert calls == []
    backend.train_step(batches)
    assert _layers(calls) == _micro_batch() * 2
    # Inside a layer too, before each of its parts (attention, intermediate, output), both ways.
    assert calls.count(("forward", 1, LAYERS)) == 2 * 4 and calls.count(("backward", 1, LAYERS)) >= 2 * 3


def test_the_mock_reports_its_compile_trace_then_each_layer():
    backend, _, batches = _prepared("mock")
    calls = _recorded(backend)
    backend.train_step(batches)
    assert _layers(calls) == _micro_batch("trace") + _micro_batch() * 2
    del calls[:]
    backend.eval_step(batches[0])
    backend.train_step(batches)  # compiled: no trace any more
    assert _layers(calls) == _micro_batch() * 2


def test_a_compiled_step_gets_no_hooks():
    backend, model, _ = _prepared("cpu", ["cpu.compile=true", "model.attention_implementation=dense"])
    assert backend.layer_handles == []
    assert all(not part._forward_pre_hooks and not part._forward_hooks for part in model.bert.encoder.layer.modules())


def test_the_hooks_change_no_number_of_the_step():
    watched, model_a, batches = _prepared("cpu", ["model.hidden_dropout_prob=0.1"])
    plain, model_b, _ = _prepared("cpu", ["model.hidden_dropout_prob=0.1"])
    for handle in plain.layer_handles:
        handle.remove()
    _recorded(watched)
    torch.manual_seed(1)
    a = watched.train_step(batches)
    torch.manual_seed(1)
    b = plain.train_step(batches)
    assert [float(a[k]) for k in ("loss", "mlm_loss", "grad_norm")] == [float(b[k]) for k in ("loss", "mlm_loss",
                                                                                              "grad_norm")]
    assert all(torch.equal(x, y) for x, y in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert np.isfinite(float(a["loss"]))


def _hooked(model):
    return any(part._forward_pre_hooks or part._forward_hooks for part in model.bert.encoder.layer.modules())


def test_after_a_short_first_micro_batch_the_hooks_remove_themselves(monkeypatch):
    import bert_packed.loop.within_step as within_step
    from bert_packed.loop.within_step import StepWatch

    class NoStop:
        signum = None

    for seconds, kept in ((60.0, False), (0.0, True)):  # a tiny model's micro-batch: milliseconds
        monkeypatch.setattr(within_step, "LAYERS_FROM_SECONDS", seconds)
        backend, model, batches = _prepared("cpu")
        watch = StepWatch(None, NoStop(), total_steps=2, can_abandon=True)
        backend.micro_batch_hook, backend.layer_hook = watch, watch.layer
        watch.start(1, 1, len(batches))
        backend.train_step(batches)
        assert _hooked(model) == kept
    backend, model, batches = _prepared("cpu")  # no loop listening: removed at the first report
    backend.train_step(batches)
    assert not _hooked(model)
