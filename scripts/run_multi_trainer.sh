#!/usr/bin/env bash
# Data parallel with paddle.distributed.launch: GPUS=0,...,7 on one node (the default).
# Several nodes: on every node NNODES=N NODE_RANK=R MASTER=IP:PORT (R = 0 on the master node).
# CPU (gloo backend): DEVICE=cpu NPROC=2 (the launcher's --gpus does not work on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_common.sh
launch multi train_vae_trainer.py "$@"
