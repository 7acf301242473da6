"""A SQuAD v2.0 test set written by the tests: template questions over an embedded corpus.

Every paragraph is a run of facts ("Mara Quill restored the chapel of Eastwick in
1674.") with filler sentences between them; questions ask for the person, the year, the
town or the thing of one fact, and unanswerable (v2.0) questions ask about a thing and
town that no fact of that paragraph mentions. Long paragraphs need several windows at the
tests' ``max_seq_length``, and with a fact every sentence or two some answers land on a
window's first or last context token or straddle a window edge (tests check that they do).
Deterministic for a seed; no file, no download.
"""
from __future__ import annotations

import json
import random
from typing import Any, Dict, List

FIRST_NAMES = ("Mara", "Elias", "Tobin", "Wren", "Hester", "Abel", "Ione", "Caspar", "Delia", "Rufus", "Sabine",
               "Otto", "Linnea", "Jasper", "Perpetua", "Silas", "Agnes", "Bram", "Cora", "Edmund")
SURNAMES = ("Quill", "Thorne", "Ashby", "Marlowe", "Penhallow", "Vance", "Greaves", "Holloway", "Tressider",
            "Blackwood", "Fenwick", "Oakes", "Ransome", "Yardley", "Winterbourne", "Calloway")
TOWNS = ("Eastwick", "Harrowgate", "Millbrook", "Oxmere", "Kestrel Vale", "Saltmarsh", "Dunmore", "Ferrybridge",
         "Larkhill", "Ravensfold", "Thistledown", "Westerby", "Coldharbour", "Briarwood")
THINGS = ("chapel", "mill", "bridge", "library", "market hall", "lighthouse", "school", "tannery", "granary",
          "clock tower", "harbour wall", "almshouse")
# (past tense, base form)
VERBS = (("built", "build"), ("restored", "restore"), ("sold", "sell"), ("painted", "paint"),
         ("founded", "found"), ("repaired", "repair"))
FILLER = (
    "The winter that followed was long, and the roads were closed for many weeks.",
    "Most of the town's records from that time were later lost in a fire.",
    "Travellers often remarked on the smell of salt and woodsmoke in the lanes.",
    "A fair was held every autumn on the common below the church.",
    "The river rose twice in that decade and flooded the lower streets.",
    "Local accounts disagree about many of the details.",
    "Several families moved north in search of work at the mines.",
    "The parish bought a new bell, which cracked within a year.",
    "Letters from the period describe hard harvests and high prices.",
    "Nobody now remembers who first planted the long avenue of limes.",
)


def _fact(rng: random.Random, used: Dict[str, set]) -> Dict[str, str]:
    """A fact whose person, year and (thing, town) are unique within its paragraph."""
    while True:
        person = f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"
        year = str(rng.randrange(1500, 1900))
        thing, town = rng.choice(THINGS), rng.choice(TOWNS)
        if person not in used["person"] and year not in used["year"] and (thing, town) not in used["pair"]:
            break
    used["person"].add(person)
    used["year"].add(year)
    used["pair"].add((thing, town))
    past, base = rng.choice(VERBS)
    return {"person": person, "year": year, "thing": thing, "town": town, "past": past, "base": base}


def _paragraph(rng: random.Random, num_facts: int, filler_rate: float):
    used: Dict[str, set] = {"person": set(), "year": set(), "pair": set()}
    facts, sentences = [], []
    for _ in range(num_facts):
        fact = _fact(rng, used)
        if rng.random() < 0.5:
            sentence = f"{fact['person']} {fact['past']} the {fact['thing']} of {fact['town']} in {fact['year']}."
        else:
            sentence = f"In {fact['year']}, {fact['person']} {fact['past']} the {fact['thing']} of {fact['town']}."
        sentences.append(sentence)
        facts.append(fact)
        while rng.random() < filler_rate:
            sentences.append(rng.choice(FILLER))
    return " ".join(sentences), facts, used


def _answer(context: str, text: str) -> Dict[str, Any]:
    start = context.index(text)
    return {"text": text, "answer_start": start}


