"""SQuAD-style extractive question answering as a task of the training loop.

The steps are plain functions over plain data, in the files of this package:

1. **Read** (``data.read_squad``): SQuAD v1.1 / v2.0 JSON or Hugging Face ``squad`` /
   ``squad_v2`` rows -> :class:`~bert_packed.tasks.squad.data.SquadExample`, checked.
2. **Featurise** (``data.build_features``): question + context windows through the
   checkpoint's fast tokenizer, answers mapped to window tokens -> ``SquadFeatures``.
3. **Pack and collate** (``data.collate_question_answering``): features packed side by side
   in fixed ``[B, S]`` rows, each with its own [CLS] -> the ``QA_FIELDS`` batch.
4. **Model** (``model.BertForQuestionAnswering``): start / end scores and the span loss.
5. **Evaluate** (``metrics``): post-processing to answer texts, official EM / F1.

This module holds what ties them to the loop: :func:`split_examples` (the held-out
validation contexts), :class:`SquadTask` and :func:`span_loss`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bert_packed.errors import ConfigError
from bert_packed.tasks.packed import PackedTask
from bert_packed.tasks.data import held_out
from bert_packed.tasks.squad.data import (Moved, SquadExample, SquadFeatures, build_features,
                                             collate_question_answering, read_squad, squad_version)
from bert_packed.limits import SEQUENCE_TOKENS, at_most, bounded

__all__ = ["split_examples", "SquadTask", "span_loss"]


# ----------------------------------------------------------------------------- the task


_WINDOW = at_most(SEQUENCE_TOKENS, "a window holds at most data.max_sequence_length's maximum of tokens")


@dataclass
class SquadFields:
    """``finetune.*`` keys of question answering (data.max_sequence_length is the window length)."""

    # Context tokens shared by consecutive windows of a long context (Hugging Face's stride).
    # (The three token counts are also checked against the window, data.max_sequence_length.)
    doc_stride: int = bounded(128, ge=0, **_WINDOW)
    # Questions longer than this many tokens are cut.
    max_query_length: int = bounded(64, ge=1, **_WINDOW)
    # Start and end candidates per window, and answers kept per question (nbest_predictions.json).
    # Their n_best_size^2 (start, end) pairs are scored for every window (Hugging Face: 20).
    n_best_size: int = bounded(20, ge=1, **at_most(1024, "its square of (start, end) pairs is scored for every "
                                                         "window; Hugging Face uses 20"))
    # Longest answer in tokens.
    max_answer_length: int = bounded(30, ge=1, **_WINDOW)
    # SQuAD v2.0 (unanswerable questions): null = when the data has any.
    version_2_with_negative: Optional[bool] = None
    # v2.0: answer "" when null score - best span score exceeds this.
    null_score_diff_threshold: float = field(default=0.0, metadata={
        "unbounded": "a threshold on logit differences: any finite value means something"})


def split_examples(examples: Sequence[SquadExample], fraction: float, seed: int,
                   where: str) -> Tuple[List[SquadExample], List[SquadExample]]:
    """(train, validation) with a seeded ``fraction`` of the *contexts* held out, so no
    paragraph is seen in both (its questions would leak the answers' positions)."""
    contexts = list(dict.fromkeys(example.context for example in examples))
    held = {contexts[i] for i in held_out(len(contexts), fraction, seed, what="contexts", where=where)[1]}
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
    metric_names = ("loss", "span_accuracy")  # start and end both right (BertForQuestionAnswering)
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
        train = self._read(f.train_file)
        if f.validation_file:
            validation = self._read(f.validation_file)
        else:
            train, validation = split_examples(train, f.validation_fraction, c.train.seed, f.train_file)
        self.version_2 = squad_version(train, validation, f.version_2_with_negative, train_where=f.train_file,
                                       validation_where=f.validation_file or f"{f.train_file} (validation part)")
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

    def _read(self, path: str) -> List[SquadExample]:
        """``read_squad``, its answer_start fix-up note printed by the main process only."""
        moved = Moved()
        examples = read_squad(path, notes=False, moved=moved)
        note = moved.note(path)
        if note:
            self.note(note)
        return examples

    def _features(self, examples, tokenizer, progress: bool) -> SquadFeatures:
        f = self.config.finetune
        return build_features(examples, tokenizer, max_seq_length=self.config.data.max_sequence_length,
                              doc_stride=f.doc_stride, max_query_length=f.max_query_length, show_progress=progress)

    def _dataset(self, features: SquadFeatures):
        from functools import partial

        from bert_packed.tasks.data import Encoded, PackedDataset

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
        from bert_packed.tasks.squad.model import BertForQuestionAnswering

        return BertForQuestionAnswering

    # -- evaluation -------------------------------------------------------------------------
    def predict_logits(self, backend) -> Tuple[np.ndarray, np.ndarray]:
        """Start / end logits ``[F, S]`` of every validation window (feature-local, token t at t)."""
        from bert_packed.tasks.squad.metrics import feature_logits

        shape = (self.eval_features.num_features, self.config.data.max_sequence_length)
        start, end = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for batch, rows in self.evaluation_batches():
            out = backend.predict_step(batch, names=("start_logits", "end_logits"))
            feature_logits(batch, out["start_logits"], out["end_logits"], rows, start, end)
        return start, end

    def evaluate(self, backend) -> Dict[str, float]:
        from bert_packed.tasks.squad.metrics import postprocess_predictions, squad_scores

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
        from bert_packed.io.files import write_text_atomic

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
        from bert_packed.tasks.squad.metrics import Predictions

        return Predictions(*state)


def span_loss(start_logits: np.ndarray, end_logits: np.ndarray, features: SquadFeatures) -> float:
    """Mean over features of ``(CE(start) + CE(end)) / 2``, each over the feature's own tokens:
    the model's training loss (``model.span_loss_terms``) on per-feature logits ``[F, L]``,
    each feature a row holding one sequence."""
    import torch

    from bert_packed.tasks.squad.model import span_loss_terms

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
