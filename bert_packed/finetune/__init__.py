"""Fine-tuning tasks for the one training loop (see ``bert_packed.task`` for the interface).

Every task is a package of the same files (``task.py``, ``model.py``, ``data.py``,
``metrics.py``, ``__init__.py``; see ``bert_packed.finetune.base``):

- ``classification``: packed sequence classification / regression (``ClassificationTask``);
- ``squad``: extractive question answering, SQuAD v1.1 / v2.0 (``SquadTask``);
- ``token_classification``: named-entity recognition (``TokenClassificationTask``).

Shared by them:

- ``base``: ``PackedTask``, the base class of the tasks;
- ``data``: reading CSV/TSV/JSONL, tokenising with the checkpoint's tokenizer, packing;
- ``python -m bert_packed.finetune {export,predict,fortunes}``: Hugging Face export of a
  run's checkpoint, predictions from an exported model, the fortunes example data.
"""
