#!/usr/bin/env bash
# Multi-host TPU pod slice (e.g. v5p-64 = 8 hosts, v6e-64 = 16 hosts): one command from your workstation copies
# this working tree to every worker, sets up the environment there, and starts the same program on all workers
# (`gcloud compute tpus tpu-vm ssh --worker=all`). Each process calls jax.distributed.initialize() through
# stapo_jax.runtime.distributed (STAPO_DISTRIBUTED=on: JAX reads the slice topology from the TPU metadata).
# Every worker logs to REMOTE_DIR/logs/worker-<n>.log on its own VM; `logs` tails one of them.
#
# usage:  launch/tpu_pod.sh ACTION TPU_NAME ZONE [CONFIG [key=value ...]]
#   setup   copy the tree (git-tracked + untracked, not ignored files) to all workers; create .venv with jax[tpu]
#   start   start CMD on all workers in the background (nohup; survives the ssh session)
#   run     setup, then start
#   logs    tail the log of worker $WORKER (default 0)
#   stop    SIGTERM on all workers: the trainer saves a checkpoint and exits cleanly
#   status  TPU state and, per worker, whether the job runs and its exit code
#   watch   every $INTERVAL s: when the slice is READY and the job is neither running nor finished with exit 0,
#           run setup + start again (resume after preemption / maintenance). Ctrl-C to stop watching.
# env:    PROJECT (gcloud --project), CMD (train), MESH (default configs/mesh/tpu-v5p-64.yaml; "" = the config's),
#         REMOTE_DIR (stapo_jax, relative to the remote home), WORKER (0), INTERVAL (300),
#         DRY_RUN=1 (print the gcloud commands instead of running them)
#
# Resume after preemption: trainer.run_dir must be shared by all workers and outlive the VMs: a POSIX path on
# shared storage, e.g. a bucket mounted with gcsfuse at the same path on every worker (the trainer writes
# metrics and plots with plain file I/O, so a gs:// URL is not accepted); the trainer resumes from its latest
# checkpoint by default, so re-running `run` (or `watch`) continues.
# example:
#   launch/tpu_pod.sh run my-v5p-64 us-east5-a configs/paper/qwen3-14b-base-stapo.yaml \
#     trainer.run_dir=/mnt/gcs/stapo/qwen3-14b-stapo trainer.total_steps=500 \
#     data.train_files=[data/dapo_math_17k.jsonl] model.path=/mnt/ckpt/Qwen3-14B-Base
set -euo pipefail
cd "$(dirname "$0")/.."
ACTION=${1:?usage: launch/tpu_pod.sh setup|start|run|logs|stop|status|watch TPU_NAME ZONE [CONFIG [key=value ...]]}
NAME=${2:?TPU_NAME missing}
ZONE=${3:?ZONE missing}
shift 3
CMD=${CMD:-train}
MESH=${MESH-configs/mesh/tpu-v5p-64.yaml}
REMOTE_DIR=${REMOTE_DIR:-stapo_jax}
WORKER=${WORKER:-0}
INTERVAL=${INTERVAL:-300}
GCLOUD=(gcloud compute tpus tpu-vm)
EXTRA=(--zone "$ZONE")
[ -n "${PROJECT:-}" ] && EXTRA+=(--project "$PROJECT")

run() {  # run or (DRY_RUN) print a command
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
on_workers() {  # on_workers WORKERS 'remote shell command'
  run "${GCLOUD[@]}" ssh "$NAME" "${EXTRA[@]}" --worker="$1" --command "$2"
}

setup() {
  local tarball=/tmp/stapo_jax-$$.tgz
  if [ -z "${DRY_RUN:-}" ]; then
    git ls-files -co --exclude-standard -z | tar czf "$tarball" --null -T -
  fi
  run "${GCLOUD[@]}" scp "$tarball" "$NAME:/tmp/stapo_jax.tgz" "${EXTRA[@]}" --worker=all
  on_workers all "mkdir -p $REMOTE_DIR && tar xzf /tmp/stapo_jax.tgz -C $REMOTE_DIR && cd $REMOTE_DIR && \
make -s setup PY=python3 && .venv/bin/pip install -q -U 'jax[tpu]'"
  [ -n "${DRY_RUN:-}" ] || rm -f "$tarball"
}

start() {
  local config=${1:?CONFIG missing}
  shift
  local mesh_args=()
  if [ -n "$MESH" ]; then
    while IFS= read -r line; do mesh_args+=("$line"); done < <(python3 launch/overrides_from_yaml.py "$MESH")
  fi
  local job script b64
  job=$(printf '%q ' .venv/bin/stapo-jax "$CMD" --config "$config" ${mesh_args[@]+"${mesh_args[@]}"} "$@")
  script=$(printf 'export STAPO_DISTRIBUTED=on\n%s\necho $? > logs/exit-code\n' "$job")
  b64=$(printf '%s\n' "$script" | base64 | tr -d '\n')  # travels through ssh without any quoting issue
  # worker index from the TPU metadata (agent-worker-number), hostname as a fallback
  on_workers all "cd $REMOTE_DIR && mkdir -p logs && rm -f logs/exit-code && \
echo $b64 | base64 -d > logs/job.sh && \
W=\$(curl -s -f -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname) && \
(nohup bash logs/job.sh > logs/worker-\$W.log 2>&1 < /dev/null & echo \$! > logs/job.pid) && \
echo worker \$W started, log $REMOTE_DIR/logs/worker-\$W.log"
}

case "$ACTION" in
  setup) setup ;;
  start) start "$@" ;;
  run) setup; start "$@" ;;
  logs) on_workers "$WORKER" "tail -n 200 -F $REMOTE_DIR/logs/worker-*.log" ;;
  stop) on_workers all "cd $REMOTE_DIR && [ -f logs/job.pid ] && pkill -TERM -P \$(cat logs/job.pid) && echo sent SIGTERM || echo no job" ;;
  status)
    run "${GCLOUD[@]}" describe "$NAME" "${EXTRA[@]}" --format='value(state)'
    on_workers all "cd $REMOTE_DIR 2>/dev/null && { [ -f logs/job.pid ] && kill -0 \$(cat logs/job.pid) 2>/dev/null && echo running || echo 'not running, exit code:' \$(cat logs/exit-code 2>/dev/null || echo none); }" ;;
  watch)
    while true; do
      state=$("${GCLOUD[@]}" describe "$NAME" "${EXTRA[@]}" --format='value(state)' 2>/dev/null || echo UNKNOWN)
      job=$(on_workers 0 "cd $REMOTE_DIR 2>/dev/null && { [ -f logs/job.pid ] && kill -0 \$(cat logs/job.pid) 2>/dev/null && echo running || cat logs/exit-code 2>/dev/null || echo none; }" 2>/dev/null || echo unreachable)
      echo "$(date -u +%FT%TZ) slice=$state job=$job"
      if [ "$job" = "0" ]; then echo "job finished (exit 0)"; break; fi
      if [ "$state" = "READY" ] && [ "$job" != "running" ]; then setup; start "$@"; fi
      [ -n "${DRY_RUN:-}" ] && break
      sleep "$INTERVAL"
    done ;;
  *) echo "tpu_pod.sh: unknown action $ACTION (setup|start|run|logs|stop|status|watch)" >&2; exit 2 ;;
esac
