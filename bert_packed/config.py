"""Configuration: YAML files mapped onto documented dataclasses.

Precedence: ``--set section.key=value`` on the command line > the YAML file > the
defaults written below. Unknown sections/keys and values of the wrong type are rejected
with one line (:class:`ConfigError`); a setting that does not apply to the chosen backend
(e.g. ``--set ipu.replication_factor=2`` when training on ``cpu``) gets a warning.

A config NAME resolves to ``configs/NAME`` or ``configs/NAME.yaml`` (relative to the
repository), or to a path to a YAML file.

    python -m bert_packed.config phase2            # print the resolved config
    python -m bert_packed.config phase2 --backend mock --set train.steps=10

Counting conventions used throughout: a *pack* is one fixed-shape row of
``max_sequence_length`` tokens holding up to ``max_sequences_per_pack`` sequences (an
unpacked/padded row is a pack with one sequence). ``micro_batch_size`` counts packs per
replica per forward pass; a *replica* is one data-parallel copy of the model (a torchrun
process on cpu/cuda, ``replication_factor`` x processes on the IPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO_ROOT, "configs")


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line naming the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a command-line mistake as one line and exit 2, like every other
    user mistake (argparse's default prints the usage block first). For run.py and our CLIs."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _choices(*values: str) -> Dict[str, Any]:
    return {"choices": values}


# ---------------------------------------------------------------------------------------
# Sections. Every field has a default so a YAML file only states what differs.


@dataclass
class ModelConfig:
    """The BERT architecture (Hugging Face ``BertConfig`` field names)."""

    vocab_size: int = 30522
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    # Name in bert_packed.attention's registry; "dense" runs everywhere (IPU included).
    attention_implementation: str = "dense"
    # "token": mean over the masked tokens of the step (canonical BERT);
    # "sequence": mean per sequence, then over sequences (the paper's Listing 1).
    mlm_loss_normalization: str = field(default="token", metadata=_choices("token", "sequence"))
    # Hugging Face BERT directory or this project's checkpoint to start from (null = random
    # init); the model's shape then comes from the checkpoint (bert_packed/hf_io.py).
    init_checkpoint: Optional[str] = None
    # Tokenizer shipped with the Hugging Face export (a tokenizer directory or vocab.txt);
    # null = the init checkpoint's.
    tokenizer: Optional[str] = None
    pad_token_id: Optional[int] = 0
    tie_word_embeddings: bool = True
    # Dropout before a task head; null = hidden_dropout_prob (Hugging Face's rule).
    classifier_dropout: Optional[float] = None


@dataclass
class DataConfig:
    """Where packs come from and how they are shaped.

    ``path: null`` means generated data: sequence lengths drawn from ``histogram``,
    packed with ``packing_algorithm`` at depth ``max_sequences_per_pack``, random tokens
    from seeded Zipf-distributed word pairs (so the MLM loss has something to learn), 15 % MLM,
    random NSP labels. With ``path`` set, the HDF5 reader (bert_packed.data.hdf5) is used.
    """

    path: Optional[str] = None
    # Held-out HDF5 data for evaluation (with path set); generated data makes its own.
    eval_path: Optional[str] = None
    max_sequence_length: int = 512
    # Packing depth K; 1 = classic padded BERT (one sequence per row).
    max_sequences_per_pack: int = 3
    packing_algorithm: str = "lpfhp"
    # Masked-token budget of ONE full-length sequence (76 at S=512, 20 at S=128);
    # a pack gets max_masked_tokens + max_sequences_per_pack - 1 slots because rounding
    # 15 % per sequence can add up to one token per extra sequence.
    max_masked_tokens: int = 76
    mask_probability: float = 0.15
    # Generated data only ------------------------------------------------------------
    histogram: str = "wikipedia-512"
    # How histogram lengths map onto max_sequence_length when they differ:
    # "scale" keeps the shape (about 50 % padding at any S, the Wikipedia-512 case),
    # "truncate" clips long sequences to S (what create_pretraining_data does at S=128).
    length_mapping: str = field(default="scale", metadata=_choices("scale", "truncate"))
    # Sequences per epoch of generated training data (packed once, then cycled).
    num_sequences: int = 20000
    num_eval_sequences: int = 2000

    @property
    def max_masked_tokens_per_pack(self) -> int:
        return self.max_masked_tokens + self.max_sequences_per_pack - 1


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule (bert_packed.optim)."""

    name: str = field(default="lamb", metadata=_choices("lamb", "adamw"))
    learning_rate: float = 0.002828
    # Fraction of train.steps spent warming up linearly from 0.
    warmup_fraction: float = 0.128
    schedule: str = field(default="linear", metadata=_choices("linear", "constant"))
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    # Global gradient-norm clip; null = none (LAMB's trust ratio already bounds steps).
    max_grad_norm: Optional[float] = None
    # LAMB trust ratio phi(||w||) / ||u|| with phi(z) = min(z, max_weight_norm), for the
    # weight-decayed tensors; null = no clamp (the published LAMB).
    max_weight_norm: Optional[float] = None
    # The same for biases and LayerNorm parameters (not decayed). 0 = no trust ratio for them,
    # a plain Adam-style step: Graphcore's BERT choice. With the trust ratio a LayerNorm gain's
    # step grows with its own norm and can run away (norms of 1e17, then NaN); null = unclamped.
    bias_max_weight_norm: Optional[float] = 0.0


