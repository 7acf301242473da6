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

Per tile (``largest_tensors``, ``format_tile_table``): Poplar runs out of memory on a TILE
(624 KiB on a GC200), not on an IPU: an IPU is as full as its fullest tile. So besides the
per-IPU totals the estimate lists the largest single tensors of each IPU (the word-embedding
table and its accumulator, the tied decoder's weight gradient, the MLM logits, the attention
scores, the FFN weights and intermediate) with what one tile holds if each is spread evenly over
the 1,472 tiles, against the tile and, for matmul temporaries, against the share the
available-memory proportion gives them; and what Graphcore's BERT does about each. What only a
real compile can tell: the tile mapping Poplar's planner picks (gathers, exchange buffers, vertex
state and code are not spread evenly), hence the fullest tile; the out-of-memory error names
the tiles over, and the report of ``run.py --backend ipu ... --compile-only report`` shows memory per tile.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

MIB = 2 ** 20
GC200_TILES = 1472
GC200_TILE_BYTES = 624 * 1024           # In-Processor Memory of one tile
GC200_MEMORY_BYTES = GC200_TILES * GC200_TILE_BYTES  # 897 MiB per IPU
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


def parameter_counts(config) -> Dict[str, int]:
    """Parameters of the embeddings, one encoder layer and the pre-training heads (decoder weight
    tied), from the model's shape (a model section, ``BertConfig`` or config.json dict); the cuda
    backend's memory fit counts the same way."""
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
    counts = parameter_counts(config)
    num_ipus = len(lpi)
    params = [lpi[k] * counts["layer"] for k in range(num_ipus)]
    params[0] += counts["embeddings"] + counts["heads"]
    largest = [counts["layer"] // 3 if lpi[k] else 0 for k in range(num_ipus)]  # FFN matrices ~ 1/3 of a layer
    largest[0] = max(largest[0], counts["largest_embedding"])
    shards = layout.replicas if layout.replicated_tensor_sharding and layout.replicas > 1 else 1

    hidden = b * s * h * act  # one [B, S, H] activation
    scores = b * a * s * s * act
    stash = estimate_stash(config, layout)

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
    tensors = largest_tensors(config, layout)
    return {"ipus": rows, "limit_bytes": layout.memory_bytes, "fits": fits,
            "per_ipu_bytes": [r["total"] for r in rows], "table": format_table(rows, layout.memory_bytes),
            "largest_tensors": tensors, "tile_table": format_tile_table(tensors, rows)}


# What Graphcore's PopTorch BERT (graphcore/examples nlp/bert/pytorch modeling.py, ipu_options.py)
# does about each large tensor, and what this project does.
MITIGATIONS = {
    "word_embeddings": "one table for the lookup and the tied MLM decoder (PopART TiedGather); Graphcore's QA model "
                       "also splits the lookup (SerializedEmbedding, 'to reduce memory in the embedding gradient')",
    "word_embeddings_accumulator": "one accumulator for both uses (TiedGatherAccumulate); fp16 (accum_type); "
                                   "the LAMB moments live in Streaming Memory, sharded over the replicas",
    "decoder_weight_gradient": "serialised decoder matmul (poptorch.serializedMatMul, OutputChannels: "
                               "ipu.embedding_serialization_factor pieces, Graphcore's SerializedLinear)",
    "mlm_logits": "decoder only on the masked slots (Graphcore: OnehotGather; here mlm_positions), fp16 cross "
                  "entropy (no fp32 copy), serialised matmul",
    "attention_scores": "recomputation checkpoint after every layer (one layer's scores live at a time); matmul "
                        "temporaries capped by ipu.available_memory_proportion",
    "ffn_intermediate": "recomputation checkpoints; available_memory_proportion",
    "ffn_weight": "layers_per_ipu (fewer layers on a fuller IPU)",
    "pipeline_stash": "recomputation checkpoints (only layer outputs are stashed); Graphcore keeps the embeddings' "
                      "LayerNorm out of the encoder's outlined code, which 'improves the tile mapping of the "
                      "pipeline stashes'",
}


def largest_tensors(config, layout: Layout) -> List[Dict[str, object]]:
    """The largest single tensors of each IPU of one replica, against ONE tile.

    Each row: ``ipu``, ``tensor``, ``shape``, ``bytes``, ``kind`` (``always live`` weights and
    accumulators, ``temporary`` for activations that live within one layer's pass, ``stash``),
    ``per_tile_bytes`` (bytes / 1,472: what one tile holds if Poplar spreads it evenly, the
    least its fullest tile holds), ``tile_fraction`` (of 624 KiB), for temporaries that are
    matmul outputs or partials ``budget_fraction`` (of the available-memory proportion's share of
    a tile, which Poplar's matmul planner aims to keep its temporaries within), and
    ``mitigation`` (what Graphcore's BERT does about it).
    """
    lpi = [int(n) for n in layout.layers_per_ipu]
    h, i, a = _get(config, "hidden_size"), _get(config, "intermediate_size"), _get(config, "num_attention_heads")
    v = _get(config, "vocab_size")
    b, s, m = layout.micro_batch_size, layout.sequence_length, layout.max_masked_tokens_per_pack
    act, serial = layout.weight_bytes, max(1, layout.embedding_serialization_factor)
    proportions = list(layout.available_memory_proportion)
    proportions = proportions * len(lpi) if len(proportions) == 1 else proportions
    tile = layout.memory_bytes // GC200_TILES
    dtype = {2: "fp16", 4: "fp32"}

    def row(ipu, name, shape, element_bytes, kind, matmul=False):
        size = element_bytes
        for dim in shape:
            size *= int(dim)
        per_tile = size / GC200_TILES
        entry = {"ipu": ipu, "tensor": name, "shape": [int(d) for d in shape], "dtype": dtype[element_bytes],
                 "bytes": size, "kind": kind, "per_tile_bytes": per_tile, "tile_fraction": per_tile / tile,
                 "budget_fraction": per_tile / (proportions[ipu] * tile) if matmul else None,
                 "mitigation": MITIGATIONS[name]}
        return entry

    rows = [row(0, "word_embeddings", (v, h), layout.weight_bytes, "always live"),
            row(0, "word_embeddings_accumulator", (v, h), layout.accumulator_bytes, "always live"),
            row(0, "decoder_weight_gradient", (h, v // serial), act, "temporary", matmul=True),
            row(0, "mlm_logits", (b, m, v), act, "temporary", matmul=True)]
    stash = estimate_stash(config, layout)
    for ipu, layers in enumerate(lpi):
        if layers:
            rows.append(row(ipu, "attention_scores", (b, a, s, s), act, "temporary", matmul=True))
            rows.append(row(ipu, "ffn_intermediate", (b, s, i), act, "temporary", matmul=True))
            rows.append(row(ipu, "ffn_weight", (h, i), layout.weight_bytes, "always live"))
        if stash[ipu]:
            entry = row(ipu, "pipeline_stash", (stash[ipu] // act,), act, "stash")
            entry["shape"] = []  # many buffers, not one tensor: bytes only
            rows.append(entry)
    return sorted(rows, key=lambda r: (r["ipu"], -r["bytes"]))


def estimate_stash(config, layout: Layout) -> List[int]:
    """Stash bytes per IPU: pipelined training keeps each in-flight micro-batch's stage input and
    its layers' share until its backward; forward stage i of F holds 2 (F - 1 - i) + 1 of them."""
    lpi = [int(n) for n in layout.layers_per_ipu]
    h, i, a = _get(config, "hidden_size"), _get(config, "intermediate_size"), _get(config, "num_attention_heads")
    b, s, act = layout.micro_batch_size, layout.sequence_length, layout.weight_bytes
    hidden, scores = b * s * h * act, b * a * s * s * act
    # What one layer keeps for its backward: its output (a recomputation checkpoint), or without
    # recomputation every activation the backward reads.
    per_layer = hidden if layout.recompute_checkpoint_every_layer else 8 * hidden + 2 * scores + 2 * b * s * i * act
    stages = forward_stages(lpi)
    stash = [0] * len(lpi)
    for index, ipu in enumerate(stages):
        in_flight = 2 * (len(stages) - 1 - index) + 1 if len(stages) > 1 else 1
        heads_stage = len(stages) > 1 and index == len(stages) - 1
        stash[ipu] += in_flight * (hidden + (0 if heads_stage else lpi[ipu] * per_layer))  # input + layers' share
    return stash


def format_tile_table(tensors: List[Dict[str, object]], rows: List[Dict[str, int]]) -> str:
    """Markdown: the largest tensors per IPU against one tile, then each IPU's average per tile."""
    tile_kib = GC200_TILE_BYTES / 1024
    lines = [f"Largest single tensors per IPU against one tile ({tile_kib:,.0f} KiB; spread evenly over "
             f"{GC200_TILES:,} tiles, the least the fullest tile holds):", "",
             "| IPU | tensor | shape | dtype | MiB | kind | KiB per tile | % of a tile | % of the matmul share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t in tensors:
        shape = "x".join(str(d) for d in t["shape"]) or "(buffers)"
        budget = f"{100 * t['budget_fraction']:.0f}" if t["budget_fraction"] is not None else ""
        lines.append(f"| {t['ipu']} | {t['tensor']} | {shape} | {t['dtype']} | {t['bytes'] / MIB:,.1f} | {t['kind']} | "
                     f"{t['per_tile_bytes'] / 1024:,.1f} | {100 * t['tile_fraction']:.1f} | {budget} |")
    lines += ["", "| IPU | estimated total MiB | average KiB per tile | % of a tile |", "|---|---|---|---|"]
    for k, row in enumerate(rows):
        average = row["total"] / GC200_TILES
        lines.append(f"| {k} | {row['total'] / MIB:,.0f} | {average / 1024:,.0f} | "
                     f"{100 * average / GC200_TILE_BYTES:.0f} |")
    lines.append("\n% of the matmul share: of available_memory_proportion x 624 KiB, the part of a tile the matmul "
                 "planner aims to keep its temporaries within. Only a real compile tells the tile mapping (gathers, "
                 "exchange buffers, vertex state and code are not spread evenly), hence the fullest tile: Poplar's "
                 "out-of-memory error names the tiles over; `run.py --backend ipu ... --compile-only report` writes the per-tile "
                 "report. What Graphcore's BERT does about each tensor: docs/ipu.md.")
    return "\n".join(lines)


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
