"""Hostile inputs to `pack` of a sharded dataset: each is refused with one `error:` line and exit
status 2 before anything is lost (the input dataset byte-identical, no output, or the previous
output as it was)."""
import json
import os
import shutil

import pytest

from bert_packed.data.__main__ import main as data_main
from bert_packed.data.shards import MANIFEST, shard_name
from bert_packed.data.prepare.synthetic import write_synthetic_unpacked
from hostile import assert_unchanged, main_error, snapshot
from test_data_pack_shards import make_unpacked_dir


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_unpacked_dir(tmp_path_factory.mktemp("hostile") / "train", (300, 200, 250))


@pytest.fixture
def work(dataset, tmp_path):
    """A private copy (cases damage it)."""
    shutil.copytree(dataset, tmp_path / "train")
    return tmp_path / "train"


def pack(capsys, source, output, *extra):
    argv = ["pack", "--input", str(source), "--output", str(output), "--algorithm", "lpfhp",
            "--max-sequences-per-pack", "3", "--workers", "1", *map(str, extra)]
    return main_error(capsys, argv, entry=data_main)


def edit_manifest(folder, change):
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def refused(capsys, work, output, needle, *extra):
    before = snapshot(work)
    code, line = pack(capsys, work, output, *extra)
    assert code == 2 and line.startswith("error: ") and needle in line, line
    assert_unchanged(before, work)
    return line


def test_a_missing_shard(work, tmp_path, capsys):
    os.unlink(work / shard_name(1))
    refused(capsys, work, tmp_path / "out", "shard missing")
    assert not (tmp_path / "out").exists()


def test_an_empty_shard(work, tmp_path, capsys):
    open(work / shard_name(2), "wb").close()
    refused(capsys, work, tmp_path / "out", "shard is empty (0 bytes)")
    assert not (tmp_path / "out").exists()


def test_a_manifest_whose_sizes_or_row_counts_do_not_match_its_shards(work, tmp_path, capsys):
    edit_manifest(work, lambda m: m["shards"][0].update(bytes=m["shards"][0]["bytes"] + 1))
    refused(capsys, work, tmp_path / "out", "the shard does not match")
    edit_manifest(work, lambda m: m["shards"][0].update(bytes=m["shards"][0]["bytes"] - 1, num_items=301))
    refused(capsys, work, tmp_path / "out", "300 sequences, manifest.json records 301")
    assert not (tmp_path / "out").exists()


def test_a_shard_whose_lengths_differ_from_its_manifest_histogram(work, tmp_path, capsys):
    """Same size and rows, other sequences: found when the shard is read, nothing else lost."""
    def swap(m):
        a, b = m["shards"][0]["length_histogram"], m["shards"][1]["length_histogram"]
        i = next(i for i in range(len(a)) if a[i] and not b[i])
        j = next(j for j in range(len(a)) if b[j] and not a[j])
        a[i], a[j] = a[i] - 1, a[j] + 1
        b[i], b[j] = b[i] + 1, b[j] - 1
    edit_manifest(work, swap)
    refused(capsys, work, tmp_path / "out", "its sequence lengths differ from the length histogram")


def test_shards_of_different_sequence_lengths(work, tmp_path, capsys):
    other = tmp_path / "other.h5"
    write_synthetic_unpacked(other, 200, max_seq_length=64, max_predictions=20, seed=1)
    shutil.copy(other, work / shard_name(1))
    edit_manifest(work, lambda m: m["shards"][1].update(bytes=os.path.getsize(other)))
    refused(capsys, work, tmp_path / "out", "sequence length 64, the dataset's is 128")
    edit_manifest(work, lambda m: m["shards"][1].update(max_sequence_length=64))
    refused(capsys, work, tmp_path / "out", "shards of one dataset share it")


def test_a_directory_without_manifest(work, tmp_path, capsys):
    os.unlink(work / MANIFEST)
    refused(capsys, work, tmp_path / "out", "no manifest.json")
    empty = tmp_path / "empty"
    os.makedirs(empty)
    refused(capsys, empty, tmp_path / "out", "it holds no shards")


def test_an_already_packed_dataset(work, tmp_path, capsys):
    assert data_main(["pack", "--input", str(work), "--output", str(tmp_path / "packed"), "--workers", "1"]) == 0
    capsys.readouterr()
    refused(capsys, tmp_path / "packed", tmp_path / "again", "this dataset is already packed")


@pytest.mark.parametrize("depth, needle", [(128, "--max-sequences-per-pack must be <= 127"),
                                           (0, "max_sequences_per_pack must be a positive integer")])
def test_a_depth_beyond_limits(work, tmp_path, capsys, depth, needle):
    before = snapshot(work)
    code, line = main_error(capsys, ["pack", "--input", str(work), "--output", str(tmp_path / "out"),
                                     "--max-sequences-per-pack", str(depth), "--workers", "1"], entry=data_main)
    assert code == 2 and needle in line, line
    assert_unchanged(before, work)
    assert not (tmp_path / "out").exists()


def test_output_equal_to_or_inside_the_input(work, capsys):
    refused(capsys, work, work, "is the input dataset")
    refused(capsys, work, work / "packed", "or inside it")
    assert not (work / "packed").exists()


def test_an_existing_complete_or_foreign_output(work, tmp_path, capsys):
    assert data_main(["pack", "--input", str(work), "--output", str(tmp_path / "done"), "--workers", "1"]) == 0
    capsys.readouterr()
    done = snapshot(tmp_path / "done")
    refused(capsys, work, tmp_path / "done", "already holds a complete dataset")
    assert_unchanged(done, tmp_path / "done")
    foreign = tmp_path / "foreign"
    os.makedirs(foreign)
    (foreign / "notes.txt").write_text("mine")
    refused(capsys, work, foreign, "is not empty and holds no unfinished pack")
    assert os.listdir(foreign) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    refused(capsys, work, tmp_path / "file", "exists and is not a directory")


def test_a_sequence_longer_than_the_pack(work, tmp_path, capsys):
    refused(capsys, work, tmp_path / "out", "longer than --max-sequence-length 32", "--max-sequence-length", 32)
    assert not (tmp_path / "out").exists()


def test_workers_for_a_single_file_are_refused(work, tmp_path, capsys):
    code, line = main_error(capsys, ["pack", "--input", str(work / shard_name(0)), "--output",
                                     str(tmp_path / "one.h5"), "--workers", "2"], entry=data_main)
    assert code == 2 and "--workers and --scheduler are for a sharded dataset (a directory)" in line, line
    assert not (tmp_path / "one.h5").exists()
