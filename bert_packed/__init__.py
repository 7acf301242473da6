"""Packed BERT: the model (packed and unpacked through the same code), losses, collation,
optimisation, data and the training loop.

The model classes are importable from here (``from bert_packed import BertConfig,
BertForPreTraining``); they are loaded on first use so that light modules such as
``bert_packed.config`` do not pay for importing torch.
"""

_LAZY = {
    "BertConfig": "bert_packed.model.modeling",
    "BertModel": "bert_packed.model.modeling",
    "BertForPreTraining": "bert_packed.tasks.pretraining.model",
    "BertForSequenceClassification": "bert_packed.tasks.classification.model",
    "ModelConfigError": "bert_packed.model.modeling",
    "register_attention": "bert_packed.model.attention",
    "AttentionImplementation": "bert_packed.model.attention",
    "AttentionError": "bert_packed.model.attention",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bert_packed' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
