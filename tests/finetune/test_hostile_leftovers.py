"""Hostile inputs left over from the previous held-out round (issue 46): a sharded Hugging Face
index that is not what it claims, a directory holding two kinds of weights, and an output path
that is a directory.

Each case asserts the one-line message, exit status 2, byte-identical inputs and that nothing
was written, through the surfaces users touch (``run.main``, the fine-tuning CLI's ``main``).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from bert_packed.io.hf_io import CheckpointError, read_pretrained
from finetune_fixtures import tiny_pretraining_checkpoint
from hostile import assert_unchanged, main_error, snapshot

transformers = pytest.importorskip("transformers")

S = 64  # the tiny checkpoint's max_position_embeddings
GOOD = "text,label\ngood dog,pos\nbad cat,neg\nfine tree,pos\nsad river,neg\n"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Hugging Face BertForPreTraining directory with its fast tokenizer (read-only use)."""
    return tiny_pretraining_checkpoint(transformers, tmp_path_factory.mktemp("ckpt"))


def sharded(checkpoint, target, index_name, weight_map):
    """A copy of ``checkpoint`` whose weights are one shard named by an index with ``weight_map``
    (None: the true map of every tensor to the shard)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, target)
    state = load_file(str(target / "model.safetensors"))
    os.unlink(target / "model.safetensors")
    if index_name.startswith("model.safetensors"):
        shard = "model-00001-of-00001.safetensors"
        save_file(state, str(target / shard), metadata={"format": "pt"})
    else:
        import torch

        shard = "pytorch_model-00001-of-00001.bin"
        torch.save(state, target / shard)
    if weight_map is None:
        weight_map = {name: shard for name in state}
    (target / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


def classify_refused(capsys, ckpt, tmp_path, message):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text(GOOD)
    before = snapshot(data, ckpt)
    out = tmp_path / "out"
    argv = ["--config", "finetune_classification", "--init-checkpoint", str(ckpt), "--output-dir", str(out),
            "--no-progress", "--set", f"data.max_sequence_length={S}", "--set", f"finetune.train_file={data}/train.csv",
            "--set", "train.num_threads=1"]
    assert main_error(capsys, argv) == (2, "error: " + message)
    assert_unchanged(before, data, ckpt)
    assert not out.exists() or sorted(os.listdir(out)) == [".lock"], sorted(os.listdir(out))


@pytest.mark.parametrize("index_name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_a_sharded_index_loads_its_shards(checkpoint, tmp_path, index_name):
    reference = read_pretrained(str(checkpoint)).state_dict
    loaded = read_pretrained(str(sharded(checkpoint, tmp_path / "sharded", index_name, None))).state_dict
    assert sorted(loaded) == sorted(reference)
    assert all(loaded[name].equal(reference[name]) for name in reference)


@pytest.mark.parametrize("index_name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_a_weight_map_that_is_a_list_is_one_line(capsys, checkpoint, tmp_path, index_name):
    # Was: AttributeError: 'list' object has no attribute 'values' (a traceback).
    broken = sharded(checkpoint, tmp_path / "broken", index_name, ["model-00001-of-00001.safetensors"])
    classify_refused(capsys, broken, tmp_path,
                     f"{broken / index_name}: \"weight_map\" must be a JSON object of parameter name -> shard file, "
                     "got a list")


@pytest.mark.parametrize("weight_map, got", [({}, "an empty object"), ("x.safetensors", "a string"), (None, "null")])
def test_a_weight_map_that_is_no_map_is_refused(checkpoint, tmp_path, weight_map, got):
    index = "model.safetensors.index.json"
    broken = sharded(checkpoint, tmp_path / "broken", index, {})
    (broken / index).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as caught:
        read_pretrained(str(broken))
    assert str(caught.value) == (f"{broken / index}: \"weight_map\" must be a JSON object of parameter name -> "
                                 f"shard file, got {got}")


@pytest.mark.parametrize("shard, shown", [(["a"], "['a']"), ("../model.safetensors", "'../model.safetensors'"), ("", "''")])
def test_a_shard_name_that_is_no_file_name_is_refused_shortened(checkpoint, tmp_path, shard, shown):
    index = "model.safetensors.index.json"
    broken = sharded(checkpoint, tmp_path / "broken", index, {"bert.embeddings.word_embeddings.weight": shard})
    with pytest.raises(CheckpointError) as caught:
        read_pretrained(str(broken))
    assert str(caught.value) == (f"{broken / index}: weight_map['bert.embeddings.word_embeddings.weight'] must be "
                                 f"the name of a shard file in {broken}, got {shown}")


def test_a_missing_shard_is_named(checkpoint, tmp_path):
    index = "model.safetensors.index.json"
    broken = sharded(checkpoint, tmp_path / "broken", index, None)
    os.unlink(broken / "model-00001-of-00001.safetensors")
    with pytest.raises(CheckpointError) as caught:
        read_pretrained(str(broken))
    assert str(caught.value).startswith(f"{broken / index}: shard 'model-00001-of-00001.safetensors' (of '")
    assert str(caught.value).endswith(f"') is not a file in {broken}")


def test_a_long_shard_name_is_shortened(checkpoint, tmp_path):
    index = "model.safetensors.index.json"
    broken = sharded(checkpoint, tmp_path / "broken", index, {"bert.pooler.dense.weight": "x" * 100_000})
    with pytest.raises(CheckpointError) as caught:
        read_pretrained(str(broken))
    assert str(caught.value) == (f"{broken / index}: shard '{'x' * 59}... (100,002 characters) (of "
                                 f"'bert.pooler.dense.weight') is not a file in {broken}")


def test_safetensors_next_to_a_bin_index_are_loaded(checkpoint, tmp_path):
    # Was refused: the .bin index came first and its shards are not there. transformers loads
    # model.safetensors; so do we.
    both = tmp_path / "both"
    shutil.copytree(checkpoint, both)
    (both / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"bert.embeddings.word_embeddings.weight": "pytorch_model-00001-of-00002.bin"}}))
    before = snapshot(both)
    loaded = read_pretrained(str(both)).state_dict
    reference = read_pretrained(str(checkpoint)).state_dict
    assert sorted(loaded) == sorted(reference)
    assert all(loaded[name].equal(reference[name]) for name in reference)
    assert_unchanged(before, both)


# ----------------------------------------------------------------------------- --output naming a directory


@pytest.mark.parametrize("exists", [False, True])
def test_predict_output_with_a_trailing_slash_names_what_was_given(capsys, checkpoint, tmp_path, exists):
    # Was: "error: /cwd/.tmp-host.pid.xyz: Not a directory" (our temporary file, not the user's path).
    from bert_packed.finetune.__main__ import main as finetune_main

    data = tmp_path / "data"
    data.mkdir()
    (data / "test.csv").write_text(GOOD)
    output = f"{tmp_path / 'results'}/"
    if exists:
        (tmp_path / "results").mkdir()
    before = snapshot(tmp_path, checkpoint)
    code, line = main_error(capsys, ["predict", "--model", str(checkpoint), "--input", str(data / "test.csv"),
                                     "--output", output], entry=finetune_main)
    expected = (f"--output {output} is a directory; give the path of a file to write" if exists else
                f"--output {output} ends in '/', so it names a directory; give the path of a file to write "
                f"(e.g. {output}predictions.jsonl)")
    assert (code, line) == (2, "error: " + expected)
    assert_unchanged(before, tmp_path, checkpoint)
    assert sorted(os.listdir(tmp_path)) == ["data"] + (["results"] if exists else [])


@pytest.mark.parametrize("name", ["results/", "."])
def test_an_atomic_write_to_a_directory_name_names_it_and_writes_nothing(tmp_path, monkeypatch, name):
    from bert_packed.io.files import write_text_atomic

    monkeypatch.chdir(tmp_path)
    with pytest.raises(IsADirectoryError) as caught:
        write_text_atomic(name, "x")
    assert caught.value.filename == name
    assert "names a directory" in caught.value.strerror
    assert os.listdir(tmp_path) == []


def test_an_atomic_write_failing_at_publish_names_the_target_not_the_temporary_file(tmp_path):
    from bert_packed.io.files import write_text_atomic

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "inside").write_text("keep")
    with pytest.raises(OSError) as caught:
        write_text_atomic(str(tmp_path / "taken"), "x")
    assert caught.value.filename == str(tmp_path / "taken")
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert (tmp_path / "taken" / "inside").read_text() == "keep"
