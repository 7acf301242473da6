"""SQuAD-style extractive question answering as a task of the training loop.

The steps are plain functions over plain data, each in its own module:

1. **Read** (``squad_data``): SQuAD v1.1 / v2.0 JSON or Hugging Face ``squad`` /
   ``squad_v2`` rows -> :class:`~bert_packed.finetune.squad_data.SquadExample`, checked.
2. **Featurise** (``squad_features``): question + context windows through the checkpoint's
   fast tokenizer, answers mapped to window tokens -> ``SquadFeatures``.
3. **Pack and collate** (``squad_collate``): features packed side by side in fixed
   ``[B, S]`` rows, each with its own [CLS] -> the ``QA_FIELDS`` batch.

This module holds what ties them to the loop: :func:`split_examples` (the held-out
validation contexts), :class:`SquadTask` and :func:`span_loss`. Post-processing and metrics
are in ``squad_postprocess`` / ``squad_metrics``; the model is
``bert_packed.modeling.BertForQuestionAnswering``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.finetune.data import PackedTask
from bert_packed.finetune.squad_collate import collate_question_answering
from bert_packed.finetune.squad_data import SquadExample, read_squad
from bert_packed.finetune.squad_features import SquadFeatures, build_features

__all__ = ["split_examples", "SquadTask", "span_loss"]


# ----------------------------------------------------------------------------- the task


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
        self.best: Dict[str, Any] = {}
        self.last_eval: Dict[str, Any] = {}
        self.best_predictions = None
        self._last_predictions = None

    # -- setup ------------------------------------------------------------------------------
    def setup(self, *, rank: int = 0, world_size: int = 1, show_progress: bool = True) -> None:
        from bert_packed.config import ConfigError

        super().setup(rank=rank, world_size=world_size, show_progress=show_progress)
        c, f, d = self.config, self.config.finetune, self.config.data
        if not f.train_file:
            raise ConfigError("question answering needs finetune.train_file (SQuAD v1.1/v2.0 JSON or JSON lines)")
        for key in ("n_best_size", "max_answer_length", "max_query_length"):
            if getattr(f, key) < 1:
                raise ConfigError(f"finetune.{key} must be >= 1, got {getattr(f, key)}")
        if f.doc_stride < 0:
            raise ConfigError(f"finetune.doc_stride must be >= 0, got {f.doc_stride}")
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

    def data_source(self, split: str, *, micro_batch_size: int, rank: int, world_size: int):
        if split != "train":
            raise ValueError("question answering evaluates the whole validation set (evaluate), not a stream")
        return self.train_data.source(micro_batch_size, rank, world_size)

    # -- evaluation -------------------------------------------------------------------------
    def predict_logits(self, backend) -> Tuple[np.ndarray, np.ndarray]:
        """Start / end logits ``[F, S]`` of every validation window (feature-local, token t at t)."""
        from bert_packed.finetune.squad_postprocess import feature_logits

        if not self._eval_batches:
            self.prepare_evaluation(micro_batch_size=self.config.train.micro_batch_size, rank=0, world_size=1)
        shape = (self.eval_features.num_features, self.config.data.max_sequence_length)
        start, end = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for batch, rows in self._eval_batches:
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
        self._last_predictions = predictions
        return metrics

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return f"EM {metrics['eval_exact_match']:.2f} F1 {metrics['eval_f1']:.2f} loss {metrics['eval_loss']:.4f}"

    def on_evaluation(self, step: int, metrics: Dict[str, float], backend, model, output_dir: str) -> None:
        better = "value" not in self.best or metrics[self.best_metric] > self.best["value"]
        if self.record_evaluation(step, metrics, backend, model, output_dir, better=better):
            self.best_predictions = self._last_predictions

    # -- end of run -------------------------------------------------------------------------
    def finish(self, backend, model, output_dir: str, summary: Dict[str, Any]) -> None:
        from bert_packed.io import write_text_atomic

        use_best = self.restore_best(model, output_dir, f"F1 {self.best.get('value', float('nan')):.2f}")
        chosen = self.best if use_best else {"step": self.last_eval.get("step"), "metrics": self.last_eval}
        predictions = self.best_predictions if use_best else self._last_predictions
        if chosen.get("metrics"):
            metrics = {k[len("eval_"):]: v for k, v in chosen["metrics"].items() if k.startswith("eval_")}
            summary["eval"] = {**metrics, "step": chosen["step"]}
        summary["squad_version"] = "v2.0" if self.version_2 else "v1.1"
        if self.is_main and predictions is not None:
            files = {"predictions.json": predictions.answers, "nbest_predictions.json": predictions.nbest}
            if self.version_2:
                files["null_odds.json"] = predictions.null_odds
            for name, content in files.items():
                write_text_atomic(os.path.join(output_dir, name), json.dumps(content, indent=1) + "\n")
            summary["predictions"] = os.path.join(output_dir, "predictions.json")
        super().finish(backend, model, output_dir, summary)

    def state_dict(self) -> Dict[str, Any]:
        best = self.best_predictions
        return {"best": dict(self.best), "last_eval": dict(self.last_eval),
                "best_predictions": None if best is None else [best.answers, best.null_odds, best.nbest]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        from bert_packed.finetune.squad_postprocess import Predictions

        self.best = dict(state.get("best") or {})
        self.last_eval = dict(state.get("last_eval") or {})
        best = state.get("best_predictions")
        self.best_predictions = None if best is None else Predictions(*best)


def span_loss(start_logits: np.ndarray, end_logits: np.ndarray, features: SquadFeatures) -> float:
    """Mean over features of ``(CE(start) + CE(end)) / 2``, each over the feature's own tokens
    (the model's training loss, from per-feature logits ``[F, L]``)."""
    valid = features.input_mask.astype(bool)
    total = np.zeros(features.num_features)
    rows = np.arange(features.num_features)
    for logits, target in ((start_logits, features.start_positions), (end_logits, features.end_positions)):
        scores = np.where(valid, logits.astype(np.float64), -np.inf)
        top = scores.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(scores - top).sum(axis=1)) + top[:, 0]
        total += log_norm - scores[rows, target]
    return float((total / 2).mean()) if features.num_features else 0.0
