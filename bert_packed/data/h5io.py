"""HDF5 layouts of the pipeline: field names, checks with one-line errors, atomic writes.

Unpacked files use the NVIDIA/MLPerf BERT layout (N sequences, S = max sequence length,
P = max predictions per sequence), so files made by NVIDIA's or MLPerf's tools read as
they are:

| field | shape | meaning |
|---|---|---|
| input_ids | [N,S] | tokens, [CLS] A [SEP] B [SEP], 0 = padding |
| input_mask | [N,S] | 1 for real tokens, 0 for padding |
| segment_ids | [N,S] | 0 for [CLS] A [SEP], 1 for B [SEP] |
| masked_lm_positions | [N,P] | positions of the masked tokens, 0 in unused slots |
| masked_lm_ids | [N,P] | original tokens there, 0 in unused slots |
| next_sentence_labels | [N] (or [N,1]) | 1 = B is a random sentence, 0 = B follows A |

Packed files (written by `pack`) hold the packed-batch fields of docs/design.md with
B = number of packs (see `PACKED_FIELDS`), and the packing statistics as attributes.
"""
import contextlib
import os
import re

import numpy as np

from bert_packed.collate import MLM_FIELDS, SEQUENCE_FIELDS, TOKEN_FIELDS
from bert_packed.data.errors import DataError
from bert_packed.io.files import atomic_path

# field -> (second dimension: S tokens, P masked slots, None for [N]; dtype written).
UNPACKED_LAYOUT = {"input_ids": ("S", np.int32), "input_mask": ("S", np.int8), "segment_ids": ("S", np.int8),
                   "masked_lm_positions": ("P", np.int32), "masked_lm_ids": ("P", np.int32),
                   "next_sentence_labels": (None, np.int8)}
UNPACKED_FIELDS = tuple(UNPACKED_LAYOUT)
# field -> which second dimension it has: S (sequence), M (masked slots), K (sequences/pack).
PACKED_FIELDS = {**dict.fromkeys(TOKEN_FIELDS, "S"), **dict.fromkeys(MLM_FIELDS, "M"),
                 **dict.fromkeys(SEQUENCE_FIELDS, "K")}
PACKED_FORMAT = "packed-bert/packed-v1"



def pad_fields(raw, *, packed, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack):
    """Rows as read (``{field: [n, width]}``) with every field zero-padded on its second
    dimension to the configured width: S, K, M (packed), or S, P = M (unpacked). Files and
    shards may be narrower than the run's layout (``pack`` gives each shard the M it needs);
    padding with zeros adds unused slots, nothing else."""
    widths = {"S": max_sequence_length, "K": max_sequences_per_pack, "M": max_masked_tokens_per_pack,
              "P": max_masked_tokens_per_pack}
    dims = PACKED_FIELDS if packed else {name: dim for name, (dim, _) in UNPACKED_LAYOUT.items()}
    out = {}
    for name, array in raw.items():
        missing = widths[dims[name]] - array.shape[1] if array.ndim == 2 and dims.get(name) else 0
        out[name] = np.pad(array, ((0, 0), (0, missing))) if missing > 0 else array
    return out

def open_h5(path, **options):
    """Open an HDF5 file for reading; a missing or unreadable file raises DataError. ``options``
    go to ``h5py.File`` (e.g. the chunk cache: ``rdcc_nbytes``, ``rdcc_nslots``)."""
    import h5py

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    try:
        return h5py.File(path, "r", **options)
    except OSError as exc:
        reason = str(exc).split("(")[0].strip() or "unreadable"
        raise DataError(f"{path}: not a readable HDF5 file ({reason}); re-create it with "
                        "`python -m bert_packed.data create`") from None


_READ_FAILURE = re.compile(r"read|inflate|decompress|checksum|filter|truncated|bad|corrupt|address", re.I)


@contextlib.contextmanager
def read_errors(path):
    """Turn HDF5 read failures inside the block (h5py raises OSError for a corrupt or truncated
    chunk, e.g. "Can't read data (inflate() failed)") into one-line DataErrors naming the file.
    Other OSErrors (a write failing, a permission) pass through unchanged."""
    try:
        yield
    except OSError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if getattr(exc, "filename", None) or not _READ_FAILURE.search(message):
            raise
        raise DataError(f"{path}: the file is corrupt or truncated and cannot be read ({message}); "
                        f"re-create it") from None


def is_packed(handle):
    """True for files written by `pack` (they have `sequence_ids`)."""
    return "sequence_ids" in handle


def unpacked_shapes(num_sequences, max_seq_length, max_predictions):
    """field -> (shape, dtype) of an unpacked file we write, in `UNPACKED_FIELDS` order."""
    widths = {"S": (max_seq_length,), "P": (max_predictions,), None: ()}
    return {name: ((num_sequences,) + widths[dim], dtype) for name, (dim, dtype) in UNPACKED_LAYOUT.items()}


