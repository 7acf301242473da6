"""The sharded `create` (`--output DIR`): layout and manifest, byte-identical output whatever the
engine (in-process, a LocalCluster, a real TCP Dask cluster), resume, the four input formats,
and blocks that never split or repeat a document. Tiny corpora keep it fast."""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bert_packed.data import DataError
from bert_packed.data.prepare import formats as corpus
from bert_packed.data.prepare import create_shards as cs
from bert_packed.data.shards import load_manifest, shard_paths
from bert_packed.data.prepare.vocab import train_vocab
from test_data_create import check_layout_and_masking, synthetic_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINNED = [492, 103, 897, 533, 318, 131, 968, 275]  # document_shards(12345, 7, 8, 1000) on the day it was written
OPTIONS = dict(max_seq_length=64, max_predictions=10, dupe_factor=2, seed=5, output_shards=3, block_bytes=3000)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    text = synthetic_corpus(folder / "corpus.txt", num_documents=40)
    vocab = folder / "vocab.txt"
    train_vocab(text, 300, vocab)
    return folder, text, vocab


@pytest.fixture(scope="module")
def reference(corpus_dir):
    """One in-process run: the bytes every other engine must reproduce."""
    folder, text, vocab = corpus_dir
    output = folder / "reference"
    summary = cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    return output, summary


def contents(directory):
    """{file name: bytes} of a finished dataset (nothing else may be left, .work included)."""
    names = sorted(os.listdir(directory))
    return {name: open(os.path.join(directory, name), "rb").read() for name in names}


def test_shards_hold_the_algorithms_rows_and_a_matching_manifest(corpus_dir, reference):
    _, text, vocab = corpus_dir
    output, summary = reference
    manifest = load_manifest(output)
    assert sorted(os.listdir(output)) == ["manifest.json", "shard-00000.h5", "shard-00001.h5", "shard-00002.h5"]
    assert manifest["kind"] == "unpacked" and manifest["num_shards"] == 3 and manifest["max_predictions_per_seq"] == 10
    assert manifest["num_documents"] == summary["num_documents"] == 40
    assert manifest["options"]["seed"] == 5 and manifest["options"]["dupe_factor"] == 2
    assert manifest["inputs"] == [{"path": str(text), "bytes": os.path.getsize(text), "format": "lines"}]
    assert manifest["vocab"]["file"] == "vocab.txt" and manifest["vocab"]["bytes"] == os.path.getsize(vocab)
    rows = 0
    for path, entry in zip(shard_paths(output, manifest), manifest["shards"]):
        with h5py.File(path, "r") as handle:
            arrays = {name: handle[name][:] for name in handle}
        check_layout_and_masking(arrays, 64, 10, manifest["vocab"]["num_tokens"])
        assert entry["num_sequences"] == len(arrays["input_ids"]) > 0
        rows += len(arrays["input_ids"])
    assert rows == manifest["num_sequences"] == summary["num_sequences"]
    # Documents are spread over the shards, and random-next pairs are about half.
    assert 0.35 < summary["random_next_fraction"] < 0.65


def test_two_local_workers_write_the_same_bytes(corpus_dir, reference, tmp_path):
    _, text, vocab = corpus_dir
    cs.create_shards([text], vocab, tmp_path / "two", workers=2, **OPTIONS)
    assert contents(tmp_path / "two") == contents(reference[0])


def _doubled_unless_negative(value):
    if value < 0:
        raise DataError(f"task {value}: refused")
    return 2 * value


def test_the_engine_returns_results_in_task_order_and_re_raises_a_tasks_error_as_it_is():
    """Results come back in batches as tasks finish (as_completed with_results) and land in task
    order; a worker's DataError reaches the caller with its type and its one line."""
    assert cs.engine.run_tasks(_doubled_unless_negative, range(200), workers=2) == [2 * i for i in range(200)]
    with pytest.raises(DataError) as error:
        cs.engine.run_tasks(_doubled_unless_negative, [1, 2, -3, 4], workers=2)
    assert str(error.value) == "task -3: refused"


