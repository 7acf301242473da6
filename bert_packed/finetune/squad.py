"""SQuAD-style extractive question answering: examples in, packed features out.

Three steps, each a plain function over plain data:

1. **Read** SQuAD v1.1 / v2.0 JSON (``{"version", "data": [{"title", "paragraphs":
   [{"context", "qas": [{"id", "question", "answers", "is_impossible"}]}]}]}``), or the
   flat rows of the Hugging Face ``squad`` / ``squad_v2`` datasets (JSON lines, a JSON
   list, or rows from ``datasets``: ``id, title, context, question, answers: {"text":
   [...], "answer_start": [...]}``) into :class:`SquadExample` objects.
2. **Featurise** (:func:`build_features`): question + context through the checkpoint's
   fast tokenizer (the ``tokenizers`` library, the engine behind Hugging Face's fast
   tokenizers), long contexts split into overlapping windows of ``max_seq_length``
   tokens that share ``doc_stride`` context tokens (Hugging Face's ``stride``
   semantics, so the features are exactly those of ``tokenizer(question, context,
   truncation="only_second", stride=..., return_overflowing_tokens=True)``), with the
   character offsets of every context token. The answer is mapped to the token start /
   end of every window that contains it whole; a window that does not (and every window
   of an unanswerable v2.0 question) points at its own [CLS] (token 0), as Hugging Face's
   ``run_qa.py`` does.
3. **Collate** (:func:`collate_question_answering`): features packed side by side in
   fixed ``[B, S]`` rows, each with its own [CLS], positions restarting, and the answer
   positions moved to pack columns; :func:`pack_features` plans the packs with the
   ``packing`` library (depth 1 = the padded layout).

No torch here: the model side is ``bert_packed.modeling.BertForQuestionAnswering``,
post-processing and metrics are in ``squad_postprocess`` / ``squad_metrics``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from bert_packed.collate import BatchError, pack_tokens, per_sequence, one_per_pack
from bert_packed.data import DataError
from bert_packed.errors import ConfigError
from bert_packed.finetune.data import PackedTask

__all__ = [
    "SquadExample",
    "SquadFeatures",
    "read_squad",
    "examples_from_rows",
    "examples_from_squad_json",
    "backend_tokenizer",
    "build_features",
    "pack_features",
    "collate_question_answering",
    "feature_slots",
    "QA_FIELDS",
]

# The packed QA batch (BertForQuestionAnswering's inputs): token fields [B, S], then per
# feature slot [B, K]: its [CLS] column, answer start / end columns (absolute in the pack),
# and 1.0 where the slot holds a feature.
QA_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions",
             "start_positions", "end_positions", "label_weights")


# ----------------------------------------------------------------------------- examples


@dataclass
class SquadExample:
    """One question about one context. ``answers`` are ``(text, answer_start)`` pairs
    (character offset into ``context``); empty for an unanswerable (v2.0) question."""

    id: str
    question: str
    context: str
    answers: List[Tuple[str, int]] = field(default_factory=list)
    title: str = ""

    @property
    def is_impossible(self) -> bool:
        return not self.answers

    @property
    def answer_texts(self) -> List[str]:
        return [text for text, _ in self.answers]


def _checked_answer(example_id: str, context: str, text: Any, start: Any, where: str) -> Tuple[str, int]:
    """(text, start) with ``context[start:start+len(text)] == text``; a start that is off by
    a few characters (some hand-made files) is moved to the nearest occurrence."""
    if not isinstance(text, str) or not text:
        raise DataError(f"{where}: question {example_id!r} has an answer without text")
    if isinstance(start, bool) or not isinstance(start, int):
        raise DataError(f"{where}: question {example_id!r}: answer_start must be an integer, got {start!r}")
    if context[start:start + len(text)] == text:
        return text, start
    found = list(_occurrences(context, text))
    if not found:
        raise DataError(f"{where}: question {example_id!r}: answer {text!r} does not occur in its context")
    nearest = min(found, key=lambda i: abs(i - start))
    return text, nearest


def _occurrences(context: str, text: str) -> Iterable[int]:
    index = context.find(text)
    while index >= 0:
        yield index
        index = context.find(text, index + 1)


def _require(mapping: Any, key: str, kind: type, where: str, what: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise DataError(f"{where}: {what} has no {key!r} field")
    value = mapping[key]
    if not isinstance(value, kind):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataError(f"{where}: {what}: {key!r} must be a {expected}, got {type(value).__name__}")
    return value


def examples_from_squad_json(document: Mapping[str, Any], where: str = "SQuAD JSON") -> List[SquadExample]:
    """Examples of a SQuAD v1.1 / v2.0 document (the ``{"version", "data": [...]}`` object)."""
    examples = []
    for article in _require(document, "data", list, where, "the document"):
        title = article.get("title", "") if isinstance(article, dict) else ""
        for paragraph in _require(article, "paragraphs", list, where, f"article {title!r}"):
            context = _require(paragraph, "context", str, where, f"a paragraph of {title!r}")
            for qa in _require(paragraph, "qas", list, where, f"a paragraph of {title!r}"):
                example_id = str(_require(qa, "id", (str, int), where, "a question"))
                question = _require(qa, "question", str, where, f"question {example_id!r}")
                # v2.0: an impossible question's "answers" is empty (its "plausible_answers" are not answers).
                raw = [] if qa.get("is_impossible", False) else qa.get("answers", [])
                if not isinstance(raw, list):
                    raise DataError(f"{where}: question {example_id!r}: 'answers' must be a list")
                answers = [_checked_answer(example_id, context, a.get("text") if isinstance(a, dict) else None,
                                           a.get("answer_start") if isinstance(a, dict) else None, where) for a in raw]
                examples.append(SquadExample(example_id, question, context, answers, title))
    return examples


def examples_from_rows(rows: Iterable[Mapping[str, Any]], where: str = "rows") -> List[SquadExample]:
    """Examples of flat Hugging Face ``squad`` / ``squad_v2`` rows (``datasets`` or JSON lines):
    ``id, title, context, question, answers: {"text": [...], "answer_start": [...]}``."""
    examples = []
    for number, row in enumerate(rows, 1):
        what = f"row {number}"
        example_id = str(_require(row, "id", (str, int), where, what))
        context = _require(row, "context", str, where, what)
        question = _require(row, "question", str, where, what)
        answers = row.get("answers") or {"text": [], "answer_start": []}
        if isinstance(answers, list):  # rows written from SQuAD JSON: [{"text", "answer_start"}, ...]
            answers = {"text": [a.get("text") for a in answers], "answer_start": [a.get("answer_start") for a in answers]}
        texts, starts = answers.get("text", []), answers.get("answer_start", [])
        if len(texts) != len(starts):
            raise DataError(f"{where}: {what}: answers.text and answers.answer_start differ in length")
        pairs = [_checked_answer(example_id, context, t, s, where) for t, s in zip(texts, starts)]
        examples.append(SquadExample(example_id, question, context, pairs, str(row.get("title", ""))))
    return examples


def read_squad(path: str) -> List[SquadExample]:
    """Examples of a SQuAD JSON file, of flat rows as JSON lines / a JSON list, or of a Hugging
    Face ``squad`` / ``squad_v2`` split saved with ``save_to_disk`` (a directory; needs ``datasets``).

    Raises ``DataError`` (one line) for a missing, empty or malformed file, duplicate ids,
    or an answer that is not in its context.
    """
    if os.path.isdir(path):  # a Hugging Face dataset saved with save_to_disk (squad / squad_v2 columns)
        from bert_packed.finetune.data import read_table

        table = read_table(path, ("id", "context", "question", "answers"))
        return _unique_ids(examples_from_rows([dict(zip(table, row)) for row in zip(*table.values())], path), path)
    if not os.path.isfile(path):
        raise DataError(f"SQuAD file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read SQuAD file {path}: {exc}") from None
    if not text.strip():
        raise DataError(f"SQuAD file {path} is empty")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {number} is not JSON ({exc.msg}); expected SQuAD JSON or JSON lines") from None
    if isinstance(document, dict) and "data" in document:
        examples = examples_from_squad_json(document, path)
    elif isinstance(document, dict):  # a one-line JSON-lines file
        examples = examples_from_rows([document], path)
    elif isinstance(document, list):
        examples = examples_from_rows(document, path)
    else:
        examples = examples_from_rows(rows, path)
    return _unique_ids(examples, path)


def _unique_ids(examples: List[SquadExample], path: str) -> List[SquadExample]:
    if not examples:
        raise DataError(f"SQuAD file {path} holds no questions")
    seen = set()
    for example in examples:
        if example.id in seen:
            raise DataError(f"{path}: question id {example.id!r} occurs twice (ids key predictions.json)")
        seen.add(example.id)
    return examples


# ----------------------------------------------------------------------------- features


class SquadFeatures(NamedTuple):
    """Tokenised windows, one row per feature, padded to ``max_seq_length`` columns.

    ``input_ids``/``segment_ids``/``input_mask`` ``[F, L]``; ``offsets`` ``[F, L, 2]``:
    character span in the context of every context token, -1 elsewhere (question, special
    tokens, padding); ``example_index`` ``[F]``; ``start_positions`` / ``end_positions``
    ``[F]``: answer tokens within the feature (0 = its [CLS]: no answer in this window).
    """

    input_ids: np.ndarray
    segment_ids: np.ndarray
    input_mask: np.ndarray
    offsets: np.ndarray
    example_index: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self.input_mask.sum(axis=1).astype(np.int64)

    @property
    def num_features(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, indices) -> "SquadFeatures":
        """The features at ``indices`` (an index array, slice or boolean mask)."""
        return SquadFeatures(*(np.asarray(array)[indices] for array in self))

    def samples(self) -> Dict[str, np.ndarray]:
        """The per-feature arrays ``collate_question_answering`` reads."""
        return {"input_ids": self.input_ids, "segment_ids": self.segment_ids, "input_mask": self.input_mask,
                "start_positions": self.start_positions, "end_positions": self.end_positions}


def backend_tokenizer(tokenizer: Any):
    """A private copy of the ``tokenizers.Tokenizer`` behind ``tokenizer`` (a Hugging Face fast
    tokenizer, or a ``tokenizers.Tokenizer``): truncation and padding are set per call, so
    the caller's object is left as it was."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise DataError("question answering needs a fast tokenizer (a tokenizer.json, or a vocab.txt that "
                        f"transformers converts); got {type(tokenizer).__name__}")
    return Tokenizer.from_str(backend.to_str())


