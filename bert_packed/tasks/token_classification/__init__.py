"""Token classification (NER): ``task`` (the task and its keys), ``model``
(``BertForTokenClassification`` and its loss), ``data`` (sentences, tags, encoding, collation),
``metrics`` (word predictions, seqeval entity scores).

The package exports the task class, which ``bert_packed.tasks.registry.TASKS`` names.
"""
from bert_packed.tasks.token_classification.task import TokenClassificationTask

__all__ = ["TokenClassificationTask"]
