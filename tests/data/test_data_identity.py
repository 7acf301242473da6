"""Identity by content on the data path (issue 46, items 2 and 4): shards carry a checksum and a
rerun, `pack` and a resume compare it, not names or sizes; a failed or refused command leaves
nothing that looks finished or blocks the rerun; `--scheduler` has a deadline; Ctrl-C with
workers is one line."""
import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest

from bert_packed.data import DataError
from bert_packed.data.prepare import engine
from bert_packed.data.prepare import pack_shards as ps
from bert_packed.data.__main__ import main as data_main
from bert_packed.data.prepare.pack_shards import STATE, pack_dataset
from bert_packed.data.shards import MANIFEST, load_manifest, shard_entry, shard_name, write_manifest
from bert_packed.io.files import file_sha256
from bert_packed.data.sharded import ShardedSource, dataset_identity
from bert_packed.data.prepare.vocab import train_vocab
from hostile import assert_unchanged, main_error, snapshot
from test_data_create import synthetic_corpus
from test_data_pack_shards import digests, make_unpacked_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACK = dict(algorithm="lpfhp", max_sequences_per_pack=3, workers=1, show_progress=False)


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    return make_unpacked_dir(tmp_path_factory.mktemp("identity") / "train", (300, 200, 250))


@pytest.fixture(scope="module")
def packed(unpacked, tmp_path_factory):
    output = tmp_path_factory.mktemp("identity_packed") / "packed"
    pack_dataset(unpacked, output, seed=4, **PACK)
    return output


@pytest.fixture
def work(unpacked, tmp_path):
    shutil.copytree(unpacked, tmp_path / "train")
    return tmp_path / "train"


def outputs(folder):
    """{name: sha256} of the dataset's files (receipts and state are the job's, not the data)."""
    return {name: digest for name, digest in digests(folder).items() if not name.startswith(".")}


# -- the manifest's checksum ---------------------------------------------------------------------


def test_every_shard_entry_carries_the_checksum_of_its_bytes(unpacked, packed):
    for folder in (unpacked, packed):
        manifest = load_manifest(folder)
        for entry in manifest["shards"]:
            assert entry["sha256"] == file_sha256(folder / entry["file"])
        assert sorted(os.listdir(folder)) == [MANIFEST] + [shard_name(i) for i in range(3)]  # no receipt left