def _log_an_error(name):
    import logging

    logging.getLogger(name).error("an error logged by a worker")


def test_a_local_clusters_workers_log_nothing_once_it_starts_to_stop(capfd):
    """Dask issue 7105: a heartbeat in flight as a local cluster closes prints an error and a
    traceback after a job that succeeded. Before closing, the engine quiets every worker process
    (their stderr is this process's); until then a worker's error is printed (the check can fail).
    The scheduler and nannies run in this process, quiet while the cluster stops, then put back."""
    import logging

    import distributed  # noqa: F401  (importing it sets the level that must be put back)

    level = logging.getLogger("distributed").level
    with cs.engine.Engine(workers=2) as runner:
        assert runner.run(abs, [-1, -2]) == [1, 2]
        client = runner._client
        client.run(_log_an_error, "distributed.worker")
        time.sleep(0.2)
        assert capfd.readouterr().err.count("an error logged by a worker") == 2
        cs.engine._quiet_for_shutdown(client)
        client.run(_log_an_error, "distributed.worker")
        time.sleep(0.2)
        assert "an error logged by a worker" not in capfd.readouterr().err
    assert logging.getLogger("distributed").level == level


def test_local_workers_keep_glibcs_adaptive_malloc_and_one_thread_each(monkeypatch):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_ in its workers, which turns off glibc's adaptive
    mmap threshold (shard writing 1.3x slower); our local cluster drops it and pins the threads."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    names = ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "RAYON_NUM_THREADS", "OMP_NUM_THREADS"]
    seen = cs.engine.run_tasks(os.getenv, names + names, workers=2)
    assert seen == [None, None, "1", "1"] * 2


def _timers(dask_worker=None, dask_scheduler=None):
    """A server's periodic callbacks that wake it most: the profiler's, "tick" and "monitor" (ms)."""
    server = dask_worker if dask_worker is not None else dask_scheduler
    return {name: callback.callback_time for name, callback in server.periodic_callbacks.items()
            if name.startswith("profile") or name in ("tick", "monitor")}


def test_local_workers_run_without_dasks_sampling_profiler_and_frequent_timers():
    """A local cluster serves no dashboard, so its workers' 10 ms stack sampler (about 4 % of a
    2-worker `create`) is off, and every server's event-loop tick (20 ms) and system monitor
    (0.5 s) slow down (QUIET_LOCAL_CLUSTER): workers, nannies and the scheduler. A cluster
    started with Dask's defaults has them all (the check can fail)."""
    from dask.distributed import Client, LocalCluster

    quiet = {"tick": 1000, "monitor": 5000}
    with cs.engine.Engine(workers=2) as runner:
        assert runner.run(abs, [-1, -2]) == [1, 2]
        client = runner._client
        assert list(client.run(_timers).values()) == [quiet, quiet]
        assert list(client.run(_timers, nanny=True).values()) == [quiet, quiet]
        assert client.run_on_scheduler(_timers) == quiet
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=0) as cluster, Client(cluster) as client:
        default = {"tick": 20, "monitor": 500}
        assert list(client.run(_timers).values()) == [{**default, "profile": 10, "profile-cycle": 1000}]
        assert list(client.run(_timers, nanny=True).values()) == [default]
        assert client.run_on_scheduler(_timers) == default


