"""Declared bounds of config values: :func:`bounded` and the maximums sections share.

Every int and float field of every config section declares a maximum (``le``/``lt``; above 1,
with ``why``: the reason, shown in the error) or says why it has none (``unbounded``); a test
(tests/loop/test_config.py) checks all registered sections, so a new field cannot forget one. The
maximums stop absurd values (10^30 steps, a micro-batch no memory holds, a seed numpy refuses)
with one line before anything is built; each sits well above any real run. A maximum that
several fields share is defined here, with its reason; one of a single field sits on it.

This module imports nothing from the project, so task modules (which must not import
``bert_packed.config``) and the backends' sections use it too. ``bert_packed.config`` checks the
bounds of every section (``check_section``) and re-exports :func:`bounded`.
"""
from __future__ import annotations

import math
import typing
from dataclasses import field
from typing import Any, Callable, Dict, Optional, Tuple

BOUND_KEYS = ("ge", "gt", "lt", "le")


def bounded(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None, lt: Optional[float] = None,
            le: Optional[float] = None, **metadata: Any):
    """A dataclass field whose value ``bert_packed.config.validate`` keeps within the given
    bounds (None is always allowed for an Optional field: it means "not set"; a list's items are
    checked one by one).

    Metadata understood besides the bounds: ``hint`` (appended to every bound message, e.g.
    "(0 = no trust ratio)"), ``why`` (the reason for the maximum, shown when a value exceeds it;
    a maximum with a reason is a sanity limit, not part of the value's meaning, so a value below
    the minimum is told only the minimum), ``unbounded`` (why the field deliberately has no
    maximum)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("lt", lt), ("le", le)) if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={**metadata, **bounds})
    return field(default=default, metadata={**metadata, **bounds})


def at_most(limit: float, why: str) -> Dict[str, Any]:
    """``le=limit`` with its reason, for ``bounded(default, ge=1, **at_most(10, "why"))``."""
    return {"le": limit, "why": why}


def _number(bound: float) -> str:
    """A bound as written: 1000000000, 65504, 0.5 (a whole float is shown as the integer it is)."""
    if isinstance(bound, float) and bound.is_integer() and abs(bound) < 1e16:
        return str(int(bound))
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def bound_message(key: str, value: Any, meta: Dict[str, Any]) -> Optional[str]:
    """None if ``value`` is within the bounds in ``meta``, else the one-line reason it is not."""
    ge, gt, lt, le = (meta.get(k) for k in BOUND_KEYS)
    low_ok = (ge is None or value >= ge) and (gt is None or value > gt)
    high_ok = (lt is None or value < lt) and (le is None or value <= le)
    if low_ok and high_ok:
        return None
    hint = f" {meta['hint']}" if meta.get("hint") else ""
    low = f"[{_number(ge)}" if ge is not None else (f"({_number(gt)}" if gt is not None else None)
    high = f"{_number(lt)})" if lt is not None else (f"{_number(le)}]" if le is not None else None)
    if meta.get("why"):
        if not high_ok:
            limit = f"< {_number(lt)}" if lt is not None else f"<= {_number(le)}"
            return f"{key} must be {limit} ({meta['why']}), got {value}"
        high = None
    if low and high:
        return f"{key} must be in {low}, {high}{hint}, got {value}"
    if low:
        return f"{key} must be {'>=' if ge is not None else '>'} {_number(ge if ge is not None else gt)}{hint}, got {value}"
    return f"{key} must be {'<' if lt is not None else '<='} {_number(lt if lt is not None else le)}{hint}, got {value}"


def meaning_bounds(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The bounds in ``meta`` that are part of the value's meaning: all but a maximum given with a
    reason (``why``: a sanity limit of a run's config, not of the value, e.g. a checkpoint's)."""
    bounds = {k: meta[k] for k in BOUND_KEYS if meta.get(k) is not None}
    if meta.get("why"):
        bounds.pop("le", None)
        bounds.pop("lt", None)
    return bounds


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _range_words(noun: str, bounds: Dict[str, Any]) -> str:
    """"a positive integer", "an integer >= 0", "a number in [0, 1)", "a positive number"."""
    ge, gt, lt, le = (bounds.get(k) for k in BOUND_KEYS)
    article = "an" if noun[0] in "aeiou" else "a"
    if (ge is not None or gt is not None) and (lt is not None or le is not None):
        low = f"[{_number(ge)}" if ge is not None else f"({_number(gt)}"
        high = f"{_number(lt)})" if lt is not None else f"{_number(le)}]"
        return f"{article} {noun} in {low}, {high}"
    if (noun == "integer" and ge == 1) or gt == 0:
        return f"a positive {noun}"
    for op, bound in ((">=", ge), (">", gt), ("<", lt), ("<=", le)):
        if bound is not None:
            return f"{article} {noun} {op} {_number(bound)}"
    return f"{article} {noun}"


