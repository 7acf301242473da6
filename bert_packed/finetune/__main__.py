"""Fine-tuning utilities on the command line.

    python -m bert_packed.finetune export RUN_DIR|checkpoint.pt --output DIR [--tokenizer PATH]
    python -m bert_packed.finetune predict --model DIR --input FILE [--text-column text]
        [--text-pair-column C] [--output predictions.jsonl] [--max-sequence-length 128]
    python -m bert_packed.finetune fortunes --output-dir DIR [--categories a b ...] [--seed 0]

``export`` writes the Hugging Face directory of a run's checkpoint (any task; the tokenizer
of ``--tokenizer``, ``model.tokenizer`` or the checkpoint the run started from).
``predict`` classifies a CSV/TSV/JSONL file with an exported (or any Hugging Face)
sequence-classification model on the CPU, packed, and writes one JSON line per row.
``fortunes`` writes the fortune-cookie classification data (docs/finetuning.md).
``--output`` never writes over an input (the ``--input`` file, anything in the ``--model``
directory, the checkpoint, its tokenizer or init checkpoint) nor into a run's directory (one
holding checkpoint.pt or metrics.jsonl: that run's own outputs live there).
User mistakes: one ``error:`` line, exit status 2, nothing written.
"""
from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

from packing.entry import ArgumentParser, run_cli
from bert_packed.io.files import write_text_atomic

RUN_FILES = ("checkpoint.pt", "metrics.jsonl")  # what makes a directory a run's own


class OutputError(ValueError):
    """An output path that would overwrite an input or land in a run's own directory."""


def _inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or inside it (symbolic links resolved)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def _run_directory(path: str) -> Optional[str]:
    """The run directory (one holding checkpoint.pt or metrics.jsonl) that ``path`` is or is
    inside, as the user named it; None when there is none."""
    named = os.path.abspath(path)
    while True:
        if os.path.isdir(named) and any(os.path.isfile(os.path.join(named, n)) for n in RUN_FILES):
            return named
        parent = os.path.dirname(named)
        if parent == named:
            return None
        named = parent


def refuse_output(output: str, option: str, *, inputs=(), input_dirs=(), kind: str = "file") -> None:
    """``OutputError`` (one line) when writing ``output`` would change an input or a run's own
    directory: it is one of ``inputs`` ((option, path) pairs, files), inside one of
    ``input_dirs`` ((option, directory) pairs), inside a run directory, or of the wrong kind
    (``kind``: "file" or "directory")."""
    for name, path in inputs:
        if path and _same_file(output, path):
            raise OutputError(f"{option} {output} is the {name} {path}; writing it would destroy the input: choose "
                              f"another output path")
    for name, directory in input_dirs:
        if directory and os.path.isdir(directory) and _inside(output, directory):
            raise OutputError(f"{option} {output} is inside the {name} {directory}; writing there would change that "
                              f"input: choose a path outside it")
    run_dir = _run_directory(output)
    if run_dir is not None:
        held = ", ".join(n for n in RUN_FILES if os.path.isfile(os.path.join(run_dir, n)))
        raise OutputError(f"{option} {output} is inside the run directory {run_dir} (it holds {held}); a run's "
                          f"directory is for that run's own outputs: choose a path outside it")
    if kind == "file" and os.path.isdir(output):
        raise OutputError(f"{option} {output} is a directory; give the path of a file to write")
    if kind == "file" and output.endswith((os.sep, os.altsep or os.sep)):  # a folder to be, not a file
        raise OutputError(f"{option} {output} ends in {output[-1]!r}, so it names a directory; give the path of a "
                          f"file to write (e.g. {os.path.join(output, 'predictions.jsonl')})")
    if kind == "directory" and os.path.exists(output) and not os.path.isdir(output):
        raise OutputError(f"{option} {output} is a file; give a directory to write the export into")


