"""Packed token classification (named-entity recognition) as a task of the loop.

    python run.py --config finetune_token_classification --init-checkpoint DIR \\
        --set finetune.train_file=train.jsonl --set finetune.validation_file=dev.conll --output-dir OUT

Input (``finetune.train_file`` / ``validation_file``), one sentence = a list of words with one
IOB2 tag each (``O``, ``B-TYPE``, ``I-TYPE``; an entity starts with ``B-``):

- JSON lines (``.jsonl``, ``.json``, ``.ndjson``): ``{"tokens": [...], "ner_tags": [...]}`` per
  line, string tags (columns ``finetune.tokens_column`` / ``finetune.tags_column``);
- a Hugging Face dataset saved with ``save_to_disk`` (a directory): integer tags whose
  ``ClassLabel`` feature names them (e.g. ``conll2003``), or string tags;
- anything else is read as CoNLL text: one word per line, its tag in the last
  whitespace-separated column, a blank line between sentences, ``-DOCSTART-`` lines skipped.

Everything is checked before the first step (one-line ``DataError`` naming the file, the line
or row, the column and the value). Words are tokenised with the checkpoint's tokenizer as
Hugging Face's ``is_split_into_words=True`` does; only the first sub-token of every word
carries its tag (label -100 elsewhere, as ``transformers``' ``run_ner.py``;
``finetune.label_all_tokens`` labels every sub-token, B- continuations as I-). Sentences are
packed several per row (``bert_packed.finetune.data.PackedDataset``; ``finetune.packing=false``:
one per row) and trained with :class:`BertForTokenClassification`: Hugging Face's layout
and loss (the mean cross-entropy over the step's labelled tokens).

Evaluation (every ``train.eval_every`` steps and at the end) predicts every word's tag from
its first sub-token; a word without tokens (cut by truncation, or a word the tokenizer's
normaliser removes) is predicted ``O``. Metrics (``summary.json`` under ``eval``): entity
precision / recall / F1 by ``seqeval`` with its default rules (the conlleval rules, as
``transformers``' ``run_ner.py`` computes them through ``evaluate``'s seqeval metric),
word accuracy and the loss. The best evaluation by F1 is kept (``OUT/best``); its
predictions go to ``OUT/predictions.jsonl`` and the model to ``OUT/hf``
(``AutoModelForTokenClassification``, ``id2label`` named by the tags).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bert_packed.attention import profiler_scope
from bert_packed.data import DataError
from bert_packed.errors import ConfigError
from bert_packed.finetune import data as ft_data
from bert_packed.io import write_text_atomic
from bert_packed.losses import add_sequence_normalizer, normalize
from bert_packed.modeling import BertConfig, BertModel, BertPreTrainedModel, PipelineLayout

__all__ = ["Sentences", "read_sentences", "TagSet", "encode_sentences", "collate_token_classification",
           "BertForTokenClassification", "token_loss_terms", "entity_scores", "TokenClassificationTask",
           "IGNORE_INDEX", "PREDICTIONS_NAME"]

IGNORE_INDEX = -100  # Hugging Face's label of a token that is not scored
PREDICTIONS_NAME = "predictions.jsonl"
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
        for number, line in enumerate(ft_data._utf8_lines(path, handle), 1):
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

    def check(self, sentences: Sentences, tags: List[List[str]]) -> None:
        """Every tag of ``sentences`` (e.g. the validation file) is one the model has."""
        for i, sentence in enumerate(tags):
            for j, tag in enumerate(sentence):
                if tag not in self.label2id:
                    raise DataError(f"{sentences.place(i, j, 1)}: tag {tag!r} is not among the training tags "
                                    f"({_preview(sorted(self.label2id))})")

    def continuation(self, label: int) -> int:
        """The label of a word's later sub-tokens with label_all_tokens: B-X -> I-X (if the model has it)."""
        name = self.id2label[label]
        if name.startswith("B-"):
            return self.label2id.get("I-" + name[2:], label)
        return label


# ----------------------------------------------------------------------------- tokens


