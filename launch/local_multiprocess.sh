#!/usr/bin/env bash
# Rehearse a multi-host job (TPU pod slice / SLURM) on one machine: N JAX processes on 127.0.0.1, each with
# D simulated CPU devices, logs prefixed [p<i>], non-zero exit if any process fails (the others are stopped).
#
# usage:  launch/local_multiprocess.sh N CONFIG [key=value ...]
# env:    CMD      train | sft | eval | demo   (default: train)
#         DEVICES  simulated CPU devices per process (default: 2)
#         PY       python interpreter (default: .venv/bin/python, else python3)
# example: launch/local_multiprocess.sh 2 configs/tiny_cpu.yaml trainer.total_steps=3 sft.steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: launch/local_multiprocess.sh N CONFIG [key=value ...]}
CONFIG=${2:?usage: launch/local_multiprocess.sh N CONFIG [key=value ...]}
shift 2
[ -f "$CONFIG" ] || { echo "local_multiprocess.sh: config not found: $CONFIG" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec "$PY" -m stapo_jax launch --local "$N" --devices-per-process "${DEVICES:-2}" --command "${CMD:-train}" \
  --config "$CONFIG" "$@"