def value_rule(tp: Any, meta: Dict[str, Any]) -> Tuple[Callable[[Any], bool], str]:
    """(test, what the value must be) of a field of type ``tp`` declared with ``meta``: its type,
    its choices and the bounds that are part of its meaning (:func:`meaning_bounds`), for values
    that arrive without the config's parsing (a checkpoint's ``config.json``, a ``BertConfig``
    built in code). ``meta["what"]`` words a text value's rule ("the name of an activation")."""
    optional = typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    choices = meta.get("choices")
    bounds = meaning_bounds(meta)
    if choices is not None:
        names = [c for c in choices if c is not None]
        optional = optional or None in choices
        test, what = (lambda v: v in names), f"one of {', '.join(map(str, names))}"
    elif tp is bool:
        test, what = (lambda v: isinstance(v, bool)), "true or false"
    elif tp in (int, float):
        typed = _integer if tp is int else _finite
        test = lambda v: typed(v) and bound_message("", v, bounds) is None  # noqa: E731
        what = _range_words("integer" if tp is int else "number", bounds)
    elif tp is str:
        test, what = (lambda v: isinstance(v, str) and bool(v)), meta.get("what", "a text")
    else:
        test, what = (lambda v: True), "anything"
    if optional:
        return (lambda v: v is None or test(v)), f"null or {what}"
    return test, what


# Hugging Face's names of a sequence classification's problem (``BertConfig.problem_type``).
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")
# A problem_type field's declaration (null: resolved from the labels, as Hugging Face does).
PROBLEM_TYPE = {"choices": (None, *PROBLEM_TYPES)}


# ---------------------------------------------------------------------------------------
# Maximums shared by several fields (and by the tasks' and backends' sections).

# Optimizer steps, and every "every N steps" / "N steps" count: BERT-Large pre-training takes
# 10^4 (LAMB) to 10^6 (Adam) steps; 10^9 is beyond any run (years even for a tiny model).
STEPS = at_most(10**9, "more optimizer steps than any run takes; BERT-Large pre-training takes 10^4 to 10^6")

# Tokens of one sequence or window. Dense attention keeps S x S scores per head (16 GiB in fp32
# at 65536), BERT-family checkpoints hold at most 8192 positions, and with micro_batch_size at
# most MICRO_BATCH a micro-batch holds at most 2^30 tokens: its token offsets fit the int32
# the variable-length attention kernels index them with.
SEQUENCE_TOKENS = 65536
SEQUENCE = at_most(SEQUENCE_TOKENS, "one head's dense attention scores are 16 GiB at 65536 tokens; BERT checkpoints "
                                    "hold at most 8192 positions")

# Packs per replica per forward pass: 16384 packs of 128 tokens at hidden size 768 are 6 GiB per
# fp32 activation, dozens of which the backward pass keeps; (see SEQUENCE for the int32 bound).
MICRO_BATCH = at_most(2**14, "no device holds the activations of more packs in one forward pass")

