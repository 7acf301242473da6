"""benchmarks/cuda_throughput.py (and cuda_setups.py): the parts that run without a GPU."""
import copy
import json

import numpy as np
import pytest
import torch

pytest.importorskip("torch.nn.attention.flex_attention", reason="needs torch >= 2.5 (FlexAttention)")
from benchmarks import cuda_setups, cuda_throughput  # noqa: E402


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


# ----------------------------------------------------------------------------- the throughput rows on CPU

SMALL = ["--device", "cpu", "--models", "tiny", "--steps", "1", "--repeats", "2", "--window-seconds", "0", "--warmup-steps", "1",
         "--micro-batch-size", "4", "--gradient-accumulation", "1", "--num-sequences", "300", "--pool-size", "4",
         "--precision", "fp32"]


def _rows(tmp_path, args):
    out = tmp_path / "rows.json"
    code = cuda_throughput.main(SMALL + args + ["--output", str(out)])
    return code, json.loads(out.read_text())


def _check_measured(row):
    assert row["status"] == "ok"
    assert 0 < row["sequences_per_second_min"] <= row["sequences_per_second"] <= row["sequences_per_second_max"]
    assert 0 < row["tokens_per_second_min"] <= row["tokens_per_second"] <= row["tokens_per_second_max"]
    assert row["mfu"] is None and row["max_memory_gib"] is None, "no published peak or GPU memory on a CPU"


@pytest.mark.slow
def test_cpu_compile_compiles_every_setup_it_reports_as_compiled(tmp_path):
    # One process per setup: each row's dynamo counters are its own (a shared process would
    # pile up graphs and, past the recompile limit, silently run later setups eagerly).
    setups = ["packed-sdpa", "padded-sdpa", "hf-padded-sdpa", "packed-flex", "hf-padding-free-varlen"]
    code, rows = _rows(tmp_path, ["--compile", "--compile-backend", "aot_eager", "--setups", *setups])
    assert code == 0
    assert [r["setup"] for r in rows] == setups
    by_name = {r["setup"]: r for r in rows}
    for name in ("packed-sdpa", "padded-sdpa", "hf-padded-sdpa"):
        row = by_name[name]
        _check_measured(row)
        assert row["compiled"] and row["compile_backend"] == "aot_eager"
        assert row["graphs_compiled"] >= 1 and row["graph_breaks"] == 0 and row["recompiles_while_timed"] == 0
    assert by_name["packed-sdpa"]["recompiles_after_warmup"] == 0
    # Packing removes padding: more real tokens per slot than one sequence per row.
    assert by_name["packed-sdpa"]["token_efficiency"] > by_name["padded-sdpa"]["token_efficiency"]
    # What a CPU cannot run is a row that says so, never a number.
    for name in ("packed-flex", "hf-padding-free-varlen"):
        assert by_name[name]["status"].startswith("GPU only") and "sequences_per_second" not in by_name[name]
        assert by_name[name]["compiled"] is False


@pytest.mark.slow
def test_cpu_compile_with_inductor_through_the_backend(tmp_path):
    # The backend's own torch.compile path (cuda.compile=true, inductor), as a GPU run uses it.
    code, rows = _rows(tmp_path, ["--compile", "--setups", "packed-sdpa"])
    assert code == 0
    (row,) = rows
    _check_measured(row)
    assert row["compiled"] and row["compile_backend"] == "inductor"
    assert row["graphs_compiled"] >= 1 and row["recompiles_while_timed"] == 0 and row["recompiles_after_warmup"] == 0


@pytest.mark.slow
def test_without_compile_no_row_claims_compilation(tmp_path):
    code, rows = _rows(tmp_path, ["--setups", "packed-dense"])
    assert code == 0
    (row,) = rows
    _check_measured(row)
    assert row["compiled"] is False and row["graphs_compiled"] is None


