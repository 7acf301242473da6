"""`pack` of a sharded dataset: a directory of unpacked shards -> a directory of packed shards.

Why it is not `pack_file` on each shard: the plan should be the *dataset's*, with the LP
certificate of the whole dataset's histogram, and packing the shards one by one would
neither say how far the result is from that bound nor reuse one plan. Why it is not
`pack_file` on the concatenation: that needs a scratch file as large as the data, and one
process. So:

1. **One histogram, one plan** (this process, no pass over the data): the shards' length
   histograms from the input manifest are summed and planned once with ``packing.pack``;
   its LP bound (``--algorithm lp``) certifies the whole dataset.
2. **Split** (``packing.split``): every strategy's repeat count is apportioned over the
   shards, as far as each shard's sequences fill the copies; each shard keeps a small
   leftover histogram (its mismatch with its share of the plan).
3. **Pack each shard** (in parallel on ``engine.run_tasks``, one task per shard): a pack's
   sequences come from one shard, so output shard i is made from input shard i alone, in
   memory (a shard fits in memory by design): no scratch file. The shard's plan is its
   part of the global plan plus the leftover packed with the same algorithm, taken as it is
   when within 0.05 % of the shard's certified bound (the global LP's duals price any shard
   for free); otherwise, cheapest first, the leftover polished by ``lp``'s MILP (about a
   thousand sequences whatever the shard's size), the shard's own histogram planned, and that
   polished, until a plan is within; the best plan is kept (``packing.split.plan_shard``;
   a pack cannot cross shards, so the best plan of each shard is the real target; both are
   exact plans of the shard, the file records which one it used as ``shard_plan`` and its
   bound as ``shard_lp_bound_packs``).
4. **Manifest** (kind ``packed``, written last): global efficiency, packing factor, packs,
   the LP bound of the global histogram and the gap to it, the unsharded plan's packs and the
   sharding gap, the options and the input dataset's options.

Deterministic: every shard's output is a function of its task (the seed of shard i is
derived from ``--seed`` and i), so any ``--workers`` writes the same bytes. ``lp``'s MILP
polish is bounded by branch-and-bound nodes here, not by its usual 2 s clock (a clock would
make the plan depend on the machine's load), and runs only where it can matter: on the global
plan when it is more than 0.02 % above its bound (``packing.split.pack_polished``), and on a
shard whose plans so far are all more than 0.05 % above its bound: first on its leftover, then
on its own plan. The LP's rounding alone costs about 7 packs a leftover and 12 a plan, 0.1 % of
a 12 k-pack shard, and the MILP closes it: about a tenth of the time on the leftover that it
takes on the whole shard (KJV, S=512, 12.6 k sequences a shard). Going straight to the shard's
own polished plan, 50 of 64 such shards needed it and planning was three quarters of `pack`'s
time; with the leftover's polish first, 12 do and `pack` is 2.1x faster.

Resumable: output shards are written atomically, each with a receipt of its content checksum
(``shards.finished_shard``), so a rerun with the same options skips the shards that still have
the checksum they were written with and writes the others again (a shard replaced by a copy of
another, or changed in place, is never counted); ``.pack-state.json`` (removed at the end)
records the options and the input manifest's digest, and another command on that directory is
refused.

Identity by content: every input shard is checked against the checksum its manifest records
before it is packed, every output shard must hold exactly its input shard's length histogram,
and the dataset's sequences in must equal its sequences out, or `pack` stops without a manifest.
With ``verify`` each output shard is compared with its input sequence by sequence (digests) as
part of its task; a shard that fails is removed, and no manifest is written.

Nothing written on a refusal: the engine connects (``--scheduler``, a local cluster) before the
output directory is made, and a run that is refused for its input (a ``DataError``) removes the
directory it started; an unfinished run of the same command (interrupted, a full disk) keeps its
finished shards for the rerun.
"""
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np
from tqdm import tqdm

from bert_packed.data import h5io
from bert_packed.data.errors import DataError
from bert_packed.data.prepare.pack import _check_depth, _record_dtype, _statistics, read_lengths, unpacked_digests, \
    packed_digests, write_packed
