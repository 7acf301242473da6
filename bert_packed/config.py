"""Configuration: YAML files mapped onto documented dataclasses, one *section* per owner.

Precedence: ``--set section.key=value`` on the command line > the YAML file > the
defaults written in the section classes. Unknown sections/keys and values of the wrong
type are rejected with one line (:class:`ConfigError`); a setting that does not apply to
the chosen backend or task (e.g. ``--set ipu.replication_factor=2`` when training on
``cpu``) gets a warning.

Sections and who owns them:

- ``model``, ``data``, ``optimizer``, ``train``: the model and the loop (this module);
- ``finetune``: the keys every fine-tuning task shares (this module) plus each task's own
  keys, declared by the task class (``Task.config_fields``) and registered with
  :func:`register_task_fields` by the task registry (``bert_packed.tasks.registry.register_config_sections``);
- one section per backend that has settings (``ipu``, ``cuda``, ``cpu``): declared by the
  backend package and registered with :func:`register_section` by the backend registry
  (``backends.register_config_sections``).

This module is a leaf: it names no task and no backend and imports neither, nor torch, nor
any reader of checkpoints or data; ``run.py`` (and the tests' conftest) call both registries'
``register_config_sections`` before loading a config. A step every loaded config goes through
after its overrides (the init checkpoint's model shape) is registered the same way
(:func:`register_resolver`).

Bounds are declared on the fields (``bounded(default, ge=1)``) and checked by
:func:`validate` for every section alike; so are the keys a resumed run may change
(``metadata={"resume_harmless": True}``).

A config NAME resolves to ``configs/NAME`` or ``configs/NAME.yaml`` (relative to the
repository), or to a path to a YAML file.

    python run.py --print-config phase2 --backend mock     # the resolved config
    python -m bert_packed.config phase2                    # the same (delegates to run.py)

Counting conventions used throughout: a *pack* is one fixed-shape row of
``max_sequence_length`` tokens holding up to ``max_sequences_per_pack`` sequences (an
unpacked/padded row is a pack with one sequence). ``micro_batch_size`` counts packs per
replica per forward pass; a *replica* is one data-parallel copy of the model (a torchrun
process on cpu/cuda; a backend may feed several from one process, see
``Backend.replicas_per_process``).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import yaml

from bert_packed.errors import ConfigError, excerpt
from bert_packed import limits
from bert_packed.limits import BOUND_KEYS, at_most, bound_message, bounded
from bert_packed.loop.plan import check_global_batch
from bert_packed.io.yaml_io import YamlError, YamlSyntaxError, load_yaml, loads_yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO_ROOT, "configs")

__all__ = ["ConfigError", "Config", "ModelConfig", "DataConfig", "OptimizerConfig", "TrainConfig", "FinetuneConfig",
           "register_section", "register_task_fields", "register_resolver", "section_names", "bounded", "load_config",
           "config_from_dict", "resolve_config_path",
           "validate", "resolve_run", "resolve_attention", "ResolvedRun", "model_rules", "model_shape_error",
           "resume_harmless_keys", "input_paths", "dump",
           "CONFIG_DIR"]

AUTO_ATTENTION = "auto"  # model.attention_implementation chosen by the backend (resolve_attention)


def _choices(*values: Any) -> Dict[str, Any]:
    return {"choices": values}


HARMLESS = {"resume_harmless": True}  # a resumed run may change this key without changing its steps
# "Every N steps": N beyond train.steps' maximum is never reached.
_EVERY = at_most(limits.STEPS["le"], "train.steps is at most that")
_CLAMP = "a clamp: any positive value means something, a large one never acts"
_GENERATED = at_most(10**8, "generated sequences are drawn and packed in host memory at the start; use data.path")


# ---------------------------------------------------------------------------------------
# The core sections. Every field has a default so a YAML file only states what differs, and
# every number a maximum (bert_packed.limits: the shared ones and the rules) or the reason it
# has none (``unbounded``).


@dataclass
class ModelConfig:
    """The BERT architecture (Hugging Face ``BertConfig`` field names)."""

    vocab_size: int = bounded(30522, ge=1, **limits.VOCABULARY)
    hidden_size: int = bounded(1024, ge=1, **limits.HIDDEN)
    num_hidden_layers: int = bounded(24, ge=1, **limits.LAYERS)
    # It divides hidden_size, so hidden_size's maximum is its own.
    num_attention_heads: int = bounded(16, ge=1, **at_most(limits.HIDDEN["le"], "it divides model.hidden_size"))
    # 4 x hidden_size in BERT: four times hidden_size's maximum.
    intermediate_size: int = bounded(4096, ge=1, **at_most(4 * limits.HIDDEN["le"], "4 x model.hidden_size's maximum"))
    # Rows of the position table; no sequence is longer than data.max_sequence_length's maximum,
    # so a larger table only holds weights no token reads (a checkpoint's is kept up to 2^20).
    max_position_embeddings: int = bounded(512, ge=1, **at_most(2**20, "16 times the longest sequence a run takes"))
    # Segment (token type) table: ids 0 and 1 (sentences A and B) are used; checkpoints hold 1 to 16.
    type_vocab_size: int = bounded(2, ge=1, **at_most(1024, "only segment ids 0 and 1 are ever used"))
    # A name of bert_packed.model.modeling's activations (checked when the model is built).
    hidden_act: str = field(default="gelu", metadata={"what": "the name of an activation (e.g. \"gelu\")"})
    hidden_dropout_prob: float = bounded(0.1, ge=0.0, lt=1.0)
    attention_probs_dropout_prob: float = bounded(0.1, ge=0.0, lt=1.0)
    # Added to a variance of order 1 (BERT: 1e-12): above 1 it outweighs it and LayerNorm stops normalising.
    layer_norm_eps: float = bounded(1e-12, gt=0.0, **at_most(1.0, "it is added to a variance of order 1"))
    # Std of the initial weights (BERT: 0.02): at 1 every matmul of a 1024-wide layer multiplies
    # activations by about 32, and fp16 overflows within a few layers.
    initializer_range: float = bounded(0.02, ge=0.0, **at_most(1.0, "larger initial weights overflow within a few "
                                                                    "layers (BERT: 0.02)"))
    # Name in bert_packed.model.attention's registry; "dense" runs everywhere (IPU included). "auto":
    # the backend chooses when the run is validated (resolve_attention, Backend.resolve_attention:
    # the CPU without compile takes "bucketed", a GPU "flex" or "sdpa", every other backend "dense");
    # the fine-tuning configs and phase2 ask for it.
    attention_implementation: str = "dense"
    # "token": mean over the masked tokens of the step (canonical BERT);
    # "sequence": mean per sequence, then over sequences (the paper's Listing 1).
    mlm_loss_normalization: str = field(default="token", metadata=_choices("token", "sequence"))
    # Hugging Face BERT directory or this project's checkpoint to start from (null = random
    # init); the model's shape then comes from the checkpoint (bert_packed/io/hf_io.py).
    init_checkpoint: Optional[str] = None
    # Tokenizer shipped with the Hugging Face export (a tokenizer directory or vocab.txt);
    # null = the init checkpoint's.
    tokenizer: Optional[str] = None
    # An id of the vocabulary (below model.vocab_size: model_shape_error).
    pad_token_id: Optional[int] = bounded(0, ge=0, **at_most(limits.VOCABULARY["le"] - 1, "an id of the vocabulary"))
    tie_word_embeddings: bool = True
    # Dropout before a task head; null = hidden_dropout_prob (Hugging Face's rule).
    classifier_dropout: Optional[float] = bounded(None, ge=0.0, lt=1.0)
    # GPU levers (off by default until a GPU measures them; docs/cuda.md, "Levers"). Checkpoints
    # load into either layout and the Hugging Face export is the same (bert_packed/model/modeling.py).
    # One Linear(H, 3H) for the query, key and value projections instead of three Linear(H, H).
    fused_qkv: bool = field(default=False, metadata=HARMLESS)  # the same parameters: a resume may switch it
    # The word embeddings and the MLM decoder get this many rows per block (64: 30,522 -> 30,528):
    # tensor-core friendly GEMM shapes. The extra rows stay zero, their logits are cut before
    # the loss, and the export has vocab_size rows. 1 = no padding.
    vocab_padding_multiple: int = bounded(1, ge=1, **at_most(1024, "a GEMM tile is at most that wide"))


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
    eval_path: Optional[str] = field(default=None, metadata=HARMLESS)
    max_sequence_length: int = bounded(512, ge=1, **limits.SEQUENCE)
    # Packing depth K; 1 = classic padded BERT (one sequence per row).
    max_sequences_per_pack: int = bounded(3, ge=1, **limits.SEQUENCES_PER_PACK)
    packing_algorithm: str = "lpfhp"
    # Masked-token budget of ONE full-length sequence (76 at S=512, 20 at S=128);
    # a pack gets max_masked_tokens + max_sequences_per_pack - 1 slots because rounding
    # 15 % per sequence can add up to one token per extra sequence.
    max_masked_tokens: int = bounded(76, ge=1, **at_most(limits.SEQUENCE_TOKENS, "no sequence has more tokens"))
    mask_probability: float = bounded(0.15, gt=0.0, lt=1.0)
    # Generated data only ------------------------------------------------------------
    histogram: str = "wikipedia-512"
    # How histogram lengths map onto max_sequence_length when they differ:
    # "scale" keeps the shape (about 50 % padding at any S, the Wikipedia-512 case),
    # "truncate" clips long sequences to S (what create_pretraining_data does at S=128).
    length_mapping: str = field(default="scale", metadata=_choices("scale", "truncate"))
    # Sequences per epoch of generated training data (packed once, then cycled). They are drawn
    # and packed in host memory at the start: about 30 bytes and 0.7 us each (10^7: 0.3 GB, 7 s
    # on one core), so 10^8 is minutes and gigabytes; real data of that size goes in data.path.
    num_sequences: int = bounded(20000, ge=1, **_GENERATED)
    num_eval_sequences: int = bounded(2000, ge=1, **_GENERATED, **HARMLESS)
    # Sharded data only (path a directory, bert_packed.data.sharded): the shards are dealt into this
    # many lanes, each read by one process; the data order depends on it, not on the number of
    # processes, which must divide it. null = the largest divisor of the shard count up to 64 (a
    # process holds two windows of 1,024 packs per lane it reads).
    lanes: Optional[int] = bounded(None, ge=1, **at_most(1 << 20, "more lanes than any dataset has shards (NVIDIA "
                                                                 "LDDL makes about 4,096)"))

    @property
    def max_masked_tokens_per_pack(self) -> int:
        return self.max_masked_tokens + self.max_sequences_per_pack - 1


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule (bert_packed.optim)."""

    name: str = field(default="lamb", metadata=_choices("lamb", "adamw"))
    learning_rate: float = bounded(0.002828, ge=0.0, unbounded="a rate too large diverges, and the divergence "
                                   "guard stops the run (exit 3, the last good checkpoint kept)")
    # Fraction of train.steps spent warming up linearly from 0 (rounded up to whole steps).
    warmup_fraction: float = bounded(0.128, ge=0.0, le=1.0)
    # true: the first warm-up step runs at rate 0, as transformers' linear schedule (the Hugging
    # Face Trainer's; the fine-tuning configs set it); false: at 1/warmup steps of the rate.
    warmup_from_zero: bool = False
    schedule: str = field(default="linear", metadata=_choices("linear", "constant"))
    # Recipes use 0.01 to 0.1; far above, the decay outweighs the update and drives the weights to
    # zero (AdamW multiplies them by 1 - learning_rate x weight_decay per step).
    weight_decay: float = bounded(0.01, ge=0.0, **at_most(1.0, "ten times the largest decay recipes use (0.01 to "
                                                                "0.1)"))
    beta1: float = bounded(0.9, ge=0.0, lt=1.0)
    beta2: float = bounded(0.999, ge=0.0, lt=1.0)
    # Added to the gradient's RMS (1e-8 to 1e-6): from about 1 on it replaces it, and Adam no longer normalises.
    eps: float = bounded(1e-6, gt=0.0, **at_most(1.0, "it would replace the gradient's RMS Adam divides by"))
    # Global gradient-norm clip; null = none (LAMB's trust ratio already bounds steps). The
    # fine-tuning configs clip at 1.0, as the Hugging Face Trainer does by default.
    max_grad_norm: Optional[float] = bounded(None, gt=0.0, unbounded=_CLAMP)
    # LAMB trust ratio phi(||w||) / ||u|| with phi(z) = min(z, max_weight_norm), for the
    # weight-decayed tensors; null = no clamp (the published LAMB).
    max_weight_norm: Optional[float] = bounded(None, ge=0.0, hint="(0 = no trust ratio) or null (no clamp)",
                                               unbounded=_CLAMP)
    # The same for biases and LayerNorm parameters (not decayed). 0 = no trust ratio for them,
    # a plain Adam-style step: Graphcore's BERT choice. With the trust ratio a LayerNorm gain's
    # step grows with its own norm and can run away (norms of 1e17, then NaN); null = unclamped.
    bias_max_weight_norm: Optional[float] = bounded(0.0, ge=0.0, hint="(0 = no trust ratio) or null (no clamp)",
                                                    unbounded=_CLAMP)


