#!/usr/bin/env bash
# The GPU run in one script (issue 47): the kernel profile of the main command's step first, then
# the throughput rows of benchmarks/cuda_throughput.py on BERT-Large phase 2 at S=512 in bf16 with
# the config's recipe (hidden dropout 0.1): `run-py-default` (exactly what `python run.py --backend
# cuda --config phase2` runs), each lever on top of it, Hugging Face padding-free compiled, our
# fixed-micro-batch rows; the mission's overhead report (run.py --profile) and the cuda-marked tests.
# Each stage runs inside a time budget, so whatever ran comes back even if a later one does not. No
# network: what is not on the machine must travel with the tree.
#
#   bash benchmarks/gpu_check.sh OUT_DIR                       # on a GPU machine: both parts (~15 min)
#   GPU_CHECK_PART=1 bash benchmarks/gpu_check.sh OUT_DIR      # the first part only (under 10 minutes)
#   GPU_CHECK_PART=2 bash benchmarks/gpu_check.sh OUT_DIR      # then the second, in another command
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh OUT_DIR   # every stage on this CPU, tiny shapes
#   (GPU_CHECK_IN_PROCESS=1 with it: the rows in one process, as the test suite runs the dry run)
#
# Part 1: env.txt (GPU, clocks, power limit, driver, torch), smoke.log, profile/ and profile.log (profile.md: top
# kernels, GEMM share, gaps between launches), rows_default.json (run-py-default, the FP8 lever, HF
# padding-free compiled). Part 2: rows_levers.json, rows_compiled.json, rows_eager.json,
# overhead/ (run.py --profile), tests.log. Then table.md: one table of every row. log.txt: progress.
# GPU_CHECK_BUDGET (seconds, default 570 per part) bounds a part: a stage that would start with too
# little time left is skipped and says so. GPU_CHECK_SKIP: stage names not to run (e.g. "tests").
# The whole script is one block, read before it runs: editing the file meanwhile cannot change a run.
{
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# One inductor cache for every row's process: a graph compiled once is loaded by the next (it may travel).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$out/inductor_cache}
part=${GPU_CHECK_PART:-all}
budget=${GPU_CHECK_BUDGET:-570}
skip=" ${GPU_CHECK_SKIP:-} "
start=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*" | tee -a "$out/log.txt"; }
left() { echo $(( budget - ($(date +%s) - start) )); }

# stage NAME MIN_SECONDS MAX_SECONDS LOG COMMAND...: run COMMAND under `timeout` (at most MAX_SECONDS
# and what is left of the budget), its output appended to LOG, unless less than MIN_SECONDS are left.
stage() {
  local name=$1 need=$2 most=$3 output=$4; shift 4
  if [[ "$skip" == *" $name "* ]]; then log "SKIPPED $name: GPU_CHECK_SKIP"; return 0; fi
  local remaining; remaining=$(left)
  if (( remaining < need )); then log "SKIPPED $name: ${remaining}s left of the budget, it needs ${need}s"; return 0; fi
  local limit=$(( remaining < most ? remaining : most ))
  log "start $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >>"$output" 2>&1
  log "end $name: exit $?"
  return 0
}

if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
  # This machine's CPU, tiny shapes: checks the stages, their arguments and every row, not speed.
  rows=(--models tiny --device cpu --precision fp32 --micro-batch-size 4 --gradient-accumulation 1 --num-sequences 300
        --pool-size 4 --steps 1 --repeats 3 --window-seconds 0 --warmup-steps 1 --setup-timeout 240)
  compile_backend=(--compile-backend aot_eager)
  # GPU_CHECK_IN_PROCESS=1 (the test suite's dry run): every row in one process, seconds each.
  [ -n "${GPU_CHECK_IN_PROCESS:-}" ] && rows+=(--in-process)
  profile_args=(--model tiny --device cpu --steps 1 --warmup-steps 1 --gradient-accumulation 1 --num-sequences 300)
  run_args=(--config tiny --set cuda.device=cpu)
  smoke_args=(--set cuda.device=cpu --set cuda.precision=fp32)
else
  # Windows of at least 20 s, 3 of them, after 2 untimed steps (compilation). Our fixed rows: 32 x 2.
  rows=(--models phase2 --precision bf16 --micro-batch-size 32 --gradient-accumulation 2 --steps 1 --repeats 3
        --window-seconds 20 --warmup-steps 2 --setup-timeout 280)
  compile_backend=()
  profile_args=(--model phase2 --steps 2 --warmup-steps 3 --gradient-accumulation 2)
  run_args=(--config phase2)
  smoke_args=(--set cuda.precision=fp32)
fi
bench=("$PY" benchmarks/cuda_throughput.py "${rows[@]}" "${compile_backend[@]}")

if [ "$part" != 2 ]; then
  {
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,power.max_limit \
      --format=csv 2>&1 || true
    "$PY" - <<'PYEOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("transformers", transformers.__version__)
try:
    import torchao
    print("torchao", torchao.__version__)
except ImportError:
    print("torchao: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "memory GiB", round(p.total_memory / 2**30, 1), "SMs", p.multi_processor_count)
PYEOF
  } >"$out/env.txt" 2>&1
  log "environment: $(grep -m1 '^device\|^torch' "$out/env.txt")"

  # 1. Smoke: the package imports on this torch and one tiny step trains (seconds). A failure here ends
  #    the run at once, so that the device time goes to a fixed rerun instead of to doomed stages.
  if [[ "$skip" != *" smoke "* ]]; then
    stage smoke 30 120 "$out/smoke.log" "$PY" run.py --backend cuda --config tiny --steps 3 --no-progress \
      --output-dir "$out/smoke_run" "${smoke_args[@]}"
    if ! grep -q '"step": 3' "$out/smoke_run/metrics.jsonl" 2>/dev/null; then
      log "smoke run failed: see smoke.log; stopping"; tail -20 "$out/smoke.log"; exit 1
    fi
    rm -rf "$out/smoke_run"
  fi

  # 2. The kernel profile of the main command's compiled step: before any lever.
  stage profile 60 150 "$out/profile.log" "$PY" benchmarks/cuda_profile.py "${profile_args[@]}" --output "$out/profile"

  # 3. The headline rows: run.py's default, the FP8 lever, Hugging Face padding-free compiled (and eager).
  stage rows_default 90 400 "$out/log.txt" "${bench[@]}" --compile both --setups run-py-default lever-fp8 \
    hf-padding-free-varlen hf-padding-free-fa2 --output "$out/rows_default.json"
fi

if [ "$part" != 1 ]; then
  [ "$part" = 2 ] && start=$(date +%s)  # a part of its own: its own budget
  # 4. Each other lever on top of run.py's default (a switch this tree lacks: a "not available" row).
  stage rows_levers 60 240 "$out/log.txt" "${bench[@]}" --setups lever-fused-qkv lever-padded-vocab lever-compiled-lamb \
    lever-cuda-graphs --output "$out/rows_levers.json"
  # 5. Ours at a fixed micro-batch and HF padded, compiled.
  stage rows_compiled 60 200 "$out/log.txt" "${bench[@]}" --compile --setups packed-flex packed-sdpa \
    hf-padded-sdpa --output "$out/rows_compiled.json"
  # 6. The mission's overhead report on this backend (mask and loss-unpacking overhead per depth).
  stage overhead 40 150 "$out/overhead.log" "$PY" run.py --backend cuda "${run_args[@]}" --profile --no-progress \
    --output-dir "$out/overhead"
  # 7. Eager rows, every remaining setup (what cannot run says why).
  stage rows_eager 40 200 "$out/log.txt" "${bench[@]}" --setups packed-sdpa packed-dense packed-varlen padded-sdpa \
    padded-dense padded-flex hf-padded-sdpa --output "$out/rows_eager.json"
  # 8. The cuda-marked tests (GPU kernels against references, compile without recompiles, GPU resume).
  stage tests 60 170 "$out/tests.log" "$PY" -m pytest -m cuda -v -rs -p no:cacheprovider \
    tests/backends/test_cuda_backend.py tests/model/test_flex_attention.py tests/model/test_varlen_attention.py \
    tests/model/test_attention.py
  [ -f "$out/tests.log" ] && log "tests: $(tail -1 "$out/tests.log")"
fi

tables=$(ls "$out"/rows_*.json 2>/dev/null)
if [ -n "$tables" ]; then
  # shellcheck disable=SC2086
  "$PY" benchmarks/cuda_throughput.py --table $tables >"$out/table.md" 2>>"$out/log.txt"
  cat "$out/table.md"
fi
log "done"
exit 0
}
