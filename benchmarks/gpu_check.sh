#!/usr/bin/env bash
# The GPU run in one command, under 9 minutes on one H100/H200: a smoke check, the cuda-marked
# tests, and the throughput rows of benchmarks/cuda_throughput.py (BERT-Large phase 2 at S=512
# in bf16, eager and compiled; BERT-base phase 1 at S=128), each stage inside a time budget so
# that whatever ran comes back even if a later stage does not finish.
#
#   bash benchmarks/gpu_check.sh OUT_DIR                       # on a GPU machine (its own torch)
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh OUT_DIR   # the same stages on a CPU, tiny shapes
#
# OUT_DIR gets: env.txt (GPU, driver, torch, transformers), smoke.log, tests.log (pytest -m cuda -v),
# bench_phase2.json, bench_phase2_compiled.json, bench_phase1.json, table.md (one table of all rows,
# the ratios inside it) and log.txt (this script's own progress). GPU_CHECK_BUDGET (seconds, default
# 570) bounds the whole run: a stage that would start with too little time left is skipped and says so.
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
budget=${GPU_CHECK_BUDGET:-570}
start=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*" | tee -a "$out/log.txt"; }
left() { echo $(( budget - ($(date +%s) - start) )); }

# stage NAME MIN_SECONDS MAX_SECONDS LOG COMMAND...: run COMMAND under `timeout` (at most MAX_SECONDS
# and what is left of the budget), its output appended to LOG, unless less than MIN_SECONDS are left.
stage() {
  local name=$1 need=$2 most=$3 output=$4; shift 4
  local remaining; remaining=$(left)
  if (( remaining < need )); then log "SKIPPED $name: ${remaining}s left of the budget, it needs ${need}s"; return 0; fi
  local limit=$(( remaining < most ? remaining : most ))
  log "start $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >>"$output" 2>&1
  local rc=$?
  log "end $name: exit $rc"
  return 0
}

if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
  # This machine's CPU, tiny shapes: checks the stages and their arguments, not speed.
  large=(--models tiny --device cpu --precision fp32 --micro-batch-size 4 --gradient-accumulation 1 --num-sequences 300
         --pool-size 4 --steps 1 --repeats 2 --warmup-steps 1)
  base=("${large[@]}")
  compile_args=(--compile --compile-backend aot_eager)
else
  # Timed windows of 4 optimizer steps (x 4 micro-batches), 3 windows, 2 untimed steps first.
  large=(--models phase2 --precision bf16 --micro-batch-size 16 --gradient-accumulation 4 --steps 4 --repeats 3 --warmup-steps 2)
  base=(--models phase1_base --precision bf16 --micro-batch-size 128 --gradient-accumulation 2 --steps 4 --repeats 3 --warmup-steps 2)
  compile_args=(--compile)
fi

{
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "memory GiB", round(p.total_memory / 2**30, 1), "SMs", p.multi_processor_count)
EOF
} >"$out/env.txt" 2>&1
log "environment: $(grep -m1 '^device\|^torch' "$out/env.txt")"

# 1. Smoke: the package imports on this torch and one tiny step trains (seconds). A failure here ends the
#    run at once, so that the device time goes to a fixed rerun instead of to doomed stages.
smoke_device=cuda; [ -n "${GPU_CHECK_DRY_RUN:-}" ] && smoke_device=cpu
stage smoke 30 120 "$out/smoke.log" "$PY" run.py --backend cuda --config tiny --steps 3 --no-progress \
  --output-dir "$out/smoke_run" --set cuda.device=$smoke_device --set cuda.precision=fp32
if ! grep -q '"step": 3' "$out/smoke_run/metrics.jsonl" 2>/dev/null; then
  log "smoke run failed: see smoke.log; stopping"; tail -20 "$out/smoke.log"; exit 1
fi
rm -rf "$out/smoke_run"

# 2. The headline rows: BERT-Large phase 2 eager, every setup (what cannot run says why).
stage bench_phase2 60 200 "$out/log.txt" "$PY" benchmarks/cuda_throughput.py "${large[@]}" --setup-timeout 90 \
  --setups packed-sdpa packed-flex packed-varlen packed-dense padded-sdpa hf-padded-sdpa hf-padding-free-varlen hf-padding-free-fa2 \
  --output "$out/bench_phase2.json"

# 3. The cuda-marked tests (GPU kernels against references, compile without recompiles, fp16 200 steps,
#    GPU resume bit-exact, GPU step against the CPU reference). -v: each result is in the log as it ends.
stage tests 60 170 "$out/tests.log" "$PY" -m pytest -m cuda -v -rs -p no:cacheprovider tests/backends/test_cuda_backend.py \
  tests/model/test_flex_attention.py tests/model/test_varlen_attention.py tests/model/test_attention.py
log "tests: $(tail -1 "$out/tests.log")"

# 4. Compiled BERT-Large (inductor): MFU, and compiled against compiled.
stage bench_phase2_compiled 100 200 "$out/log.txt" "$PY" benchmarks/cuda_throughput.py "${large[@]}" "${compile_args[@]}" \
  --setup-timeout 150 --setups packed-sdpa packed-flex hf-padded-sdpa --output "$out/bench_phase2_compiled.json"

# 5. BERT-base phase 1 (S=128) eager.
stage bench_phase1 40 100 "$out/log.txt" "$PY" benchmarks/cuda_throughput.py "${base[@]}" --setup-timeout 60 \
  --setups packed-sdpa packed-varlen padded-sdpa hf-padded-sdpa hf-padding-free-varlen --output "$out/bench_phase1.json"

tables=$(ls "$out"/bench_phase2.json "$out"/bench_phase2_compiled.json "$out"/bench_phase1.json 2>/dev/null)
if [ -n "$tables" ]; then
  # shellcheck disable=SC2086
  "$PY" benchmarks/cuda_throughput.py --table $tables >"$out/table.md" 2>>"$out/log.txt"
  cat "$out/table.md"
fi
log "done"
