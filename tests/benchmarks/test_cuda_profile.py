"""benchmarks/cuda_profile.py: the report's arithmetic (gaps, GEMM share) and its refusals."""
from types import SimpleNamespace

import pytest
import torch

from benchmarks import cuda_profile


def _event(name, start, end, device=False, self_cpu=0.0, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                           device_type=torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU,
                           self_cpu_time_total=self_cpu)


def test_gaps_merge_overlaps_and_measure_idle_time():
    spans = [("a", 0.0, 10.0), ("b", 5.0, 20.0), ("c", 50.0, 60.0), ("d", 62.0, 70.0)]
    g = cuda_profile.gaps(spans)
    assert g["span_us"] == 70.0 and g["busy_us"] == 38.0
    assert g["idle_share"] == pytest.approx(32 / 70)
    assert g["gaps_over_10us"] == 1 and g["largest_gaps_us"] == [30.0, 2.0] and g["median_gap_us"] == 16.0
    assert cuda_profile.gaps([])["idle_share"] is None


def test_kernel_summary_ranks_kernels_and_counts_gemms():
    events = [_event("ampere_bf16_s16816gemm_relu", 0, 60, device=True), _event("cutlass_80_wgmma", 60, 80, device=True),
              _event("vectorized_elementwise_kernel", 100, 120, device=True), _event("aten::mm", 0, 200)]
    s = cuda_profile.summarize(events, on_device=True)
    assert [k["name"] for k in s["top"]][0] == "ampere_bf16_s16816gemm_relu"
    assert s["gemm_share"] == pytest.approx(80 / 100) and s["total_us"] == 100
    assert s["gaps"]["gaps_over_10us"] == 1 and s["gaps_between"] == "kernels"


def test_cpu_summary_uses_self_time_of_operators():
    top = _event("aten::linear", 0, 100, self_cpu=5.0)
    events = [top, _event("aten::addmm", 10, 90, self_cpu=80.0, parent=top), _event("aten::gelu", 120, 140, self_cpu=15.0)]
    s = cuda_profile.summarize(events, on_device=False)
    assert s["gemm_share"] == pytest.approx(0.8) and s["unit"].startswith("CPU operators")
    assert s["gaps"]["span_us"] == 140 and s["gaps"]["largest_gaps_us"] == [20.0]  # between top-level operators


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "must be >= 1"), (["--warmup-steps", "-1"], "--warmup-steps >= 0"),
])
def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "profile"
    assert cuda_profile.main(argv + ["--device", "cpu", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not out.exists()
