"""Building what a run trains from its config: the model's ``BertConfig`` (every task builds
its model on it: ``Task.build_model``; pre-training's ``build_model`` for the profiler and the
IPU tools) and the optimizer with its learning-rate schedule."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from bert_packed.config import resolve_attention
from bert_packed.errors import ConfigError


def bert_config(config, **overrides):
    """The model's ``BertConfig``: the model section, the data section's packed shapes, ``overrides``."""
    from bert_packed.model.modeling import BertConfig, ModelConfigError

    names = {f.name for f in dataclasses.fields(BertConfig)}
    values = {k: v for k, v in dataclasses.asdict(config.model).items() if k in names}
    values["attention_implementation"] = resolve_attention(config)  # auto and never validated: the default
    values["max_sequences_per_pack"] = config.data.max_sequences_per_pack
    values["max_masked_tokens_per_pack"] = config.data.max_masked_tokens_per_pack
    try:
        return BertConfig(**{**values, **overrides})
    except ModelConfigError as exc:
        from bert_packed.model.attention import list_attention_implementations

        unknown = values["attention_implementation"] not in list_attention_implementations()
        raise ConfigError(str(exc) + (", or auto (the backend chooses)" if unknown else "")) from None



def build_optimizer(config, model, betas: Optional[Sequence[float]] = None, *, steps: Optional[int] = None):
    """(optimizer, schedule) of the optimizer section over ``steps`` (default ``train.steps``);
    ``betas`` default to its beta1, beta2 (the step plan passes the packing-adjusted ones)."""
    from bert_packed import optim

    o = config.optimizer
    betas = (o.beta1, o.beta2) if betas is None else tuple(betas)
    optimizer = optim.build_optimizer(model, o.name, lr=o.learning_rate, betas=betas, eps=o.eps,
                                      weight_decay=o.weight_decay, max_weight_norm=o.max_weight_norm,
                                      bias_max_weight_norm=o.bias_max_weight_norm)
    scheduler = optim.build_schedule(optimizer, o.schedule, warmup_fraction=o.warmup_fraction,
                                     warmup_from_zero=o.warmup_from_zero,
                                     total_steps=config.train.steps if steps is None else steps)
    return optimizer, scheduler
