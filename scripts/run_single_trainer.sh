#!/usr/bin/env bash
# One process: one GPU (default), or the CPU with DEVICE=cpu. Knobs: scripts/_common.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_common.sh
launch single train_vae_trainer.py "$@"