@dataclass
class TrainConfig:
    """The loop: batch layout, length, logging, evaluation and checkpoints."""

    steps: int = bounded(2137, ge=1, **limits.STEPS, **HARMLESS)
    # Packs per replica per forward pass.
    micro_batch_size: int = bounded(2, ge=1, **limits.MICRO_BATCH)
    # Micro-batches per replica per optimizer step (used when global_batch_size is null).
    gradient_accumulation: int = bounded(1024, ge=1, **limits.PER_STEP)
    # Packs per optimizer step over all replicas; when set, gradient_accumulation is
    # derived from it (so torchrun with N processes keeps the same step) and must divide.
    global_batch_size: Optional[int] = bounded(None, ge=1, **limits.PER_STEP)
    # Adapt the unpacked recipe to packing factor p (sequences per pack), see the paper:
    # "none" (the config is already adjusted), "gradient_accumulation" (divide it by p:
    # same sequences per update), "betas" (keep the batch, LAMB beta := beta ** p).
    packing_adjustment: str = field(
        default="none", metadata=_choices("none", "gradient_accumulation", "betas")
    )
    # p for the adjustment; null = measured on the training data (sequences / packs).
    packing_factor: Optional[float] = bounded(None, ge=1.0, hint="(sequences per pack)", **at_most(
        limits.SEQUENCES_PER_PACK["le"], "no pack holds more sequences than data.max_sequences_per_pack's maximum"))
    # numpy's global generator (seeded at the start of every run) takes seeds below 2^32.
    seed: int = bounded(0, ge=0, **at_most(2**32 - 1, "numpy's random seed is 32 bits"))
    # Write a metrics.jsonl line every N steps. The step's numbers stay on the device between
    # lines (no host synchronisation inside a step); every step is still checked for
    # divergence when they are read, and an evaluated, checkpointed or last step is always read.
    log_every: int = bounded(1, ge=1, **_EVERY, **HARMLESS)
    # Evaluate on held-out generated/HDF5 data every N steps (0 = never; always at the end
    # when eval_every > 0).
    eval_every: int = bounded(0, ge=0, **_EVERY, **HARMLESS)
    # Held-out micro-batches per evaluation (pre-training data), built once and kept in host
    # memory: 10^4 micro-batches of 16 packs x 512 tokens are already gigabytes.
    eval_batches: int = bounded(4, ge=1, **at_most(10**4, "they are built once and kept in host memory"), **HARMLESS)
    # Atomic checkpoint every N steps (0 = only with --resume-able end state off).
    checkpoint_every: int = bounded(0, ge=0, **_EVERY, **HARMLESS)
    # null = runs/<config name>
    output_dir: Optional[str] = field(default=None, metadata=HARMLESS)
    tensorboard: bool = field(default=True, metadata=HARMLESS)
    # Write the Hugging Face export (model + tokenizer) to <output_dir>/hf at the end.
    hf_export: bool = True
    # Micro-batches made ahead in a background thread (packing and collation off the step's
    # critical path); 0 = made between steps.
    # Each is a whole micro-batch in host memory; 2 hide the collation, more only cost memory.
    prefetch_micro_batches: int = bounded(2, ge=0, **at_most(1024, "each one is a micro-batch held in host memory"),
                                          **HARMLESS)
    # torch intra-op threads (null = torch's default, one per core). Small models gain
    # nothing from more threads, and on a shared machine spinning threads stall badly.
    # The largest CPUs have a few hundred hardware threads; when the system cannot create that
    # many, libgomp aborts the process (a segfault at 65536 here).
    num_threads: Optional[int] = bounded(None, ge=1, **at_most(1024, "more threads than any CPU runs; libgomp "
                                                                       "crashes when it cannot create them"), **HARMLESS)
    # A backend may skip an update by design (fp16 loss scaling after an overflow); this many
    # skipped steps in a row stop the run (the loss scale can no longer recover).
    max_consecutive_skipped_steps: int = bounded(20, ge=1, **limits.STEPS, **HARMLESS)
    # Distributed runs (torchrun): a collective that waits longer than this (a hung or dead
    # rank) ends the job with an error instead of gloo's/NCCL's 30-minute default. A week: a
    # collective waiting longer has hung (and datetime.timedelta overflows near 1.4e12 minutes).
    collective_timeout_minutes: float = bounded(10.0, gt=0.0, **at_most(7 * 24 * 60.0, "a week; a collective "
                                                                                         "waiting longer has hung"),
                                                **HARMLESS)


