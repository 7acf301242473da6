"""The ``ipu`` config section (backends ``ipu`` and ``mock``) and its validation.

The backend package registers it (``backends/__init__.py``); the IPU code path reads it from
the step plan (``plan.settings``). See the research notes on Graphcore's PopTorch BERT and
docs/ipu.md. Pipeline: one stage per IPU of a replica.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import List, Optional

from bert_packed.config import HARMLESS, bounded
from bert_packed.errors import ConfigError
from bert_packed.limits import LAYERS, VOCABULARY, at_most
from bert_packed.loop.plan import accumulation_for, adjust_gradient_accumulation

# The largest IPU systems (Bow Pod1024) have 1024 IPUs: replicas x IPUs per replica must fit.
MAX_IPUS = 1024
# Host tokens of one call (device_iterations x gradient_accumulation x replicas x micro-batch packs
# x max_sequence_length): the host builds them all before the call; 2^31 tokens are 8 GiB per
# int32 input (Graphcore's BERT phases use about 5e6).
MAX_TOKENS_PER_CALL = 2**31


@dataclass
class IPUConfig:
    """Graphcore IPU settings (backends ``ipu`` and ``mock``)."""

    # Encoder layers on each IPU of one replica; its length is the IPUs per replica and
    # it must sum to model.num_hidden_layers. The embeddings sit on IPU 0; heads tied to the
    # embeddings (the MLM decoder) on IPU 0 too, other task heads on the last IPU.
    layers_per_ipu: List[int] = bounded([3, 7, 7, 7], ge=0, hint="(encoder layers on that IPU)", **LAYERS)
    replication_factor: int = bounded(4, ge=1, **at_most(MAX_IPUS, "the largest IPU systems have 1024 IPUs"))
    # Optimizer steps per host call (PopTorch deviceIterations). A call's logs, checkpoints and
    # Ctrl-C wait for its end, and the host builds all its packs first (see MAX_TOKENS_PER_CALL).
    device_iterations: int = bounded(1, ge=1, **at_most(10**4, "logs, checkpoints and Ctrl-C wait for a call's "
                                                               "end"))
    # What the host gets back per call (PopTorch OutputMode).
    output_mode: str = field(default="sum", metadata={"choices": ("all", "sum", "final", "default")})
    # Fraction of tile memory for matmul/conv temporaries, one per IPU (or one for all).
    available_memory_proportion: List[float] = bounded([0.1, 0.15, 0.15, 0.15], gt=0.0, le=1.0,
                                                       hint="(a fraction of tile memory)")
    enable_half_partials: bool = True
    half_precision: bool = True
    # Gradient accumulators (PopTorch optimizer accum_type): "auto" = fp16 with half_precision
    # (Graphcore's choice: half the memory; PopTorch then keeps a running mean, which cannot
    # overflow), else fp32. LAMB's two moments are always fp32.
    accumulator_dtype: str = field(default="auto", metadata={"choices": ("auto", "fp16", "fp32")})
    stochastic_rounding: bool = True
    # Every gradient is scaled by it in fp16, whose largest value is 65504: at that scale a
    # gradient of 1 already overflows (Graphcore's BERT uses 512 to 16384).
    loss_scaling: float = bounded(8192.0, gt=0.0, **at_most(65504.0, "fp16's largest value; Graphcore's BERT uses "
                                                                     "512 to 16384"))
    # PopTorch's executable cache: BERT-Large compiles for tens of minutes, a cached executable
    # loads in seconds. A relative path is relative to the working directory; null = off.
    executable_cache_dir: Optional[str] = field(default="runs/executable_cache", metadata=HARMLESS)
    synthetic_data: bool = False
    log_cycle_count: bool = field(default=False, metadata=HARMLESS)
    optimizer_state_offchip: bool = True
    replicated_tensor_sharding: bool = True
    recompute_checkpoint_every_layer: bool = True
    auto_round_num_ipus: bool = True
    # Split the tied MLM decoder matmul into this many pieces to fit IPU 0's memory.
    embedding_serialization_factor: int = bounded(2, ge=1, **at_most(VOCABULARY["le"], "it divides "
                                                                                          "model.vocab_size"))

    @property
    def ipus_per_replica(self) -> int:
        return len(self.layers_per_ipu)

    @property
    def fp16_accumulators(self) -> bool:
        return self.accumulator_dtype == "fp16" or (self.accumulator_dtype == "auto" and self.half_precision)


def validate(config, world_size: int = 1) -> List[str]:
    """The ``ipu`` section against the model (bounds are checked by ``bert_packed.config``).

    A layout the user did not give is fitted to the model (``fit_to_model``, noted in the
    returned lines); one given that does not fit is refused with a ``--set`` line that does."""
    ipu, m = config.ipu, config.model
    if not ipu.layers_per_ipu:
        raise ConfigError(f"ipu.layers_per_ipu={ipu.layers_per_ipu}: give one count >= 0 per IPU "
                          f"(encoder layers on that IPU)")
    notes = fit_to_model(config, world_size)
    if ipu.replication_factor * ipu.ipus_per_replica > MAX_IPUS:
        raise ConfigError(f"ipu.replication_factor={ipu.replication_factor} replicas of {ipu.ipus_per_replica} IPUs "
                          f"(ipu.layers_per_ipu) need {ipu.replication_factor * ipu.ipus_per_replica} IPUs; the "
                          f"largest IPU systems have {MAX_IPUS}")
    if sum(ipu.layers_per_ipu) != m.num_hidden_layers:
        raise ConfigError(
            f"ipu.layers_per_ipu={ipu.layers_per_ipu} sums to {sum(ipu.layers_per_ipu)} but "
            f"model.num_hidden_layers={m.num_hidden_layers}; make them agree, e.g. "
            f"{fitting_set_line(config, world_size)}"
        )
    if len(ipu.available_memory_proportion) not in (1, len(ipu.layers_per_ipu)):
        proportions = _proportions(ipu.available_memory_proportion, len(ipu.layers_per_ipu))
        raise ConfigError(
            f"ipu.available_memory_proportion has {len(ipu.available_memory_proportion)} entries; "
            f"give 1 or one per IPU ({len(ipu.layers_per_ipu)}), e.g. "
            f"--set \"ipu.available_memory_proportion={_flow(proportions)}\""
        )
    if m.vocab_size % ipu.embedding_serialization_factor:
        raise ConfigError(
            f"ipu.embedding_serialization_factor={ipu.embedding_serialization_factor} must be >= 1 and divide "
            f"model.vocab_size={m.vocab_size}; pick a divisor (1 = no serialization)"
        )
    _check_attention(m.attention_implementation)
    _check_call_size(config, world_size)
    return notes


# ---------------------------------------------------------------------------------------
# A layout for the model: from the checkpoint's depth, or suggested in a refusal


def _flow(values) -> str:
    """``[0,2,2,2]``: the form a ``--set`` value takes (no blanks, so one shell word)."""
    return "[" + ",".join(str(v) for v in values) + "]"


def spread_layers(num_layers: int, weights: List[int]) -> List[int]:
    """``num_layers`` encoder layers over ``len(weights)`` IPUs in proportion to ``weights`` (a
    layout for another depth), largest remainders first, ties to later IPUs (IPU 0 also holds
    the embeddings): ``spread_layers(6, [3, 7, 7, 7]) == [0, 2, 2, 2]``."""
    total = sum(weights)
    shares = [Fraction(num_layers * w, total) if total else Fraction(num_layers, len(weights)) for w in weights]
    counts = [int(share) for share in shares]  # exact fractions: equal remainders tie exactly
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - counts[i], i), reverse=True)
    for i in by_remainder[:num_layers - sum(counts)]:
        counts[i] += 1
    return counts


def _proportions(proportions: List[float], num_ipus: int) -> List[float]:
    """One memory proportion per IPU of a layout of ``num_ipus`` IPUs from a list for another
    count: the list's first ``num_ipus`` (IPU 0's first), its last repeated beyond its end."""
    return [proportions[min(i, len(proportions) - 1)] for i in range(num_ipus)]


def _accumulation_floor(config, world_size: int) -> int:
    """The fewest micro-batches per replica a step can get (after ``train.packing_adjustment``
    divides them by a packing factor of at most ``data.max_sequences_per_pack``)."""
    t = config.train
    accumulation = max(1, accumulation_for(t, config.ipu.replication_factor * world_size))
    if t.packing_adjustment == "gradient_accumulation":
        accumulation = adjust_gradient_accumulation(accumulation, config.data.max_sequences_per_pack)
    return accumulation


def fitted_layout(config, world_size: int = 1):
    """(layers_per_ipu, available_memory_proportion) for ``model.num_hidden_layers``: the
    configured layout spread over its IPUs, or over fewer when PopTorch's pipeline rule (a
    training pipeline of F forward stages needs 2 F - 1 micro-batches per step) would refuse
    the step's accumulation; the proportions of those IPUs."""
    from ipu.pipeline import forward_stage_ipus

    ipu, layers = config.ipu, config.model.num_hidden_layers
    accumulation = _accumulation_floor(config, world_size)
    for count in range(len(ipu.layers_per_ipu), 0, -1):
        layout = spread_layers(layers, ipu.layers_per_ipu[:count])
        heads = 0 if not config.finetune.task else count - 1  # pre-training's MLM decoder sits with the embeddings
        stages = len(forward_stage_ipus(layout, heads))
        if stages == 1 or 2 * stages - 1 <= accumulation:
            break
    proportions = ipu.available_memory_proportion
    if len(proportions) not in (1, len(layout)):
        proportions = _proportions(proportions, len(layout))
    return layout, list(proportions)


