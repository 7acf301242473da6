"""ShardedSource (`data.path` = a directory of shards): each rank reads its own shards, shuffled
in bounded windows, resumable to the exact micro-batch (also with another micro-batch size)."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from bert_packed.collate import validate_batch
from bert_packed.data import DataError, h5io
from bert_packed.data.prepare.pack import pack_file
from bert_packed.data.shards import MANIFEST, shard_entry, shard_name, write_manifest
from bert_packed.data.sharded import LaneCursor, ShardedSource
from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

DIMS = dict(max_sequence_length=128, max_sequences_per_pack=3, max_masked_tokens_per_pack=22)
CHUNK = 16  # rows per HDF5 chunk in the test shards: many blocks and windows from little data


def split_file(source, directory, bounds, *, chunk_rows=CHUNK):
    """Write rows [bounds[i], bounds[i+1]) of HDF5 file ``source`` as shard i of ``directory``
    (chunked like the real tools, ``chunk_rows`` rows) and its manifest."""
    os.makedirs(directory, exist_ok=True)
    entries = []
    with h5py.File(source, "r") as src:
        kind = "packed" if h5io.is_packed(src) else "unpacked"
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            path = os.path.join(directory, shard_name(index))
            with h5io.atomic_h5(path) as dst:
                for name in src:
                    h5io.create_dataset(dst, name, src[name][start:stop], chunk_rows=chunk_rows)
                if "vocab_size" in src.attrs:
                    dst.attrs["vocab_size"] = src.attrs["vocab_size"]
            entries.append(shard_entry(path))
    write_manifest(directory, kind=kind, shards=entries)
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    unpacked, packed = folder / "train.h5", folder / "packed.h5"
    write_synthetic_unpacked(unpacked, 900, max_seq_length=128, max_predictions=20, vocab_size=1000, seed=2)
    pack_file(unpacked, packed, algorithm="lpfhp", max_sequences_per_pack=3, seed=0, show_progress=False)
    with h5py.File(packed, "r") as handle:
        num_packs = len(handle["input_ids"])
    # Four shards of different sizes (the smallest lane decides the epoch).
    cuts = [0, num_packs // 4 - 7, num_packs // 2, 3 * num_packs // 4 + 5, num_packs]
    return {"unpacked": unpacked, "packed": packed, "num_packs": num_packs, "cuts": cuts,
            "dir": split_file(packed, folder / "shards", cuts),
            "unpacked_dir": split_file(unpacked, folder / "unpacked_shards", [0, 200, 450, 700, 900])}


def source(path, **kwargs):
    options = dict(DIMS, micro_batch_size=8, seed=11, window_blocks=2)
    options.update(kwargs)
    return ShardedSource(path, **options)


def take(src, count):
    iterator = iter(src)
    return [next(iterator) for _ in range(count)]


def fingerprint(batch):
    """One id per pack: its tokens as bytes (packs are distinct with random tokens)."""
    return [row.tobytes() for row in batch["input_ids"]]


def same(a, b):
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def epoch_batches(src):
    return len(src.lane_items) * (min(src.lane_items) // src.micro_batch_size)


def test_batches_keep_the_contract_and_the_stream_is_endless(data):
    src = source(data["dir"])
    per_epoch = epoch_batches(src)
    assert src.packing is None and src.epoch == 0
    with h5py.File(data["packed"], "r") as handle:
        assert src.packing_factor == pytest.approx(900 / len(handle["input_ids"])) and src.packing_factor > 1.2
    for batch in take(src, per_epoch + 3):  # past the end of the first epoch
        assert batch["input_ids"].shape == (8, 128) and batch["mlm_positions"].shape == (8, 22)
        assert batch["nsp_weights"].shape == (8, 3) and batch["nsp_weights"].dtype == np.float32
        assert all(batch[name].dtype == np.int64 for name in batch if name != "nsp_weights")
        validate_batch(batch)
    assert src.epoch == 1
    src.close()


def test_unpacked_shards_are_packs_of_one_sequence(data):
    src = source(data["unpacked_dir"])
    assert src.packing_factor == 1.0
    batches = take(src, 8)
    for batch in batches:
        validate_batch(batch)
        assert batch["nsp_weights"][:, 1:].sum() == 0 and (batch["nsp_weights"][:, 0] == 1).all()
    with h5py.File(data["unpacked"], "r") as handle:
        rows = {row.astype(np.int64).tobytes() for row in handle["input_ids"][:]}
    assert all(f in rows for batch in batches for f in fingerprint(batch))


def test_same_seed_same_stream_other_seed_other_stream(data):
    a, b, c = (take(source(data["dir"], seed=seed), 6) for seed in (11, 11, 12))
    for x, y in zip(a, b):
        same(x, y)
    assert fingerprint(a[0]) != fingerprint(c[0])


def test_every_item_at_most_once_per_epoch_and_the_drop_is_as_documented(data):
    src = source(data["dir"])
    lanes, per_lane = len(src.lane_items), min(src.lane_items) // 8
    assert src.lane_items == [b - a for a, b in zip(data["cuts"][:-1], data["cuts"][1:])]
    per_epoch = epoch_batches(src)
    epochs = [sum((fingerprint(b) for b in take(src, per_epoch)), []) for _ in range(2)]
    for rows in epochs:
        assert len(rows) == len(set(rows)) == lanes * per_lane * 8
    assert data["num_packs"] - len(epochs[0]) == sum(n - per_lane * 8 for n in src.lane_items)  # the lanes' tails
    assert epochs[0] != epochs[1] and set(epochs[0]) != set(epochs[1])  # reshuffled: other items dropped
    ordered = source(data["dir"], shuffle=False)
    with h5py.File(data["packed"], "r") as handle:
        np.testing.assert_array_equal(take(ordered, 1)[0]["input_ids"], handle["input_ids"][:8])


@pytest.mark.parametrize("world_size,lanes", [(2, None), (4, None), (2, 2)])
def test_ranks_split_one_global_stream(data, world_size, lanes):
    """1 process x N micro-batches == N processes x 1, for every N dividing the lanes."""
    single = take(source(data["dir"], lanes=lanes), 4 * world_size + 3)
    ranks = [take(source(data["dir"], rank=r, world_size=world_size, lanes=lanes), 8) for r in range(world_size)]
    for g, batch in enumerate(single):
        same(batch, ranks[g % world_size][g // world_size])


def test_a_rank_opens_only_its_own_shards(data, monkeypatch):
    opened = []
    real = h5io.open_h5
    monkeypatch.setattr(h5io, "open_h5", lambda path, **kw: opened.append(os.path.basename(path)) or real(path, **kw))
    for rank in range(2):
        opened.clear()
        take(source(data["dir"], rank=rank, world_size=2), 10)
        assert sorted(opened) == [shard_name(rank), shard_name(rank + 2)]
    opened.clear()
    take(source(data["dir"], rank=1, world_size=2, lanes=2), 4)  # lane 1 = shards 1 and 3
    assert sorted(opened) == [shard_name(1), shard_name(3)]


@pytest.mark.parametrize("prefetch", [True, False])
def test_resume_gives_exactly_the_next_batch(data, prefetch):
    first = source(data["dir"], rank=1, world_size=2, prefetch=prefetch)
    iterator = iter(first)
    for _ in range(epoch_batches(first) // 2 + 4):  # across an epoch boundary
        next(iterator)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    expected = [next(iterator) for _ in range(5)]
    resumed = source(data["dir"], rank=1, world_size=2, prefetch=prefetch)
    resumed.load_state_dict(state)
    for want, got in zip(expected, take(resumed, 5)):
        same(want, got)
    first.close()
    resumed.close()


def test_resume_with_another_micro_batch_size_continues_at_the_same_items(data):
    """Mid-epoch, B 8 -> 5 -> 3 -> 8 (each a forced resume from the last one's state): the packs
    come in exactly the order of the uninterrupted stream at B=8, across the epoch's end (was:
    each lane continued at its own item, so the steps after the resume read other packs than the
    uninterrupted run's)."""
    straight = source(data["dir"])
    per_epoch = epoch_batches(straight)
    done = 13  # not a multiple of the 4 lanes: lanes stand at different items
    take(straight, done)
    state = json.loads(json.dumps(straight.state_dict()))  # as a checkpoint stores it
    expected = sum((fingerprint(b) for b in take(straight, 80)), [])  # 640 items: more than served below
    served = []
    for size, count in ((5, 40), (3, 50), (8, 30)):
        resumed = source(data["dir"], micro_batch_size=size)
        resumed.load_state_dict(state)
        batches = take(resumed, count)
        assert all(len(b["input_ids"]) == size for b in batches)
        served += sum((fingerprint(b) for b in batches), [])
        state = json.loads(json.dumps(resumed.state_dict()))
        resumed.close()
    assert len(served) > (per_epoch - done) * 8  # into the next epoch
    assert served == expected[:len(served)]


def test_cursor_recut_joins_the_units_of_two_lanes():
    units = LaneCursor([40, 33], 8)
    recut = units.recut(3, 5)
    assert recut.pieces(3) == [(0, 1, 8, 13)]
    assert recut.pieces(4) == [(0, 1, 13, 16), (0, 0, 16, 18)]  # the end of unit 3, the start of unit 4
    again = recut.recut(5, 3)  # micro-batch 5 of size 5 starts at item 2 of unit 4
    assert again.pieces(5) == [(0, 0, 18, 21)] and again.state_dict()["unit_size"] == 8


def test_another_micro_batch_size_on_several_processes_is_refused(data):
    first = source(data["dir"], rank=1, world_size=2)
    take(first, 3)
    state = first.state_dict()
    resumed = source(data["dir"], rank=1, world_size=2, micro_batch_size=5)
    with pytest.raises(DataError) as error:
        resumed.load_state_dict(state, force=True)
    assert str(error.value) == (f"{data['dir']}: a resume with micro-batch size 5 where the checkpoint used 8 cannot "
                                f"keep the order of the packs on 2 processes (each reads its own shards, a micro-batch "
                                f"of another size would join several processes' lanes); resume with "
                                f"train.micro_batch_size=8, or on one process")
    first.close()
    resumed.close()


def test_memory_stays_within_two_windows_per_lane(data):
    src = source(data["dir"], rank=0, world_size=2, window_blocks=3)
    bound = 2 * 3 * CHUNK
    iterator = iter(src)
    for _ in range(2 * epoch_batches(src) // 2):
        next(iterator)
        held = src.held_rows()
        assert set(held) == {0, 2} and all(rows <= bound for rows in held.values()), held
    src.close()
    assert src._shards == {} and src._pool is None  # the thread and files are closed
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("shard-prefetch")]


def test_cursor_plain_stream_and_rebase():
    cursor = LaneCursor([40, 33], 8)
    assert cursor.batches_per_lane == 4
    assert [cursor.locate(g) for g in (0, 1, 2, 7, 8, 9)] == [(0, 0, 0), (0, 1, 0), (0, 0, 8), (0, 1, 24),
                                                            (1, 0, 0), (1, 1, 0)]
    based = LaneCursor([40, 33], 5, {"base_global": 3, "base_epoch": 0, "base_offsets": [16, 8]})
    assert based.first_epoch == 4 and based.locate(3) == (0, 1, 8) and based.locate(4) == (0, 0, 16)
    assert based.locate(3 + 8) == (1, 1, 0)


def test_refusals(data, tmp_path):
    with pytest.raises(DataError, match="re-shard with --output-shards a multiple of 8"):
        source(data["dir"], world_size=8)
    with pytest.raises(DataError, match="a multiple of 3"):
        source(data["dir"], world_size=3)
    with pytest.raises(DataError, match="data.max_sequences_per_pack=3"):
        source(data["dir"], max_sequences_per_pack=2)
    with pytest.raises(DataError, match="data.max_sequence_length=128"):
        source(data["unpacked_dir"], max_sequence_length=64)
    with pytest.raises(DataError, match="masked-token slots up to 20 but data.max_masked_tokens_per_pack is 10"):
        source(data["unpacked_dir"], max_masked_tokens_per_pack=10)
    with pytest.raises(DataError, match="fewer than one micro-batch"):
        source(data["dir"], micro_batch_size=10_000)
    broken = tmp_path / "broken"
    shutil.copytree(data["dir"], broken)
    os.remove(broken / shard_name(2))
    with pytest.raises(DataError, match="shard missing"):
        source(broken)
    open(broken / shard_name(2), "wb").close()
    with pytest.raises(DataError, match="shard is empty"):
        source(broken)


def test_manifest_that_does_not_match_its_shards(data, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(data["dir"], wrong)
    manifest = json.loads((wrong / MANIFEST).read_text())
    manifest["shards"][1]["num_items"] += 1
    (wrong / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="the manifest records"):
        source(wrong, rank=1, world_size=2)
    manifest["shards"][1]["num_items"] -= 1
    manifest["kind"] = "unpacked"
    manifest["max_predictions_per_seq"] = 20
    (wrong / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="packed shard in a dataset the manifest calls unpacked"):
        source(wrong)


def test_shards_of_different_sequence_lengths(data, tmp_path):
    mixed = tmp_path / "mixed"
    split_file(data["unpacked"], mixed, [0, 450, 900])
    with h5py.File(data["unpacked"], "r") as src, h5io.atomic_h5(mixed / shard_name(1)) as dst:
        for name in src:  # shard 1 rewritten at S=64 behind the manifest's back
            rows = src[name][450:900]
            h5io.create_dataset(dst, name, rows[:, :64] if name in ("input_ids", "input_mask", "segment_ids") else rows)
    manifest = json.loads((mixed / MANIFEST).read_text())
    manifest["shards"][1]["bytes"] = os.path.getsize(mixed / shard_name(1))
    (mixed / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="sequence length 64 differs from the dataset's 128"):
        source(mixed)


def test_resume_on_a_changed_dataset_is_refused_unless_forced(data, tmp_path):
    other = split_file(data["packed"], tmp_path / "other", [0, 100, 200, 300, data["num_packs"]])
    src = source(data["dir"])
    take(src, 7)
    state = src.state_dict()
    with pytest.raises(DataError, match="resume with the same dataset"):
        source(other).load_state_dict(state)
    forced = source(other)
    forced.load_state_dict(state, force=True)
    assert forced.epoch == 1 and len(take(forced, 3)) == 3
    with pytest.raises(DataError, match="resume with the same dataset"):
        source(data["dir"], lanes=2).load_state_dict(state)


def test_build_data_source_reads_a_directory(data):
    from bert_packed.config import load_config
    from bert_packed.tasks.pretraining.data import build_data_source

    config = load_config("tiny", [f"data.path={data['dir']}", f"data.eval_path={data['unpacked_dir']}",
                                  "data.max_sequence_length=128", "model.max_position_embeddings=128",
                                  "model.vocab_size=1000", "data.max_masked_tokens=20"])
    train = build_data_source(config, split="train", micro_batch_size=4, rank=1, world_size=2)
    held_out = build_data_source(config, split="eval", micro_batch_size=4)
    assert isinstance(train, ShardedSource) and isinstance(held_out, ShardedSource)
    assert train.shuffle and not held_out.shuffle and train.own_lanes == [1, 3]
    validate_batch(take(train, 1)[0])


def test_training_resumed_mid_epoch_on_shards_repeats_the_uninterrupted_run(data, tmp_path):
    """train(): 14 steps straight == 9 steps, then resume to 14; the data crosses an epoch
    boundary after the resume (36 micro-batches of 12 per epoch, 3 per step: the resume starts
    at micro-batch 27). Losses and final weights equal bit for bit."""
    import torch

    from backends.cpu import CPUBackend
    from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
    from bert_packed.config import load_config
    from bert_packed.loop.train import train

    def run(output, steps, resume=False):
        config = load_config("tiny", [f"data.path={data['dir']}", "data.max_sequence_length=128",
                                      "model.max_position_embeddings=128", "model.vocab_size=1000",
                                      "data.max_masked_tokens=20", "train.micro_batch_size=12",
                                      "train.gradient_accumulation=3",
                                      "train.checkpoint_every=100", f"train.steps={steps}",
                                      "optimizer.schedule=constant", "optimizer.warmup_fraction=0"])
        train(config, CPUBackend(), output_dir=str(output), resume=resume, show_progress=False)
        with open(output / "metrics.jsonl") as handle:
            return [json.loads(line) for line in handle]

    straight = run(tmp_path / "a", 14)
    run(tmp_path / "b", 9)
    resumed = run(tmp_path / "b", 14, resume=True)
    assert [m["step"] for m in resumed] == list(range(1, 15))
    for want, got in zip(straight, resumed):
        assert (want["loss"], want["sequences"], want["tokens"]) == (got["loss"], got["sequences"], got["tokens"])
    a, b = (load_checkpoint(str(tmp_path / name / CHECKPOINT_NAME)) for name in ("a", "b"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_the_fast_row_check_agrees_with_validate_batch(data):
    """hdf5.packed_rows_valid (O(B x S)) says True exactly when validate_batch passes: on valid
    packs and on each of many one-element corruptions of them."""
    import types

    from bert_packed.collate import BatchError
    from bert_packed.data.hdf5 import packed_rows_valid

    limits = types.SimpleNamespace(vocab_size=1000, type_vocab_size=2, max_position_embeddings=128,
                                   max_sequences_per_pack=3, max_masked_tokens_per_pack=22)
    with h5py.File(data["packed"], "r") as handle:
        valid = {name: handle[name][:64].astype(np.float32 if name == "nsp_weights" else np.int64)
                 for name in h5io.PACKED_FIELDS}
    rng = np.random.default_rng(0)
    disagreements = []
    for trial in range(600):
        arrays = {name: array.copy() for name, array in valid.items()}
        if trial:
            name = list(arrays)[trial % len(arrays)]
            b, j = rng.integers(arrays[name].shape[0]), rng.integers(arrays[name].shape[1])
            arrays[name][b, j] = rng.choice([arrays[name][b, j] + d for d in (-2, -1, 1, 2)] + [0, 1, 127, 128, 1000])
        try:
            validate_batch(arrays, limits)
            passes = True
        except BatchError:
            passes = False
        if packed_rows_valid(arrays, limits) != passes:
            disagreements.append((trial, passes))
    assert not disagreements


@pytest.mark.slow
def test_torchrun_two_processes_on_shards_equal_one(data, tmp_path):
    """run.py on shards: 2 processes x 1 micro-batch == 1 process x 2 (same global batches, each
    process reading only its own shards)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    args = ["--no-progress", "--backend", "cpu", "--config", "tiny", "--steps", "6",
            "--set", f"data.path={data['dir']}", "--set", "data.max_sequence_length=128",
            "--set", "model.max_position_embeddings=128", "--set", "model.vocab_size=1000",
            "--set", "data.max_masked_tokens=20", "--set", "train.global_batch_size=16",
            "--set", "train.micro_batch_size=8", "--set", "train.checkpoint_every=100"]
    one = subprocess.run([sys.executable, os.path.join(root, "run.py"), "--output-dir", str(tmp_path / "one"), *args],
                         cwd=root, env=env, capture_output=True, text=True)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          os.path.join(root, "run.py"), "--output-dir", str(tmp_path / "two"), *args],
                         cwd=root, env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = ([json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("one", "two"))
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert (x["sequences"], x["tokens"]) == (y["sequences"], y["tokens"])  # the same global batch
        assert abs(x["loss"] - y["loss"]) <= 1e-5, (x["step"], x["loss"], y["loss"])


def test_a_bad_row_is_named_by_shard_and_row_from_the_prefetch_thread(data, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(data["dir"], bad)
    path = bad / shard_name(0)
    with h5py.File(data["dir"] / shard_name(0), "r") as src, h5io.atomic_h5(path) as dst:
        for name in src:
            rows = src[name][:]
            if name == "input_ids":
                rows[37, 1] = 5000
            h5io.create_dataset(dst, name, rows, chunk_rows=CHUNK)
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["shards"][0]["bytes"] = os.path.getsize(path)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"shard-00000.h5: input_ids of pack 37: value 5000 is outside \[0, 1000\)"):
        take(source(bad, vocab_size=1000, shuffle=False), 40)


def test_default_lanes_bound_what_one_process_holds():
    from bert_packed.data.sharded import default_lanes

    assert [default_lanes(n) for n in (1, 4, 6, 64, 96, 1000, 4096, 4099)] == [1, 4, 6, 64, 48, 50, 64, 1]
