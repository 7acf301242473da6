"""Token classification data: sentences (words and their IOB2 tags) read and checked,
the tag set, sub-word encoding and the collation of packed batches (numpy, no torch).

- :func:`read_sentences`: JSON lines, a Hugging Face dataset directory or CoNLL text ->
  :class:`Sentences`; :func:`check_sentences`: the tags as IOB2 names;
- :class:`TagSet`: tag names <-> ids (from the training tags, or the checkpoint's labels);
- :func:`encode_sentences`: words through the tokenizer, the tag on each word's first
  sub-token (``IGNORE_INDEX`` elsewhere, unless ``label_all_tokens``);
- :func:`collate_token_classification`: the packed batch (``labels`` / ``label_weights`` per
  token) of ``bert_packed.tasks.token_classification.model.BertForTokenClassification``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.tasks import data as ft_data
from bert_packed.io.files import utf8_lines

__all__ = ["Sentences", "read_sentences", "check_sentences", "TagSet", "EncodedSentences", "encode_sentences",
           "collate_token_classification", "split_sentences", "IGNORE_INDEX", "JSON_LINES"]

IGNORE_INDEX = -100  # Hugging Face's label of a token that is not scored
JSON_LINES = (".jsonl", ".json", ".ndjson")


# ----------------------------------------------------------------------------- reading


class Sentences:
    """Sentences of one file: ``words`` and ``tags`` (lists of string lists), where they came
    from (``lines``: CoNLL line numbers per word; else ``rows``: each sentence's row index in
    its file) and, for a dataset whose tags are a ``ClassLabel``, its ``label_names``."""

    def __init__(self, path: str, words: List[List[str]], tags: List[List[Any]], *,
                 lines: Optional[List[List[int]]] = None, rows: Optional[List[int]] = None,
                 columns: Tuple[str, str] = ("tokens", "ner_tags"), label_names: Optional[List[str]] = None):
        self.path, self.words, self.tags, self.lines = path, words, tags, lines
        self.rows = list(range(len(words))) if rows is None else rows
        self.columns, self.label_names = columns, label_names

    def subset(self, indices: Sequence[int]) -> "Sentences":
        """The sentences at ``indices`` (their places in the file kept)."""
        return Sentences(self.path, [self.words[i] for i in indices], [self.tags[i] for i in indices],
                         lines=None if self.lines is None else [self.lines[i] for i in indices],
                         rows=[self.rows[i] for i in indices], columns=self.columns, label_names=self.label_names)

    def __len__(self) -> int:
        return len(self.words)

    def place(self, sentence: int, word: Optional[int] = None, column: Optional[int] = None) -> str:
        """``file:line`` (CoNLL) or ``file: row r, column 'c', word w`` for messages."""
        if self.lines is not None:
            return f"{self.path}:{self.lines[sentence][word or 0]}"
        text = f"{self.path}: row {self.rows[sentence] + 1}"
        if column is not None:
            text += f", column {self.columns[column]!r}"
        return text + (f", word {word + 1}" if word is not None else "")


def _read_conll(path: str) -> Sentences:
    words: List[List[str]] = []
    tags: List[List[str]] = []
    lines: List[List[int]] = []

    def start_sentence() -> None:
        if not words or words[-1]:
            words.append([]), tags.append([]), lines.append([])

    start_sentence()
    # UTF-8 read as read_table reads it: a byte-order mark dropped (else line 1's -DOCSTART- was
    # the word '\ufeff-DOCSTART-' and a sentence), another encoding refused naming its line.
    with open(path, "rb") as handle:
        for number, line in enumerate(utf8_lines(path, handle, DataError), 1):
            parts = line.split()
            if not parts or parts[0] == "-DOCSTART-":  # a blank line ends a sentence; so does a document
                start_sentence()
                continue
            if len(parts) < 2:
                raise DataError(f"{path}:{number}: expected a word and its tag separated by whitespace (CoNLL), "
                                f"got {ft_data._short(line.strip())!r}")
            words[-1].append(parts[0])
            tags[-1].append(parts[-1])  # CoNLL-2003 has POS and chunk columns before the tag
            lines[-1].append(number)
    if not words[-1]:
        words.pop(), tags.pop(), lines.pop()
    if not words:
        raise DataError(f"{path}: no sentences (a CoNLL file holds a word and its tag per line)")
    return Sentences(path, words, tags, lines=lines)


def _class_label_names(path: str, column: str) -> Optional[List[str]]:
    """The ``ClassLabel`` names of a saved dataset's tag column (a sequence of ClassLabel), or None."""
    import datasets

    feature = datasets.load_from_disk(path).features[column]
    # A list feature: Sequence (datasets 2-3), List (4+) or a plain [feature].
    inner = feature[0] if isinstance(feature, list) else getattr(feature, "feature", None)
    return list(inner.names) if isinstance(inner, datasets.ClassLabel) else None


