"""Per-IPU memory estimate of a pipelined BERT training layout: will it fit before compiling?

A GC200 has 1,472 tiles x 624 KiB = 897 MiB of In-Processor Memory, and a BERT-Large compile
that does not fit fails after tens of minutes. This model tells in milliseconds, per IPU of one
replica, what occupies that memory; ``run.py --compile-only`` then asks Poplar for the real
figure (an offline compile writing its memory report). It is an ESTIMATE: Poplar's report, not
this, decides. Torch-free, like ``ipu/cost_model.py``.

What is counted, per IPU (embeddings and the tied MLM/NSP heads on IPU 0, encoder layers where
``layers_per_ipu`` puts them; Graphcore's PopTorch BERT layout):

* weights, in the model's precision (fp16: 2 bytes per parameter);
* gradient accumulators, in the optimizer's ``accum_type`` (fp16 2 / fp32 4 bytes); the tied
  decoder/embedding weight has one (PopART's TiedGather/TiedGatherAccumulate patterns);
* optimizer state (LAMB/Adam: two fp32 moments, 8 bytes per parameter): none on chip when it
  lives in Streaming Memory (``optimizer_state_offchip``); on chip it is divided by the
  replicas when sharded (replicated tensor sharding);
* stashed activations: pipelined training keeps every in-flight micro-batch's stage input and
  recomputation checkpoints until its backward pass; forward stage i of F holds
  ``2 (F - 1 - i) + 1`` micro-batches (PopART's pipeline schedule);
* live activations: the peak working set of recomputing and back-propagating ONE layer
  (attention scores, probabilities and their gradient, the FFN intermediate, the [B, S, H]
  tensors around them), and on IPU 0 the MLM logits [B, M, V] with their softmax and gradient
  (divided by ``embedding_serialization_factor``); matmul temporaries are capped by the
  available-memory proportion, as Poplar's planner is;
* weight-update transients: the update streams each tensor's optimizer state in and updates
  it in fp32; it runs after the last backward, so its peak (the largest tensor on the IPU x
  16 bytes / shards) counts against the activations', not on top of them;
* code, exchange buffers and control: ``code_bytes`` per IPU, an ASSUMPTION (Poplar's report
  gives the real figure; Graphcore's published BERT profiles put code and exchange in the low
  hundreds of MiB per IPU).

Peak = weights + accumulators + optimizer state + code + max(stash + live, update).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

MIB = 2 ** 20
GC200_MEMORY_BYTES = 1472 * 624 * 1024  # 897 MiB of In-Processor Memory per IPU
DEFAULT_CODE_BYTES = 160 * MIB          # assumption: code + exchange + control per IPU

COLUMNS = ("weights", "accumulators", "optimizer", "stash", "live", "update", "code", "total")


class MemoryEstimateError(ValueError):
    """A layout the estimate cannot describe (one-line message)."""


@dataclass(frozen=True)
class Layout:
    """What the estimate needs besides the model's sizes (``ipu`` section + batch shape)."""

    layers_per_ipu: Sequence[int]
    micro_batch_size: int
    sequence_length: int
    max_masked_tokens_per_pack: int
    replicas: int = 1                     # all replicas (PopRun instances included): RTS shards
    weight_bytes: int = 2                 # fp16 weights
    accumulator_bytes: int = 2            # fp16 gradient accumulators
    optimizer_state_bytes: int = 8        # two fp32 moments
    optimizer_state_offchip: bool = True
    replicated_tensor_sharding: bool = True
    recompute_checkpoint_every_layer: bool = True
    embedding_serialization_factor: int = 1
    available_memory_proportion: Sequence[float] = (0.6,)
    code_bytes: int = DEFAULT_CODE_BYTES
    memory_bytes: int = GC200_MEMORY_BYTES


def _get(config, key):
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    if value is None:
        raise MemoryEstimateError(f"model config has no '{key}' (Hugging Face BERT field names expected)")
    return int(value)


def _parameter_counts(config) -> Dict[str, int]:
    """Parameters of the embeddings, one encoder layer and the heads (decoder weight tied)."""
    h, i, v = _get(config, "hidden_size"), _get(config, "intermediate_size"), _get(config, "vocab_size")
    positions, types = _get(config, "max_position_embeddings"), _get(config, "type_vocab_size")
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    embeddings = (v + positions + types) * h + 2 * h
    heads = (h * h + h) + (h * h + h) + 2 * h + v + (2 * h + 2)  # pooler, MLM transform + LN, bias, NSP
    return {"layer": layer, "embeddings": embeddings, "heads": heads, "largest_embedding": v * h}


def forward_stages(layers_per_ipu: Sequence[int]) -> List[int]:
    """IPU of each forward pipeline stage: embeddings on IPU 0, the encoder layers, the heads back
    on IPU 0 (consecutive blocks on one IPU are one stage)."""
    blocks = [0] + [ipu for ipu, n in enumerate(layers_per_ipu) for _ in range(int(n))] + [0]
    stages = [ipu for k, ipu in enumerate(blocks) if k == 0 or ipu != blocks[k - 1]]
    return stages if len(stages) > 1 else [0]


