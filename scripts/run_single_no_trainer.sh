#!/usr/bin/env bash
# One process (one GPU, or the CPU with DEVICE=cpu). See scripts/_common.sh for the knobs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_common.sh
DEVICE=${DEVICE:-gpu}
exec "$PYTHON" train_vae_no_trainer.py "${COMMON_ARGS[@]}" --device "$DEVICE" "$@"