@dataclass
class FinetuneConfig:
    """Fine-tuning keys every task shares (``task`` null = pre-training). Each task adds its
    own keys to this section (``Task.config_fields``: e.g. ``text_column`` for
    classification, ``doc_stride`` for SQuAD). Data: the task's files, tokenised with the
    checkpoint's tokenizer, packed with data.packing_algorithm at depth
    data.max_sequences_per_pack into rows of data.max_sequence_length (bert_packed/finetune)."""

    task: Optional[str] = None
    train_file: Optional[str] = None
    # null = hold out validation_fraction of the training rows (seeded).
    validation_file: Optional[str] = None
    validation_fraction: float = bounded(0.1, ge=0.0, lt=1.0)
    # false = one sequence per row (padded), the baseline to compare packing with.
    packing: bool = True
    # A text longer than data.max_sequence_length: "truncate" (with a warning) or "error".
    truncation: str = field(default="truncate", metadata=_choices("truncate", "error"))
    # Passes over the training data; sets train.steps unless --steps / --set train.steps is given.
    # (The steps they come to are held to train.steps' maximum too.)
    epochs: Optional[float] = bounded(3.0, gt=0.0, **at_most(10**6, "fine-tuning takes 2 to 10 passes"))
    # eval_* key selecting the best model (null = the task's own default).
    metric_for_best_model: Optional[str] = None
    # At the end, export and predict with the best evaluated weights (not the last).
    load_best_model_at_end: bool = True


