#!/usr/bin/env bash
# Accelerator check for issues 14 and 15 on one NVIDIA H200 (the `device` tool's nvidia-h200 machine: python3 3.12 with
# JAX 0.11 + CUDA 13, torch 2.11, transformers 5, flax, optax, pytest, hypothesis; no google-jetstream, no
# network). One call of at most 9 minutes; every stage has its own timeout, so one hang or failure cannot eat the
# budget, and writes its log under $OUT (8 files at most come back: machine, tests, update, rollout, model_0.6b,
# model_1.7b, summary), in this order (the open issue's figures first):
#   1. the attention, model and HF parity tests on the GPU (tests/test_attention.py, test_qwen3.py, test_hf.py;
#      float32 with JAX_DEFAULT_MATMUL_PRECISION=highest so XLA does not use TF32; the 8-device mesh test and the
#      TPU splash kernel in interpret mode are CPU tests and are deselected here);
#   2. issue 15: one full update (forward + backward + AdamW) at the Qwen3-0.6B shape, 8 x (512 + 512) tokens,
#      bf16 compute with fp32 master weights on both sides, ours vs HF PyTorch on CUDA (bench/bench_update.py),
#      with the MFU against the H200's dense bf16 peak (989 TFLOP/s, datasheet) and the measured matmul peak;
#   3. issue 15: bench/bench_rollout.py at 0.6B against HF generate on CUDA (both bf16, 32 x 128 greedy tokens),
#      with the weight sync into the engine;
#   4. issue 14: bf16 forward + backward tokens/s and MFU at Qwen3-0.6B and Qwen3-1.7B shapes (full depth,
#      2 x 4,096 tokens, two packed sequences per row) with cudnn vs blockwise vs xla attention, plus cuDNN-vs-XLA
#      attention parity in bf16 (bench/bench_model_attention.py), one process per model.
# The last lines printed (and $OUT/summary.log) are the figures for the issue's note and docs/benchmarks.md ("Accelerator check").
#
# Prepare once, here (google-jetstream 0.2.2 is pure Python; the rollout engine imports it, its seqio import is
# stubbed by stapo_jax.rollout.compat and its other imports are on the machine):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl google-jetstream==0.2.2
# then call the device tool:  run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=590)
# Budget (seconds, override by environment): T_TESTS=100 T_UPDATE=150 T_ROLLOUT=110 T_MODEL06=90 T_MODEL17=90
# (540 s).
#
#   bash bench/gpu_check.sh --cpu-smoke    # here, on CPU: every stage with tiny shapes (arguments, imports, parsing)
set -u -o pipefail
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$SMOKE" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  T_TESTS=${T_TESTS:-240} T_MODEL06=${T_MODEL06:-240} T_MODEL17=${T_MODEL17:-240} T_ROLLOUT=${T_ROLLOUT:-300}
  T_UPDATE=${T_UPDATE:-300}
  TESTS=(tests/test_attention.py -k "auto_selection or all_padding")
  UPDATE_ARGS=(--layers 1 --vocab 4096 --B 1 --P 16 --R 16 --repeats 3 --peak-n 256 --chip-peak 1)
  MODEL_ARGS=(--layers 1 --seq 256 --batch 1 --impls xla,blockwise --dtype float32 --repeats 2)
  ROLLOUT_ARGS=(--models tiny --batch 4 --new-tokens 8 --repeats 3 --steps-per-sync 1 --torch-device cpu
                --dtype bfloat16)
else
  export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU in the rollout stage
  T_TESTS=${T_TESTS:-100} T_MODEL06=${T_MODEL06:-90} T_MODEL17=${T_MODEL17:-90} T_ROLLOUT=${T_ROLLOUT:-110}
  T_UPDATE=${T_UPDATE:-150}
  TESTS=(tests/test_attention.py tests/test_qwen3.py tests/test_hf.py -k "not mesh and not splash")
  UPDATE_ARGS=(--preset qwen3-0.6b --B 8 --P 512 --R 512 --repeats 5 --device cuda --dtype bfloat16
               --torch-entropy --peak-n 8192 --chip-peak 989)
  MODEL_ARGS=(--seq 4096 --batch 2 --dtype bfloat16 --repeats 5)
  ROLLOUT_ARGS=(--models 0.6b --torch-device cuda --dtype bfloat16)
fi
START=$(date +%s)
stage() { echo "=== $1 ($(( $(date +%s) - START )) s)"; }
# run NAME SECONDS CMD...: the command under its own timeout (SIGKILL 5 s after SIGTERM), output to $OUT/NAME.log
run() {
  local name=$1 secs=$2
  shift 2
  timeout -k 5 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc = 124 ] || [ $rc = 137 ] && echo "  $name: timed out after $secs s" | tee -a "$OUT/$name.log"
  tail -n 4 "$OUT/$name.log"
  return $rc
}

stage "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  timeout 60 $PY -c "import jax, torch, transformers, flax; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| transformers', transformers.__version__, '| flax', flax.__version__)" 2>&1
} | tee "$OUT/machine.log"

stage "1. parity tests (fp32)"
JAX_DEFAULT_MATMUL_PRECISION=highest run tests "$T_TESTS" $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}"
TESTS_RC=$?

stage "2. update vs torch (bf16)"
run update "$T_UPDATE" $PY bench/bench_update.py "${UPDATE_ARGS[@]}"
UPDATE_RC=$?

stage "3. rollout: ours vs HF generate (bf16)"
run rollout "$T_ROLLOUT" $PY bench/bench_rollout.py "${ROLLOUT_ARGS[@]}"
ROLLOUT_RC=$?

stage "4. bf16 forward+backward, cudnn vs blockwise vs xla: Qwen3-0.6B"
run model_0.6b "$T_MODEL06" $PY bench/bench_model_attention.py --models Qwen3-0.6B "${MODEL_ARGS[@]}"
M06_RC=$?
stage "4. bf16 forward+backward, cudnn vs blockwise vs xla: Qwen3-1.7B"
run model_1.7b "$T_MODEL17" $PY bench/bench_model_attention.py --models Qwen3-1.7B "${MODEL_ARGS[@]}"
M17_RC=$?

stage "summary"
{ echo "machine: $(head -2 "$OUT/machine.log" | tr '\n' ' ')"
  echo "tests (rc $TESTS_RC): $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -8
  grep -E "^machine|^shape|step-0 loss|matmul peak|update .*tok/s|^ratio ours|^MFU|timed out|Error" "$OUT/update.log" \
    | head -12 | sed "s/^/update (rc $UPDATE_RC): /"
  grep -E "HF generate|ours steps_per_sync|weight sync|compile|timed out|Error" "$OUT/rollout.log" | head -6 \
    | sed "s/^/rollout (rc $ROLLOUT_RC): /"
  for m in 0.6b 1.7b; do
    rc=$M06_RC; [ $m = 1.7b ] && rc=$M17_RC
    grep -E "cudnn vs xla|tokens/s|time / xla|failed:|timed out" "$OUT/model_$m.log" | sed "s/^/model $m (rc $rc): /"
  done
  echo "total $(( $(date +%s) - START )) s"
} | tee "$OUT/summary.log"
[ $TESTS_RC = 0 ] && [ $UPDATE_RC = 0 ] && [ $M06_RC = 0 ] && [ $M17_RC = 0 ] && [ $ROLLOUT_RC = 0 ]
