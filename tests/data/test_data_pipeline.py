"""Real text end to end: King James Bible -> vocab -> create -> pack -> training steps (run.py).

Skips, saying why, where Debian's bible-kjv (the `bible` program) is not installed.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bert_packed.data.prepare.kjv import kjv_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kjv_available(),
                                 reason="needs the `bible` program (Debian package bible-kjv)")]


def run(*args, module=True):
    command = [sys.executable] + (["-m", "bert_packed.data"] if module else []) + list(map(str, args))
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_kjv_text_to_packed_training(tmp_path):
    corpus, vocab = tmp_path / "corpus.txt", tmp_path / "vocab.txt"
    unpacked, packed = tmp_path / "train.h5", tmp_path / "packed.h5"
    run("kjv", "--output", corpus, "--first", "Gen1:1", "--last", "Gen20:18")
    run("vocab", "--input", corpus, "--size", 600, "--output", vocab)
    # Verses are long (any two fill 64 tokens), so S=128; short targets are raised to 50 %
    # so this small slice has some padding for packing to remove.
    run("create", "--input", corpus, "--vocab", vocab, "--output", unpacked,
        "--max-seq-length", 128, "--max-predictions", 20, "--dupe-factor", 2, "--seed", 0,
        "--short-seq-prob", 0.5)
    out = run("pack", "--input", unpacked, "--output", packed, "--algorithm", "lpfhp",
              "--max-sequences-per-pack", 3)
    assert "packing factor" in out
    stats = json.loads(run("stats", packed, "--json", "--no-plot"))
    before = json.loads(run("stats", unpacked, "--json", "--no-plot"))
    assert stats["num_sequences"] == before["num_sequences"]
    assert stats["packing_factor"] > 1.03 and stats["efficiency"] > before["efficiency"] + 0.03
    num_vocab = len(open(vocab).read().split("\n")) - 1
    for name, path, depth in (("unpacked", unpacked, 1), ("packed", packed, 3)):
        output_dir = tmp_path / name
        run("run.py", "--config", "tiny", "--steps", 3, "--output-dir", output_dir,
            "--set", f"data.path={path}", "--set", f"data.eval_path={unpacked}",
            "--set", f"data.max_sequences_per_pack={depth}", "--set", f"model.vocab_size={num_vocab}",
            "--set", "data.max_sequence_length=128", "--set", "model.max_position_embeddings=128",
            "--set", "data.max_masked_tokens=20", "--set", "train.eval_every=3",
            "--set", "train.eval_batches=2", "--no-progress", module=False)
        lines = [json.loads(line) for line in open(output_dir / "metrics.jsonl")]
        assert [line["step"] for line in lines] == [1, 2, 3]
        assert all(np.isfinite(line["loss"]) for line in lines)
        # One sequence per row unpacked; packed rows carry at least as many.
        sequences = sum(line["sequences"] for line in lines)
        rows = sum(line["packs"] for line in lines)
        assert (sequences == rows) if depth == 1 else (sequences >= rows)
        assert "eval_mlm_accuracy" in lines[-1]


def test_kjv_text_to_sharded_packed_training(tmp_path):
    """The Wikipedia-scale path at KJV size: sharded create on 2 local workers -> sharded pack
    (one global plan) -> run.py on the packed directory, evaluating on the unpacked one."""
    corpus, vocab = tmp_path / "corpus.txt", tmp_path / "vocab.txt"
    unpacked, packed = tmp_path / "train", tmp_path / "packed"
    run("kjv", "--output", corpus, "--first", "Gen1:1", "--last", "Gen30:43")
    run("vocab", "--input", corpus, "--size", 600, "--output", vocab)
    run("create", "--input", corpus, "--vocab", vocab, "--output", unpacked, "--max-seq-length", 128,
        "--max-predictions", 20, "--dupe-factor", 2, "--seed", 0, "--short-seq-prob", 0.5, "--output-shards", 4,
        "--workers", 2)
    out = run("pack", "--input", unpacked, "--output", packed, "--algorithm", "lp", "--max-sequences-per-pack", 3,
              "--workers", 1, "--verify")
    assert "LP bound" in out and "each exactly once" in out
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["kind"] == "packed" and manifest["num_shards"] == 4
    assert manifest["num_sequences"] == json.loads((unpacked / "manifest.json").read_text())["num_sequences"]
    num_vocab = len(open(vocab).read().split("\n")) - 1
    output_dir = tmp_path / "run"
    run("run.py", "--config", "tiny", "--steps", 4, "--output-dir", output_dir,
        "--set", f"data.path={packed}", "--set", f"data.eval_path={unpacked}",
        "--set", "data.max_sequences_per_pack=3", "--set", f"model.vocab_size={num_vocab}",
        "--set", "data.max_sequence_length=128", "--set", "model.max_position_embeddings=128",
        "--set", "data.max_masked_tokens=20", "--set", "train.eval_every=4", "--set", "train.eval_batches=2",
        "--no-progress", module=False)
    lines = [json.loads(line) for line in open(output_dir / "metrics.jsonl")]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all(np.isfinite(line["loss"]) for line in lines) and "eval_mlm_accuracy" in lines[-1]
    assert sum(line["sequences"] for line in lines) > sum(line["packs"] for line in lines)  # packs of several
