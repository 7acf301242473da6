"""A new user's first hour (issue 38): progress and a duration estimate inside a long step, a
stop signal honoured mid-step (the partial step dropped, the resume exact), the logged learning
rate is the one the step used."""
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

import bert_packed.loop.within_step as within_step
from backends.cpu import CPUBackend
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.config import load_config
from bert_packed.loop.stops import Interrupted
from bert_packed.loop.within_step import StepWatch, duration_text
from bert_packed.loop.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
# A tiny model with 4 micro-batches per step, checkpoints every 2 steps.
ACCUMULATING = ["train.steps=6", "train.gradient_accumulation=4", "train.packing_adjustment=none",
                "train.micro_batch_size=4", "train.checkpoint_every=2", "data.num_sequences=300",
                "data.num_eval_sequences=60", "data.packing_algorithm=lpfhp", "optimizer.warmup_fraction=0.5"]
KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "sequences", "tokens", "learning_rate", "grad_norm")


def _lines(directory):
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


class SignalledMidStep(CPUBackend):
    """Sends itself ``signum`` after micro-batch ``index`` (0-based) of call ``call`` (1-based)."""

    def __init__(self, call, index, signum=signal.SIGTERM):
        super().__init__()
        self.call, self.index, self.signum, self.calls = call, index, signum, 0

    def train_step(self, micro_batches):
        self.calls += 1
        return super().train_step(micro_batches)

    def micro_batch_done(self, index, count):
        if self.calls == self.call and index == self.index:
            os.kill(os.getpid(), self.signum)  # the handler runs before the next line
        super().micro_batch_done(index, count)


def test_a_stop_mid_step_drops_the_step_and_the_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(within_step, "ABANDON_FROM_SECONDS", 0.0)  # every step counts as long
    config = load_config("tiny", ACCUMULATING)
    train(config, CPUBackend(), output_dir=str(tmp_path / "full"), show_progress=False)
    cut = tmp_path / "cut"
    with pytest.raises(Interrupted) as stopped:
        train(config, SignalledMidStep(call=5, index=1), output_dir=str(cut), show_progress=False)
    assert stopped.value.exit_code == 143
    assert str(stopped.value) == (f"SIGTERM during step 5 of 6, after micro-batch 2 of 4: the unfinished step was "
                                  f"dropped; the checkpoint {cut / CHECKPOINT_NAME} (step 4) is kept: --resume "
                                  f"continues from step 5")
    assert load_checkpoint(str(cut / CHECKPOINT_NAME))["step"] == 4
    summary = json.loads((cut / "summary.json").read_text())
    assert (summary["status"], summary["last_step"], summary["checkpoint_step"]) == ("interrupted", 4, 4)
    assert [line["step"] for line in _lines(cut)] == [1, 2, 3, 4]
    train(config, CPUBackend(), output_dir=str(cut), resume=True, show_progress=False)
    full, resumed = _lines(tmp_path / "full"), _lines(cut)
    assert [line["step"] for line in resumed] == list(range(1, 7))
    assert [[line[k] for k in KEYS] for line in full] == [[line[k] for k in KEYS] for line in resumed]
    a, b = (load_checkpoint(str(tmp_path / name / CHECKPOINT_NAME)) for name in ("full", "cut"))
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_stop_near_the_end_of_a_fast_step_finishes_it_with_a_checkpoint(tmp_path):
    """A step with little left is finished (today's step-boundary stop): nothing is lost."""
    config = load_config("tiny", ACCUMULATING)
    with pytest.raises(Interrupted) as stopped:
        train(config, SignalledMidStep(call=3, index=1), output_dir=str(tmp_path), show_progress=False)
    assert stopped.value.exit_code == 143
    assert load_checkpoint(str(tmp_path / CHECKPOINT_NAME))["step"] == 3
    assert str(stopped.value).startswith("SIGTERM at step 3 of 6: checkpoint")


