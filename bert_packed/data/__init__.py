"""Data sources for the training loop: one interface, two implementations.

A *data source* yields the packed micro-batches of ONE data-parallel rank:

    source = build_data_source(config, split="train", micro_batch_size=B, rank=r, world_size=n)
    source.packing_factor          # float: sequences per pack over the data
    batch = next(iter(source))     # dict of numpy arrays, DESIGN §2 fields, each [B, ...]
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
  whether it runs as 1 process x N accumulation or N processes x 1.
- Deterministic per ``seed``: the same config and seed give the same stream.

``build_data_source`` picks the generated source when ``config.data.path`` is null and
the HDF5 reader (``bert_packed.data.hdf5.HDF5Source``) otherwise.
"""
from __future__ import annotations

import types
from typing import Any, Dict, Iterator, Protocol, runtime_checkable

import numpy as np

from bert_packed.collate import MLM_FIELDS, SEQUENCE_FIELDS, TOKEN_FIELDS

Batch = Dict[str, np.ndarray]


class DataError(ValueError):
    """A user mistake about data (missing file, wrong fields or shapes): one line."""


def empty_batch(micro_batch_size: int, max_sequence_length: int, max_sequences_per_pack: int,
                max_masked_tokens_per_pack: int) -> Batch:
    """All-zero micro-batch with the contract's fields, shapes [B, S|M|K] and dtypes (all
    padding: no sequences)."""
    B, S, K, M = micro_batch_size, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack
    batch = {}
    for names, width in ((TOKEN_FIELDS, S), (MLM_FIELDS, M), (SEQUENCE_FIELDS, K)):
        batch.update({name: np.zeros((B, width), dtype=np.int64) for name in names})
    batch["nsp_weights"] = np.zeros((B, K), dtype=np.float32)
    return batch


class EpochCursor:
    """Where global micro-batch g of a stream of epochs starts: ``locate(g) -> (epoch, first item)``.

    Each epoch serves its items (in that epoch's order) ``micro_batch_size`` at a time and drops
    the last partial micro-batch (fixed shapes). A *base* ``(base_global, base_epoch,
    base_offset)`` says that micro-batch ``base_global`` starts at item ``base_offset`` of epoch
    ``base_epoch``: a run resumed with a different micro-batch size continues at exactly the item
    where the checkpoint stopped, so no item is skipped or served twice. The default base (0, 0,
    0) is the plain stream ``g -> divmod(g, batches per epoch)``.
    """

    def __init__(self, num_items: int, micro_batch_size: int, state: Dict[str, int] = None):
        self.num_items, self.micro_batch_size = int(num_items), int(micro_batch_size)
        state = state or {}
        self.base_global = int(state.get("base_global", 0))
        self.base_epoch = int(state.get("base_epoch", 0))
        self.base_offset = int(state.get("base_offset", 0))
        self.batches_per_epoch = self.num_items // self.micro_batch_size

    def state_dict(self) -> Dict[str, int]:
        return {"base_global": self.base_global, "base_epoch": self.base_epoch, "base_offset": self.base_offset}

    def locate(self, global_batch: int) -> tuple:
        k = int(global_batch) - self.base_global
        if k < 0:
            raise DataError(f"micro-batch {global_batch} lies before the resumed position {self.base_global}")
        first_epoch = (self.num_items - self.base_offset) // self.micro_batch_size  # left in the base epoch
        if k < first_epoch:
            return self.base_epoch, self.base_offset + k * self.micro_batch_size
        epoch, index = divmod(k - first_epoch, self.batches_per_epoch)
        return self.base_epoch + 1 + epoch, index * self.micro_batch_size


@runtime_checkable
class DataSource(Protocol):
    packing_factor: float

    def __iter__(self) -> Iterator[Batch]:
        ...

    def state_dict(self) -> Dict[str, Any]:
        ...

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ...


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
    from bert_packed.data.hdf5 import HDF5Source

    return HDF5Source(path, micro_batch_size=micro_batch_size, max_sequence_length=d.max_sequence_length,
                      max_sequences_per_pack=d.max_sequences_per_pack,
                      max_masked_tokens_per_pack=d.max_masked_tokens_per_pack, seed=seed, rank=rank,
                      world_size=world_size, shuffle=(split == "train"), vocab_size=config.model.vocab_size,
                      type_vocab_size=config.model.type_vocab_size)
