"""One layout per dataset (issue 46): shards of one dataset may each have their own masked-slot
width (``pack`` gives every shard the M it needs; NVIDIA-layout shards may differ in P), and the
sharded reader serves every micro-batch in the configured layout, whatever the lanes, windows and
epochs, even where a micro-batch or a window joins rows of two shards. Lanes that do not divide
the shards are served with a warning naming the share of the data each epoch skips."""
import os

import h5py
import numpy as np
import pytest

from bert_packed.collate import validate_batch
from bert_packed.data import h5io
from bert_packed.data.hdf5 import to_batch
from bert_packed.data.prepare.pack import pack_file
from bert_packed.data.shards import shard_entry, shard_name, write_manifest
from bert_packed.data.sharded import ShardedSource
from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

DIMS = dict(max_sequence_length=128, max_sequences_per_pack=3, max_masked_tokens_per_pack=22)
NUM_SHARDS = 6
CHUNK = 16  # rows per HDF5 chunk: many blocks and windows, micro-batches that span them
MICRO_BATCH = 7  # does not divide a chunk: micro-batches start mid-block


def _slot_fields(packed):
    return [name for name, dim in h5io.PACKED_FIELDS.items() if dim == "M"] if packed else \
        ["masked_lm_positions", "masked_lm_ids"]