def test_sigterm_stops_a_long_step_within_seconds_from_the_command_line(tmp_path):
    """run.py with a step of 3,000 micro-batches (~30 s on a busy CPU): SIGTERM a
    second into it ends the run in seconds with 143 and one line; nothing is checkpointed."""
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "run.py"), "--config", "tiny", "--set", "data.num_sequences=300",
         "--set", "data.num_eval_sequences=60", "--set", "data.packing_algorithm=lpfhp",
         "--set", "train.micro_batch_size=4", "--set", "train.packing_adjustment=none",
         "--set", "train.gradient_accumulation=3000", "--steps", "3", "--output-dir", str(out)],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = process.stdout.readline()  # the opening line: the loop is about to start
    assert first.startswith("training tiny on cpu x1: 3 steps of 3000 x 4 packs"), first
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = process.wait(timeout=60)
    waited = time.monotonic() - sent
    stderr = process.stderr.read().strip().splitlines()
    assert code == 143, stderr
    assert waited < 10, waited
    # While its 3000 micro-batches are read (seconds on a busy host), between micro-batches, or inside one
    # between its layers ("in micro-batch 1 of 3000 (forward, layer 2 of 2)").
    assert stderr[-1].startswith(tuple(f"stopped: SIGTERM during step 1 of 3, {where}" for where in (
        "while its micro-batches were read ", "after micro-batch ", "in micro-batch "))), stderr
    assert stderr[-1].endswith("the unfinished step was dropped; no checkpoint was written yet: a new run starts "
                               "from step 1"), stderr
    assert not (out / CHECKPOINT_NAME).exists()
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


class SlowMicroBatches(CPUBackend):
    """Every micro-batch takes 20 ms longer: a slow step in a fraction of a second."""

    def micro_batch_done(self, index, count):
        time.sleep(0.02)
        super().micro_batch_done(index, count)


def test_progress_inside_a_slow_step_on_a_pipe(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(within_step, "LINE_EVERY_SECONDS", 0.1)
    monkeypatch.setattr(within_step, "ESTIMATE_FROM_SECONDS", 0.2)
    config = load_config("tiny", ACCUMULATING + ["train.gradient_accumulation=20", "train.steps=2"])
    train(config, SlowMicroBatches(), output_dir=str(tmp_path), show_progress=True)
    # (Without the layer lines a micro-batch slower than a progress interval gets: "..., layer k of n, ...".)
    out = [line for line in capsys.readouterr().out.splitlines() if ", layer " not in line]
    assert out[0].startswith("training tiny on cpu x1: 2 steps of 20 x 4 packs")
    assert out[1].startswith("step 1: micro-batch 1 of 20 took "), out  # the estimate, right after it
    assert "per step, run ~" in out[1] and out[1].endswith("for the 2 steps left at this rate")
    within = [line for line in out if line.startswith("step 1: micro-batch ") and " so far, ~" in line]
    assert within, out  # progress lines inside step 1, before its step line
    assert out.index(within[0]) < next(i for i, line in enumerate(out) if line.startswith("step     1/2 |"))


def test_no_estimate_or_progress_lines_for_a_fast_run(tmp_path, capsys):
    config = load_config("tiny", ACCUMULATING + ["train.steps=2"])
    train(config, CPUBackend(), output_dir=str(tmp_path), show_progress=True)
    assert not [line for line in capsys.readouterr().out.splitlines() if "micro-batch" in line]


class FakeStop:
    signum = None


def test_step_watch_estimate_and_lines_on_a_fake_clock():
    now = [0.0]
    lines = []
    watch = StepWatch(lines.append, FakeStop(), total_steps=2137, can_abandon=True, clock=lambda: now[0])
    watch.start(1, 1)
    now[0] = 2.8
    watch(0, 4096)
    assert lines == ["step 1: micro-batch 1 of 4096 took 2.8 s: ~3 h 11 min per step, run ~6,800 h for the "
                     "2137 steps left at this rate"]
    now[0] = 10.0
    watch(1, 4096)
    assert len(lines) == 1  # at most one line every LINE_EVERY_SECONDS
    now[0] = 20.0
    watch(5, 4096)
    assert lines[1] == "step 1: micro-batch 6/4096, 20 s so far, ~3 h 47 min left in this step"


def test_duration_text():
    assert [duration_text(s) for s in (0.042, 4.44, 59, 600, 3 * 3600 + 600, 6700 * 3600)] == [
        "0.04 s", "4.4 s", "59 s", "10 min", "3 h 10 min", "6,700 h"]


def test_the_logged_learning_rate_is_the_one_the_step_used(tmp_path):
    """Warm-up over 3 of 6 steps: step 1 runs at lr/3, and logs that (it logged 2 lr/3 before)."""
    config = load_config("tiny", ["train.steps=6", "optimizer.warmup_fraction=0.5", "train.micro_batch_size=4",
                                  "data.num_sequences=300", "data.num_eval_sequences=60"])
    used = []

    class Recording(CPUBackend):
        def optimizer_step(self):
            used.append(self.optimizer.param_groups[0]["lr"])
            super().optimizer_step()

    backend = Recording()
    train(config, backend, output_dir=str(tmp_path), show_progress=False)
    logged = [line["learning_rate"] for line in _lines(tmp_path)]
    assert logged == used
    schedule, base = backend.scheduler.lr_lambdas[0], backend.scheduler.base_lrs[0]
    assert logged == [base * schedule(step) for step in range(6)]
    assert logged[0] > 0.0


def test_question_answering_logs_span_accuracy_start_and_end_both_right():
    """QA logged ``accuracy 0.000`` with nothing saying what it was: it is the share of windows
    whose predicted start AND end are both the labelled ones, now named ``span_accuracy``."""
    from bert_packed.tasks.squad.model import BertForQuestionAnswering, span_loss_terms
    from bert_packed.model.losses import normalize

    assert BertForQuestionAnswering.metric_names == ("loss", "span_accuracy")
    # One pack of two windows: tokens 0-3 are window 1, 4-7 window 2.
    sequence_ids = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    start = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0]])  # argmax: column 1, column 6
    end = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 5.0]])  # argmax: column 2, column 7
    weights = torch.ones(1, 2)
    for starts, ends, expected in (([1, 6], [2, 7], 1.0), ([1, 6], [2, 6], 0.5), ([1, 4], [3, 6], 0.0)):
        terms = span_loss_terms(start, end, sequence_ids, torch.tensor([starts]), torch.tensor([ends]), weights)
        assert normalize(terms["correct_sum"], terms["count"], None).item() == expected