def export(checkpoint: str, output: str, tokenizer: Optional[str] = None) -> str:
    """Hugging Face export of this project's checkpoint (file or run directory)."""
    from bert_packed.io import hf_io
    from bert_packed.io.checkpoint import CHECKPOINT_NAME, load_checkpoint
    from bert_packed.config import config_from_dict
    from bert_packed.tasks.registry import get_task, register_config_sections

    register_config_sections()  # the checkpoint's config holds its task's own finetune.* keys
    path = os.path.join(checkpoint, CHECKPOINT_NAME) if os.path.isdir(checkpoint) else checkpoint
    if not os.path.isfile(path):
        raise hf_io.CheckpointError(f"{checkpoint}: no {CHECKPOINT_NAME} (train with train.checkpoint_every > 0)")
    refuse_output(output, "--output", inputs=[("checkpoint", path)], kind="directory")
    state = load_checkpoint(path)
    config = config_from_dict(state["config"])
    if tokenizer:
        config.model.tokenizer = tokenizer
    # The tokenizer and the checkpoint the run started from are read while the export is written.
    sources = [("--tokenizer" if tokenizer else "model.tokenizer", config.model.tokenizer),
               ("init checkpoint (model.init_checkpoint)", config.model.init_checkpoint)]
    refuse_output(output, "--output", inputs=[(name, p) for name, p in sources if p and os.path.isfile(p)],
                  input_dirs=[(name, p) for name, p in sources if p and os.path.isdir(p)], kind="directory")
    task = get_task(config)
    task.load_state_dict(state.get("task") or {})
    init, config.model.init_checkpoint = config.model.init_checkpoint, None  # weights come from the checkpoint
    model = task.build_model()
    config.model.init_checkpoint = init  # its tokenizer, if nothing else names one
    model.load_state_dict(state["model"])
    return task.export(model, output)


HEAD_TASKS = {"ForSequenceClassification": "sequence classification", "ForTokenClassification": "token classification",
              "ForQuestionAnswering": "question answering", "ForPreTraining": "pre-training (no task head)",
              "ForMaskedLM": "masked language modelling (no task head)", "Model": "no task head"}


def check_sequence_classifier(model_dir: str, pretrained) -> None:
    """A one-line ``CheckpointError`` unless ``model_dir`` holds a sequence classifier: its
    config.json's ``architectures`` name another task head, or its classifier's outputs are not
    as many as ``id2label``'s labels."""
    from bert_packed.io import hf_io

    architectures = [a for a in pretrained.hf_config.get("architectures") or [] if isinstance(a, str)]
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        name = architectures[0]
        task = next((t for suffix, t in HEAD_TASKS.items() if name.endswith(suffix)), "another task")
        raise hf_io.CheckpointError(f"{model_dir}: config.json's architectures is {name} ({task}); predict "
                                    f"classifies sequences and needs a sequence-classification model "
                                    f"(BertForSequenceClassification)")
    id2label, _ = hf_io.label_maps(pretrained.hf_config)
    weight = next((v for k, v in pretrained.state_dict.items() if k.endswith("classifier.weight")), None)
    if id2label and weight is not None and getattr(weight, "ndim", 0) == 2 and weight.shape[0] != len(id2label):
        raise hf_io.CheckpointError(f"{model_dir}: config.json's id2label names {len(id2label)} labels but the "
                                    f"classifier has {weight.shape[0]} outputs; the config does not belong to these "
                                    f"weights")


