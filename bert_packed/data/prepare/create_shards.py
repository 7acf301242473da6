"""Sharded `create`: a corpus of any size -> a directory of unpacked HDF5 shards (``shards.py``).

The single-file `create` (create.py) holds the whole tokenised corpus and every instance in
memory; at Wikipedia scale (~20 GB of text) that is over a TiB. Here memory is bounded by a block
of input and by one shard, whatever the corpus size, and the work runs on ``engine.run_tasks``
(this process, a local Dask cluster, or an existing one):

Phase A, one task per input block (``formats.plan_blocks``: ~8 MiB of whole documents, or a
Parquet row group): read the block's documents, tokenise them (WordPiece, as create.py),
and send every document to one of N shards by a hash of (seed, block, document). The block's
documents are stored as ``DIR/.work/blocks/block-NNNNNN.bin`` grouped by shard, as flat arrays
(int32 tokens, sentence and document ends, shard ends) of which phase B reads only its part.

Phase B, one task per shard: gather the shard's documents from every block in block order and
run Google's algorithm on them (``create.create_instances``: random-next B segments come from
the shard's own documents, as NVIDIA LDDL does), seeded by (seed, shard); write the shard
atomically, in row chunks. N defaults to one shard per ~4 MiB of text (Parquet: uncompressed), so a shard's documents,
instances and arrays stay a few hundred MB at --dupe-factor 10 however large the corpus.

Then ``manifest.json`` (counts, length histograms, options, vocabulary, inputs) and ``.work/``
is removed. Every output is a function of the inputs, options and seed alone, so the shards and
the manifest are byte-identical for any --workers or cluster.

Resume: blocks (files renamed into place whole) and shards (atomic files) that exist with the
checksum they were written with are finished and are skipped when the same command runs again;
any other (overwritten in place, cut, another task's) is made again. A block carries its
checksum in a trailer (over its task and its bytes), a shard in a receipt until the manifest
records it (``shards.finished_shard``; the manifest's ``sha256`` per shard). ``.work/job.json``
records the job (options, inputs with sizes and times, vocabulary digest) and a different job
on the same directory is refused. A bad input found while tokenising (phase A) removes the job
once the workers have stopped, so the rerun on the fixed file starts afresh. A directory
holding a finished dataset is never overwritten.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import sys

import numpy as np

from bert_packed.data import h5io, shards
from bert_packed.data.prepare import engine, formats
from bert_packed.data.prepare.create import Documents, check_options, create_instances
from bert_packed.data.errors import DataError, refuse_output_over_input
from bert_packed.data.prepare.vocab import SPECIAL_TOKENS, check_corpus_file, load_vocab
from bert_packed.io.files import (TEMP_PREFIX, DirectoryLock, OutputInUseError, atomic_path, file_sha256,
                                  write_text_atomic)

DEFAULT_BLOCK_BYTES = 8 << 20  # 20 GB: 2,500 tasks; small enough to balance 2 workers on 80 MB
DEFAULT_SHARD_BYTES = 4 << 20
MAX_SHARDS = 100_000  # shard names have five digits (shards.shard_name)
MAX_BLOCK_BYTES = 1 << 30  # a block is decoded whole in one task's memory
WORK = ".work"


def create_shards(inputs, vocab_path, output_dir, *, max_seq_length=128, max_predictions=20, dupe_factor=10,
                  seed=12345, short_seq_prob=0.1, masked_lm_prob=0.15, lowercase=True, whole_word_mask=False,
                  input_format=None, text_column="text", workers=None, scheduler=None, output_shards=None,
                  block_bytes=DEFAULT_BLOCK_BYTES, show_progress=False):
    """The sharded `create` (see the module docstring); returns summary statistics.

    A bad input found before any shard is written (phase A) leaves no job behind, so the fixed
    rerun starts afresh; a failure later (a full disk) keeps the finished shards for the rerun."""
    output_dir = os.fspath(output_dir)
    check_options(max_seq_length, max_predictions, dupe_factor, masked_lm_prob, short_seq_prob)
    workers = engine.check_workers(workers, scheduler)
    _check_counts(output_shards, block_bytes, input_format)
    if not isinstance(text_column, str) or not text_column.strip():
        raise DataError(f"--text-column must name the JSONL field / Parquet column of the text, got {text_column!r}")
    paths = formats.expand_inputs(inputs)
    if not paths:
        raise DataError("--input names no files")
    _refuse_output_over_inputs(output_dir, [os.fspath(x) for x in inputs], paths + [os.fspath(vocab_path)])
    vocab = load_vocab(os.fspath(vocab_path))
    for path in paths:
        check_corpus_file(path)
    detected = [formats.detect_format(path, input_format) for path in paths]
    options = {"max_seq_length": max_seq_length, "max_predictions": max_predictions, "dupe_factor": dupe_factor,
               "seed": seed, "short_seq_prob": short_seq_prob, "masked_lm_prob": masked_lm_prob,
               "do_lower_case": bool(lowercase), "whole_word_mask": bool(whole_word_mask),
               "text_column": text_column, "block_bytes": block_bytes, "sentence_splitter": "blingfire"}
    inputs_record = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "format": f}
                     for p, f in zip(paths, detected)]
    total_bytes = sum(formats.text_bytes(x["path"], x["format"], text_column) for x in inputs_record)
    options["num_shards"] = output_shards or min(MAX_SHARDS, max(1, math.ceil(total_bytes / DEFAULT_SHARD_BYTES)))
    vocab_record = {"file": os.path.basename(os.fspath(vocab_path)), "bytes": os.path.getsize(vocab_path),
                    "num_tokens": max(vocab.values()) + 1}
    job = {"options": options, "inputs": [dict(x, mtime_ns=os.stat(x["path"]).st_mtime_ns) for x in inputs_record],
           "vocab": dict(vocab_record, path=os.path.abspath(vocab_path), sha256=file_sha256(vocab_path))}
    created = not os.path.lexists(output_dir)
    # One engine for both phases: a local cluster starts once. An existing cluster is reached before
    # anything is written, so a refused --scheduler leaves nothing behind.
    with engine.Engine(workers=workers, scheduler=scheduler) as runner:
        if scheduler is not None:
            runner.start()
        work, _ = _start_job(output_dir, job)
        with _locked(work, output_dir):
            _remove_unfinished_blocks(work)
            common = {"work": work, "vocab": job["vocab"]["path"], "options": options}
            shard_tasks = _phase_a(runner, common, inputs_record, block_bytes, text_column, output_dir, paths,
                                   show_progress, output_shards)
            if isinstance(shard_tasks, DataError):
                bad_input = shard_tasks
            else:
                bad_input = None
                manifest, totals, entries = _phase_b(runner, shard_tasks, output_dir, options, inputs_record,
                                                     vocab_record, show_progress)
    if bad_input is not None:
        # Bad input found before any shard: leave no job behind that would refuse the fixed rerun. Only
        # now, with the engine stopped: a worker still busy with another block wrote it after the error.
        shutil.rmtree(work, ignore_errors=True)
        if created and os.path.isdir(output_dir) and not os.listdir(output_dir):
            os.rmdir(output_dir)
        raise bad_input
    shutil.rmtree(work, ignore_errors=True)  # with the shards' receipts
    num_sequences = manifest["num_sequences"]
    return {"num_shards": len(entries), "num_documents": totals["num_documents"], "num_sequences": num_sequences,
            "num_tokens": manifest["num_tokens"], "num_masked_tokens": totals["num_masked_tokens"],
            "random_next_fraction": totals["num_random_next"] / max(1, num_sequences),
            "padding_fraction": 1.0 - manifest["num_tokens"] / max(1, num_sequences * max_seq_length)}


def _phase_a(runner, common, inputs_record, block_bytes, text_column, output_dir, paths, show_progress,
             output_shards=None):
    """Tokenise every block; returns the shard tasks, or the DataError of a bad input (raised by
    the caller once the engine has stopped; a failed write, ``WriteFailed``, is raised here and
    keeps the finished blocks for the rerun)."""
    try:
        blocks = [(record["path"], record["format"], start, stop) for record in inputs_record
                  for start, stop in formats.plan_blocks(record["path"], record["format"], block_bytes, text_column)]
        block_tasks = [dict(common, index=i, path=p, format=f, start=a, stop=b)
                       for i, (p, f, a, b) in enumerate(blocks)]
        results = runner.run(tokenise_block, block_tasks, desc="tokenise", unit=" blocks", show_progress=show_progress)
        shard_tasks = _shard_tasks(common, output_dir, results, paths)
        if output_shards and len(shard_tasks) < output_shards:  # said, never silent (issue 46)
            print(f"warning: --output-shards {output_shards}: only {len(shard_tasks)} shards receive documents "
                  f"({int(sum(sum(r['documents']) for r in results))} documents in all; shards without any are "
                  f"not written), so {len(shard_tasks)} are written", file=sys.stderr)
        return shard_tasks
    except WriteFailed:
        raise
    except DataError as exc:
        return exc


def _phase_b(runner, shard_tasks, output_dir, options, inputs_record, vocab_record, show_progress):
    """Write every shard, then the manifest (with each shard's checksum); returns (manifest,
    totals, entries)."""
    summaries = runner.run(write_shard, shard_tasks, desc="shards", unit=" shards", show_progress=show_progress)
    _remove_orphan_shards(output_dir)
    entries = [summary.pop("entry") for summary in summaries]
    totals = {key: int(sum(s[key] for s in summaries)) for key in ("num_documents", "num_masked_tokens",
                                                                  "num_random_next")}
    with _writing(os.path.join(output_dir, shards.MANIFEST)):
        manifest = shards.write_manifest(
            output_dir, kind="unpacked", shards=entries, options=options, inputs=inputs_record,
            vocab=vocab_record, num_documents=totals["num_documents"],
            num_masked_tokens=totals["num_masked_tokens"], num_random_next=totals["num_random_next"],
            created_by="python -m bert_packed.data create")
    return manifest, totals, entries


class _locked(DirectoryLock):
    """One create per output directory (the lock lives in ``.work``), refused in `create`'s words."""

    def __init__(self, work, output_dir):
        super().__init__(work)
        self.output_dir = output_dir

    def acquire(self):
        try:
            return super().acquire()
        except OutputInUseError as exc:
            holder = str(exc).split("(", 1)[1].split(")", 1)[0] if "(" in str(exc) else "another process"
            raise DataError(f"--output {self.output_dir} is being written by another create ({holder}); wait for "
                            f"it to finish, or choose another --output") from None


