"""The per-depth overhead report: packing statistics, paired measurements, pva, end to end."""
import json
import os
import types

import numpy as np
import pytest

from backends import get_backend
from bert_packed.analysis import profiling
from bert_packed.config import load_config

TINY = ["model.num_hidden_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
        "model.intermediate_size=64", "model.vocab_size=200", "data.max_sequence_length=64",
        "data.max_masked_tokens=10", "train.micro_batch_size=2", "data.packing_algorithm=lpfhp"]

# phase2's own packer (lp) takes seconds per depth on the full Wikipedia histogram; the
# report's logic is the same with lpfhp, which takes milliseconds.
FAST_PACKER = ["data.packing_algorithm=lpfhp"]


def test_histogram_mapping_keeps_every_sequence():
    counts = np.arange(1, 513)
    same = profiling.mapped_histogram_counts(counts, 512, 512, "scale")
    assert same.sum() == counts.sum()
    assert np.array_equal(same[3:], counts[3:])  # only lengths 1, 2 are raised to 3
    short = profiling.mapped_histogram_counts(counts, 512, 128, "truncate")
    assert short.sum() == counts.sum() and short[-1] == counts[127:].sum()
    scaled = profiling.mapped_histogram_counts(counts, 512, 128, "scale")
    assert scaled[-1] == counts[508:].sum()  # ceil(l / 4) = 128 for l in 509..512


def test_packing_statistics_match_the_packing_library():
    from packing import Histogram, pack

    config = load_config("phase2", FAST_PACKER)
    stats = profiling.packing_statistics(config, depths=(1, 3))
    hist = Histogram.load("wikipedia-512")
    direct = pack(hist, algorithm=config.data.packing_algorithm, max_sequences_per_pack=3).to_dict()
    assert stats["rows"][3]["packing_factor"] == pytest.approx(direct["packing_factor"], rel=1e-12)
    assert stats["rows"][1]["packing_factor"] == pytest.approx(1.0)
    assert stats["theoretical_speedup"] == pytest.approx(2.0013, abs=1e-4)


def test_hdf5_runs_are_profiled_on_their_own_lengths(tmp_path):
    import h5py

    from bert_packed.data.prepare.synthetic import write_synthetic_unpacked
    from packing import Histogram, pack

    path = tmp_path / "train.h5"
    write_synthetic_unpacked(path, 500, max_seq_length=128, max_predictions=20, seed=3)
    with h5py.File(path, "r") as handle:  # lengths straight from the NVIDIA layout's input_mask
        lengths = handle["input_mask"][:].sum(axis=1)
    config = load_config("tiny", [f"data.path={path}", "data.max_sequence_length=128",
                                  "data.packing_algorithm=lpfhp"])
    assert np.array_equal(np.sort(profiling.data_lengths(config)), np.sort(lengths))
    stats = profiling.packing_statistics(config, depths=(1, 3), lengths=profiling.data_lengths(config))
    direct = pack(Histogram.from_lengths(lengths, 128), algorithm="lpfhp", max_sequences_per_pack=3)
    assert stats["rows"][3]["packing_factor"] == pytest.approx(direct.to_dict()["packing_factor"], rel=1e-12)
    assert profiling.data_lengths(load_config("tiny")) is None  # generated data: the histogram


def test_depths_the_algorithm_cannot_pack_fall_back_to_lpfhp_and_say_so():
    config = load_config("phase2", ["data.packing_algorithm=nnlshp"])
    stats = profiling.packing_statistics(config, depths=(1, 4))  # nnlshp stops at depth 3
    assert stats["rows"][4]["algorithm"] == "lpfhp (nnlshp not defined at depth 4)"
    lpfhp = profiling.packing_statistics(load_config("phase2", ["data.packing_algorithm=lpfhp"]), depths=(4,))
    assert stats["rows"][4]["packing_factor"] == lpfhp["rows"][4]["packing_factor"]


def test_an_unknown_algorithm_is_a_one_line_error_not_a_fallback():
    config = load_config("phase2", ["data.packing_algorithm=bogus"])
    with pytest.raises(profiling.ProfilingError, match="unknown packing algorithm 'bogus'"):
        profiling.packing_statistics(config, depths=(1, 4))
    assert issubclass(profiling.ProfilingError, ValueError)


