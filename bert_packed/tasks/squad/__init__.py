"""SQuAD-style extractive question answering: ``task`` (the task and its keys), ``model``
(``BertForQuestionAnswering`` and the span loss), ``data`` (reading, features, collation),
``metrics`` (answers from logits, official EM / F1).

The package exports the task class, which ``bert_packed.tasks.registry.TASKS`` names.
"""
from bert_packed.tasks.squad.task import SquadTask

__all__ = ["SquadTask"]