@pytest.mark.slow
def test_scaling_rows_run_under_torchrun_and_count_every_rank(tmp_path):
    # On a CPU "GPUs" are gloo processes: this checks the torchrun plumbing, not speed.
    code, rows = _rows(tmp_path, ["--setups", "packed-dense", "--scaling", "1", "2"])
    assert code == 0
    main_row, one, two = rows
    assert not main_row.get("scaling") and one["scaling"] and two["scaling"]
    assert (one["gpus"], two["gpus"]) == (1, 2)
    for row in rows:
        _check_measured(row)
    # Each rank trains its own shard of the same micro-batch size: twice the sequences.
    assert two["sequences_timed"] > 1.5 * one["sequences_timed"]


@pytest.mark.slow
def test_a_setup_over_its_timeout_is_a_failed_row_and_earlier_rows_are_kept(tmp_path, capsys):
    """--setup-timeout kills a setup's process (a GPU run has minutes, not hours); the rows before
    it are already in --output, and --table prints the rows of several files as one table."""
    out = tmp_path / "rows.json"
    code = cuda_throughput.main(SMALL + ["--setups", "packed-dense", "padded-dense", "--output", str(out),
                                         "--setup-timeout", "0.01"])
    assert code == 1  # a failed row fails the command
    rows = json.loads(out.read_text())
    assert [r["status"] for r in rows] == ["failed: timeout after 0.01 s (--setup-timeout)"] * 2
    ok = tmp_path / "ok.json"
    assert cuda_throughput.main(SMALL + ["--setups", "packed-dense", "--output", str(ok)]) == 0
    capsys.readouterr()
    assert cuda_throughput.main(["--table", str(ok), str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + 3 and "failed: timeout" in table[-1] and "| tiny |" in table[2]


@pytest.mark.parametrize("content,message", [
    (None, "cannot read results"), ("{not json", "cannot read results"), ('{"a": 1}', "not a results file"),
    ('[{"setup": "packed-dense"}]', "not a results file"),
])
def test_table_of_a_bad_results_file_is_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    assert cuda_throughput.main(["--table", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --table") and message in err[0]


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_setup_timeout_that_is_not_positive_is_one_line_error(capsys, value):
    assert cuda_throughput.main(SMALL + ["--setup-timeout", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --setup-timeout must be a positive number")


def test_bad_scaling_argument_is_one_line_error(capsys):
    assert cuda_throughput.main(SMALL + ["--scaling", "two"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --scaling")


# ----------------------------------------------------------------------------- MFU inputs


def test_useful_flops_do_not_depend_on_the_layout():
    # The same sequences packed (depth 3) or one per row: the same useful work, so MFU
    # compares setups on equal terms (padding and cross-sequence tiles are not counted).
    from bert_packed.collate import collate, one_per_pack
    from bert_packed.config import load_config
    from bert_packed.model.modeling import BertConfig
    from test_model_fixtures import random_packed_problem

    samples, assignment = random_packed_problem(0, num_packs=4, max_sequence_length=64, max_sequences_per_pack=3)
    packed = collate(samples, assignment, max_sequence_length=64, max_sequences_per_pack=3, max_masked_tokens_per_pack=30)
    count = len(samples["input_ids"])
    padded = collate(samples, one_per_pack(np.arange(count)), max_sequence_length=64, max_sequences_per_pack=1,
                     max_masked_tokens_per_pack=10)
    a, b = cuda_setups.batch_counts(packed), cuda_setups.batch_counts(padded)
    assert a["sequences"] == b["sequences"] == count and a["tokens"] == b["tokens"] and a["masked"] == b["masked"]
    assert sorted(a["lengths"]) == sorted(b["lengths"])
    model = BertConfig(**{k: v for k, v in vars(load_config("tiny").model).items() if k in BertConfig.__dataclass_fields__})
    assert cuda_setups.training_flops(model, a["lengths"], a["masked"]) == pytest.approx(
        cuda_setups.training_flops(model, b["lengths"], b["masked"]))
    assert a["slots"] < b["slots"]


def test_bert_large_flops_per_token_match_its_parameter_count():
    # BERT-Large's encoder has ~302M non-embedding parameters: training costs ~6 x 302M
    # FLOPs per token when attention is negligible (a 1-token sequence, no heads).
    from types import SimpleNamespace

    large = SimpleNamespace(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, vocab_size=30522)
    per_token = cuda_setups.training_flops(large, np.array([1]), 0, with_nsp=False)
    assert per_token == pytest.approx(6 * 302e6, rel=0.01)
    # Attention grows with the square of the sequence: 512 tokens in one sequence cost more
    # than 4 sequences of 128.
    assert cuda_setups.training_flops(large, np.array([512]), 0) > cuda_setups.training_flops(
        large, np.array([128] * 4), 0)


@pytest.mark.parametrize("name,precision,tf32,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989.5),
    ("NVIDIA H100 PCIe", "bf16", True, 756.5),
    ("NVIDIA H200", "fp32", True, 494.5),
    ("NVIDIA H200", "fp32", False, 67.0),
    ("NVIDIA A100-SXM4-80GB", "fp16", True, 312.0),
    ("Some Future GPU", "bf16", True, None),
])
def test_peak_table(name, precision, tf32, expected):
    assert cuda_setups.peak_tflops(name, precision, tf32) == expected


# ----------------------------------------------------------------------------- the Hugging Face padding-free peer


def test_hf_padding_free_varlen_peer_attends_within_each_sequence(monkeypatch):
    """The HF peer's plumbing on CPU: DataCollatorWithFlattening's cu_seq_lens reach the
    registered attention, and the flattened row gives each sequence's own logits (a
    reference kernel stands in for torch's CUDA-only varlen_attn)."""
    transformers = pytest.importorskip("transformers")
    varlen_module = pytest.importorskip("torch.nn.attention.varlen")
    import math

    def reference(query, key, value, cu_q, cu_k, max_q, max_k, scale=None):
        out = torch.zeros_like(query)
        for lo, hi in zip(cu_q.tolist(), cu_q.tolist()[1:]):
            q, k, v = (t[lo:hi].transpose(0, 1) for t in (query, key, value))
            probs = torch.softmax(q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1])), dim=-1)
            out[lo:hi] = (probs @ v).transpose(0, 1)
        return out

    cuda_setups.register_hf_torch_varlen()
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    # _from_config sets the attention on the config object it is given: one copy per model.
    flat_model = transformers.BertForMaskedLM._from_config(copy.deepcopy(config), attn_implementation="torch_varlen").eval()
    per_sequence = transformers.BertForMaskedLM._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    assert flat_model.config._attn_implementation == "torch_varlen"
    calls = []
    monkeypatch.setattr(varlen_module, "varlen_attn", lambda *a, **k: calls.append(a[3]) or reference(*a, **k))
    per_sequence.load_state_dict(flat_model.state_dict())
    sequences = [[2, 5, 6, 7, 3], [2, 9, 3], [2, 11, 12, 13, 14, 15, 3]]
    from transformers import DataCollatorWithFlattening

    inputs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in sequences])
    inputs.pop("labels")
    with torch.no_grad():
        flat = flat_model(**inputs).logits[0]
        expected = torch.cat([per_sequence(input_ids=torch.tensor([s])).logits[0] for s in sequences])
    assert len(calls) == config.num_hidden_layers and calls[0].tolist() == [0, 5, 8, 15]
    torch.testing.assert_close(flat, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compile_both_gives_an_eager_and_a_compiled_row_per_compilable_setup(tmp_path, capsys):
    code, rows = _rows(tmp_path, ["--compile", "both", "--compile-backend", "aot_eager",
                                  "--setups", "packed-dense", "hf-padding-free-varlen"])
    assert code == 0
    # HF padding-free compiles too now (dynamic shapes); on a CPU both its rows say "GPU only".
    assert [(r["setup"], r["compiled"], r.get("compile_requested")) for r in rows] == [
        ("packed-dense", False, None), ("packed-dense", True, None), ("hf-padding-free-varlen", False, False),
        ("hf-padding-free-varlen", False, True)]
    eager, compiled = rows[0], rows[1]
    assert eager["graphs_compiled"] is None and compiled["graphs_compiled"] >= 1
    table = capsys.readouterr().out
    assert table.count("| tiny | packed, dense mask |") == 2 and "x HF padding-free" in table


def test_padding_free_micro_batches_carry_the_packed_micro_batch_sequences():
    from bert_packed.tasks.pretraining.data import build_data_source

    args = cuda_throughput.parse_args(SMALL)
    spec = {"model": "tiny", "micro_batch_size": 4, "gradient_accumulation": 1, "warmup_steps": 1, "steps": 1,
            "repeats": 1, "num_sequences": 300, "packing_algorithm": args.packing_algorithm, "precision": "fp32",
            "compile": False, "compile_backend": "inductor", "compile_mode": "default", "set": [], "pool_size": 3,
            "hf_sequences_per_micro_batch": None}
    per_micro = cuda_setups.packed_sequences_per_micro_batch(spec)
    assert per_micro > 4, "depth-3 packs of 4 rows hold more than 4 sequences"
    config = cuda_setups.load_config("tiny", cuda_setups._overrides(spec, 1, "sdpa"))
    pool = cuda_setups.padding_free_pool(spec, build_data_source(config, split="train", micro_batch_size=4))
    assert len(pool) == 3 and all(b["input_ids"].shape[0] == per_micro for b in pool)
    flat = cuda_setups.hf_flattened_inputs([pool[0]], flash_kwargs=True)
    counts = cuda_setups.batch_counts(pool[0])
    assert flat["input_ids"].shape == (1, counts["tokens"])
    assert flat["cu_seq_lens_q"].tolist() == [0, *np.cumsum(counts["lengths"]).tolist()]
    assert int((flat["labels"] != -100).sum()) == counts["masked"]


# ----------------------------------------------------------------------------- issue 47: recipe, windows, levers


@pytest.mark.parametrize("argv,message", [
    (["--window-seconds", "-1"], "--window-seconds must be >= 0"),
    (["--window-seconds", "nan"], "--window-seconds must be >= 0"),
    (["--repeats", "0"], "--repeats and --steps >= 1"),
    (["--in-process", "--scaling", "2"], "--in-process runs one process"),
])
def test_bad_window_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    out = tmp_path / "rows.json"
    assert cuda_throughput.main(SMALL + argv + ["--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not out.exists()


def test_a_lever_whose_switch_the_config_lacks_is_not_available_without_a_process():
    lever = cuda_setups.Setup("lever-x", "run.py", 3, "resolved", "x", ("cuda.no_such_switch=true",))
    base = {"num_sequences": 300, "device": "cpu"}
    reason = cuda_throughput._switch_missing(lever, base, "tiny")
    assert reason.startswith("not available: ") and "no_such_switch" in reason
    assert cuda_throughput._switch_missing(cuda_setups.SETUPS["run-py-default"], base, "tiny") is None


def test_rows_keep_the_configs_dropout(tmp_path):
    """The fixed-micro-batch rows train the config's recipe: phase 2's hidden dropout 0.1 reaches the
    model (it was forced to 0 in every setup before)."""
    spec = {"micro_batch_size": 2, "gradient_accumulation": 1, "num_sequences": 300, "packing_algorithm": "lp",
            "precision": "fp32", "warmup_steps": 1, "compile": False, "compile_backend": "inductor",
            "compile_mode": "default", "set": []}
    config = cuda_setups.load_config("phase2", cuda_setups._overrides(spec, 3, "sdpa"))
    assert (config.model.hidden_dropout_prob, config.model.attention_probs_dropout_prob) == (0.1, 0.0)
    assert not any("dropout" in o for o in cuda_setups._overrides(spec, 3, "sdpa"))
    # run.py's rows: nothing but the data's size and the dry run's device.
    assert cuda_setups.run_py_overrides({**spec, "device": "cpu"}, cuda_setups.SETUPS["run-py-default"]) == [
        "data.num_sequences=300", "cuda.device=cpu"]
