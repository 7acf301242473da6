"""Pre-training (MLM + NSP) as a task of the one loop: ``finetune.task: null``."""
from __future__ import annotations

from typing import Any, Dict, List

from bert_packed.tasks.base import Task
from bert_packed.tasks.pretraining.metrics import evaluation_metrics

__all__ = ["PretrainingTask"]


class PretrainingTask(Task):
    """MLM + NSP pre-training on generated data, one HDF5 file or a directory of shards."""

    name = "pretraining"
    metric_names = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
    headline_metric = "mlm_loss"

    def __init__(self, config):
        super().__init__(config)
        self.eval_batches: List[Dict[str, Any]] = []

    def model_class(self):
        from bert_packed.tasks.pretraining.model import BertForPreTraining

        return BertForPreTraining

    def data_source(self, split: str, *, micro_batch_size: int, rank: int, world_size: int):
        from bert_packed.tasks.pretraining.data import build_data_source

        return build_data_source(self.config, split=split, micro_batch_size=micro_batch_size, rank=rank,
                                 world_size=world_size)

    def progress_text(self, line: Dict[str, Any], short: bool = False) -> str:
        if short:  # the bar shares one terminal line with it
            return f"mlm {line['mlm_loss']:.3f} acc {line['mlm_accuracy']:.3f} {line['sequences_per_second']:.0f} seq/s"
        return (f"loss {line['loss']:.3f} mlm {line['mlm_loss']:.3f} nsp {line['nsp_loss']:.3f} "
                f"mlm_acc {line['mlm_accuracy']:.3f} {line['sequences_per_second']:.0f} seq/s")

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return (f"loss {metrics['eval_loss']:.3f} mlm {metrics['eval_mlm_loss']:.3f} "
                f"nsp {metrics['eval_nsp_loss']:.3f} mlm_acc {metrics['eval_mlm_accuracy']:.3f}")

    def prepare_evaluation(self, *, micro_batch_size: int, rank: int, world_size: int) -> None:
        """The first ``train.eval_batches`` held-out micro-batches of this rank, built once (the
        same batches every time, so evaluations are comparable)."""
        iterator = iter(self.data_source("eval", micro_batch_size=micro_batch_size, rank=rank, world_size=world_size))
        self.eval_batches = [next(iterator) for _ in range(self.config.train.eval_batches)]

    def evaluate(self, backend) -> Dict[str, float]:
        """Count-weighted means over the held-out micro-batches (``metrics.evaluation_metrics``)."""
        return evaluation_metrics(backend.eval_step(batch) for batch in self.eval_batches)