class DriftingBackend:
    """Cost = true cost of the batch's depth x a machine-speed factor that drifts 3x over the run."""

    def __init__(self, overhead_per_depth):
        self.calls = 0
        self.overhead_per_depth = overhead_per_depth

    def profile(self, model, batch, *, num_repeats=5):
        depth = batch["nsp_weights"].shape[1]
        drift = 1.0 + 2.0 * self.calls / 40.0
        self.calls += 1
        return {"cost": 100.0 * (1.0 + self.overhead_per_depth * (depth - 1)) * drift, "unit": "ms",
                "breakdown": None}


def _fake_batch(depth):
    return {"nsp_weights": np.ones((2, depth), dtype=np.float32)}


def test_paired_interleaved_ratios_cancel_machine_drift():
    batches = {d: _fake_batch(d) for d in (1, 2, 3, 4)}
    backend = DriftingBackend(overhead_per_depth=0.01)
    costs = profiling.measure_costs(backend, None, batches, num_repeats=5, deterministic=False)
    for depth in (2, 3, 4):
        true = 1 - 1 / (1 + 0.01 * (depth - 1))  # the decrease in packs/s
        # Each packed call follows its baseline call: a pair sees one drift step (1/40 of 2x).
        assert costs[depth]["overhead"] == pytest.approx(true, abs=0.06 * (1 + true))
        assert costs[depth]["overhead_paired_median"] == pytest.approx(true, abs=0.06 * (1 + true))
        assert costs[depth]["num_samples"] == 5
    # The unpaired medians would be badly off: the drift moves costs by up to 3x over the run.
    unpaired = 1 - costs[2]["unpacked_cost"] / costs[4]["packed_cost"]
    assert abs(unpaired - (1 - 1 / 1.03)) > 0.05


class BurstyBackend(DriftingBackend):
    """Like the drifting one but steady, with other work slowing random calls by up to 2x."""

    def profile(self, model, batch, *, num_repeats=5):
        depth = batch["nsp_weights"].shape[1]
        self.calls += 1
        slowdown = 1.0 + (self.rng.random() if self.rng.random() < 0.6 else 0.0)
        return {"cost": 100.0 * (1.0 + self.overhead_per_depth * (depth - 1)) * slowdown, "unit": "ms",
                "breakdown": None}


def test_fastest_interleaved_runs_see_through_bursts_of_other_work():
    batches = {d: _fake_batch(d) for d in (1, 2, 3)}
    backend = BurstyBackend(overhead_per_depth=0.02)
    backend.rng = np.random.default_rng(0)
    costs = profiling.measure_costs(backend, None, batches, num_repeats=15, deterministic=False)
    # 15 pairs: at least one undisturbed run per side with probability 1 - 2 * 0.6**15 > 0.999.
    assert costs[3]["overhead"] == pytest.approx(1 - 1 / 1.04, abs=1e-9)
    assert costs[3]["unpacked_cost"] == pytest.approx(100.0)


def test_deterministic_backends_are_measured_once_per_shape():
    batches = {d: _fake_batch(d) for d in (1, 2, 3)}
    backend = DriftingBackend(overhead_per_depth=0.0)
    profiling.measure_costs(backend, None, batches, num_repeats=5, deterministic=True)
    assert backend.calls == 3


def test_pva_reader_total_and_step_sum():
    total = types.SimpleNamespace(execution=types.SimpleNamespace(totalCycles=types.SimpleNamespace(total=1234)))
    steps = [types.SimpleNamespace(ipus=[types.SimpleNamespace(cycles=c)]) for c in (10, 20, 30)]
    summed = types.SimpleNamespace(execution=types.SimpleNamespace(steps=steps))
    assert profiling.pva_total_cycles(total) == 1234
    assert profiling.pva_total_cycles(summed) == 60
    assert profiling.pva_total_cycles(None) is None


def _check_report(report, output_dir, depths):
    for name in ("overhead.json", "overhead.md", "overhead.png"):
        assert os.path.getsize(os.path.join(output_dir, name)) > 100
    on_disk = json.loads(open(os.path.join(output_dir, "overhead.json")).read())
    assert [row["depth"] for row in on_disk["rows"]] == list(depths)
    for row in on_disk["rows"]:
        assert row["realized_speedup"] == pytest.approx(row["packing_factor"] * (1 - row["overhead"]))
        assert row["overhead"] == pytest.approx(0.0) if row["depth"] == 1 else True
        assert set(row["breakdown"]) == set(profiling.CATEGORIES)
        assert sum(row["breakdown"].values()) == pytest.approx(row["packed_cost"], rel=1e-6)
    return on_disk


