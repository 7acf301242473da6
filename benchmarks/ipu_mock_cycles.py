"""Estimated GC200 cycles of the phase-2 layout through the mock IPU path (a cost model, not hardware).

    python benchmarks/ipu_mock_cycles.py [--config phase2] [--depths 1 2 3]

For each packing depth K: one micro-batch (forward + backward, bottleneck pipeline stage of one
replica) as ``MockBackend.profile`` reports it for a BERT built on the meta device (no compute),
and the per-step figure for the config's gradient accumulation. Unit: *estimated* cycles from
ipu/cost_model.py; a real IPU run (``--backend ipu``) reports hardware cycles instead.
"""
import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_table  # noqa: E402
from backends.mock import MockBackend  # noqa: E402
from bert_packed.config import ConfigError, load_config  # noqa: E402
from bert_packed.data import empty_batch  # noqa: E402
from bert_packed.tasks.pretraining.model import build_model  # noqa: E402
from run import register_config_sections  # noqa: E402

register_config_sections()  # the ipu section before any config loads


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="phase2")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:  # a bad name or value: one line (bounds are checked when the model is built)
        return cycles(load_config(args.config, args.overrides), args.depths)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cycles(config, depths) -> int:
    """Print the table of ``depths`` for ``config``."""
    backend = MockBackend()
    d, t, ipu = config.data, config.train, config.ipu
    print(f"config {config.name}: layers_per_ipu {ipu.layers_per_ipu}, micro_batch {t.micro_batch_size}, "
          f"S={d.max_sequence_length}, GA {t.gradient_accumulation}, {'fp16' if ipu.half_precision else 'fp32'}")
    rows = []
    for depth in depths:
        config.data.max_sequences_per_pack = depth
        with torch.device("meta"):
            model = build_model(config)
        # Zeros with the batch contract's shapes: the cost model reads shapes only.
        batch = empty_batch(t.micro_batch_size, d.max_sequence_length, depth, d.max_masked_tokens_per_pack)
        result = backend.profile(model, batch, config=config)
        parts = ", ".join(f"{k} {v:,}" for k, v in (result["breakdown"] or {}).items())
        rows.append([depth, f"{result['cost']:,.0f}", f"{result['cost'] * t.gradient_accumulation:,.0f}", parts])
    print(markdown_table(["K", "est. cycles / micro-batch", "est. cycles / step (x GA)", "breakdown"], rows))
    print(f"unit: {result['unit']} (ipu/cost_model.py; not a hardware measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