# ----------------------------------------------------------------------------- the estimate before a run

def test_phase2_on_a_cpu_is_said_to_take_hours_per_step_before_it_starts():
    from bert_packed.loop.estimate import slow_step_warning

    config = load_config("phase2")
    line = slow_step_warning(config, packs_per_step=8192, steps=2137, rate=lambda: 30e9, backend_name="mock")
    assert line == ("phase2 on mock: ~77 h 22 min per step, ~170,000 h for 2137 steps (estimated: 8192 packs of "
                    "1e+12 training FLOPs at ~30 GFLOP/s); for a first try make it small, e.g. --set "
                    "model.num_hidden_layers=2 --set model.hidden_size=128 --set model.num_attention_heads=2 --set "
                    "model.intermediate_size=512 --set train.gradient_accumulation=2 --steps 3")
    small = load_config("phase2", ["model.num_hidden_layers=2", "model.hidden_size=128", "model.num_attention_heads=2",
                                   "model.intermediate_size=512", "train.gradient_accumulation=2"])
    assert slow_step_warning(small, packs_per_step=4, steps=3, rate=lambda: 30e9, backend_name="cpu") is None
    assert slow_step_warning(config, packs_per_step=8192, steps=1, rate=lambda: None, backend_name="ipu") is None


class NoRate(CPUBackend):
    def compute_rate(self):
        raise AssertionError("a small step needs no measurement")


class SlowRate(CPUBackend):
    def compute_rate(self):
        return 1e6


def test_the_estimate_line_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import bert_packed.loop.estimate as estimate

    config = load_config("tiny", ACCUMULATING + ["train.steps=1"])
    train(config, NoRate(), output_dir=str(tmp_path / "fast"), show_progress=False)
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(estimate, "WARN_FROM_SECONDS", 0.01)
    summary = train(config, SlowRate(), output_dir=str(tmp_path / "slow"), show_progress=False)
    assert summary["status"] == "completed"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: tiny on cpu: ~") and " per step, ~" in warnings[0]
    assert warnings[0].endswith("--set train.gradient_accumulation=2 --steps 3")