def test_cpu_report_end_to_end(tmp_path):
    config = load_config("phase2_base", TINY)
    report = profiling.run_profile(config, get_backend("cpu"), str(tmp_path), depths=(1, 2, 3), num_repeats=2,
                                   throughput_steps=2, show_progress=False)
    on_disk = _check_report(report, str(tmp_path), (1, 2, 3))
    assert on_disk["unit"] == "ms"
    t = on_disk["throughput"]
    assert t["packed"]["steps"] == t["padded"]["steps"] == 2
    assert t["padded"]["data_packing_factor"] == 1.0 and t["packed"]["data_packing_factor"] > 1.2
    # Long-run sequences/s = measured packs/s x the data's sequences per pack.
    for mode in ("packed", "padded"):
        m = t[mode]
        assert m["sequences_per_second"] == pytest.approx(m["packs"] / m["seconds"] * m["data_packing_factor"])
    assert t["padded"]["measured_sequences"] == 2 * 2
    assert t["speedup_median_steps"] > 0
    assert "| 3 |" in open(tmp_path / "overhead.md").read()


def _mock_available():
    try:
        from backends import get_backend_class
        cls = get_backend_class("mock")
    except Exception:
        return False
    return cls.is_available()


@pytest.mark.skipif(not _mock_available(), reason="the mock backend is not importable")
def test_mock_phase2_bert_large_is_priced_from_shapes(tmp_path):
    # BERT-Large at S=512 on the meta device: shapes only, nothing executed, so this is fast.
    config = load_config("phase2", FAST_PACKER)
    report = profiling.run_profile(config, get_backend("mock"), str(tmp_path), show_progress=False)
    on_disk = _check_report(report, str(tmp_path), profiling.DEPTHS)
    assert on_disk["unit"] == "estimated cycles"
    rows = {row["depth"]: row for row in on_disk["rows"]}
    assert 0.0 <= rows[3]["overhead"] <= 0.10
    # lpfhp reaches ~99.9 % efficiency by depth 16; the speed-up then only lacks the overhead.
    assert rows[16]["realized_speedup"] > 1.8
    assert on_disk["throughput"]["speedup"] == pytest.approx(rows[config.data.max_sequences_per_pack]["realized_speedup"],
                                                             rel=1e-9)


@pytest.mark.skipif(not _mock_available(), reason="the mock backend is not importable")
def test_mock_executes_through_cycle_count_and_reads_pva(tmp_path):
    # A tiny model really runs through the mock's trainingModel with logCycleCount(True); the
    # injected PopVision reader must be handed the profile directory and its total reported.
    config = load_config("phase2_base", TINY + ["ipu.layers_per_ipu=[1]", "ipu.replication_factor=1",
                                                "ipu.available_memory_proportion=[0.2]"])
    seen = []

    def fake_reader(profile_dir):
        seen.append(profile_dir)
        return types.SimpleNamespace(execution=types.SimpleNamespace(totalCycles=types.SimpleNamespace(total=42)))

    report = profiling.run_profile(config, get_backend("mock"), str(tmp_path), depths=(1, 3), report_reader=fake_reader,
                                   show_progress=False, execute=True)
    _check_report(report, str(tmp_path), (1, 3))
    assert report["unit"] == "estimated cycles"
    assert report["cycle_count_logged"] is True
    assert seen == [os.path.join(str(tmp_path), "popvision")]
    assert report["pva_cycles"] == 42


@pytest.mark.slow
def test_run_py_profile_prints_the_table_and_the_files_and_no_bar_when_piped(tmp_path, capfd):
    """`run.py --profile` used to write overhead.md silently, draw a 0 % bar into a pipe and let
    torch's profiler print a 'USDT: ... profiler_start' line at every scope measurement."""
    import run

    output_dir = tmp_path / "profile"
    assert run.main(["--config", "tiny", "--profile", "--output-dir", str(output_dir)]) == 0
    out, err = capfd.readouterr()
    assert "| depth | algorithm |" in out and "Packed / padded sequences/s" in out
    assert out.strip().splitlines()[-1] == f"wrote {output_dir}: overhead.md, overhead.json, overhead.png"
    assert (output_dir / "overhead.md").read_text().strip() in out
    assert "%|" not in err and "it/s" not in err, "a progress bar on a pipe"
    assert "USDT" not in err and "profiler_start" not in err
