"""Sharded datasets: a directory of HDF5 shards plus ``manifest.json``.

This is the one format that ``create`` writes and ``pack`` and the training reader read when
they are given a directory (a single ``.h5`` file keeps working everywhere). Each shard is an
ordinary HDF5 file in today's layouts (``h5io``): unpacked shards in the NVIDIA/MLPerf layout
(so MLPerf-style readers read them as they are), packed shards in the packed layout.

``manifest.json`` (written last, atomically: a directory without it is not a dataset)::

    {"format": "packed-bert/shards-v1",
     "kind": "unpacked" | "packed",
     "max_sequence_length": S,
     "max_predictions_per_seq": P,            # unpacked: masked slots per sequence
     "max_sequences_per_pack": K,             # packed (1 for unpacked)
     "max_masked_tokens_per_pack": M,         # packed: the widest shard's M
     "num_items": rows, "num_sequences": n, "num_tokens": t,
     "length_histogram": [h_1, ..., h_S],     # sequences of each length, summed over shards
     "options": {...},                        # what made it (seed, dupe factor, algorithm, ...)
     "inputs": [{"path": ..., "bytes": ...}], # the files it was made from
     "shards": [{"file": "shard-00000.h5", "bytes": b, "sha256": "<64 hex digits>", "num_items": r,
                 "num_sequences": n, "num_tokens": t, "length_histogram": [...]}, ...],
     ...}                                     # kind-specific statistics (packing efficiency, LP bound)

``sha256`` is the SHA-256 of the shard file's bytes (what ``sha256sum shard-00000.h5`` prints),
computed from the bytes as they are written, not by reading the file back. It is the shard's
identity: ``pack`` checks each input shard against it, a checkpoint records the dataset by it
(``sharded.dataset_identity``), and a rerun of ``create`` or ``pack`` reuses a finished shard only
when the file still has the checksum it was written with (``finished_shard``: the writer leaves a
receipt, ``.shard-NNNNN.h5.sha256`` in ``sha256sum`` format, until the manifest is written).

``load_manifest`` checks a directory against its manifest (every shard present, non-empty, of
the recorded size) and refuses a mismatch with one line; ``verify_shard`` also compares the
content (a full read: ~1 GB/s); ``shard_entry`` computes a shard's entry from the file itself,
so a manifest can always be rebuilt from its shards.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from bert_packed.data import h5io
from bert_packed.data.errors import DataError
from bert_packed.io.files import atomic_path, file_sha256, write_text_atomic

MANIFEST = "manifest.json"
FORMAT = "packed-bert/shards-v1"
KINDS = ("unpacked", "packed")


def shard_name(index: int) -> str:
    """File name of shard ``index`` (sorted names are shard order)."""
    return f"shard-{int(index):05d}.h5"


def is_dataset_dir(path) -> bool:
    """True when ``path`` is a directory (a sharded dataset, or one to be refused with a reason)."""
    return os.path.isdir(os.fspath(path))


CHECKSUM = "sha256"  # the manifest field of a shard's content checksum
RECEIPT_SUFFIX = ".sha256"


def receipt_path(shard_path, folder=None) -> str:
    """Where the writer of ``shard_path`` records its checksum until the manifest is written: next
    to it, or in ``folder`` (`create` keeps them in its work directory)."""
    here, name = os.path.split(os.fspath(shard_path))
    return os.path.join(here if folder is None else os.fspath(folder), "." + name + RECEIPT_SUFFIX)


def write_receipt(shard_path, sha256: str, folder=None) -> None:
    """Record that ``shard_path`` (just published whole) was written with content ``sha256``."""
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    write_text_atomic(receipt_path(shard_path, folder), f"{sha256}  {os.path.basename(os.fspath(shard_path))}\n")


def finished_shard(shard_path, folder=None) -> Optional[str]:
    """The checksum of ``shard_path`` when it is a finished shard of this job: it exists, its
    writer's receipt exists, and the file's bytes still have the receipt's checksum. None
    otherwise (missing, never finished, or changed since: replaced by a copy of another shard,
    overwritten in place); the caller then writes it again."""
    shard_path = os.fspath(shard_path)
    try:
        with open(receipt_path(shard_path, folder), encoding="utf-8") as handle:
            recorded = handle.read().split()
        if len(recorded) != 2 or recorded[1] != os.path.basename(shard_path):
            return None
        return recorded[0] if file_sha256(shard_path) == recorded[0] else None
    except (OSError, UnicodeDecodeError):
        return None


def remove_receipts(directory) -> None:
    """The receipts of ``directory``'s shards (once the manifest records the checksums)."""
    for name in os.listdir(os.fspath(directory)):
        if name.startswith(".") and name.endswith(".h5" + RECEIPT_SUFFIX):
            os.unlink(os.path.join(os.fspath(directory), name))


def verify_shard(path, entry: Dict[str, Any]) -> Optional[str]:
    """DataError unless the file at ``path`` has the content checksum its manifest entry records
    (entries of manifests written before checksums have none: nothing to compare). Returns it."""
    recorded = entry.get(CHECKSUM)
    if recorded is None:
        return None
    found = file_sha256(path)
    if found != recorded:
        raise DataError(f"{path}: its content differs from the checksum {MANIFEST} records for it ({CHECKSUM} "
                        f"{found[:12]}..., recorded {str(recorded)[:12]}...): the shard was changed or replaced "
                        f"since the dataset was written; re-create the dataset")
    return found