def predict(model_dir: str, input_path: str, output: str, *, text_column: str = "text",
            text_pair_column: Optional[str] = None, max_sequence_length: int = 128, max_sequences_per_pack: int = 6,
            micro_batch_size: int = 16) -> int:
    """Classify ``input_path`` with the sequence-classification model in ``model_dir``; returns rows written."""
    from functools import partial

    import numpy as np
    import torch

    from bert_packed.io import hf_io
    from bert_packed.tasks import data as ft_data
    from bert_packed.tasks.classification.data import collate_classification
    from bert_packed.tasks.classification.metrics import prediction_lines
    from bert_packed.tasks.classification.model import BertForSequenceClassification
    from bert_packed.model.modeling import BertConfig

    refuse_output(output, "--output", inputs=[("--input file", input_path)],
                  input_dirs=[("--model directory", model_dir)], kind="file")
    pretrained = hf_io.read_pretrained(model_dir)
    check_sequence_classifier(model_dir, pretrained)
    id2label, problem_type = hf_io.label_maps(pretrained.hf_config)
    if not id2label:
        raise hf_io.CheckpointError(f"{model_dir}: config.json has no id2label; not a sequence-classification model")
    values = {k: v for k, v in pretrained.model_values.items() if k != "classifier_dropout"}
    config = BertConfig(**values, num_labels=len(id2label), problem_type=problem_type,
                        max_sequences_per_pack=max_sequences_per_pack)
    if max_sequence_length > config.max_position_embeddings:
        max_sequence_length = config.max_position_embeddings
    model = BertForSequenceClassification(config).eval()
    report = hf_io.load_weights(model, pretrained.state_dict, source=model_dir)
    fresh = [part for part in report.split("; ") if part.startswith(("newly initialised", "re-initialised"))]
    if fresh:  # predict would label the texts through random weights
        raise hf_io.CheckpointError(f"{model_dir}: not a trained sequence-classification model: {'; '.join(fresh)} "
                                    f"(predict would classify through random weights); give a model fine-tuned for "
                                    f"sequence classification (a run's OUT/hf)")
    if pretrained.tokenizer_path is None:
        raise hf_io.CheckpointError(f"{model_dir}: no tokenizer files (tokenizer.json or vocab.txt)")
    tokenizer = hf_io.load_tokenizer(pretrained.tokenizer_path)
    if tokenizer.get_vocab_size() > config.vocab_size:  # its ids past the embeddings: an index error
        raise hf_io.CheckpointError(f"{model_dir}: the tokenizer has {tokenizer.get_vocab_size():,} tokens but the "
                                    f"model's vocabulary (vocab_size) has {config.vocab_size:,}; the tokenizer does "
                                    f"not belong to this model")
    columns = [text_column] + ([text_pair_column] if text_pair_column else [])
    table = ft_data.read_table(input_path, columns)
    encoded = ft_data.encode_texts(tokenizer, table[text_column], table[text_pair_column] if text_pair_column else None,
                                   max_length=max_sequence_length, where=input_path)
    collate = partial(collate_classification, max_sequence_length=max_sequence_length,
                      max_sequences_per_pack=max_sequences_per_pack)
    dataset = ft_data.PackedDataset(encoded, {"labels": np.zeros(len(encoded), np.int64)}, collate,
                                    max_sequence_length=max_sequence_length,
                                    max_sequences_per_pack=max_sequences_per_pack, algorithm="lpfhp", seed=0)
    logits = np.zeros((len(encoded), config.num_labels), dtype=np.float32)
    fields = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions")
    with torch.no_grad():
        for batch, rows in dataset.batches(micro_batch_size):
            out = model(**{k: torch.from_numpy(batch[k]) for k in fields})["logits"].numpy()
            logits[rows[rows >= 0]] = out[rows >= 0]
    lines = prediction_lines(logits, config.resolved_problem_type, id2label)
    write_text_atomic(output, "".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m bert_packed.finetune", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="Hugging Face export of a run's checkpoint")
    p.add_argument("checkpoint", help="a run directory (with checkpoint.pt) or a checkpoint.pt file")
    p.add_argument("--output", required=True, help="directory to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--tokenizer", help="tokenizer directory or vocab.txt to ship (default: the run's)")
    p = sub.add_parser("predict", help="classify a file with a sequence-classification model directory")
    p.add_argument("--model", required=True, help="a Hugging Face directory (e.g. a run's OUT/hf)")
    p.add_argument("--input", required=True, help="CSV, TSV or JSONL file")
    p.add_argument("--output", default="predictions.jsonl")
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column")
    p.add_argument("--max-sequence-length", type=int, default=128)
    p = sub.add_parser("fortunes", help="write the fortune-cookie classification data (train.csv, validation.csv)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--categories", nargs="+", help="fortune files (default: %(default)s)")
    p.add_argument("--fortunes-dir", help="where the fortune files are (default: Debian's)")
    p.add_argument("--validation-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return run_cli(lambda: _run(args))


def _run(args) -> None:
    if args.command == "export":
        print(export(args.checkpoint, args.output, args.tokenizer))
    elif args.command == "predict":
        count = predict(args.model, args.input, args.output, text_column=args.text_column,
                        text_pair_column=args.text_pair_column, max_sequence_length=args.max_sequence_length)
        print(f"{count} predictions -> {args.output}")
    else:
        from bert_packed.finetune import fortunes

        counts = fortunes.write_fortunes_dataset(args.output_dir, args.fortunes_dir or fortunes.FORTUNES_DIR,
                                                 args.categories or fortunes.DEFAULT_CATEGORIES,
                                                 validation_fraction=args.validation_fraction, seed=args.seed)
        print(json.dumps(counts))


if __name__ == "__main__":
    sys.exit(main())