def read_sentences(path: str, tokens_column: str = "tokens", tags_column: str = "ner_tags") -> Sentences:
    """The sentences of ``path``: JSON lines, a saved Hugging Face dataset, or CoNLL text
    (see the module docstring); read, not yet checked (:func:`check_sentences`)."""
    if not path:
        raise DataError("no data file given")
    columns = (tokens_column, tags_column)
    if os.path.isdir(path):
        table = ft_data.read_table(path, columns)  # one-line errors for a bad directory or column
        return Sentences(path, table[tokens_column], table[tags_column], columns=columns,
                         label_names=_class_label_names(path, tags_column))
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    if os.path.splitext(path)[1].lower() in JSON_LINES:
        table = ft_data.read_table(path, columns)
        return Sentences(path, table[tokens_column], table[tags_column], columns=columns)
    return _read_conll(path)


def _iob2_error(tag: str, previous: str) -> Optional[str]:
    """Why ``tag`` (after ``previous``) is not IOB2, or None."""
    if tag == "O":
        return None
    if len(tag) < 3 or tag[:2] not in ("B-", "I-") or not tag[2:].strip():
        return "is not an IOB2 tag (O, B-TYPE or I-TYPE)"
    if tag[0] == "I" and previous[2:] != tag[2:]:
        return (f"follows {previous!r}: in IOB2 an entity starts with B-{tag[2:]} (IOB1 data? convert it to IOB2)")
    return None


def check_sentences(sentences: Sentences) -> List[List[str]]:
    """The tags of every sentence as IOB2 strings, after checking words and tags; raises a
    one-line ``DataError`` at the first problem (naming file, line or row, column, value)."""
    names = sentences.label_names
    out = []
    for i, (words, tags) in enumerate(zip(sentences.words, sentences.tags)):
        if not isinstance(words, list):
            raise DataError(f"{sentences.place(i, column=0)}: expected a list of words, got {type(words).__name__} "
                            f"{_short(words)}")
        if not isinstance(tags, list):
            raise DataError(f"{sentences.place(i, column=1)}: expected a list of tags, got {type(tags).__name__} "
                            f"{_short(tags)}")
        if not words:
            raise DataError(f"{sentences.place(i, column=0)}: the sentence is empty (no words)")
        if len(words) != len(tags):
            raise DataError(f"{sentences.place(i)}: {_count(len(words), 'word')} (column {sentences.columns[0]!r}) "
                            f"but {_count(len(tags), 'tag')} (column {sentences.columns[1]!r})")
        named, previous = [], "O"
        for j, (word, tag) in enumerate(zip(words, tags)):
            if not isinstance(word, str) or not word.strip():
                raise DataError(f"{sentences.place(i, j, 0)}: {_short(word)} is not a word (a non-empty string)")
            tag = _tag_name(tag, names, sentences.place(i, j, 1))
            problem = _iob2_error(tag, previous)
            if problem:
                raise DataError(f"{sentences.place(i, j, 1)}: tag {tag!r} {problem}")
            named.append(tag)
            previous = tag
        out.append(named)
    return out


