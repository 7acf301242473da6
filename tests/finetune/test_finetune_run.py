"""`python run.py --config finetune_classification ...` end to end on tiny files (the issue's
contract): summary eval metrics, OUT/hf loadable by transformers, predictions, TensorBoard,
packing on/off, the three problem types, the mock (IPU) path, and one-line errors."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import run
from finetune_fixtures import classification_rows, save_hf_checkpoint, write_rows, write_vocab

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny pre-trained BERT directory (transformers' save_pretrained + tokenizer files)."""
    directory = tmp_path_factory.mktemp("ckpt")
    vocab = write_vocab(str(directory / "vocab"))
    save_hf_checkpoint(transformers, str(directory / "bert"), vocab, "BertForPreTraining",
                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return str(directory / "bert")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    columns = ["text", "pair", "label"]
    out = {"train": write_rows(str(directory / "train.csv"), classification_rows(160, 0), columns),
           "dev": write_rows(str(directory / "dev.tsv"), classification_rows(40, 1), columns)}
    for problem in ("multi_label_classification", "regression"):
        out[problem] = write_rows(str(directory / f"{problem}.jsonl"), classification_rows(120, 2, problem), columns)
    return out


def finetune(checkpoint, output, *extra, backend="cpu"):
    """run.main with the contract's flags; returns (exit status, summary or None)."""
    argv = ["--config", "finetune_classification", "--backend", backend, "--init-checkpoint", checkpoint,
            "--output-dir", str(output), "--no-progress", "--set", "data.max_sequence_length=64",
            "--set", "train.num_threads=1", *extra]
    status = run.main(argv)
    path = os.path.join(output, "summary.json")
    return status, (json.load(open(path)) if status == 0 and os.path.exists(path) else None)


def test_finetune_run_reports_metrics_and_exports_a_transformers_model(checkpoint, files, tmp_path, capsys):
    out = tmp_path / "out"
    status, summary = finetune(checkpoint, out, "--set", f"finetune.train_file={files['train']}",
                               "--set", f"finetune.validation_file={files['dev']}",
                               "--set", "finetune.text_pair_column=pair", "--set", "train.eval_every=4")
    assert status == 0
    assert summary["task"] == "classification" and summary["problem_type"] == "single_label_classification"
    assert summary["labels"] == {"0": "neg", "1": "pos"}  # string labels mapped to ids, sorted
    assert set(summary["eval"]) >= {"accuracy", "f1_macro", "mcc", "loss", "step"}
    assert summary["packing_factor"] > 1.5  # several sequences per row
    # Steps from finetune.epochs (3) over the packed rows; the accumulation divided by the packing
    # factor (train.packing_adjustment), so a step sees about as many sequences as a padded one.
    assert summary["gradient_accumulation"] == round(4 / summary["packing_factor"])
    assert summary["total_sequences"] >= 3 * 160
    assert summary["steps"] == -(-3 * summary["data_packing"]["num_packs"] // summary["packs_per_step"])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "accuracy", "sequences", "packs", "tokens", "sequences_per_second"} <= set(lines[-1])
    assert "eval_accuracy" in lines[-1]
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 40 and {p["prediction"] for p in predictions} <= {"neg", "pos"}
    best_step = summary["eval"]["step"]
    accuracy = np.mean([p["prediction"] == p["label"] for p in predictions])
    assert abs(accuracy - summary["eval"]["accuracy"]) < 1e-9, best_step
    # The export: transformers loads model and tokenizer without code changes.
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert model.config.id2label == {0: "neg", 1: "pos"} and model.config.problem_type == "single_label_classification"
    import csv
    import torch

    with open(files["dev"], newline="") as f:
        dev = list(csv.DictReader(f, delimiter="\t"))
    inputs = tokenizer([r["text"] for r in dev], [r["pair"] for r in dev], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits.numpy()
    ours = np.array([p["logits"] for p in predictions])
    assert np.abs(logits - ours).max() <= 1e-4  # predictions.jsonl rounds to 6 decimals
    # `python -m bert_packed.finetune predict` on the export: the same predictions, packed.
    from bert_packed.finetune.__main__ import main as finetune_main

    assert finetune_main(["predict", "--model", str(out / "hf"), "--input", files["dev"], "--text-pair-column",
                          "pair", "--max-sequence-length", "64", "--output", str(tmp_path / "p.jsonl")]) == 0
    again = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [p["prediction"] for p in again] == [p["prediction"] for p in predictions]
    assert np.abs(np.array([p["logits"] for p in again]) - ours).max() <= 1e-5
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:  # optional: event files when installed
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
    assert "init checkpoint" in capsys.readouterr().err


def test_packing_false_trains_the_same_job_padded(checkpoint, files, tmp_path):
    common = ("--set", f"finetune.train_file={files['train']}", "--set", f"finetune.validation_file={files['dev']}",
              "--set", "finetune.epochs=1")
    _, packed = finetune(checkpoint, tmp_path / "packed", *common)
    _, padded = finetune(checkpoint, tmp_path / "padded", *common, "--set", "finetune.packing=false")
    assert padded["packing_factor"] == 1.0 and padded["max_sequences_per_pack"] == 1
    assert padded["data_packing"]["num_packs"] == 160
    # One epoch each: every training sequence once, the packed run in far fewer rows; its steps
    # keep about a padded step's sequences (accumulation 4 divided by the packing factor).
    assert packed["total_sequences"] >= 160 and padded["total_sequences"] >= 160
    assert packed["total_packs"] < padded["total_packs"] / 1.5
    assert padded["gradient_accumulation"] == 4 and packed["gradient_accumulation"] == round(4 / packed["packing_factor"])


@pytest.mark.parametrize("problem_type, keys", [("multi_label_classification", {"f1_micro", "f1_macro", "accuracy"}),
                                                ("regression", {"pearson", "spearman", "mse"})])
def test_multi_label_and_regression_from_jsonl_with_a_held_out_split(checkpoint, files, tmp_path, problem_type, keys):
    out = tmp_path / "out"
    status, summary = finetune(checkpoint, out, "--set", f"finetune.train_file={files[problem_type]}",
                               "--set", "finetune.validation_fraction=0.25", "--steps", "4")
    assert status == 0 and summary["problem_type"] == problem_type and summary["steps"] == 4
    assert keys <= set(summary["eval"])
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["problem_type"] == problem_type
    if problem_type == "regression":
        assert config["id2label"] == {"0": "LABEL_0"} and summary["eval"]["mse"] > 0
    else:
        assert sorted(config["label2id"]) == ["long", "neg", "pos"]
    lines = (out / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 30  # 25 % of 120 rows held out


def test_mock_ipu_path_matches_cpu(checkpoint, files, tmp_path):
    """The IPU code path (mock poptorch, fixed pack shape, fp32) trains the same steps as cpu."""
    common = ("--set", f"finetune.train_file={files['train']}", "--set", f"finetune.validation_file={files['dev']}",
              "--steps", "3", "--set", "model.hidden_dropout_prob=0.0", "--set", "model.attention_probs_dropout_prob=0.0",
              "--set", "train.checkpoint_every=0")
    _, cpu = finetune(checkpoint, tmp_path / "cpu", *common)
    status, mock = finetune(checkpoint, tmp_path / "mock", *common, "--set", "ipu.layers_per_ipu=[2]",
                            "--set", "ipu.replication_factor=1", "--set", "ipu.available_memory_proportion=[0.6]",
                            "--set", "ipu.embedding_serialization_factor=1", "--set", "ipu.half_precision=false",
                            "--set", "ipu.enable_half_partials=false", "--set", "ipu.stochastic_rounding=false",
                            backend="mock")
    assert status == 0
    cpu_lines = [json.loads(x) for x in (tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines()]
    mock_lines = [json.loads(x) for x in (tmp_path / "mock" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in mock_lines] == [x["step"] for x in cpu_lines] == [3]
    assert abs(mock["last"]["loss"] - cpu["last"]["loss"]) <= 1e-5
    assert abs(mock["eval"]["loss"] - cpu["eval"]["loss"]) <= 1e-5


def _error(capsys, status, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_user_mistakes_are_one_line_errors(checkpoint, files, tmp_path, capsys):
    train = ("--set", f"finetune.train_file={files['train']}")
    status, _ = finetune(checkpoint, tmp_path / "a", *train, "--set", "finetune.label_column=category")
    _error(capsys, status, "no column 'category'", "columns: text, pair, label")
    out_of_range = write_rows(str(tmp_path / "ints.csv"), [{"text": "good", "label": 0}, {"text": "bad", "label": 7}],
                              ["text", "label"])
    status, _ = finetune(checkpoint, tmp_path / "b", "--set", f"finetune.train_file={out_of_range}",
                         "--set", f"finetune.validation_file={out_of_range}", "--set", "finetune.num_labels=3")
    _error(capsys, status, f"{out_of_range}: line 3: column 'label': label '7' is outside num_labels=3")
    long_text = write_rows(str(tmp_path / "long.csv"), [{"text": "good " * 100, "label": "pos"},
                                                         {"text": "bad", "label": "neg"}], ["text", "label"])
    status, _ = finetune(checkpoint, tmp_path / "c", "--set", f"finetune.train_file={long_text}",
                         "--set", f"finetune.validation_file={long_text}", "--set", "finetune.truncation=error")
    _error(capsys, status, f"{long_text}: line 2: ", "tokens, more than the maximum 64")
    status, _ = finetune(checkpoint, tmp_path / "d", "--set", f"finetune.train_file={long_text}",
                         "--set", f"finetune.validation_file={long_text}", "--steps", "1")
    assert status == 0 and "1 of 2 texts are longer than 64 tokens and were truncated" in capsys.readouterr().err
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    status, _ = finetune(checkpoint, tmp_path / "e", "--set", f"finetune.train_file={empty}")
    _error(capsys, status, "empty.csv: the file is empty")
    no_config = tmp_path / "not_a_checkpoint"
    no_config.mkdir()
    status, _ = finetune(str(no_config), tmp_path / "f", *train)
    _error(capsys, status, "no config.json")
    status, _ = finetune(checkpoint, tmp_path / "g", *train, "--set", "model.hidden_size=64")
    _error(capsys, status, "model.hidden_size=64 contradicts the checkpoint's hidden_size=32")
    # --init-checkpoint is a path, not YAML: "null" is a (missing) folder and "" is refused; neither
    # trains from scratch.
    argv = ["--config", "finetune_classification", "--output-dir", str(tmp_path / "h"), "--no-progress", *train]
    status = run.main(argv + ["--init-checkpoint", "null"])
    _error(capsys, status, "null: no such file or directory")
    with pytest.raises(SystemExit) as stopped:
        run.main(argv + ["--init-checkpoint", ""])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "got an empty one" in err[0], err
    assert not (tmp_path / "h").exists()
    before = {name: open(os.path.join(checkpoint, name), "rb").read() for name in sorted(os.listdir(checkpoint))}
    status, _ = finetune(checkpoint, checkpoint, *train)
    _error(capsys, status, "is the init checkpoint's directory")
    assert {name: open(os.path.join(checkpoint, name), "rb").read() for name in sorted(os.listdir(checkpoint))} == before


def test_interrupted_finetune_resumes_exactly_and_exports_from_its_checkpoint(checkpoint, files, tmp_path):
    """Killed after step 4 (checkpoint at 3), --resume gives the uninterrupted run's lines, weights,
    best model and eval; `python -m bert_packed.finetune export` rebuilds OUT/hf from checkpoint.pt."""
    import torch

    from backends.cpu import CPUBackend
    from bert_packed.io.checkpoint import load_checkpoint
    from bert_packed.config import load_config
    from bert_packed.finetune.__main__ import main as finetune_main
    from bert_packed.loop.train import train

    class Interrupted(CPUBackend):
        calls = 0

        def train_step(self, micro_batches):
            Interrupted.calls += 1
            if Interrupted.calls == 5:
                raise KeyboardInterrupt
            return super().train_step(micro_batches)

    config = load_config("finetune_classification", [
        f"model.init_checkpoint={checkpoint}", f"finetune.train_file={files['train']}",
        f"finetune.validation_file={files['dev']}", "data.max_sequence_length=64", "train.steps=6",
        "train.checkpoint_every=3", "train.eval_every=2", "train.num_threads=1"])
    full = train(config, CPUBackend(), output_dir=str(tmp_path / "full"), show_progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(config, Interrupted(), output_dir=str(tmp_path / "cut"), show_progress=False)
    assert load_checkpoint(str(tmp_path / "cut" / "checkpoint.pt"))["step"] == 3
    resumed = train(config, CPUBackend(), output_dir=str(tmp_path / "cut"), resume=True, show_progress=False)
    lines = {name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("full", "cut")}
    keys = ("loss", "accuracy", "sequences", "learning_rate")
    assert [[line[k] for k in keys] for line in lines["full"]] == [[line[k] for k in keys] for line in lines["cut"]]
    assert resumed["eval"] == full["eval"]
    a, b = (load_checkpoint(str(tmp_path / name / "checkpoint.pt"))["model"] for name in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert finetune_main(["export", str(tmp_path / "full"), "--output", str(tmp_path / "export")]) == 0
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert exported.config.id2label == {0: "neg", 1: "pos"}
    assert os.path.isfile(tmp_path / "export" / "tokenizer.json")  # the init checkpoint's tokenizer
    assert torch.equal(exported.classifier.weight, a["classifier.weight"])