def _check_counts(output_shards, block_bytes, input_format):
    if output_shards is not None and (isinstance(output_shards, bool) or not isinstance(output_shards, int)
                                      or not 1 <= output_shards <= MAX_SHARDS):
        raise DataError(f"--output-shards must be between 1 and {MAX_SHARDS} (shard names have five digits), "
                        f"got {output_shards}")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or not 1 <= block_bytes <= MAX_BLOCK_BYTES:
        raise DataError(f"--block-bytes must be between 1 and {MAX_BLOCK_BYTES} (a block is read whole into one "
                        f"task's memory), got {block_bytes}")
    if input_format is not None:
        formats.get(input_format)


def _refuse_output_over_inputs(output_dir, arguments, paths):
    """The shards' directory must not hold an input, be one, or lie inside an input directory
    (a rerun would then read the shards as corpus)."""
    target = os.path.realpath(output_dir)
    refuse_output_over_input(output_dir, paths)
    for path in paths:
        real = os.path.realpath(path)
        if real == target or real.startswith(target + os.sep):
            raise DataError(f"--output {output_dir} holds an input ({path}); writing shards there could destroy it: "
                            f"choose another --output")
    for argument in arguments:
        if os.path.isdir(argument):
            real = os.path.realpath(argument)
            if target == real or target.startswith(real + os.sep):
                raise DataError(f"--output {output_dir} is inside the input directory {argument}; a rerun would read "
                                f"the shards as corpus: choose another --output")
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise DataError(f"--output {output_dir} is a file; give a directory for shards (or a .h5/.hdf5 file name "
                        f"for one file)")


