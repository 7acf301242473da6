"""The main job end to end at a size that exercises it (issue 46): a corpus through `create` with 2
workers into 256 shards, `pack` with 2 workers, and training on the packed directory with the
default lanes (64 lanes of 4 shards: every lane's stream crosses shard boundaries, and shards with
different masked-slot widths meet in one micro-batch), killed with SIGKILL after a checkpoint and
resumed: the resumed run equals the uninterrupted one step for step.

Small on purpose (S=32, a tiny model, ~2,000 packs) so it runs in the default suite."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
NUM_SHARDS = 256
STEPS, CHECKPOINT_EVERY, MICRO_BATCH, ACCUMULATION = 40, 8, 8, 2
KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "sequences", "packs", "tokens",
        "learning_rate", "grad_norm")


def _corpus(folder):
    """2,000 short documents of made-up words, and a vocabulary of exactly those words."""
    rng = np.random.default_rng(46)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "va"]
    words = sorted({"".join(rng.choice(syllables, size=rng.integers(1, 3))) for _ in range(200)})
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + words) + "\n")
    corpus = folder / "corpus.txt"
    with open(corpus, "w") as handle:
        for _ in range(2000):
            for _ in range(rng.integers(1, 5)):
                handle.write(" ".join(rng.choice(words, size=rng.integers(2, 8))) + " .\n")
            handle.write("\n")
    return corpus, vocab


def _data_tool(*argv):
    result = subprocess.run([sys.executable, "-m", "bert_packed.data", *argv, "--workers", "2", "--no-progress"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("end_to_end")
    corpus, vocab = _corpus(folder)
    _data_tool("create", "--input", str(corpus), "--vocab", str(vocab), "--output", str(folder / "unpacked"),
               "--max-seq-length", "32", "--max-predictions", "5", "--dupe-factor", "1", "--seed", "1",
               "--output-shards", str(NUM_SHARDS))
    _data_tool("pack", "--input", str(folder / "unpacked"), "--output", str(folder / "packed"),
               "--max-sequences-per-pack", "3")
    with open(folder / "packed" / "manifest.json") as handle:
        manifest = json.load(handle)
    assert manifest["kind"] == "packed" and len(manifest["shards"]) == NUM_SHARDS
    return folder / "packed", manifest


def _train(data, output_dir, *extra):
    args = ["--config", "tiny", "--no-progress", "--output-dir", str(output_dir),
            "--set", f"data.path={data}", "--set", "data.max_sequence_length=32", "--set", "data.max_masked_tokens=5",
            "--set", "model.max_position_embeddings=32", "--set", f"train.micro_batch_size={MICRO_BATCH}",
            "--set", f"train.gradient_accumulation={ACCUMULATION}", "--set", f"train.steps={STEPS}",
            "--set", f"train.checkpoint_every={CHECKPOINT_EVERY}", "--set", "train.eval_every=0",
            "--set", "model.hidden_dropout_prob=0.1", *extra]  # dropout: the RNG streams must resume too
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _lines(output_dir):
    with open(output_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def test_created_packed_trained_killed_and_resumed_equals_the_uninterrupted_run(packed, tmp_path):
    data, manifest = packed
    full = _train(data, tmp_path / "full")
    killed = _train(data, tmp_path / "killed")
    checkpoint = tmp_path / "killed" / CHECKPOINT_NAME
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert killed.poll() is None, f"the run ended before it could be killed: {killed.stderr.read()}"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / "summary.json").exists()
    saved = load_checkpoint(str(checkpoint))
    assert CHECKPOINT_EVERY <= saved["step"] < STEPS

    resumed = _train(data, tmp_path / "killed", "--resume")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert full.wait(timeout=600) == 0, full.stderr.read()
    expected, got = _lines(tmp_path / "full"), _lines(tmp_path / "killed")
    assert [line["step"] for line in got] == [line["step"] for line in expected] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}, a["step"]
    final = [load_checkpoint(str(tmp_path / name / CHECKPOINT_NAME)) for name in ("full", "killed")]
    assert final[0]["step"] == final[1]["step"] == STEPS
    assert final[0]["data"] == final[1]["data"]
    for name, tensor in final[0]["model"].items():
        assert tensor.equal(final[1]["model"][name]), name

    with open(tmp_path / "full" / "summary.json") as handle:
        assert 0.0 <= json.load(handle)["data_wait_fraction"] < 1.0
    # What the run read: the default lanes (64 of 4 shards each); micro-batches that join rows of
    # two shards, some of them of two masked-slot widths (the crash of issue 46).
    assert final[0]["data"][0]["lanes"] == 64
    joined, mixed = _shards_per_micro_batch(data, manifest, STEPS * ACCUMULATION)
    assert joined >= 20 and mixed >= 1, (joined, mixed)


def _shards_per_micro_batch(data, manifest, count):
    """How many of the run's first ``count`` micro-batches (the reader's stream for train.seed 0)
    hold rows of more than one shard, and of shards with different masked-slot widths."""
    import h5py

    from bert_packed.data.sharded import ShardedSource

    shard_of = {}
    for index, entry in enumerate(manifest["shards"]):
        with h5py.File(data / entry["file"], "r") as handle:
            ids = handle["input_ids"][:].astype(np.int64)
        shard_of.update({row.tobytes(): index for row in ids})
    source = ShardedSource(data, micro_batch_size=MICRO_BATCH, max_sequence_length=32, max_sequences_per_pack=3,
                           max_masked_tokens_per_pack=7, seed=0)
    joined = mixed = 0
    for _, batch in zip(range(count), source):
        shards = {shard_of[row.tobytes()] for row in batch["input_ids"]}
        joined += len(shards) > 1
        mixed += len({manifest["shards"][i]["max_masked_tokens_per_pack"] for i in shards}) > 1
    source.close()
    return joined, mixed
