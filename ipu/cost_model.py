"""An analytical GC200 cost model of one BERT training micro-batch: *estimated* cycles.

The papers measured packing's overhead in IPU hardware cycles because the cycle count of
a fixed, precompiled program is exact where wall-clock time is noisy. Without an IPU we
cannot count cycles, so the mock backend reports this estimate instead, and every figure
derived from it is labelled ``"estimated cycles"``. Nothing here executes the model: the
step is described as a list of operations whose FLOPs and bytes follow from the model
config and the batch shape [B, S] (plus K sequences and M masked tokens per pack), and
each operation is priced with a roofline on the hardware below.

Hardware (IPU-M2000's Colossus Mk2 GC200; sources in the project's PopTorch research
notes, section 7):

- 1,472 tiles clocked at 1.33 GHz;
- fp16 peak 250 TFLOP/s per IPU (AMP units, matmuls); fp32 taken as a quarter of that;
- In-Processor-Memory bandwidth 47.5 TB/s; IPU-Exchange (tile-to-tile) 8 TB/s.

Assumptions (not published figures; change them through :class:`Hardware`):

- matmuls reach ``matmul_efficiency`` (0.5) of peak;
- every other op runs on the tiles' 64-bit vector units: 4 fp16 (2 fp32) flop per tile
  per cycle;
- an op costs ``max(compute, memory) + exchange`` cycles; the backward pass of an op
  costs ``backward_factor`` (2) times its forward; integer mask construction has none;
- the optimizer update (once per optimizer step, not per micro-batch) is not counted.

What separates the two models (the source of packing's overhead):

- the classic padded model (``packed=False``) builds a key-padding bias of shape
  [B, 1, 1, S] and takes NSP from position 0 and plain means for the losses;
- the packed model builds a block-diagonal bias [B, 1, S, S] from ``sequence_ids``
  (more bytes to build, to exchange to every head's tiles and to read in every layer),
  gathers K [CLS] tokens for the pooler/NSP and reduces the losses per sequence with a
  one-hot over K ("loss unpacking").

Breakdown categories (the same ones the profiling report uses for every backend):
``mask`` (mask construction), ``attention`` (masked attention: scores, mask add,
softmax, dropout, context), ``loss_unpacking`` (per-sequence gathers and reductions of
the MLM/NSP losses and accuracies), ``rest`` (everything else).
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

UNIT = "estimated cycles"
CATEGORIES = ("mask", "attention", "loss_unpacking", "rest")
DEFAULT_MAX_MASKED_TOKENS_PER_PACK = 76  # MLPerf's max_predictions_per_seq at S=512


class CostModelError(ValueError):
    """A shape or configuration the cost model cannot price (one-line message)."""


@dataclass(frozen=True)
class Hardware:
    """One IPU. Published figures first, assumptions (documented above) last."""

    name: str = "GC200"
    num_tiles: int = 1472
    clock_hz: float = 1.33e9
    peak_flops_fp16: float = 250e12
    peak_flops_fp32: float = 62.5e12
    memory_bytes_per_second: float = 47.5e12
    exchange_bytes_per_second: float = 8e12
    matmul_efficiency: float = 0.5
    vector_flops_per_tile_cycle_fp16: float = 4.0
    vector_flops_per_tile_cycle_fp32: float = 2.0
    backward_factor: float = 2.0


GC200 = Hardware()


@dataclass
class Op:
    """One operation of the forward pass, with the work it implies.

    ``flops`` and ``bytes`` (memory read + written) are for the forward pass;
    ``exchange_bytes`` are moved between tiles; ``backward`` says whether the op has a
    gradient to compute in training. ``count`` repeats the op (e.g. once per layer).
    """

    name: str
    category: str
    kind: str  # "matmul" | "vector"
    flops: float
    bytes: float
    exchange_bytes: float = 0.0
    backward: bool = True
    stage: int = 0
    count: int = 1
    cycles: float = field(default=0.0)


def _get(config, key, default=None):
    """Read a field from a dataclass, an object or a dict (Hugging Face field names)."""
    if isinstance(config, dict):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    if value is None:
        raise CostModelError(f"model config has no '{key}'; pass a BertConfig with Hugging Face field names")
    return value


def _stage_of_layers(num_layers: int, num_stages: int, layers_per_ipu: Optional[Sequence[int]]) -> List[int]:
    """Stage index of every encoder layer (embeddings and heads live on stage 0)."""
    if layers_per_ipu is None:
        if num_stages < 1:
            raise CostModelError(f"num_ipus_per_replica must be >= 1, got {num_stages}")
        base, extra = divmod(num_layers, num_stages)
        layers_per_ipu = [base + (1 if i < extra else 0) for i in range(num_stages)]
    layers_per_ipu = [int(n) for n in layers_per_ipu]
    if any(n < 0 for n in layers_per_ipu) or sum(layers_per_ipu) != num_layers:
        raise CostModelError(
            f"layers_per_ipu {layers_per_ipu} must be non-negative and sum to num_hidden_layers={num_layers}")
    stages = []
    for stage, n in enumerate(layers_per_ipu):
        stages.extend([stage] * n)
    return stages


def _add_head_ops(add, *, B: int, K: int, H: int, V: int, M: int, b: int, ids: int, packed: bool) -> None:
    """The heads' operations of :func:`build_ops` (``add`` appends one), on stage 0 with the tied
    word embeddings, as in Graphcore's pipelined BERT."""
    # NSP: the classic model slices position 0; the packed one gathers K [CLS] tokens.
    if packed:
        add("heads/cls_gather", "loss_unpacking", "vector", 0, B * K * (ids + 2 * H * b), B * K * H * b)
    else:
        add("heads/cls_slice", "rest", "vector", 0, 2 * B * H * b, B * H * b)
    add("heads/pooler", "rest", "matmul", 2 * B * K * H * H, (2 * B * K * H + H * H) * b)
    add("heads/pooler_tanh", "rest", "vector", 4 * B * K * H, 2 * B * K * H * b)
    add("heads/nsp", "rest", "matmul", 2 * B * K * H * 2, (B * K * H + 2 * H + B * K * 2) * b)
    add("heads/nsp_log_softmax", "rest", "vector", 10 * B * K, 4 * B * K * b)
    # MLM: M masked positions per pack, the same M for the padded and the packed model.
    masked = B * M
    add("heads/mlm_gather", "rest", "vector", 0, masked * (ids + 2 * H * b), masked * H * b)
    add("heads/mlm_transform", "rest", "matmul", 2 * masked * H * H, (2 * masked * H + H * H) * b)
    add("heads/mlm_transform_gelu_layernorm", "rest", "vector", 20 * masked * H, 4 * masked * H * b)
    add("heads/mlm_decoder", "rest", "matmul", 2 * masked * H * V, (masked * H + H * V + masked * V) * b)
    add("heads/mlm_log_softmax", "rest", "vector", 5 * masked * V, 2 * masked * V * b)
    add("heads/mlm_label_pick_accuracy", "rest", "vector", 2 * masked * V, masked * (V * b + 2 * ids))
    # Loss and accuracy reductions: plain weighted means, or per sequence (one-hot over K).
    if packed:
        add("heads/mlm_per_sequence", "loss_unpacking", "vector", 4 * masked * K,
            masked * (ids + 2 * b) + masked * K * b + 2 * B * K * b)
        add("heads/nsp_per_sequence", "loss_unpacking", "vector", 6 * B * K, B * K * (ids + 3 * b))
    else:
        add("heads/mlm_mean", "loss_unpacking", "vector", 3 * masked, masked * (ids + 2 * b))
        add("heads/nsp_mean", "loss_unpacking", "vector", 3 * B, B * (ids + 2 * b))


