"""Pre-training, MLM + NSP: ``task`` (the task, ``finetune.task: null``), ``model``
(``BertForPreTraining``: the heads on ``BertModel``, and ``build_model``), ``data`` (the data
source a config names: generated, one HDF5 file or a directory of shards), ``metrics`` (the
held-out evaluation, the progress line).

The package exports the task class, which ``bert_packed.tasks.registry.TASKS`` names.
"""
from bert_packed.tasks.pretraining.task import PretrainingTask

__all__ = ["PretrainingTask"]