# Micro-batches / packs per optimizer step: the largest published BERT batch is 65536 sequences
# (LAMB, phase 1); Graphcore's packed phase 1 accumulates 1750 micro-batches.
PER_STEP = at_most(2**20, "16 times the largest published BERT batch (65536 sequences)")

# Sequences in one pack: packed HDF5 files store sequence ids as int8 (bert_packed/data/prepare/pack.py),
# and the per-sequence selection masks are [B, S, K].
SEQUENCES_PER_PACK = at_most(127, "packed files store sequence ids as int8")

# Layers: DeepNet trained 1000-layer transformers; BERT-Large has 24.
LAYERS = at_most(1024, "deeper than any trained transformer (DeepNet: 1000 layers)")

# Vocabulary rows: the embedding is vocab_size x hidden_size weights (16 GiB in fp32 at 2^22 x
# 1024); multilingual BERT-family vocabularies have about 250000 entries.
VOCABULARY = at_most(2**22, "16 times the largest BERT-family vocabulary (about 250000)")

# Hidden width: one hidden x hidden matrix is 16 GiB in fp32 at 65536; the widest published
# transformers use about 25000.
HIDDEN = at_most(65536, "one hidden x hidden weight matrix would be 16 GiB; the widest transformers use ~25000")


# ---------------------------------------------------------------------------------------
# Size flags of the data command line (python -m bert_packed.data): the maximum of each, with
# its reason, checked before anything is read (absurd values ended in a memory error, an
# overflow traceback or a panic of the tokenizers library). Each command's own minimums stay
# where the command checks them; a minimum here is one the command lacked.

# A word's count in the corpus: tokenizers keeps counts as 64-bit integers and panics on a
# negative one; no word of any corpus occurs 10^12 times (Common Crawl's "the": ~10^11).
FREQUENCY = at_most(10**12, "more occurrences than any word has in any corpus")

# Passes of create over the corpus, each writing it again with other masks: BERT used 10.
DUPE_FACTOR = at_most(1000, "each pass writes the whole corpus again; BERT used 10")

# Masked tokens of a sequence or a pack: at most the tokens there are.
MASKED = at_most(SEQUENCE_TOKENS, f"more masked tokens than the longest sequence ({SEQUENCE_TOKENS} tokens) holds")

# Packs a pack step builds in memory before writing them: each holds S tokens of 6 fields.
CHUNK_PACKS = at_most(2**20, "a chunk is built in memory: 2^20 packs of 512 tokens are GiBs per field")

# Seeds: the output file records the seed as an unsigned 64-bit integer (a larger one ended in
# h5py's "Object dtype has no native HDF5 equivalent" traceback after all the work).
SEED = at_most(2**64 - 1, "the output file records the seed as an unsigned 64-bit integer")

DATA_FLAGS = {
    "vocab": (("size", "--size", None, VOCABULARY), ("min_frequency", "--min-frequency", 0, FREQUENCY)),
    "create": (("max_seq_length", "--max-seq-length", None, SEQUENCE),
               ("max_predictions", "--max-predictions", None, MASKED),
               ("dupe_factor", "--dupe-factor", None, DUPE_FACTOR), ("seed", "--seed", None, SEED)),
    "pack": (("max_sequence_length", "--max-sequence-length", 1, SEQUENCE),
             ("max_masked_tokens_per_pack", "--max-masked-tokens-per-pack", 1, MASKED),
             ("chunk_packs", "--chunk-packs", None, CHUNK_PACKS), ("seed", "--seed", None, SEED)),
}


def size_flag_error(command: str, values: Dict[str, Any]) -> Optional[str]:
    """The one-line reason a size flag of ``python -m bert_packed.data COMMAND`` is out of bounds
    (``values``: the parsed flags by name), or None."""
    for name, flag, low, high in DATA_FLAGS.get(command, ()):
        value = values.get(name)
        if value is None:
            continue
        meta = {**high, **({"ge": low} if low is not None else {})}
        message = bound_message(flag, value, meta)
        if message is not None:
            return message
    return None