def build_ops(config, *, micro_batch_size: int, sequence_length: int, max_sequences_per_pack: int = 1,
              packed: bool = True, training: bool = True, precision: str = "fp16",
              max_masked_tokens_per_pack: Optional[int] = None, num_ipus_per_replica: int = 1,
              layers_per_ipu: Optional[Sequence[int]] = None) -> List[Op]:
    """The forward operations of one micro-batch of B = micro_batch_size packs of S tokens.

    With ``packed=False`` the classic padded model is described (K = 1 whatever
    ``max_sequences_per_pack`` says). Training adds dropout (its backward is priced later).
    """
    B, S = int(micro_batch_size), int(sequence_length)
    K = int(max_sequences_per_pack) if packed else 1
    if B < 1 or S < 1 or K < 1:
        raise CostModelError(f"micro_batch_size, sequence_length and max_sequences_per_pack must be >= 1 "
                             f"(got {B}, {S}, {K})")
    if precision not in ("fp16", "fp32"):
        raise CostModelError(f"precision must be 'fp16' or 'fp32', got {precision!r}")
    H = int(_get(config, "hidden_size"))
    A = int(_get(config, "num_attention_heads"))
    I = int(_get(config, "intermediate_size"))
    V = int(_get(config, "vocab_size"))
    L = int(_get(config, "num_hidden_layers"))
    if max_masked_tokens_per_pack is None:
        M = _get(config, "max_masked_tokens_per_pack", DEFAULT_MAX_MASKED_TOKENS_PER_PACK)
    else:
        M = max_masked_tokens_per_pack
    M = int(M)
    D = H // A
    b = 2 if precision == "fp16" else 4  # activation/weight bytes
    ids = 4  # the IPU has no int64: indices travel as int32
    layer_stage = _stage_of_layers(L, int(num_ipus_per_replica), layers_per_ipu)

    ops: List[Op] = []

    def add(name, category, kind, flops, nbytes, exchange=0.0, backward=True, stage=0, count=1):
        ops.append(Op(name, category, kind, float(flops), float(nbytes), float(exchange), backward, stage, count))

    # Embeddings: three table lookups (an exchange on the IPU: rows live on other tiles),
    # their sum and a layer norm.
    tokens = B * S
    add("embeddings/word_gather", "rest", "vector", 0, tokens * (ids + 2 * H * b), tokens * H * b)
    add("embeddings/position_gather", "rest", "vector", 0, tokens * (ids + 2 * H * b), tokens * H * b)
    add("embeddings/segment_gather", "rest", "vector", 0, tokens * (ids + 2 * H * b), tokens * H * b)
    add("embeddings/sum_layernorm_dropout", "rest", "vector", 12 * tokens * H, 5 * tokens * H * b)

    # Attention mask, built once per forward and read by every layer.
    if packed:
        pair = B * S * S
        # sequence_ids[:, :, None] == sequence_ids[:, None, :], & (ids != 0), -> additive bias.
        # Every tile building rows of the [S, S] block needs the pack's whole id vector.
        add("mask/block_diagonal", "mask", "vector", 3 * pair, pair * (1 + 1 + b) + 2 * B * S * ids,
            pair * ids, backward=False)
        mask_bytes = pair * b
    else:
        add("mask/key_padding", "mask", "vector", 2 * B * S, B * S * (ids + 1 + b), 0, backward=False)
        mask_bytes = B * S * b

    scores = B * A * S * S
    for layer in range(L):
        stage = layer_stage[layer]
        p = f"layer{layer}/"
        add(p + "qkv", "rest", "matmul", 2 * tokens * H * 3 * H, (tokens * H + 3 * H * H + tokens * 3 * H) * b,
            stage=stage)
        add(p + "scores", "attention", "matmul", 2 * scores * D, (2 * tokens * H + scores) * b, stage=stage)
        # Scale and add the bias: the bias must reach the tiles of every head.
        add(p + "mask_add", "attention", "vector", 2 * scores, 2 * scores * b + mask_bytes, A * mask_bytes,
            stage=stage)
        add(p + "softmax", "attention", "vector", 5 * scores, 2 * scores * b, stage=stage)
        if training:
            add(p + "attention_dropout", "attention", "vector", 2 * scores, 2 * scores * b, stage=stage)
        add(p + "context", "attention", "matmul", 2 * scores * D, (scores + 2 * tokens * H) * b, stage=stage)
        add(p + "output", "rest", "matmul", 2 * tokens * H * H, (2 * tokens * H + H * H) * b, stage=stage)
        add(p + "output_residual_layernorm", "rest", "vector", 12 * tokens * H, 4 * tokens * H * b, stage=stage)
        add(p + "ffn_in", "rest", "matmul", 2 * tokens * H * I, (tokens * H + H * I + tokens * I) * b, stage=stage)
        add(p + "gelu", "rest", "vector", 8 * tokens * I, 2 * tokens * I * b, stage=stage)
        add(p + "ffn_out", "rest", "matmul", 2 * tokens * I * H, (tokens * I + I * H + tokens * H) * b, stage=stage)
        add(p + "ffn_residual_layernorm", "rest", "vector", 12 * tokens * H, 4 * tokens * H * b, stage=stage)

    _add_head_ops(add, B=B, K=K, H=H, V=V, M=M, b=b, ids=ids, packed=packed)
    return ops


