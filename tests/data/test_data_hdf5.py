"""HDF5Source (`data.path`): shuffled per epoch, sharded per rank, resumable to the exact batch."""
import h5py
import numpy as np
import pytest

from bert_packed.collate import validate_batch
from bert_packed.data import DataError
from bert_packed.data.hdf5 import HDF5Source
from bert_packed.data.prepare.pack import pack_file
from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

DIMS = dict(max_sequence_length=128, max_sequences_per_pack=3, max_masked_tokens_per_pack=22)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hdf5")
    unpacked, packed = folder / "train.h5", folder / "packed.h5"
    write_synthetic_unpacked(unpacked, 403, max_seq_length=128, max_predictions=20,
                             vocab_size=1000, seed=2)
    pack_file(unpacked, packed, algorithm="lpfhp", max_sequences_per_pack=3, seed=0,
              show_progress=False)
    return unpacked, packed


def source(path, **kwargs):
    options = dict(DIMS, micro_batch_size=8, seed=11)
    options.update(kwargs)
    return HDF5Source(path, **options)


def take(src, count):
    iterator = iter(src)
    return [next(iterator) for _ in range(count)]


def fingerprint(batch):
    """One row id per pack: its tokens as bytes (packs are distinct with random tokens)."""
    return [row.tobytes() for row in batch["input_ids"]]


@pytest.mark.parametrize("which", [0, 1])
def test_batches_are_valid_packed_batches(files, which):
    src = source(files[which])
    for batch in take(src, 3):
        assert batch["input_ids"].shape == (8, 128) and batch["mlm_positions"].shape == (8, 22)
        assert batch["nsp_weights"].shape == (8, 3) and batch["nsp_weights"].dtype == np.float32
        assert all(batch[name].dtype == np.int64 for name in batch if name != "nsp_weights")
        validate_batch(batch)
    if which == 0:
        assert src.packing_factor == 1.0 and take(src, 1)[0]["nsp_weights"][:, 1:].sum() == 0
    else:
        with h5py.File(files[1], "r") as handle:
            assert src.packing_factor == pytest.approx(403 / len(handle["input_ids"]))
        assert src.packing_factor > 1.2


def test_each_epoch_is_a_new_permutation_without_repeats(files):
    src = source(files[1])
    per_epoch = src.num_batches_per_epoch
    epochs = [sum((fingerprint(b) for b in batches), [])
              for batches in (take(src, per_epoch), take(src, per_epoch))]
    for rows in epochs:
        assert len(set(rows)) == len(rows) == per_epoch * 8  # no pack twice in an epoch
    assert epochs[0] != epochs[1]  # reshuffled
    assert len(set(epochs[0]) & set(epochs[1])) >= len(epochs[0]) - 2 * 8  # same packs, minus remainders
    ordered = source(files[1], shuffle=False)
    with h5py.File(files[1], "r") as handle:
        np.testing.assert_array_equal(take(ordered, 1)[0]["input_ids"], handle["input_ids"][:8])


