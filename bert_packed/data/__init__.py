"""Data sources for the training loop: one interface, two implementations.

A *data source* yields the packed micro-batches of ONE data-parallel rank:

    source = build_data_source(config, split="train", micro_batch_size=B, rank=r, world_size=n)
    source.packing_factor          # float: sequences per pack over the data
    batch = next(iter(source))     # dict of numpy arrays, docs/design.md's fields, [B, ...]
    state = source.state_dict()    # JSON-able; after load_state_dict(state) the next
    source.load_state_dict(state)  # micro-batch is exactly the one that would have come

Contract every source keeps:
- ``__iter__`` returns an endless iterator (epochs cycle) over micro-batches of
  ``micro_batch_size`` packs; fields ``input_ids, segment_ids, position_ids,
  sequence_ids`` [B,S], ``mlm_positions, mlm_labels, mlm_sequence_ids`` [B,M],
  ``cls_positions, nsp_labels`` [B,K] int64 and ``nsp_weights`` [B,K] float32, with
  S = max_sequence_length, K = max_sequences_per_pack, M = max_masked_tokens_per_pack.
- Sharding: there is one global stream of micro-batches g = 0, 1, 2, ... that does not
  depend on ``world_size``; rank r yields exactly those with ``g % world_size == r``, in
  order. So one optimizer step over N global micro-batches is the same set of data
  whether it runs as 1 process x N accumulation or N processes x 1. (The sharded reader, whose
  ranks read only their own shards, keeps this for every world size dividing its number of
  lanes, and refuses the others.)
- Deterministic per ``seed``: the same config and seed give the same stream.

``build_data_source`` picks the generated source when ``config.data.path`` is null, the
sharded reader (``bert_packed.data.sharded.ShardedSource``) when it is a directory of shards,
and the HDF5 reader (``bert_packed.data.hdf5.HDF5Source``) for a single file.
"""
from __future__ import annotations

import os
import types

from bert_packed.data.errors import DataError
from bert_packed.data.source import Batch, DataSource, EpochCursor, empty_batch

__all__ = ["Batch", "DataError", "DataSource", "EpochCursor", "build_data_source", "empty_batch"]


def build_data_source(config, *, split: str = "train", micro_batch_size: int, rank: int = 0, world_size: int = 1,
                      seed: int = None) -> DataSource:
    """The data source of ``split`` ("train" or "eval") for this rank (see module docstring)."""
    d = config.data
    seed = config.train.seed if seed is None else seed
    if d.path is None:
        from bert_packed.collate import BatchError, validate_batch
        from bert_packed.data.generated import GeneratedSource

        source = GeneratedSource(config, split=split, micro_batch_size=micro_batch_size, rank=rank,
                                 world_size=world_size, seed=seed)
        # The same range checks as a file gets (token ids against model.vocab_size, segments,
        # positions, ...), on the first micro-batch: generated data is in range by construction,
        # so this guards the generator, cheaply.
        limits = dict(vocab_size=config.model.vocab_size, type_vocab_size=config.model.type_vocab_size,
                      max_position_embeddings=config.model.max_position_embeddings,
                      max_sequences_per_pack=d.max_sequences_per_pack,
                      max_masked_tokens_per_pack=d.max_masked_tokens_per_pack)
        try:
            validate_batch(source.micro_batch(rank), types.SimpleNamespace(**limits))
        except BatchError as exc:
            raise DataError(f"generated {split} data: {exc}") from None
        return source
    path = d.path if split == "train" else d.eval_path
    if path is None:
        raise DataError("evaluation needs data.eval_path when data.path is set; set it or train.eval_every=0")
    options = dict(micro_batch_size=micro_batch_size, max_sequence_length=d.max_sequence_length,
                   max_sequences_per_pack=d.max_sequences_per_pack,
                   max_masked_tokens_per_pack=d.max_masked_tokens_per_pack, seed=seed, rank=rank,
                   world_size=world_size, shuffle=(split == "train"), vocab_size=config.model.vocab_size,
                   type_vocab_size=config.model.type_vocab_size)
    if os.path.isdir(path):
        from bert_packed.data.sharded import ShardedSource

        return ShardedSource(path, lanes=d.lanes, **options)
    from bert_packed.data.hdf5 import HDF5Source

    return HDF5Source(path, **options)