@dataclass
class TrainConfig:
    """The loop: batch layout, length, logging, evaluation and checkpoints."""

    steps: int = 2137
    # Packs per replica per forward pass.
    micro_batch_size: int = 2
    # Micro-batches per replica per optimizer step (used when global_batch_size is null).
    gradient_accumulation: int = 1024
    # Packs per optimizer step over all replicas; when set, gradient_accumulation is
    # derived from it (so torchrun with N processes keeps the same step) and must divide.
    global_batch_size: Optional[int] = None
    # Adapt the unpacked recipe to packing factor p (sequences per pack), see the paper:
    # "none" (the config is already adjusted), "gradient_accumulation" (divide it by p:
    # same sequences per update), "betas" (keep the batch, LAMB beta := beta ** p).
    packing_adjustment: str = field(
        default="none", metadata=_choices("none", "gradient_accumulation", "betas")
    )
    # p for the adjustment; null = measured on the training data (sequences / packs).
    packing_factor: Optional[float] = None
    seed: int = 0
    log_every: int = 1
    # Evaluate on held-out generated/HDF5 data every N steps (0 = never; always at the end
    # when eval_every > 0).
    eval_every: int = 0
    eval_batches: int = 4
    # Atomic checkpoint every N steps (0 = only with --resume-able end state off).
    checkpoint_every: int = 0
    # null = runs/<config name>
    output_dir: Optional[str] = None
    tensorboard: bool = True
    # Write the Hugging Face export (model + tokenizer) to <output_dir>/hf at the end.
    hf_export: bool = True
    # torch intra-op threads (null = torch's default, one per core). Small models gain
    # nothing from more threads, and on a shared machine spinning threads stall badly.
    num_threads: Optional[int] = None
    # A backend may skip an update by design (fp16 loss scaling after an overflow); this many
    # skipped steps in a row stop the run (the loss scale can no longer recover).
    max_consecutive_skipped_steps: int = 20
    # Distributed runs (torchrun): a collective that waits longer than this (a hung or dead
    # rank) ends the job with an error instead of gloo's/NCCL's 30-minute default.
    collective_timeout_minutes: float = 10.0


