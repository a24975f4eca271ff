#!/usr/bin/env bash
# Accelerator check of issue 33: one run of at most 8 minutes on one NVIDIA H200 (the `device` tool's machine:
# python3 3.12 with jax 0.11 + CUDA, flax 0.12.10, optax, orbax, transformers 5.17, torch 2.11 preinstalled; no
# network). Every stage runs under its own `timeout`, streams its figure lines as it measures them (so a stage cut
# short still reports what it reached) and keeps its full log in $OUT; all stages share one persistent JAX
# compilation cache (JAX_COMPILATION_CACHE_DIR, default .jax_cache/ in the repository: a rerun on a warm machine
# skips the compiles). Stages, in this order:
#   a. `stapo-jax train` at the Qwen3-0.6B shape (bf16 compute, fp32 master weights, model.attention=auto), GSM8K
#      prompts, 32 prompts x 8 samples x 256 new tokens, 6 RL steps: one line per step as it lands in
#      metrics.jsonl, then the steady state (rollout tok/s, update tok/s, MFU) and the compile seconds per program
#      from summary.json (bench/gpu_check_report.py);
#   b. one update vs HF PyTorch on CUDA, bf16 both sides, 8 x (512 + 512) tokens (bench/bench_update.py);
#   c. decode vs HF generate, 32 x 128 greedy tokens, bf16 (bench/bench_rollout.py; one KV-cache length, so one
#      decode program to compile);
#   d. cuDNN / blockwise / XLA attention at 2 x 4096, 0.6B shape, each against XLA on one layer first (parity),
#      then forward + backward tokens/s and MFU per implementation (bench/bench_model_attention.py);
#   e. if at least 45 s remain: the decode-step HLO bytes at the 0.6B shape, 256 slots x 512 positions
#      (bench/bench_decode_step.py --hlo-only).
# Budgets (seconds; environment overrides) from the first H200 run's compile figures (issue 33): the training step 1
# took 73 s at 256 new tokens (compiles included) and steps 2.. 24 s, bench_update spent 26 s in init and > 140 s
# compiling, bench_rollout > 100 s, bench_model_attention > 80 s: T_TRAIN=200 T_UPDATE=90 T_ROLLOUT=75
# T_ATTENTION=75, all cut to what is left of T_TOTAL=470.
#
# Prepare once, here (the packages the machine lacks, as wheels for its Python 3.12 / x86_64; pure-Python ones and
# the binary wheels of grain and array-record):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d .whl google-jetstream==0.2.2 grain \
#     array-record math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 tensorboardX pebble shortuuid \
#     portpicker
# then one command (the wheels go into /tmp/site with pip --no-index --no-deps, ahead on PYTHONPATH; a venv made
# with --system-site-packages and the same pip install works as well):
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
#   bash bench/gpu_check.sh --cpu-smoke    # here, on CPU: every stage at tiny shapes (arguments, imports, parsing)
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
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
RUN_DIR=$OUT/train_run
TRAIN_ARGS=(--config configs/gsm8k_tiny.yaml trainer.run_dir="$RUN_DIR" trainer.resume=false trainer.save_every=0
            trainer.export_hf=false "trainer.logger=[]")
TRAIN_ARGS+=(trainer.compilation_cache_dir="$JAX_COMPILATION_CACHE_DIR")
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # safety limits only (a few minutes in all on an idle 2-core machine; a shared, loaded one takes several times that)
  T_TOTAL=${T_TOTAL:-1800} T_TRAIN=${T_TRAIN:-600} T_UPDATE=${T_UPDATE:-400} T_ROLLOUT=${T_ROLLOUT:-400}
  T_ATTENTION=${T_ATTENTION:-400}
  TRAIN_ARGS+=(trainer.total_steps=2)
  TRAIN_SHAPE="configs/gsm8k_tiny.yaml's toy body, float32, 2 steps"
  UPDATE_ARGS=(--layers 1 --vocab 4096 --B 1 --P 16 --R 16 --repeats 3 --peak-n 128 --chip-peak 1)
  ROLLOUT_ARGS=(--models tiny --batch 4 --new-tokens 8 --repeats 3 --steps-per-sync 1 --torch-device cpu
                --dtype bfloat16 --kv-cache-buckets off)
  ATTENTION_ARGS=(--models Qwen3-0.6B --layers 1 --vocab 4096 --seq 128 --batch 1 --impls xla,blockwise
                  --dtype float32 --repeats 2 --parity-seq 128)
  DECODE_ARGS=(--hlo-only)
else
  export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU in stages b and c
  T_TOTAL=${T_TOTAL:-470} T_TRAIN=${T_TRAIN:-200} T_UPDATE=${T_UPDATE:-90} T_ROLLOUT=${T_ROLLOUT:-75}
  T_ATTENTION=${T_ATTENTION:-75}
  TRAIN_SHAPE="Qwen3-0.6B shape, bf16, 32 x 8 x 256 tokens, 6 steps"
  TRAIN_ARGS+=(trainer.total_steps=6 trainer.train_batch_size=32 rollout.n=8 rollout.max_new_tokens=256
               rollout.max_concurrent_decodes=256 actor.ppo_mini_batch_size=32 actor.ppo_micro_batch_size=32
               data.max_prompt_length=128 model.hidden_size=1024 model.intermediate_size=3072
               model.num_hidden_layers=28 model.num_attention_heads=16 model.num_key_value_heads=8 model.head_dim=128
               model.dtype=bfloat16 model.param_dtype=float32 model.attention=auto reward.num_workers=8)
  UPDATE_ARGS=(--preset qwen3-0.6b --B 8 --P 512 --R 512 --repeats 3 --device cuda --dtype bfloat16
               --peak-n 4096 --chip-peak 989)
  ROLLOUT_ARGS=(--models 0.6b --torch-device cuda --dtype bfloat16 --repeats 3 --steps-per-sync 8
                --kv-cache-buckets off)
  ATTENTION_ARGS=(--models Qwen3-0.6B --seq 4096 --batch 2 --dtype bfloat16 --repeats 3)
  DECODE_ARGS=(--preset qwen3-0.6b --hlo-only)