def _answer_tokens(offsets: np.ndarray, is_context: np.ndarray, start_char: int, end_char: int) -> Tuple[int, int]:
    """(start, end) token of the character span [start_char, end_char) in one window, or (0, 0)
    (the [CLS]) when the window's context does not contain the whole span.

    ``offsets`` ``[L, 2]`` character spans, ``is_context`` ``[L]`` bool. The start is the last
    context token beginning at or before ``start_char``, the end the first one ending at or
    after ``end_char`` (so an answer inside a word piece maps to the whole piece).
    """
    context = np.nonzero(is_context)[0]
    first, last = int(context[0]), int(context[-1])
    if offsets[first, 0] > start_char or offsets[last, 1] < end_char:
        return 0, 0
    start = int(context[np.nonzero(offsets[context, 0] <= start_char)[0][-1]])
    end = int(context[np.nonzero(offsets[context, 1] >= end_char)[0][0]])
    return start, end


def build_features(examples: Sequence[SquadExample], tokenizer: Any, *, max_seq_length: int = 384,
                   doc_stride: int = 128, max_query_length: int = 64, show_progress: bool = False) -> SquadFeatures:
    """Tokenise every example into one or more windows (see the module docstring).

    ``doc_stride`` is the number of context tokens consecutive windows share (Hugging
    Face's ``stride``; the original BERT script's ``doc_stride`` was the step between window
    starts instead). Questions longer than ``max_query_length`` tokens are cut to that many.
    The answer labels use each example's first answer (as Hugging Face trains).
    """
    if max_query_length < 1 or max_seq_length < max_query_length + 4:
        raise DataError(f"max_seq_length={max_seq_length} leaves no room for context after a question of up to "
                        f"max_query_length={max_query_length} tokens and 3 special tokens")
    room = max_seq_length - max_query_length - 3  # fewest context tokens a window can hold
    if not 0 <= doc_stride < room:
        raise DataError(f"doc_stride={doc_stride} must be below the context room of a window "
                        f"({room} = max_seq_length - max_query_length - 3); lower finetune.doc_stride")
    tok = backend_tokenizer(tokenizer)
    tok.no_padding()
    tok.no_truncation()
    question_tok = backend_tokenizer(tok)
    tok.enable_truncation(max_seq_length, stride=doc_stride, strategy="only_second", direction="right")

    L = int(max_seq_length)
    ids, segments, masks, offsets_out, example_index, starts, ends = [], [], [], [], [], [], []
    pairs = []
    for example in examples:
        if not example.context.strip():
            raise DataError(f"question {example.id!r} has an empty context")
        question = example.question.lstrip()  # leading spaces make the window arithmetic fail (HF run_qa)
        if not question.strip():
            raise DataError(f"question {example.id!r} is empty")
        pairs.append((question, example.context))
    # Questions over max_query_length tokens are cut at that token's end.
    for i, encoding in enumerate(question_tok.encode_batch([q for q, _ in pairs], add_special_tokens=False)):
        if len(encoding.ids) > max_query_length:
            pairs[i] = (pairs[i][0][:encoding.offsets[max_query_length - 1][1]], pairs[i][1])

    chunk = 256  # encode_batch runs in Rust threads; chunks keep the progress bar moving
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(pairs), desc="tokenising", unit="question")
    for first in range(0, len(pairs), chunk):
        encodings = tok.encode_batch(pairs[first:first + chunk])
        for index, encoding in enumerate(encodings, first):
            example = examples[index]
            answer = example.answers[0] if example.answers else None
            for window in [encoding] + list(encoding.overflowing):
                # Encoding properties build a new list on every access: read each once.
                sequence_ids, window_ids, window_offsets = window.sequence_ids, window.ids, window.offsets
                if sequence_ids[0] is not None or 1 not in sequence_ids:
                    raise DataError("the tokenizer does not frame question and context as [CLS] question [SEP] "
                                    "context [SEP] (no post-processor?); use the checkpoint's BERT tokenizer")
                n = len(window_ids)
                is_context = np.zeros(L, dtype=bool)
                is_context[:n] = np.asarray([s == 1 for s in sequence_ids])
                row_offsets = np.full((L, 2), -1, dtype=np.int64)
                row_offsets[:n][is_context[:n]] = np.asarray(window_offsets, dtype=np.int64)[is_context[:n]]
                if answer is None:
                    start, end = 0, 0
                else:
                    start, end = _answer_tokens(row_offsets, is_context, answer[1], answer[1] + len(answer[0]))
                pad = L - n
                ids.append(window_ids + [0] * pad)
                segments.append(window.type_ids + [0] * pad)
                masks.append([1] * n + [0] * pad)
                offsets_out.append(row_offsets)
                example_index.append(index)
                starts.append(start)
                ends.append(end)
        if progress is not None:
            progress.update(len(encodings))
    if progress is not None:
        progress.close()
    if not ids:
        raise DataError("no questions to tokenise")
    return SquadFeatures(
        input_ids=np.asarray(ids, dtype=np.int64), segment_ids=np.asarray(segments, dtype=np.int64),
        input_mask=np.asarray(masks, dtype=np.int64), offsets=np.stack(offsets_out),
        example_index=np.asarray(example_index, dtype=np.int64),
        start_positions=np.asarray(starts, dtype=np.int64), end_positions=np.asarray(ends, dtype=np.int64))