def _write_shards(rows, directory, bounds, packed):
    """Shards of ``rows`` (field -> array) cut at ``bounds``, each with the masked-slot width its
    own rows need (as `pack` writes them), and the manifest; returns the shards' widths."""
    os.makedirs(directory)
    used = rows["mlm_sequence_ids"] != 0 if packed else rows["masked_lm_positions"] != 0
    entries, widths = [], []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        width = int(used[start:stop].sum(axis=1).max())  # used slots are a prefix of each row
        widths.append(width)
        path = os.path.join(directory, shard_name(index))
        with h5io.atomic_h5(path) as handle:
            for name, array in rows.items():
                part = array[start:stop]
                if name in _slot_fields(packed):
                    part = part[:, :width]
                h5io.create_dataset(handle, name, part, chunk_rows=CHUNK)
        entries.append(shard_entry(path))
    write_manifest(directory, kind="packed" if packed else "unpacked", shards=entries)
    return widths


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layout")
    unpacked, packed = folder / "train.h5", folder / "packed.h5"
    write_synthetic_unpacked(unpacked, 700, max_seq_length=128, max_predictions=20, vocab_size=1000, seed=4)
    pack_file(unpacked, packed, algorithm="lpfhp", max_sequences_per_pack=3, seed=0, show_progress=False)
    out = {}
    for kind, path in (("packed", packed), ("unpacked", unpacked)):
        with h5py.File(path, "r") as handle:
            rows = {name: handle[name][:] for name in handle}
        is_packed = kind == "packed"
        # Rows ordered by the slots they use, so the shards' widths differ (narrow first, wide last).
        need = (rows["mlm_sequence_ids"] if is_packed else rows["masked_lm_positions"]) != 0
        order = np.argsort(need.sum(axis=1), kind="stable")
        rows = {name: array[order] for name, array in rows.items()}
        count = len(order)
        bounds = [0, count // 7, count // 3, count // 2, 2 * count // 3, 5 * count // 6, count]
        widths = _write_shards(rows, folder / kind, bounds, is_packed)
        assert len(set(widths)) > 1, widths  # otherwise nothing here would be tested
        reference = to_batch(dict(rows, next_sentence_labels=rows.get("next_sentence_labels", np.zeros(1)).reshape(-1))
                             if not is_packed else rows, packed=is_packed, **DIMS)
        out[kind] = {"dir": folder / kind, "widths": widths, "count": count,
                     "reference": {row.tobytes(): i for i, row in enumerate(reference["input_ids"])},
                     "rows": reference}
    return out


def _source(path, **options):
    return ShardedSource(path, micro_batch_size=MICRO_BATCH, seed=3, window_blocks=1, **DIMS, **options)


def _served(src, count):
    iterator = iter(src)
    return [next(iterator) for _ in range(count)]


def _check_against_the_data(batches, kind):
    """Every micro-batch in the configured layout, every row equal to its row of the data."""
    reference, rows = kind["reference"], kind["rows"]
    for batch in batches:
        assert batch["input_ids"].shape == (MICRO_BATCH, 128) and batch["mlm_positions"].shape == (MICRO_BATCH, 22)
        assert batch["cls_positions"].shape == (MICRO_BATCH, 3)
        validate_batch(batch)
        indices = [reference[ids.tobytes()] for ids in batch["input_ids"]]
        for name in batch:
            np.testing.assert_array_equal(batch[name], rows[name][indices], err_msg=name)


@pytest.mark.parametrize("kind", ["packed", "unpacked"])
@pytest.mark.parametrize("lanes", range(1, NUM_SHARDS + 1))
def test_every_lane_count_serves_the_one_layout_across_shard_boundaries(data, kind, lanes, capsys):
    """Lanes of several shards join rows of shards with other widths within a window and within a
    micro-batch; two epochs, every lane count from 1 to the shard count (the uneven ones too)."""
    src = _source(data[kind]["dir"], lanes=lanes)
    per_epoch = lanes * (min(src.lane_items) // MICRO_BATCH)
    batches = _served(src, 2 * per_epoch + 1)
    assert src.epoch == 2
    _check_against_the_data(batches, data[kind])
    # Within one epoch no row comes twice.
    first = [ids.tobytes() for batch in batches[:per_epoch] for ids in batch["input_ids"]]
    assert len(first) == len(set(first))
    src.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert bool(warnings) == (NUM_SHARDS % lanes != 0)


def test_a_world_of_ranks_reads_the_same_rows_in_the_one_layout(data):
    single = _served(_source(data["packed"]["dir"], lanes=2), 12)
    ranks = [_served(_source(data["packed"]["dir"], lanes=2, rank=r, world_size=2), 6) for r in range(2)]
    for g, batch in enumerate(single):
        for name in batch:
            np.testing.assert_array_equal(batch[name], ranks[g % 2][g // 2][name], err_msg=name)


@pytest.mark.parametrize("lanes", [4, 5])
def test_lanes_that_do_not_divide_the_shards_warn_with_the_share_each_epoch_skips(data, lanes, capsys):
    src = _source(data["packed"]["dir"], lanes=lanes)
    lines = capsys.readouterr().err.splitlines()
    per_epoch = lanes * (min(src.lane_items) // MICRO_BATCH)
    served = {ids.tobytes() for batch in _served(src, per_epoch) for ids in batch["input_ids"]}
    total = data["packed"]["count"]
    skipped = total - len(served)
    assert skipped > MICRO_BATCH * lanes  # more than the partial micro-batches: the uneven lanes' cost
    assert len(lines) == 1 and lines[0].startswith(f"warning: {data['packed']['dir']}: data.lanes={lanes} does not "
                                                   f"divide its {NUM_SHARDS} shards: ")
    assert f"every epoch skips {100.0 * skipped / total:.1f} % of the data ({skipped} of {total} items)" in lines[0]
    assert lines[0].endswith(f"set data.lanes to a divisor of {NUM_SHARDS}, such as {NUM_SHARDS} (the default when "
                             f"unset)")
    src.close()
    if lanes % 2 == 0:  # only the first rank says it (every rank would say the same)
        _source(data["packed"]["dir"], lanes=lanes, rank=1, world_size=2).close()
        assert capsys.readouterr().err == ""


# -- a forced resume with another micro-batch size (issue 46, from the previous held-out round) ------


def test_a_forced_resume_with_another_micro_batch_size_trains_each_step_on_the_uninterrupted_packs(data, tmp_path):
    """2 x 2 packs a step, then --resume-force at 4 x 1: each step after the resume reads exactly
    the packs of the uninterrupted run's step, in its order (was: other lanes' packs, e.g. packs
    8-11 of the stream where the uninterrupted run read 4-7)."""
    from backends.cpu import CPUBackend
    from bert_packed.config import load_config
    from bert_packed.loop.train import train

    steps = []

    class Recording(CPUBackend):
        def train_step(self, micro_batches):
            steps.append(np.concatenate([batch["input_ids"] for batch in micro_batches]))
            return super().train_step(micro_batches)

    def run(output, total, size, accumulation, **resume):
        config = load_config("tiny", [f"data.path={data['packed']['dir']}", "data.max_sequence_length=128",
                                      "model.max_position_embeddings=128", "model.vocab_size=1000",
                                      "data.max_masked_tokens=20", f"train.micro_batch_size={size}",
                                      f"train.gradient_accumulation={accumulation}", "train.checkpoint_every=1",
                                      f"train.steps={total}"])
        steps.clear()
        train(config, Recording(), output_dir=str(output), show_progress=False, **resume)
        return list(steps)

    straight = run(tmp_path / "straight", 5, 2, 2)
    run(tmp_path / "forced", 2, 2, 2)
    resumed = run(tmp_path / "forced", 5, 4, 1, resume=True, resume_force=True)
    assert len(straight) == 5 and len(resumed) == 3
    for want, got in zip(straight[2:], resumed):
        np.testing.assert_array_equal(want, got)