def _start_job(output_dir, job):
    """``DIR/.work`` with ``job.json``: a new job in an empty directory, or the same job resumed."""
    work = os.path.join(output_dir, WORK)
    record = os.path.join(work, "job.json")
    if os.path.exists(os.path.join(output_dir, shards.MANIFEST)):
        raise DataError(f"--output {output_dir} already holds a finished dataset ({shards.MANIFEST}); remove it or "
                        f"choose another --output (nothing is overwritten)")
    if os.path.exists(record):
        with open(record, encoding="utf-8") as handle:
            try:
                previous = json.load(handle)
            except ValueError:
                previous = {}
        if previous != job:
            differ = [key for key in ("options", "inputs", "vocab") if previous.get(key) != job.get(key)]
            raise DataError(f"--output {output_dir} holds an unfinished create of another job (its "
                            f"{' and '.join(differ) or 'record'} differ); run that command again to finish it, or "
                            f"choose an empty --output")
        return work, True
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        raise DataError(f"--output {output_dir} is not empty and holds no unfinished create; choose an empty or new "
                        f"directory")
    with _writing(record):
        os.makedirs(work, exist_ok=True)
        write_text_atomic(record, json.dumps(job, indent=1, sort_keys=True) + "\n")
    return work, False


class WriteFailed(DataError):
    """Writing an output failed (a full disk): finished work is kept for the rerun."""


