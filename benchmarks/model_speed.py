"""Model speed on this machine, as ratios measured side by side in one run.

1. Ours, unpacked, vs ``transformers.BertForPreTraining`` (same weights), forward + backward
   at BERT-Base shape (S = 128, B = 8 by default): ratio = HF time / our time (>= 1.0 means
   we are not slower). Ours runs the MLM head on the masked positions only (as NVIDIA's
   and Graphcore's BERT do); Hugging Face runs it on all S tokens.
2. Ours packed vs ours unpacked at the same [B, S] (S = 512): the cost of packing itself
   (block-diagonal mask instead of a padding mask, per-sequence loss unpacking over K
   slots, M = mask tokens + K - 1 masked slots). overhead = packed / unpacked - 1.

Timing: the variants alternate, each forward + backward is timed with
``time.perf_counter``, and the median per variant is compared, so slow phases of a shared
machine hit both sides alike. Absolute times are printed for reference only.

    python benchmarks/model_speed.py                 # both comparisons, BERT-Base
    python benchmarks/model_speed.py --repeats 3 --tiny   # quick smoke run
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

from benchmarks.common import spread  # noqa: E402
from bert_packed.collate import collate, masked_tokens_per_pack, one_per_pack  # noqa: E402
from bert_packed.model.modeling import BertConfig
from bert_packed.tasks.pretraining.model import BertForPreTraining  # noqa: E402

BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
print = functools.partial(print, flush=True)  # noqa: A001  (results show up promptly in a log file)
MASK_TOKENS = {128: 20, 384: 56, 512: 76}  # per full-length sequence (Graphcore / NVIDIA configs)


def make_samples(rng, lengths, width, mask_tokens, vocab_size):
    """Unpacked samples (NVIDIA fields) of the given lengths with 15 % masking."""
    n = len(lengths)
    input_ids = np.zeros((n, width), np.int64)
    positions = np.zeros((n, mask_tokens), np.int64)
    labels = np.zeros((n, mask_tokens), np.int64)
    for i, length in enumerate(lengths):
        input_ids[i, :length] = rng.integers(5, vocab_size, length)
        num_masked = max(1, min(mask_tokens, int(round(0.15 * length))))
        chosen = np.sort(rng.choice(np.arange(1, length), num_masked, replace=False))
        positions[i, :num_masked] = chosen
        labels[i, :num_masked] = input_ids[i, chosen]
    segment_ids = (np.arange(width)[None, :] >= (np.asarray(lengths)[:, None] // 2)).astype(np.int64)
    return {
        "input_ids": input_ids,
        "segment_ids": segment_ids * (input_ids != 0),
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "next_sentence_labels": rng.integers(0, 2, n),
    }


def to_torch(batch):
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


def unpacked_batch(rng, batch_size, S, vocab_size, full_length=True):
    lengths = [S] * batch_size if full_length else list(rng.integers(S // 4, S + 1, batch_size))
    samples = make_samples(rng, lengths, S, MASK_TOKENS.get(S, S * 15 // 100), vocab_size)
    batch = collate(samples, one_per_pack(np.arange(batch_size)), max_sequence_length=S, max_sequences_per_pack=1,
                    max_masked_tokens_per_pack=MASK_TOKENS.get(S, S * 15 // 100))
    return to_torch(batch), samples


def packed_batch(rng, batch_size, S, K, vocab_size):
    """B packs, each exactly full with K sequences of random lengths."""
    lengths = []
    for _ in range(batch_size):
        cuts = np.sort(rng.choice(np.arange(8, S - 8), K - 1, replace=False))
        parts = np.diff(np.concatenate([[0], cuts, [S]]))
        while parts.min() < 4:  # keep every sequence at least [CLS] + 3 tokens
            cuts = np.sort(rng.choice(np.arange(8, S - 8), K - 1, replace=False))
            parts = np.diff(np.concatenate([[0], cuts, [S]]))
        lengths.extend(int(p) for p in parts)
    mask_tokens = MASK_TOKENS.get(S, S * 15 // 100)
    samples = make_samples(rng, lengths, S, mask_tokens, vocab_size)
    offsets = np.arange(0, len(lengths) + 1, K)
    from bert_packed.collate import PackSlice

    batch = collate(samples, PackSlice(offsets, np.arange(len(lengths))), max_sequence_length=S, max_sequences_per_pack=K,
                    max_masked_tokens_per_pack=masked_tokens_per_pack(mask_tokens, K))
    return to_torch(batch)


def hf_inputs(batch):
    """transformers inputs equivalent to our unpacked batch (padding mask, -100 off the masked positions)."""
    input_ids = batch["input_ids"]
    labels = torch.full_like(input_ids, -100)
    valid = batch["mlm_sequence_ids"] > 0
    rows = torch.arange(input_ids.shape[0])[:, None].expand_as(valid)
    labels[rows[valid], batch["mlm_positions"][valid]] = batch["mlm_labels"][valid]
    return dict(input_ids=input_ids, token_type_ids=batch["segment_ids"], attention_mask=(batch["sequence_ids"] > 0).long(),
                labels=labels, next_sentence_label=batch["nsp_labels"][:, 0])


def step_seconds(model, inputs, loss_of):
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_of(model(**inputs)).backward()
    return time.perf_counter() - start


def compare(variants, repeats, warmup=1):
    """variants: name -> (model, inputs, loss_of). Alternate them; return name -> list of seconds."""
    times = {name: [] for name in variants}
    for _ in range(warmup):
        for name, (model, inputs, loss_of) in variants.items():
            step_seconds(model, inputs, loss_of)
    for _ in range(repeats):
        for name, (model, inputs, loss_of) in variants.items():
            times[name].append(step_seconds(model, inputs, loss_of))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test), not BERT-Base")
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--packed-batch", type=int, default=2)
    parser.add_argument("--depths", type=int, nargs="+", default=[3, 16], help="sequences per pack K for comparison 2")
    parser.add_argument("--skip-hf", action="store_true", help="skip comparison 1")
    parser.add_argument("--skip-packed", action="store_true", help="skip comparison 2")
    parser.add_argument("--attention", nargs="+", default=["dense", "sdpa"], help="our attention implementations to time")
    args = parser.parse_args(argv)

    import transformers

    dims = TINY if args.tiny else BASE
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"model {'tiny' if args.tiny else 'BERT-Base'}, repeats {args.repeats} (median of each)")

    if not args.skip_hf:
        S, B = 128, args.hf_batch
        hf_config = transformers.BertConfig(**dims, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        hf = transformers.BertForPreTraining(hf_config).train()
        batch, _ = unpacked_batch(rng, B, S, dims["vocab_size"])
        variants = {"transformers (sdpa)": (hf, hf_inputs(batch), lambda out: out.loss)}
        for attention in args.attention:
            ours = BertForPreTraining(BertConfig(**dims, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                 max_sequences_per_pack=1, max_masked_tokens_per_pack=MASK_TOKENS[S],
                                                 attention_implementation=attention)).train()
            ours.load_hf_state_dict(hf.state_dict())
            variants[f"ours unpacked ({attention})"] = (ours, batch, lambda out: out["loss"])
        times = compare(variants, args.repeats)
        reference = spread(times["transformers (sdpa)"])["median"]
        print(f"\n[1] unpacked fwd+bwd, S={S}, B={B}: ratio = transformers time / our time")
        for name, values in times.items():
            median = spread(values)["median"]
            print(f"  {name:28s} median {median * 1e3:8.1f} ms   ratio {reference / median:5.2f}")

    if args.skip_packed:
        return
    S, B = 512, args.packed_batch
    config = dict(**dims, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for attention in args.attention:
        base = BertForPreTraining(BertConfig(**config, max_sequences_per_pack=1, max_masked_tokens_per_pack=MASK_TOKENS[S],
                                             attention_implementation=attention)).train()
        unpacked, _ = unpacked_batch(rng, B, S, dims["vocab_size"], full_length=False)
        variants = {"unpacked (K=1)": (base, unpacked, lambda out: out["loss"])}
        for K in args.depths:
            # Same weights; the model reads K and M from the batch shapes.
            variants[f"packed (K={K})"] = (base, packed_batch(rng, B, S, K, dims["vocab_size"]), lambda out: out["loss"])
        times = compare(variants, args.repeats)
        reference = spread(times["unpacked (K=1)"])["median"]
        print(f"\n[2] {attention}: fwd+bwd at the same [B,S] = [{B},{S}]: overhead = packed / unpacked - 1")
        for name, values in times.items():
            median = spread(values)["median"]
            print(f"  {name:28s} median {median * 1e3:8.1f} ms   overhead {100 * (median / reference - 1):+5.1f} %")


if __name__ == "__main__":
    main()