from bert_packed.data.shards import CHECKSUM, MANIFEST, finished_shard, load_manifest, receipt_path, remove_receipts, shard_entry, \
    shard_name, shard_paths, verify_shard, write_manifest, write_receipt
from bert_packed.io.files import TEMP_PREFIX, file_sha256, make_folder, write_text_atomic

STATE = ".pack-state.json"
# lp's MILP stops at a wall-clock limit by default, so its plan could depend on the machine's
# load: here the first run has no MILP, and a plan more than 0.02 % above its bound (a small
# shard) is polished by a second run whose MILP stops at a node limit instead (module doc).
ALGORITHM_OPTIONS = {"lp": ({"max_milp_sequences": 0}, {"milp_node_limit": 1000, "max_milp_sequences": 1_000_000})}


def _algorithm_options(algorithm):
    """Keyword arguments for packing.split's functions: the algorithm's options and ``polish``."""
    options, polish = ALGORITHM_OPTIONS.get(algorithm, ({}, None))
    return dict(options, polish=polish)


def pack_dataset(input_dir, output_dir, *, algorithm="lpfhp", max_sequences_per_pack=3,
                 max_sequence_length=None, max_masked_tokens_per_pack=None, seed=0, chunk_packs=8192,
                 compression="gzip", workers=1, scheduler=None, show_progress=True, verify=False):
    """The whole sharded `pack` (module doc). Returns the output manifest (a dict); with
    ``verify``, its ``verified_sequences`` says how many sequences were compared."""
    import packing
    from packing.split import global_duals, pack_polished, split_plan
    from bert_packed.data.prepare.engine import Engine

    _check_options(algorithm, max_sequences_per_pack, chunk_packs, workers, scheduler, seed)
    input_dir, output_dir = os.fspath(input_dir), os.fspath(output_dir)
    _refuse_output_in_input(input_dir, output_dir)
    manifest = _load_unpacked(input_dir)
    seq_len = int(max_sequence_length or manifest["max_sequence_length"])
    counts = _shard_histograms(input_dir, manifest, seq_len)
    options = {"algorithm": algorithm, "max_sequences_per_pack": int(max_sequences_per_pack),
               "max_sequence_length": seq_len, "max_masked_tokens_per_pack": max_masked_tokens_per_pack,
               "seed": int(seed), "compression": compression, "chunk_packs": int(chunk_packs)}
    digest = file_sha256(os.path.join(input_dir, MANIFEST))
    state = {"input_manifest_sha256": digest, "options": options}
    resuming = _check_output(output_dir, state)
    total = counts.sum(axis=0)
    _say(show_progress, f"pack: planning {int(total.sum())} sequences of {len(counts)} shards ({algorithm}) ...")
    started_at = time.perf_counter()
    try:
        histogram = packing.Histogram(total, seq_len, name=os.path.basename(os.path.abspath(input_dir)))
        result = pack_polished(histogram, algorithm, max_sequences_per_pack, seed, **_algorithm_options(algorithm))
        parts = split_plan(result.plan, list(counts))
        duals = global_duals(result)
    except packing.PackingError as exc:
        raise DataError(str(exc)) from None
    _say(show_progress, f"pack: the dataset's plan has {result.num_packs} packs"
         + (f" (LP bound {result.lp_bound_packs})" if result.lp_bound_packs else "")
         + f", {time.perf_counter() - started_at:.1f} s; now each shard's plan and file")
    inputs = shard_paths(input_dir, manifest)
    tasks = [{"index": i, "input": path, "input_sha256": entry.get(CHECKSUM),
              "output": os.path.join(output_dir, shard_name(i)), "counts": counts[i], "part": part,
              "leftover": leftover, "duals": duals, "options": options, "seed": _shard_seed(seed, i),
              "verify": bool(verify)}
             for i, (path, entry, (part, leftover)) in enumerate(zip(inputs, manifest["shards"], parts))]
    source = {"path": input_dir, "manifest_sha256": digest, "num_shards": len(inputs),
              "bytes": sum(int(entry["bytes"]) for entry in manifest["shards"])}
    started = None  # what this run made: "folder" (it created --output) or "contents" (an empty one)
    try:
        with Engine(workers=workers, scheduler=scheduler) as runner:
            runner.start(len(tasks))  # a refused --scheduler leaves nothing behind
            for task in tasks:  # a shard's own steps are shown when it runs here (not on a worker)
                task["progress"] = bool(show_progress) and runner.in_process(len(tasks))
            if not resuming:  # only now: a refused input, plan or engine leaves no directory behind
                started = "contents" if os.path.isdir(output_dir) else "folder"
                make_folder(output_dir)
                write_text_atomic(os.path.join(output_dir, STATE), json.dumps(state, indent=1, sort_keys=True) + "\n")
            entries = runner.run(pack_shard, tasks, desc="pack: shards", unit=" shards", show_progress=show_progress)
            return _finish(output_dir, entries, result, histogram, manifest, options, source, verify)
    except DataError as exc:
        if started is not None and not isinstance(exc, WriteFailed):
            _discard(output_dir, started)  # after the engine stopped: no worker writes any more
        raise


