"""Checkpoints in and out: Hugging Face directories, this project's checkpoints, tokenizers.

In (``model.init_checkpoint`` / ``--init-checkpoint``):

* a Hugging Face directory: ``config.json`` plus ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``) or ``pytorch_model.bin``, with the weights of a
  ``BertForPreTraining``, ``BertModel`` or ``BertForSequenceClassification`` (any BERT
  head); its tokenizer (``tokenizer.json`` or ``vocab.txt``) comes along;
* this project's ``checkpoint.pt`` (or a run directory holding one): the model weights
  and the run's model section.

The model's shape comes from the checkpoint (``resolve_model_config``): a shape the run's
config states differently is an error, not a silent resize. Weights load by name
(``load_weights``); what the checkpoint lacks (a new task head) and what it has beyond the
model (another task's head) is reported in one summary line.

Out (``save_pretrained``): a directory ``transformers.AutoModelFor*.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load as they are: ``config.json`` (``model_type: bert``,
``architectures``, labels), ``model.safetensors`` (Hugging Face parameter names; a tied
decoder is stored once, as Hugging Face does) and the tokenizer files.

Tokenizers are ``tokenizers.Tokenizer`` objects (the library Hugging Face's fast tokenizers
are built on), so reading and tokenising need no ``transformers``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

# One error class for every unusable checkpoint (ours or Hugging Face's): one line, exit 2.
from bert_packed.io.checkpoint import CheckpointError, safe_torch_load
from bert_packed.config import model_rules
from bert_packed.limits import PROBLEM_TYPE, value_rule
from bert_packed.io.files import atomic_path, read_utf8, read_vocab_tokens, write_text_atomic

__all__ = [
    "CheckpointError", "Pretrained", "read_pretrained", "resolve_model_config", "load_weights",
    "save_pretrained", "load_tokenizer", "save_tokenizer", "SHAPE_FIELDS", "check_hf_config", "check_layers",
    "HEAD_PREFIXES",
]

CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME = "config.json", "model.safetensors", "pytorch_model.bin"
SAFETENSORS_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
OUR_CHECKPOINT = "checkpoint.pt"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
# Fields that fix a tensor's shape: the checkpoint decides them.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size")
# Architecture fields the checkpoint provides unless the run's config sets them (e.g. dropout).
BEHAVIOUR_FIELDS = ("hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "layer_norm_eps",
                    "initializer_range", "pad_token_id", "tie_word_embeddings", "classifier_dropout")


@dataclasses.dataclass
class Pretrained:
    """What ``read_pretrained`` found: ``kind`` "hf" or "ours", the model fields (our names),
    the raw Hugging Face config (labels, architectures), the weights, and where the tokenizer is."""

    path: str
    kind: str
    model_values: Dict[str, Any]
    hf_config: Dict[str, Any]
    state_dict: Dict[str, torch.Tensor]
    tokenizer_path: Optional[str]


# ----------------------------------------------------------------------------- checking config.json

# Heads a checkpoint may lack on purpose (a new task's head starts fresh, as in transformers):
# the MLM/NSP heads, a classifier, a QA head, the pooler (QA and token-classification models
# have none). Everything else (embeddings, encoder layers) must come from the checkpoint.
HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.", "bert.pooler.")


def _kind_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a number", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _field_rules() -> Dict[str, Any]:
    """field -> (test, what it must be) of the architecture fields a ``config.json`` gives: the
    model section's declared rules (bert_packed.config.model_rules), and ``problem_type``'s."""
    rules = model_rules()
    return {**{name: rules[name] for name in (*SHAPE_FIELDS, *BEHAVIOUR_FIELDS) if name in rules},
            "problem_type": value_rule(Optional[str], PROBLEM_TYPE)}


def check_hf_config(hf_config: Mapping[str, Any], where: str) -> None:
    """Refuse a ``config.json`` field of the wrong type or range (``"hidden_size": "768"``,
    ``"num_hidden_layers": 2.5``, ``null``) and an ``id2label`` that is not a mapping of class
    ids 0..n-1 to distinct names: ``CheckpointError`` naming ``where`` and the field."""
    for name, (test, expected) in _field_rules().items():
        if name in hf_config and not test(hf_config[name]):
            value = hf_config[name]
            raise CheckpointError(f"{where}: {name} must be {expected}, got {json.dumps(value)} "
                                  f"({_kind_name(value)})")
    _id2label(hf_config, where)


def _id2label(hf_config: Mapping[str, Any], where: str) -> Optional[Dict[int, str]]:
    id2label = hf_config.get("id2label")
    if id2label is None:
        return None
    if not isinstance(id2label, dict):
        raise CheckpointError(f"{where}: id2label must map class ids to names (e.g. {{\"0\": \"neg\", \"1\": "
                              f"\"pos\"}}), got {_kind_name(id2label)}")
    out: Dict[int, str] = {}
    for key, name in id2label.items():
        text = str(key).strip()
        if not (text.isdigit() or (isinstance(key, int) and not isinstance(key, bool))):
            raise CheckpointError(f"{where}: id2label must map class ids to names, but it has the key {key!r} "
                                  f"(keyed by names, like label2id?): write {{\"0\": {json.dumps(str(key))}, ...}}")
        if not isinstance(name, str):
            raise CheckpointError(f"{where}: id2label[{json.dumps(str(key))}] must be a label name (a string), got "
                                  f"{json.dumps(name)}")
        out[int(text)] = name
    if sorted(out) != list(range(len(out))):
        raise CheckpointError(f"{where}: id2label's class ids must be 0..{len(out) - 1}, got "
                              f"{', '.join(str(i) for i in sorted(out))}")
    names: Dict[str, int] = {}
    for i in sorted(out):
        if out[i] in names:
            raise CheckpointError(f"{where}: id2label names {out[i]!r} twice (ids {names[out[i]]} and {i}); which "
                                  f"class a prediction of {out[i]!r} means is ambiguous")
        names[out[i]] = i
    return out


def _layer_indices(state: Mapping[str, Any]) -> List[int]:
    found = set()
    for key in state:
        match = _LAYER.search(key)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


_LAYER = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")


def _spans(numbers: List[int]) -> str:
    """``0-3, 5`` for [0, 1, 2, 3, 5]."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


