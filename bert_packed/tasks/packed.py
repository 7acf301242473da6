"""The base class of the fine-tuning tasks: what every task that trains on packed
``PackedDataset``s does the same way (``bert_packed.tasks.base.Task`` for the interface).

A task is a package ``bert_packed/tasks/<task>/`` with the same files (pre-training's too):

- ``task.py``: the task class (a :class:`PackedTask`), its ``finetune.*`` keys and its outputs;
- ``model.py``: the model (encoder + head) and its loss;
- ``data.py``: reading and checking its files, encoding, and the collation of packed batches;
- ``metrics.py``: evaluation metrics and predictions;
- ``__init__.py``: exports the task class (what ``bert_packed.tasks.registry.TASKS`` names).

What the tasks share sits here and in ``bert_packed.tasks.data`` (tables, tokenising,
``PackedDataset``).
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.errors import ConfigError
from bert_packed.tasks.data import PackedDataset
from bert_packed.limits import STEPS
from bert_packed.tasks.base import Task

__all__ = ["PackedTask", "epochs_to_steps"]


def epochs_to_steps(epochs: float, num_packs: int, packs_per_step: int) -> int:
    """Optimizer steps that cover ``epochs`` passes over ``num_packs`` packs (at least 1)."""
    return max(1, math.ceil(epochs * num_packs / packs_per_step))


class PackedTask(Task):
    """A fine-tuning task that trains on ``train_data`` and evaluates every pack of ``eval_data``
    (``PackedDataset``s its ``setup`` builds)."""

    def __init__(self, config):
        super().__init__(config)
        self.train_data: Optional[PackedDataset] = None
        self.eval_data: Optional[PackedDataset] = None
        self._eval_batches: List[Tuple[Dict[str, np.ndarray], np.ndarray]] = []

    def checked_tokenizer(self, purpose: str):
        """:meth:`Task.tokenizer`, refused in one line when there is none or it has more tokens
        than the model's vocabulary (``purpose`` names the task in the message)."""
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise ConfigError(f"{purpose} needs a tokenizer: --init-checkpoint a Hugging Face directory with "
                              "tokenizer files (tokenizer.json or vocab.txt), or set model.tokenizer")
        vocab_size = self.config.model.vocab_size
        if tokenizer.get_vocab_size() > vocab_size:
            raise ConfigError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
                              f"{vocab_size}; use the checkpoint's own tokenizer")
        return tokenizer

    def num_steps(self, packs_per_step: int) -> int:
        """``train.steps``, or ``finetune.epochs`` over the training packs (unless steps came from the CLI).

        Training data smaller than one optimizer step cannot make an epoch: one step would hold
        the same packs several times (18 SQuAD questions in a 32-pack step trained each six
        times in one update, reported as "1 steps"). With steps from ``finetune.epochs`` that is
        refused (``DataError``) rather than trained with a smaller step, because the step size is
        part of the recipe (the learning rate and warm-up were chosen for it): shrinking it
        silently would train something else than configured. With steps given (``--steps``)
        the passes are the user's to choose, so the repetition is said in a note instead."""
        f, t = self.config.finetune, self.config.train
        data = self.train_data
        small = data.num_packs < packs_per_step
        what = (f"{f.train_file}: {data.num_sequences} training sequences make {data.num_packs} packs, fewer than "
                f"the {packs_per_step} packs of one optimizer step") if small else ""
        if f.epochs is None or "steps" in self.config.cli_keys["train"]:
            if small:
                self.note(f"note: {what}: every step repeats them (~{packs_per_step / data.num_packs:.0f} passes)")
            return t.steps
        if small:
            raise DataError(
                f"{what}, so finetune.epochs={f.epochs:g} cannot be kept; lower train.micro_batch_size="
                f"{t.micro_batch_size} or train.gradient_accumulation (or train.global_batch_size) to at most "
                f"{data.num_packs} packs per step, or give more training data")
        steps = epochs_to_steps(f.epochs, data.num_packs, packs_per_step)
        if steps > STEPS["le"]:
            raise ConfigError(f"finetune.epochs={f.epochs:g} over {data.num_packs} training packs, "
                              f"{packs_per_step} per step, come to {steps} optimizer steps, more than train.steps' "
                              f"maximum {STEPS['le']} ({STEPS['why']}); lower finetune.epochs")
        return steps

    def training_lengths(self):
        """The lengths of the training file's sequences as tokenized (reads it when not set up yet)."""
        if self.train_data is None:
            self.setup(show_progress=False)
        return np.asarray(self.train_data.lengths)

    def data_source(self, split: str, *, micro_batch_size: int, rank: int, world_size: int):
        if split != "train":
            raise ValueError(f"{self.name} evaluates the whole validation set (evaluate), not a stream")
        f = self.config.finetune
        return self.train_data.source(micro_batch_size, rank, world_size,
                                      inputs=[p for p in (f.train_file, f.validation_file) if p and os.path.exists(p)])

    def prepare_evaluation(self, *, micro_batch_size: int, rank: int, world_size: int) -> None:
        self._eval_batches = list(self.eval_data.batches(micro_batch_size))

    def evaluation_batches(self) -> List[Tuple[Dict[str, np.ndarray], np.ndarray]]:
        """Every validation pack once, as ``(batch, rows)`` (built on first use when the loop did not)."""
        if not self._eval_batches:
            self.prepare_evaluation(micro_batch_size=self.config.train.micro_batch_size, rank=0, world_size=1)
        return self._eval_batches
