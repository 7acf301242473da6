"""HDF5 data source for training (`data.path`): packed files from `pack`, unpacked files in
the NVIDIA/MLPerf layout served as packs of one sequence.

The stream (contract of `bert_packed.data`): global micro-batch g = e * num_batches + b of
epoch e holds items perm_e[b*B:(b+1)*B], with perm_e a permutation seeded by (seed, e)
(identity without shuffle); the last partial micro-batch of an epoch is dropped (fixed
shapes), and a new permutation each epoch drops different items. Rank r of n yields the
micro-batches with g % n == r, so the data of an optimizer step does not depend on how it
is split over ranks. The state is the next global micro-batch index: resuming from it
yields exactly the micro-batch that would have come next.

Files that fit in `max_cache_bytes` (uncompressed) are read into memory once; larger ones
are read per micro-batch (sorted row reads, a larger HDF5 chunk cache).
"""
import os

import numpy as np

from . import h5io
from .errors import DataError

INT_FIELDS = tuple(name for name in h5io.PACKED_FIELDS if name != "nsp_weights")


class HDF5Source:
    """Packed micro-batches [micro_batch_size, ...] of one rank from an HDF5 file (see module doc).

    Shapes follow the configuration: S = max_sequence_length, K = max_sequences_per_pack,
    M = max_masked_tokens_per_pack; a file with smaller dimensions is zero-padded, a file
    with larger ones is refused with a DataError naming the option to raise.
    """

    def __init__(self, path, *, micro_batch_size, max_sequence_length, max_sequences_per_pack,
                 max_masked_tokens_per_pack, seed, rank=0, world_size=1, shuffle=True,
                 max_cache_bytes=1 << 30):
        self.path = os.fspath(path)
        self.micro_batch_size = int(micro_batch_size)
        self.max_sequence_length = int(max_sequence_length)
        self.max_sequences_per_pack = int(max_sequences_per_pack)
        self.max_masked_tokens_per_pack = int(max_masked_tokens_per_pack)
        self.seed, self.rank, self.world_size = int(seed or 0), int(rank), int(world_size)
        self.shuffle = bool(shuffle)
        if not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}")
        self._handle = h5io.open_h5(self.path)
        try:
            self._open(max_cache_bytes)
        except BaseException:
            self._handle.close()
            raise
        self._next_global_batch = self.rank
        self._order_epoch = self._order = None

    def _open(self, max_cache_bytes):
        handle, path = self._handle, self.path
        self.packed = h5io.is_packed(handle)
        if self.packed:
            num_items, seq_len, max_k, max_m = h5io.check_packed(handle, path)
            names = tuple(h5io.PACKED_FIELDS)
            num_sequences = handle.attrs.get("num_sequences")
            if num_sequences is None:
                num_sequences = int(sum((handle["nsp_weights"][i:i + 65536] != 0).sum()
                                        for i in range(0, num_items, 65536)))
            self.packing_factor = float(num_sequences) / max(1, num_items)
        else:
            num_items, seq_len, max_m = h5io.check_unpacked(handle, path)
            max_k = 1
            names = h5io.UNPACKED_FIELDS
            self.packing_factor = 1.0
        problems = [(seq_len, self.max_sequence_length, "data.max_sequence_length", "sequences are"),
                    (max_k, self.max_sequences_per_pack, "data.max_sequences_per_pack", "packs hold"),
                    (max_m, self.max_masked_tokens_per_pack, "data.max_masked_tokens_per_pack",
                     "packs have masked-token slots")]
        for have, limit, option, what in problems:
            if have > limit:
                raise DataError(f"{path}: {what} up to {have} but {option} is {limit}; "
                                f"set {option}={have}")
        self.num_items = int(num_items)
        self.num_batches_per_epoch = self.num_items // self.micro_batch_size
        if self.num_batches_per_epoch == 0:
            raise DataError(f"{path}: {self.num_items} items, fewer than one micro-batch of "
                            f"{self.micro_batch_size}; use a smaller micro-batch or more data")
        self._file_dims = (seq_len, max_k, max_m)
        size = sum(handle[name].size * handle[name].dtype.itemsize for name in names)
        if size <= max_cache_bytes:
            self._cache = {name: _read_all(handle[name]) for name in names}
        else:
            self._cache = None
            self._datasets = {name: handle[name] for name in names}

    # -- the stream ---------------------------------------------------------------------

    def _items(self, global_batch):
        epoch, index = divmod(global_batch, self.num_batches_per_epoch)
        if self._order_epoch != epoch:  # one permutation per epoch, not per micro-batch
            self._order = (_permutation(self.num_items, self.seed, epoch) if self.shuffle
                           else np.arange(self.num_items))
            self._order_epoch = epoch
        return self._order[index * self.micro_batch_size:(index + 1) * self.micro_batch_size]

    def batch(self, global_batch):
        """Global micro-batch `global_batch` as a packed-batch dict (any rank may ask)."""
        rows = self._items(global_batch)
        if self._cache is not None:
            raw = {name: array[rows] for name, array in self._cache.items()}
        else:
            order = np.argsort(rows)
            inverse = np.empty_like(order)
            inverse[order] = np.arange(order.size)
            sorted_rows = rows[order]
            raw = {name: dataset[sorted_rows][inverse] for name, dataset in self._datasets.items()}
        if self.packed:
            return self._pad_packed(raw)
        from .pack import collate_records

        num = len(rows)
        batch = collate_records(raw, np.arange(num + 1), np.arange(num),
                                max_sequence_length=self.max_sequence_length,
                                max_sequences_per_pack=self.max_sequences_per_pack,
                                max_masked_tokens_per_pack=self.max_masked_tokens_per_pack)
        return _as_batch_dtypes(batch)

    def _pad_packed(self, raw):
        widths = {"S": self.max_sequence_length, "K": self.max_sequences_per_pack,
                  "M": self.max_masked_tokens_per_pack}
        batch = {}
        for name, dim in h5io.PACKED_FIELDS.items():
            array = raw[name]
            missing = widths[dim] - array.shape[1]
            if missing:
                array = np.pad(array, ((0, 0), (0, missing)))
            batch[name] = array
        return _as_batch_dtypes(batch)

    def __iter__(self):
        while True:
            global_batch = self._next_global_batch
            batch = self.batch(global_batch)
            self._next_global_batch = global_batch + self.world_size
            yield batch

    def state_dict(self):
        return {"next_global_batch": int(self._next_global_batch), "seed": self.seed,
                "num_items": self.num_items, "world_size": self.world_size,
                "file": os.path.basename(self.path)}

    def load_state_dict(self, state):
        if int(state.get("num_items", self.num_items)) != self.num_items:
            raise DataError(f"{self.path}: the checkpoint was taken on data with "
                            f"{state['num_items']} items, this file has {self.num_items}; "
                            "resume with the same data file")
        next_global = int(state["next_global_batch"])
        if next_global % self.world_size != self.rank:
            raise DataError(f"the data state (next micro-batch {next_global}) belongs to another "
                            f"rank than {self.rank} of {self.world_size}; resume with the same "
                            "number of processes")
        self._next_global_batch = next_global

    @property
    def epoch(self):
        return self._next_global_batch // self.num_batches_per_epoch

    def close(self):
        self._handle.close()


def _permutation(num_items, seed, epoch):
    return np.random.default_rng([int(seed), int(epoch), 0x5EED]).permutation(num_items)


def _read_all(dataset, rows=1 << 16):
    out = np.empty(dataset.shape, dataset.dtype)
    for start in range(0, dataset.shape[0], rows):
        out[start:start + rows] = dataset[start:start + rows]
    if out.ndim == 2 and dataset.name.endswith("next_sentence_labels"):
        out = out.reshape(-1)
    return out


def _as_batch_dtypes(batch):
    out = {name: np.ascontiguousarray(batch[name], dtype=np.int64) for name in INT_FIELDS}
    out["nsp_weights"] = np.ascontiguousarray(batch["nsp_weights"], dtype=np.float32)
    return out
