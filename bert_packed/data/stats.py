"""`stats`: length histogram and padding of an unpacked or packed HDF5 file, or of a sharded dataset
directory (its shards together, as `pack` and training read them), printed and plotted.

Everything is read in row chunks, so any file size works. A reader of what `create` and `pack`
write (``--profile`` reads a dataset's lengths here too); the `stats` command first names a corpus
given to it as what it is (``bert_packed.data.__main__``).
"""
import os

import numpy as np

from bert_packed.data import h5io, shards
from bert_packed.data.errors import DataError


def dataset_stats(path, read_rows=1 << 16):
    """Statistics dict of an HDF5 file or of a sharded dataset directory (its shards together; JSON-able).
    Keys for both layouts: kind, num_rows, max_sequence_length, num_sequences, num_tokens, efficiency
    (real tokens / row tokens), padding_fraction, length_counts (sequences of length 1..S); packed
    data adds max_sequences_per_pack, packing_factor, sequences_per_pack_counts (0..K), tokens_per_row
    histogram (tokens_per_row_counts, 1..S); unpacked data adds theoretical_speedup. A directory adds
    num_shards."""
    path = os.fspath(path)
    if os.path.isdir(path):
        manifest = shards.load_manifest(path)
        counts = [_file_counts(shard, read_rows) for shard in shards.shard_paths(path, manifest)]
        merged = _merge(counts, path)
        merged["extra"] = {key: manifest[key] for key in _PACKED_ATTRS if key in manifest}
        merged["extra"]["num_shards"] = len(counts)
        return _finish(path, merged)
    return _finish(path, _file_counts(path, read_rows))


_PACKED_ATTRS = ("algorithm", "lp_bound_packs", "unpacked_efficiency", "speedup", "seed")


def _file_counts(path, read_rows):
    """The counts of one HDF5 file that the statistics are made of (summed over shards)."""
    with h5io.open_h5(path) as handle, h5io.read_errors(path):
        if h5io.is_packed(handle):
            num_rows, seq_len, max_k, max_m = h5io.check_packed(handle, path)
            counts = {"kind": "packed", "num_rows": num_rows, "seq_len": seq_len, "max_k": max_k, "max_m": max_m,
                      "length_counts": np.zeros(seq_len + 1, np.int64), "row_counts": np.zeros(seq_len + 1, np.int64),
                      "depth_counts": np.zeros(max_k + 1, np.int64), "num_masked": 0,
                      "extra": {key: _plain(handle.attrs[key]) for key in _PACKED_ATTRS if key in handle.attrs}}
            for start in range(0, num_rows, read_rows):
                sequence_ids = handle["sequence_ids"][start:start + read_rows].astype(np.int64)
                per_sequence = np.stack([(sequence_ids == k).sum(axis=1)
                                         for k in range(1, max_k + 1)], axis=1)
                counts["length_counts"] += np.bincount(per_sequence[per_sequence > 0].ravel(), minlength=seq_len + 1)
                counts["row_counts"] += np.bincount(per_sequence.sum(axis=1), minlength=seq_len + 1)
                counts["depth_counts"] += np.bincount((per_sequence > 0).sum(axis=1), minlength=max_k + 1)
                counts["num_masked"] += int((handle["mlm_sequence_ids"][start:start + read_rows] != 0).sum())
            return counts
        num_rows, seq_len, _ = h5io.check_unpacked(handle, path)
        counts = {"kind": "unpacked", "num_rows": num_rows, "seq_len": seq_len, "num_masked": 0, "random_next": 0,
                  "length_counts": np.bincount(h5io.sequence_lengths(handle, read_rows), minlength=seq_len + 1),
                  "extra": {}}
        for start in range(0, num_rows, read_rows):
            counts["num_masked"] += int((handle["masked_lm_positions"][start:start + read_rows] != 0).sum())
            counts["random_next"] += int(handle["next_sentence_labels"][start:start + read_rows].sum())
        return counts


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _merge(counts, path):
    """The counts of a dataset's shards together (they share the kind and S: the manifest says so)."""
    kinds, lengths = {c["kind"] for c in counts}, {c["seq_len"] for c in counts}
    if len(kinds) != 1 or len(lengths) != 1:
        raise DataError(f"{path}: shards of different kinds or sequence lengths ({sorted(kinds)}, {sorted(lengths)}); "
                        f"re-create the dataset")
    merged = dict(counts[0])
    for key in ("num_rows", "num_masked", "random_next"):
        if key in merged:
            merged[key] = sum(c[key] for c in counts)
    for key in ("length_counts", "row_counts", "depth_counts"):
        if key in merged:
            width = max(len(c[key]) for c in counts)
            merged[key] = sum(np.pad(c[key], (0, width - len(c[key]))) for c in counts)
    for key in ("max_k", "max_m"):
        if key in merged:
            merged[key] = max(c[key] for c in counts)
    return merged