def shard_entry(path, *, sha256: Optional[str] = None, read_rows: int = 1 << 16) -> Dict[str, Any]:
    """A shard's manifest entry, computed from the HDF5 file: rows, sequences, tokens, byte size,
    content checksum (``sha256``: give the one computed as the file was written, or the file is
    read to compute it) and the length histogram (sequences of each length 1..S)."""
    path = os.fspath(path)
    with h5io.open_h5(path) as handle, h5io.read_errors(path):
        if h5io.is_packed(handle):
            num_items, seq_len, max_k, max_m = h5io.check_packed(handle, path)
            histogram = np.zeros(seq_len + 1, np.int64)
            ids = handle["sequence_ids"]
            for start in range(0, num_items, read_rows):
                block = np.asarray(ids[start:start + read_rows], np.int64)
                for k in range(1, max_k + 1):
                    lengths = (block == k).sum(axis=1)
                    histogram += np.bincount(lengths[lengths > 0], minlength=seq_len + 1)
            extra = {"max_sequences_per_pack": int(max_k), "max_masked_tokens_per_pack": int(max_m)}
        else:
            num_items, seq_len, num_predictions = h5io.check_unpacked(handle, path)
            lengths = h5io.sequence_lengths(handle, read_rows)
            histogram = np.bincount(lengths, minlength=seq_len + 1)
            extra = {"max_predictions_per_seq": int(num_predictions)}
    histogram = histogram[1:]
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path),
            CHECKSUM: sha256 or file_sha256(path), "num_items": int(num_items),
            "num_sequences": int(histogram.sum()),
            "num_tokens": int((histogram * np.arange(1, seq_len + 1)).sum()),
            "max_sequence_length": int(seq_len), "length_histogram": [int(x) for x in histogram], **extra}


def write_manifest(directory, *, kind: str, shards: Sequence[Dict[str, Any]], options: Dict[str, Any] = None,
                   inputs: Sequence[Dict[str, Any]] = (), **extra) -> Dict[str, Any]:
    """Write ``directory/manifest.json`` atomically from the shards' entries (``shard_entry``);
    returns the manifest. All shards must share S (and K for packed data)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not shards:
        raise DataError(f"{directory}: no shards to write a manifest for")
    seq_lens = sorted({int(s["max_sequence_length"]) for s in shards})
    if len(seq_lens) > 1:
        raise DataError(f"{directory}: shards of different sequence lengths {seq_lens}; a dataset has one")
    seq_len = seq_lens[0]
    histogram = np.zeros(seq_len, np.int64)
    for shard in shards:
        histogram += np.asarray(shard["length_histogram"], np.int64)
    manifest = {"format": FORMAT, "kind": kind, "max_sequence_length": seq_len,
                "num_shards": len(shards),
                "num_items": int(sum(s["num_items"] for s in shards)),
                "num_sequences": int(histogram.sum()),
                "num_tokens": int((histogram * np.arange(1, seq_len + 1)).sum()),
                "length_histogram": [int(x) for x in histogram]}
    if kind == "packed":
        depths = sorted({int(s["max_sequences_per_pack"]) for s in shards})
        if len(depths) > 1:
            raise DataError(f"{directory}: packed shards of different depths {depths}; a dataset has one")
        manifest["max_sequences_per_pack"] = depths[0]
        manifest["max_masked_tokens_per_pack"] = max(int(s["max_masked_tokens_per_pack"]) for s in shards)
    else:
        manifest["max_sequences_per_pack"] = 1
        manifest["max_predictions_per_seq"] = max(int(s["max_predictions_per_seq"]) for s in shards)
    manifest.update(extra)
    manifest["options"] = dict(options or {})
    manifest["inputs"] = [dict(x) for x in inputs]
    manifest["shards"] = [dict(s) for s in shards]
    with atomic_path(os.path.join(os.fspath(directory), MANIFEST)) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1)
            handle.write("\n")
    return manifest


def load_manifest(directory, *, check_files: bool = True) -> Dict[str, Any]:
    """Read and check ``directory/manifest.json``: DataError (one line) when it is missing or
    malformed, or when a shard is missing, empty or not the size the manifest records."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory of shards")
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        found = sorted(name for name in os.listdir(directory) if name.endswith(".h5"))
        hint = (f"it holds {len(found)} .h5 file(s) but no manifest (an interrupted `create` or `pack`? "
                "run the same command again to finish it)" if found else "it holds no shards")
        raise DataError(f"{directory}: no {MANIFEST}; {hint}")
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a valid manifest ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("kind") not in KINDS or not isinstance(manifest.get("shards"), list) or not manifest["shards"]:
        raise DataError(f"{path}: the manifest lists no shards (or no kind)")
    if check_files:
        for shard in manifest["shards"]:
            check_shard_file(directory, shard, manifest)
    return manifest


def check_shard_file(directory, shard: Dict[str, Any], manifest: Dict[str, Any]) -> str:
    """The path of one shard after the cheap checks (present, non-empty, recorded size, S)."""
    name = shard.get("file")
    if not isinstance(name, str) or os.path.basename(name) != name:
        raise DataError(f"{directory}/{MANIFEST}: a shard entry has no plain file name ({name!r})")
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise DataError(f"{path}: shard missing (listed in {MANIFEST}); re-create the dataset")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path}: shard is empty (0 bytes); re-create the dataset")
    if size != int(shard.get("bytes", -1)):
        raise DataError(f"{path}: {size} bytes, the manifest records {shard.get('bytes')}; the shard does not "
                        f"match {MANIFEST} (changed or half-written): re-create the dataset")
    if int(shard.get("max_sequence_length", manifest["max_sequence_length"])) != manifest["max_sequence_length"]:
        raise DataError(f"{path}: sequence length {shard.get('max_sequence_length')} differs from the "
                        f"dataset's {manifest['max_sequence_length']}; shards of one dataset share it")
    return path


def shard_paths(directory, manifest: Dict[str, Any]) -> List[str]:
    """The shards' paths in manifest order."""
    return [os.path.join(os.fspath(directory), shard["file"]) for shard in manifest["shards"]]