def price_ops(ops: List[Op], *, training: bool = True, precision: str = "fp16",
              hardware: Hardware = GC200) -> List[Op]:
    """Fill ``op.cycles`` (forward, plus backward in training) with the roofline estimate."""
    peak = hardware.peak_flops_fp16 if precision == "fp16" else hardware.peak_flops_fp32
    matmul_per_cycle = peak / hardware.clock_hz * hardware.matmul_efficiency
    vector_per_tile = (hardware.vector_flops_per_tile_cycle_fp16 if precision == "fp16"
                       else hardware.vector_flops_per_tile_cycle_fp32)
    vector_per_cycle = vector_per_tile * hardware.num_tiles
    memory_per_cycle = hardware.memory_bytes_per_second / hardware.clock_hz
    exchange_per_cycle = hardware.exchange_bytes_per_second / hardware.clock_hz
    for op in ops:
        per_cycle = matmul_per_cycle if op.kind == "matmul" else vector_per_cycle
        forward = max(op.flops / per_cycle, op.bytes / memory_per_cycle) + op.exchange_bytes / exchange_per_cycle
        factor = 1.0 + (hardware.backward_factor if (training and op.backward) else 0.0)
        op.cycles = forward * factor * op.count
    return ops


def estimate_cycles(config, *, micro_batch_size: int, sequence_length: int, max_sequences_per_pack: int = 1,
                    packed: bool = True, num_ipus_per_replica: int = 1, training: bool = True,
                    layers_per_ipu: Optional[Sequence[int]] = None, precision: str = "fp16",
                    max_masked_tokens_per_pack: Optional[int] = None, hardware: Hardware = GC200) -> Dict:
    """Estimated GC200 cycles of ONE micro-batch forward (+ backward when training) on one replica.

    Args:
        config: the model config (object or dict with Hugging Face field names:
            hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
            vocab_size; optionally max_masked_tokens_per_pack).
        micro_batch_size, sequence_length: the batch shape [B, S] (packs of S tokens).
        max_sequences_per_pack: K, the packing depth (ignored when ``packed=False``).
        packed: the packed model (block-diagonal mask, per-sequence losses) or the classic
            padded one.
        num_ipus_per_replica, layers_per_ipu: pipeline layout; with more than one IPU the
            total is the bottleneck stage's cycles (embeddings and heads on stage 0).
        precision: "fp16" or "fp32".

    Returns:
        {"total": int, "unit": "estimated cycles",
         "breakdown": {"mask", "attention", "loss_unpacking", "rest"} -> int (of the
         bottleneck stage; sums to total), "flops": float (all stages, forward and
         backward), "bytes": float (forward memory traffic), "stages": [int per IPU]}.
    """
    ops = build_ops(config, micro_batch_size=micro_batch_size, sequence_length=sequence_length,
                    max_sequences_per_pack=max_sequences_per_pack, packed=packed, training=training,
                    precision=precision, max_masked_tokens_per_pack=max_masked_tokens_per_pack,
                    num_ipus_per_replica=num_ipus_per_replica, layers_per_ipu=layers_per_ipu)
    price_ops(ops, training=training, precision=precision, hardware=hardware)
    num_stages = max(op.stage for op in ops) + 1
    if layers_per_ipu is not None:
        num_stages = len(layers_per_ipu)
    stage_cycles = [0.0] * num_stages
    for op in ops:
        stage_cycles[op.stage] += op.cycles
    bottleneck = max(range(num_stages), key=lambda s: stage_cycles[s])
    breakdown = {name: 0.0 for name in CATEGORIES}
    for op in ops:
        if op.stage == bottleneck:
            breakdown[op.category] += op.cycles
    breakdown_int = {name: int(round(value)) for name, value in breakdown.items()}
    backward = 1.0 + hardware.backward_factor if training else 1.0
    flops = sum(op.flops * op.count * (backward if op.backward else 1.0) for op in ops)
    return {
        "total": sum(breakdown_int.values()),
        "unit": UNIT,
        "breakdown": breakdown_int,
        "flops": flops,
        "bytes": sum(op.bytes * op.count for op in ops),
        "stages": [int(round(c)) for c in stage_cycles],
    }


def cycles_to_seconds(cycles: float, hardware: Hardware = GC200) -> float:
    """Seconds a cycle count takes at the tile clock (1.33 GHz on a GC200)."""
    return float(cycles) / hardware.clock_hz