# ---------------------------------------------------------------------------------------
# The section registry


@dataclass(frozen=True)
class Section:
    """One config section: its dataclass and who reads it (``readers``: the backends that do;
    None = every run). ``key_owners``: for a section several tasks extend, the tasks that
    declared each key (a key missing from it is shared)."""

    name: str
    cls: type
    readers: Optional[Tuple[str, ...]] = None
    key_owners: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()


_SECTIONS: Dict[str, Section] = {}


def register_section(name: str, cls: type, *, readers: Optional[Iterable[str]] = None) -> None:
    """Make ``name: {...}`` a config section mapped onto dataclass ``cls``. ``readers`` names the
    backends that read it (a setting given for another backend gets a warning). Registering the
    same class again is a no-op; another class under a taken name is a programming error."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config section {name!r}: {cls!r} is not a dataclass")
    existing = _SECTIONS.get(name)
    if existing is not None:
        if existing.cls is not cls:
            raise TypeError(f"config section {name!r} is already registered with {existing.cls.__name__}")
        return
    _SECTIONS[name] = Section(name, cls, tuple(readers) if readers is not None else None)


for _name, _cls in (("model", ModelConfig), ("data", DataConfig), ("optimizer", OptimizerConfig),
                    ("train", TrainConfig)):
    register_section(_name, _cls)


_TASK_FIELDS: Dict[str, type] = {}  # task name -> its own finetune.* keys (a dataclass), in registration order


def register_task_fields(task: str, cls: type) -> None:
    """Add task ``task``'s own ``finetune.*`` keys (dataclass ``cls``, the task's ``config_fields``)
    to the ``finetune`` section. Registering the same class again is a no-op; a key that
    redeclares a shared one, or one another task declares differently, is a programming error
    (TypeError, raised here). Configs built before keep the keys they had."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"task {task!r}: its config fields {cls!r} are not a dataclass")
    existing = _TASK_FIELDS.get(task)
    if existing is cls:
        return
    if existing is not None:
        raise TypeError(f"task {task!r} already registered its config fields ({existing.__name__})")
    _TASK_FIELDS[task] = cls
    try:
        _SECTIONS["finetune"] = _build_finetune_section()
    except TypeError:
        del _TASK_FIELDS[task]
        raise


