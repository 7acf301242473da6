"""Packed vs padded SQuAD fine-tuning on the tests' question set: rows per epoch, time, EM / F1.

    python benchmarks/squad_packed_vs_padded.py                  # ~5 min on 2 shared cores
    python benchmarks/squad_packed_vs_padded.py --epochs 6 --train-paragraphs 160
    python benchmarks/squad_packed_vs_padded.py --prepare-only ...   # data + checkpoint for your own run.py jobs

Data: the SQuAD v2.0 question set the tests write (tests/squad_fixtures.py: template
questions over an embedded corpus, long contexts needing several windows, unanswerable
questions): training set seed 0, validation set seed 1. Model: a small BERT built with
transformers (random weights, no pre-training: there is no hub here) saved as a Hugging
Face directory with the tests' WordPiece tokenizer, passed with --init-checkpoint.

`run.py --config finetune_squad` jobs at the config's 384 tokens / stride 128, same seed and
epochs: packed (up to 4 windows per row) and padded (`finetune.packing=false`), one thread
each, run one after the other and alternating (packed, padded, packed, ... `--repeats`
pairs), so slow phases of the shared machine hit both; the time reported is each's median
over its repeats. (Side by side they do not share the machine equally: the packed run ends
first and the padded one then runs alone, faster.) The CPU is shared and noisy: read the
ratio, not the absolute seconds. Output: WORKDIR/results.json and a Markdown table.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchmarks.common import markdown_table, run_measured, spread  # noqa: E402


def prepare(workdir, args):
    import torch
    import transformers

    from squad_fixtures import corpus_texts, make_squad_v2, make_tokenizer, write_squad

    train = make_squad_v2(seed=0, num_paragraphs=args.train_paragraphs)
    dev = make_squad_v2(seed=1, num_paragraphs=args.dev_paragraphs)
    write_squad(os.path.join(workdir, "train.json"), train)
    write_squad(os.path.join(workdir, "dev.json"), dev)
    tokenizer = make_tokenizer(corpus_texts(train) + corpus_texts(dev))
    config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden,
                                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                     intermediate_size=4 * args.hidden, max_position_embeddings=512)
    torch.manual_seed(0)
    checkpoint = os.path.join(workdir, "init")
    transformers.BertForPreTraining(config).save_pretrained(checkpoint)
    tokenizer.save(os.path.join(checkpoint, "tokenizer.json"))
    return checkpoint


def command(workdir, checkpoint, args, packed):
    out = os.path.join(workdir, "packed" if packed else "padded")
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), "--config", "finetune_squad", "--init-checkpoint", checkpoint,
           "--output-dir", out, "--no-progress",
           "--set", f"finetune.train_file={os.path.join(workdir, 'train.json')}",
           "--set", f"finetune.validation_file={os.path.join(workdir, 'dev.json')}",
           "--set", f"finetune.epochs={args.epochs}", "--set", "train.global_batch_size=null",
           "--set", f"train.micro_batch_size={args.rows_per_step}", "--set", "train.gradient_accumulation=1",
           "--set", f"optimizer.learning_rate={args.learning_rate}", "--set", "optimizer.warmup_fraction=0.1",
           "--set", "train.num_threads=1", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
           "--set", "train.tensorboard=false", "--set", "finetune.packing=" + ("true" if packed else "false")]
    return cmd, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "squad_packed_vs_padded"))
    p.add_argument("--train-paragraphs", type=int, default=60)
    p.add_argument("--dev-paragraphs", type=int, default=20)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--rows-per-step", type=int, default=8, help="rows (packs) per optimizer step, both runs")
    p.add_argument("--learning-rate", type=float, default=0.001)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="packed/padded pairs, run alternately")
    p.add_argument("--prepare-only", action="store_true",
                   help="only write WORKDIR/train.json, dev.json and the init checkpoint WORKDIR/init")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    checkpoint = prepare(args.workdir, args)
    if args.prepare_only:
        print(f"wrote {args.workdir}/train.json, dev.json and the init checkpoint {checkpoint}")
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {"packed": [], "padded": []}
    for repeat in range(args.repeats):
        for packed in (True, False):
            name = "packed" if packed else "padded"
            cmd, out = command(args.workdir, checkpoint, args, packed)
            out = f"{out}{repeat}"
            cmd[cmd.index("--output-dir") + 1] = out
            if run_measured(cmd, env=env, log_path=out + ".log", sample_memory=False).returncode != 0:
                sys.exit(f"error: the {name} run failed; see {out}.log")
            runs[name].append(json.load(open(os.path.join(out, "summary.json"))))
            print(f"{name} run {repeat + 1}: {runs[name][-1]['train_seconds']:.0f} s", file=sys.stderr, flush=True)
    results = {}
    for name, summaries in runs.items():
        summary = summaries[0]
        seconds = sorted(s["train_seconds"] for s in summaries)
        results[name] = {
            "rows_per_epoch": summary["data_packing"]["num_packs"],
            "windows": summary["data_packing"]["num_sequences"],
            "windows_per_row": summary["data_packing"]["packing_factor"],
            "steps": summary["steps"], "rows": summary["total_packs"],
            "train_seconds": spread(seconds)["median"], "train_seconds_all": seconds,
            "exact_match": summary["eval"]["exact_match"], "f1": summary["eval"]["f1"],
            "has_ans_f1": summary["eval"].get("has_ans_f1"), "no_ans_f1": summary["eval"].get("no_ans_f1"),
        }
    with open(os.path.join(args.workdir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    a, b = results["packed"], results["padded"]
    print(markdown_table(["run", "windows", "rows/epoch", "windows/row", "steps", "train s", "EM", "F1"],
                         [[name, r["windows"], r["rows_per_epoch"], f"{r['windows_per_row']:.2f}", r["steps"],
                           f"{r['train_seconds']:.0f}", f"{r['exact_match']:.1f}", f"{r['f1']:.1f}"]
                          for name, r in results.items()], align="lrrrrrrr"))
    print(f"\npadded/packed: rows per epoch {b['rows_per_epoch'] / a['rows_per_epoch']:.2f}x, "
          f"training time {b['train_seconds'] / a['train_seconds']:.2f}x")


if __name__ == "__main__":
    main()