def _tag_name(tag: Any, names: Optional[List[str]], place: str) -> str:
    if isinstance(tag, str):
        return tag
    if isinstance(tag, (int, np.integer)) and not isinstance(tag, bool):
        if names is None:
            raise DataError(f"{place}: tag {tag} is an integer but nothing names it; give IOB2 tag strings, or a "
                            f"datasets directory whose tag column is a ClassLabel")
        if not 0 <= tag < len(names):
            raise DataError(f"{place}: tag {tag} is outside the ClassLabel's {len(names)} names")
        return names[int(tag)]
    raise DataError(f"{place}: tag {_short(tag)} is not a string")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _preview(names: Sequence[str], limit: int = 10) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


# ----------------------------------------------------------------------------- labels


class TagSet:
    """Tag names <-> ids for one job."""

    def __init__(self, id2label: Dict[int, str]):
        self.id2label = dict(id2label)
        self.label2id = {name: i for i, name in self.id2label.items()}

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @classmethod
    def from_training(cls, tags: List[List[str]], label_names: Optional[List[str]],
                      checkpoint_labels: Optional[Dict[int, str]], where: str) -> "TagSet":
        """The training tags' ids: a fine-tuned checkpoint's when its labels cover the tags (its
        head keeps its meaning), else the dataset's ClassLabel order, else the tags sorted."""
        seen = sorted({tag for sentence in tags for tag in sentence})
        if all(tag == "O" for tag in seen):
            raise DataError(f"{where}: every tag is 'O' (no entity to learn)")
        if checkpoint_labels and set(seen) <= set(checkpoint_labels.values()):
            return cls(checkpoint_labels)
        if label_names:
            return cls(dict(enumerate(label_names)))
        return cls(dict(enumerate(seen)))

    def check(self, sentences: Sentences, tags: List[List[str]], only_in: str = "the validation sentences") -> None:
        """Every tag of ``sentences`` (the validation file or the held-out split, which ``only_in``
        describes) is one the model has."""
        for i, sentence in enumerate(tags):
            for j, tag in enumerate(sentence):
                if tag not in self.label2id:
                    raise DataError(f"{sentences.place(i, j, 1)}: tag {tag!r} appears only in {only_in}, so the "
                                    f"model cannot learn it (training tags: {_preview(sorted(self.label2id))})")

    def continuation(self, label: int) -> int:
        """The label of a word's later sub-tokens with label_all_tokens: B-X -> I-X (if the model has it)."""
        name = self.id2label[label]
        if name.startswith("B-"):
            return self.label2id.get("I-" + name[2:], label)
        return label


# ----------------------------------------------------------------------------- tokens


class EncodedSentences(ft_data.Encoded):
    """Tokenised sentences (``bert_packed.tasks.data.Encoded``) plus ``input_mask``,
    ``labels`` ``[N, width]`` (int64, ``IGNORE_INDEX`` where not scored) and ``word_starts``
    (per sentence: each word's first token, -1 when the word has none)."""

    def __init__(self, encoded: ft_data.Encoded, labels: np.ndarray, word_starts: List[np.ndarray]):
        super().__init__(encoded.input_ids, encoded.segment_ids, encoded.lengths, encoded.num_truncated)
        self.labels, self.word_starts = labels, word_starts
        self.input_mask = (np.arange(self.input_ids.shape[1])[None, :] < self.lengths[:, None]).astype(np.int32)


