"""Pre-training data: the sources the training loop reads (this package's modules) and the
offline tools that write their files (``bert_packed.data.prepare``: ``create``, ``pack``,
``vocab``, ``stats``, ``kjv``; ``python -m bert_packed.data``). Nothing that training reads
imports the offline tools.

Three sources share one interface and one set of options: generated data (``generated``),
one HDF5 file (``hdf5``) and a directory of shards (``sharded``).

A *data source* yields the packed micro-batches of ONE data-parallel rank:

    source = build_data_source(config, split="train", micro_batch_size=B, rank=r, world_size=n)
    # (bert_packed.tasks.pretraining.data: the source a config names)
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

``bert_packed.tasks.pretraining.data.build_data_source`` picks the generated source when
``config.data.path`` is null, the sharded reader (``bert_packed.data.sharded.ShardedSource``)
when it is a directory of shards, and the HDF5 reader (``bert_packed.data.hdf5.HDF5Source``)
for a single file.
"""
from __future__ import annotations

from bert_packed.data.errors import DataError
from bert_packed.data.source import Batch, DataSource, EpochCursor, empty_batch

__all__ = ["Batch", "DataError", "DataSource", "EpochCursor", "empty_batch"]