# Every BERT encoder layer's and the embeddings' tensors (Hugging Face names; gamma/beta are
# the LayerNorm names of old TF-converted checkpoints).
_LAYER_TENSORS = tuple(f"{part}.{kind}" for part in (
    "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
    "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm") for kind in ("weight", "bias"))
_EMBEDDING_TENSORS = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
                      "LayerNorm.weight", "LayerNorm.bias")
_BODY = re.compile(r"(?:^|\.)((?:embeddings|encoder)\..*)$")


def check_layers(num_hidden_layers: int, state: Mapping[str, Any], where: str) -> None:
    """``CheckpointError`` unless the weights hold exactly encoder layers 0..num_hidden_layers-1,
    each whole, and the embeddings: what config.json names but the weights lack would train
    from random weights (a new task head may start fresh; the body may not)."""
    layers = _layer_indices(state)
    expected = list(range(num_hidden_layers))
    if layers == expected:
        held = set()
        for key in state:
            match = _BODY.search(key)
            if match:
                held.add(match.group(1).replace("LayerNorm.gamma", "LayerNorm.weight")
                         .replace("LayerNorm.beta", "LayerNorm.bias"))
        needed = [f"embeddings.{t}" for t in _EMBEDDING_TENSORS] + [
            f"encoder.layer.{i}.{t}" for i in expected for t in _LAYER_TENSORS]
        missing = [name for name in needed if name not in held]
        if missing:
            raise CheckpointError(f"{where}: the weights lack {len(missing)} tensor(s) of the BERT it describes "
                                  f"(first: {missing[0]}); they would start from random weights: use the weights "
                                  f"this config.json belongs to")
        return
    missing = sorted(set(expected) - set(layers))
    held = f"layers {_spans(layers)}" if layers else "no encoder layers"
    if missing:
        raise CheckpointError(f"{where}: num_hidden_layers is {num_hidden_layers} but the weights hold {held}: "
                              f"layer(s) {_spans(missing)} would start from random weights; fix num_hidden_layers, "
                              f"or use the weights this config.json belongs to")
    extra = sorted(set(layers) - set(expected))
    raise CheckpointError(f"{where}: num_hidden_layers is {num_hidden_layers} but the weights hold {held}: "
                          f"layer(s) {_spans(extra)} would be dropped; fix num_hidden_layers, or use the weights this "
                          f"config.json belongs to")


