"""The GC200 cost model: its arithmetic, its scaling, and the overhead it attributes to packing."""
import os
import subprocess
import sys

import pytest

from ipu.cost_model import GC200, CostModelError, Hardware, Op, estimate_cycles, price_ops

BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                  vocab_size=30522, max_masked_tokens_per_pack=76)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=100)


def test_a_matmul_is_priced_at_the_stated_fraction_of_fp16_peak():
    # 1 GFLOP matmul, negligible bytes: forward = 1e9 / (250e12 / 1.33e9 * 0.5) cycles, and
    # training adds a backward of twice that.
    op = Op("m", "rest", "matmul", flops=1e9, bytes=8.0)
    price_ops([op], training=True, precision="fp16")
    flop_per_cycle = 250e12 / 1.33e9 * 0.5
    assert op.cycles == pytest.approx(3 * 1e9 / flop_per_cycle, rel=1e-12)


def test_a_memory_bound_op_pays_bandwidth_plus_exchange():
    op = Op("v", "rest", "vector", flops=1.0, bytes=47.5e6, exchange_bytes=8e6, backward=False)
    price_ops([op], training=True, hardware=GC200)
    # 47.5 MB at 47.5 TB/s = 1 us; 8 MB at 8 TB/s = 1 us; 2 us at 1.33 GHz.
    assert op.cycles == pytest.approx(2e-6 * 1.33e9, rel=1e-9)


def test_breakdown_sums_to_total_and_uses_the_report_categories():
    cost = estimate_cycles(BERT_LARGE, micro_batch_size=2, sequence_length=512, max_sequences_per_pack=3)
    assert set(cost["breakdown"]) == {"mask", "attention", "loss_unpacking", "rest"}
    assert cost["total"] == sum(cost["breakdown"].values())
    assert cost["unit"] == "estimated cycles"


def test_training_flops_match_an_independent_count_of_bert_matmuls():
    # Independent count: per layer 2*T*(4H^2 + 2HI) projection flops + 4*B*S^2*H attention flops,
    # plus the MLM head on B*M tokens (transform H^2 + decoder H*V) and pooler/NSP; x3 for training.
    B, S, H, I, L, V, M = 2, 512, 1024, 4096, 24, 30522, 76
    T = B * S
    forward = L * (2 * T * (4 * H * H + 2 * H * I) + 4 * B * S * S * H) + 2 * B * M * (H * H + H * V)
    cost = estimate_cycles(BERT_LARGE, micro_batch_size=B, sequence_length=S, packed=False)
    # Vector ops add a few per cent of flops on top of the matmuls.
    assert 3 * forward <= cost["flops"] <= 1.05 * 3 * forward


def test_cycles_scale_with_the_batch_and_precision():
    one = estimate_cycles(BERT_LARGE, micro_batch_size=1, sequence_length=512, packed=False)["total"]
    four = estimate_cycles(BERT_LARGE, micro_batch_size=4, sequence_length=512, packed=False)["total"]
    assert 3.6 < four / one <= 4.0  # weights are read once per op, activations scale with B
    fp32 = estimate_cycles(BERT_LARGE, micro_batch_size=1, sequence_length=512, packed=False, precision="fp32")
    assert fp32["total"] > 2 * one


def test_packing_overhead_is_small_positive_and_grows_with_depth():
    base = estimate_cycles(BERT_LARGE, micro_batch_size=2, sequence_length=512, packed=False)["total"]
    overheads = []
    for depth in (2, 3, 4, 8, 16):
        packed = estimate_cycles(BERT_LARGE, micro_batch_size=2, sequence_length=512, max_sequences_per_pack=depth)
        overheads.append(packed["total"] / base - 1)
    assert all(0 < o < 0.10 for o in overheads)
    assert overheads == sorted(overheads)


def test_the_packed_mask_costs_more_than_the_padding_mask():
    kwargs = dict(micro_batch_size=2, sequence_length=512)
    padded = estimate_cycles(BERT_LARGE, packed=False, **kwargs)["breakdown"]
    packed = estimate_cycles(BERT_LARGE, max_sequences_per_pack=3, **kwargs)["breakdown"]
    assert packed["mask"] > padded["mask"]
    assert packed["attention"] > padded["attention"]
    assert packed["loss_unpacking"] > padded["loss_unpacking"]


def test_pipelined_total_is_the_bottleneck_stage():
    single = estimate_cycles(BERT_LARGE, micro_batch_size=2, sequence_length=512, max_sequences_per_pack=3)
    piped = estimate_cycles(BERT_LARGE, micro_batch_size=2, sequence_length=512, max_sequences_per_pack=3,
                            num_ipus_per_replica=4, layers_per_ipu=[3, 7, 7, 7])
    assert len(piped["stages"]) == 4
    assert piped["total"] == max(piped["stages"])
    assert sum(piped["stages"]) == pytest.approx(single["total"], abs=8)  # rounding per stage
    assert piped["total"] >= single["total"] / 4


def test_bad_layouts_and_configs_raise_one_line_errors():
    with pytest.raises(CostModelError, match="sum to num_hidden_layers"):
        estimate_cycles(TINY, micro_batch_size=1, sequence_length=8, num_ipus_per_replica=2, layers_per_ipu=[1, 2])
    with pytest.raises(CostModelError, match="hidden_size"):
        estimate_cycles({}, micro_batch_size=1, sequence_length=8)
    with pytest.raises(CostModelError, match="precision"):
        estimate_cycles(TINY, micro_batch_size=1, sequence_length=8, precision="bf8")
    assert issubclass(CostModelError, ValueError)


def test_hardware_is_overridable():
    slow = Hardware(matmul_efficiency=0.25)
    fast = estimate_cycles(TINY, micro_batch_size=4, sequence_length=128)["total"]
    assert estimate_cycles(TINY, micro_batch_size=4, sequence_length=128, hardware=slow)["total"] > fast


def test_the_cost_model_imports_no_torch():
    # Loaded as a file, so the check covers this module and not the package around it.
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ipu", "cost_model.py")
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('cm', %r); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "assert 'torch' not in sys.modules and 'poptorch' not in sys.modules" % path)
    subprocess.run([sys.executable, "-c", code], check=True)
