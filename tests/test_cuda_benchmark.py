"""benchmarks/cuda_throughput.py: the parts that run without a GPU (tile counting, errors)."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("torch.nn.attention.flex_attention", reason="needs torch >= 2.5 (FlexAttention)")
import cuda_throughput  # noqa: E402


def test_tiles_only_reports_fractions_for_padded_and_packed(tmp_path, capsys):
    out = tmp_path / "tiles.json"
    code = cuda_throughput.main(["--tiles-only", "--models", "tiny", "--micro-batch-size", "4", "--pool-size", "3",
                                 "--num-sequences", "400", "--block-sizes", "16", "64", "--output", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert {(r["layout"], r["block_size"]) for r in results} == {(l, b) for l in ("padded", "packed") for b in (16, 64)}
    for r in results:
        assert 0.0 < r["active_tile_fraction"] <= 1.0
    padded = [r for r in results if r["layout"] == "padded"]
    packed = [r for r in results if r["layout"] == "packed"]
    assert all(r["sequences_per_row"] == 1.0 for r in padded)
    assert all(r["sequences_per_row"] > 1.0 for r in packed)
    # tiny's S=64 is one 64-token tile: every non-empty row computes it.
    assert all(r["active_tile_fraction"] == 1.0 for r in results if r["block_size"] == 64)
    # Finer tiles never compute more of the matrix.
    for layout in ("padded", "packed"):
        fine, coarse = (next(r for r in results if r["layout"] == layout and r["block_size"] == b) for b in (16, 64))
        assert fine["active_tile_fraction"] <= coarse["active_tile_fraction"]
    assert "| tiny | packed (depth 3) |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_throughput_without_gpu_is_one_line_error(capsys):
    assert cuda_throughput.main(["--models", "tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no GPU") and "--tiles-only" in err[0]