# ----------------------------------------------------------------------------- reading


def _read_json(path: str) -> Dict[str, Any]:
    try:
        value = json.loads(read_utf8(path, CheckpointError, drop_bom=False))  # json refuses a BOM, as before
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _first_line(exc: BaseException) -> str:
    """An exception's first line (torch's messages run to paragraphs)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def _load_tensor_file(path: str) -> Dict[str, torch.Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        return safe_torch_load(path)
    except CheckpointError:
        raise
    except Exception as exc:  # corrupt or truncated file: one line naming it
        raise CheckpointError(f"{path}: cannot read the weights ({type(exc).__name__}: {_first_line(exc)})") from None


def _index_shards(directory: str, index_path: str) -> List[str]:
    """The shard files a sharded checkpoint's index names (its ``weight_map`` values), checked:
    a JSON object of parameter name -> a file next to the index."""
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = "an empty object" if weight_map == {} else _kind_name(weight_map)
        raise CheckpointError(f"{index_path}: \"weight_map\" must be a JSON object of parameter name -> shard file, "
                              f"got {got}")
    shards = set()
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard or shard in (".", ".."):
            raise CheckpointError(f"{index_path}: weight_map[{_short(name)}] must be the name of a shard file in "
                                  f"{directory}, got {_short(shard)}")
        if not os.path.isfile(os.path.join(directory, shard)):
            raise CheckpointError(f"{index_path}: shard {_short(shard)} (of {_short(name)}) is not a file in {directory}")
        shards.add(shard)
    return sorted(shards)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _hf_weights(directory: str) -> Dict[str, torch.Tensor]:
    # transformers' order: safetensors before pickles, a single file before a sharded index (a
    # directory may hold both kinds, e.g. a converted model that kept its .bin index).
    for name in (SAFETENSORS_NAME, SAFETENSORS_INDEX, BIN_NAME, BIN_INDEX):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".index.json"):
            state: Dict[str, torch.Tensor] = {}
            for shard in _index_shards(directory, path):
                state.update(_load_tensor_file(os.path.join(directory, shard)))
            return state
        return _load_tensor_file(path)
    raise CheckpointError(f"{directory}: no weights ({SAFETENSORS_NAME}, {BIN_NAME} or a sharded index) next to "
                          f"{CONFIG_NAME}")


def tokenizer_in(directory: str) -> Optional[str]:
    """``directory`` when it holds a tokenizer (tokenizer.json or vocab.txt), else None."""
    return directory if any(os.path.isfile(os.path.join(directory, n)) for n in ("tokenizer.json", "vocab.txt")) else None


def hf_model_values(hf_config: Mapping[str, Any]) -> Dict[str, Any]:
    """Our model fields from a Hugging Face BERT ``config.json``."""
    names = set(SHAPE_FIELDS) | set(BEHAVIOUR_FIELDS)
    values = {k: v for k, v in hf_config.items() if k in names}
    values.setdefault("tie_word_embeddings", True)  # Hugging Face's default when the key is absent
    return values


def read_pretrained(path: str, *, weights: bool = True) -> Pretrained:
    """Read a Hugging Face BERT directory or this project's checkpoint (file or run directory);
    ``weights=False`` reads only what describes the model (``state_dict`` is then empty)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"init checkpoint {path}: no such file or directory")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_NAME)):
        hf_config = _read_json(os.path.join(path, CONFIG_NAME))
        model_type = hf_config.get("model_type", "bert")
        if model_type != "bert":
            raise CheckpointError(f"{path}: model_type {model_type!r}; only BERT checkpoints (model_type bert) load")
        where = os.path.join(path, CONFIG_NAME)
        check_hf_config(hf_config, where)
        state = _hf_weights(path) if weights else {}
        if weights and isinstance(hf_config.get("num_hidden_layers"), int):
            check_layers(hf_config["num_hidden_layers"], state, where)
        return Pretrained(path, "hf", hf_model_values(hf_config), hf_config, state, tokenizer_in(path))
    ours = os.path.join(path, OUR_CHECKPOINT) if os.path.isdir(path) else path
    if os.path.isdir(path) and not os.path.isfile(ours):
        raise CheckpointError(f"{path}: no {CONFIG_NAME}, so not a Hugging Face checkpoint directory (nor a run "
                              f"directory with {OUR_CHECKPOINT}); give the folder holding config.json and the weights")
    try:
        # mmap: describing the model does not read the weights.
        state = safe_torch_load(ours, mmap=not weights)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{ours}: cannot read the checkpoint ({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(f"{ours}: not a checkpoint of this project (no model weights and config)")
    model_section = dict(state["config"].get("model", {}))
    values = {k: v for k, v in model_section.items() if k in set(SHAPE_FIELDS) | set(BEHAVIOUR_FIELDS)}
    # The run's own export (labels, tokenizer) when it has one.
    run_dir = os.path.dirname(os.path.abspath(ours))
    export = os.path.join(run_dir, "hf")
    hf_config = _read_json(os.path.join(export, CONFIG_NAME)) if os.path.isfile(os.path.join(export, CONFIG_NAME)) else {}
    if hf_config:
        check_hf_config(hf_config, os.path.join(export, CONFIG_NAME))
    if weights and isinstance(values.get("num_hidden_layers"), int):
        check_layers(values["num_hidden_layers"], state["model"], ours)
    tokenizer = export if tokenizer_in(export) else model_section.get("tokenizer")
    return Pretrained(path, "ours", values, hf_config, dict(state["model"]) if weights else {}, tokenizer)


def resolve_model_config(model, pretrained: Pretrained) -> None:
    """Take the model's shape (and, unless set, its other architecture fields) from the checkpoint.

    A shape field the run's config sets to something other than its default AND other than
    the checkpoint's value is a contradiction: ``CheckpointError`` naming both.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(type(model))}  # ``model``: the model section
    where = os.path.join(pretrained.path, CONFIG_NAME) if pretrained.kind == "hf" else pretrained.path
    for name in SHAPE_FIELDS:
        if name not in pretrained.model_values:
            raise CheckpointError(f"{where}: lacks {name}; cannot tell the model's shape")
        value, ours = pretrained.model_values[name], getattr(model, name)
        if ours != defaults[name] and ours != value:
            raise CheckpointError(f"model.{name}={ours} contradicts the checkpoint's {name}={value} ({where}); "
                                  f"drop the setting: the shape comes from the checkpoint")
        setattr(model, name, value)
    for name in BEHAVIOUR_FIELDS:
        if name in pretrained.model_values and getattr(model, name) == defaults[name]:
            setattr(model, name, pretrained.model_values[name])


# ----------------------------------------------------------------------------- weights


def _group(keys: List[str]) -> str:
    """Readable summary of parameter names: ``cls.predictions.* (6)``, ``classifier.weight``."""
    groups: Dict[str, List[str]] = {}
    for key in sorted(keys):
        parts = key.split(".")
        prefix = ".".join(parts[:2]) if len(parts) > 2 else key
        groups.setdefault(prefix, []).append(key)
    return ", ".join(v[0] if len(v) == 1 else f"{k}.* ({len(v)})" for k, v in groups.items())


def _normalise_keys(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A bare ``BertModel`` checkpoint (no ``bert.`` prefix) into a task model gets the prefix."""
    own = set(model.state_dict())
    wants_prefix = any(k.startswith("bert.") for k in own)
    has_prefix = any(k.startswith("bert.") for k in state)
    if wants_prefix and not has_prefix:
        return {(f"bert.{k}" if k.split(".")[0] in ("embeddings", "encoder", "pooler") else k): v
                for k, v in state.items()}
    return dict(state)


def load_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, source: str) -> str:
    """Load checkpoint weights into ``model`` by name; return a one-line summary.

    Tensors the model has but the checkpoint lacks keep their fresh initialisation (a new
    task head); checkpoint tensors the model has no place for are not used (another head).
    A classifier whose number of labels differs is re-initialised (a new label set); any
    other shape difference is a ``CheckpointError``.
    """
    from bert_packed.model.modeling import hf_parameter_name, hf_shapes, load_hf_state_dict

    state = _normalise_keys(model, state_dict)
    own = model.state_dict()
    # A vocabulary tensor may come padded (this project's checkpoint with model.vocab_padding_multiple)
    # or not (Hugging Face's): either loads into either (modeling.fit_vocab_rows).
    shapes = {name: {tuple(tensor.shape)} for name, tensor in own.items()}
    for name, shape in hf_shapes(model).items():
        shapes.setdefault(name, set()).add(shape)
    reinitialised = []
    for key in list(state):
        target = hf_parameter_name(key)  # as load_hf_state_dict will rename it
        if target in shapes and tuple(state[key].shape) not in shapes[target]:
            if target.startswith("classifier."):
                reinitialised.append(target)
                del state[key]
                continue
            raise CheckpointError(f"{source}: tensor {key} has shape {list(state[key].shape)}, the model's is "
                                  f"{list(min(shapes[target]))}; the checkpoint's config.json does not match its weights")
    result = load_hf_state_dict(model, state, strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    missing = [k for k in result.missing_keys if k not in buffers]
    # A tied decoder is provided by the word embeddings; not a missing weight.
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "cls.predictions.decoder.weight")]
    needed = [k for k in missing if not k.startswith(HEAD_PREFIXES)]
    if needed:
        raise CheckpointError(f"{source}: the weights lack {_group(needed)}, which the model needs (only a task head "
                              f"may start fresh); the checkpoint's config.json does not match its weights")
    unexpected = [k for k in result.unexpected_keys
                  if not k.endswith(("position_ids", "token_type_ids"))]
    loaded = len(own) - len(missing) - len(reinitialised)
    parts = [f"init checkpoint {source}: loaded {loaded} of {len(own)} tensors"]
    if missing:
        parts.append(f"newly initialised: {_group(missing)}")
    if reinitialised:
        parts.append(f"re-initialised (other number of labels): {_group(reinitialised)}")
    if unexpected:
        parts.append(f"not used: {_group(unexpected)}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- tokenizers


def load_tokenizer(path: str, *, lowercase: Optional[bool] = None):
    """A ``tokenizers.Tokenizer`` with BERT's ``[CLS] A [SEP] (B [SEP])`` template.

    ``path``: a directory with ``tokenizer.json`` (used as is) or ``vocab.txt`` (+ optional
    ``tokenizer_config.json`` for ``do_lower_case``), or a ``vocab.txt`` file. ``lowercase``
    overrides the configured lower-casing for a bare vocabulary.
    """
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        try:
            return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as exc:
            raise CheckpointError(f"{path}/tokenizer.json: not a tokenizers file ({exc})") from None
    vocab = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
    if not os.path.isfile(vocab):
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json or vocab.txt); set model.tokenizer to one")
    if lowercase is None:
        config_path = os.path.join(directory, "tokenizer_config.json")
        lowercase = bool(_read_json(config_path).get("do_lower_case", True)) if os.path.isfile(config_path) else True
    read_vocab_tokens(vocab, CheckpointError)  # a token listed twice is refused (ambiguous ids)
    try:
        wordpiece = BertWordPieceTokenizer(vocab, lowercase=lowercase, strip_accents=None, clean_text=True,
                                           handle_chinese_chars=True)
    except Exception as exc:
        raise CheckpointError(f"{vocab}: not a WordPiece vocabulary ({exc})") from None
    return wordpiece._tokenizer  # the underlying tokenizers.Tokenizer (normaliser, template, decoder)