fi
START=$(date +%s)
FIGURES='tok/s|tokens/s|MFU|loss|ratio|vs xla|compile|steady|train step|summary|peak|HLO|round trips|unbounded|Error|error:|failed|timed out'
left() { echo $(( T_TOTAL - ($(date +%s) - START) )); }
stage() { echo "=== $1 ($(( $(date +%s) - START )) s)"; }
# run NAME SECONDS CMD...: CMD under `timeout` (cut to what is left of T_TOTAL; SIGKILL 5 s after SIGTERM), its
# figure lines printed as they come, everything in $OUT/NAME.log; returns CMD's status (124/137: timed out).
run() {
  local name=$1 secs=$2 rc
  shift 2
  [ "$secs" -gt "$(left)" ] && secs=$(left)
  if [ "$secs" -le 5 ]; then echo "  $name: skipped (no time left)" | tee "$OUT/$name.log"; return 124; fi
  timeout -k 5 "$secs" "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  tail -n +1 --pid=$pid -f "$OUT/$name.log" 2>/dev/null | grep --line-buffered -E "$FIGURES" | grep -v " INFO " \
    | sed -u "s/^/  /"
  wait $pid
  rc=$?
  { [ $rc = 124 ] || [ $rc = 137 ]; } && echo "  $name: timed out after $secs s" | tee -a "$OUT/$name.log"
  return $rc
}

stage "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  timeout 60 $PY -c "import jax, torch, transformers, flax; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| transformers', transformers.__version__, '| flax', flax.__version__)" 2>&1
} | tee "$OUT/machine.log"

stage "a. stapo-jax train, $TRAIN_SHAPE (steady state, compile per program)"
rm -rf "$RUN_DIR"
secs=$T_TRAIN; [ "$secs" -gt "$(left)" ] && secs=$(left)
timeout -k 5 "$secs" $PY -m stapo_jax train "${TRAIN_ARGS[@]}" > "$OUT/train.log" 2>&1 &
TRAIN_PID=$!
$PY bench/gpu_check_report.py follow "$RUN_DIR" --pid $TRAIN_PID | tee "$OUT/train_steps.log"
wait $TRAIN_PID
TRAIN_RC=$?
{ [ $TRAIN_RC = 124 ] || [ $TRAIN_RC = 137 ]; } && echo "  train: timed out after $secs s" | tee -a "$OUT/train.log"
[ $TRAIN_RC != 0 ] && grep -E "Error|error:" "$OUT/train.log" | tail -3
$PY bench/gpu_check_report.py summary "$RUN_DIR" | tee "$OUT/train_summary.log"

stage "b. update vs HF PyTorch (bf16)"
run update "$T_UPDATE" $PY bench/bench_update.py "${UPDATE_ARGS[@]}"
UPDATE_RC=$?

stage "c. decode: ours vs HF generate (bf16)"
run rollout "$T_ROLLOUT" $PY bench/bench_rollout.py "${ROLLOUT_ARGS[@]}"
ROLLOUT_RC=$?

stage "d. attention: cudnn / blockwise / xla, parity and forward+backward"
run attention "$T_ATTENTION" $PY bench/bench_model_attention.py "${ATTENTION_ARGS[@]}"
ATTENTION_RC=$?

DECODE_RC=skipped
if [ "$(left)" -ge 45 ]; then
  stage "e. decode-step HLO bytes (time left: $(left) s)"
  run decode_step "$(left)" $PY bench/bench_decode_step.py "${DECODE_ARGS[@]}"
  DECODE_RC=$?
fi

stage "summary"
{ echo "machine: $(head -2 "$OUT/machine.log" | tr '\n' ' ')"
  echo "a. train (rc $TRAIN_RC): $(grep -c "^train step" "$OUT/train_steps.log") steps"
  grep -hE "steady|compile:" "$OUT/train_summary.log" | sed "s/^/a. /"
  grep -E "^shape|step-0 loss|update .*tok/s|^ratio ours|^MFU|timed out|Error" "$OUT/update.log" | head -8 \
    | sed "s/^/b. update (rc $UPDATE_RC): /"
  grep -E "HF generate|ours steps_per_sync|compile|timed out|Error" "$OUT/rollout.log" | head -5 \
    | sed "s/^/c. rollout (rc $ROLLOUT_RC): /"
  grep -E "vs xla|tokens/s|time / xla|failed:|timed out" "$OUT/attention.log" | sed "s/^/d. attention (rc $ATTENTION_RC): /"
  [ "$DECODE_RC" != skipped ] && grep -E "ratio|unbounded" "$OUT/decode_step.log" | sed "s/^/e. decode step (rc $DECODE_RC): /"
  echo "total $(( $(date +%s) - START )) s"
} | tee "$OUT/summary.log"
[ $TRAIN_RC = 0 ] && [ $UPDATE_RC = 0 ] && [ $ROLLOUT_RC = 0 ] && [ $ATTENTION_RC = 0 ]
