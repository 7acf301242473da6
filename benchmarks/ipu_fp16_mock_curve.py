"""fp16 on the mock IPU vs the fp32 cpu reference: how far the loss curves drift (CPU, not an IPU).

    python benchmarks/ipu_fp16_mock_curve.py [--steps 50] [--set section.key=value ...]

phase2 shrunk (tests/ipu_helpers.py FP16_CURVE): replication 2 x accumulation 8, a 4-stage pipeline, fp16
weights/activations/accumulators with loss scaling, 50 LAMB steps over four cycled global batches.
Prints the largest absolute and relative per-step loss difference, and the same for an fp32 mock
run (``--set ipu.half_precision=false``) as the floor. tests/ipu/test_ipu_readiness.py asserts 0.5 %.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from ipu_helpers import mock_and_cpu_loss_curves  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; {args.steps} steps")
    for label, extra in (("fp16", []), ("fp32", ["ipu.half_precision=false", "ipu.loss_scaling=1.0"])):
        start = time.perf_counter()
        mock, cpu, _ = mock_and_cpu_loss_curves(args.overrides + extra, steps=args.steps)
        difference = np.abs(mock - cpu)
        print(f"{label}: cpu loss {cpu[0]:.4f} -> {cpu[-1]:.4f}; max |mock - cpu| {difference.max():.2e} "
              f"(relative {(difference / np.abs(cpu)).max():.2e}); {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