# ----------------------------------------------------------------------------- packing


def pack_features(lengths: np.ndarray, *, max_sequence_length: int, max_sequences_per_pack: int,
                  algorithm: str = "lpfhp", seed: int = 0, shuffle: bool = False):
    """Packs of feature indices (``packing.Assignment``; depth 1 = one feature per row).

    Features keep their index, so predictions map back to examples whatever the order.
    """
    from packing import Histogram, assign, pack

    lengths = np.asarray(lengths, dtype=np.int64)
    if max_sequences_per_pack == 1:
        order = np.random.default_rng(seed).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
        return one_per_pack(order)
    histogram = Histogram.from_lengths(lengths, max_sequence_length=max_sequence_length, name="squad features")
    result = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed)
    return assign(result.plan, lengths, seed=seed, shuffle_packs=shuffle)


def collate_question_answering(samples: Mapping[str, np.ndarray], assignment: Any, *, max_sequence_length: int,
                               max_sequences_per_pack: int) -> Dict[str, np.ndarray]:
    """Packed QA batch (``QA_FIELDS``, numpy) of ``assignment``'s packs of ``samples``.

    ``samples``: ``input_ids``, ``segment_ids``, ``input_mask`` and per-feature
    ``start_positions`` / ``end_positions`` (token within the feature), e.g.
    ``SquadFeatures.samples()``. The answer positions become pack columns (feature start +
    token), so the model needs no per-feature offset; empty slots point at column 0 with
    weight 0.
    """
    S, K = int(max_sequence_length), int(max_sequences_per_pack)
    batch, layout = pack_tokens(samples, assignment, S, K)
    lengths = layout.lengths
    for name in ("start_positions", "end_positions"):
        local = np.asarray(samples[name], dtype=np.int64)[layout.order]
        if len(local) and (local.min() < 0 or np.any(local >= lengths)):
            bad = int(np.argmax((local < 0) | (local >= lengths)))
            raise BatchError(f"feature {int(layout.order[bad])}: {name} {int(local[bad])} is outside its "
                             f"{int(lengths[bad])} tokens")
        absolute = np.zeros((len(layout.offsets) - 1, K), dtype=np.int64)
        absolute[layout.pack_of, layout.slot] = layout.start + local
        batch[name] = absolute
    batch["label_weights"] = per_sequence(layout, np.ones(len(np.asarray(samples["input_ids"]))), K, np.float32)
    return batch


