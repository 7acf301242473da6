"""SQuAD fine-tuning end to end through run.py (the issue's contract): packed and padded runs,
OUT/predictions.json, OUT/summary.json eval.exact_match / eval.f1, OUT/hf loadable with
AutoModelForQuestionAnswering (same logits as ours), one-line errors for user mistakes."""
import json

import pytest
import torch

import run
from bert_packed.tasks.squad.data import build_features, read_squad
from bert_packed.tasks.squad.metrics import squad_scores
from squad_fixtures import corpus_texts, make_squad_v2, make_tokenizer, write_squad

transformers = pytest.importorskip("transformers")

S, STRIDE, QUERY = 128, 32, 24


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Train / dev SQuAD v2.0 files and a tiny Hugging Face BertForPreTraining checkpoint with its tokenizer."""
    root = tmp_path_factory.mktemp("squad")
    train, dev = make_squad_v2(seed=0, num_paragraphs=8), make_squad_v2(seed=1, num_paragraphs=4)
    tokenizer = make_tokenizer(corpus_texts(train) + corpus_texts(dev))
    config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=S)
    torch.manual_seed(0)
    transformers.BertForPreTraining(config).save_pretrained(root / "ckpt")
    tokenizer.save(str(root / "ckpt" / "tokenizer.json"))
    return {"root": root, "train": write_squad(root / "train.json", train), "dev": write_squad(root / "dev.json", dev),
            "ckpt": str(root / "ckpt"), "tokenizer": tokenizer}


def _args(job, out, *extra):
    return ["--config", "finetune_squad", "--init-checkpoint", job["ckpt"], "--output-dir", str(out), "--no-progress",
            "--set", f"finetune.train_file={job['train']}", "--set", f"finetune.validation_file={job['dev']}",
            "--set", f"data.max_sequence_length={S}", "--set", f"finetune.doc_stride={STRIDE}",
            "--set", f"finetune.max_query_length={QUERY}", "--set", "train.global_batch_size=null",
            "--set", "train.micro_batch_size=8", "--set", "train.gradient_accumulation=1",
            "--set", "optimizer.learning_rate=0.001", "--set", "train.num_threads=1",
            "--set", "train.checkpoint_every=0", "--set", "train.tensorboard=false",
            # No dropout: the comparisons below are exact, and dropout's masks cost more than this model.
            "--set", "model.hidden_dropout_prob=0.0", "--set", "model.attention_probs_dropout_prob=0.0", *extra]


@pytest.fixture(scope="module")
def runs(job):
    """One epoch packed and one padded (same seed, same data)."""
    out = {}
    for name, extra in (("packed", []), ("padded", ["--set", "finetune.packing=false"])):
        directory = job["root"] / name
        assert run.main(_args(job, directory, "--set", "finetune.epochs=1", *extra)) == 0
        out[name] = directory
    return out


def test_outputs_follow_the_contract(job, runs):
    dev = read_squad(job["dev"])
    for directory in runs.values():
        summary = json.loads((directory / "summary.json").read_text())
        predictions = json.loads((directory / "predictions.json").read_text())
        assert set(predictions) == {ex.id for ex in dev}
        contexts = {ex.id: ex.context for ex in dev}
        assert all(text in contexts[key] for key, text in predictions.items())  # spans of the context, or ""
        scores = squad_scores(predictions, dev)
        assert summary["eval"]["exact_match"] == pytest.approx(scores["exact_match"])
        assert summary["eval"]["f1"] == pytest.approx(scores["f1"])
        assert 0.0 <= summary["eval"]["exact_match"] <= summary["eval"]["f1"] <= 100.0
        assert "no_ans_f1" in summary["eval"]  # v2.0 data: the split scores too
        odds = json.loads((directory / "null_odds.json").read_text())
        assert set(odds) == set(predictions)
    packed, padded = (json.loads((runs[k] / "summary.json").read_text()) for k in ("packed", "padded"))
    # One epoch each: the same windows, in fewer rows when packed.
    assert packed["data_packing"]["num_sequences"] == padded["data_packing"]["num_sequences"]
    assert padded["data_packing"]["max_sequences_per_pack"] == 1
    assert packed["data_packing"]["num_packs"] < padded["data_packing"]["num_packs"]
    assert packed["steps"] < padded["steps"]


def test_export_loads_in_transformers_with_our_logits(job, runs):
    from bert_packed.io import hf_io
    from bert_packed.tasks.squad.model import BertForQuestionAnswering
    from bert_packed.model.modeling import BertConfig

    directory = runs["packed"] / "hf"
    theirs = transformers.AutoModelForQuestionAnswering.from_pretrained(directory).eval()
    assert type(theirs).__name__ == "BertForQuestionAnswering"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    dev = read_squad(job["dev"])[:12]
    features = build_features(dev, job["tokenizer"], max_seq_length=S, doc_stride=STRIDE, max_query_length=QUERY)
    hf_ids = tokenizer([ex.question for ex in dev], [ex.context for ex in dev], truncation="only_second",
                       max_length=S, stride=STRIDE, return_overflowing_tokens=True)["input_ids"]
    assert [list(ids) for ids in hf_ids] == [list(row[:n]) for row, n in zip(features.input_ids, features.lengths)]

    pretrained = hf_io.read_pretrained(str(directory))
    ours = BertForQuestionAnswering(BertConfig.from_hf(pretrained.hf_config, max_sequences_per_pack=1)).eval()
    assert "newly initialised" not in hf_io.load_weights(ours, pretrained.state_dict, source=str(directory))
    ids, mask = torch.as_tensor(features.input_ids), torch.as_tensor(features.input_mask)
    positions = torch.arange(S).expand_as(ids) * mask
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask, token_type_ids=torch.as_tensor(features.segment_ids))
        got = ours(ids, torch.as_tensor(features.segment_ids), positions, mask)
    real = mask.bool()
    assert (expected.start_logits - got["start_logits"])[real].abs().max() <= 1e-5
    assert (expected.end_logits - got["end_logits"])[real].abs().max() <= 1e-5


@pytest.mark.parametrize("extra, needle", [
    (["--set", "finetune.train_file=null"], "finetune.train_file"),
    (["--set", "finetune.doc_stride=200"], "doc_stride"),
    (["--set", "finetune.n_best_size=0"], "n_best_size"),
])
def test_user_mistakes_are_one_line_errors(job, tmp_path, capsys, extra, needle):
    assert run.main(_args(job, tmp_path / "out", "--steps", "1", *extra)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1], lines


def test_a_bad_squad_file_is_a_one_line_error(job, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "abc", "qas": [
        {"id": "1", "question": "q", "answers": [{"text": "zz", "answer_start": 0}]}]}]}]}))
    assert run.main(_args(job, tmp_path / "out", "--steps", "1", "--set", f"finetune.train_file={bad}")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "does not occur in its context" in err and str(bad) in err


def test_mock_ipu_path_trains_the_cpu_steps(job, tmp_path):
    """The IPU code path (mock poptorch: fixed pack shape, pipeline annotations, fp32) gives the cpu
    run's losses, evaluation and answers on the question-answering model."""
    common = ("--steps", "3", "--set", "train.micro_batch_size=4", "--set", "train.gradient_accumulation=2")
    assert run.main(_args(job, tmp_path / "cpu", *common)) == 0
    assert run.main(_args(job, tmp_path / "mock", *common, "--backend", "mock", "--set", "ipu.layers_per_ipu=[2]",
                          "--set", "ipu.replication_factor=1", "--set", "ipu.device_iterations=1",
                          "--set", "ipu.available_memory_proportion=[0.6]", "--set", "ipu.half_precision=false",
                          "--set", "ipu.enable_half_partials=false", "--set", "ipu.stochastic_rounding=false")) == 0
    cpu, mock = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("cpu", "mock"))
    assert mock["backend"] == "mock"
    assert abs(mock["last"]["loss"] - cpu["last"]["loss"]) <= 1e-5
    assert abs(mock["eval"]["loss"] - cpu["eval"]["loss"]) <= 1e-5
    answers = [json.loads((tmp_path / name / "predictions.json").read_text()) for name in ("cpu", "mock")]
    assert answers[0] == answers[1]
