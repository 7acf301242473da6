"""Tasks: what the one training loop (``bert_packed.loop.train``) trains, one package each.

- ``base``: the task interface (``Task``) and the best-model bookkeeping;
- ``registry``: ``TASKS`` (``finetune.task`` -> the task class; null = pre-training) and what
  the tasks add to the configuration;
- ``pretraining``: MLM + NSP on generated data, one HDF5 file or a directory of shards;
- ``classification``, ``squad``, ``token_classification``: the fine-tuning tasks, on
  ``packed.PackedTask`` and the shared table reader and ``PackedDataset`` (``data``).

Every task package has the same five files: ``__init__.py`` (exports the task class),
``task.py``, ``model.py``, ``data.py``, ``metrics.py``.
"""
