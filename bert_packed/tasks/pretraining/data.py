"""Pre-training's data: the source a config names, for one split and rank.

``data.path`` null: generated data (``bert_packed.data.generated``); a directory: the sharded
reader (``bert_packed.data.sharded``); a file: the HDF5 reader (``bert_packed.data.hdf5``).
Every source takes the same options (:func:`source_options`) plus its own: where the data is,
or for generated data what to generate (:func:`generated_source`). The sources' contract is
``bert_packed.data``'s."""
from __future__ import annotations

import os
import types
from typing import Any, Dict, Optional

from bert_packed.data import DataError, DataSource

__all__ = ["build_data_source", "generated_source", "source_options"]


def source_options(config, *, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                   seed: Optional[int] = None) -> Dict[str, Any]:
    """The options every data source takes: the micro-batch, the packed shapes S/K/M (the data
    section's), the vocabulary size, seed (default ``train.seed``), rank and world size."""
    d = config.data
    return dict(micro_batch_size=micro_batch_size, max_sequence_length=d.max_sequence_length,
                max_sequences_per_pack=d.max_sequences_per_pack, max_masked_tokens_per_pack=d.max_masked_tokens_per_pack,
                seed=config.train.seed if seed is None else seed, rank=rank, world_size=world_size,
                vocab_size=config.model.vocab_size)


def generated_source(config, *, split: str = "train", micro_batch_size: int, rank: int = 0, world_size: int = 1,
                     seed: Optional[int] = None):
    """The generated source of ``split`` from the data section (``data.path`` is not read)."""
    from bert_packed.data.generated import GeneratedSource

    d = config.data
    return GeneratedSource(split=split, histogram=d.histogram, length_mapping=d.length_mapping,
                           num_sequences=d.num_sequences if split == "train" else d.num_eval_sequences,
                           packing_algorithm=d.packing_algorithm, max_masked_tokens=d.max_masked_tokens,
                           mask_probability=d.mask_probability,
                           **source_options(config, micro_batch_size=micro_batch_size, rank=rank,
                                            world_size=world_size, seed=seed))


def build_data_source(config, *, split: str = "train", micro_batch_size: int, rank: int = 0, world_size: int = 1,
                      seed: Optional[int] = None) -> DataSource:
    """The data source of ``split`` ("train" or "eval") for this rank (see the module docstring)."""
    d = config.data
    options = source_options(config, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, seed=seed)
    if d.path is None:
        from bert_packed.collate import BatchError, validate_batch

        source = generated_source(config, split=split, micro_batch_size=micro_batch_size, rank=rank,
                                  world_size=world_size, seed=seed)
        # The same range checks as a file gets (token ids against model.vocab_size, segments,
        # positions, ...), on the first micro-batch: generated data is in range by construction,
        # so this guards the generator, cheaply.
        try:
            m = config.model
            limits = types.SimpleNamespace(vocab_size=m.vocab_size, type_vocab_size=m.type_vocab_size,
                                           max_position_embeddings=m.max_position_embeddings,
                                           max_sequences_per_pack=d.max_sequences_per_pack,
                                           max_masked_tokens_per_pack=d.max_masked_tokens_per_pack)
            validate_batch(source.micro_batch(rank), limits)
        except BatchError as exc:
            raise DataError(f"generated {split} data: {exc}") from None
        return source
    path = d.path if split == "train" else d.eval_path
    if path is None:
        raise DataError("evaluation needs data.eval_path when data.path is set; set it or train.eval_every=0")
    options.update(shuffle=(split == "train"), type_vocab_size=config.model.type_vocab_size)
    if os.path.isdir(path):
        from bert_packed.data.sharded import ShardedSource

        return ShardedSource(path, lanes=d.lanes, **options)
    from bert_packed.data.hdf5 import HDF5Source

    return HDF5Source(path, **options)