def _lowercases(tokenizer) -> bool:
    normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
    return bool(normalizer.get("lowercase", False))


def save_tokenizer(tokenizer, directory: str, *, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``vocab.txt`` and ``tokenizer_config.json`` for ``AutoTokenizer``."""
    os.makedirs(directory, exist_ok=True)
    with atomic_path(os.path.join(directory, "tokenizer.json")) as tmp:
        tokenizer.save(tmp)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    write_text_atomic(os.path.join(directory, "vocab.txt"), "".join(token + "\n" for token, _ in vocab))
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": _lowercases(tokenizer),
              "model_max_length": int(model_max_length), "unk_token": "[UNK]", "sep_token": "[SEP]",
              "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}
    write_text_atomic(os.path.join(directory, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- export


def save_pretrained(model: torch.nn.Module, directory: str, *, tokenizer=None, id2label: Optional[Mapping[int, str]] = None,
                    extra_config: Optional[Mapping[str, Any]] = None) -> str:
    """Export ``model`` (ours: ``BertForPreTraining``, ``BertForSequenceClassification``, ...)
    as a Hugging Face directory; returns it. ``tokenizer``: a ``tokenizers.Tokenizer`` (or a
    path ``load_tokenizer`` reads) to ship with it; ``id2label`` names the labels."""
    from safetensors.torch import save_file

    cfg = model.config
    architecture = model.hf_architecture
    config = {"architectures": [architecture], "model_type": "bert", **cfg.to_hf_dict()}
    config.pop("num_labels", None)  # Hugging Face derives it from id2label
    config.update(model.hf_label_config(id2label))
    config["dtype"] = "float32"
    config.update(extra_config or {})
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is not None and tokenizer.get_vocab_size() > cfg.vocab_size:
        # Checked before anything is written: ids past the word embeddings make a model that
        # transformers cannot run (an index error on the first such token).
        raise CheckpointError(f"the tokenizer has {tokenizer.get_vocab_size():,} tokens but the model's vocabulary "
                              f"(vocab_size) has {cfg.vocab_size:,}; an export with it would index past the word "
                              f"embeddings: ship the tokenizer the model was trained with")
    os.makedirs(directory, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.hf_state_dict().items()}
    # Shared tensors are stored once (safetensors refuses aliases), as Hugging Face does:
    # the decoder bias is cls.predictions.bias; a tied decoder is the word embeddings.
    state.pop("cls.predictions.decoder.bias", None)
    if cfg.tie_word_embeddings:
        state.pop("cls.predictions.decoder.weight", None)
    with atomic_path(os.path.join(directory, SAFETENSORS_NAME)) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    write_text_atomic(os.path.join(directory, CONFIG_NAME), json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory, model_max_length=cfg.max_position_embeddings)
    return directory


def label_maps(hf_config: Mapping[str, Any]) -> Tuple[Optional[Dict[int, str]], Optional[str]]:
    """(id2label, problem_type) of a Hugging Face config, or (None, None)."""
    id2label = _id2label(hf_config, CONFIG_NAME)
    return id2label or None, hf_config.get("problem_type")