class WriteFailed(DataError):
    """Writing an output shard failed (a full disk): finished shards are kept for the rerun."""


def _discard(output_dir, started):
    """Remove what a refused run wrote: the directory it created, or the contents of the empty one."""
    if started == "folder":
        shutil.rmtree(output_dir, ignore_errors=True)
        return
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


def _say(show_progress, line):
    """A progress line on stderr (with the bars: when they are shown), above any bar."""
    if show_progress:
        tqdm.write(line, file=sys.stderr)


def _check_options(algorithm, max_sequences_per_pack, chunk_packs, workers, scheduler, seed):
    """Everything that can be refused before a file is read."""
    import packing
    from bert_packed.data.prepare.engine import check_workers

    if isinstance(max_sequences_per_pack, bool) or not isinstance(max_sequences_per_pack, int):
        raise DataError(f"--max-sequences-per-pack must be a positive integer for a sharded dataset "
                        f"(all shards share K), got {max_sequences_per_pack!r}")
    _check_depth(max_sequences_per_pack)
    if chunk_packs < 1:
        raise DataError("--chunk-packs must be at least 1")
    try:
        packing.check_algorithm_depth(algorithm, max_sequences_per_pack)
        packing.histogram.check_seed(seed)
    except packing.PackingError as exc:
        raise DataError(str(exc)) from None
    check_workers(workers, scheduler)


def _refuse_output_in_input(input_dir, output_dir):
    source, target = os.path.realpath(input_dir), os.path.realpath(output_dir)
    if target == source or target.startswith(source.rstrip(os.sep) + os.sep):
        raise DataError(f"--output {output_dir} is the input dataset {input_dir} or inside it; writing there "
                        "would mix packed shards into the input: choose a directory outside it")


def _load_unpacked(input_dir):
    """The input manifest, checked: an unpacked dataset whose shards are the files it lists."""
    manifest = load_manifest(input_dir)
    if manifest["kind"] == "packed":
        raise DataError(f"{input_dir}: this dataset is already packed; give the unpacked dataset")
    for entry, path in zip(manifest["shards"], shard_paths(input_dir, manifest)):
        with h5io.open_h5(path) as handle, h5io.read_errors(path):
            if h5io.is_packed(handle):
                raise DataError(f"{path}: this shard is already packed; give the unpacked dataset")
            rows, seq_len, _ = h5io.check_unpacked(handle, path)
        if seq_len != manifest["max_sequence_length"]:
            raise DataError(f"{path}: sequence length {seq_len}, the dataset's is {manifest['max_sequence_length']}; "
                            "shards of one dataset share it: re-create the dataset")
        histogram = entry.get("length_histogram")
        if rows != entry.get("num_items") or not isinstance(histogram, list) or sum(histogram) != rows:
            raise DataError(f"{path}: {rows} sequences, {MANIFEST} records {entry.get('num_items')} (histogram "
                            f"{sum(histogram) if isinstance(histogram, list) else 'missing'}); the shard does not "
                            "match its manifest: re-create the dataset")
    return manifest