def fitting_set_line(config, world_size: int = 1) -> str:
    """The ``--set`` options of a layout that fits the model (``fitted_layout``), complete: the
    memory proportions too when their count changes."""
    layout, proportions = fitted_layout(config, world_size)
    line = f"--set \"ipu.layers_per_ipu={_flow(layout)}\""
    if proportions != list(config.ipu.available_memory_proportion):
        line += f" --set \"ipu.available_memory_proportion={_flow(proportions)}\""
    return line


def fit_to_model(config, world_size: int = 1) -> List[str]:
    """Fit what the user did not give (``--set``) to the model, in place (in the resolved copy
    ``bert_packed.config.resolve_run`` builds); returns one line per change. The layout follows the
    model when its depth comes from the checkpoint (``model.init_checkpoint``, no ``--set
    model.num_hidden_layers``): the config file's layout is for the model it describes
    (finetune_squad's BERT-Base), not the checkpoint's. The memory proportions follow the
    layout's IPU count."""
    ipu, m, given = config.ipu, config.model, config.cli_keys.get("ipu", set())
    notes: List[str] = []
    from_checkpoint = m.init_checkpoint and "num_hidden_layers" not in config.cli_keys.get("model", set())
    if "layers_per_ipu" not in given and from_checkpoint and sum(ipu.layers_per_ipu) != m.num_hidden_layers:
        before = list(ipu.layers_per_ipu)
        ipu.layers_per_ipu, _ = fitted_layout(config, world_size)
        notes.append(f"ipu.layers_per_ipu={_flow(ipu.layers_per_ipu)} for the checkpoint's {m.num_hidden_layers} "
                     f"encoder layers (the config's {_flow(before)} has {sum(before)}); --set ipu.layers_per_ipu "
                     f"to choose another")
    count = len(ipu.layers_per_ipu)
    if "available_memory_proportion" not in given and len(ipu.available_memory_proportion) not in (1, count):
        ipu.available_memory_proportion = _proportions(ipu.available_memory_proportion, count)
        notes.append(f"ipu.available_memory_proportion={_flow(ipu.available_memory_proportion)}, one per IPU of "
                     f"ipu.layers_per_ipu={_flow(ipu.layers_per_ipu)}")
    return notes


