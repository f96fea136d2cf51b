#!/usr/bin/env bash
# Data parallel with paddle.distributed.launch: GPUS=0,...,7 on one node (the default).
# Several nodes: run this on every node with NNODES=N MASTER=IP:PORT (same values everywhere).
# CPU (gloo backend): DEVICE=cpu NPROC=2 bash scripts/run_multi_trainer.sh  (--gpus does not work on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_common.sh
DEVICE=${DEVICE:-gpu}
LAUNCH=(-m paddle.distributed.launch --log_dir "$OUTPUT_DIR/launch_logs")
if [ "$DEVICE" = cpu ]; then LAUNCH+=(--nproc_per_node "${NPROC:-2}"); else LAUNCH+=(--gpus "$GPUS"); fi
if [ -n "${NNODES:-}" ]; then LAUNCH+=(--nnodes "$NNODES" --master "$MASTER"); fi
exec "$PYTHON" "${LAUNCH[@]}" train_vae_trainer.py "${COMMON_ARGS[@]}" --device "$DEVICE" "$@"