def _build_finetune_section() -> Section:
    """``finetune``: the shared keys plus every registered task's own keys."""
    hints = typing.get_type_hints(FinetuneConfig)
    fields = [(f.name, hints[f.name], _copy_field(f)) for f in dataclasses.fields(FinetuneConfig)]
    owners: Dict[str, List[str]] = {}
    declared: Dict[str, Any] = {}
    for task_name, fields_cls in _TASK_FIELDS.items():
        task_hints = typing.get_type_hints(fields_cls)
        for f in dataclasses.fields(fields_cls):
            signature = (task_hints[f.name], f.default, f.metadata.get("choices"))
            if f.name in hints:
                raise TypeError(f"task {task_name!r} redeclares the shared key finetune.{f.name}")
            if f.name in declared and declared[f.name] != signature:
                raise TypeError(f"tasks declare finetune.{f.name} differently ({', '.join(owners[f.name])}, "
                                f"{task_name})")
            if f.name not in declared:
                declared[f.name] = signature
                fields.append((f.name, task_hints[f.name], _copy_field(f)))
            owners.setdefault(f.name, []).append(task_name)
    cls = dataclasses.make_dataclass("FinetuneConfig", fields, bases=(FinetuneConfig,))
    cls.__doc__ = FinetuneConfig.__doc__
    return Section("finetune", cls, None, tuple((k, tuple(v)) for k, v in owners.items()))


def _finetune_section() -> Section:
    section = _SECTIONS.get("finetune")
    if section is None:
        section = _SECTIONS["finetune"] = _build_finetune_section()
    return section


def _copy_field(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def section_names() -> Tuple[str, ...]:
    """The registered sections, in their order (core, then backends as registered, finetune last)."""
    _finetune_section()
    names = [n for n in _SECTIONS if n != "finetune"]
    return tuple(names + ["finetune"])


def _section(name: str, source: str) -> Section:
    if name == "finetune":
        return _finetune_section()
    if name not in _SECTIONS:
        raise ConfigError(f"{source}: unknown section {excerpt(name)}; sections are: {', '.join(section_names())} (a "
                          f"backend's section is known once the backend registry registers it: "
                          f"backends.register_config_sections(), as run.py does)")
    return _SECTIONS[name]


class Config:
    """The whole run: one object per registered section (``config.train``, ``config.ipu``, ...)
    and ``name``, the config file's name (for the default output dir). ``cli_keys`` records
    which keys the command line set (warnings and "did the user ask for steps?" read it)."""

    def __init__(self, name: str = "default"):
        self.name = name
        self.sections: Dict[str, Any] = {n: _section(n, "config").cls() for n in section_names()}
        self.cli_keys: Dict[str, set] = {n: set() for n in self.sections}
        self.unregistered: Dict[str, Dict[str, Any]] = {}
        # The init checkpoint whose model shape the model section holds (set by the one function
        # that resolves it, bert_packed.tasks.registry.resolve_checkpoint_shape), so it is resolved once.
        self.shape_from: Optional[str] = None

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        if sections is not None and not name.startswith("_"):
            raise AttributeError(f"the config has no section {name!r} (sections: {', '.join(sections)}); a backend's "
                                 f"section exists once it is registered (backends.register_config_sections())")
        raise AttributeError(name)

    def to_dict(self) -> Dict[str, Any]:
        return {**{name: dataclasses.asdict(obj) for name, obj in self.sections.items()}, **self.unregistered}


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
    if os.path.isdir(name):
        raise ConfigError(f"config {name} is a directory; give a YAML file (or a name in configs/)")
    available = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) if os.path.isdir(CONFIG_DIR) else []
    tried = name if os.path.isabs(name) else f"configs/{name}, configs/{name}.yaml or {name}"
    raise ConfigError(f"unknown config {name!r}: no file {tried}; available: {', '.join(available)}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin in (list, List):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


MAX_TEXT_SETTING = 4096  # PATH_MAX on Linux: no path or name a setting takes is longer
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
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {excerpt(value)}; write it as [a, b, ...]")
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
            raise ConfigError(f"{where}: expected a finite number, got {excerpt(value)}")
    elif tp is str:
        ok = isinstance(value, str)
        if ok and len(value) > MAX_TEXT_SETTING:
            # Every text setting is a name or a path: refused here, naming its key, rather than
            # echoed whole by whatever opens it later ("init checkpoint xxxx...: no such file").
            raise ConfigError(f"{where}: {value[:40]!r}... is {len(value):,} characters long; a name or path setting "
                              f"takes at most {MAX_TEXT_SETTING:,}")
    if not ok:
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {excerpt(value)} ({type(value).__name__})")
    return value


def _section_types(section_cls) -> Dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f.metadata.get("choices")) for f in dataclasses.fields(section_cls)}


