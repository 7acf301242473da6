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
packed several per row (``bert_packed.tasks.data.PackedDataset``; ``finetune.packing=false``:
one per row) and trained with ``model.BertForTokenClassification``: Hugging Face's layout
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
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from bert_packed.errors import ConfigError
from bert_packed.tasks import data as ft_data
from bert_packed.tasks.packed import PackedTask
from bert_packed.tasks.token_classification.data import (IGNORE_INDEX, EncodedSentences, TagSet,
                                                            check_sentences, collate_token_classification,
                                                            encode_sentences, read_sentences, split_sentences)
from bert_packed.tasks.token_classification.metrics import entity_scores, word_predictions
from bert_packed.io.files import write_text_atomic

__all__ = ["TokenClassificationTask", "TokenClassificationFields", "scored_token_loss", "PREDICTIONS_NAME"]

PREDICTIONS_NAME = "predictions.jsonl"


# ----------------------------------------------------------------------------- the task


@dataclass
class TokenClassificationFields:
    """``finetune.*`` keys of token classification (NER)."""

    # JSON lines / datasets columns: the words of a sentence and their IOB2 tags.
    tokens_column: str = "tokens"
    tags_column: str = "ner_tags"
    # Train every sub-token of a word (later ones of a B-X word as I-X), not only its first.
    label_all_tokens: bool = False


class TokenClassificationTask(PackedTask):
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
            only_in = f"the validation file, not in the training file {train.path}"
        else:
            train, train_tags, validation, validation_tags = split_sentences(train, train_tags, f.validation_fraction,
                                                                    c.train.seed)
            only_in = (f"the held-out validation split (finetune.validation_fraction={f.validation_fraction} of "
                       f"{train.path}), not in the sentences trained on")
        self.tags = TagSet.from_training(train_tags, train.label_names, self._checkpoint_labels(), train.path)
        self.tags.check(validation, validation_tags, only_in)
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
        from bert_packed.io.hf_io import label_maps

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
        from bert_packed.tasks.token_classification.model import BertForTokenClassification

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


def scored_token_loss(logits: List[np.ndarray], labels: np.ndarray) -> float:
    """The model's loss on per-sentence logits: mean cross-entropy over the scored tokens."""
    import torch
    import torch.nn.functional as F

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
