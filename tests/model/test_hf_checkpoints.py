"""Hugging Face checkpoints in and out: transformers-saved models load via init_checkpoint with
the same logits (packed, per sequence); our export loads with from_pretrained with the same
logits; tokenizers round-trip to identical ids; unusable checkpoints are one-line errors."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from bert_packed.io import hf_io  # noqa: E402
from bert_packed.model.build import bert_config  # noqa: E402
from bert_packed.collate import collate  # noqa: E402
from bert_packed.config import Config  # noqa: E402
from bert_packed.tasks.classification.data import collate_classification  # noqa: E402
from bert_packed.tasks.classification.model import BertForSequenceClassification  # noqa: E402
from bert_packed.tasks.data import encode_texts  # noqa: E402
from bert_packed.tasks.pretraining.model import BertForPreTraining  # noqa: E402
from finetune_fixtures import classification_rows, save_hf_checkpoint, write_vocab  # noqa: E402

TOL = 1e-5
TEXTS = [(r["text"], r["pair"]) for r in classification_rows(7, seed=3)]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return write_vocab(str(tmp_path_factory.mktemp("vocab")))


def ours_from(path, cls, **overrides):
    """Our model of class ``cls`` built the way a run builds it from model.init_checkpoint."""
    config = Config()
    config.data.max_sequence_length, config.data.max_sequences_per_pack = 64, 4
    pretrained = hf_io.read_pretrained(path)
    hf_io.resolve_model_config(config.model, pretrained)
    model = cls(bert_config(config, **overrides)).eval()
    summary = hf_io.load_weights(model, pretrained.state_dict, source=str(path))
    return model, pretrained, summary


def packed_inputs(tokenizer, pairs=True):
    """Our packed batch of TEXTS (4 per row at most) and each slot's text index."""
    texts, second = [t for t, _ in TEXTS], [p for _, p in TEXTS] if pairs else None
    encoded = encode_texts(tokenizer, texts, second, max_length=64)
    samples = {"input_ids": encoded.input_ids, "segment_ids": encoded.segment_ids,
               "labels": np.arange(len(texts)) % 2}
    # Packs of 3, 3, 1 sequences in rows of 128 tokens (positions restart: each stays < 64).
    from bert_packed.collate import PackSlice

    order = np.array([4, 0, 6, 2, 5, 1, 3])
    assignment = PackSlice(np.array([0, 3, 6, 7]), order)
    batch = collate_classification(samples, assignment, max_sequence_length=128, max_sequences_per_pack=4)
    return {k: torch.from_numpy(v) for k, v in batch.items()}, order, encoded


def hf_inputs(hf_tokenizer, pairs=True):
    texts, second = [t for t, _ in TEXTS], [p for _, p in TEXTS] if pairs else None
    return hf_tokenizer(texts, second, padding=True, return_tensors="pt")