def _set_value(config: Config, section: str, key: str, value: Any, source: str) -> None:
    _section(section, source)
    obj = config.sections[section]
    types = _section_types(type(obj))
    if key not in types:
        close = difflib.get_close_matches(key[:200], list(types), n=1)
        hint = f"did you mean {section}.{close[0]}? " if close else ""
        shown = f"{section}.{key}" if len(key) <= 100 else f"{section}.{excerpt(key, 60)}"
        raise ConfigError(f"{source}: unknown key {shown}; {hint}keys of {section}: {', '.join(sorted(types))}")
    tp, choices = types[key]
    value = _coerce(value, tp, f"{source}: {section}.{key}")
    optional = typing.get_origin(tp) is typing.Union
    if isinstance(value, str) and (value == "" or (optional and not value.strip())):
        # An unset shell variable ($DATA) would otherwise mean "none" (random init, generated
        # data, the default output directory) or fail deep inside (an empty separator).
        raise ConfigError(f"{source}: {section}.{key} is empty; give a value"
                          f"{' (or null for none)' if optional else ''}")
    if choices is not None and value not in choices:
        names = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{source}: {section}.{key} must be one of {names}, got {excerpt(value)}")
    setattr(obj, key, value)


def _parse_override(text: str) -> tuple:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {excerpt(text)}: expected section.key=value, e.g. --set train.steps=100")
    dotted, raw = text.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = loads_yaml(raw, f"--set {dotted}") if raw.strip() else raw  # blanks as they are
    except YamlSyntaxError:  # not YAML: the text as it is (e.g. a path with a colon)
        value = raw
    except YamlError as exc:  # YAML, but refused (a repeated key, an alias bomb)
        raise ConfigError(str(exc)) from None
    return section.strip(), key.strip(), value


def config_from_dict(values: Dict[str, Any], name: str = "checkpoint") -> Config:
    """A Config from ``Config.to_dict()`` output (e.g. the one a checkpoint keeps), checked like YAML.

    A section no registered owner reads here (a backend's, when its package is not imported,
    e.g. exporting a checkpoint) is kept as it was in ``unregistered`` (and in ``to_dict()``)."""
    config = Config(name=name)
    for section, entries in values.items():
        if section not in config.sections and section not in _SECTIONS:
            config.unregistered[section] = dict(entries or {})
            continue
        for key, value in (entries or {}).items():
            _set_value(config, section, key, value, name)
    return config


def _read_yaml(path: str) -> Any:
    """The YAML document of ``path``: a repeated key, alias expansion past its bound and bytes
    that are not UTF-8 are refused in one line naming the file (``bert_packed.io.yaml_io``)."""
    try:
        data = load_yaml(path)
    except YamlError as exc:
        raise ConfigError(str(exc)) from None
    if data is None:  # nothing but blanks and comments: a file saved empty by mistake?
        raise ConfigError(f"{path}: the config file is empty; write its sections (model:, data:, train:, ...), or "
                          f"{{}} for every default")
    return data


def load_config(name: Optional[str] = None, overrides: Optional[List[str]] = None) -> Config:
    """Defaults, then the YAML file ``name`` (if given), then ``overrides`` ("s.k=v")."""
    config = Config()
    if name is not None:
        path = resolve_config_path(name)
        base = os.path.basename(path)
        config.name = base[:-5] if base.endswith(".yaml") else base
        data = _read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections (model:, data:, train:, ...)")
        for section, values in data.items():
            _section(section, base)
            if not isinstance(values, dict):
                raise ConfigError(f"{base}: section {section!r} must be a mapping of key: value")
            for key, value in values.items():
                _set_value(config, section, key, value, base)
    for text in overrides or []:
        section, key, value = _parse_override(text)
        _set_value(config, section, key, value, "--set")
        config.cli_keys[section].add(key)
    for resolve in _RESOLVERS:  # e.g. the model's shape from model.init_checkpoint (bert_packed.tasks.registry)
        resolve(config)
    return config


