#!/usr/bin/env bash
# Accelerator check for issue 14 on one NVIDIA H200 (the `device` tool's nvidia-h200 machine: JAX 0.11 with
# CUDA, torch, transformers, flax, optax; no google-jetstream). One call of at most 8 minutes:
#   1. the attention and model parity tests on the GPU (tests/test_attention.py, test_qwen3.py, test_hf.py;
#      float32 with JAX_DEFAULT_MATMUL_PRECISION=highest so XLA does not use TF32);
#   2. bf16 forward + backward tokens/s and MFU at Qwen3-0.6B and Qwen3-1.7B shapes with cudnn vs blockwise vs
#      xla attention, and cuDNN-vs-XLA attention parity in bf16 (bench/bench_model_attention.py);
#   3. bench/bench_rollout.py at 0.6B against HF generate on CUDA.
# It prints a compact summary at the end; full logs go to $OUT (or /tmp/gpu_check).
#
# Prepare once, here (google-jetstream is pure Python; the rollout engine imports it):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl google-jetstream==0.2.2
# then call the device tool:  run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
START=$(date +%s)
stage() { echo "=== $1 ($(( $(date +%s) - START )) s)"; }

stage "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/machine.log"
python3 -c "import jax, torch, transformers, flax; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, torch.cuda.is_available(), '| transformers', transformers.__version__, '| flax', flax.__version__)" 2>&1 | tee -a "$OUT/machine.log"

stage "1. parity tests on GPU (fp32)"
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 180 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_attention.py tests/test_qwen3.py tests/test_hf.py > "$OUT/tests.log" 2>&1
TESTS_RC=$?
tail -5 "$OUT/tests.log"

stage "2. bf16 forward+backward, Qwen3-0.6B / 1.7B shapes, cudnn vs blockwise vs xla"
timeout 200 python3 bench/bench_model_attention.py --models Qwen3-0.6B,Qwen3-1.7B --seq 4096 --batch 2 \
  --dtype bfloat16 --repeats 5 2>&1 | tee "$OUT/model.log"
MODEL_RC=$?

stage "3. rollout 0.6B: ours vs HF generate on CUDA"
timeout 120 python3 bench/bench_rollout.py --models 0.6b --torch-device cuda 2>&1 | tee "$OUT/rollout.log"
ROLLOUT_RC=$?

stage "summary"
echo "tests (rc $TESTS_RC): $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1)"
grep -E "cudnn vs xla|tokens/s|time / xla|failed:" "$OUT/model.log" | sed 's/^/model (rc '"$MODEL_RC"'): /'
grep -E "HF generate|ours steps_per_sync" "$OUT/rollout.log" | sed 's/^/rollout (rc '"$ROLLOUT_RC"'): /'
echo "total $(( $(date +%s) - START )) s"
