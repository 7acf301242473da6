"""benchmarks/gpu_check.sh's dry run (GPU_CHECK_DRY_RUN=1): every stage's arguments on this CPU at
tiny shapes, every row of benchmarks/cuda_throughput.py (run-py-default, the FP8 lever, Hugging
Face padding-free compiled included) and the kernel-profile file. The smoke run, the overhead report
and the pytest stage are run.py and the test suite, tested where they live: skipped here."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks.common import ROOT
from benchmarks.cuda_setups import LEVERS, RUN_PY_DEFAULT, SETUPS

pytest.importorskip("torch.nn.attention.flex_attention", reason="needs torch >= 2.5 (FlexAttention)")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    # The rows in one process (GPU_CHECK_IN_PROCESS): the per-row processes are checked in
    # test_cuda_throughput.py; here every row's arguments and fields.
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_SKIP": "smoke overhead tests",
           "GPU_CHECK_IN_PROCESS": "1", "GPU_CHECK_BUDGET": "3000", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = []
    for name in sorted(os.listdir(out)):
        if name.startswith("rows_") and name.endswith(".json"):
            rows += json.loads((out / name).read_text())
    return out, rows, (out / "log.txt").read_text()


def test_every_stage_ran_and_every_setup_has_a_row(dry_run):
    out, rows, log = dry_run
    assert "SKIPPED rows" not in log and "SKIPPED profile" not in log
    assert {r["setup"] for r in rows} == set(SETUPS)
    for r in rows:  # every row says what it trained and how, measured or not
        for key in ("compiled", "fp8", "hidden_dropout_prob", "attention_probs_dropout_prob", "status"):
            assert key in r, (r["setup"], key)
        assert not r["status"].startswith("failed"), r
    table = (out / "table.md").read_text()
    assert all(SETUPS[name].label in table for name in SETUPS)


def test_run_py_default_is_measured_with_the_configs_recipe(dry_run):
    _, rows, _ = dry_run
    (row,) = [r for r in rows if r["setup"] == RUN_PY_DEFAULT]
    assert row["status"] == "ok" and row["family"] == "run.py" and row["in_process"]
    # run.py --backend cuda --config tiny --set cuda.device=cpu: eager dense, tiny's own micro-batch.
    assert (row["attention"], row["compiled"], row["fp8"], row["micro_batch_size"]) == ("dense", False, False, 8)
    assert (row["hidden_dropout_prob"], row["attention_probs_dropout_prob"]) == (0.0, 0.0)
    assert row["repeats"] == 3 and len(row["window_seconds"]) == 3
    assert 0 < row["tokens_per_second_min"] <= row["tokens_per_second"] <= row["tokens_per_second_max"]
    assert row["gpu"]["device"] == "cpu" and row["gpu"]["nvidia_smi"] is None


def test_the_fp8_lever_and_hf_padding_free_compiled_have_rows(dry_run):
    _, rows, _ = dry_run
    levers = {r["setup"]: r for r in rows if r["setup"].startswith("lever-")}
    assert set(levers) == {name for name, _, _ in LEVERS}
    for r in levers.values():
        assert r["status"] == "ok" or r["status"].startswith("not available: "), r
    fp8 = levers["lever-fp8"]
    assert fp8["switch"] == ["cuda.fp8=true"]
    assert fp8["status"] != "ok" or fp8["fp8"] is True
    padding_free = [r for r in rows if r["setup"] == "hf-padding-free-varlen"]
    assert [r.get("compile_requested") for r in padding_free] == [False, True]  # eager and compiled rows
    assert all(r["status"].startswith("GPU only") and r["compiled"] is False for r in padding_free)


def test_the_profile_file_is_written(dry_run):
    out, _, _ = dry_run
    report = json.loads((out / "profile" / "profile.json").read_text())
    assert report["unit"].startswith("CPU operators") and 0 < report["gemm_share"] < 1
    assert report["top"] and report["gaps"]["span_us"] > 0
    assert "GEMM share" in (out / "profile" / "profile.md").read_text()