def _check_attention(name: str) -> None:
    """PopTorch compiles one static graph: an attention whose shapes follow the batch cannot run."""
    from bert_packed.model.attention import AttentionError, get_attention

    try:
        static = get_attention(name).static_shapes
    except AttentionError:
        return  # an unknown name is the model config's error (one line there)
    if not static:
        raise ConfigError(f"model.attention_implementation={name} has shapes that depend on each batch; the IPU "
                          f"compiles one static graph: use 'dense' there")


def _check_call_size(config, world_size: int) -> None:
    """The packs of one host call (built on the host before it) within MAX_TOKENS_PER_CALL."""
    ipu, t = config.ipu, config.train
    per_pass = t.micro_batch_size * ipu.replication_factor
    accumulation = max(1, accumulation_for(t, ipu.replication_factor * world_size))
    tokens = ipu.device_iterations * accumulation * per_pass * config.data.max_sequence_length
    if tokens > MAX_TOKENS_PER_CALL:
        raise ConfigError(
            f"one host call holds {tokens} tokens (ipu.device_iterations={ipu.device_iterations} x {accumulation} "
            f"micro-batches per step x ipu.replication_factor={ipu.replication_factor} x train.micro_batch_size="
            f"{t.micro_batch_size} packs x data.max_sequence_length={config.data.max_sequence_length}), more than "
            f"{MAX_TOKENS_PER_CALL}: the host builds them all before the call; lower ipu.device_iterations")