def _shard_histograms(input_dir, manifest, seq_len):
    """np.int64 [shards, L]: each shard's length histogram from the manifest, cut to the pack
    length L (a longer sequence is refused, naming the shard)."""
    counts = np.zeros((len(manifest["shards"]), seq_len), np.int64)
    for i, entry in enumerate(manifest["shards"]):
        histogram = np.asarray(entry["length_histogram"], np.int64)
        if histogram.size != manifest["max_sequence_length"] or np.any(histogram < 0):
            raise DataError(f"{input_dir}/{MANIFEST}: shard {entry['file']}'s length histogram has "
                            f"{histogram.size} bins for sequence length {manifest['max_sequence_length']}")
        longer = np.flatnonzero(histogram[seq_len:])
        if longer.size:
            raise DataError(f"{input_dir}/{entry['file']}: has sequences of {seq_len + longer[-1] + 1} tokens, longer "
                            f"than --max-sequence-length {seq_len}; raise it")
        counts[i] = histogram[:seq_len]
    if not np.array_equal(counts.sum(axis=0), np.asarray(manifest["length_histogram"][:seq_len], np.int64)):
        raise DataError(f"{input_dir}/{MANIFEST}: the dataset's length histogram is not the sum of its shards'; "
                        "re-create the dataset")
    return counts


def _shard_seed(seed, index):
    """Shard i's own seed (its assignment's shuffle), a function of --seed and i only."""
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint32)[0])