def encode_sentences(tokenizer, words: List[List[str]], tags: List[List[str]], tag_set: TagSet, *, max_length: int,
                     truncation: str = "truncate", label_all_tokens: bool = False,
                     place: Optional[Callable[[int], str]] = None) -> EncodedSentences:
    """Tokenise pre-split sentences (Hugging Face's ``is_split_into_words=True``: BERT's
    ``[CLS] ... [SEP]`` template around the words' sub-tokens) and place the tags.
    ``place(i)`` names sentence i in messages (e.g. ``Sentences.place``)."""
    place = place or (lambda i: f"sentence {i + 1}")
    if truncation not in ft_data.TRUNCATION:
        raise DataError(f"finetune.truncation must be one of {', '.join(ft_data.TRUNCATION)}, got {truncation!r}")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    encodings = tokenizer.encode_batch(words, is_pretokenized=True)
    rows: List[Tuple[List[int], List[int], List[Optional[int]]]] = []
    truncated = []
    for i, encoding in enumerate(encodings):
        ids, types, word_ids = list(encoding.ids), list(encoding.type_ids), list(encoding.word_ids)
        if len(ids) > max_length:
            if truncation == "error":
                raise DataError(f"{place(i)}: the sentence has {len(ids)} tokens, more than the maximum {max_length} "
                                f"(data.max_sequence_length); shorten it, raise the maximum, or set "
                                f"finetune.truncation=truncate")
            truncated.append(i)
            keep = max_length - 1 if word_ids[-1] is None else max_length  # keep the closing [SEP]
            tail = slice(len(ids) - (max_length - keep), len(ids))
            ids, types, word_ids = (x[:keep] + x[tail] for x in (ids, types, word_ids))
        rows.append((ids, types, word_ids))
    if truncated:
        print(f"warning: {len(truncated)} of {len(words)} sentences are longer than {max_length} tokens and were "
              f"truncated (first: {place(truncated[0])}); their cut words are not trained and are "
              f"predicted 'O'; finetune.truncation=error refuses them", file=sys.stderr)
    lengths = np.array([len(r[0]) for r in rows], dtype=np.int64)
    width = int(max(1, lengths.max(initial=1)))
    input_ids = np.zeros((len(rows), width), dtype=np.int32)
    segment_ids = np.zeros((len(rows), width), dtype=np.int32)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    word_starts = []
    for i, (ids, types, word_ids) in enumerate(rows):
        input_ids[i, :len(ids)], segment_ids[i, :len(ids)] = ids, types
        starts = np.full(len(words[i]), -1, dtype=np.int64)
        for t, w in enumerate(word_ids):
            if w is None:
                continue
            label = tag_set.label2id[tags[i][w]]
            if starts[w] < 0:
                starts[w], labels[i, t] = t, label
            elif label_all_tokens:
                labels[i, t] = tag_set.continuation(label)
        word_starts.append(starts)
    encoded = ft_data.Encoded(input_ids, segment_ids, lengths, len(truncated))
    return EncodedSentences(encoded, labels, word_starts)


def collate_token_classification(samples, assignment, *, max_sequence_length: int,
                                 max_sequences_per_pack: int) -> Dict[str, np.ndarray]:
    """Packed token-classification batch: the token fields and ``cls_positions`` of
    ``bert_packed.collate.pack_tokens``, ``labels`` ``[B, S]`` (int64, each sentence's tags at
    its own columns, ``IGNORE_INDEX`` elsewhere) and ``label_weights`` ``[B, S]`` (1.0 where a
    token is scored).

    ``samples``: ``input_ids``, ``segment_ids``, ``input_mask`` and per-token ``labels`` ``[N, width]``."""
    from bert_packed.collate import pack_tokens

    batch, layout = pack_tokens(samples, assignment, int(max_sequence_length), int(max_sequences_per_pack))
    first = np.concatenate([[0], np.cumsum(layout.lengths)[:-1]]).astype(np.int64)
    token_sequence = np.repeat(np.arange(len(layout.order), dtype=np.int64), layout.lengths)
    token_position = np.arange(len(token_sequence), dtype=np.int64) - first[token_sequence]
    labels = np.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=np.int64)
    labels[layout.pack_of[token_sequence], layout.start[token_sequence] + token_position] = \
        np.asarray(samples["labels"])[layout.order[token_sequence], token_position]
    batch["labels"] = labels
    batch["label_weights"] = (labels != IGNORE_INDEX).astype(np.float32)
    return batch


def split_sentences(sentences: Sentences, tags: List[List[str]], fraction: float,
           seed: int) -> Tuple[Sentences, List[List[str]], Sentences, List[List[str]]]:
    """(train, its tags, validation, its tags): a seeded random ``fraction`` of the sentences held out."""
    parts = []
    for indices in ft_data.held_out(len(sentences), fraction, seed, what="sentences", where=sentences.path):
        parts += [sentences.subset(indices), [tags[i] for i in indices]]
    return tuple(parts)