def _questions(rng: random.Random, context: str, fact: Dict[str, str]) -> List[Dict[str, Any]]:
    p, y, th, tw, past, base = (fact[k] for k in ("person", "year", "thing", "town", "past", "base"))
    sentence_start = max(context.find(f"{p} {past}"), 0)
    pick = rng.randrange(4)
    if pick == 0:
        question, text = f"Who {past} the {th} of {tw}?", p
    elif pick == 1:
        question, text = f"In what year did {p} {base} the {th} of {tw}?", y
    elif pick == 2:
        question, text = f"Which town's {th} did {p} {base}?", tw
    else:
        question, text = f"What did {p} {base} in {y}?", f"the {th} of {tw}"
    # The answer occurrence inside this fact's own sentence (names may repeat across facts).
    start = context.find(text, max(0, sentence_start - 12) if pick == 1 else sentence_start)
    assert start >= 0, (context, text)
    answers = [{"text": text, "answer_start": start}]
    if pick == 3:  # a second gold answer without the article, as SQuAD's crowd answers vary
        answers.append({"text": f"{th} of {tw}", "answer_start": start + 4})
    return [{"question": question, "answers": answers, "is_impossible": False}]


def _impossible(rng: random.Random, used: Dict[str, set]) -> Dict[str, Any]:
    while True:
        thing, town = rng.choice(THINGS), rng.choice(TOWNS)
        if (thing, town) not in used["pair"]:
            break
    past, _ = rng.choice(VERBS)
    return {"question": f"Who {past} the {thing} of {town}?", "answers": [], "is_impossible": True}


def make_squad_v2(seed: int = 0, num_paragraphs: int = 40, long_every: int = 4) -> Dict[str, Any]:
    """A SQuAD v2.0 document: ``num_paragraphs`` paragraphs, every ``long_every``-th one long
    (10-14 facts, about 300 tokens), the others 2-6 facts; about 5 questions per
    short paragraph, many more per long one, and one or two unanswerable ones each."""
    rng = random.Random(seed)
    data = []
    counter = 0
    for number in range(num_paragraphs):
        long = number % long_every == long_every - 1
        num_facts = rng.randrange(10, 15) if long else rng.randrange(2, 7)
        context, facts, used = _paragraph(rng, num_facts, filler_rate=0.45 if long else 0.3)
        qas = []
        for fact in facts:
            for qa in _questions(rng, context, fact):
                counter += 1
                qa["id"] = f"q{seed}-{counter:05d}"
                qas.append(qa)
        for _ in range(1 + (number % 2)):
            qa = _impossible(rng, used)
            counter += 1
            qa["id"] = f"q{seed}-{counter:05d}"
            qas.append(qa)
        data.append({"title": f"Chronicle {number + 1}", "paragraphs": [{"context": context, "qas": qas}]})
    return {"version": "v2.0", "data": data}


def write_squad(path, document: Dict[str, Any]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)
    return str(path)


def corpus_texts(document: Dict[str, Any]) -> List[str]:
    """Every context and question (for training the tests' WordPiece vocabulary)."""
    texts = []
    for article in document["data"]:
        for paragraph in article["paragraphs"]:
            texts.append(paragraph["context"])
            texts.extend(qa["question"] for qa in paragraph["qas"])
    return texts


def make_tokenizer(texts: List[str], vocab_size: int = 300):
    """A lower-casing BERT WordPiece tokenizer (``tokenizers``) for ``texts``, deterministic.

    (``tokenizers``' WordPiece trainer breaks frequency ties in hash order, which differs
    between processes; the tests need the same windows every run.) The vocabulary: the special
    tokens, every character and its ``##`` continuation, then the most frequent words (ties
    alphabetical) up to ``vocab_size``; rarer words (most years, some names) are split into
    word pieces, so answers also start and end inside multi-piece words.
    """
    from collections import Counter

    from tokenizers import BertWordPieceTokenizer, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts: Counter = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in counts for c in word})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars]
    words = [w for w, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if w not in vocab]
    vocab += words[:max(0, vocab_size - len(vocab))]
    backend = BertWordPieceTokenizer({token: i for i, token in enumerate(vocab)}, lowercase=True)._tokenizer
    # BERT's pair template, as Hugging Face's converted tokenizers have it.
    backend.post_processor = TemplateProcessing(single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
                                                special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return backend


def make_features(max_seq_length: int, doc_stride: int, max_query_length: int, seed: int = 0):
    """``(document, examples, tokenizer, features)`` of ``make_squad_v2(seed)`` with its own tokenizer."""
    from bert_packed.tasks.squad.data import build_features, examples_from_squad_json

    document = make_squad_v2(seed=seed)
    examples = examples_from_squad_json(document)
    tokenizer = make_tokenizer(corpus_texts(document))
    features = build_features(examples, tokenizer, max_seq_length=max_seq_length, doc_stride=doc_stride,
                              max_query_length=max_query_length)
    return document, examples, tokenizer, features
