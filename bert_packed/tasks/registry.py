"""The task registry: ``finetune.task`` -> the task class (null = pre-training), and what the
tasks add to the configuration.

Register a task with one line in ``TASKS`` (``name: "module:Class"``, imported on use);
:func:`register_config_sections` (``run.py`` calls it) registers every task's keys with
``bert_packed.config``, which imports no task.
"""
from __future__ import annotations

import importlib
from typing import Dict

from bert_packed.config import register_resolver, register_task_fields
from bert_packed.errors import ConfigError


TASKS = {
    "pretraining": "bert_packed.tasks.pretraining:PretrainingTask",
    "classification": "bert_packed.tasks.classification:ClassificationTask",
    "squad": "bert_packed.tasks.squad:SquadTask",
    "token_classification": "bert_packed.tasks.token_classification:TokenClassificationTask",
}


def task_class(name: str) -> type:
    """The task class registered as ``name``."""
    if name not in TASKS:
        raise ConfigError(f"finetune.task={name!r} is not a task; tasks: {', '.join(sorted(TASKS))}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def task_config_fields() -> Dict[str, type]:
    """``{task name: its config_fields dataclass}`` of every registered task that has keys."""
    fields = {}
    for name in TASKS:
        cls = task_class(name)
        if cls.config_fields is not None:
            fields[name] = cls.config_fields
    return fields


def register_config_sections() -> None:
    """Tell ``bert_packed.config`` what the tasks add to it: each task's own ``finetune.*`` keys,
    and the init checkpoint's model shape, resolved on every loaded config. Call it before loading
    a config that may use them (``run.py`` does; again is a no-op)."""
    for name, fields_cls in task_config_fields().items():
        register_task_fields(name, fields_cls)
    register_resolver(resolve_init_checkpoint)


def resolve_init_checkpoint(config) -> None:
    """The model's shape from ``model.init_checkpoint`` as a config is loaded (``load_config``),
    so validation and the printed config see it. A config file's shape (e.g. finetune_squad's
    BERT-Base) is what to build without a checkpoint; with one, the checkpoint's wins: only a
    ``--set`` shape can contradict it. ConfigError (one line) for an unreadable checkpoint."""
    path = config.model.init_checkpoint
    if not path or config.shape_from == path:
        return
    from bert_packed.io import hf_io

    defaults = type(config.model)()
    for key in hf_io.SHAPE_FIELDS:
        if key not in config.cli_keys["model"]:
            setattr(config.model, key, getattr(defaults, key))
    try:
        resolve_checkpoint_shape(config, hf_io.read_pretrained(path, weights=False))
    except hf_io.CheckpointError as exc:  # a config problem to every caller of load_config
        raise ConfigError(str(exc)) from None


def resolve_checkpoint_shape(config, pretrained) -> None:
    """Take the model section's shape (and unset architecture fields) from ``pretrained`` (an
    ``hf_io.Pretrained``), once per config: a config already resolved from that checkpoint (as
    it was loaded) is left as it is."""
    if config.shape_from == pretrained.path:
        return
    from bert_packed.io import hf_io

    hf_io.resolve_model_config(config.model, pretrained)
    config.shape_from = pretrained.path


def get_task(config):
    """The task object for ``config`` (``finetune.task``; null = pre-training)."""
    return task_class(config.finetune.task or "pretraining")(config)
