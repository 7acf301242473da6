"""Synthetic named-entity data for the token-classification tests (no downloads): sentences of
filler words and entities whose tags follow from the words (first names B-PER, surnames I-PER,
cities B-LOC, company names B-ORG + I-ORG suffixes; two names a person or a place by the
word before them), a WordPiece vocabulary small enough that
the long names split into several sub-tokens, a tiny Hugging Face checkpoint, and writers for
the three input formats (JSON lines, CoNLL text, a ``datasets`` directory)."""
from __future__ import annotations

import json
import os
import random

from finetune_fixtures import save_hf_checkpoint

FIRST = "alice bob carol david emma frank grace henry".split()
LAST = "smithsonian johnstonbury williamsford brownstone".split()
CITIES = "paris london berlin madrid tokyo lisbon".split()
COMPANIES = "acme globex initech umbrella".split()
SUFFIXES = "corporation incorporated".split()
FILLER = "the a visited met with in at from saw likes works for and today yesterday".split()
# Names that are a person after "met"/"saw" and a place after "in"/"from"/"visited": only the
# context tells (the model must attend within its own sentence).
AMBIGUOUS = "jordan georgia".split()
TAGS = ["O", "B-PER", "I-PER", "B-LOC", "B-ORG", "I-ORG"]  # a ClassLabel order (string tags get theirs sorted)


def entity(rng: random.Random):
    if rng.random() < 0.25:
        kind = rng.choice(["PER", "LOC"])
        cue = rng.choice(["met", "saw"] if kind == "PER" else ["in", "from", "visited"])
        return [cue, rng.choice(AMBIGUOUS)], ["O", f"B-{kind}"]
    kind = rng.choice(["PER", "LOC", "ORG"])
    if kind == "PER":
        words = [rng.choice(FIRST)] + ([rng.choice(LAST)] if rng.random() < 0.6 else [])
    elif kind == "LOC":
        words = [rng.choice(CITIES)]
    else:
        words = [rng.choice(COMPANIES)] + ([rng.choice(SUFFIXES)] if rng.random() < 0.7 else [])
    return words, [f"B-{kind}"] + [f"I-{kind}"] * (len(words) - 1)


def ner_sentences(n: int, seed: int, min_parts: int = 2, max_parts: int = 9):
    """``n`` sentences as (words, tags) with IOB2 string tags."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(min_parts, max_parts)):
            if rng.random() < 0.35:
                w, t = entity(rng)
            else:
                w, t = [rng.choice(FILLER)], ["O"]
            words += w
            tags += t
        out.append((words, tags))
    return out


def write_jsonl(path, sentences, tokens_column="tokens", tags_column="ner_tags"):
    with open(path, "w") as f:
        for words, tags in sentences:
            f.write(json.dumps({tokens_column: words, tags_column: tags}) + "\n")
    return str(path)


def write_conll(path, sentences, docstart=True):
    """CoNLL-2003 style: ``word POS chunk tag`` per line, -DOCSTART- lines, blank lines between sentences."""
    with open(path, "w") as f:
        if docstart:
            f.write("-DOCSTART- -X- -X- O\n\n")
        for i, (words, tags) in enumerate(sentences):
            for word, tag in zip(words, tags):
                f.write(f"{word} NN I-NP {tag}\n")
            f.write("\n")
            if docstart and i == len(sentences) // 2:
                f.write("-DOCSTART- -X- -X- O\n\n")
    return str(path)


def write_dataset(path, sentences, class_label=True, names=TAGS):
    """A ``datasets`` directory (``save_to_disk``): integer tags with a ClassLabel, or strings."""
    import datasets

    words = [w for w, _ in sentences]
    if class_label:
        ids = {name: i for i, name in enumerate(names)}
        features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                      "ner_tags": datasets.Sequence(datasets.ClassLabel(names=list(names)))})
        table = {"tokens": words, "ner_tags": [[ids[t] for t in tags] for _, tags in sentences]}
    else:
        features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                      "ner_tags": datasets.Sequence(datasets.Value("string"))})
        table = {"tokens": words, "ner_tags": [tags for _, tags in sentences]}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(path))
    return str(path)


def write_ner_vocab(directory, size: int = 180) -> str:
    """A WordPiece vocab.txt trained on the synthetic sentences; small, so long names split."""
    from bert_packed.data.prepare.vocab import train_vocab

    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        for words, _ in ner_sentences(400, 99):
            f.write(" ".join(words) + "\n")
    vocab = os.path.join(directory, "vocab.txt")
    train_vocab(corpus, size, vocab, min_frequency=1)
    return vocab


def ner_checkpoint(transformers, directory, **config_overrides) -> str:
    """A tiny randomly initialised BertForPreTraining with the synthetic vocabulary, saved by transformers."""
    vocab = write_ner_vocab(os.path.join(directory, "vocab"))
    save_hf_checkpoint(transformers, os.path.join(directory, "bert"), vocab, "BertForPreTraining", **config_overrides)
    return os.path.join(directory, "bert")