@dataclass
class IPUConfig:
    """Graphcore IPU settings (backends ``ipu`` and ``mock``); see research notes on
    Graphcore's PopTorch BERT. Pipeline: one stage per IPU of a replica."""

    # Encoder layers on each IPU of one replica; its length is the IPUs per replica and
    # it must sum to model.num_hidden_layers. Embeddings and heads sit on IPU 0.
    layers_per_ipu: List[int] = field(default_factory=lambda: [3, 7, 7, 7])
    replication_factor: int = 4
    # Optimizer steps per host call (PopTorch deviceIterations).
    device_iterations: int = 1
    # What the host gets back per call (PopTorch OutputMode).
    output_mode: str = field(default="sum", metadata=_choices("all", "sum", "final", "default"))
    # Fraction of tile memory for matmul/conv temporaries, one per IPU (or one for all).
    available_memory_proportion: List[float] = field(default_factory=lambda: [0.1, 0.15, 0.15, 0.15])
    enable_half_partials: bool = True
    half_precision: bool = True
    # Gradient accumulators (PopTorch optimizer accum_type): "auto" = fp16 with half_precision
    # (Graphcore's choice: half the memory; PopTorch then keeps a running mean, which cannot
    # overflow), else fp32. LAMB's two moments are always fp32.
    accumulator_dtype: str = field(default="auto", metadata=_choices("auto", "fp16", "fp32"))
    stochastic_rounding: bool = True
    loss_scaling: float = 8192.0
    # PopTorch's executable cache: BERT-Large compiles for tens of minutes, a cached executable
    # loads in seconds. A relative path is relative to the working directory; null = off.
    executable_cache_dir: Optional[str] = "runs/executable_cache"
    synthetic_data: bool = False
    log_cycle_count: bool = False
    optimizer_state_offchip: bool = True
    replicated_tensor_sharding: bool = True
    recompute_checkpoint_every_layer: bool = True
    auto_round_num_ipus: bool = True
    # Split the tied MLM decoder matmul into this many pieces to fit IPU 0's memory.
    embedding_serialization_factor: int = 2

    @property
    def ipus_per_replica(self) -> int:
        return len(self.layers_per_ipu)

    @property
    def fp16_accumulators(self) -> bool:
        return self.accumulator_dtype == "fp16" or (self.accumulator_dtype == "auto" and self.half_precision)


@dataclass
class CUDAConfig:
    """NVIDIA GPU settings (backend ``cuda``)."""

    precision: str = field(default="bf16", metadata=_choices("bf16", "fp16", "fp32"))
    # torch.compile the model once (fixed shapes: no recompiles after warm-up).
    compile: bool = False
    # torch.compile mode: "default", "reduce-overhead" (CUDA graphs) or "max-autotune".
    compile_mode: str = field(default="default", metadata=_choices("default", "reduce-overhead", "max-autotune"))
    # Optimizer steps that may compile (the first forward/backward compiles; eval compiles
    # its own graph on first use). After them, graphs compiled are counted as recompiles.
    num_warmup_steps: int = 2
    # Recompiles tolerated after warm-up; more is an error (a shape or guard changed: with
    # fixed [B, S] packs that is a bug, and it silently costs seconds per step).
    max_recompiles_after_warmup: int = 0
    # fp16 only: GradScaler's initial loss scale (dynamic afterwards).
    loss_scale_init: float = 65536.0
    # Let fp32 matmuls use TF32 tensor cores (Ampere and newer).
    allow_tf32: bool = True


@dataclass
class FinetuneConfig:
    """Fine-tuning (``task`` null = pre-training). Data: CSV/TSV/JSONL files with named columns,
    tokenised with the checkpoint's tokenizer, packed with data.packing_algorithm at depth
    data.max_sequences_per_pack into rows of data.max_sequence_length (bert_packed/finetune)."""

    task: Optional[str] = None
    train_file: Optional[str] = None
    # null = hold out validation_fraction of the training rows (seeded).
    validation_file: Optional[str] = None
    validation_fraction: float = 0.1
    text_column: str = "text"
    text_pair_column: Optional[str] = None
    label_column: str = "label"
    # Hugging Face's names; null = from the labels (lists: multi-label, fractional numbers or
    # num_labels 1: regression, else single-label).
    problem_type: Optional[str] = field(default=None, metadata=_choices(
        None, "single_label_classification", "multi_label_classification", "regression"))
    # null = from the data (string labels: their count; integer labels: the largest + 1).
    num_labels: Optional[int] = None
    # Multi-label labels written as one string: the separator between label names.
    label_separator: str = ","
    # false = one sequence per row (padded), the baseline to compare packing with.
    packing: bool = True
    # A text longer than data.max_sequence_length: "truncate" (with a warning) or "error".
    truncation: str = field(default="truncate", metadata=_choices("truncate", "error"))
    # Passes over the training data; sets train.steps unless --steps / --set train.steps is given.
    epochs: Optional[float] = 3.0
    # eval_* key selecting the best model (null = accuracy / f1_micro / pearson by problem type).
    metric_for_best_model: Optional[str] = None
    # At the end, export and predict with the best evaluated weights (not the last).
    load_best_model_at_end: bool = True