_RESOLVERS: List[Callable[[Config], None]] = []


def register_resolver(resolve: Callable[[Config], None]) -> None:
    """Make ``load_config`` call ``resolve(config)`` on every config it loads, after the YAML file
    and the overrides, so validation and the printed config see what it resolves (the task
    registry registers the init checkpoint's model shape; this module reads no checkpoint).
    ``resolve`` raises ConfigError for a user mistake. Registering it again is a no-op."""
    if resolve not in _RESOLVERS:
        _RESOLVERS.append(resolve)


# ---------------------------------------------------------------------------------------
# Validation and derived values


def check_section(name: str, obj: Any) -> None:
    """Every field of section ``obj`` declared with bounds (``bounded``): one line for the first
    value outside them. (Backends call it on their own section in ``prepare`` too, for callers
    that build a plan without validating the config.)"""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or not any(k in f.metadata for k in BOUND_KEYS):
            continue
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            where = f"{name}.{f.name}" if not isinstance(value, list) else f"{name}.{f.name}[{i}]"
            message = bound_message(where, item, f.metadata)
            if message is not None:
                raise ConfigError(message)


def check_bounds(config: Config) -> None:
    """``check_section`` of every section."""
    for name, obj in config.sections.items():
        check_section(name, obj)


@dataclass(frozen=True)
class ResolvedRun:
    """What validating a config for one backend and world size settled (:func:`resolve_run`):
    ``config``, the resolved configuration (a copy of the given one with ``model.attention_implementation:
    auto`` resolved by the backend and the defaults the backend fills in, e.g. cuda's compile and
    fitted micro-batch): what runs, and what config.yaml, ``--print-config`` and checkpoints name;
    the attention implementation the model computes with, the step's micro-batch layout (as the
    backend fitted it) and the warnings, one line each. The loop takes it from its caller
    (``train(..., resolved=)``) rather than validating again, and runs a copy of its ``config``."""

    backend: str
    world_size: int
    attention: str
    micro_batch_size: int
    gradient_accumulation: int
    warnings: Tuple[str, ...]
    config: Config = field(compare=False, repr=False)

    def matches(self, backend, world_size: int) -> bool:
        """Whether it was resolved for ``backend`` (object or class) and ``world_size``."""
        return (self.backend, self.world_size) == (backend.name, world_size)


def resolve_attention(config: Config, backend=None) -> str:
    """``model.attention_implementation`` as the run computes with it: a named implementation as
    it is; ``auto`` the backend's choice (``Backend.resolve_attention``: the one place that knows
    what ``auto`` means there; :func:`resolve_run` asks it, once per resolved run); without a
    backend (a model built from a config no backend resolved, ``bert_packed.model.build``) the
    section's default, ``dense``, the exact one everywhere."""
    name = config.model.attention_implementation
    if name != AUTO_ATTENTION:
        return name
    return ModelConfig.attention_implementation if backend is None else backend.resolve_attention(config)


def resolve_run(config: Config, backend, world_size: int = 1) -> ResolvedRun:
    """Check ``config`` for ``backend`` (an object or class, ``backends.get_backend_class(name)``:
    it validates its own section, ``validate_config``, and says how many replicas a process
    feeds) and ``world_size`` processes: ConfigError (one line) on an inconsistent config, else
    the resolved run. ``config`` itself is left as it is: the run's configuration is the resolved
    run's ``config``, a copy the attention ``auto`` resolved to and the backend's ``validate_config``
    filled in (so resolving one config for two backends gives each its own answer)."""
    resolved = copy.deepcopy(config)
    attention = resolve_attention(resolved, backend)
    resolved.model.attention_implementation = attention
    warns = _check(resolved, backend, world_size)
    t = resolved.train
    return ResolvedRun(backend.name, world_size, attention, t.micro_batch_size, t.gradient_accumulation, tuple(warns),
                       resolved)


def validate(config: Config, backend, world_size: int = 1) -> List[str]:
    """:func:`resolve_run`'s warnings (``config`` is left as it is)."""
    return list(resolve_run(config, backend, world_size).warnings)


_MODEL_RULES: Dict[str, Tuple[Callable[[Any], bool], str]] = {}


def model_rules() -> Dict[str, Tuple[Callable[[Any], bool], str]]:
    """field -> (test, what it must be) of every field of the model section, from its declaration
    (type, choices, the bounds that are part of its meaning: ``limits.value_rule``): the checks of
    values that do not come through this module's parsing, a ``BertConfig`` built in code
    (``bert_packed.model.modeling``) and a checkpoint's ``config.json`` (``bert_packed.io.hf_io``)."""
    if not _MODEL_RULES:
        hints = typing.get_type_hints(ModelConfig)
        _MODEL_RULES.update({f.name: limits.value_rule(hints[f.name], dict(f.metadata))
                             for f in dataclasses.fields(ModelConfig)})
    return _MODEL_RULES


