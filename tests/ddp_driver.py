"""Started by tests/backends/test_cuda_backend.py under torchrun (not a test module): trains the tiny config
on the cuda backend with ``cuda.device=cpu`` (gloo, DistributedDataParallel) through the training
loop and writes, per rank, what the test checks that metrics.jsonl cannot show.

    python -m torch.distributed.run --nproc_per_node 2 --standalone tests/ddp_driver.py \
        OUTPUT_DIR RECORD {fresh|resume} STOP_AT [SECTION.KEY=VALUE ...]

STOP_AT > 0: every rank sends itself SIGTERM after that many steps of this invocation, as a kill
would, and the loop writes its checkpoint there and stops (the run is then resumed); 0: never.

- a fake CUDA generator per rank (the CPU has none): ``torch.cuda.get_rng_state`` returns this
  rank's bytes (``10 + rank`` in a fresh run, zeros in a resumed one, so only a restore from the
  checkpoint can bring the fresh run's bytes back) and ``set_rng_state`` records what it is given;
  the backend is told its generator lives on ``cuda:RANK``;
- the bucket indices DDP's communication hook was called with, per optimizer step (with ``no_sync``
  on the accumulation micro-batches, every bucket once per step).

With ``cuda.compile=true`` the model is compiled with dynamo's ``aot_eager`` backend (graph capture,
DDP's graph splitting at bucket boundaries and AOT autograd, without inductor's CPU compile time).

RECORD.RANK (JSON): ``{"ddp": bool, "buckets": [[index, ...] per step], "restored": [[byte, ...]
per set_rng_state call], "devices": [device per call]}``.
"""
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import backends  # noqa: E402
import backends.cuda as cuda_backend  # noqa: E402
from run import register_config_sections  # noqa: E402
from bert_packed.config import load_config  # noqa: E402
from bert_packed.loop.train import Interrupted, train  # noqa: E402


def main() -> int:
    register_config_sections()
    output_dir, record_path, mode, stop_at, overrides = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                                         sys.argv[5:])
    rank = int(os.environ.get("RANK", "0"))
    generator = {"state": torch.full((16,), 0 if mode == "resume" else 10 + rank, dtype=torch.uint8)}
    restored, devices = [], []

    def set_rng_state(state, device="cuda"):
        restored.append(state.tolist())
        devices.append(str(device))
        generator["state"] = state.clone()

    torch.cuda.get_rng_state = lambda device="cuda": generator["state"].clone()
    torch.cuda.set_rng_state = set_rng_state
    cuda_backend.CUDABackend.rng_device = property(lambda self: torch.device("cuda", rank))

    buckets = []
    summing = cuda_backend._sum_over_ranks

    def counting_hook(process_group, bucket):
        buckets[-1].append(bucket.index())
        return summing(process_group, bucket)

    cuda_backend._sum_over_ranks = counting_hook

    def wrap_model(self, model):
        if not self.plan.settings.compile:
            return model
        return torch.compile(model, backend="aot_eager", dynamic=False)

    cuda_backend.CUDABackend.wrap_model = wrap_model
    config = load_config("tiny", ["cuda.device=cpu", *overrides])
    backend = backends.get_backend("cuda", config=config)
    train_step = backend.train_step

    def counted_step(micro_batches):
        buckets.append([])
        result = train_step(micro_batches)
        if len(buckets) == stop_at:
            signal.raise_signal(signal.SIGTERM)
        return result

    backend.train_step = counted_step
    try:
        train(config, backend, output_dir=output_dir, resume=mode == "resume", show_progress=False)
    except Interrupted:
        if not stop_at:
            raise
    from torch.nn.parallel import DistributedDataParallel

    with open(f"{record_path}.{rank}", "w") as f:
        json.dump({"ddp": isinstance(backend.ddp, DistributedDataParallel), "buckets": buckets,
                   "restored": restored, "devices": devices, "compiled_graphs": cuda_backend.num_compiled_graphs()},
                  f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