class EncodedSentences(ft_data.Encoded):
    """Tokenised sentences (``bert_packed.finetune.data.Encoded``) plus ``input_mask``,
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


# ----------------------------------------------------------------------------- the model


def token_loss_terms(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-pack numerators and counts of the token cross-entropy: ``logits`` ``[B, S, C]``,
    ``labels`` ``[B, S]`` (any value where the weight is 0, e.g. -100), ``weights`` ``[B, S]``
    (1.0 for a scored token). Returns ``[B]`` float ``loss_sum``, ``correct_sum``, ``count``.
    Masked by multiplication, not ``ignore_index``: fixed shapes for the IPU."""
    num_packs, num_tokens, num_labels = logits.shape
    weights = weights.float()
    scored = weights > 0
    targets = torch.where(scored, labels, torch.zeros_like(labels))
    nll = F.cross_entropy(logits.reshape(-1, num_labels).float(), targets.reshape(-1), reduction="none")
    nll = nll.view(num_packs, num_tokens) * weights
    correct = (logits.argmax(dim=-1) == targets).float() * weights
    return {"loss_sum": nll.sum(dim=1), "correct_sum": correct.sum(dim=1), "count": weights.sum(dim=1)}


class BertForTokenClassification(BertPreTrainedModel):
    """Packed token classification: one logit row per token, whatever sequence of the pack it
    belongs to (each attends only to its own sequence).

    Hugging Face's ``BertForTokenClassification`` layout (``bert`` without pooler, dropout,
    ``classifier`` Linear(H, num_labels)), so its checkpoints load and ours export.
    ``model(**batch)`` with ``input_ids, segment_ids, position_ids, sequence_ids`` ``[B, S]``
    returns ``logits`` ``[B, S, num_labels]``; with ``labels`` ``[B, S]`` (``IGNORE_INDEX``
    where not scored) and optional ``label_weights`` ``[B, S]`` (default: labels != -100) also
    ``loss``: the summed cross-entropy of the scored tokens divided by ``normalizer`` ``[B]``
    (the step's scored-token count, from ``add_step_normalizers``) or by this batch's count:
    Hugging Face's mean over a batch's labelled tokens, for the whole step. ``accuracy`` is
    the same mean of right argmaxes; ``num_labelled_tokens`` this batch's count.
    """

    metric_names = ("loss", "accuracy")
    count_names = ("num_labelled_tokens",)
    normalizer_fields = ("normalizer",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.classifier.apply(self._init_weights)

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(self.bert.embeddings, self.bert.encoder.layer, self.classifier, False)

    def hf_label_config(self, id2label=None):
        return self._labels_of(id2label)  # the tags; no problem_type (it names sequence classification's)

    def add_step_normalizers(self, micro_batches, *, all_reduce=None):
        """Set ``normalizer`` (float32 ``[B]``) in every micro-batch to the step's scored-token count
        (``label_weights`` summed over all micro-batches, and over processes by ``all_reduce``)."""
        return add_sequence_normalizer(micro_batches, "label_weights", "normalizer", all_reduce=all_reduce)

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor, position_ids: torch.Tensor,
                sequence_ids: torch.Tensor, cls_positions: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, label_weights: Optional[torch.Tensor] = None,
                normalizer: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        sequence_output = self.bert(input_ids, segment_ids, position_ids, sequence_ids)
        logits = self.classifier(self.dropout(sequence_output))  # [B,S,num_labels]
        outputs: Dict[str, torch.Tensor] = {"logits": logits}
        if labels is None:
            return outputs
        if label_weights is None:
            label_weights = (labels != IGNORE_INDEX).float()
        with profiler_scope("packing/loss_unpacking"):
            terms = token_loss_terms(logits, labels, label_weights)
            outputs["loss"] = normalize(terms["loss_sum"], terms["count"], normalizer)
            outputs["accuracy"] = normalize(terms["correct_sum"], terms["count"], normalizer)
            outputs["num_labelled_tokens"] = terms["count"].sum()
        return outputs


# ----------------------------------------------------------------------------- metrics


def entity_scores(true_tags: List[List[str]], predicted_tags: List[List[str]]) -> Dict[str, float]:
    """Entity-level ``precision``, ``recall``, ``f1`` (micro-averaged over entities) and word
    ``accuracy``, by ``seqeval`` with its default rules, as ``evaluate``'s seqeval metric in
    ``transformers``' ``run_ner.py`` (``overall_*``): an entity is a maximal run B-X I-X ...
    (an I-X after another type or O also starts one, as conlleval counts it); it is right
    when its type and both ends are. No predicted (or true) entity: 0, not a warning."""
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    return {"precision": float(precision_score(true_tags, predicted_tags, zero_division=0)),
            "recall": float(recall_score(true_tags, predicted_tags, zero_division=0)),
            "f1": float(f1_score(true_tags, predicted_tags, zero_division=0)),
            "accuracy": float(accuracy_score(true_tags, predicted_tags))}


# ----------------------------------------------------------------------------- the task


@dataclass
class TokenClassificationFields:
    """``finetune.*`` keys of token classification (NER)."""

    # JSON lines / datasets columns: the words of a sentence and their IOB2 tags.
    tokens_column: str = "tokens"
    tags_column: str = "ner_tags"
    # Train every sub-token of a word (later ones of a B-X word as I-X), not only its first.
    label_all_tokens: bool = False


class TokenClassificationTask(ft_data.PackedTask):
    """Token classification (NER) fine-tuning (see the module docstring)."""

    name = "token_classification"
    config_fields = TokenClassificationFields
    always_evaluate = True  # summary.json reports the validation metrics
    metric_names = ("loss", "accuracy")
    best_metric = "eval_f1"

    def __init__(self, config):
        super().__init__(config)
        self.tags: Optional[TagSet] = None
        self.eval_words: List[List[str]] = []
        self.eval_tags: List[List[str]] = []
        self.eval_encoded: Optional[EncodedSentences] = None

    # -- setup ------------------------------------------------------------------------------
    def setup(self, *, rank: int = 0, world_size: int = 1, show_progress: bool = True) -> None:
        super().setup(rank=rank, world_size=world_size, show_progress=show_progress)
        c, f, d = self.config, self.config.finetune, self.config.data
        self.best_metric = "eval_" + (f.metric_for_best_model or "f1")
        self.greater_is_better = self.best_model.greater_is_better = self.best_metric != "eval_loss"
        if not f.train_file:
            raise ConfigError("token classification needs finetune.train_file (JSON lines, CoNLL text or a saved "
                              "datasets directory)")
        if importlib.util.find_spec("seqeval") is None:
            raise ConfigError("token classification scores entities with seqeval: pip install seqeval "
                              "(requirements.txt)")
        if not f.packing:
            d.max_sequences_per_pack = 1  # one sentence per row: the padded baseline
        tokenizer = self.checked_tokenizer("token classification")
        train = read_sentences(f.train_file, f.tokens_column, f.tags_column)
        train_tags = check_sentences(train)
        if f.validation_file:
            validation = read_sentences(f.validation_file, f.tokens_column, f.tags_column)
            validation_tags = check_sentences(validation)
        else:
            train, train_tags, validation, validation_tags = _split(train, train_tags, f.validation_fraction,
                                                                    c.train.seed)
        self.tags = TagSet.from_training(train_tags, train.label_names, self._checkpoint_labels(), train.path)
        self.tags.check(validation, validation_tags)
        self.eval_words, self.eval_tags = validation.words, validation_tags
        encode = dict(max_length=d.max_sequence_length, truncation=f.truncation, label_all_tokens=f.label_all_tokens)
        train_encoded = encode_sentences(tokenizer, train.words, train_tags, self.tags, place=train.place, **encode)
        self.eval_encoded = encode_sentences(tokenizer, validation.words, validation_tags, self.tags,
                                             place=validation.place, **encode)
        self.train_data = self._dataset(train_encoded)
        self.eval_data = self._dataset(self.eval_encoded)
        self.note(f"token classification with {self.tags.num_labels} tags: {len(train)} training and "
                  f"{len(validation)} validation sentences; {self.train_data.packing_factor:.2f} sentences per row "
                  f"({self.train_data.algorithm}, at most {d.max_sequences_per_pack} per row of {d.max_sequence_length})")

    def _checkpoint_labels(self) -> Optional[Dict[int, str]]:
        if self.pretrained is None or not self.pretrained.hf_config.get("id2label"):
            return None
        from bert_packed.hf_io import label_maps

        return label_maps(self.pretrained.hf_config)[0]

    def _dataset(self, encoded: EncodedSentences) -> ft_data.PackedDataset:
        from functools import partial

        d = self.config.data
        collate = partial(collate_token_classification, max_sequence_length=d.max_sequence_length,
                          max_sequences_per_pack=d.max_sequences_per_pack)
        return ft_data.PackedDataset(encoded, {"input_mask": encoded.input_mask, "labels": encoded.labels}, collate,
                                     max_sequence_length=d.max_sequence_length,
                                     max_sequences_per_pack=d.max_sequences_per_pack,
                                     algorithm=d.packing_algorithm, seed=self.config.train.seed)

    # -- model ------------------------------------------------------------------------------
    def model_class(self):
        return BertForTokenClassification

    def bert_config_overrides(self) -> Dict[str, Any]:
        return {"num_labels": self.tags.num_labels}

    def export_labels(self) -> Optional[Dict[int, str]]:
        return self.tags.id2label

    # -- evaluation -------------------------------------------------------------------------
    def predict_token_logits(self, backend) -> List[np.ndarray]:
        """Logits ``[tokens, num_labels]`` of every validation sentence (file order) through ``backend``."""
        lengths = self.eval_encoded.lengths
        out: List[Optional[np.ndarray]] = [None] * len(lengths)
        for batch, rows in self.evaluation_batches():
            logits = backend.predict_step(batch, names=("logits",))["logits"]
            for b, k in zip(*np.nonzero(rows >= 0)):
                i, start = int(rows[b, k]), int(batch["cls_positions"][b, k])
                out[i] = np.asarray(logits[b, start:start + lengths[i]], dtype=np.float32)
        return out

    def evaluate(self, backend) -> Dict[str, float]:
        logits = self.predict_token_logits(backend)
        predicted = word_predictions(logits, self.eval_encoded.word_starts, self.tags.id2label)
        metrics = {"eval_loss": scored_token_loss(logits, self.eval_encoded.labels)}
        metrics.update({f"eval_{k}": v for k, v in entity_scores(self.eval_tags, predicted).items()})
        self.last_outputs = predicted
        return metrics

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return (f"f1 {metrics['eval_f1']:.4f} precision {metrics['eval_precision']:.4f} recall "
                f"{metrics['eval_recall']:.4f} accuracy {metrics['eval_accuracy']:.4f} loss {metrics['eval_loss']:.4f}")

    # -- end of run -------------------------------------------------------------------------
    def finish(self, backend, model, output_dir: str, summary: Dict[str, Any]) -> None:
        predicted = self.chosen_evaluation(model, output_dir, summary)
        summary["labels"] = {str(i): name for i, name in self.tags.id2label.items()}
        if self.is_main and predicted is not None:
            path = os.path.join(output_dir, PREDICTIONS_NAME)
            lines = [{"row": i, "tokens": words, "tags": tags, "predicted_tags": guess}
                     for i, (words, tags, guess) in enumerate(zip(self.eval_words, self.eval_tags, predicted))]
            write_text_atomic(path, "".join(json.dumps(line) + "\n" for line in lines))
            summary["predictions"] = path
        super().finish(backend, model, output_dir, summary)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "labels": {str(i): n for i, n in self.tags.id2label.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("labels") and self.tags is None:  # export from a checkpoint, without the data
            self.tags = TagSet({int(i): n for i, n in state["labels"].items()})
        super().load_state_dict(state)


def word_predictions(logits: List[np.ndarray], word_starts: List[np.ndarray], id2label: Dict[int, str]) -> List[List[str]]:
    """Each word's tag: the argmax at its first sub-token ('O' for a word without tokens)."""
    out = []
    for sentence_logits, starts in zip(logits, word_starts):
        best = sentence_logits.argmax(axis=-1)
        out.append([id2label[int(best[t])] if t >= 0 else "O" for t in starts])
    return out


def scored_token_loss(logits: List[np.ndarray], labels: np.ndarray) -> float:
    """The model's loss on per-sentence logits: mean cross-entropy over the scored tokens."""
    parts, targets = [], []
    for i, sentence_logits in enumerate(logits):
        row = labels[i, :len(sentence_logits)]
        scored = row != IGNORE_INDEX
        parts.append(sentence_logits[scored])
        targets.append(row[scored])
    if not parts or not sum(len(t) for t in targets):
        return 0.0
    with torch.no_grad():
        loss = F.cross_entropy(torch.from_numpy(np.concatenate(parts)).double(),
                               torch.from_numpy(np.concatenate(targets)), reduction="mean")
    return float(loss)


def _split(sentences: Sentences, tags: List[List[str]], fraction: float,
           seed: int) -> Tuple[Sentences, List[List[str]], Sentences, List[List[str]]]:
    """(train, its tags, validation, its tags): a seeded random ``fraction`` of the sentences held out."""
    parts = []
    for indices in ft_data.held_out(len(sentences), fraction, seed, what="sentences", where=sentences.path):
        parts += [sentences.subset(indices), [tags[i] for i in indices]]
    return tuple(parts)