def check_unpacked(handle, path):
    """Validate the NVIDIA layout; return (num_sequences, S, P). Raises DataError."""
    missing = [name for name in UNPACKED_FIELDS if name not in handle]
    if missing:
        raise DataError(f"{path}: missing field(s) {', '.join(missing)}; an unpacked file needs "
                        f"{', '.join(UNPACKED_FIELDS)} (NVIDIA/MLPerf layout)")
    num_sequences, seq_len = _shape2(handle, "input_ids", path)
    for name in ("input_mask", "segment_ids"):
        if _shape2(handle, name, path) != (num_sequences, seq_len):
            raise DataError(f"{path}: {name} has shape {handle[name].shape}, expected "
                            f"{(num_sequences, seq_len)} like input_ids")
    num_rows, num_predictions = _shape2(handle, "masked_lm_positions", path)
    if num_rows != num_sequences or handle["masked_lm_ids"].shape != (num_rows, num_predictions):
        raise DataError(f"{path}: masked_lm_positions {handle['masked_lm_positions'].shape} and "
                        f"masked_lm_ids {handle['masked_lm_ids'].shape} must both be "
                        f"({num_sequences}, P)")
    labels = handle["next_sentence_labels"].shape
    if labels not in ((num_sequences,), (num_sequences, 1)):
        raise DataError(f"{path}: next_sentence_labels has shape {labels}, expected ({num_sequences},)")
    return num_sequences, seq_len, num_predictions


def check_packed(handle, path):
    """Validate a packed file; return (num_packs, S, K, M). Raises DataError."""
    missing = [name for name in PACKED_FIELDS if name not in handle]
    if missing:
        raise DataError(f"{path}: missing packed field(s) {', '.join(missing)}; re-create it "
                        "with `python -m bert_packed.data pack`")
    num_packs, seq_len = _shape2(handle, "input_ids", path)
    dims = {"S": seq_len, "K": handle["cls_positions"].shape[-1],
            "M": handle["mlm_positions"].shape[-1]}
    for name, dim in PACKED_FIELDS.items():
        if handle[name].shape != (num_packs, dims[dim]):
            raise DataError(f"{path}: {name} has shape {handle[name].shape}, expected "
                            f"{(num_packs, dims[dim])}")
    return num_packs, seq_len, dims["K"], dims["M"]


def _shape2(handle, name, path):
    shape = handle[name].shape
    if len(shape) != 2:
        raise DataError(f"{path}: {name} must be 2-D, it has shape {shape}")
    return shape


def sequence_lengths(handle, chunk_rows=1 << 16):
    """Lengths of an unpacked file's sequences (input_mask row sums), read in chunks."""
    dataset = handle["input_mask"]
    num_rows = dataset.shape[0]
    lengths = np.empty(num_rows, dtype=np.int64)
    for start in range(0, num_rows, chunk_rows):
        block = dataset[start:start + chunk_rows]
        lengths[start:start + len(block)] = (block != 0).sum(axis=1)
    return lengths


@contextlib.contextmanager
def atomic_h5(path):
    """Yield an h5py.File open for writing at a temporary name; os.replace onto `path` on success.

    A crash or error leaves any existing `path` untouched and removes the partial file.
    """
    import h5py

    with atomic_path(path) as tmp:
        # track_order off and no timestamps: the same inputs give byte-identical files.
        with h5py.File(tmp, "w", libver=("earliest", "v110")) as handle:
            yield handle


@contextlib.contextmanager
def atomic_h5_image(path, digest=None):
    """Like `atomic_h5`, but the file is built in memory (HDF5's core driver) and written to disk
    by Python in one go at the end.

    Why: when the disk fills (ENOSPC) or a file-size limit is hit (EFBIG) while HDF5 itself
    writes, h5py raises from deep in the library and the process then crashes with SIGSEGV on
    its way out (h5py 3 / HDF5 1.14, measured), so the user gets a crash instead of a message
    and a resumable job. Written by Python, the same failure is a plain OSError. The cost is
    memory of about the (compressed) file's size, so use it for files of bounded size (shards).
    ``digest`` (a hashlib object) is updated with the file's bytes as they are written: a shard's
    checksum without reading the file back.
    """
    import h5py

    with atomic_path(path) as tmp:
        handle = h5py.File(os.path.basename(tmp) + ".image", "w", driver="core", backing_store=False,
                           libver=("earliest", "v110"))
        try:
            yield handle
            handle.flush()
            image = handle.id.get_file_image()
        finally:
            handle.close()
        if digest is not None:
            digest.update(image)
        with open(tmp, "wb") as out:
            out.write(image)
            out.flush()
            os.fsync(out.fileno())


def create_dataset(handle, name, data=None, *, shape=None, dtype=None, compression="gzip",
                   chunk_rows=1024):
    """Create a row-chunked dataset (no timestamps, so files are reproducible)."""
    if data is not None:
        shape, dtype = data.shape, dtype or data.dtype
    chunks = (min(chunk_rows, max(1, shape[0])),) + tuple(shape[1:]) if shape[0] else None
    kwargs = {}
    if compression == "gzip":
        kwargs = {"compression": "gzip", "compression_opts": 1, "shuffle": True}
    elif compression not in (None, "none"):
        kwargs = {"compression": compression}
    if chunks is None:
        kwargs = {}
    dataset = handle.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks,
                                    track_times=False, **kwargs)
    if data is not None and shape[0]:
        dataset[...] = data
    return dataset


def collate_records(samples, pack_offsets, sequence_indices, *, max_sequence_length,
                    max_sequences_per_pack, max_masked_tokens_per_pack):
    """NVIDIA-layout samples + CSR packs -> packed fields, through the model's collator."""
    from bert_packed.collate import BatchError, PackSlice, collate

    try:
        return collate(samples, PackSlice(np.asarray(pack_offsets, np.int64),
                                          np.asarray(sequence_indices, np.int64)),
                       max_sequence_length=max_sequence_length,
                       max_sequences_per_pack=max_sequences_per_pack,
                       max_masked_tokens_per_pack=max_masked_tokens_per_pack)
    except BatchError as exc:
        raise DataError(str(exc)) from None
