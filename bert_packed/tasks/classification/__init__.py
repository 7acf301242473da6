"""Packed sequence classification (single-label, multi-label, regression): ``task`` (the task
and its keys), ``model`` (``BertForSequenceClassification`` and its losses), ``data`` (labels,
collation), ``metrics`` (scikit-learn / SciPy metrics, predictions).

The package exports the task class, which ``bert_packed.tasks.registry.TASKS`` names.
"""
from bert_packed.tasks.classification.task import ClassificationTask

__all__ = ["ClassificationTask"]
