"""SQuAD features: question + context windows through the checkpoint's fast tokenizer.

:func:`build_features` tokenises question + context with the ``tokenizers`` library (the
engine behind Hugging Face's fast tokenizers); a long context is split into overlapping
windows of ``max_seq_length`` tokens that share ``doc_stride`` context tokens (Hugging Face's
``stride`` semantics, so the features are exactly those of ``tokenizer(question, context,
truncation="only_second", stride=..., return_overflowing_tokens=True)``), with the character
offsets of every context token. The answer is mapped to the token start / end of every
window that contains it whole; a window that does not (and every window of an unanswerable
v2.0 question) points at its own [CLS] (token 0), as Hugging Face's ``run_qa.py`` does.
No torch here.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Sequence, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.finetune.squad.data import SquadExample

__all__ = ["SquadFeatures", "backend_tokenizer", "build_features"]


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