def test_workers_of_an_existing_cluster_with_dasks_malloc_setting_get_a_one_line_hint(capsys, monkeypatch):
    """A cluster started with Dask's defaults (its nanny sets MALLOC_TRIM_THRESHOLD_) works, and the
    user is told once how to make it faster, naming what is set (any malloc threshold turns off
    glibc's adaptive one); a cluster without the setting gets no note. (A nanny also sets the
    variables in the process that starts it: they are cleared before each cluster.)"""
    from dask.distributed import LocalCluster

    for nanny_env, expected in (({}, ""), ({"MALLOC_TRIM_THRESHOLD_": 65536}, "note: 1 of 1 Dask workers run with "
                                                                             "MALLOC_TRIM_THRESHOLD_ set"),
                                ({"MALLOC_MMAP_THRESHOLD_": 131072}, "note: 1 of 1 Dask workers run with "
                                                                     "MALLOC_MMAP_THRESHOLD_ set")):
        import dask.config

        for name in cs.engine.MALLOC_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        with dask.config.set({"distributed.nanny.pre-spawn-environ": nanny_env}):
            cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                   memory_limit=0)
        with cluster:
            assert cs.engine.run_tasks(abs, [-1, -2], scheduler=cluster.scheduler_address) == [1, 2]
        err = capsys.readouterr().err
        assert err.startswith(expected) and ("--no-nanny" in err) == bool(expected), err
        assert err.count("\n") == bool(expected)


def _start(argv, log):
    env = dict(os.environ, PYTHONPATH=ROOT, **cs.engine.WORKER_ENV)
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=os.path.dirname(ROOT) or "/")


