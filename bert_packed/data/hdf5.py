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
are read per micro-batch (sorted row reads, a larger HDF5 chunk cache: ``CHUNK_CACHE``).
"""
import os
import types

import numpy as np

from bert_packed.data import h5io
from bert_packed.data.source import EpochCursor, RankStream
from bert_packed.data.errors import DataError

INT_FIELDS = tuple(name for name in h5io.PACKED_FIELDS if name != "nsp_weights")
# h5py's chunk cache (per dataset) for files read by rows. The default 1 MiB cannot hold one
# chunk of input_ids at S=512 (1,024 rows x 512 x 4 bytes = 2 MiB), so HDF5 bypasses it and
# every micro-batch decompresses every chunk it touches again; 64 MiB keeps the last chunks
# of each field, and a prime number of hash slots (HDF5's advice: ~100x the chunks held)
# keeps them from colliding.
CHUNK_CACHE = dict(rdcc_nbytes=64 << 20, rdcc_nslots=10007)


class HDF5Source(RankStream):
    """Packed micro-batches [micro_batch_size, ...] of one rank from an HDF5 file (see module doc).

    Shapes follow the configuration: S = max_sequence_length, K = max_sequences_per_pack,
    M = max_masked_tokens_per_pack; a file with smaller dimensions is zero-padded, a file
    with larger ones is refused with a DataError naming the option to raise. ``chunk_cache``:
    h5py's chunk-cache options (default ``CHUNK_CACHE``; ``{}`` is h5py's own 1 MiB, for the
    benchmark's before/after).
    """

    packing = None  # the file was packed beforehand (bert_packed.data pack); no plan of this run

    def __init__(self, path, *, micro_batch_size, max_sequence_length, max_sequences_per_pack,
                 max_masked_tokens_per_pack, seed, rank=0, world_size=1, shuffle=True,
                 max_cache_bytes=1 << 30, vocab_size=None, type_vocab_size=2, chunk_cache=None):
        self.path = os.fspath(path)
        self.micro_batch_size = int(micro_batch_size)
        self.max_sequence_length = int(max_sequence_length)
        self.max_sequences_per_pack = int(max_sequences_per_pack)
        self.max_masked_tokens_per_pack = int(max_masked_tokens_per_pack)
        self.seed, self.rank, self.world_size = int(seed or 0), int(rank), int(world_size)
        self.shuffle = bool(shuffle)
        if not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}")
        self.vocab_size, self.type_vocab_size = vocab_size, type_vocab_size
        self._handle = h5io.open_h5(self.path, **(CHUNK_CACHE if chunk_cache is None else chunk_cache))
        try:
            with h5io.read_errors(self.path):
                self._open(max_cache_bytes)
        except BaseException:
            self._handle.close()
            raise
        self._next_global_batch = self.rank
        self._cursor = EpochCursor(self.num_items, self.micro_batch_size)
        self._order_epoch = self._order = None

    def _open(self, max_cache_bytes):
        handle, path = self._handle, self.path
        layout = read_layout(handle, path)
        self.packed, names = layout.packed, layout.names
        self.packing_factor = layout.num_sequences() / max(1, layout.num_items)
        check_dims(path, layout.dims, self.max_sequence_length, self.max_sequences_per_pack,
                   self.max_masked_tokens_per_pack)
        self.num_items = layout.num_items
        self.num_batches_per_epoch = self.num_items // self.micro_batch_size
        if self.num_batches_per_epoch == 0:
            raise DataError(f"{path}: {self.num_items} items, fewer than one micro-batch of "
                            f"{self.micro_batch_size}; use a smaller micro-batch or more data")
        self._file_dims = layout.dims
        check_vocab(path, handle.attrs.get("vocab_size"), self.vocab_size)
        size = sum(handle[name].size * handle[name].dtype.itemsize for name in names)
        if size <= max_cache_bytes:
            self._cache = {name: _read_all(handle[name]) for name in names}
            # Range-checked once, now (a file too large to cache is checked per micro-batch).
            for start in range(0, self.num_items, 4096):  # bounded temporaries (validate_batch is [B, S, K])
                stop = min(self.num_items, start + 4096)
                self._check({name: array[start:stop] for name, array in self._cache.items()},
                            np.arange(start, stop))
        else:
            self._cache = None
            self._datasets = {name: handle[name] for name in names}

    def _check(self, raw, rows):
        """Range checks of file rows ``rows`` (their fields in ``raw``): DataError naming the file,
        field, row and value."""
        check_rows(raw, rows, self.path, packed=self.packed, vocab_size=self.vocab_size,
                   type_vocab_size=self.type_vocab_size, max_sequence_length=self.max_sequence_length,
                   max_sequences_per_pack=self.max_sequences_per_pack,
                   max_masked_tokens_per_pack=self.max_masked_tokens_per_pack)

    # -- the stream ---------------------------------------------------------------------

    def _items(self, global_batch):
        epoch, start = self._cursor.locate(global_batch)
        if self._order_epoch != epoch:  # one permutation per epoch, not per micro-batch
            self._order = (_permutation(self.num_items, self.seed, epoch) if self.shuffle
                           else np.arange(self.num_items))
            self._order_epoch = epoch
        return self._order[start:start + self.micro_batch_size]

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
            with h5io.read_errors(self.path):
                raw = {name: dataset[sorted_rows][inverse] for name, dataset in self._datasets.items()}
            if raw.get("next_sentence_labels") is not None:
                raw["next_sentence_labels"] = raw["next_sentence_labels"].reshape(-1)
            self._check(raw, rows)
        return to_batch(raw, packed=self.packed, max_sequence_length=self.max_sequence_length,
                        max_sequences_per_pack=self.max_sequences_per_pack,
                        max_masked_tokens_per_pack=self.max_masked_tokens_per_pack)

    def state_dict(self):
        return {"next_global_batch": int(self._next_global_batch), "seed": self.seed,
                "num_items": self.num_items, "world_size": self.world_size,
                "file": os.path.basename(self.path), "micro_batch_size": self.micro_batch_size,
                "cursor": self._cursor.state_dict()}

    def load_state_dict(self, state, force=False):
        """Continue exactly after the checkpoint's last micro-batch. With another micro-batch
        size the stream continues at the same item of the same epoch (no item skipped or
        repeated; only the micro-batches' boundaries move)."""
        if int(state.get("num_items", self.num_items)) != self.num_items:
            raise DataError(f"{self.path}: the checkpoint was taken on data with "
                            f"{state['num_items']} items, this file has {self.num_items}; "
                            "resume with the same data file")
        next_global = int(state["next_global_batch"])
        if next_global % self.world_size != self.rank:
            raise DataError(f"the data state (next micro-batch {next_global}) belongs to another "
                            f"rank than {self.rank} of {self.world_size}; resume with the same "
                            "number of processes")
        old_size = int(state.get("micro_batch_size", self.micro_batch_size))
        cursor = EpochCursor(self.num_items, old_size, state.get("cursor"))
        if old_size == self.micro_batch_size:
            self._cursor = cursor
        else:
            # The step's first micro-batch (rank 0's) is where the global stream stands.
            first = next_global - self.rank
            self._cursor = EpochCursor(self.num_items, self.micro_batch_size,
                                       {"base_global": first, **dict(zip(("base_epoch", "base_offset"),
                                                                         cursor.locate(first)))})
        self._next_global_batch = next_global

    @property
    def epoch(self):
        return self._cursor.locate(self._next_global_batch)[0]

    def close(self):
        self._handle.close()


class Layout:
    """What an opened HDF5 data file holds: packed or unpacked, rows, (S, K, M) and fields."""

    def __init__(self, handle, path):
        self.handle, self.path = handle, path
        self.packed = h5io.is_packed(handle)
        if self.packed:
            num_items, seq_len, max_k, max_m = h5io.check_packed(handle, path)
            self.names = tuple(h5io.PACKED_FIELDS)
        else:
            num_items, seq_len, max_m = h5io.check_unpacked(handle, path)
            max_k = 1
            self.names = h5io.UNPACKED_FIELDS
        self.num_items, self.dims = int(num_items), (int(seq_len), int(max_k), int(max_m))

    def num_sequences(self):
        """Sequences in the file: the attribute `pack` writes, else counted (nsp_weights != 0)."""
        if not self.packed:
            return float(self.num_items)
        count = self.handle.attrs.get("num_sequences")
        if count is None:
            weights = self.handle["nsp_weights"]
            count = sum(int((weights[i:i + 65536] != 0).sum()) for i in range(0, self.num_items, 65536))
        return float(count)


def read_layout(handle, path):
    """The checked ``Layout`` of an open file (DataError naming ``path`` when malformed)."""
    return Layout(handle, path)


def check_dims(path, dims, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack):
    """Refuse data wider than the configuration (S, K, M), naming the option to raise; narrower
    data is zero-padded by ``to_batch``."""
    seq_len, max_k, max_m = dims
    problems = [(seq_len, max_sequence_length, "data.max_sequence_length", "sequences are"),
                (max_k, max_sequences_per_pack, "data.max_sequences_per_pack", "packs hold"),
                (max_m, max_masked_tokens_per_pack, "data.max_masked_tokens_per_pack",
                 "packs have masked-token slots")]
    for have, limit, option, what in problems:
        if have > limit:
            raise DataError(f"{path}: {what} up to {have} but {option} is {limit}; set {option}={have}")


def check_vocab(path, made_with, vocab_size):
    """Refuse data made with a larger vocabulary than the model's (its ``vocab_size`` attribute)."""
    if vocab_size is not None and made_with is not None and int(made_with) > vocab_size:
        raise DataError(f"{path}: the data's vocabulary ({int(made_with)} tokens) is larger than the model's "
                        f"(model.vocab_size={vocab_size}); set model.vocab_size={int(made_with)}")


def check_rows(raw, rows, where, *, packed, vocab_size, type_vocab_size, max_sequence_length,
               max_sequences_per_pack, max_masked_tokens_per_pack):
    """Range checks of file rows ``rows`` (their fields, as read, in ``raw``): DataError naming
    ``where``, the field, row and value."""
    if not packed:
        _check_unpacked_rows(raw, rows, where, vocab_size=vocab_size, type_vocab_size=type_vocab_size)
        return
    from bert_packed.collate import BatchError, validate_batch

    limits = types.SimpleNamespace(
        vocab_size=vocab_size if vocab_size is not None else np.iinfo(np.int64).max,
        type_vocab_size=type_vocab_size, max_position_embeddings=max_sequence_length,
        max_sequences_per_pack=max_sequences_per_pack, max_masked_tokens_per_pack=max_masked_tokens_per_pack)
    arrays = {name: np.asarray(raw[name]) for name in h5io.PACKED_FIELDS}
    if packed_rows_valid(arrays, limits):
        return  # the common case, in O(B x S); validate_batch is O(B x S x K) and names the problem
    try:
        validate_batch(arrays, limits, rows=rows)
    except BatchError as exc:
        raise DataError(f"{where}: {exc}") from None


def packed_rows_valid(arrays, limits):
    """True when ``validate_batch(arrays, limits)`` would pass, decided in a few passes over
    [B, S] (validate_batch builds [B, S, K] temporaries: at S=512 it checked ~13,000 packs/s,
    the sharded reader's largest cost). False means "let validate_batch find and name the
    problem", so the messages stay validate_batch's. A sequence is contiguous when it starts
    (a real token whose left neighbour has another id) at most once; its positions are right
    when they are 0 at that start and grow by one inside the run."""
    if any(a.ndim != 2 or (name != "nsp_weights" and not np.issubdtype(a.dtype, np.integer))
           for name, a in arrays.items()):
        return False
    ids, positions = arrays["sequence_ids"], arrays["position_ids"]
    B, S = ids.shape
    M, K = arrays["mlm_positions"].shape[1], arrays["nsp_weights"].shape[1]
    shapes = {"S": (B, S), "M": (B, M), "K": (B, K)}
    if any(arrays[name].shape != shapes[dim] for name, dim in h5io.PACKED_FIELDS.items()):
        return False
    if not B:
        return True
    if K > limits.max_sequences_per_pack or M > limits.max_masked_tokens_per_pack or S > limits.max_position_embeddings:
        return False
    ranges = (("input_ids", limits.vocab_size), ("mlm_labels", limits.vocab_size), ("segment_ids", limits.type_vocab_size),
              ("position_ids", S), ("sequence_ids", K + 1), ("mlm_sequence_ids", K + 1), ("mlm_positions", S),
              ("cls_positions", S), ("nsp_labels", 2))
    if any(arrays[name].min() < 0 or arrays[name].max() >= high for name, high in ranges):
        return False
    real = ids > 0
    starts = real.copy()
    starts[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    if np.any(positions[starts] != 0) or np.any((positions[:, 1:] != positions[:, :-1] + 1) & real[:, 1:] & ~starts[:, 1:]):
        return False
    pack, column = np.nonzero(starts)
    key = pack * (K + 1) + ids[pack, column]
    if np.bincount(key, minlength=B * (K + 1)).max(initial=0) > 1:  # a sequence in two runs
        return False
    first = np.full(B * (K + 1), S, np.int64)
    first[key] = column
    first = first.reshape(B, K + 1)[:, 1:]
    present = first < S
    weights = arrays["nsp_weights"]
    if np.any((weights != 0) != present) or np.any((weights != 0) & (weights != 1)):
        return False
    if np.any(present & (arrays["cls_positions"] != first)):
        return False
    used, mlm_ids, mlm_positions = arrays["mlm_sequence_ids"] > 0, arrays["mlm_sequence_ids"], arrays["mlm_positions"]
    owner = np.take_along_axis(ids, mlm_positions.astype(np.intp), axis=1)
    at_cls = mlm_positions == np.take_along_axis(first, (mlm_ids.clip(1, K) - 1).astype(np.intp), axis=1)
    return not np.any(used & ((owner != mlm_ids) | at_cls))


def to_batch(raw, *, packed, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack):
    """File rows (fields as read) -> a micro-batch of the contract: packed rows zero-padded to
    the configured S/K/M, unpacked rows collated as packs of one sequence; int64/float32."""
    if not packed:
        from bert_packed.data.h5io import collate_records

        num = len(raw["input_ids"])
        batch = collate_records(raw, np.arange(num + 1), np.arange(num), max_sequence_length=max_sequence_length,
                                max_sequences_per_pack=max_sequences_per_pack,
                                max_masked_tokens_per_pack=max_masked_tokens_per_pack)
        return _as_batch_dtypes(batch)
    batch = h5io.pad_fields({name: raw[name] for name in h5io.PACKED_FIELDS}, packed=True,
                            max_sequence_length=max_sequence_length, max_sequences_per_pack=max_sequences_per_pack,
                            max_masked_tokens_per_pack=max_masked_tokens_per_pack)
    return _as_batch_dtypes(batch)


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


def _check_unpacked_rows(raw, rows, where, *, vocab_size, type_vocab_size):
    """Range checks of NVIDIA-layout rows: DataError naming file, field, row and value."""
    def fail(field, index, value, expected):
        raise DataError(f"{where}: {field} of row {int(rows[index[0]])}: value {int(value)} {expected}")

    ids, mask = np.asarray(raw["input_ids"]), np.asarray(raw["input_mask"]) != 0
    positions, labels = np.asarray(raw["masked_lm_positions"]), np.asarray(raw["masked_lm_ids"])
    used = positions != 0  # NVIDIA layout: unused masked slots hold position 0
    lengths = mask.sum(axis=1)
    checks = [("input_ids", ids, (ids < 0) | ((ids >= vocab_size) if vocab_size else False),
               f"is outside the vocabulary [0, {vocab_size}) (model.vocab_size): the data's vocabulary is larger "
               f"than the model's" if vocab_size else "is negative"),
              ("masked_lm_ids", labels, used & ((labels < 0) | ((labels >= vocab_size) if vocab_size else False)),
               f"is outside the vocabulary [0, {vocab_size}) (model.vocab_size)" if vocab_size else "is negative"),
              ("segment_ids", np.asarray(raw["segment_ids"]),
               mask & ((np.asarray(raw["segment_ids"]) < 0) | (np.asarray(raw["segment_ids"]) >= type_vocab_size)),
               f"is outside [0, {type_vocab_size}) (model.type_vocab_size)"),
              ("masked_lm_positions", positions, used & ((positions < 0) | (positions >= lengths[:, None])),
               "is not a position inside its sequence (0 .. length - 1)"),
              ("input_mask", mask, np.diff(mask.astype(np.int8), axis=1) > 0,
               "marks a real token after padding (input_mask must be 1...1 0...0)"),
              ("next_sentence_labels", np.asarray(raw["next_sentence_labels"]).reshape(-1),
               ~np.isin(np.asarray(raw["next_sentence_labels"]).reshape(-1), (0, 1)), "is not 0 or 1")]
    for field, values, bad, expected in checks:
        bad = np.asarray(bad)
        if bad.any():
            index = np.argwhere(bad)[0]
            fail(field, index, values[tuple(index)] if field != "input_mask" else 1, expected)