def test_sequence_classification_checkpoint_loads_with_the_same_logits(tmp_path, vocab):
    directory = tmp_path / "clf"
    hf = save_hf_checkpoint(transformers, directory, vocab, "BertForSequenceClassification", seed=1,
                            num_labels=3, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})
    ours, pretrained, summary = ours_from(directory, BertForSequenceClassification, num_labels=3)
    assert "newly initialised" not in summary and "loaded 41 of 41" in summary, summary
    assert hf_io.label_maps(pretrained.hf_config)[0] == {0: "a", 1: "b", 2: "c"}
    tokenizer = hf_io.load_tokenizer(pretrained.tokenizer_path)
    batch, order, _ = packed_inputs(tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        reference = hf(**hf_inputs(hf_tokenizer)).logits
        fields = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions")
        logits = ours(**{k: batch[k] for k in fields})["logits"]
    present = batch["label_weights"] > 0
    difference = (logits[present] - reference[torch.from_numpy(order)]).abs().max().item()
    assert difference <= TOL, difference


@pytest.mark.parametrize("tied, safe", [(True, True), (False, False)])
def test_pretraining_checkpoint_loads_with_the_same_logits(tmp_path, vocab, tied, safe):
    """BertForPreTraining, tied (safetensors) and untied (pytorch_model.bin): MLM and NSP logits."""
    directory = tmp_path / "pt"
    hf = save_hf_checkpoint(transformers, directory, vocab, "BertForPreTraining", seed=2,
                            safe_serialization=safe, tie_word_embeddings=tied)
    assert os.path.isfile(directory / ("model.safetensors" if safe else "pytorch_model.bin"))
    if not tied:  # the untied decoder really differs from the embeddings
        assert not torch.equal(hf.cls.predictions.decoder.weight, hf.bert.embeddings.word_embeddings.weight)
    ours, pretrained, summary = ours_from(directory, BertForPreTraining, max_masked_tokens_per_pack=12)
    assert "newly initialised" not in summary and "not used" not in summary, summary
    assert ours.config.tie_word_embeddings is tied
    decoder, embeddings = ours.cls.predictions.decoder.weight, ours.bert.embeddings.word_embeddings.weight
    assert (decoder is embeddings) is tied
    tokenizer = hf_io.load_tokenizer(pretrained.tokenizer_path)
    encoded = encode_texts(tokenizer, [t for t, _ in TEXTS], [p for _, p in TEXTS], max_length=64)
    n = len(TEXTS)
    positions = np.zeros((n, 3), dtype=np.int64)
    positions[:, 0], positions[:, 1], positions[:, 2] = 1, 2, encoded.lengths - 2
    samples = {"input_ids": encoded.input_ids, "segment_ids": encoded.segment_ids,
               "masked_lm_positions": positions, "masked_lm_ids": np.ones_like(positions),
               "next_sentence_labels": np.zeros(n, dtype=np.int64)}
    from bert_packed.collate import PackSlice

    batch = collate(samples, PackSlice(np.array([0, 3, 6, 7]), np.arange(n)), max_sequence_length=128,
                    max_sequences_per_pack=4, max_masked_tokens_per_pack=12)
    batch = {k: torch.from_numpy(v) for k, v in batch.items()}
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        reference = hf(**hf_inputs(hf_tokenizer))
        out = ours(**batch)
    rows = torch.arange(n)[:, None].expand(-1, 3)
    hf_mlm = reference.prediction_logits[rows, torch.from_numpy(positions)]  # [n, 3, V]
    valid = batch["mlm_sequence_ids"] > 0
    assert (out["mlm_logits"][valid] - hf_mlm.reshape(-1, hf_mlm.shape[-1])).abs().max().item() <= TOL
    present = batch["nsp_weights"] > 0
    assert (out["nsp_logits"][present] - reference.seq_relationship_logits).abs().max().item() <= TOL


@pytest.mark.parametrize("architecture", ["BertForSequenceClassification", "BertForPreTraining"])
def test_our_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, vocab, architecture):
    source = tmp_path / "source"
    save_hf_checkpoint(transformers, source, vocab, "BertModel", seed=4, pad_token_id=None)
    if architecture == "BertForSequenceClassification":
        ours, pretrained, summary = ours_from(source, BertForSequenceClassification, num_labels=2,
                                              problem_type="single_label_classification")
        assert "newly initialised: classifier.bias, classifier.weight" in summary, summary
        auto = transformers.AutoModelForSequenceClassification
    else:
        ours, pretrained, summary = ours_from(source, BertForPreTraining, max_masked_tokens_per_pack=12)
        auto = transformers.AutoModelForPreTraining
    assert ours.config.pad_token_id is None  # pad_token_id: null honoured
    torch.manual_seed(0)
    with torch.no_grad():  # make the new heads non-trivial
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export = tmp_path / "export"
    hf_io.save_pretrained(ours, str(export), tokenizer=pretrained.tokenizer_path, id2label={0: "neg", 1: "pos"})
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"] == "bert"
    loaded = auto.from_pretrained(export, attn_implementation="eager").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    our_tokenizer = hf_io.load_tokenizer(export)
    inputs = hf_inputs(hf_tokenizer)
    batch, order, encoded = packed_inputs(our_tokenizer)
    with torch.no_grad():
        reference = loaded(**inputs)
        fields = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions")
        if architecture == "BertForSequenceClassification":
            assert loaded.config.id2label == {0: "neg", 1: "pos"}
            logits = ours(**{k: batch[k] for k in fields})["logits"]
            present = batch["label_weights"] > 0
            assert (logits[present] - reference.logits[torch.from_numpy(order)]).abs().max().item() <= TOL
        else:
            hidden = ours.bert(*(batch[k] for k in fields[:4]))
            pooled = ours.bert.pool(hidden, batch["cls_positions"])
            nsp = ours.cls.seq_relationship(pooled)
            present = batch["label_weights"] > 0
            assert (nsp[present] - reference.seq_relationship_logits[torch.from_numpy(order)]).abs().max().item() <= TOL
            assert torch.equal(loaded.cls.predictions.decoder.weight, ours.bert.embeddings.word_embeddings.weight)