def feature_slots(assignment: Any, max_sequences_per_pack: int) -> np.ndarray:
    """``[P, K]`` feature index of every pack slot of ``assignment`` (-1 for an empty slot):
    how a packed batch's per-slot outputs map back to features."""
    offsets = np.asarray(assignment.pack_offsets, dtype=np.int64)
    indices = np.asarray(assignment.sequence_indices, dtype=np.int64)
    per_pack = np.diff(offsets)
    pack_of = np.repeat(np.arange(len(per_pack)), per_pack)
    slot = np.arange(len(indices)) - offsets[pack_of]
    out = np.full((len(per_pack), int(max_sequences_per_pack)), -1, dtype=np.int64)
    out[pack_of, slot] = indices
    return out


# ----------------------------------------------------------------------------- the task


@dataclass
class SquadFields:
    """``finetune.*`` keys of question answering (data.max_sequence_length is the window length)."""

    # Context tokens shared by consecutive windows of a long context (Hugging Face's stride).
    doc_stride: int = field(default=128, metadata={"ge": 0})
    # Questions longer than this many tokens are cut.
    max_query_length: int = field(default=64, metadata={"ge": 1})
    # Start and end candidates per window, and answers kept per question (nbest_predictions.json).
    n_best_size: int = field(default=20, metadata={"ge": 1})
    # Longest answer in tokens.
    max_answer_length: int = field(default=30, metadata={"ge": 1})
    # SQuAD v2.0 (unanswerable questions): null = when the data has any.
    version_2_with_negative: Optional[bool] = None
    # v2.0: answer "" when null score - best span score exceeds this.
    null_score_diff_threshold: float = 0.0


