"""Hostile inputs to training (run.py): divergence, bad configs, resume mistakes, corrupted
checkpoints, concurrent runs. Each case: the exact one-line message, the exit code, and that
the inputs and previous outputs are byte-identical afterwards."""
import json
import math
import os
import re

import pytest
import torch

from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
from bert_packed.io.files import DirectoryLock
from hostile import TINY, assert_unchanged, main_error, run_ok, snapshot


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run with a checkpoint at step 4 (the 'previous output' of many cases)."""
    import run

    out = tmp_path_factory.mktemp("finished")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert run.main(TINY + ["--steps", "4", "--set", "train.checkpoint_every=2", "--output-dir", str(out)]) == 0
    torch.set_num_threads(threads)
    return out


def _summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- divergence


def test_forced_divergence_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code, line = main_error(capsys, TINY + ["--steps", "30", "--set", "optimizer.learning_rate=1000",
                                            "--set", "train.checkpoint_every=1", "--output-dir", str(out)])
    assert code == 3
    summary = _summary(out)
    failed = int(line.split("step ")[1].split(":")[0])
    # The first non-finite value of the step: its loss, or (loss still finite) its gradient norm.
    assert re.fullmatch(rf"error: step {failed}: non-finite (loss|grad_norm) nan: training diverged and was "
                        rf"stopped; last good checkpoint {re.escape(str(out / CHECKPOINT_NAME))} "
                        rf"\(step {failed - 1}\)", line), line
    assert 2 <= failed <= 10  # within a few steps
    assert summary["status"] == "diverged" and summary["error"] == line[len("error: "):]
    assert summary["checkpoint_step"] == failed - 1
    state = load_checkpoint(str(out / CHECKPOINT_NAME))  # checksum intact
    assert state["step"] == failed - 1
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, failed))  # no NaN line


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    # A step whose update makes weights non-finite while its own loss was finite: the loop
    # refuses to write that checkpoint (the previous one stays).
    from backends.cpu import CPUBackend
    from bert_packed.config import load_config
    from bert_packed.loop.train import DivergenceError, train

    class PoisoningBackend(CPUBackend):
        def train_step(self, micro_batches):
            metrics = super().train_step(micro_batches)
            if self.optimizer.state and len(self.optimizer.state[next(iter(self.optimizer.state))]) and \
                    self.optimizer.state[next(iter(self.optimizer.state))]["step"] == 3:
                with torch.no_grad():
                    next(self.model.parameters()).fill_(float("inf"))
            return metrics

    config = load_config("tiny", ["train.steps=6", "train.checkpoint_every=1", "data.num_sequences=300", "data.packing_algorithm=lpfhp",
                                  "train.micro_batch_size=4"])
    with pytest.raises(DivergenceError) as error:
        train(config, PoisoningBackend(), output_dir=str(tmp_path), show_progress=False)
    assert str(error.value).startswith("step 3: non-finite weights (bert.embeddings.word_embeddings.weight")
    assert load_checkpoint(str(tmp_path / CHECKPOINT_NAME))["step"] == 2


def test_fp16_skipped_steps_are_logged_and_too_many_in_a_row_stop_the_run(tmp_path, capsys):
    # fp16 loss scaling on the cuda backend's code path (on the CPU): a loss scale so large that
    # every scaled gradient overflows makes GradScaler skip every update.
    from bert_packed.config import load_config
    from bert_packed.loop.train import DivergenceError, train
    from test_cuda_backend import CPUDeviceCUDABackend

    config = load_config("tiny", ["train.steps=20", "cuda.precision=fp16", "cuda.loss_scale_init=3e38", "data.packing_algorithm=lpfhp",
                                  "train.max_consecutive_skipped_steps=3", "data.num_sequences=300",
                                  "train.micro_batch_size=4"])
    with pytest.raises(DivergenceError) as error:
        train(config, CPUDeviceCUDABackend(), output_dir=str(tmp_path), show_progress=True)
    assert str(error.value) == ("step 3: 3 consecutive updates skipped by loss scaling "
                                "(train.max_consecutive_skipped_steps=3): training diverged and was stopped; "
                                "no checkpoint was written before it")
    logged = [line for line in capsys.readouterr().out.splitlines() if "skipped by loss scaling" in line]
    assert len(logged) == 3 and logged[0].startswith("step 1: update skipped by loss scaling")
    assert _summary(tmp_path)["status"] == "diverged"


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_config_numbers_are_refused_at_config_time(tmp_path, capsys, value):
    code, line = main_error(capsys, TINY + ["--set", f"optimizer.learning_rate={value}", "--output-dir",
                                            str(tmp_path / "run")])
    shown = {".inf": "inf", "-.inf": "-inf", ".nan": "nan"}[value]
    assert (code, line) == (2, f"error: --set: optimizer.learning_rate: expected a finite number, got {shown}")
    assert not (tmp_path / "run").exists()


def test_lamb_defaults_to_no_trust_ratio_for_biases_and_layernorm():
    from bert_packed.config import load_config
    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model

    config = load_config("tiny")
    optimizer, _ = build_optimizer(config, build_model(config))
    decay, no_decay = optimizer.param_groups
    assert no_decay["max_weight_norm"] == 0.0 and no_decay["weight_decay"] == 0.0
    assert decay["max_weight_norm"] is None
    config = load_config("tiny", ["optimizer.bias_max_weight_norm=null"])
    assert build_optimizer(config, build_model(config))[0].param_groups[1]["max_weight_norm"] is None


# ----------------------------------------------------------------------------- config mistakes

BAD_CONFIGS = [
    (["train.log_every=0"], "cpu", "train.log_every must be >= 1, got 0"),
    (["model.num_attention_heads=0"], "cpu", "model.num_attention_heads must be >= 1, got 0"),
    (["model.type_vocab_size=1"], "cpu", "model.type_vocab_size=1 but pre-training (next-sentence prediction) uses "
                                         "segment ids 0 and 1; set model.type_vocab_size=2"),
    (["train.num_threads=0"], "cpu", "train.num_threads must be >= 1, got 0"),
    (["train.seed=-1"], "cpu", "train.seed must be >= 0, got -1"),
    (["train.eval_batches=0", "train.eval_every=2"], "cpu", "train.eval_batches must be >= 1, got 0"),
    (["optimizer.weight_decay=-0.1"], "cpu", "optimizer.weight_decay must be >= 0, got -0.1"),
    (["optimizer.learning_rate=-1"], "cpu", "optimizer.learning_rate must be >= 0, got -1.0"),
    (["optimizer.bias_max_weight_norm=-1"], "cpu",
     "optimizer.bias_max_weight_norm must be >= 0 (0 = no trust ratio) or null (no clamp), got -1.0"),
    (["optimizer.eps=0"], "cpu", "optimizer.eps must be > 0, got 0.0"),
    (["optimizer.beta1=1"], "cpu", "optimizer.beta1 must be in [0, 1), got 1.0"),
    (["train.collective_timeout_minutes=0"], "cpu", "train.collective_timeout_minutes must be > 0, got 0.0"),
    (["train.max_consecutive_skipped_steps=0"], "cpu", "train.max_consecutive_skipped_steps must be >= 1, got 0"),
    (["ipu.embedding_serialization_factor=3"], "mock",
     "ipu.embedding_serialization_factor=3 must be >= 1 and divide model.vocab_size=256; pick a divisor "
     "(1 = no serialization)"),
    (["ipu.available_memory_proportion=[1.5]"], "mock",
     "ipu.available_memory_proportion[0] must be in (0, 1] (a fraction of tile memory), got 1.5"),
    (["ipu.layers_per_ipu=[-1, 3]"], "mock",
     "ipu.layers_per_ipu[0] must be >= 0 (encoder layers on that IPU), got -1"),
    # An empty value (an unset shell variable): was "none" in silence (random init, generated
    # data, runs/NAME) or, for the label separator, a traceback (str.split("")).
    (["model.init_checkpoint="], "cpu", "--set: model.init_checkpoint is empty; give a value (or null for none)"),
    (["data.path=  "], "cpu", "--set: data.path is empty; give a value (or null for none)"),
    (["train.output_dir="], "cpu", "--set: train.output_dir is empty; give a value (or null for none)"),
    (["finetune.label_separator="], "cpu", "--set: finetune.label_separator is empty; give a value"),
    (["cpu.reuse_freed_memory=maybe"], "cpu", "--set: cpu.reuse_freed_memory: expected bool, got 'maybe' (str)"),
    (["cpu.reuse_freed_memory="], "cpu", "--set: cpu.reuse_freed_memory: expected bool, got '' (str)"),
    (["cpu.fast_dropout=maybe"], "cpu", "--set: cpu.fast_dropout: expected bool, got 'maybe' (str)"),
    (["cpu.fast_dropout=0.5"], "cpu", "--set: cpu.fast_dropout: expected bool, got 0.5 (float)"),
    (["cpu.fast_dropout="], "cpu", "--set: cpu.fast_dropout: expected bool, got '' (str)"),
]


@pytest.mark.parametrize("overrides, backend, message", BAD_CONFIGS, ids=[c[0][0] for c in BAD_CONFIGS])
def test_config_mistakes_exit_2_with_one_line(tmp_path, capsys, overrides, backend, message):
    argv = TINY + ["--backend", backend, "--output-dir", str(tmp_path / "run")]
    for override in overrides:
        argv += ["--set", override]
    assert main_error(capsys, argv) == (2, f"error: {message}")
    assert not (tmp_path / "run").exists()


# Absurd counts and sizes (issue 27): every number of every section has a maximum with its
# reason (tests/loop/test_config.py checks the declarations); these go through run.main.
ABSURD = [
    (["--steps", "1000000000000000000000000000000"], "cpu",
     "train.steps must be <= 1000000000 (more optimizer steps than any run takes; BERT-Large pre-training takes "
     "10^4 to 10^6), got 1000000000000000000000000000000"),
    (["--set", "train.micro_batch_size=1000000000000"], "cpu",
     "train.micro_batch_size must be <= 16384 (no device holds the activations of more packs in one forward pass), "
     "got 1000000000000"),
    (["--set", "train.gradient_accumulation=10000000000000000000000"], "cpu",
     "train.gradient_accumulation must be <= 1048576 (16 times the largest published BERT batch (65536 sequences)), "
     "got 10000000000000000000000"),
    # Was a numpy traceback (np.random.seed takes 32 bits).
    (["--set", "train.seed=4294967296"], "cpu",
     "train.seed must be <= 4294967295 (numpy's random seed is 32 bits), got 4294967296"),
    # Was a segfault (libgomp cannot create the threads).
    (["--set", "train.num_threads=100000000"], "cpu",
     "train.num_threads must be <= 1024 (more threads than any CPU runs; libgomp crashes when it cannot create "
     "them), got 100000000"),
    (["--set", "train.collective_timeout_minutes=1e30"], "cpu",
     "train.collective_timeout_minutes must be <= 10080 (a week; a collective waiting longer has hung), got 1e+30"),
    (["--set", "train.eval_batches=100000", "--set", "train.eval_every=1"], "cpu",
     "train.eval_batches must be <= 10000 (they are built once and kept in host memory), got 100000"),
    (["--set", "data.num_sequences=1000000000000"], "cpu",
     "data.num_sequences must be <= 100000000 (generated sequences are drawn and packed in host memory at the "
     "start; use data.path), got 1000000000000"),
    (["--set", "data.max_sequence_length=1000000000", "--set", "model.max_position_embeddings=1000000000"], "cpu",
     "model.max_position_embeddings must be <= 1048576 (16 times the longest sequence a run takes), got 1000000000"),
    (["--set", "data.max_sequences_per_pack=200"], "cpu",
     "data.max_sequences_per_pack must be <= 127 (packed files store sequence ids as int8), got 200"),
    (["--set", "model.hidden_size=1000000000000"], "cpu",
     "model.hidden_size must be <= 65536 (one hidden x hidden weight matrix would be 16 GiB; the widest transformers "
     "use ~25000), got 1000000000000"),
    (["--set", "optimizer.weight_decay=1e30"], "cpu",
     "optimizer.weight_decay must be <= 1 (ten times the largest decay recipes use (0.01 to 0.1)), got 1e+30"),
    (["--set", "finetune.epochs=1e300"], "cpu",
     "finetune.epochs must be <= 1000000 (fine-tuning takes 2 to 10 passes), got 1e+300"),
    (["--set", "ipu.replication_factor=1000000"], "mock",
     "ipu.replication_factor must be <= 1024 (the largest IPU systems have 1024 IPUs), got 1000000"),
    (["--set", "ipu.replication_factor=1024", "--set", "ipu.layers_per_ipu=[1, 1]"], "mock",
     "ipu.replication_factor=1024 replicas of 2 IPUs (ipu.layers_per_ipu) need 2048 IPUs; the largest IPU "
     "systems have 1024"),
    (["--set", "ipu.device_iterations=10000", "--set", "train.gradient_accumulation=100000"], "mock",
     "one host call holds 256000000000 tokens (ipu.device_iterations=10000 x 100000 micro-batches per step x "
     "ipu.replication_factor=1 x train.micro_batch_size=4 packs x data.max_sequence_length=64), more than "
     "2147483648: the host builds them all before the call; lower ipu.device_iterations"),
    (["--set", "ipu.loss_scaling=1e9"], "mock",
     "ipu.loss_scaling must be <= 65504 (fp16's largest value; Graphcore's BERT uses 512 to 16384), got 1000000000.0"),
    (["--set", "cuda.loss_scale_init=1e300"], "cuda",
     "cuda.loss_scale_init must be <= 3.40282e+38 (GradScaler keeps it in fp32, whose largest value that is), got "
     "1e+300"),
    # More IPUs than the (mock) system has: refused before the run directory is made (was a
    # traceback at the first step's compile, with metrics.jsonl already written).
    (["--set", "ipu.replication_factor=512"], "mock",
     "the run needs 512 IPUs (ipu.replication_factor=512 x 1 per replica, ipu.layers_per_ipu), more than this "
     "system has (the mock system has 16; set MOCK_POPTORCH_NUM_IPUS to model a larger one); lower "
     "ipu.replication_factor"),
]


@pytest.mark.parametrize("extra, backend, message", ABSURD, ids=[" ".join(c[0]) for c in ABSURD])
def test_absurd_counts_and_sizes_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, extra, backend, message):
    from bert_packed.config import resolve_config_path

    tiny = resolve_config_path("tiny")
    before = snapshot(tmp_path, tiny)
    argv = TINY + ["--backend", backend, "--output-dir", str(tmp_path / "out" / "run"), *extra]
    assert main_error(capsys, argv) == (2, f"error: {message}")
    assert_unchanged(before, tmp_path, tiny)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, environ, message", [
    (["--world-size", "0"], {}, "error: --world-size counts processes: give 1 or more, got 0 (see run.py --help)"),
    ([], {"WORLD_SIZE": "two"}, "error: $WORLD_SIZE='two' is not a number of processes (see run.py --help)"),
])
def test_a_world_size_that_is_no_count_of_processes_is_one_line(capsys, monkeypatch, argv, environ, message):
    import run

    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("sys.argv", ["run.py"])
    with pytest.raises(SystemExit) as exit_:
        run.main(["--config", "tiny", "--print-config", *argv])
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [message]


def test_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me\n")
    before = snapshot(tmp_path)
    code, line = main_error(capsys, TINY + ["--steps", "1", "--output-dir", str(target)])
    assert (code, line) == (2, f"error: output directory {target} is a file; choose another --output-dir")
    assert_unchanged(before, tmp_path)


def test_output_dir_below_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me\n")
    before = snapshot(tmp_path)
    code, line = main_error(capsys, TINY + ["--steps", "1", "--output-dir", str(target / "sub")])
    assert (code, line) == (2, f"error: output directory {target / 'sub'}: Not a directory ({target} is a file); "
                               f"choose another --output-dir")
    assert_unchanged(before, tmp_path)


def test_keyboard_interrupt_before_training_is_one_line(monkeypatch, capsys):
    import run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "load_config", interrupted)
    assert main_error(capsys, ["--config", "tiny"]) == (130, "interrupted (nothing half-written was kept)")


# ----------------------------------------------------------------------------- the modes of run.py (issue 27)
# --compile-only, --profile and --print-config: the same output-directory rules as training, a
# mistake refused before anything is written, and flags that contradict each other refused.


@pytest.fixture
def packed_data(tmp_path):
    """A folder holding a packed HDF5 file (data.path: an input of pre-training)."""
    from bert_packed.data.prepare.pack import pack_file
    from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

    folder = tmp_path / "data"
    folder.mkdir()
    write_synthetic_unpacked(folder / "u.h5", 200, max_seq_length=64, max_predictions=10, vocab_size=256, seed=1)
    pack_file(folder / "u.h5", folder / "packed.h5", show_progress=False)
    os.remove(folder / "u.h5")
    return folder


@pytest.mark.parametrize("mode", [["--compile-only"], ["--compile-only", "report"], ["--profile"], []],
                         ids=["compile-only", "compile-only report", "profile", "train"])
@pytest.mark.parametrize("where", ["a file", "below a file", "the data's folder"])
def test_every_mode_refuses_an_output_dir_that_cannot_be_one(tmp_path, capsys, packed_data, mode, where):
    (tmp_path / "file").write_text("keep me\n")
    target = {"a file": tmp_path / "file", "below a file": tmp_path / "file" / "sub",
              "the data's folder": packed_data}[where]
    message = {"a file": f"output directory {target} is a file; choose another --output-dir",
               "below a file": f"output directory {target}: Not a directory ({tmp_path / 'file'} is a file); choose "
                               f"another --output-dir",
               "the data's folder": f"--output-dir {target} is data.path's directory ({packed_data / 'packed.h5'}); "
                                    f"choose another --output-dir so the input stays as it is"}[where]
    before = snapshot(tmp_path)
    argv = TINY + ["--backend", "mock", "--steps", "1", "--set", f"data.path={packed_data / 'packed.h5'}",
                   "--set", "model.vocab_size=256", "--output-dir", str(target), *mode]
    assert main_error(capsys, argv) == (2, f"error: {message}")  # (was "error: FILE: File exists" for the modes)
    assert_unchanged(before, tmp_path)


def test_compile_only_refuses_a_mistake_before_writing_its_estimate(tmp_path, capsys):
    # Was: memory_estimate.md/.json written, then the refusal.
    out = tmp_path / "out"
    argv = TINY + ["--backend", "mock", "--compile-only", "--steps", "4", "--set", "ipu.device_iterations=3",
                   "--output-dir", str(out)]
    assert main_error(capsys, argv) == (2, "error: train.steps=4 is not a multiple of ipu.device_iterations=3 (one "
                                           "PopTorch call runs that many steps); change either")
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--print-config", "tiny", "--config", "phase2"],
     "--print-config tiny and --config phase2 name two configs; give one"),
    (["--compile-only", "--profile"], "argument --profile: not allowed with argument --compile-only"),
    (["--print-config", "--compile-only"], "argument --compile-only: not allowed with argument --print-config"),
    (["--profile", "--resume"], "--resume continues a training run; --profile does not train"),
    (["--compile-only", "report", "--resume-force"], "--resume continues a training run; --compile-only does not train"),
])
def test_modes_that_contradict_are_refused(capsys, monkeypatch, argv, message):
    # Was: one of them silently won (--print-config NAME over --config, --compile-only over --profile).
    import run

    monkeypatch.setattr("sys.argv", ["run.py"])
    with pytest.raises(SystemExit) as exit_:
        run.main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [f"error: {message} (see run.py --help)"]


@pytest.mark.parametrize("content", ["", "# nothing but a comment\n\n"], ids=["empty", "comment"])
def test_an_empty_config_file_is_refused_not_the_defaults(tmp_path, capsys, content):
    # Was: every default (BERT-Large, 2137 steps) for a file saved empty by mistake; {} still means that.
    path = tmp_path / "mine.yaml"
    path.write_text(content)
    before = snapshot(tmp_path)
    assert main_error(capsys, ["--config", str(path), "--output-dir", str(tmp_path / "run")]) == (
        2, f"error: {path}: the config file is empty; write its sections (model:, data:, train:, ...), or {{}} for "
           f"every default")
    assert_unchanged(before, tmp_path)
    path.write_text("{}\n")
    assert run_ok(capsys, ["--print-config", str(path)]).out.startswith("# resolved config 'mine'")


def test_a_config_that_is_a_directory_or_a_missing_path_is_named_plainly(tmp_path, capsys):
    (tmp_path / "conf.yaml").mkdir()
    code, line = main_error(capsys, ["--print-config", str(tmp_path / "conf.yaml")])
    assert (code, line) == (2, f"error: config {tmp_path / 'conf.yaml'} is a directory; give a YAML file (or a name "
                               f"in configs/)")
    code, line = main_error(capsys, ["--print-config", str(tmp_path / "nope.yaml")])
    # Was: "no file configs//abs/nope.yaml, configs//abs/nope.yaml.yaml or /abs/nope.yaml".
    assert code == 2 and line.startswith(f"error: unknown config '{tmp_path / 'nope.yaml'}': no file "
                                         f"{tmp_path / 'nope.yaml'}; available: demo, ")


# ----------------------------------------------------------------------------- Ctrl-C (issue 27)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_py_as_main(code_before, argv, tmp_path):
    """``python run.py ARGV`` (as __main__, through runpy) after ``code_before``; (status, stderr, the
    SIGINT handler at exit)."""
    import subprocess
    import sys

    # SIGINT as a terminal's foreground process has it (a test run started in the background has
    # it ignored, inherited, and the SIG_IGN check below would then prove nothing).
    script = (f"import builtins, runpy, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"{code_before}\nsys.argv = ['run.py'] + {argv!r}\n"
              f"try:\n    runpy.run_path('run.py', run_name='__main__')\nexcept SystemExit as exc:\n"
              f"    print('handler', signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n    sys.exit(exc.code)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stderr, result.stdout


def test_ctrl_c_while_torch_loads_is_one_line(tmp_path):
    # Was: a KeyboardInterrupt traceback from inside an import (the first seconds of every run).
    interrupt_imports = ("real = builtins.__import__\n"
                         "def imp(name, *args, **kwargs):\n"
                         "    if name == 'backends':\n"
                         "        raise KeyboardInterrupt\n"
                         "    return real(name, *args, **kwargs)\n"
                         "builtins.__import__ = imp")
    code, err, _ = _run_py_as_main(interrupt_imports, ["--config", "tiny", "--output-dir", str(tmp_path / "run")],
                                   tmp_path)
    assert (code, err.splitlines()) == (130, ["interrupted (nothing half-written was kept)"])
    assert not (tmp_path / "run").exists()


def test_ctrl_c_after_the_work_is_done_is_ignored():
    # Was: a Ctrl-C during the interpreter's shutdown, after a completed run, exited "killed by
    # SIGINT"; from the moment run.py has its exit status, SIGINT is ignored.
    code, err, out = _run_py_as_main("", ["--print-config", "tiny"], None)
    assert code == 0 and out.rstrip().endswith("handler True"), err


def test_ctrl_c_while_the_end_of_run_outputs_are_written_says_what_is_left(tmp_path, capsys, monkeypatch):
    # Was: "interrupted (nothing half-written was kept)" and no summary.json, though the trained
    # weights were in a checkpoint the message did not mention.
    from bert_packed.tasks import base as task_module

    def export(self, model, directory):
        raise KeyboardInterrupt

    monkeypatch.setattr(task_module.Task, "export", export)
    out = tmp_path / "run"
    argv = TINY + ["--steps", "4", "--set", "train.checkpoint_every=2", "--output-dir", str(out)]
    code, line = main_error(capsys, argv)
    assert (code, line) == (130, f"stopped: SIGINT after the last step (4), while the end-of-run outputs (final "
                                 f"evaluation, predictions, OUT/hf) were written: they are incomplete; the checkpoint "
                                 f"{out / 'checkpoint.pt'} holds step 4 (python -m bert_packed.finetune export {out} "
                                 f"--output DIR writes its Hugging Face export)")
    assert _summary(out)["status"] == "interrupted" and load_checkpoint(str(out / CHECKPOINT_NAME))["step"] == 4
    before = snapshot(out)
    assert run_ok(capsys, argv + ["--resume"]).err.splitlines() == [
        f"note: {out / 'checkpoint.pt'} is at step 4 and train.steps=4: nothing to do (raise --steps to continue)",
        f"note: the run was stopped: {line[len('stopped: '):]}"]
    assert_unchanged(before, out)
    code, line = main_error(capsys, TINY + ["--steps", "4", "--output-dir", str(tmp_path / "run0")])
    assert line.endswith("no checkpoint holds step 4 (train.checkpoint_every=0)")
# ----------------------------------------------------------------------------- resume and checkpoints


def test_forgetting_resume_on_a_directory_with_a_checkpoint_is_refused(finished, capsys):
    before = snapshot(finished)
    code, line = main_error(capsys, TINY + ["--steps", "4", "--output-dir", str(finished)])
    assert (code, line) == (2, f"error: {finished} already holds a checkpoint (checkpoint.pt); pass --resume to "
                               f"continue that run, choose another --output-dir, or delete {finished} to start over "
                               f"(nothing was changed)")
    assert_unchanged(before, finished)


def test_resuming_a_finished_run_changes_nothing(finished, capsys):
    import run

    before = snapshot(finished)
    assert run.main(TINY + ["--steps", "4", "--resume", "--set", "train.checkpoint_every=2",
                            "--output-dir", str(finished)]) == 0
    assert capsys.readouterr().err.strip() == (f"note: {finished / CHECKPOINT_NAME} is at step 4 and train.steps=4: "
                                               f"nothing to do (raise --steps to continue)")
    assert_unchanged(before, finished)


def test_resume_with_a_computation_change_lists_the_keys(finished, capsys):
    before = snapshot(finished)
    code, line = main_error(capsys, TINY + ["--steps", "4", "--resume", "--set", "optimizer.learning_rate=0.01",
                                            "--set", "train.micro_batch_size=2", "--output-dir", str(finished)])
    assert (code, line) == (2, f"error: {finished / CHECKPOINT_NAME}: the configuration differs from the "
                               f"checkpoint's in optimizer.learning_rate, train.micro_batch_size; that would change "
                               f"the computation, so resuming is refused (restore them, or pass --resume-force)")
    assert_unchanged(before, finished)


def test_resume_with_harmless_changes_and_forced_changes_continues(finished, tmp_path, capsys):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    captured = run_ok(capsys, TINY + ["--steps", "6", "--resume", "--set", "train.log_every=2",
                                      "--output-dir", str(out)])
    assert "note: resuming with train.steps changed from 4 to 6" in captured.err
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 6]
    # A computation change goes through with --resume-force, and says so.
    captured = run_ok(capsys, TINY + ["--steps", "8", "--resume-force", "--set", "train.micro_batch_size=2",
                                      "--output-dir", str(out)])
    assert "note: resuming with train.micro_batch_size changed from 4 to 2 (forced)" in captured.err
    assert _summary(out)["last"]["step"] == 8 and _summary(out)["last"]["packs"] == 2


@pytest.mark.parametrize("damage", ["truncate", "bit_flip", "trailer", "empty", "garbage"])
def test_damaged_checkpoint_is_refused_naming_the_file(finished, tmp_path, capsys, damage):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    path = out / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bit_flip":
        data[len(data) // 3] ^= 0x10
    elif damage == "trailer":
        data = data[:-3] + b"99\n"
    elif damage == "empty":
        data = b""
    else:
        data = b"not a checkpoint\n" * 40
    path.write_bytes(bytes(data))
    before = snapshot(out)
    code, line = main_error(capsys, TINY + ["--steps", "6", "--resume", "--output-dir", str(out)])
    expected = {
        "truncate": "no checksum trailer: the file is truncated, corrupted at its end, or not a checkpoint of this "
                    "project; not loaded",
        "bit_flip": "checksum mismatch",
        "trailer": "but its trailer says",
        "empty": "not a complete checkpoint (0 bytes, no checksum trailer): truncated; not loaded",
        "garbage": "no checksum trailer",
    }[damage]
    assert code == 2 and line.startswith(f"error: {path}: ") and expected in line, line
    assert line.endswith("not loaded")
    assert_unchanged(before, out)


def test_a_cpu_checkpoint_is_refused_clearly_on_mock(finished, tmp_path, capsys):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    before = snapshot(out)
    code, line = main_error(capsys, TINY + ["--steps", "6", "--resume", "--backend", "mock", "--output-dir", str(out)])
    assert (code, line) == (2, f"error: {out / CHECKPOINT_NAME} was written by backend 'cpu', this run uses 'mock': "
                               f"optimizer state does not carry over between backends; resume with --backend cpu")
    assert_unchanged(before, out)


def test_a_second_run_on_a_locked_directory_is_refused(finished, capsys):
    before = snapshot(finished)
    with DirectoryLock(finished):
        code, line = main_error(capsys, TINY + ["--steps", "6", "--resume", "--output-dir", str(finished)])
    assert code == 2 and line == (f"error: {finished} is in use by another run (pid {os.getpid()} on "
                                  f"{os.uname().nodename}); wait for it to finish, or choose another --output-dir")
    assert_unchanged(before, finished)


def test_stale_lock_and_orphan_temp_files_of_dead_processes_are_cleaned(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    from bert_packed.io.files import _host

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("pid 999999 on elsewhere\n")  # a killed run's lock file (no flock held)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan = out / f".checkpoint-{_host()}.{dead}.abc.tmp"
    orphan.write_bytes(b"half a checkpoint")
    alive = out / f".tmp-{_host()}.{os.getppid()}.abc.metrics.jsonl"  # a live process's: kept
    alive.write_text("")
    run_ok(capsys, TINY + ["--steps", "1", "--output-dir", str(out)])
    assert not orphan.exists() and alive.exists()
    assert socket.gethostname() in (out / ".lock").read_text()


def test_summary_of_a_completed_run_says_so(finished):
    summary = _summary(finished)
    assert summary["status"] == "completed" and summary["error"] is None and summary["checkpoint_step"] == 4
    assert math.isfinite(summary["last"]["grad_norm"])


# ----------------------------------------------------------------------------- distributed


def test_process_group_gets_the_configured_collective_timeout(monkeypatch):
    import datetime

    import torch.distributed as dist

    from backends.cpu import CPUBackend
    from bert_packed.loop.train import setup_distributed

    seen = {}
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # as torchrun sets them
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(seen))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert setup_distributed(CPUBackend(), 2.5) == (1, 2)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=2.5)}


def test_a_timed_out_collective_is_one_line_naming_the_setting(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    import run
    from backends.cpu import CPUBackend

    class HungPeer(CPUBackend):
        distributed = staticmethod(lambda: False)  # the backend's own collectives are not under test

        def train_step(self, micro_batches):  # what gloo raises when a peer never answers
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 150000ms "
                               "for recv operation to complete")

    monkeypatch.setattr(run, "get_backend", lambda name, **kwargs: HungPeer())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    code, line = main_error(capsys, TINY + ["--steps", "2", "--set", "train.collective_timeout_minutes=2.5",
                                            "--output-dir", str(tmp_path / "run")])
    assert (code, line) == (1, "error: a collective between the 2 processes timed out after "
                               "train.collective_timeout_minutes=2.5: another rank hung or died (see its log); the "
                               "last checkpoint is intact")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "abc"], "error: argument --steps: invalid int value: 'abc' (see run.py --help)"),
    (["--bogus"], "error: unrecognized arguments: --bogus (see run.py --help)"),
    (["--output-dir", ""], "error: --output-dir needs a directory, got an empty one (see run.py --help)"),
])
def test_command_line_mistakes_are_one_line(capsys, monkeypatch, argv, message):
    import run

    monkeypatch.setattr("sys.argv", ["run.py"])
    with pytest.raises(SystemExit) as exit_:
        run.main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [message]


def test_checkpoints_of_multi_step_calls_resume_exactly(tmp_path, capsys, monkeypatch):
    # IPU device_iterations=2: one backend call runs two steps. A checkpoint due inside a call
    # (step 3 of the call 3-4) is written at the call's end, where the weights and the data
    # position belong together; after a crash the resumed run repeats the uninterrupted one.
    import run
    from backends.mock import MockBackend

    mock = TINY + ["--backend", "mock", "--set", "ipu.device_iterations=2", "--set", "train.checkpoint_every=3",
                   "--set", "optimizer.schedule=constant", "--set", "optimizer.warmup_fraction=0", "--steps", "6"]
    run_ok(capsys, mock + ["--output-dir", str(tmp_path / "full")])

    class CrashOnThirdCall(MockBackend):
        calls = 0

        def train_step(self, micro_batches):
            CrashOnThirdCall.calls += 1
            if CrashOnThirdCall.calls == 3:
                raise KeyboardInterrupt  # e.g. a second Ctrl-C, or the machine going down
            return super().train_step(micro_batches)

    with monkeypatch.context() as patch:
        patch.setattr(run, "get_backend", lambda name, **kwargs: CrashOnThirdCall())
        assert main_error(capsys, mock + ["--output-dir", str(tmp_path / "split")])[0] == 130
    assert load_checkpoint(str(tmp_path / "split" / CHECKPOINT_NAME))["step"] == 4
    run_ok(capsys, mock + ["--resume", "--output-dir", str(tmp_path / "split")])
    lines = {}
    for name in ("full", "split"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            lines[name] = [json.loads(line) for line in f]
    keys = ("step", "loss", "mlm_loss", "nsp_loss", "sequences", "tokens")
    assert [[line[k] for k in keys] for line in lines["full"]] == [[line[k] for k in keys] for line in lines["split"]]


def test_a_world_size_left_set_without_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    # Was: a traceback from torch's env:// rendezvous ("environment variable RANK expected").
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    code, line = main_error(capsys, TINY + ["--steps", "1", "--output-dir", str(out)])
    assert (code, line) == (2, "error: WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not: this process "
                               "was not started by torchrun; for one process unset WORLD_SIZE (unset WORLD_SIZE), for "
                               "2 launch with torchrun --nproc_per_node 2 run.py ...")
    assert not out.exists()


def test_a_huge_set_value_is_quoted_by_an_excerpt_in_every_message(tmp_path, capsys):
    # Was: a 100 kB --set value echoed whole in the one-line error (and so in every log).
    out = tmp_path / "run"
    huge = "x" * 100_000
    code, line = main_error(capsys, TINY + ["--set", f"train.steps={huge}", "--output-dir", str(out)])
    assert (code, line) == (2, f"error: --set: train.steps: expected int, got '{'x' * 59}... (100,000 characters) "
                               f"(str)")
    code, line = main_error(capsys, TINY + ["--set", huge, "--output-dir", str(out)])
    assert (code, line) == (2, f"error: --set '{'x' * 59}... (100,000 characters): expected section.key=value, e.g. "
                               f"--set train.steps=100")
    # A name or path setting longer than any name or path is refused naming its key (issue 46),
    # before anything quotes the value whole.
    code, line = main_error(capsys, TINY + ["--set", f"data.packing_algorithm={huge}", "--output-dir", str(out)])
    assert code == 2 and len(line) < 500 and "data.packing_algorithm" in line and "100,000 characters" in line, \
        line[:600]
    assert not out.exists()


def test_a_full_disk_during_a_checkpoint_names_the_file_and_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    # Was: "error: No space left on device", no file named; the temporary file's fate unsaid.
    import errno

    from bert_packed.io import checkpoint as checkpoint_module

    real, calls = checkpoint_module.torch.save, []

    class FullDisk:  # the disk fills after some bytes: torch.save reports it as a RuntimeError
        def __init__(self, inner):
            self.inner = inner

        def write(self, data):
            if self.inner.size > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.inner.write(data)

        def flush(self):
            self.inner.flush()

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        return real(obj, FullDisk(f) if len(calls) == 2 else f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)
    out = tmp_path / "run"
    code, line = main_error(capsys, TINY + ["--steps", "3", "--set", "train.checkpoint_every=1", "--output-dir",
                                            str(out)])
    assert (code, line) == (2, f"error: {out / CHECKPOINT_NAME}: No space left on device: the checkpoint was not "
                               f"written (the previous checkpoint there is intact); free space or choose another "
                               f"--output-dir, then --resume")
    assert load_checkpoint(str(out / CHECKPOINT_NAME))["step"] == 1
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint-")]