def _wait_for_address(scheduler_file, process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the scheduler exited"
        if os.path.exists(scheduler_file):
            try:
                with open(scheduler_file) as handle:
                    return json.load(handle)["address"]
            except (ValueError, KeyError):
                pass
        time.sleep(0.2)
    raise AssertionError("the scheduler wrote no address")


def _wait_for_workers(address, count, timeout=60):
    from dask.distributed import Client

    with Client(address, timeout="20s") as client:
        client.wait_for_workers(count, timeout=timeout)


def _executed_per_worker(address):
    from dask.distributed import Client

    with Client(address, timeout="20s") as client:
        # A lambda travels by value (this test module is not importable on the workers).
        return sorted(client.run(lambda dask_worker: dask_worker.state.executed_count).values())


def test_a_real_tcp_cluster_writes_the_same_bytes(corpus_dir, reference, tmp_path):
    """A scheduler and two single-threaded workers over TCP on 127.0.0.1, started and stopped
    here (only these three processes: --no-nanny keeps each worker one process)."""
    _, text, vocab = corpus_dir
    scheduler_file = str(tmp_path / "scheduler.json")
    processes = []
    try:
        with open(tmp_path / "cluster.log", "w") as log:
            scheduler = _start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                                "--no-dashboard", "--scheduler-file", scheduler_file], log)
            processes.append(scheduler)
            address = _wait_for_address(scheduler_file, scheduler)
            assert address.startswith("tcp://127.0.0.1:")
            for _ in range(2):
                processes.append(_start(["distributed.cli.dask_worker", address, "--nthreads", "1", "--no-nanny",
                                         "--no-dashboard", "--host", "127.0.0.1", "--memory-limit", "0"], log))
            _wait_for_workers(address, 2)
            result = subprocess.run(
                [sys.executable, "-m", "bert_packed.data", "create", "--input", str(text), "--vocab", str(vocab),
                 "--output", str(tmp_path / "tcp"), "--max-seq-length", "64", "--max-predictions", "10",
                 "--dupe-factor", "2", "--seed", "5", "--output-shards", "3", "--block-bytes", "3000",
                 "--scheduler", address], capture_output=True, text=True, cwd=ROOT)
            executed = _executed_per_worker(address)
        assert result.returncode == 0, result.stderr + open(tmp_path / "cluster.log").read()[-3000:]
        assert len(executed) == 2 and sum(executed) >= 4, executed  # the tasks ran on the cluster's workers
        assert result.stdout.startswith(f"wrote {tmp_path / 'tcp'}: ")
        assert contents(tmp_path / "tcp") == contents(reference[0])
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
        for process in reversed(processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_rerun_after_a_failure_skips_finished_blocks_and_shards(corpus_dir, reference, tmp_path, monkeypatch):
    _, text, vocab = corpus_dir
    output = tmp_path / "resumed"
    real_write = cs._write_instances
    written = []

    def fail_on_the_second_shard(path, *args):
        if written:
            raise RuntimeError("simulated crash")
        written.append(path)
        real_write(path, *args)

    monkeypatch.setattr(cs, "_write_instances", fail_on_the_second_shard)
    with pytest.raises(RuntimeError, match="simulated crash"):
        cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    assert sorted(os.listdir(output)) == [".work", "shard-00000.h5"]  # no half-written shard, no manifest
    first = os.stat(output / "shard-00000.h5")

    def no_tokenising(task):
        raise AssertionError("a finished block was tokenised again")

    monkeypatch.setattr(cs, "_write_instances", real_write)
    monkeypatch.setattr(cs, "_tokenise", no_tokenising)
    cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    assert os.stat(output / "shard-00000.h5").st_mtime_ns == first.st_mtime_ns  # kept, not rewritten
    assert contents(output) == contents(reference[0])


def _stopped_before_the_first_shard(text, vocab, output, monkeypatch):
    """A create stopped at the start of phase B: every block finished, no shard; its block files."""
    def crash(*args):
        raise RuntimeError("simulated crash")

    with monkeypatch.context() as patch:
        patch.setattr(cs, "_write_instances", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    return sorted((output / ".work" / "blocks").iterdir())


def _other_tokens(data):
    """The same block with one token changed in place: same size, valid header, other content."""
    data = bytearray(data)
    data[-40] ^= 1  # a token byte (the last 32 bytes are the checksum trailer)
    return bytes(data)


@pytest.mark.parametrize("damage", ["cut", "overwritten", "lengthened", "other tokens", "another block"])
def test_a_damaged_or_replaced_block_file_is_tokenised_again(corpus_dir, reference, tmp_path, monkeypatch, damage):
    """A finished block is reused on a rerun only when its checksum (over its task and its bytes)
    holds: one cut short, longer than its header says, zeroed, changed in place at the same size,
    or replaced by another block's file is tokenised again, and the shards equal an uninterrupted
    run's."""
    _, text, vocab = corpus_dir
    output = tmp_path / "out"
    blocks = _stopped_before_the_first_shard(text, vocab, output, monkeypatch)
    assert len(blocks) > 2 and [b.name for b in blocks] == [f"block-{i:06d}.bin" for i in range(len(blocks))]
    data = blocks[1].read_bytes()
    blocks[1].write_bytes({"cut": data[:-4], "overwritten": b"\x00" * len(data), "lengthened": data + data[-4:],
                           "other tokens": _other_tokens(data), "another block": blocks[2].read_bytes()}[damage])
    tokenised, tokenise = [], cs._tokenise
    monkeypatch.setattr(cs, "_tokenise", lambda task: tokenised.append(task["index"]) or tokenise(task))
    cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    assert tokenised == [1]  # that block again, the others reused
    assert contents(output) == contents(reference[0])


def test_blocks_of_the_earlier_layout_are_tokenised_again_on_the_rerun(corpus_dir, reference, tmp_path, monkeypatch):
    """An unfinished job from before blocks were single files (a directory of four .npy files per
    block) finishes with the same bytes: those directories are removed and the blocks remade."""
    _, text, vocab = corpus_dir
    output = tmp_path / "out"
    blocks = _stopped_before_the_first_shard(text, vocab, output, monkeypatch)
    for block in blocks:
        block.unlink()
        block.with_suffix("").mkdir()
        np.save(block.with_suffix("") / "tokens.npy", np.arange(3, dtype=np.int32))
    tokenised, tokenise = [], cs._tokenise
    left = lambda: sorted(path.name for path in blocks[0].parent.iterdir())  # noqa: E731
    monkeypatch.setattr(cs, "_tokenise", lambda task: tokenised.append((task["index"], left())) or tokenise(task))
    cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    # The old directories went before the first block was tokenised (no two copies on disk).
    assert tokenised == [(i, [b.name for b in blocks[:i]]) for i in range(len(blocks))]
    assert contents(output) == contents(reference[0])


def test_a_rerun_with_other_options_is_refused_and_an_empty_dir_is_fine(corpus_dir, tmp_path, monkeypatch):
    _, text, vocab = corpus_dir
    output = tmp_path / "job"
    output.mkdir()  # an existing empty directory is a fine output
    monkeypatch.setattr(cs, "write_shard", _crash)
    with pytest.raises(RuntimeError):
        cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    with pytest.raises(DataError, match=r"holds an unfinished create of another job \(its options differ\)"):
        cs.create_shards([text], vocab, output, workers=1, **dict(OPTIONS, seed=6))


def _crash(task):
    raise RuntimeError("crash")


def test_default_shard_count_follows_the_input_size(corpus_dir, tmp_path):
    _, text, vocab = corpus_dir
    options = dict(OPTIONS, output_shards=None)
    summary = cs.create_shards([text], vocab, tmp_path / "default", workers=1, **options)
    assert summary["num_shards"] == 1  # a few kB of text: one shard (one per ~4 MiB)
    assert load_manifest(tmp_path / "default")["options"]["num_shards"] == 1


# ---------------------------------------------------------------------------------------------- formats

DOCUMENTS = [["Mr. Smith went to Washington.", "He arrived at 3 p.m. on Monday."],
             ["The U.S. economy grew by 2.5 percent.", "Analysts were surprised."],
             ["One lonely sentence here."]]


def write_formats(folder):
    """The same three documents in each format (paragraphs of two sentences where there are
    paragraphs); returns {format: path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"lines": folder / "a.txt", "wikiextractor": folder / "wiki_00", "jsonl": folder / "c.jsonl",
             "parquet": folder / "d.parquet"}
    paths["lines"].write_text("\n\n".join("\n".join(doc) for doc in DOCUMENTS) + "\n")
    paths["wikiextractor"].write_text("".join(
        f'<doc id="{i}" url="https://x/?curid={i}" title="Title {i}">\nTitle {i}\n\n{" ".join(doc)}\n</doc>\n'
        for i, doc in enumerate(DOCUMENTS)))
    texts = ["\n".join(doc) if len(doc) > 1 else doc[0] for doc in DOCUMENTS]
    paths["jsonl"].write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), paths["parquet"], row_group_size=2)
    return paths


def read_all(path, fmt, block_bytes=1 << 30, text_column="text"):
    return [doc for start, stop in corpus.plan_blocks(str(path), fmt, block_bytes, text_column)
            for doc in corpus.read_block(str(path), fmt, start, stop, text_column)]


def test_parquet_text_is_counted_uncompressed_for_the_shard_count(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["a" * 100_000, "b" * 100_000]}), path, row_group_size=1)
    assert os.path.getsize(path) < 20_000 < 200_000 <= corpus.text_bytes(str(path), "parquet")


@pytest.mark.parametrize("fmt", corpus.FORMATS)
def test_each_format_is_detected_and_read_as_its_documents(tmp_path, fmt):
    path = write_formats(tmp_path)[fmt]
    assert corpus.detect_format(str(path)) == fmt
    assert read_all(path, fmt) == DOCUMENTS  # titles dropped, abbreviations and decimals kept whole


def test_a_directory_of_mixed_formats_makes_one_dataset(corpus_dir, tmp_path):
    _, _, vocab = corpus_dir
    write_formats(tmp_path / "in" / "sub")
    summary = cs.create_shards([tmp_path / "in"], vocab, tmp_path / "out", workers=1, **OPTIONS)
    assert summary["num_documents"] == 4 * len(DOCUMENTS)
    manifest = load_manifest(tmp_path / "out")
    assert [x["format"] for x in manifest["inputs"]] == ["lines", "jsonl", "parquet", "wikiextractor"]


def test_inputs_expand_globs_and_directories_in_sorted_order(tmp_path):
    for name in ["b/2.txt", "b/1.txt", "a.txt", "b/.hidden", "c/x.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    found = corpus.expand_inputs([str(tmp_path / "b"), str(tmp_path / "*.txt"), str(tmp_path / "b" / "1.txt")])
    assert found == [str(tmp_path / "b" / "1.txt"), str(tmp_path / "b" / "2.txt"), str(tmp_path / "a.txt")]


def test_a_forced_format_and_another_text_column(tmp_path):
    path = tmp_path / "records.txt"
    path.write_text(json.dumps({"body": "First one. Second one."}) + "\n")
    assert corpus.detect_format(str(path)) == "jsonl"
    assert corpus.detect_format(str(path), "lines") == "lines"
    assert read_all(path, "jsonl", text_column="body") == [["First one.", "Second one."]]


# ---------------------------------------------------------------------------------------------- blocks

sentence = st.text(alphabet="abc ", min_size=1, max_size=12).map(lambda s: s.strip() or "w")
documents = st.lists(st.lists(sentence, min_size=1, max_size=5), min_size=1, max_size=8)


def _render(fmt, docs, gaps):
    if fmt == "lines":
        return "".join("\n".join(doc) + "\n" + "\n" * gap + ("\r\n" if gap > 1 else "")
                       for doc, gap in zip(docs, gaps))
    if fmt == "wikiextractor":
        return "".join(f'<doc id="{i}">\nT\n' + "\n".join(doc) + "\n" + "\n" * gap + "</doc>\n"
                       for i, (doc, gap) in enumerate(zip(docs, gaps)))
    return "".join(json.dumps({"text": "\n".join(doc)}) + "\n" + "\n" * gap for doc, gap in zip(docs, gaps))


@settings(max_examples=40, deadline=None)
@given(docs=documents, gaps=st.lists(st.integers(1, 3), min_size=8, max_size=8),
       block_bytes=st.integers(1, 200), fmt=st.sampled_from(["lines", "wikiextractor", "jsonl"]))
def test_blocks_never_split_or_repeat_a_document(tmp_path_factory, docs, gaps, block_bytes, fmt):
    path = tmp_path_factory.mktemp("blocks") / "corpus"
    path.write_bytes(_render(fmt, docs, gaps).encode())
    whole = read_all(path, fmt)
    blocks = corpus.plan_blocks(str(path), fmt, block_bytes)
    assert blocks[0][0] == 0 and blocks[-1][1] == os.path.getsize(path)
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # contiguous, no gap, no overlap
    assert read_all(path, fmt, block_bytes) == whole
    if fmt == "lines":
        assert whole == [[s for s in doc] for doc in docs]
    assert len(whole) == len(docs)


def test_documents_spread_evenly_and_stably_over_shards():
    """The assignment is a fixed hash: the same (seed, block) gives the same shards on any
    machine (pinned values), and a large block fills 16 shards about evenly."""
    assert cs.document_shards(12345, 7, 8, 1000).tolist() == PINNED
    counts = np.bincount(cs.document_shards(1, 0, 160_000, 16), minlength=16)
    assert counts.min() > 9_500 and counts.max() < 10_500
    assert cs.document_shards(1, 1, 100, 16).tolist() != cs.document_shards(1, 0, 100, 16).tolist()
    assert cs.document_shards(-3, 0, 5, 4).min() >= 0


def test_many_block_sizes_give_the_same_shards_statistics(corpus_dir, tmp_path):
    """The blocks change which shard a document goes to, never the documents read."""
    _, text, vocab = corpus_dir
    counts = set()
    for block_bytes in (97, 1000, 1 << 20):
        summary = cs.create_shards([text], vocab, tmp_path / str(block_bytes), workers=1,
                                   **dict(OPTIONS, block_bytes=block_bytes))
        counts.add(summary["num_documents"])
    assert counts == {40}


def test_block_arrays_group_documents_by_shard(tmp_path):
    """Phase A's layout: the documents of shard k are the k-th run, each keeping its sentences."""
    tokens = np.arange(10, dtype=np.int32)
    sentence_lengths = np.array([2, 1, 3, 4])
    document_sizes = np.array([1, 2, 1])  # documents: [0 1] / [2] [3 4 5] / [6 7 8 9]
    task = {"options": {"num_shards": 2, "seed": 0}, "index": 0}
    arrays = cs._group_by_shard(tokens, sentence_lengths, document_sizes, task)
    shard_of = cs.document_shards(0, 0, 3, 2)
    expected_docs = [d for k in (0, 1) for d in range(3) if shard_of[d] == k]
    pieces = {0: [[0, 1]], 1: [[2], [3, 4, 5]], 2: [[6, 7, 8, 9]]}
    flat = [t for d in expected_docs for s in pieces[d] for t in s]
    assert arrays["tokens"].tolist() == flat
    assert arrays["shard_ends"].tolist() == np.cumsum(np.bincount(shard_of, minlength=2)).tolist()
    assert arrays["document_ends"].tolist() == np.cumsum([len(pieces[d]) for d in expected_docs]).tolist()


def test_a_killed_create_resumes_to_the_same_bytes(corpus_dir, tmp_path):
    """SIGKILL in the middle of phase B (no clean-up runs); the same command finishes the job."""
    _, _, vocab = corpus_dir
    text = synthetic_corpus(tmp_path / "bigger.txt", num_documents=400, seed=3)
    argv = [sys.executable, "-m", "bert_packed.data", "create", "--input", str(text), "--vocab", str(vocab),
            "--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "3", "--seed", "5",
            "--output-shards", "16", "--block-bytes", "20000", "--workers", "1", "--no-progress"]
    output = tmp_path / "killed"
    process = subprocess.Popen(argv + ["--output", str(output)], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (output / "shard-00002.h5").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.kill()
    process.wait()
    assert not (output / "manifest.json").exists(), "the run finished before it could be killed"
    finished = {name: os.stat(output / name).st_mtime_ns for name in os.listdir(output) if name.startswith("shard-")}
    assert len(finished) >= 3
    (output / ".tmp-otherhost.1.abcshard-00009.h5").write_bytes(b"half")  # a writer killed on another machine
    result = subprocess.run(argv + ["--output", str(output)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert all(os.stat(output / name).st_mtime_ns == mtime for name, mtime in finished.items())
    cs.create_shards([text], vocab, tmp_path / "clean", workers=1, max_seq_length=64, max_predictions=10,
                     dupe_factor=3, seed=5, output_shards=16, block_bytes=20000)
    assert contents(output) == contents(tmp_path / "clean")


def test_a_second_create_on_the_same_directory_is_refused(corpus_dir, tmp_path, monkeypatch):
    from bert_packed.io.files import DirectoryLock

    _, text, vocab = corpus_dir
    output = tmp_path / "busy"
    monkeypatch.setattr(cs, "write_shard", _crash)
    with pytest.raises(RuntimeError):
        cs.create_shards([text], vocab, output, workers=1, **OPTIONS)
    monkeypatch.undo()
    with DirectoryLock(output / ".work"):
        with pytest.raises(DataError, match=rf"^--output {output} is being written by another create \(pid \d+ on "):
            cs.create_shards([text], vocab, output, workers=1, **OPTIONS)


def test_every_shard_is_a_file_that_pack_takes_as_it_is(reference, tmp_path):
    """Shards keep the NVIDIA/MLPerf layout of the one-file create, so the file tools read them."""
    from bert_packed.data.prepare.pack import pack_file

    output, _ = reference
    manifest = load_manifest(output)
    stats = pack_file(shard_paths(output, manifest)[0], tmp_path / "packed.h5", algorithm="lpfhp",
                      max_sequences_per_pack=3, show_progress=False)
    assert stats["num_sequences"] == manifest["shards"][0]["num_sequences"]