def test_a_create_manifest_records_the_checksums_of_its_shards(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.txt", num_documents=12)
    train_vocab(corpus, 200, tmp_path / "vocab.txt")
    assert data_main(["create", "--input", str(corpus), "--vocab", str(tmp_path / "vocab.txt"), "--output",
                      str(tmp_path / "out"), "--max-seq-length", "64", "--dupe-factor", "1", "--workers", "1",
                      "--output-shards", "2", "--no-progress"]) == 0
    manifest = load_manifest(tmp_path / "out")
    assert [entry["sha256"] for entry in manifest["shards"]] == [
        file_sha256(tmp_path / "out" / shard_name(i)) for i in range(2)]
    assert sorted(os.listdir(tmp_path / "out")) == [MANIFEST, shard_name(0), shard_name(1)]


# -- a resume compares content -------------------------------------------------------------------


def test_a_resume_on_the_dataset_repacked_with_another_seed_is_refused(unpacked, tmp_path):
    """Same shard names, sizes and rows (uncompressed, a fixed M), other packs: the checkpoint's
    dataset identity differs, and the resume is refused in one line."""
    options = dict(PACK, compression="none", max_masked_tokens_per_pack=60)
    first = pack_dataset(unpacked, tmp_path / "a", seed=1, **options)
    second = pack_dataset(unpacked, tmp_path / "b", seed=2, **options)
    same = [[entry[key] for key in ("file", "bytes", "num_items")] for entry in first["shards"]]
    assert same == [[entry[key] for key in ("file", "bytes", "num_items")] for entry in second["shards"]]
    assert [e["sha256"] for e in first["shards"]] != [e["sha256"] for e in second["shards"]]
    dims = dict(max_sequence_length=128, max_sequences_per_pack=3, max_masked_tokens_per_pack=60, micro_batch_size=4,
                seed=3)
    source = ShardedSource(tmp_path / "a", **dims)
    iterator = iter(source)
    for _ in range(5):
        next(iterator)
    state = source.state_dict()
    source.close()
    other = ShardedSource(tmp_path / "b", **dims)
    with pytest.raises(DataError) as error:
        other.load_state_dict(state)
    message = str(error.value)
    assert "\n" not in message and "differ in content" in message and "resume with the same dataset" in message
    other.close()
    # The same dataset resumes.
    again = ShardedSource(tmp_path / "a", **dims)
    again.load_state_dict(state)
    again.close()


def test_a_manifest_without_checksums_keeps_the_identity_it_had():
    """Checkpoints of datasets written before checksums still resume on them."""
    manifest = {"shards": [{"file": shard_name(0), "bytes": 10, "num_items": 3}]}
    import hashlib
    digest = hashlib.sha256(json.dumps([[shard_name(0), 10, 3]]).encode()).hexdigest()[:16]
    assert dataset_identity(manifest) == {"num_shards": 1, "num_items": 3, "digest": digest}


# -- pack compares content -----------------------------------------------------------------------


def _interrupted_pack(unpacked, output, monkeypatch, seed=4):
    """A pack stopped (Ctrl-C) before its last shard: shards 0 and 1 finished."""
    real = ps.pack_shard

    def stop_at_2(task):
        if task["index"] == 2:
            raise KeyboardInterrupt
        return real(task)

    with monkeypatch.context() as patch:
        patch.setattr(ps, "pack_shard", stop_at_2)
        with pytest.raises(KeyboardInterrupt):
            pack_dataset(unpacked, output, seed=seed, **PACK)


@pytest.mark.parametrize("damage", ["copy of another shard", "copy with its receipt", "changed in place"])
def test_a_rerun_packs_again_a_shard_that_lost_its_checksum(unpacked, packed, tmp_path, monkeypatch, damage):
    """A finished output shard replaced by another shard's copy (with or without the receipt), or
    changed in place at the same size, is never counted: the rerun writes it again and the result
    equals an uninterrupted run's."""
    output = tmp_path / "out"
    _interrupted_pack(unpacked, output, monkeypatch)
    target = output / shard_name(1)
    if damage.startswith("copy"):
        shutil.copyfile(output / shard_name(0), target)
        if damage == "copy with its receipt":
            shutil.copyfile(output / f".{shard_name(0)}.sha256", output / f".{shard_name(1)}.sha256")
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    written = []
    real = ps._write_shard
    monkeypatch.setattr(ps, "_write_shard", lambda task: written.append(task["index"]) or real(task))
    manifest = pack_dataset(unpacked, output, seed=4, **PACK)
    assert written == [1, 2]  # shard 0 reused, 1 written again, 2 finished
    assert manifest["num_sequences"] == 750
    assert outputs(output) == outputs(packed)


def test_an_input_shard_changed_at_the_same_size_is_refused(work, tmp_path, capsys):
    path = work / shard_name(1)
    size = os.path.getsize(path)
    with h5py.File(path, "r+") as handle:  # an attribute rewritten in place: same size, other bytes
        handle.attrs["seed"] = int(handle.attrs.get("seed", 0)) + 1
    assert os.path.getsize(path) == size
    before = snapshot(work)
    code, line = main_error(capsys, ["pack", "--input", str(work), "--output", str(tmp_path / "out"), "--workers",
                                     "1", "--no-progress"], entry=data_main)
    assert code == 2 and line.startswith(f"error: {path}: its content differs from the checksum manifest.json "
                                         "records for it"), line
    assert_unchanged(before, work)
    assert not (tmp_path / "out").exists()


def test_sequences_in_and_out_that_do_not_add_up_are_an_error(unpacked, packed, tmp_path):
    """The last check before the manifest: the packed shards' sequences against the input's."""
    manifest = load_manifest(packed)
    entries = [dict(entry) for entry in manifest["shards"]]
    entries[1]["num_sequences"] += 1
    output = tmp_path / "out"
    shutil.copytree(packed, output)
    os.unlink(output / MANIFEST)
    import packing
    histogram = packing.Histogram(np.asarray(manifest["length_histogram"], np.int64), 128)
    with pytest.raises(DataError, match="the packed shards hold 751 sequences, the input dataset 750; they do not "
                                        "add up: no manifest written"):
        ps._finish(output, entries, None, histogram, load_manifest(unpacked), manifest["options"], {})
    assert not (output / MANIFEST).exists()


# -- verify or nothing ---------------------------------------------------------------------------


def _drops_a_sequence(real):
    """``write_packed`` that writes the file, then loses one sequence of it (a fault of the writer)."""
    def write(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        with h5py.File(path, "r+") as handle:
            weights = handle["nsp_weights"][:]
            row = int(np.argmax(weights.sum(axis=1) >= 2))
            weights[row, 1] = 0
            handle["nsp_weights"][...] = weights
        return result
    return write


def test_a_failed_verify_leaves_no_manifest_and_the_rerun_finishes(work, packed, tmp_path, capsys, monkeypatch):
    output = tmp_path / "out"
    before = snapshot(work)
    argv = ["pack", "--input", str(work), "--output", str(output), "--algorithm", "lpfhp", "--seed", "4",
            "--workers", "1", "--no-progress", "--verify"]
    with monkeypatch.context() as patch:
        patch.setattr(ps, "write_packed", _drops_a_sequence(ps.write_packed))
        code, line = main_error(capsys, argv, entry=data_main)
    assert code == 2 and "the multisets of sequences differ (--verify)" in line and "no manifest written" in line
    assert not output.exists()  # nothing that training or a rerun could take for a dataset
    assert_unchanged(before, work)
    assert data_main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("verified: 750 sequences, each exactly once")
    shards_only = lambda folder: {k: v for k, v in outputs(folder).items() if k != MANIFEST}  # noqa: E731
    assert shards_only(output) == shards_only(packed)  # (the manifest names another input path)


def test_a_failed_verify_of_one_file_removes_it(work, tmp_path, capsys, monkeypatch):
    import bert_packed.data.prepare.pack as pack_module

    output = tmp_path / "one.h5"
    monkeypatch.setattr(pack_module, "write_packed", _drops_a_sequence(pack_module.write_packed))
    code, line = main_error(capsys, ["pack", "--input", str(work / shard_name(0)), "--output", str(output),
                                     "--no-progress", "--verify"], entry=data_main)
    assert code == 2 and "multisets of sequences differ" in line and f"{output} was removed" in line
    assert not output.exists()


def test_a_refused_input_leaves_no_resume_state(work, tmp_path, capsys):
    """A refusal found while packing (a pack that needs more masked slots than allowed) removes
    what the run wrote, so a rerun with other options is not refused as "another pack"."""
    output = tmp_path / "out"
    code, line = main_error(capsys, ["pack", "--input", str(work), "--output", str(output), "--workers", "1",
                                     "--max-masked-tokens-per-pack", "2", "--no-progress"], entry=data_main)
    assert code == 2 and "--max-masked-tokens-per-pack is 2; raise it" in line
    assert not output.exists()
    output.mkdir()  # an empty directory given by the user stays, empty
    code, _ = main_error(capsys, ["pack", "--input", str(work), "--output", str(output), "--workers", "1",
                                  "--max-masked-tokens-per-pack", "2", "--no-progress"], entry=data_main)
    assert code == 2 and os.listdir(output) == []
    assert data_main(["pack", "--input", str(work), "--output", str(output), "--workers", "1", "--no-progress"]) == 0


# -- deadlines -----------------------------------------------------------------------------------


@contextlib.contextmanager
def silent_server(seconds=30.0):
    """A TCP server on 127.0.0.1 that accepts connections and says nothing; it stops when the block
    ends, or by itself after ``seconds``."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop, held = threading.Event(), []

    def serve():
        deadline = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
        for connection in held:
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        server.close()


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # the test's stderr is the command's
        pass


@contextlib.contextmanager
def http_server():
    """An HTTP server on 127.0.0.1 (answers Dask's handshake with an HTTP error)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _QuietHandler)
    server.timeout = 0.2
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("listener", ["silent", "http"])
@pytest.mark.parametrize("command", ["pack", "create"])
def test_a_scheduler_address_where_no_dask_listens_is_refused_in_time(work, tmp_path, capsys, monkeypatch, listener,
                                                                      command):
    monkeypatch.setattr(engine, "CONNECT_TIMEOUT", 1.5)
    output = tmp_path / "out"
    if command == "create":
        corpus = synthetic_corpus(tmp_path / "corpus.txt", num_documents=6)
        train_vocab(corpus, 200, tmp_path / "vocab.txt")
        argv = ["create", "--input", str(corpus), "--vocab", str(tmp_path / "vocab.txt"), "--max-seq-length", "64"]
    else:
        argv = ["pack", "--input", str(work)]
    before = snapshot(work)
    with (silent_server() if listener == "silent" else http_server()) as address:
        start = time.monotonic()
        code, line = main_error(capsys, argv + ["--output", str(output), "--scheduler", address, "--no-progress"],
                                entry=data_main)
        took = time.monotonic() - start
    assert (code, line) == (2, f"error: --scheduler {address}: something listens there but did not answer Dask's "
                               f"handshake within 1.5 s: not a Dask scheduler; give the address that `dask scheduler` "
                               f"prints")
    assert took < 20, took
    assert not output.exists()  # no resume state, no job
    assert_unchanged(before, work)


def test_a_scheduler_address_where_nothing_listens_leaves_no_resume_state(work, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(engine, "CONNECT_TIMEOUT", 1.0)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code, line = main_error(capsys, ["pack", "--input", str(work), "--output", str(tmp_path / "out"), "--scheduler",
                                     f"tcp://127.0.0.1:{port}", "--no-progress"], entry=data_main)
    assert (code, line) == (2, f"error: --scheduler tcp://127.0.0.1:{port}: cannot reach a Dask scheduler there (Timed "
                               f"out trying to connect to tcp://127.0.0.1:{port} after 1 s)")
    assert not (tmp_path / "out").exists()


# -- create with workers: a bad byte, Ctrl-C -----------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    path = synthetic_corpus(folder / "corpus.txt", num_documents=400)
    train_vocab(path, 300, folder / "vocab.txt")
    return folder


def test_a_bad_byte_with_two_workers_does_not_block_the_rerun_on_the_fixed_file(corpus, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    good = (corpus / "corpus.txt").read_bytes()
    cut = good.rindex(b"\n\n", 0, len(good) - 100)
    text.write_bytes(good[:cut] + b"\n\nbad \xff byte\n" + good[cut:])
    output = tmp_path / "out"
    argv = ["create", "--input", str(text), "--vocab", str(corpus / "vocab.txt"), "--output", str(output),
            "--max-seq-length", "64", "--dupe-factor", "1", "--workers", "2", "--block-bytes", "20000",
            "--no-progress"]
    code, line = main_error(capsys, argv, entry=data_main)
    assert code == 2 and line.startswith(f"error: {text}") and "UTF-8" in line, line
    assert not output.exists()  # no job, no blocks (the other worker's finished block included)
    text.write_bytes(good)
    assert data_main(argv) == 0, capsys.readouterr().err


def _create_with_two_workers_interrupted(corpus, output):
    """(exit status, stderr) of a `create --workers 2` sent one SIGINT on its whole process group
    once its workers have written a block. The corpus is ten copies of the fixture's (about 1,000
    blocks, 15 s of work after the first block here), so the command is still working when the
    signal comes: with one copy it finished within about 2 s of its first block, and on a loaded
    machine the signal sometimes came after it had exited 0."""
    text = output.parent / f"{output.name}-corpus.txt"
    text.write_bytes((corpus / "corpus.txt").read_bytes() * 10)
    command = [sys.executable, "-m", "bert_packed.data", "create", "--input", str(text), "--vocab",
               str(corpus / "vocab.txt"), "--output", str(output), "--max-seq-length", "64", "--dupe-factor", "3",
               "--workers", "2", "--block-bytes", "4000", "--no-progress"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        blocks = output / ".work" / "blocks"
        deadline = time.monotonic() + 120
        while not (blocks.is_dir() and any(name.endswith(".bin") for name in os.listdir(blocks))):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        assert process.poll() is None, "create finished before the signal; the test needs a longer job"
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, err.decode()


def test_ctrl_c_to_create_with_two_workers_prints_one_line(corpus, tmp_path):
    """A real SIGINT to the whole process group (what a terminal's Ctrl-C sends) while the
    workers tokenise: exit 130 and exactly one line, as without workers."""
    output = tmp_path / "out"
    code, err = _create_with_two_workers_interrupted(corpus, output)
    assert code == 130, err
    assert err.splitlines() == [f"interrupted: finished blocks and shards are kept in {output}; run the "
                                f"same command again to finish"]