def test_a_stop_mid_step_on_the_mock_drops_the_step_and_resumes_exactly(tmp_path, monkeypatch, sigint_to_the_code):
    """The mock runs the IPU path's micro-batches on the host and reports each one: the same stop."""
    from backends.mock import MockBackend

    class MockSignalledMidStep(MockBackend):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def train_step(self, micro_batches):
            self.calls += 1
            return super().train_step(micro_batches)

        def micro_batch_done(self, index, count):
            if self.calls == 3 and index == 0:
                os.kill(os.getpid(), signal.SIGINT)
            super().micro_batch_done(index, count)

    monkeypatch.setattr(within_step, "ABANDON_FROM_SECONDS", 0.0)
    config = load_config("tiny", ACCUMULATING + ["train.steps=4", "ipu.device_iterations=1"])
    train(config, MockBackend(), output_dir=str(tmp_path / "full"), show_progress=False)
    cut = tmp_path / "cut"
    with pytest.raises(Interrupted) as stopped:
        train(config, MockSignalledMidStep(), output_dir=str(cut), show_progress=False)
    assert stopped.value.exit_code == 130
    assert str(stopped.value).startswith("SIGINT during step 3 of 4, after micro-batch 1 of 4: the unfinished step "
                                         "was dropped; the checkpoint ")
    assert load_checkpoint(str(cut / CHECKPOINT_NAME))["step"] == 2
    train(config, MockBackend(), output_dir=str(cut), resume=True, show_progress=False)
    full, resumed = _lines(tmp_path / "full"), _lines(cut)
    keys = ("loss", "mlm_loss", "sequences", "learning_rate")
    assert [[line[k] for k in keys] for line in full] == [[line[k] for k in keys] for line in resumed]


def test_on_a_terminal_a_long_step_redraws_the_bar_status_instead_of_lines():
    now, lines, shown = [0.0], [], []
    watch = StepWatch(lines.append, FakeStop(), total_steps=10, can_abandon=True, status=shown.append,
                      clock=lambda: now[0])
    watch.start(1, 1)
    for index, at in enumerate((20.0, 20.5, 21.5, 23.0)):
        now[0] = at
        watch(index, 100)
    assert len(lines) == 1 and lines[0].startswith("step 1: micro-batch 1 of 100 took 20 s: ~33 min per step")
    assert shown == ["step 1: micro-batch 3/100, ~12 min left", "step 1: micro-batch 4/100, ~9 min left"]


# -- Item 4: the IPU layout from the checkpoint's depth; refusals with a working --set line ------


@pytest.fixture(scope="module")
def six_layer_job(tmp_path_factory):
    """A 6-layer checkpoint (transformers' save_pretrained) and small classification files."""
    transformers = pytest.importorskip("transformers")
    from finetune_fixtures import classification_rows, save_hf_checkpoint, write_rows, write_vocab

    directory = tmp_path_factory.mktemp("six")
    vocab = write_vocab(str(directory / "vocab"))
    save_hf_checkpoint(transformers, str(directory / "bert"), vocab, num_hidden_layers=6)
    columns = ["text", "pair", "label"]
    return {"checkpoint": str(directory / "bert"),
            "train": write_rows(str(directory / "train.csv"), classification_rows(60, 0), columns),
            "dev": write_rows(str(directory / "dev.csv"), classification_rows(20, 1), columns)}


def _mock_finetune(job, output, *extra):
    """run.main of a one-step mock fine-tuning run with no ipu overrides (unless ``extra``)."""
    import run

    return run.main(["--backend", "mock", "--config", "finetune_classification", "--init-checkpoint",
                     job["checkpoint"], "--set", f"finetune.train_file={job['train']}", "--set",
                     f"finetune.validation_file={job['dev']}", "--output-dir", str(output), "--no-progress",
                     "--steps", "1", "--set", "data.max_sequence_length=64", "--set", "train.eval_every=0",
                     "--set", "train.checkpoint_every=0", "--set", "train.hf_export=false",
                     "--set", "train.num_threads=1", *extra])