def estimate_memory(config, layout: Layout) -> Dict[str, object]:
    """Per-IPU bytes of one replica: {"ipus": [{column: bytes}], "limit_bytes", "fits", "table"}."""
    lpi = [int(n) for n in layout.layers_per_ipu]
    if not lpi or any(n < 0 for n in lpi) or sum(lpi) != _get(config, "num_hidden_layers"):
        raise MemoryEstimateError(f"layers_per_ipu {lpi} must be non-negative and sum to num_hidden_layers")
    h, i, a = _get(config, "hidden_size"), _get(config, "intermediate_size"), _get(config, "num_attention_heads")
    v = _get(config, "vocab_size")
    b, s, m = layout.micro_batch_size, layout.sequence_length, layout.max_masked_tokens_per_pack
    act = layout.weight_bytes  # activations in the model's precision
    counts = _parameter_counts(config)
    num_ipus = len(lpi)
    params = [lpi[k] * counts["layer"] for k in range(num_ipus)]
    params[0] += counts["embeddings"] + counts["heads"]
    largest = [counts["layer"] // 3 if lpi[k] else 0 for k in range(num_ipus)]  # FFN matrices ~ 1/3 of a layer
    largest[0] = max(largest[0], counts["largest_embedding"])
    shards = layout.replicas if layout.replicated_tensor_sharding and layout.replicas > 1 else 1

    stages = forward_stages(lpi)
    num_stages = len(stages)
    hidden = b * s * h * act  # one [B, S, H] activation
    scores = b * a * s * s * act
    # What one layer keeps for its backward: its output (a recomputation checkpoint), or without
    # recomputation every activation the backward reads.
    per_layer = hidden if layout.recompute_checkpoint_every_layer else 8 * hidden + 2 * scores + 2 * b * s * i * act
    stash = [0] * num_ipus
    for index, ipu in enumerate(stages):
        in_flight = 2 * (num_stages - 1 - index) + 1 if num_stages > 1 else 1
        heads_stage = num_stages > 1 and index == num_stages - 1
        kept = hidden + (0 if heads_stage else lpi[ipu] * per_layer)  # stage input + its layers' share
        stash[ipu] += in_flight * kept

    proportions = list(layout.available_memory_proportion)
    proportions = proportions * num_ipus if len(proportions) == 1 else proportions
    layer_live = 3 * scores + 3 * b * s * i * act + 10 * hidden  # scores/probs/grad, FFN, [B,S,H] tensors
    logits = b * m * v * act
    heads_live = 3 * logits // max(1, layout.embedding_serialization_factor) + 4 * b * m * h * act
    rows = []
    for k in range(num_ipus):
        live = layer_live if lpi[k] else 0
        if k == 0:
            live = max(live, heads_live)
        live = min(live, int(proportions[k] * layout.memory_bytes) + 10 * hidden)  # planner's cap on temporaries
        optimizer = 0 if layout.optimizer_state_offchip else params[k] * layout.optimizer_state_bytes // shards
        update = largest[k] * (layout.optimizer_state_bytes + 8) // shards  # moments + fp32 grad and weight
        row = {"weights": params[k] * layout.weight_bytes, "accumulators": params[k] * layout.accumulator_bytes,
               "optimizer": optimizer, "stash": stash[k], "live": live, "update": update, "code": layout.code_bytes}
        row["total"] = (row["weights"] + row["accumulators"] + row["optimizer"] + row["code"]
                        + max(row["stash"] + row["live"], row["update"]))
        rows.append(row)
    fits = all(r["total"] <= layout.memory_bytes for r in rows)
    return {"ipus": rows, "limit_bytes": layout.memory_bytes, "fits": fits,
            "per_ipu_bytes": [r["total"] for r in rows], "table": format_table(rows, layout.memory_bytes)}


def format_table(rows: List[Dict[str, int]], limit_bytes: int = GC200_MEMORY_BYTES) -> str:
    """Markdown table in MiB, one row per IPU of a replica."""
    header = "| IPU | " + " | ".join(COLUMNS) + " | fits |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for k, row in enumerate(rows):
        cells = " | ".join(f"{row[c] / MIB:,.0f}" for c in COLUMNS)
        lines.append(f"| {k} | {cells} | {'yes' if row['total'] <= limit_bytes else 'NO'} |")
    lines.append(f"\nMiB per IPU of one replica; limit {limit_bytes / MIB:,.0f} MiB (GC200 In-Processor Memory). "
                 "total = weights + accumulators + optimizer + code + max(stash + live, update). "
                 "An estimate (ipu/memory.py, docs/ipu.md); Poplar's memory report decides.")
    return "\n".join(lines)


def layout_from_config(config, *, replicas: Optional[int] = None) -> Layout:
    """The ``Layout`` of a ``bert_packed.config.Config`` (its ipu, train and data sections)."""
    ipu, d = config.ipu, config.data
    return Layout(layers_per_ipu=list(ipu.layers_per_ipu), micro_batch_size=config.train.micro_batch_size,
                  sequence_length=d.max_sequence_length, max_masked_tokens_per_pack=d.max_masked_tokens_per_pack,
                  replicas=ipu.replication_factor if replicas is None else replicas,
                  weight_bytes=2 if ipu.half_precision else 4, accumulator_bytes=2 if ipu.fp16_accumulators else 4,
                  optimizer_state_offchip=ipu.optimizer_state_offchip,
                  replicated_tensor_sharding=ipu.replicated_tensor_sharding,
                  recompute_checkpoint_every_layer=ipu.recompute_checkpoint_every_layer,
                  embedding_serialization_factor=ipu.embedding_serialization_factor,
                  available_memory_proportion=list(ipu.available_memory_proportion))