def test_ranks_split_one_global_stream(files):
    single = take(source(files[0]), 12)
    ranks = [take(source(files[0], rank=r, world_size=3), 4) for r in range(3)]
    for g, batch in enumerate(single):
        np.testing.assert_array_equal(batch["input_ids"], ranks[g % 3][g // 3]["input_ids"])


@pytest.mark.parametrize("cache", [1 << 30, 0])
def test_resume_gives_exactly_the_next_batch(files, cache):
    first = source(files[1], rank=1, world_size=2, max_cache_bytes=cache)
    iterator = iter(first)
    for _ in range(30):  # across an epoch boundary (25 packed micro-batches per epoch / 2 ranks)
        next(iterator)
    state = first.state_dict()
    expected = [next(iterator) for _ in range(3)]
    resumed = source(files[1], rank=1, world_size=2, max_cache_bytes=cache)
    resumed.load_state_dict(state)
    for want, got in zip(expected, take(resumed, 3)):
        for name in want:
            np.testing.assert_array_equal(want[name], got[name])


def test_uncached_reads_equal_cached(files):
    for path in files:
        cached, uncached = take(source(path), 4), take(source(path, max_cache_bytes=0), 4)
        for a, b in zip(cached, uncached):
            for name in a:
                np.testing.assert_array_equal(a[name], b[name])


def test_configuration_too_small_for_the_file(files):
    with pytest.raises(DataError, match="data.max_sequences_per_pack=3"):
        source(files[1], max_sequences_per_pack=2)
    with pytest.raises(DataError, match="data.max_sequence_length=128"):
        source(files[0], max_sequence_length=64)
    with pytest.raises(DataError, match="fewer than one micro-batch"):
        source(files[1], micro_batch_size=10_000)
    with pytest.raises(DataError, match="not found"):
        source(files[1].parent / "missing.h5")
    state = source(files[0]).state_dict()
    with pytest.raises(DataError, match="same data file"):
        source(files[1]).load_state_dict(state)


def test_smaller_file_dimensions_are_zero_padded(files):
    wide = source(files[1], max_sequences_per_pack=5, max_masked_tokens_per_pack=40)
    batch = take(wide, 1)[0]
    assert batch["nsp_weights"].shape == (8, 5) and batch["nsp_weights"][:, 3:].sum() == 0
    assert batch["mlm_positions"].shape == (8, 40)
    narrow = take(source(files[1]), 1)[0]
    np.testing.assert_array_equal(batch["mlm_labels"][:, :22], narrow["mlm_labels"])


def test_nvidia_files_with_other_dtypes_and_label_shape_read_as_they_are(files, tmp_path):
    """NVIDIA's tools write int64 (or int32) fields and sometimes [N, 1] labels."""
    variant = tmp_path / "nvidia.h5"
    with h5py.File(files[0], "r") as src, h5py.File(variant, "w") as dst:
        for name in src:
            data = src[name][:].astype(np.int64)
            dst[name] = data.reshape(-1, 1) if name == "next_sentence_labels" else data
    for a, b in zip(take(source(files[0]), 3), take(source(variant), 3)):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    uncached = take(source(variant, max_cache_bytes=0), 1)[0]
    np.testing.assert_array_equal(uncached["nsp_labels"], take(source(files[0]), 1)[0]["nsp_labels"])
    from bert_packed.data.prepare.pack import packed_digests, unpacked_digests
    pack_file(variant, tmp_path / "packed.h5", show_progress=False)
    assert packed_digests(tmp_path / "packed.h5") == unpacked_digests(files[0])


@pytest.mark.slow
def test_run_py_resume_on_hdf5_repeats_the_uninterrupted_run(files, tmp_path):
    """run.py on a packed file: 14 steps straight == 9 steps, then --resume to 14 (the data
    stream crosses an epoch boundary after the resume)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    common = ["run.py", "--config", "tiny", "--no-progress", "--set", f"data.path={files[1]}",
              "--set", "data.max_sequence_length=128", "--set", "model.max_position_embeddings=128",
              "--set", "model.vocab_size=1000", "--set", "data.max_masked_tokens=20",
              "--set", "train.micro_batch_size=24", "--set", "train.checkpoint_every=100",
              "--set", "optimizer.schedule=constant", "--set", "optimizer.warmup_fraction=0"]

    def run(output, steps, *extra):
        result = subprocess.run([sys.executable, *common, "--steps", str(steps), "--output-dir",
                                 str(output), *extra], capture_output=True, text=True, cwd=root)
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in open(output / "metrics.jsonl")]

    straight = run(tmp_path / "a", 14)
    run(tmp_path / "b", 9)
    resumed = run(tmp_path / "b", 14, "--resume")
    assert [m["step"] for m in resumed] == list(range(1, 15))
    for want, got in zip(straight, resumed):
        assert (want["loss"], want["sequences"], want["tokens"]) == (got["loss"], got["sequences"], got["tokens"])