def _check_output(output_dir, state):
    """True to resume an unfinished pack of the same input and options in ``output_dir``, False
    for a new or empty directory. Refused: a file, a complete dataset, a non-empty directory
    that is not an unfinished pack, or an unfinished pack of another input or options."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise DataError(f"--output {output_dir} exists and is not a directory; choose a new directory")
    state_path = os.path.join(output_dir, STATE)
    if os.path.isdir(output_dir):
        if os.path.exists(os.path.join(output_dir, MANIFEST)):
            raise DataError(f"--output {output_dir} already holds a complete dataset ({MANIFEST}); remove it or "
                            "choose another directory")
        names = [name for name in os.listdir(output_dir) if not name.startswith(TEMP_PREFIX)]
        if names and STATE not in names:
            raise DataError(f"--output {output_dir} is not empty and holds no unfinished pack; choose an empty "
                            "or new directory")
        if names:
            try:
                with open(state_path, encoding="utf-8") as handle:
                    saved = json.load(handle)
            except ValueError:
                saved = None
            if saved != state:
                raise DataError(f"--output {output_dir} holds an unfinished pack of another input or with other "
                                "options; rerun that command to finish it, or empty the directory")
            return True
    return False


def pack_shard(task):
    """Pack one shard (an engine task; module-level so Dask workers import it). Skips a shard
    whose output exists with the checksum it was written with (its receipt); writes it again
    otherwise. Checks it holds exactly its input's sequence lengths (and with ``verify`` its
    sequences). Returns its manifest entry."""
    output = task["output"]
    sha256 = finished_shard(output)
    entry = None if sha256 is None else _entry(output, sha256, task)
    if entry is None or entry["length_histogram"] != [int(x) for x in task["counts"]]:
        sha256 = _write_shard(task)
        write_receipt(output, sha256)
        entry = _entry(output, sha256, task)
    if entry["length_histogram"] != [int(x) for x in task["counts"]]:
        _drop(output)
        raise DataError(f"{output}: holds {entry['num_sequences']} sequences, its input {task['input']} "
                        f"{int(sum(task['counts']))} (or of other lengths); the packed shard does not add up")
    if task.get("verify"):
        expected, found = unpacked_digests(task["input"]), packed_digests(output)
        if expected != found:
            _drop(output)
            raise DataError(f"{output}: holds {len(found)} sequences, {task['input']} {len(expected)}; the "
                            "multisets of sequences differ (--verify); the shard was removed, no manifest written")
        entry["verified_sequences"] = len(found)
    return entry


def _entry(output, sha256, task):
    entry = shard_entry(output, sha256=sha256)
    with h5io.open_h5(output) as handle:
        entry["shard_plan"] = str(handle.attrs.get("shard_plan", ""))
        entry["lp_bound_packs"] = int(handle.attrs.get("shard_lp_bound_packs", 0))
    entry["source"] = os.path.basename(task["input"])
    return entry


def _drop(output):
    """Remove an output shard that failed its checks and its receipt (the rerun writes it again)."""
    for path in (receipt_path(output), output):
        if os.path.exists(path):
            os.unlink(path)


def _write_shard(task):
    """Pack the shard (module doc) and write it; returns its content checksum (sha256 hex)."""
    import packing

    options, path = task["options"], task["input"]
    seq_len, max_k = options["max_sequence_length"], options["max_sequences_per_pack"]
    progress = bool(task.get("progress"))
    started_at = time.perf_counter()
    verify_shard(path, {CHECKSUM: task.get("input_sha256")})
    with h5io.open_h5(path) as handle, h5io.read_errors(path):
        num_rows, in_seq_len, num_predictions = h5io.check_unpacked(handle, path)
        lengths, num_masked = read_lengths(handle, seq_len, path=path)
        if not np.array_equal(np.bincount(lengths, minlength=seq_len + 1)[1:], task["counts"]):
            raise DataError(f"{path}: its sequence lengths differ from the length histogram {MANIFEST} records "
                            "for it; the shard does not match its manifest: re-create the dataset")
        records = _read_records(handle, _record_dtype(min(seq_len, in_seq_len), num_predictions))
        vocab_size = handle.attrs.get("vocab_size")
    name = os.path.basename(task["output"])
    _say(progress, f"pack: {name}: {lengths.size} sequences read ({time.perf_counter() - started_at:.1f} s); "
                   f"planning ...")
    plan, which, bound = _shard_plan(task)
    _say(progress, f"pack: {name}: {which} plan, bound {bound} packs ({time.perf_counter() - started_at:.1f} s); "
                   f"writing ...")
    try:
        assignment = packing.assign(plan, lengths, seed=task["seed"])
    except packing.PackingError as exc:
        raise DataError(f"{path}: {exc}") from None
    offsets = np.asarray(assignment.pack_offsets, np.int64)
    indices = np.asarray(assignment.sequence_indices, np.int64)
    needed_m = int(np.add.reduceat(num_masked[indices], offsets[:-1]).max())
    max_m = options["max_masked_tokens_per_pack"] or needed_m
    if needed_m > max_m:
        raise DataError(f"{path}: a pack needs {needed_m} masked-token slots but --max-masked-tokens-per-pack "
                        f"is {max_m}; raise it")
    records = records[indices]  # pack order
    result = packing.PackingResult(options["algorithm"], packing.Histogram.from_lengths(lengths, seq_len), max_k,
                                   plan, 0.0)
    stats = _statistics(result, lengths, offsets.size - 1, seq_len, max_k, max_m, options["seed"],
                        options["algorithm"], path)
    stats.update({"shard_plan": which, "shard_seed": task["seed"], "shard_lp_bound_packs": bound})
    digest = hashlib.sha256()
    try:
        write_packed(task["output"], lambda r0, r1: records[r0:r1], offsets, stats,
                     chunk_packs=options["chunk_packs"], compression=options["compression"], vocab_size=vocab_size,
                     show_progress=progress, digest=digest)
    except OSError as exc:  # a full disk: finished shards are kept for the rerun
        reason = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise WriteFailed(f"{task['output']}: writing failed ({reason}); finished shards are kept: free space and "
                          "run the same command again to finish") from None
    return digest.hexdigest()


def _read_records(handle, record_dtype):
    """The whole shard as one structured array (a shard fits in memory by design)."""
    num_rows = handle["input_ids"].shape[0]
    records = np.zeros(num_rows, record_dtype)
    for name in record_dtype.names:
        data = handle[name][...]
        records[name] = data.reshape(-1) if name == "next_sentence_labels" else data[:, :record_dtype[name].shape[0]]
    return records


def _shard_plan(task):
    """(exact plan of the shard, "global" or "own", the shard's bound): ``packing.split.plan_shard``."""
    import packing
    from packing.split import plan_shard

    options = task["options"]
    try:
        return plan_shard(task["part"], task["leftover"], task["counts"], options["algorithm"],
                          options["max_sequences_per_pack"], options["seed"], duals=task.get("duals"),
                          **_algorithm_options(options["algorithm"]))
    except packing.PackingError as exc:
        raise DataError(f"{task['input']}: {exc}") from None


def _finish(output_dir, entries, result, histogram, input_manifest, options, source, verify=False):
    """Write the packed dataset's manifest (its certificate) and drop the resume state, once the
    sequences out add up to the sequences in."""
    from packing.split import sharding_summary

    sequences_out = sum(int(entry["num_sequences"]) for entry in entries)
    if sequences_out != histogram.num_sequences or sequences_out != int(input_manifest["num_sequences"]):
        raise DataError(f"{output_dir}: the packed shards hold {sequences_out} sequences, the input dataset "
                        f"{int(input_manifest['num_sequences'])}; they do not add up: no manifest written")
    verified = [entry.pop("verified_sequences", None) for entry in entries]
    num_packs = sum(entry["num_items"] for entry in entries)
    summary = sharding_summary(num_packs, result, sum(entry["lp_bound_packs"] for entry in entries))
    seq_len = options["max_sequence_length"]
    statistics = {
        "algorithm": options["algorithm"], "seed": options["seed"], "num_packs": num_packs,
        "efficiency": histogram.num_tokens / (num_packs * seq_len),
        "packing_factor": histogram.num_sequences / num_packs,
        "unpacked_efficiency": histogram.num_tokens / (histogram.num_sequences * seq_len),
        "lp_bound_packs": summary["lp_bound_packs"],
        "gap_percent": None if summary["gap"] is None else 100 * summary["gap"],
        "lp_bound_components": dict(result.details.get("bounds", {})),
        "unsharded_packs": summary["unsharded_packs"],
        "sharding_gap_percent": 100 * summary["sharding_gap"],
        # No packing whose packs stay within shards beats the sum of the shards' own bounds.
        "shards_lp_bound_packs": summary["shards_lp_bound_packs"],
        "gap_to_shards_bound_percent": 100 * summary["gap_to_shards_bound"],
        "shards_on_global_plan": sum(entry["shard_plan"] == "global" for entry in entries),
        "input_options": dict(input_manifest.get("options", {}))}
    manifest = write_manifest(output_dir, kind="packed", shards=entries, options=options, inputs=[source],
                              **statistics)
    remove_receipts(output_dir)
    state = os.path.join(output_dir, STATE)
    if os.path.exists(state):
        os.unlink(state)
    if verify:
        manifest = dict(manifest, verified_sequences=int(sum(verified)))
    return manifest


# -- verification: every sequence of the unpacked dataset, exactly once in the packed one ---

def verify_packed_dataset(unpacked_dir, packed_dir):
    """Raise DataError unless the packed dataset holds exactly the unpacked dataset's sequences
    (multisets of digests, as `verify_packed_file`), shard by shard: a packed shard is made from
    the unpacked shard of its `source`, so each pair must agree (a stricter check than the whole
    multiset, and one shard's digests in memory at a time). Returns the number of sequences."""
    before, after = load_manifest(unpacked_dir), load_manifest(packed_dir)
    if after["kind"] != "packed" or before["kind"] != "unpacked":
        raise DataError(f"verify needs an unpacked dataset and a packed one, got {before['kind']} and {after['kind']}")
    sources = {entry["file"]: path for entry, path in zip(before["shards"], shard_paths(unpacked_dir, before))}
    used = [entry.get("source") for entry in after["shards"]]
    if sorted(used) != sorted(sources):
        raise DataError(f"{packed_dir}: its shards come from {len(used)} source shard(s), {unpacked_dir} has "
                        f"{len(sources)}; the datasets differ")
    total = 0
    for entry, path in zip(after["shards"], shard_paths(packed_dir, after)):
        expected, found = unpacked_digests(sources[entry["source"]]), packed_digests(path)
        if expected != found:
            raise DataError(f"{path}: holds {len(found)} sequences, {sources[entry['source']]} {len(expected)}; "
                            "the multisets of sequences differ")
        total += len(found)
    return total
