"""Shared helpers for the fine-tuning and Hugging Face tests: a WordPiece vocabulary trained
locally with `tokenizers` (no hub), tiny checkpoints saved by `transformers`, small labelled files."""
from __future__ import annotations

import csv
import json
import os
import random

WORDS = {
    "pos": "good great fine happy nice lovely bright warm".split(),
    "neg": "bad awful sad poor ugly terrible dark cold".split(),
    "filler": "the a cat dog runs sits on mat and with over under house tree river".split(),
}


def sentence(rng: random.Random, label: str, min_words: int = 3, max_words: int = 20) -> str:
    """Filler words with some of the label's words: learnable from the words alone."""
    n = rng.randint(min_words, max_words)
    return " ".join(rng.choice(WORDS[label] if rng.random() < 0.35 else WORDS["filler"]) for _ in range(n))


def write_vocab(directory: str, size: int = 120) -> str:
    """Train a WordPiece vocab.txt on generated text (bert_packed.data.prepare.vocab, i.e. `tokenizers`)."""
    from bert_packed.data.prepare.vocab import train_vocab

    rng = random.Random(0)
    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        for _ in range(400):
            f.write(sentence(rng, rng.choice(["pos", "neg"])) + " Unusualwords, punctuation! 42.\n")
    vocab = os.path.join(directory, "vocab.txt")
    train_vocab(corpus, size, vocab, min_frequency=1)
    return vocab


def tiny_hf_config(transformers, vocab_size: int, **overrides):
    values = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    values.update(overrides)
    return transformers.BertConfig(**values)


def save_hf_checkpoint(transformers, directory: str, vocab: str, cls_name: str = "BertForPreTraining", *,
                       seed: int = 0, safe_serialization: bool = True, **config_overrides):
    """A randomly initialised transformers model of class ``cls_name`` and its tokenizer, saved
    with ``save_pretrained`` (as a user's downloaded checkpoint would be); returns the model."""
    import torch

    import inspect

    # transformers 5 takes the vocabulary as `vocab`, 4.x as `vocab_file`.
    takes_vocab = "vocab" in inspect.signature(transformers.BertTokenizerFast.__init__).parameters
    tokenizer = transformers.BertTokenizerFast(**{"vocab" if takes_vocab else "vocab_file": vocab})
    assert len(tokenizer.get_vocab()) > 50, "the tokenizer did not read the vocabulary"
    config = tiny_hf_config(transformers, len(tokenizer.get_vocab()), **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    model.save_pretrained(directory, safe_serialization=safe_serialization)
    tokenizer.save_pretrained(directory)
    safetensors_path = os.path.join(directory, "model.safetensors")
    if not safe_serialization and os.path.isfile(safetensors_path):
        # transformers 5 writes safetensors only; older checkpoints (and 4.x) are pytorch_model.bin.
        from safetensors.torch import load_file

        torch.save(load_file(safetensors_path), os.path.join(directory, "pytorch_model.bin"))
        os.unlink(safetensors_path)
    return model


def write_rows(path: str, rows, columns) -> str:
    """Rows (dicts) as CSV, TSV or JSON lines by the extension of ``path``."""
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps({c: row[c] for c in columns}) + "\n")
        return path
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t" if path.endswith(".tsv") else ",")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([row[c] for c in columns])
    return path


def classification_rows(n: int, seed: int, problem_type: str = "single_label_classification"):
    """Rows with ``text``, ``pair`` and ``label`` for the problem type: names pos/neg; lists of
    names (multi-label: which of pos/neg/filler-heavy); a score in [0, 1] (regression)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        text, pair = sentence(rng, label), sentence(rng, rng.choice(["pos", "neg"]), 2, 8)
        if problem_type == "multi_label_classification":
            value = [label] + (["long"] if len(text.split()) > 10 else [])
        elif problem_type == "regression":
            words = text.split()
            value = round(sum(w in WORDS["pos"] for w in words) / len(words), 4)
        else:
            value = label
        rows.append({"text": text, "pair": pair, "label": value})
    return rows


def tiny_pretraining_checkpoint(transformers, directory):
    """A tiny Hugging Face BertForPreTraining in ``directory/bert`` with its fast tokenizer (the
    hostile fine-tuning tests' module-scoped checkpoint); returns that path."""
    vocab = write_vocab(str(directory / "vocab"))
    save_hf_checkpoint(transformers, str(directory / "bert"), vocab, "BertForPreTraining")
    return directory / "bert"