def test_spread_layers_follows_the_configured_layout():
    from ipu.config import spread_layers

    assert spread_layers(6, [3, 7, 7, 7]) == [0, 2, 2, 2]
    assert spread_layers(24, [3, 7, 7, 7]) == [3, 7, 7, 7]
    assert spread_layers(4, [3, 7, 7, 7]) == [1, 1, 1, 1]
    assert spread_layers(6, [0, 4, 4, 4]) == [0, 2, 2, 2]
    assert spread_layers(5, [0, 0]) == [2, 3]  # no weights: even, the extra layer on the later IPU
    for layers in range(1, 40):
        assert sum(spread_layers(layers, [2, 5, 5, 5, 5])) == layers


def test_mock_finetuning_from_a_six_layer_checkpoint_starts_without_ipu_overrides(six_layer_job, tmp_path, capsys):
    """The config's layout is BERT-Large's [3,7,7,7]; the checkpoint's 6 layers get one that fits
    (one IPU: the accumulation after packing is too small for a 4-stage pipeline), and say so."""
    assert _mock_finetune(six_layer_job, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "warning: ipu.layers_per_ipu=[6] for the checkpoint's 6 encoder layers" in err, err
    assert "warning: ipu.available_memory_proportion=[0.1], one per IPU of ipu.layers_per_ipu=[6]" in err, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["status"], summary["backend"], summary["last_step"]) == ("completed", "mock", 1)


