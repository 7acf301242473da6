"""Synthetic unpacked HDF5 files (NVIDIA layout) of any size, written in chunks.

For tests and benchmarks of `pack` at scale (e.g. 1 M sequences) without a corpus:
lengths follow the shipped Wikipedia histogram rescaled to the requested length,
tokens are random, 15 % of each sequence's tokens (at most `max_predictions`) masked.
"""
import numpy as np
from tqdm import tqdm

from bert_packed.data import h5io


def synthetic_lengths(num_sequences, max_seq_length, seed=0):
    """Lengths in [5, max_seq_length]: Wikipedia-512 lengths scaled to `max_seq_length`."""
    from packing import Histogram

    histogram = Histogram.load("wikipedia-512")
    rng = np.random.default_rng(seed)
    probabilities = histogram.counts / histogram.counts.sum()
    lengths = rng.choice(np.arange(1, histogram.max_sequence_length + 1), size=num_sequences,
                         p=probabilities)
    scaled = np.ceil(lengths * max_seq_length / histogram.max_sequence_length).astype(np.int64)
    return np.clip(scaled, 5, max_seq_length)


def write_synthetic_unpacked(path, num_sequences, *, max_seq_length=128, max_predictions=20,
                             vocab_size=30522, seed=0, chunk_rows=1 << 16, show_progress=False):
    """Write `num_sequences` random sequences; memory is O(chunk_rows), not O(num_sequences)."""
    rng = np.random.default_rng([seed, 1])
    lengths = synthetic_lengths(num_sequences, max_seq_length, seed)
    columns = np.arange(max_seq_length)
    with h5io.atomic_h5(path) as handle:
        shapes = h5io.unpacked_shapes(num_sequences, max_seq_length, max_predictions)
        datasets = {name: h5io.create_dataset(handle, name, shape=shape, dtype=dtype)
                    for name, (shape, dtype) in shapes.items()}
        for start in tqdm(range(0, num_sequences, chunk_rows), desc="synthetic", unit=" chunks",
                          disable=not show_progress):
            length = lengths[start:start + chunk_rows]
            rows = len(length)
            real = columns[None, :] < length[:, None]
            ids = rng.integers(5, vocab_size, size=(rows, max_seq_length)) * real
            ids[:, 0] = 2  # [CLS]
            ids[np.arange(rows), length - 1] = 3  # [SEP]
            split = rng.integers(2, length - 1)
            segments = (columns[None, :] > split[:, None]) & real
            num_masked = np.minimum(max_predictions, np.maximum(1, np.round(0.15 * length))).astype(int)
            # Random distinct positions in 1..length-2 per row: sort random keys, take the first few.
            keys = rng.random((rows, max_seq_length))
            keys[:, 0] = 2.0
            keys[columns[None, :] >= (length - 1)[:, None]] = 2.0
            keep = np.arange(max_predictions)[None, :] < num_masked[:, None]
            first = np.argsort(keys, axis=1)[:, :max_predictions]
            # Used slots first, in increasing position order; unused slots 0.
            chosen = np.sort(np.where(keep, first, max_seq_length), axis=1)
            chosen = np.where(keep, chosen, 0)
            labels = np.take_along_axis(ids, chosen, axis=1) * keep
            datasets["input_ids"][start:start + rows] = ids
            datasets["input_mask"][start:start + rows] = real
            datasets["segment_ids"][start:start + rows] = segments
            datasets["masked_lm_positions"][start:start + rows] = chosen
            datasets["masked_lm_ids"][start:start + rows] = labels
            datasets["next_sentence_labels"][start:start + rows] = rng.integers(0, 2, size=rows)
        handle.attrs.update({"synthetic": True, "seed": seed, "max_seq_length": max_seq_length,
                             "max_predictions_per_seq": max_predictions})
    return lengths