def model_shape_error(values: Any, prefix: str = "model.") -> Optional[str]:
    """The one-line reason the model's fields (``values``: an object with the model section's
    attributes, e.g. ``config.model`` or a ``BertConfig``) do not fit together, or None: the heads
    divide the hidden size, the padding id is one of the vocabulary's. Each field itself is checked
    first (bounds, ``model_rules``). ``prefix`` leads every field name in the message."""
    hidden, heads = values.hidden_size, values.num_attention_heads
    if hidden % heads:
        return (f"{prefix}hidden_size={hidden} is not divisible by {prefix}num_attention_heads={heads}; pick a head "
                f"count that divides it")
    pad, vocab = values.pad_token_id, values.vocab_size
    if pad is not None and pad >= vocab:
        return f"{prefix}pad_token_id={pad} is outside the vocabulary [0, {vocab}) ({prefix}vocab_size)"
    return None


def _check(config: Config, backend, world_size: int) -> List[str]:
    """``validate``'s checks."""
    check_bounds(config)
    m, d = config.model, config.data
    shape_error = model_shape_error(m)
    if shape_error is not None:
        raise ConfigError(shape_error)
    if m.type_vocab_size < 2:
        # Pre-training sequences are [CLS] A [SEP] B [SEP] with segment ids 0 and 1 (NSP).
        raise ConfigError(f"model.type_vocab_size={m.type_vocab_size} but pre-training (next-sentence "
                          f"prediction) uses segment ids 0 and 1; set model.type_vocab_size=2")
    if d.max_sequence_length > m.max_position_embeddings:
        raise ConfigError(
            f"data.max_sequence_length={d.max_sequence_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}; raise the latter or shorten the sequences"
        )
    check_global_batch(config, backend, world_size)
    warns = list(backend.validate_config(config, world_size))
    for name, section in _SECTIONS.items():
        changed = sorted(config.cli_keys.get(name, ()))
        if changed and section.readers is not None and backend.name not in section.readers:
            warns.append(
                f"{name}.{{{', '.join(changed)}}} do not apply to backend {backend.name!r} "
                f"(only to {'/'.join(section.readers)}); ignored"
            )
    f = config.finetune
    if f.task and f.train_file and f.validation_file and os.path.realpath(f.train_file) == os.path.realpath(
            f.validation_file):
        warns.append(f"finetune.validation_file is finetune.train_file ({f.train_file}): the evaluations, and the "
                     f"best model chosen by them, measure the training data")
    owners = dict(_finetune_section().key_owners)
    task = config.finetune.task
    foreign = sorted(k for k in config.cli_keys.get("finetune", ()) if k in owners and task not in owners[k])
    if foreign:
        tasks = sorted({name for k in foreign for name in owners[k]})
        warns.append(f"finetune.{{{', '.join(foreign)}}} do not apply to task {task!r} (only to {'/'.join(tasks)}); "
                     f"ignored")
    return warns


def input_paths(config: Config) -> List[Tuple[str, Optional[str]]]:
    """(what, path) of every file or directory the run reads (unset ones as None): the init
    checkpoint and tokenizer, and the data of pre-training or of the fine-tuning task."""
    m, d, f = config.model, config.data, config.finetune
    paths = [("the init checkpoint", m.init_checkpoint), ("model.tokenizer", m.tokenizer)]
    if f.task:
        return paths + [("finetune.train_file", f.train_file), ("finetune.validation_file", f.validation_file)]
    return paths + [("data.path", d.path), ("data.eval_path", d.eval_path)]


def resume_harmless_keys() -> frozenset:
    """Dotted keys a resumed run may change without changing what its remaining steps compute
    (declared on the fields: ``metadata={"resume_harmless": True}``). Everything else (model
    shape, optimizer, batch and accumulation, packing, data files, seeds) would make the
    continuation a different run, so it is refused unless forced."""
    section_names()
    return frozenset(f"{name}.{f.name}" for name, section in _SECTIONS.items()
                     for f in dataclasses.fields(section.cls) if f.metadata.get("resume_harmless"))


class _Dumper(yaml.SafeDumper):
    """Block style for sections, flow style for lists ([3, 7, 7, 7]) so it reads like our YAML."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def dump(config: Config) -> str:
    """The resolved config as YAML (what `python run.py --print-config NAME` prints)."""
    return yaml.dump(config.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


if __name__ == "__main__":
    # `python -m bert_packed.config NAME [--backend B] [--set ...]`: the backends' sections are
    # registered by the backend package, which this layer does not import; run.py, which wires
    # the layers together, prints the resolved config.
    os.execv(sys.executable, [sys.executable, os.path.join(REPO_ROOT, "run.py"), "--print-config", *sys.argv[1:]])