def _suggested_sets(message):
    """The ``--set X`` pairs of a refusal's 'e.g.' part, split as a shell would."""
    import shlex

    words = shlex.split(message.split("e.g. ", 1)[1])
    assert words[0::2] == ["--set"] * (len(words) // 2) and len(words) % 2 == 0, words
    return words


def test_a_refused_layout_names_a_set_line_that_runs(six_layer_job, tmp_path, capsys):
    status = _mock_finetune(six_layer_job, tmp_path / "bad", "--set", "ipu.layers_per_ipu=[3,7,7,7]")
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("error: ipu.layers_per_ipu=[3, 7, 7, 7] sums to 24 but model.num_hidden_layers=6"), err
    words = _suggested_sets(err[0])
    assert words == ["--set", "ipu.layers_per_ipu=[6]", "--set", "ipu.available_memory_proportion=[0.1]"]
    assert _mock_finetune(six_layer_job, tmp_path / "good", "--set", "ipu.layers_per_ipu=[3,7,7,7]", *words) == 0


def test_a_refused_pretraining_layout_names_a_set_line_the_config_accepts(capsys):
    """No checkpoint: a --set depth keeps the config's layout, refused with one that validates
    (phase2's accumulation of 1024 holds a 4-IPU pipeline, so the IPU count stays)."""
    import run

    base = ["--config", "phase2", "--backend", "mock", "--set", "model.num_hidden_layers=4", "--print-config"]
    assert run.main(base) == 2
    err = capsys.readouterr().err.strip()
    words = _suggested_sets(err)
    assert words == ["--set", "ipu.layers_per_ipu=[1,1,1,1]"], err
    assert run.main(base + words) == 0
    assert "layers_per_ipu: [1, 1, 1, 1]" in capsys.readouterr().out


def test_a_one_ipu_layout_without_proportions_gets_one_proportion(capsys):
    """The config comment's recipe (--set ipu.layers_per_ipu=[2]) no longer fails on the four
    memory proportions of the default layout; a --set list of the wrong length names a fitting one."""
    import run

    base = ["--config", "phase2", "--backend", "mock", "--set", "model.num_hidden_layers=2", "--set",
            "ipu.layers_per_ipu=[2]", "--print-config"]
    assert run.main(base) == 0
    captured = capsys.readouterr()
    assert "available_memory_proportion: [0.1]" in captured.out
    assert "warning: ipu.available_memory_proportion=[0.1], one per IPU of ipu.layers_per_ipu=[2]" in captured.err
    assert run.main(base[:-1] + ["--set", "ipu.available_memory_proportion=[0.2,0.3]", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ('error: ipu.available_memory_proportion has 2 entries; give 1 or one per IPU (1), e.g. '
                   '--set "ipu.available_memory_proportion=[0.2]"'), err


# -- Item 7: small things -------------------------------------------------------------------------


def test_the_cuda_backend_on_a_cpu_says_it_trains_on_the_cpu(tmp_path, capsys):
    import run

    assert run.main(["--backend", "cuda", "--config", "tiny", "--set", "cuda.device=cpu",
                     "--set", "cuda.precision=fp32",
                     "--steps", "1", "--set", "train.eval_every=0", "--output-dir", str(tmp_path / "out")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("training tiny on cpu (backend cuda) x1: 1 steps of "), first
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["backend"] == "cuda"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture()
def small_histogram(tmp_path):
    path = tmp_path / "hist.json"
    counts = [0] * 64
    for length, count in ((3, 40), (10, 25), (30, 30), (33, 20), (60, 12), (64, 5)):
        counts[length - 1] = count
    path.write_text(json.dumps({"max_sequence_length": 64, "counts": counts}))
    return str(path)


@pytest.mark.parametrize("command", ["bench", "plot"])
def test_packing_bench_and_plot_show_their_stages_on_a_terminal_only(command, small_histogram, tmp_path, monkeypatch,
                                                                     capsys):
    """`python -m packing bench|plot` take half a minute at full size: a bar of their stages on a
    terminal's stderr, nothing on a pipe (the output itself is unchanged)."""
    from packing.cli import main

    argv = [command, "--histogram", small_histogram] + (
        ["--quick", "--repeats", "1", "--num-sequences", "200"] if command == "bench" else
        ["--output", str(tmp_path / "png")])
    assert main(argv) in (0, None)
    piped = capsys.readouterr()
    assert piped.err == "" and piped.out
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) in (0, None)
    shown = terminal.getvalue()
    assert f"packing {command}" in shown and "stage" in shown, shown
    expected = "timing lp (depth max)" if command == "bench" else "lp plan at depth 3"
    assert expected in shown, shown
    assert capsys.readouterr().out.splitlines()[:1] == piped.out.splitlines()[:1]


def test_a_layout_with_room_for_its_pipeline_keeps_its_ipus(six_layer_job):
    """finetune_squad's BERT-Base layout [0,4,4,4] with a 6-layer checkpoint: four IPUs still fit
    its accumulation (32 rows / 4 replicas = 8 >= 2 x 4 - 1), so the layers are spread over them."""
    from backends import get_backend_class
    from bert_packed.config import load_config, resolve_run, validate

    config = load_config("finetune_squad", [f"model.init_checkpoint={six_layer_job['checkpoint']}",
                                            "data.max_sequence_length=64", "finetune.max_query_length=16"])
    resolved = resolve_run(config, get_backend_class("mock"))
    notes = list(resolved.warnings)
    fitted = resolved.config.ipu
    assert fitted.layers_per_ipu == [0, 2, 2, 2] and fitted.available_memory_proportion == [0.25]
    assert notes == ["ipu.layers_per_ipu=[0,2,2,2] for the checkpoint's 6 encoder layers (the config's [0,4,4,4] "
                     "has 12); --set ipu.layers_per_ipu to choose another"]
    assert validate(config, get_backend_class("mock")) == notes  # a second validation repeats the note


def test_a_pipeline_too_deep_for_the_accumulation_names_a_one_ipu_line_that_runs(six_layer_job, tmp_path, capsys):
    """A given 4-IPU layout with the ~1 micro-batch per step packing leaves: PopTorch's rule refuses
    it before anything compiles, naming a one-IPU --set line; that line (memory proportions fitted
    to it) runs."""
    given = ["--set", "ipu.layers_per_ipu=[0,2,2,2]"]
    assert _mock_finetune(six_layer_job, tmp_path / "deep", *given) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "forward pipeline stages" in errors[0], errors
    words = shlex.split(errors[0].split("or use one IPU per replica: ", 1)[1])
    assert words == ["--set", "ipu.layers_per_ipu=[6]"], errors
    assert _mock_finetune(six_layer_job, tmp_path / "one", *given, *words) == 0
