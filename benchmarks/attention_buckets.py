"""Bucketed (per-sequence) attention vs the dense block-diagonal mask on the CPU (issue 35).

Packs of short texts spend most of their attention work on the masked blocks between
sequences. This measures, side by side in one run, what computing attention per sequence in
length buckets (``model.attention_implementation=bucketed``) saves against ``dense`` (and
``sdpa``, the same mask through torch's fused kernel):

1. the attention alone: ``attend`` forward + backward on ``[B, 12, S, 32]`` query/key/value
   (the per-forward ``prepare`` is timed separately: the model builds it once for all layers);
2. a MiniLM-size train step (6 layers, hidden 384, 12 heads, sequence classification as in
   the fine-tuning benchmark): forward + backward of ``BertForSequenceClassification``.

Each at attention dropout 0.1 and 0. The packs: S = 128, B = 4 packs per micro-batch, filled
first-fit with lengths drawn like the Rotten Tomatoes snippets of benchmarks/vs_hf_trainer_classification.py
(mean ~27 tokens, at most 72): about 4.5 sequences per pack.

Timing: variants alternate repeat by repeat (a busy shared machine slows both alike); the
table gives min and median milliseconds, the ratio dense / variant of both and the median
of the per-repeat ratios (> 1: the variant is faster).

    python benchmarks/attention_buckets.py                  # default: 30 repeats, 2 threads
    python benchmarks/attention_buckets.py --repeats 5      # quick
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_header, markdown_row, spread  # noqa: E402
from bert_packed.model.attention import get_attention  # noqa: E402
from bert_packed.tasks.classification.model import BertForSequenceClassification  # noqa: E402
from bert_packed.model.modeling import BertConfig  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
VARIANTS = ("dense", "sdpa", "bucketed")


def snippet_lengths(rng, n):
    """Token lengths like the fine-tuning snippets: log-normal around 26.5, clipped to 6..72."""
    return np.clip(np.round(rng.lognormal(np.log(26.5), 0.35, n)), 6, 72).astype(int)


def packed_batch(rng, num_packs, S, K):
    """``num_packs`` packs filled in order (next-fit, at most K sequences each); classification fields.

    Next-fit rather than first-fit: first-fit over a long list picks the short lengths to fill
    the gaps and makes the packs' sequences shorter than the data's.
    """
    packs = [[]]
    while len(packs) <= num_packs:
        length = int(snippet_lengths(rng, 1)[0])
        if len(packs[-1]) == K or sum(packs[-1]) + length > S:
            packs.append([])
        packs[-1].append(length)
    packs = packs[:num_packs]
    fields = {name: np.zeros((num_packs, S), np.int64) for name in ("input_ids", "segment_ids", "position_ids", "sequence_ids")}
    cls_positions = np.zeros((num_packs, K), np.int64)
    weights = np.zeros((num_packs, K), np.float32)
    for b, pack in enumerate(packs):
        start = 0
        for k, length in enumerate(pack):
            span = slice(start, start + length)
            fields["input_ids"][b, span] = rng.integers(1000, MINILM["vocab_size"], length)
            fields["position_ids"][b, span] = np.arange(length)
            fields["sequence_ids"][b, span] = k + 1
            cls_positions[b, k], weights[b, k] = start, 1.0
            start += length
    batch = {name: torch.from_numpy(value) for name, value in fields.items()}
    batch.update(cls_positions=torch.from_numpy(cls_positions), label_weights=torch.from_numpy(weights),
                 labels=torch.from_numpy(rng.integers(0, 2, (num_packs, K))))
    return batch, packs


def time_ms(fn):
    start = time.perf_counter()
    fn()
    return 1000.0 * (time.perf_counter() - start)


def alternate(cases, repeats, warmup=2):
    """cases: name -> zero-argument callable. Alternated; name -> list of milliseconds."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(time_ms(fn))
    return times


def attention_cases(batch, dropout_p, head_dim=32, heads=12):
    """Forward + backward of ``attend`` alone, and each implementation's ``prepare``."""
    B, S = batch["sequence_ids"].shape
    torch.manual_seed(0)
    qkv = [torch.randn(B, S, heads, head_dim).transpose(1, 2).requires_grad_() for _ in range(3)]
    grad = torch.randn(B, heads, S, head_dim)
    cases = {}
    for name in VARIANTS:
        impl = get_attention(name)
        prepared = impl.prepare(batch["sequence_ids"], dtype=torch.float32)

        def step(impl=impl, prepared=prepared):
            out = impl.attend(*qkv, prepared, dropout_p=dropout_p, training=True)
            out.backward(grad)

        cases[name] = step
        cases[f"{name} prepare"] = functools.partial(impl.prepare, batch["sequence_ids"], dtype=torch.float32)
    return cases


def model_cases(batch, dropout_p, K):
    """Forward + backward of a MiniLM-size packed classification step, same weights per variant."""
    torch.manual_seed(0)
    models = {}
    for name in VARIANTS:
        config = BertConfig(**MINILM, attention_probs_dropout_prob=dropout_p, max_sequences_per_pack=K,
                            attention_implementation=name)
        model = BertForSequenceClassification(config).train()
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[name] = model

    def step(model):
        model.zero_grad(set_to_none=True)
        model(**batch)["loss"].backward()

    return {name: functools.partial(step, model) for name, model in models.items()}


def rows(title, times, baseline="dense"):
    """Markdown rows: min / median ms, the dense / variant ratios of the mins and of the
    medians, and the median of the paired ratios (repeat i of dense over repeat i of the
    variant: neighbours in time, so a burst of other work on the machine hits both)."""
    out = []
    for name, values in times.items():
        reference = times[name.replace(name.split()[0], baseline)] if " " in name else times[baseline]
        paired = spread(r / v for r, v in zip(reference, values))["median"]
        mine, theirs = spread(values), spread(reference)
        out.append(markdown_row([title, name, f"{mine['min']:.2f}", f"{mine['median']:.2f}",
                                 f"{theirs['min'] / mine['min']:.2f}", f"{theirs['median'] / mine['median']:.2f}",
                                 f"{paired:.2f}"]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--packs", type=int, default=4, help="packs per micro-batch (B)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-sequences", type=int, default=8, help="K")
    parser.add_argument("--skip-model", action="store_true", help="attention alone only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch, packs = packed_batch(np.random.default_rng(0), args.packs, args.seq_len, args.max_sequences)
    lengths = [n for pack in packs for n in pack]
    print(f"torch {torch.__version__}, {args.threads} threads, B={args.packs} packs of S={args.seq_len}: "
          f"{len(lengths) / len(packs):.2f} sequences per pack, mean length {np.mean(lengths):.1f}, "
          f"{sum(lengths) / (args.packs * args.seq_len):.1%} of the slots real; {args.repeats} alternated repeats")
    table = [markdown_header(["measured", "variant", "min ms", "median ms", "dense / variant (min)",
                              "dense / variant (median)", "dense / variant (paired median)"], align="llrrrrr")]
    for dropout_p in (0.1, 0.0):
        times = alternate(attention_cases(batch, dropout_p), args.repeats)
        table += rows(f"attention fwd+bwd, dropout {dropout_p}", times)
        if not args.skip_model:
            times = alternate(model_cases(batch, dropout_p, args.max_sequences), args.repeats)
            table += rows(f"MiniLM step fwd+bwd, dropout {dropout_p}", times)
    print("\n".join(table))


if __name__ == "__main__":
    main()