def _finish(path, counts):
    """The statistics dict (see `dataset_stats`) from a file's or a dataset's counts."""
    num_rows, seq_len, length_counts = counts["num_rows"], counts["seq_len"], counts["length_counts"]
    if counts["kind"] == "packed":
        stats = {"kind": "packed", "max_sequences_per_pack": int(counts["max_k"]),
                 "max_masked_tokens_per_pack": int(counts["max_m"]),
                 "sequences_per_pack_counts": counts["depth_counts"].tolist(),
                 "tokens_per_row_counts": counts["row_counts"][1:].tolist()}
    else:
        stats = {"kind": "unpacked", "random_next_fraction": counts["random_next"] / max(1, num_rows)}
    stats.update(counts["extra"])
    num_masked = counts["num_masked"]
    num_sequences = int(length_counts[1:].sum())
    num_tokens = int((np.arange(seq_len + 1) * length_counts).sum())
    efficiency = num_tokens / max(1, num_rows * seq_len)
    stats.update({"file": str(path), "num_rows": int(num_rows), "max_sequence_length": int(seq_len),
                  "num_sequences": num_sequences, "num_tokens": num_tokens,
                  "num_masked_tokens": num_masked,
                  "masked_fraction": num_masked / max(1, num_tokens),
                  "efficiency": efficiency, "padding_fraction": 1.0 - efficiency,
                  "packing_factor": num_sequences / max(1, num_rows),
                  "mean_length": num_tokens / max(1, num_sequences),
                  "length_counts": length_counts[1:].tolist()})
    if stats["kind"] == "unpacked":
        stats["theoretical_speedup"] = 1.0 / max(efficiency, 1e-12)
    return stats


def format_stats(stats):
    """Human-readable summary (a few lines, plus a coarse text histogram of lengths)."""
    shards_note = f" in {stats['num_shards']} shards" if "num_shards" in stats else ""
    lines = [f"{stats['file']}: {stats['kind']}{shards_note}, {stats['num_rows']} rows of "
             f"{stats['max_sequence_length']} tokens, {stats['num_sequences']} sequences",
             f"  tokens {stats['num_tokens']} (mean length {stats['mean_length']:.1f}), masked "
             f"{100 * stats['masked_fraction']:.2f} % of tokens",
             f"  efficiency {100 * stats['efficiency']:.2f} %, padding "
             f"{100 * stats['padding_fraction']:.2f} %"]
    if stats["kind"] == "unpacked":
        lines.append(f"  random next {100 * stats['random_next_fraction']:.1f} %, theoretical "
                     f"packing speed-up {stats['theoretical_speedup']:.3f}x")
    else:
        depth = ", ".join(f"{k}: {n}" for k, n in enumerate(stats["sequences_per_pack_counts"]) if k)
        lines.append(f"  packing factor {stats['packing_factor']:.3f} sequences per pack "
                     f"(packs by depth {depth})")
        if "unpacked_efficiency" in stats:
            lines.append(f"  unpacked efficiency {100 * stats['unpacked_efficiency']:.2f} %, "
                         f"speed-up {stats['speedup']:.3f}x ({stats.get('algorithm', '?')})")
    counts = np.asarray(stats["length_counts"])
    num_bins = min(16, counts.size)
    edges = np.linspace(0, counts.size, num_bins + 1).astype(int)
    peak = max(1, max(counts[a:b].sum() for a, b in zip(edges[:-1], edges[1:])))
    lines.append("  sequence lengths:")
    for a, b in zip(edges[:-1], edges[1:]):
        total = int(counts[a:b].sum())
        lines.append(f"  {a + 1:>6}-{b:<6} {total:>10}  " + "#" * int(round(40 * total / peak)))
    return "\n".join(lines)


def plot_stats(stats, output_path):
    """Write a PNG: sequence-length histogram (and tokens per row for packed files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bert_packed.io.files import atomic_path

    packed = stats["kind"] == "packed"
    figure, axes = plt.subplots(1, 2 if packed else 1, figsize=(11 if packed else 6, 4),
                                squeeze=False)
    lengths = np.arange(1, stats["max_sequence_length"] + 1)
    axes[0, 0].bar(lengths, stats["length_counts"], width=1.0, color="tab:blue")
    axes[0, 0].set_xlabel("sequence length (tokens)")
    axes[0, 0].set_ylabel("sequences")
    axes[0, 0].set_title(f"{stats['num_sequences']} sequences, mean {stats['mean_length']:.1f}")
    if packed:
        axes[0, 1].bar(lengths, stats["tokens_per_row_counts"], width=1.0, color="tab:green")
        axes[0, 1].set_xlabel("real tokens per pack")
        axes[0, 1].set_ylabel("packs")
        axes[0, 1].set_title(f"{stats['num_rows']} packs, factor {stats['packing_factor']:.2f}")
    figure.suptitle(f"{stats['kind']}: padding {100 * stats['padding_fraction']:.1f} % "
                    f"at length {stats['max_sequence_length']}")
    figure.tight_layout()
    with atomic_path(output_path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