class _writing:
    """Turn an OSError while writing (a full disk, a file-size limit) into one line that says
    what is kept and how to finish."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not issubclass(exc_type, OSError):
            return False
        reason = exc.strerror or str(exc).splitlines()[0] if str(exc) else exc_type.__name__
        found = str(exc).split("error message = '")
        if len(found) > 1:  # h5py: "Can't write data (file write failed: ..., error message = 'File too large', ...)"
            reason = found[1].split("'")[0]
        raise WriteFailed(f"{self.path}: writing failed ({reason}); finished shards are kept: free space (or raise the "
                        f"limit) and run the same command again to finish") from None


# ---------------------------------------------------------------------------------------------- phase A


@functools.lru_cache(maxsize=4)
def _tokenizer(vocab_path, lowercase):
    from tokenizers import BertWordPieceTokenizer

    return BertWordPieceTokenizer(vocab_path, clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                  lowercase=lowercase)


def _block_path(work, index):
    return os.path.join(work, "blocks", f"block-{index:06d}.bin")


# A finished block is one file (written whole, then renamed into place), read by phase B with a
# few positioned reads: header (magic, then int64 counts: shards, documents, sentences, tokens),
# then int64 shard_ends, document_ends (sentences), sentence_ends (tokens), then int32 tokens, all
# little-endian, then a 32-byte trailer: the SHA-256 of the block's task (``_block_key``: input
# file, byte range, block index, options) followed by every byte before the trailer, hashed as
# they are written. A rerun reuses a block only when the trailer matches both its task and its
# content (``_finished_block``: a block overwritten in place, cut, or left by another task or
# job is tokenised again). Every shard reads its part of every block, so at 20 GB (2,500 blocks,
# 5,000 shards) opening a block is paid 12.5 M times: four np.load(mmap_mode="r") calls took
# 225 us a block, positioned reads on one descriptor take a tenth of that (docs/benchmarks/data.md).
BLOCK_MAGIC = b"PKBLOCK2"
_BLOCK_HEADER = len(BLOCK_MAGIC) + 4 * 8
_BLOCK_TRAILER = 32


def _block_key(task):
    """What a block is a function of, as bytes (the checksum's prefix)."""
    fields = {key: task[key] for key in ("index", "path", "format", "start", "stop", "options")}
    return json.dumps(fields, sort_keys=True, default=str).encode()


def tokenise_block(task):
    """Phase A for one block (see the module docstring); returns its counts. A block file that
    exists and has its checksum is finished (it is renamed into place whole), so a rerun only
    reads it; any other is tokenised again."""
    final = _block_path(task["work"], task["index"])
    if not _finished_block(final, task):
        tokens, sentence_lengths, document_sizes = _tokenise(task)
        arrays = _group_by_shard(tokens, sentence_lengths, document_sizes, task)
        # Two runs of the same task write the same bytes, so either may publish last.
        with _writing(final), atomic_path(final, prefix=".tmp-block-") as tmp, open(tmp, "wb") as handle:
            _write_block(handle, arrays, _block_key(task))
    with _BlockReader(final) as block:
        return {"documents": np.diff(block.array(block.shard_ends_at, block.num_shards), prepend=0)}


def _finished_block(path, task, read_bytes=1 << 20):
    """True when ``path`` is this task's block with its content as written (the trailer's
    checksum over the task and the bytes); a full read of the block, only on a rerun."""
    try:
        size = os.path.getsize(path)
        if size < _BLOCK_HEADER + _BLOCK_TRAILER:
            return False
        digest = hashlib.sha256(_block_key(task))
        with open(path, "rb") as handle:
            left = size - _BLOCK_TRAILER
            while left:
                chunk = handle.read(min(read_bytes, left))
                if not chunk:
                    return False
                digest.update(chunk)
                left -= len(chunk)
            return handle.read() == digest.digest()
    except OSError:
        return False


def _write_block(handle, arrays, key):
    """One block file (layout above), through Python's own writes (np.save/tofile write with their
    own FILE* and can lose a failed write: a full disk left a truncated file behind, measured)."""
    counts = [len(arrays["shard_ends"]), len(arrays["document_ends"]), len(arrays["sentence_ends"]),
              len(arrays["tokens"])]
    digest = hashlib.sha256(key)
    parts = [BLOCK_MAGIC + np.asarray(counts, "<i8").tobytes()]
    for name, dtype in (("shard_ends", "<i8"), ("document_ends", "<i8"), ("sentence_ends", "<i8"), ("tokens", "<i4")):
        parts.append(memoryview(np.ascontiguousarray(arrays[name], dtype)).cast("B"))
    for part in parts:
        digest.update(part)
        handle.write(part)
    handle.write(digest.digest())
    handle.flush()
    os.fsync(handle.fileno())


class _BlockReader:
    """Positioned reads of a finished block file (layout above)."""

    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            header = os.pread(self.fd, _BLOCK_HEADER, 0)
            if len(header) != _BLOCK_HEADER or header[:len(BLOCK_MAGIC)] != BLOCK_MAGIC:
                self._damaged()
            counts = [int(x) for x in np.frombuffer(header, "<i8", offset=len(BLOCK_MAGIC))]
            self.num_shards, self.num_documents, self.num_sentences, self.num_tokens = counts
            expected = _BLOCK_HEADER + 8 * sum(counts[:3]) + 4 * counts[3] + _BLOCK_TRAILER
            if min(counts) < 0 or os.fstat(self.fd).st_size != expected:
                self._damaged()
        except BaseException:
            os.close(self.fd)
            raise
        self.shard_ends_at = _BLOCK_HEADER
        self.document_ends_at = self.shard_ends_at + 8 * self.num_shards
        self.sentence_ends_at = self.document_ends_at + 8 * self.num_documents
        self.tokens_at = self.sentence_ends_at + 8 * self.num_sentences

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        os.close(self.fd)

    def array(self, at, count, first=0, dtype="<i8"):
        """``count`` items from item ``first`` of the array that starts at byte ``at``."""
        size = np.dtype(dtype).itemsize
        data = os.pread(self.fd, size * count, at + size * first)
        if len(data) != size * count:
            self._damaged()
        return np.frombuffer(data, dtype)

    def ends(self, at, first, last):
        """Cumulative ends [first, last) of an array starting at byte ``at``, with the end before
        ``first`` (0 for the first): (start, ends)."""
        if first:
            values = self.array(at, last - first + 1, first - 1)
            return int(values[0]), values[1:]
        return 0, self.array(at, last)

    def _damaged(self):
        raise DataError(f"{self.path}: a finished block file is damaged (cut or overwritten); run the same command "
                        f"again to tokenise that block afresh")


def _remove_orphan_shards(output_dir):
    """Temporary shard files of killed runs, on any host (``io.remove_orphans`` only knows this
    host's processes): every shard is finished and the directory is locked, so none is live."""
    for name in os.listdir(output_dir):
        if name.startswith(TEMP_PREFIX) and name.endswith(".h5"):
            os.unlink(os.path.join(output_dir, name))


def _remove_unfinished_blocks(work):
    """Temporary block files of a killed run (never read: only renamed ones count), and block
    directories of the earlier layout (four .npy files; remade as files on the rerun)."""
    folder = os.path.join(work, "blocks")
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(".tmp-block-"):
            os.unlink(path)


def _tokenise(task, batch_sentences=4096):
    """The block's documents as token ids: flat int32 tokens, tokens per sentence, sentences per
    document (sentences without tokens and documents without sentences are left out)."""
    tokenizer = _tokenizer(task["vocab"], task["options"]["do_lower_case"])
    chunks, sentence_lengths, document_sizes = [], [], []
    pending, owners = [], []

    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which nothing here reads
    encode = getattr(tokenizer._tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def flush():
        batch = [encoding.ids for encoding in encode(pending, add_special_tokens=False)]
        lengths = [len(ids) for ids in batch]
        chunks.append(np.fromiter(itertools.chain.from_iterable(batch), np.int32, sum(lengths)))
        for owner, length in zip(owners, lengths):
            if length:
                sentence_lengths.append(length)
                document_sizes[owner] += 1
        pending.clear()
        owners.clear()

    for document in formats.read_block(task["path"], task["format"], task["start"], task["stop"],
                                       task["options"]["text_column"], task["options"]["max_seq_length"]):
        document_sizes.append(0)
        for sentence in document:
            pending.append(sentence)
            owners.append(len(document_sizes) - 1)
        if len(pending) >= batch_sentences:
            flush()
    flush()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    document_sizes = np.asarray(document_sizes, np.int64)
    return tokens, np.asarray(sentence_lengths, np.int64), document_sizes[document_sizes > 0]


def _mix64(x):
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a fixed hash, so shard
    assignment never depends on a library's random stream (NumPy keeps no stream stability)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def document_shards(seed, block, num_documents, num_shards):
    """The shard of each document of a block: hash(seed, block, document index) mod N."""
    key = _mix64(_mix64(np.array([seed & (2**64 - 1)], np.uint64)) ^ np.uint64(block))
    hashed = _mix64(key ^ np.arange(num_documents, dtype=np.uint64))
    return (hashed % np.uint64(num_shards)).astype(np.int64)


def _group_by_shard(tokens, sentence_lengths, document_sizes, task):
    """Assign the documents to shards and lay the block out grouped by shard (stable order)."""
    num_shards = task["options"]["num_shards"]
    shard_of = document_shards(task["options"]["seed"], task["index"], len(document_sizes), num_shards)
    order = np.argsort(shard_of, kind="stable")
    document_ends = np.cumsum(document_sizes)
    sentence_ends = np.cumsum(sentence_lengths)
    doc_sentence = np.stack([document_ends - document_sizes, document_ends], axis=1)[order]
    sentence_order = np.concatenate([np.arange(a, b) for a, b in doc_sentence]) if len(order) else np.zeros(0, int)
    token_ranges = np.stack([sentence_ends - sentence_lengths, sentence_ends], axis=1)[sentence_order]
    new_tokens = (np.concatenate([tokens[a:b] for a, b in _merge_ranges(token_ranges)])
                  if len(token_ranges) else np.zeros(0, np.int32))
    return {"tokens": new_tokens.astype(np.int32),
            "sentence_ends": np.cumsum(sentence_lengths[sentence_order]).astype(np.int64),
            "document_ends": np.cumsum(document_sizes[order]).astype(np.int64),
            "shard_ends": np.cumsum(np.bincount(shard_of, minlength=num_shards)).astype(np.int64)}


def _merge_ranges(ranges):
    """Adjacent [a, b) ranges joined (whole documents move together: one copy per run)."""
    merged = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return merged


# ---------------------------------------------------------------------------------------------- phase B


def _shard_tasks(common, output_dir, results, paths):
    """One task per shard that received documents (empty ones are left out; outputs are
    numbered densely in shard order)."""
    per_shard = np.sum([r["documents"] for r in results], axis=0) if results else np.zeros(0, np.int64)
    if not int(np.sum(per_shard)):
        raise DataError(f"{', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}: no text found; give documents "
                        f"(lines: one sentence per line, blank line between documents; or WikiExtractor, JSONL, "
                        f"Parquet)")
    tasks = []
    for assigned in np.nonzero(per_shard)[0]:
        output = os.path.join(output_dir, shards.shard_name(len(tasks)))
        seed = int.from_bytes(hashlib.sha256(f"{common['options']['seed']}/{assigned}".encode()).digest()[:7], "big")
        tasks.append(dict(common, assigned=int(assigned), output=output, shard_seed=seed, num_blocks=len(results)))
    return tasks


@functools.lru_cache(maxsize=4)
def _vocab_ids(vocab_path):
    vocab = load_vocab(vocab_path)
    special_ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    continuation_ids = frozenset(i for token, i in vocab.items() if token.startswith("##"))
    return special_ids, continuation_ids, max(vocab.values()) + 1


def write_shard(task):
    """Phase B for one shard; returns its manifest entry and counts. A shard file that exists is
    finished (written atomically), so a rerun only reads its statistics."""
    path = task["output"]
    receipts = os.path.join(task["work"], "shards")
    sha256 = shards.finished_shard(path, receipts)
    if sha256 is None:  # not written, or not with the content it was written with: write it (again)
        documents = _shard_documents(task)
        options = task["options"]
        special_ids, continuation_ids, vocab_size = _vocab_ids(task["vocab"])
        instances = create_instances(
            documents, vocab_size, special_ids, max_seq_length=options["max_seq_length"],
            max_predictions=options["max_predictions"], dupe_factor=options["dupe_factor"],
            short_seq_prob=options["short_seq_prob"], masked_lm_prob=options["masked_lm_prob"],
            whole_word_mask=options["whole_word_mask"], continuation_ids=continuation_ids,
            seed=task["shard_seed"])
        attrs = {"max_seq_length": options["max_seq_length"], "max_predictions_per_seq": options["max_predictions"],
                 "dupe_factor": options["dupe_factor"], "seed": task["shard_seed"],
                 "short_seq_prob": options["short_seq_prob"], "masked_lm_prob": options["masked_lm_prob"],
                 "do_lower_case": options["do_lower_case"], "whole_word_mask": options["whole_word_mask"],
                 "vocab_size": vocab_size, "num_documents": len(documents)}
        del documents
        digest = hashlib.sha256()
        with _writing(path):
            _write_instances(path, instances, options["max_seq_length"], options["max_predictions"], attrs, digest)
            sha256 = digest.hexdigest()
            shards.write_receipt(path, sha256, receipts)
    return _shard_summary(path, sha256)


def _shard_documents(task):
    """The shard's documents from every block, in block order, as flat arrays (`create.Documents`)."""
    tokens, sentence_lengths, document_sizes = [], [], []
    shard = task["assigned"]
    for index in range(task["num_blocks"]):
        with _BlockReader(_block_path(task["work"], index)) as block:
            first_doc, (last_doc,) = block.ends(block.shard_ends_at, shard, shard + 1)
            if first_doc == last_doc:
                continue
            first_sentence, doc_ends = block.ends(block.document_ends_at, first_doc, int(last_doc))
            first_token, sent_ends = block.ends(block.sentence_ends_at, first_sentence, int(doc_ends[-1]))
            tokens.append(block.array(block.tokens_at, int(sent_ends[-1]) - first_token, first_token, "<i4"))
        sentence_lengths.append(np.diff(sent_ends, prepend=first_token))
        document_sizes.append(np.diff(doc_ends, prepend=first_sentence))
    join = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    return Documents(join(tokens, np.int32), np.cumsum(join(sentence_lengths, np.int64)),
                     np.cumsum(join(document_sizes, np.int64)))


def _write_instances(path, instances, max_seq_length, max_predictions, attrs, digest=None):
    """The shard in the NVIDIA/MLPerf layout, laid out a chunk of rows at a time (`Instances.chunks`:
    the padded arrays of a whole shard are never held; the compressed file is, see h5io.atomic_h5_image)."""
    shapes = h5io.unpacked_shapes(len(instances), max_seq_length, max_predictions)
    with h5io.atomic_h5_image(path, digest) as handle:
        datasets = {name: h5io.create_dataset(handle, name, shape=shape, dtype=dtype)
                    for name, (shape, dtype) in shapes.items()}
        for start, arrays in instances.chunks():
            for name, dataset in datasets.items():
                dataset[start:start + len(arrays[name])] = arrays[name]
        handle.attrs.update(attrs)


def _shard_summary(path, sha256, rows=1 << 16):
    """A shard's manifest entry and counts, read from the file (the same after a resume)."""
    entry = shards.shard_entry(path, sha256=sha256)
    masked = random_next = 0
    with h5io.open_h5(path) as handle, h5io.read_errors(path):
        num_documents = int(handle.attrs["num_documents"])
        for start in range(0, entry["num_items"], rows):
            masked += int((handle["masked_lm_ids"][start:start + rows] != 0).sum())
            random_next += int(handle["next_sentence_labels"][start:start + rows].sum())
    return {"entry": entry, "num_documents": num_documents, "num_masked_tokens": masked,
            "num_random_next": random_next}
