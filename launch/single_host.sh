#!/usr/bin/env bash
# One machine, one process, all of its accelerators: a GPU node (e.g. 8x H100/H200), a single-host TPU VM,
# or a CPU box. Creates .venv on first use (make setup), then runs a stapo-jax command; output is shown and
# appended to logs/<cmd>-<config>-<host>.log. Re-running the same command after a crash or preemption
# resumes from the latest checkpoint in trainer.run_dir (trainer.resume defaults to true).
#
# usage:  launch/single_host.sh CONFIG [key=value ...]
# env:    CMD        train | sft | eval | plan            (default: train)
#         MESH       a configs/mesh/*.yaml preset, applied as mesh.* overrides (default: the config's mesh)
#         JAX_EXTRA  cuda12 | tpu: also installs jax[JAX_EXTRA] into .venv (default: none; CPU jax)
#         LOG_DIR    (default: logs)
#         DRY_RUN=1  print the command instead of running it (no setup)
# example: MESH=configs/mesh/gpu-8xh200.yaml JAX_EXTRA=cuda12 launch/single_host.sh \
#            configs/paper/qwen3-1.7b-base-stapo.yaml data.train_files=[data/dapo_math_17k.jsonl] \
#            trainer.total_steps=500
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: launch/single_host.sh CONFIG [key=value ...]}
shift
CMD=${CMD:-train}
LOG_DIR=${LOG_DIR:-logs}
PY=.venv/bin/python
[ -f "$CONFIG" ] || { echo "single_host.sh: config not found: $CONFIG" >&2; exit 2; }
if [ -z "${DRY_RUN:-}" ]; then
  make -s setup
  if [ -n "${JAX_EXTRA:-}" ]; then .venv/bin/pip install -q -U "jax[${JAX_EXTRA}]"; fi
else
  command -v "$PY" >/dev/null 2>&1 || PY=python3
fi
MESH_ARGS=()
if [ -n "${MESH:-}" ]; then
  while IFS= read -r line; do MESH_ARGS+=("$line"); done < <("$PY" launch/overrides_from_yaml.py "$MESH")
fi
# GPUs: let XLA take most of the memory (JAX preallocates 75% by default).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
ARGS=(.venv/bin/stapo-jax "$CMD" --config "$CONFIG" ${MESH_ARGS[@]+"${MESH_ARGS[@]}"} "$@")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${ARGS[@]}"; echo
  exit 0
fi
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/${CMD}-$(basename "$CONFIG" .yaml)-$(hostname).log"
echo "logging to $LOG"
"${ARGS[@]}" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