@dataclass
class Config:
    """The whole run. ``name`` is the config file's name (for the default output dir)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ipu: IPUConfig = field(default_factory=IPUConfig)
    cuda: CUDAConfig = field(default_factory=CUDAConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    name: str = "default"

    def to_dict(self) -> Dict[str, Any]:
        out = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        return out


SECTIONS = ("model", "data", "optimizer", "train", "ipu", "cuda", "finetune")
# Sections that only some backends read; a --set for one of them while another backend
# is chosen gets a warning.
BACKEND_SECTIONS = {"ipu": ("ipu", "mock"), "cuda": ("cuda",)}


# ---------------------------------------------------------------------------------------
# Loading


def resolve_config_path(name: str) -> str:
    """NAME -> configs/NAME, configs/NAME.yaml, or NAME itself as a path."""
    candidates = [
        os.path.join(CONFIG_DIR, name),
        os.path.join(CONFIG_DIR, name + ".yaml"),
        name,
    ]
    for path in candidates:
        if os.path.isfile(path):
            return path
    available = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) if os.path.isdir(CONFIG_DIR) else []
    raise ConfigError(
        f"unknown config {name!r}: no file configs/{name}, configs/{name}.yaml or {name}; "
        f"available: {', '.join(available)}"
    )


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin in (list, List):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; int is accepted where float is expected."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _coerce(value, inner, where)
    if origin in (list, List):
        (inner,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}; write it as [a, b, ...]")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    ok = False
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _section_types(section_cls) -> Dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f.metadata.get("choices")) for f in dataclasses.fields(section_cls)}


def _set_value(config: Config, section: str, key: str, value: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section {section!r}; sections are: {', '.join(SECTIONS)}")
    obj = getattr(config, section)
    types = _section_types(type(obj))
    if key not in types:
        close = difflib.get_close_matches(key, list(types), n=1)
        hint = f"did you mean {section}.{close[0]}? " if close else ""
        raise ConfigError(
            f"{source}: unknown key {section}.{key}; {hint}keys of {section}: {', '.join(sorted(types))}"
        )
    tp, choices = types[key]
    value = _coerce(value, tp, f"{source}: {section}.{key}")
    if choices is not None and value not in choices:
        names = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{source}: {section}.{key} must be one of {names}, got {value!r}")
    setattr(obj, key, value)


def _parse_override(text: str) -> tuple:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.steps=100")
    dotted, raw = text.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return section.strip(), key.strip(), value


def config_from_dict(values: Dict[str, Any], name: str = "checkpoint") -> Config:
    """A Config from ``Config.to_dict()`` output (e.g. the one a checkpoint keeps), checked like YAML."""
    config = Config(name=name)
    for section, entries in values.items():
        for key, value in (entries or {}).items():
            _set_value(config, section, key, value, name)
    return config


def load_config(name: Optional[str] = None, overrides: Optional[List[str]] = None) -> Config:
    """Defaults, then the YAML file ``name`` (if given), then ``overrides`` ("s.k=v")."""
    config = Config()
    if name is not None:
        path = resolve_config_path(name)
        base = os.path.basename(path)
        config.name = base[:-5] if base.endswith(".yaml") else base
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(f"{path}: not valid YAML ({first})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections (model:, data:, train:, ...)")
        for section, values in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"{base}: unknown section {section!r}; sections are: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{base}: section {section!r} must be a mapping of key: value")
            for key, value in values.items():
                _set_value(config, section, key, value, base)
    from_cli: Dict[str, set] = {s: set() for s in SECTIONS}
    for text in overrides or []:
        section, key, value = _parse_override(text)
        _set_value(config, section, key, value, "--set")
        from_cli[section].add(key)
    # Settings the user asked for on the command line: warned about if the backend ignores
    # them. (A shared YAML such as phase2.yaml carries an ipu section for every backend;
    # warning about it on every cpu run would be noise.)
    config._from_cli = from_cli  # type: ignore[attr-defined]
    if config.model.init_checkpoint:
        # The model's shape comes from the checkpoint, so validation and the printed config see it.
        from bert_packed import hf_io

        try:
            hf_io.resolve_model_config(config.model, hf_io.read_pretrained(config.model.init_checkpoint, weights=False))
        except hf_io.CheckpointError as exc:  # a config problem to every caller of load_config
            raise ConfigError(str(exc)) from None
    return config


# ---------------------------------------------------------------------------------------
# Validation and derived values


def num_replicas(config: Config, backend: str, world_size: int = 1) -> int:
    """Data-parallel model copies taking part in one optimizer step."""
    if backend in ("ipu", "mock"):
        return world_size * config.ipu.replication_factor
    return world_size


def gradient_accumulation(config: Config, backend: str, world_size: int = 1) -> int:
    """Micro-batches per replica per step before any packing adjustment."""
    t = config.train
    if t.global_batch_size is None:
        return t.gradient_accumulation
    per_pass = t.micro_batch_size * num_replicas(config, backend, world_size)
    return t.global_batch_size // per_pass


def validate(config: Config, backend: str, world_size: int = 1) -> List[str]:
    """Raise ConfigError on an inconsistent config; return warnings (one line each)."""
    m, d, t, o = config.model, config.data, config.train, config.optimizer
    positives = {
        "model.vocab_size": m.vocab_size, "model.hidden_size": m.hidden_size,
        "model.num_hidden_layers": m.num_hidden_layers, "model.num_attention_heads": m.num_attention_heads,
        "model.intermediate_size": m.intermediate_size, "model.max_position_embeddings": m.max_position_embeddings,
        "data.max_sequences_per_pack": d.max_sequences_per_pack, "data.max_sequence_length": d.max_sequence_length,
        "data.max_masked_tokens": d.max_masked_tokens, "data.num_sequences": d.num_sequences,
        "data.num_eval_sequences": d.num_eval_sequences,
        "train.micro_batch_size": t.micro_batch_size, "train.gradient_accumulation": t.gradient_accumulation,
        "train.steps": t.steps, "train.log_every": t.log_every, "train.eval_batches": t.eval_batches,
        "train.max_consecutive_skipped_steps": t.max_consecutive_skipped_steps,
    }
    if t.num_threads is not None:
        positives["train.num_threads"] = t.num_threads
    if t.global_batch_size is not None:
        positives["train.global_batch_size"] = t.global_batch_size
    for key, value in positives.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    non_negatives = {"train.seed": t.seed, "train.eval_every": t.eval_every,
                     "train.checkpoint_every": t.checkpoint_every, "optimizer.learning_rate": o.learning_rate,
                     "optimizer.weight_decay": o.weight_decay, "model.initializer_range": m.initializer_range}
    for key, value in non_negatives.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    for key, value in (("optimizer.max_weight_norm", o.max_weight_norm),
                       ("optimizer.bias_max_weight_norm", o.bias_max_weight_norm)):
        if value is not None and value < 0:
            raise ConfigError(f"{key} must be >= 0 (0 = no trust ratio) or null (no clamp), got {value}")
    strictly_positive = {"optimizer.eps": o.eps, "model.layer_norm_eps": m.layer_norm_eps,
                         "train.collective_timeout_minutes": t.collective_timeout_minutes}
    if o.max_grad_norm is not None:
        strictly_positive["optimizer.max_grad_norm"] = o.max_grad_norm
    for key, value in strictly_positive.items():
        if not value > 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    for key, value in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2),
                       ("model.hidden_dropout_prob", m.hidden_dropout_prob),
                       ("model.attention_probs_dropout_prob", m.attention_probs_dropout_prob)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}"
        )
    if m.type_vocab_size < 2:
        # Pre-training sequences are [CLS] A [SEP] B [SEP] with segment ids 0 and 1 (NSP).
        raise ConfigError(f"model.type_vocab_size={m.type_vocab_size} but pre-training (next-sentence "
                          f"prediction) uses segment ids 0 and 1; set model.type_vocab_size=2")
    if d.max_sequence_length > m.max_position_embeddings:
        raise ConfigError(
            f"data.max_sequence_length={d.max_sequence_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}; raise the latter or shorten the sequences"
        )
    if not 0.0 < d.mask_probability < 1.0:
        raise ConfigError(f"data.mask_probability must be in (0, 1), got {d.mask_probability}")
    if not 0.0 <= o.warmup_fraction <= 1.0:
        raise ConfigError(f"optimizer.warmup_fraction must be in [0, 1], got {o.warmup_fraction}")
    if t.packing_factor is not None and t.packing_factor < 1.0:
        raise ConfigError(f"train.packing_factor must be >= 1 (sequences per pack), got {t.packing_factor}")
    if t.global_batch_size is not None:
        per_pass = t.micro_batch_size * num_replicas(config, backend, world_size)
        if t.global_batch_size % per_pass:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x replicas "
                f"= {t.micro_batch_size} x {num_replicas(config, backend, world_size)} = {per_pass}; "
                f"pick a multiple of {per_pass}"
            )
    if backend in ("ipu", "mock"):
        ipu = config.ipu
        negative = [n for n in ipu.layers_per_ipu if n < 0]
        if negative or not ipu.layers_per_ipu:
            raise ConfigError(f"ipu.layers_per_ipu={ipu.layers_per_ipu}: give one count >= 0 per IPU "
                              f"(encoder layers on that IPU)")
        if sum(ipu.layers_per_ipu) != m.num_hidden_layers:
            raise ConfigError(
                f"ipu.layers_per_ipu={ipu.layers_per_ipu} sums to {sum(ipu.layers_per_ipu)} but "
                f"model.num_hidden_layers={m.num_hidden_layers}; make them agree"
            )
        if len(ipu.available_memory_proportion) not in (1, len(ipu.layers_per_ipu)):
            raise ConfigError(
                f"ipu.available_memory_proportion has {len(ipu.available_memory_proportion)} entries; "
                f"give 1 or one per IPU ({len(ipu.layers_per_ipu)})"
            )
        bad = [p for p in ipu.available_memory_proportion if not 0.0 < p <= 1.0]
        if bad:
            raise ConfigError(f"ipu.available_memory_proportion={ipu.available_memory_proportion}: each entry is a "
                              f"fraction of tile memory in (0, 1], got {bad[0]}")
        if ipu.replication_factor < 1 or ipu.device_iterations < 1:
            raise ConfigError("ipu.replication_factor and ipu.device_iterations must be >= 1")
        if ipu.embedding_serialization_factor < 1 or m.vocab_size % ipu.embedding_serialization_factor:
            raise ConfigError(
                f"ipu.embedding_serialization_factor={ipu.embedding_serialization_factor} must be >= 1 and divide "
                f"model.vocab_size={m.vocab_size}; pick a divisor (1 = no serialization)"
            )
        if not ipu.loss_scaling > 0:
            raise ConfigError(f"ipu.loss_scaling must be > 0, got {ipu.loss_scaling}")
    warns = []
    from_cli = getattr(config, "_from_cli", {})
    for section, backends in BACKEND_SECTIONS.items():
        changed = sorted(from_cli.get(section, ()))
        if changed and backend not in backends:
            warns.append(
                f"{section}.{{{', '.join(changed)}}} do not apply to backend {backend!r} "
                f"(only to {'/'.join(backends)}); ignored"
            )
    return warns


class _Dumper(yaml.SafeDumper):
    """Block style for sections, flow style for lists ([3, 7, 7, 7]) so it reads like our YAML."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def dump(config: Config) -> str:
    """The resolved config as YAML (what `python -m bert_packed.config NAME` prints)."""
    return yaml.dump(config.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m bert_packed.config", description="Print a resolved config.")
    parser.add_argument("name", nargs="?", default="demo", help="configs/NAME[.yaml] or a path (default: demo)")
    parser.add_argument("--backend", default="cpu", help="validate for this backend (default: cpu)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel processes to validate for")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.name, args.overrides)
        for line in validate(config, args.backend, args.world_size):
            print(f"warning: {line}", file=sys.stderr)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# resolved config {config.name!r} for backend {args.backend!r}")
    print(dump(config), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
