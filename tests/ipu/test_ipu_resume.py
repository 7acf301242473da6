"""Issue 26, items 1 and 5: on the IPU path (the mock), a run stopped by SIGTERM in the middle
and resumed with --resume equals the uninterrupted run bit for bit: every step's losses and
learning rate in metrics.jsonl, and the final weights and optimizer state, with dropout on and an
evaluation between steps.

What it takes (PopTorch sdk-release-3.4, ``python/_poplar_executor.py``, ``python/optim.py``):
PopTorch compiles the optimizer's hyperparameters as they were at the last ``setOptimizer``
(``trainingModel()`` calls it), so the checkpoint's optimizer state is loaded into PopTorch's
optimizer before ``trainingModel()``; and the device's random numbers (dropout) come from the
executable's own seed and RNG state (``PoplarExecutor.rng_state``), not from the host's torch
generator, so they must be saved in the checkpoint and set on the compiled executable before its
first run.

Self-contained on purpose (only ``run.main``, ``backends.mock`` and the checkpoint file): the
same file runs against the code before the issue-22 refactor, where it fails.
"""
import json
import os
import signal

import torch

import run
from backends.mock import MockBackend
from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint

STEPS = 8
ARGS = ["--config", "tiny", "--backend", "mock", "--no-progress", "--steps", str(STEPS),
        "--set", "data.num_sequences=300", "--set", "data.num_eval_sequences=60",
        "--set", "data.packing_algorithm=lpfhp", "--set", "train.micro_batch_size=4",
        "--set", "model.hidden_dropout_prob=0.1", "--set", "model.attention_probs_dropout_prob=0.1",
        # the rate moves every step (warm-up over half the run, then decay), and an evaluation
        # runs between steps (its own inference executable)
        "--set", "optimizer.warmup_fraction=0.5", "--set", "train.eval_every=2",
        "--set", f"train.checkpoint_every={STEPS}"]
KEYS = ("step", "loss", "mlm_loss", "nsp_loss", "learning_rate", "eval_loss", "sequences", "tokens")


class SigtermDuringCall(MockBackend):
    """The mock backend, that sends its own process SIGTERM during training call ``at``: the
    loop's handler stops the run at the end of that call, with a checkpoint."""

    at = 3

    def __init__(self):
        super().__init__()
        self.calls = 0

    def train_step(self, micro_batches):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(micro_batches)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{key: line.get(key) for key in KEYS} for line in map(json.loads, f)]


def test_a_run_stopped_by_sigterm_and_resumed_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys,
                                                                            one_thread):
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    assert run.main(ARGS + ["--output-dir", full]) == 0
    with monkeypatch.context() as patch:
        patch.setattr(run, "get_backend", lambda name, **kwargs: SigtermDuringCall())
        assert run.main(ARGS + ["--output-dir", split]) == 128 + signal.SIGTERM
    assert load_checkpoint(os.path.join(split, CHECKPOINT_NAME))["step"] == SigtermDuringCall.at
    assert run.main(ARGS + ["--resume", "--output-dir", split]) == 0
    capsys.readouterr()

    expected, resumed = _metrics(full), _metrics(split)
    assert [line["step"] for line in resumed] == list(range(1, STEPS + 1))
    at = SigtermDuringCall.at
    # the steps after the resume run at other rates than the first step's
    assert expected[0]["learning_rate"] not in {line["learning_rate"] for line in expected[at:at + 2]}
    assert [line["eval_loss"] is not None for line in expected] == [step % 2 == 0 for step in range(1, STEPS + 1)]
    for want, got in zip(expected, resumed):
        assert got == want, f"step {want['step']}"
    final = [load_checkpoint(os.path.join(out, CHECKPOINT_NAME)) for out in (full, split)]
    assert final[0]["step"] == final[1]["step"] == STEPS
    weights = [checkpoint["model"] for checkpoint in final]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
