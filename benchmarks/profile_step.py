"""Where a training step's time goes: torch.profiler around steps of a real ``run.py`` job.

Runs ``run.py`` with the given arguments in this process, on the cpu backend, and profiles
optimizer steps ``--warmup + 1`` to ``--warmup + --steps`` with ``torch.profiler`` (CPU
activities). The backend's parts are wrapped in ``record_function`` scopes from outside
(nothing in backends/ is changed): forward + backward of the step's micro-batches, the
gradient norm and clipping, and the optimizer's and schedule's own ``step`` and ``zero_grad``
calls as the backend makes them (so a backend that skips a non-finite update on the device is
profiled as it runs). Prints those scopes and the top operators by self time, and writes them
as JSON (``--output``) plus torch's own table (``.txt``).

    python benchmarks/profile_step.py --output prof.json -- --config finetune_classification \\
        --init-checkpoint DIR --set finetune.train_file=train.csv ... --set train.steps=26

(``train.steps`` must cover ``--warmup + --steps``.) CPU time here is the profiler's wall
time per operator on the calling thread; with intra-op threads an operator's time is its wall
time, not the sum over threads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from torch.profiler import ProfilerActivity, profile, record_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)

SCOPES = ("step/forward+backward", "step/grad_norm+clip", "step/optimizer.step", "step/scheduler",
          "step/zero_grad")


def _timed(name, method, *args, **kwargs):
    with record_function(name):
        return method(*args, **kwargs)


def instrument(backend_class, warmup: int, steps: int, output: str) -> None:
    """Wrap ``backend_class``'s parts in profiler scopes; profile steps warmup+1..warmup+steps."""
    run, clip, train_step = backend_class._run, backend_class.clip_gradients, backend_class.train_step
    state = {"step": 0}

    def scoped(name, fn):
        def wrapper(self, *args, **kwargs):
            with record_function(name):
                return fn(self, *args, **kwargs)
        return wrapper

    def scope_members(self):  # the optimizer's and schedule's own calls, as the backend makes them
        for owner, attr, name in ((self.optimizer, "step", "step/optimizer.step"),
                                  (self.optimizer, "zero_grad", "step/zero_grad"),
                                  (self.scheduler, "step", "step/scheduler")):
            if owner is not None:
                method = getattr(owner, attr)
                setattr(owner, attr, lambda *a, _m=method, _n=name, **k: _timed(_n, _m, *a, **k))

    def profiled_train_step(self, micro_batches):
        state["step"] += 1
        if state["step"] == 1:
            scope_members(self)
        if state["step"] == warmup + 1:
            state["profiler"] = profile(activities=[ProfilerActivity.CPU])
            state["profiler"].__enter__()
            state["start"] = time.perf_counter()
        with record_function("step/total"):
            result = train_step(self, micro_batches)
        if state["step"] == warmup + steps:
            wall = time.perf_counter() - state["start"]
            state["profiler"].__exit__(None, None, None)
            report(state["profiler"], wall, steps, type(self.optimizer), output)
        return result

    backend_class._run = scoped("step/forward+backward", run)
    backend_class.clip_gradients = scoped("step/grad_norm+clip", clip)
    backend_class.train_step = profiled_train_step


def report(profiler, wall: float, steps: int, optimizer_class, output: str) -> None:
    events = profiler.key_averages()
    totals = {e.key: e.cpu_time_total for e in events}
    step_total = totals.get("step/total", 0.0)
    scopes = {name: totals.get(name, 0.0) for name in SCOPES}
    top = sorted(((e.key, e.self_cpu_time_total, e.count) for e in events if not e.key.startswith("step/")),
                 key=lambda row: -row[1])[:25]
    result = {"steps": steps, "wall_seconds": wall, "ms_per_step": wall / steps * 1e3,
              "optimizer": optimizer_class.__name__, "load_average": os.getloadavg(),
              "scopes_ms_per_step": {k: v / 1e3 / steps for k, v in scopes.items()},
              "scopes_share": {k: v / step_total for k, v in scopes.items()} if step_total else {},
              "top_self_ms_per_step": [(name, t / 1e3 / steps, count // steps) for name, t, count in top]}
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    with open(output + ".txt", "w") as f:
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40))
    print(f"\nprofiled {steps} steps: {wall / steps * 1e3:.0f} ms per step ({optimizer_class.__name__}); "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| part of the step | ms per step | share |\n|---|---|---|")
    for name in SCOPES:
        print(f"| {name} | {scopes[name] / 1e3 / steps:.1f} | {100 * scopes[name] / max(step_total, 1e-9):.1f} % |")
    print("\n| operator | self ms per step | calls per step |\n|---|---|---|")
    for name, t, count in top[:15]:
        print(f"| {name} | {t / 1e3 / steps:.1f} | {count // steps} |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="profile_step.json")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the profiled ones (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps (default 20)")
    args = parser.parse_args(argv[:split])
    from backends.cpu import CPUBackend

    instrument(CPUBackend, args.warmup, args.steps, args.output)
    os.chdir(ROOT)
    import run

    return run.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