def test_tokenizer_round_trip_gives_identical_ids(tmp_path, vocab):
    """transformers' tokenizer of a checkpoint, ours read from it (tokenizer.json and vocab.txt
    alone), and transformers' reading of our export: identical ids and segment ids."""
    directory = tmp_path / "tok"
    save_hf_checkpoint(transformers, directory, vocab, "BertModel")
    texts = [t for t, _ in TEXTS] + ["Unusualwords, UNSEEN-token! 42.", "ünïcödé accents"]
    pairs = [p for _, p in TEXTS] + ["x", "y"]
    expected = transformers.AutoTokenizer.from_pretrained(directory)(texts, pairs)
    only_vocab = tmp_path / "only_vocab"
    only_vocab.mkdir()
    (only_vocab / "vocab.txt").write_text(open(vocab).read())  # a bare BERT vocab.txt
    export = tmp_path / "export"
    hf_io.save_tokenizer(hf_io.load_tokenizer(directory), str(export), model_max_length=64)
    exported = transformers.AutoTokenizer.from_pretrained(export)(texts, pairs)
    assert exported["input_ids"] == expected["input_ids"]
    for source in (directory, only_vocab, export):
        encoded = encode_texts(hf_io.load_tokenizer(str(source)), texts, pairs, max_length=64)
        for i, ids in enumerate(expected["input_ids"]):
            assert encoded.input_ids[i, :encoded.lengths[i]].tolist() == ids, (source, i)
            assert encoded.segment_ids[i, :encoded.lengths[i]].tolist() == expected["token_type_ids"][i]


def test_unusable_checkpoints_are_one_line_errors(tmp_path, vocab):
    empty = tmp_path / "no_config"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(hf_io.CheckpointError, match="no config.json"):
        hf_io.read_pretrained(str(empty))
    with pytest.raises(hf_io.CheckpointError, match="no such file"):
        hf_io.read_pretrained(str(tmp_path / "missing"))
    directory = tmp_path / "ok"
    save_hf_checkpoint(transformers, directory, vocab, "BertModel")
    config = Config()
    config.model.hidden_size = 64  # the checkpoint has 32
    with pytest.raises(hf_io.CheckpointError, match="model.hidden_size=64 contradicts the checkpoint's hidden_size=32"):
        hf_io.resolve_model_config(config.model, hf_io.read_pretrained(str(directory)))
    config = Config()
    config.model.hidden_size = 32  # agreeing is fine
    hf_io.resolve_model_config(config.model, hf_io.read_pretrained(str(directory)))
    assert config.model.num_hidden_layers == 2 and config.model.vocab_size == 120
