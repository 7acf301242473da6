"""Lengths and masks come from the tokenizer, never from id values (issue 37, kind 1).

A vocabulary may put any token at id 0: the ``tokenizers`` quick tour trains one with
``[UNK]`` first. Counting a sequence's non-zero ids then cuts every unknown word off in
silence. Property: for random vocabulary orders with [PAD] not at id 0 (and one with [UNK] at
0), classification (``predict`` on an export), token classification and question answering
give transformers' logits for the same weights, transformers fed by its own tokenizer.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from finetune_fixtures import WORDS, save_hf_checkpoint, write_rows

transformers = pytest.importorskip("transformers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
UNKNOWN = ["\u2603", "\u6f22", "\u00e6\u00f0"]  # characters no vocabulary here holds: [UNK]
TOLERANCE = 1e-4  # fp32; predict rounds logits to 6 decimals
INIT = 0.3  # weights large enough that a lost token moves the logits far beyond TOLERANCE


def shuffled_vocab(path: str, words, seed: int) -> str:
    """A vocab.txt of the specials, every character (and its ##-continuation) of ``words`` and the
    words, in a random order with [PAD] not at id 0; seed 0 puts [UNK] at id 0 (the quick tour)."""
    chars = sorted({c for w in words for c in w})
    tokens = SPECIALS + chars + ["##" + c for c in chars] + sorted(set(words) - set(chars))
    rng = random.Random(seed)
    rng.shuffle(tokens)
    first = "[UNK]" if seed == 0 else rng.choice([t for t in tokens if t != "[PAD]"])
    tokens.remove(first)
    tokens.insert(0, first)
    assert tokens.index("[PAD]") != 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(tokens) + "\n")
    return path


def hf_tokenizer(vocab: str):
    """transformers' own tokenizer of ``vocab`` (transformers 5 takes it as ``vocab``, 4.x as ``vocab_file``)."""
    import inspect

    takes_vocab = "vocab" in inspect.signature(transformers.BertTokenizerFast.__init__).parameters
    tokenizer = transformers.BertTokenizerFast(**{"vocab" if takes_vocab else "vocab_file": vocab})
    assert tokenizer.convert_tokens_to_ids("[CLS]") == open(vocab).read().split().index("[CLS]")
    return tokenizer


def sentences(seed: int, n: int = 12):
    """Texts of known words with unknown ones among them (each an [UNK] token)."""
    rng = random.Random(seed)
    words = WORDS["pos"] + WORDS["neg"] + WORDS["filler"]
    out = []
    for _ in range(n):
        text = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        for _ in range(rng.randint(1, 3)):
            text.insert(rng.randrange(len(text) + 1), rng.choice(UNKNOWN))
        out.append(text)
    return out


def all_words():
    return WORDS["pos"] + WORDS["neg"] + WORDS["filler"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predict_gives_transformers_logits_whatever_id_0_is(tmp_path, seed, one_thread, capsys):
    from bert_packed.finetune.__main__ import main

    vocab = shuffled_vocab(str(tmp_path / "vocab" / "vocab.txt"), all_words(), seed)
    model_dir = str(tmp_path / "model")
    hf = save_hf_checkpoint(transformers, model_dir, vocab, "BertForSequenceClassification", seed=seed,
                            num_labels=3, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2},
                            initializer_range=INIT)
    texts = [" ".join(words) for words in sentences(seed)]
    tokenizer = hf_tokenizer(vocab)
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    unk = tokenizer.convert_tokens_to_ids("[UNK]")
    assert (inputs["input_ids"][inputs["attention_mask"].bool()] == unk).sum() >= len(texts)  # unknown words
    with torch.no_grad():
        expected = hf(**inputs).logits.numpy()
    data = write_rows(str(tmp_path / "input.csv"), [{"text": t} for t in texts], ["text"])
    output = str(tmp_path / "predictions.jsonl")
    assert main(["predict", "--model", model_dir, "--input", data, "--output", output]) == 0, capsys.readouterr().err
    with open(output) as f:
        got = np.array([json.loads(line)["logits"] for line in f], dtype=np.float32)
    assert np.abs(got - expected).max() <= TOLERANCE


@pytest.mark.parametrize("seed", [0, 3])
def test_token_classification_gives_transformers_logits_whatever_id_0_is(tmp_path, seed, one_thread):
    from bert_packed.io import hf_io
    from bert_packed.tasks import data as ft_data
    from bert_packed.tasks.token_classification.data import TagSet, collate_token_classification, encode_sentences
    from bert_packed.tasks.token_classification.model import BertForTokenClassification
    from bert_packed.model.modeling import BertConfig
    from finetune_fixtures import tiny_hf_config

    vocab = shuffled_vocab(str(tmp_path / "vocab.txt"), all_words(), seed)
    words = sentences(seed)
    tags = [["O"] * len(w) for w in words]
    tag_set = TagSet({0: "O", 1: "B-X"})
    ours_tokenizer = hf_io.load_tokenizer(vocab)
    encoded = encode_sentences(ours_tokenizer, words, tags, tag_set, max_length=64)
    torch.manual_seed(seed)
    hf = transformers.BertForTokenClassification(tiny_hf_config(
        transformers, len(open(vocab).read().split()), num_labels=2, attn_implementation="eager",
        initializer_range=INIT)).eval()
    ours = BertForTokenClassification(BertConfig.from_hf(hf.config.to_dict(), max_sequences_per_pack=6)).eval()
    ours.load_hf_state_dict(hf.state_dict())
    dataset = ft_data.PackedDataset(encoded, {"labels": encoded.labels},
                                    lambda s, a: collate_token_classification(s, a, max_sequence_length=64,
                                                                              max_sequences_per_pack=6),
                                    max_sequence_length=64, max_sequences_per_pack=6, algorithm="lpfhp", seed=0)
    inputs = hf_tokenizer(vocab)(words, is_split_into_words=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf(**inputs).logits.numpy()
        seen = 0
        for batch, rows in dataset.batches(4):
            out = ours(**{k: torch.from_numpy(v) for k, v in batch.items()})["logits"].numpy()
            for b, k in zip(*np.nonzero(rows >= 0)):
                i, start = int(rows[b, k]), int(batch["cls_positions"][b, k])
                n = int(inputs["attention_mask"][i].sum())
                assert int(encoded.lengths[i]) == n  # the tokenizer's length, [UNK]s included
                assert np.abs(out[b, start:start + n] - expected[i, :n]).max() <= TOLERANCE
                seen += 1
    assert seen == len(words)


@pytest.mark.parametrize("seed", [0, 4])
def test_question_answering_gives_transformers_logits_whatever_id_0_is(tmp_path, seed, one_thread):
    from bert_packed.io import hf_io
    from bert_packed.collate import slice_assignment
    from bert_packed.tasks.squad.data import (SquadExample, build_features, collate_question_answering,
                                                 feature_slots, pack_features)
    from bert_packed.tasks.squad.metrics import feature_logits
    from bert_packed.tasks.squad.model import BertForQuestionAnswering
    from bert_packed.model.modeling import BertConfig
    from finetune_fixtures import tiny_hf_config

    S, K = 64, 4
    vocab = shuffled_vocab(str(tmp_path / "vocab.txt"), all_words(), seed)
    texts = sentences(seed, 16)
    examples = [SquadExample(id=str(i), question=" ".join(texts[i][:3]) + " ?", context=" ".join(texts[i]))
                for i in range(len(texts))]
    features = build_features(examples, hf_io.load_tokenizer(vocab), max_seq_length=S, doc_stride=8,
                              max_query_length=16)
    assert features.num_features == len(examples)  # one window each: comparable row by row
    torch.manual_seed(seed)
    hf = transformers.BertForQuestionAnswering(tiny_hf_config(
        transformers, len(open(vocab).read().split()), attn_implementation="eager", initializer_range=INIT)).eval()
    ours = BertForQuestionAnswering(BertConfig.from_hf(hf.config.to_dict(), max_sequences_per_pack=K)).eval()
    ours.load_hf_state_dict(hf.state_dict())
    inputs = hf_tokenizer(vocab)([e.question for e in examples], [e.context for e in examples], padding=True,
                                 return_tensors="pt")
    assignment = pack_features(features.lengths, max_sequence_length=S, max_sequences_per_pack=K)
    start = np.zeros((features.num_features, S), np.float32)
    end = np.zeros_like(start)
    with torch.no_grad():
        theirs = hf(**inputs)
        batch = collate_question_answering(features.samples(), slice_assignment(assignment, 0, assignment.num_packs),
                                           max_sequence_length=S, max_sequences_per_pack=K)
        out = ours(**{k: torch.as_tensor(v) for k, v in batch.items()})
        feature_logits(batch, out["start_logits"].numpy(), out["end_logits"].numpy(), feature_slots(assignment, K),
                       start, end)
    for i in range(len(examples)):
        n = int(inputs["attention_mask"][i].sum())
        assert int(features.lengths[i]) == n
        assert np.abs(start[i, :n] - theirs.start_logits[i, :n].numpy()).max() <= TOLERANCE
        assert np.abs(end[i, :n] - theirs.end_logits[i, :n].numpy()).max() <= TOLERANCE