def split_examples(examples: Sequence[SquadExample], fraction: float, seed: int,
                   where: str) -> Tuple[List[SquadExample], List[SquadExample]]:
    """(train, validation) with a seeded ``fraction`` of the *contexts* held out, so no
    paragraph is seen in both (its questions would leak the answers' positions)."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"finetune.validation_fraction must be in (0, 1) without a validation_file, got {fraction}")
    contexts = list(dict.fromkeys(example.context for example in examples))
    num_held = int(round(len(contexts) * fraction))
    if num_held < 1 or num_held >= len(contexts):
        raise DataError(f"{where}: {len(contexts)} contexts are too few to hold out {fraction:.0%} for validation; "
                        f"give finetune.validation_file")
    order = np.random.default_rng(seed).permutation(len(contexts))
    held = {contexts[i] for i in order[:num_held]}
    return [ex for ex in examples if ex.context not in held], [ex for ex in examples if ex.context in held]


class SquadTask(PackedTask):
    """SQuAD v1.1 / v2.0 fine-tuning as a task of the one training loop (``finetune.task: squad``).

    Training: every window of every training question (a window without the answer is
    trained to point at its [CLS], as Hugging Face does), packed. Evaluation (every
    ``train.eval_every`` steps and at the end): every validation window, logits mapped back
    to features, n-best spans merged per question, official EM / F1 (``eval_exact_match``,
    ``eval_f1``; v2.0 adds ``has_ans_*`` / ``no_ans_*``) and ``eval_loss``. The best
    evaluation by F1 is kept (``OUT/best``, and ``OUT/hf`` at the end with
    ``finetune.load_best_model_at_end``); its answers go to ``OUT/predictions.json``
    (id -> text), with ``OUT/nbest_predictions.json`` and, for v2.0, ``OUT/null_odds.json``
    (the official evaluation script's ``--na-prob-file``).
    """

    name = "squad"
    config_fields = SquadFields
    always_evaluate = True
    metric_names = ("loss", "accuracy")
    headline_metric = "loss"
    best_metric = "eval_f1"
    greater_is_better = True

    def __init__(self, config):
        super().__init__(config)
        self.eval_examples: List[SquadExample] = []
        self.eval_features: Optional[SquadFeatures] = None
        self.version_2 = False

    # -- setup ------------------------------------------------------------------------------
    def setup(self, *, rank: int = 0, world_size: int = 1, show_progress: bool = True) -> None:
        super().setup(rank=rank, world_size=world_size, show_progress=show_progress)
        c, f, d = self.config, self.config.finetune, self.config.data
        self.best_metric = "eval_" + (f.metric_for_best_model or "f1")
        if not f.train_file:
            raise ConfigError("question answering needs finetune.train_file (SQuAD v1.1/v2.0 JSON or JSON lines)")
        if not f.packing:
            d.max_sequences_per_pack = 1  # one feature per row: the padded baseline
        tokenizer = self.checked_tokenizer("question answering")
        train = read_squad(f.train_file)
        if f.validation_file:
            validation = read_squad(f.validation_file)
        else:
            train, validation = split_examples(train, f.validation_fraction, c.train.seed, f.train_file)
        self.version_2 = (f.version_2_with_negative if f.version_2_with_negative is not None
                          else any(ex.is_impossible for ex in train + validation))
        if not self.version_2 and any(ex.is_impossible for ex in validation):
            raise ConfigError("the validation file has unanswerable (SQuAD v2.0) questions but "
                              "finetune.version_2_with_negative is false")
        progress = self.show_progress and self.is_main
        train_features = self._features(train, tokenizer, progress)
        self.eval_examples = validation
        self.eval_features = self._features(validation, tokenizer, progress)
        self.train_data = self._dataset(train_features)
        self.eval_data = self._dataset(self.eval_features)
        self.note(f"question answering (SQuAD {'v2.0' if self.version_2 else 'v1.1'}): {len(train)} training questions "
                  f"-> {self.train_data.num_sequences} windows, {len(validation)} validation questions -> "
                  f"{self.eval_data.num_sequences} windows; {self.train_data.packing_factor:.2f} windows per row "
                  f"({self.train_data.algorithm}, at most {d.max_sequences_per_pack} per row of {d.max_sequence_length})")

    def _features(self, examples, tokenizer, progress: bool) -> SquadFeatures:
        f = self.config.finetune
        return build_features(examples, tokenizer, max_seq_length=self.config.data.max_sequence_length,
                              doc_stride=f.doc_stride, max_query_length=f.max_query_length, show_progress=progress)

    def _dataset(self, features: SquadFeatures):
        from functools import partial

        from bert_packed.finetune.data import Encoded, PackedDataset

        d = self.config.data
        encoded = Encoded(features.input_ids, features.segment_ids, features.lengths, 0)
        extra = {"input_mask": features.input_mask, "start_positions": features.start_positions,
                 "end_positions": features.end_positions}
        collate = partial(collate_question_answering, max_sequence_length=d.max_sequence_length,
                          max_sequences_per_pack=d.max_sequences_per_pack)
        return PackedDataset(encoded, extra, collate, max_sequence_length=d.max_sequence_length,
                             max_sequences_per_pack=d.max_sequences_per_pack, algorithm=d.packing_algorithm,
                             seed=self.config.train.seed)

    # -- model, data ------------------------------------------------------------------------
    def model_class(self):
        from bert_packed.modeling import BertForQuestionAnswering

        return BertForQuestionAnswering

    # -- evaluation -------------------------------------------------------------------------
    def predict_logits(self, backend) -> Tuple[np.ndarray, np.ndarray]:
        """Start / end logits ``[F, S]`` of every validation window (feature-local, token t at t)."""
        from bert_packed.finetune.squad_postprocess import feature_logits

        shape = (self.eval_features.num_features, self.config.data.max_sequence_length)
        start, end = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for batch, rows in self.evaluation_batches():
            out = backend.predict_step(batch, names=("start_logits", "end_logits"))
            feature_logits(batch, out["start_logits"], out["end_logits"], rows, start, end)
        return start, end

    def evaluate(self, backend) -> Dict[str, float]:
        from bert_packed.finetune.squad_metrics import squad_scores
        from bert_packed.finetune.squad_postprocess import postprocess_predictions

        f = self.config.finetune
        start, end = self.predict_logits(backend)
        predictions = postprocess_predictions(
            self.eval_examples, self.eval_features, start, end, n_best_size=f.n_best_size,
            max_answer_length=f.max_answer_length, version_2_with_negative=self.version_2,
            null_score_diff_threshold=f.null_score_diff_threshold)
        scores = squad_scores(predictions.answers, self.eval_examples, version_2=self.version_2)
        metrics = {"eval_loss": span_loss(start, end, self.eval_features)}
        metrics.update({f"eval_{k}": float(v) for k, v in scores.items() if not k.endswith("total")})
        self.last_outputs = predictions
        return metrics

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return f"EM {metrics['eval_exact_match']:.2f} F1 {metrics['eval_f1']:.2f} loss {metrics['eval_loss']:.4f}"

    # -- end of run -------------------------------------------------------------------------
    def finish(self, backend, model, output_dir: str, summary: Dict[str, Any]) -> None:
        from bert_packed.io import write_text_atomic

        predictions = self.chosen_evaluation(model, output_dir, summary)
        summary["squad_version"] = "v2.0" if self.version_2 else "v1.1"
        if self.is_main and predictions is not None:
            files = {"predictions.json": predictions.answers, "nbest_predictions.json": predictions.nbest}
            if self.version_2:
                files["null_odds.json"] = predictions.null_odds
            for name, content in files.items():
                write_text_atomic(os.path.join(output_dir, name), json.dumps(content, indent=1) + "\n")
            summary["predictions"] = os.path.join(output_dir, "predictions.json")
        super().finish(backend, model, output_dir, summary)

    def outputs_state(self, outputs) -> Any:
        return [outputs.answers, outputs.null_odds, outputs.nbest]

    def outputs_from_state(self, state: Any):
        from bert_packed.finetune.squad_postprocess import Predictions

        return Predictions(*state)


def span_loss(start_logits: np.ndarray, end_logits: np.ndarray, features: SquadFeatures) -> float:
    """Mean over features of ``(CE(start) + CE(end)) / 2``, each over the feature's own tokens:
    the model's training loss (``losses.span_loss_terms``) on per-feature logits ``[F, L]``,
    each feature a row holding one sequence."""
    import torch

    from bert_packed.losses import span_loss_terms

    if not features.num_features:
        return 0.0
    with torch.no_grad():
        terms = span_loss_terms(torch.from_numpy(np.asarray(start_logits, np.float32)),
                                torch.from_numpy(np.asarray(end_logits, np.float32)),
                                torch.from_numpy(features.input_mask.astype(np.int64)),
                                torch.from_numpy(features.start_positions.astype(np.int64))[:, None],
                                torch.from_numpy(features.end_positions.astype(np.int64))[:, None],
                                torch.ones((features.num_features, 1)))
    return float(terms["loss_sum"].double().sum() / features.num_features)
