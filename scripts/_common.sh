# Shared defaults for the run_*.sh scripts (DEVICE=gpu: the SD VAE at 256 px; DEVICE=cpu: the tiny VAE at
# 64 px). Override any of them from the environment, and pass extra flags after the script name (they go
# to the entry point), e.g.
#   FILE_LIST=data/filelist/laion.filelist.list OUTPUT_DIR=outputs/sd_vae bash scripts/run_multi_trainer.sh --max_steps 100000
# Fine-tuning: with --pretrained_model_name_or_path (or --init_from_ckpt, or their own --vae_config_file) among
# the extra flags, the scripts pass no --vae_config_file unless VAE_CONFIG is set: the VAE given brings its
# architecture and latent scale (an SDXL VAE keeps 0.13025, a FLUX VAE its 16 channels), e.g.
#   DEVICE=cpu bash scripts/run_single_trainer.sh --pretrained_model_name_or_path path/to/sdxl-vae
# CPU threads: each process uses its share of the usable cores unless OMP_NUM_THREADS is set (the entry
# points choose it, also under the launcher: vae_trainer/threads.py).
USER_VAE_CONFIG=${VAE_CONFIG:-}  # before the defaults below: did the user choose a config?
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
DEVICE=${DEVICE:-gpu}
FILE_LIST=${FILE_LIST:-data/filelist/demo.filelist.list}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/vae}
BATCH_SIZE=${BATCH_SIZE:-4}
GPUS=${GPUS:-0,1,2,3,4,5,6,7}
if [ "$DEVICE" = cpu ]; then
  # The SD VAE at 256 px takes days on a CPU: the demo's tiny VAE at 64 px, a short run, one loader worker.
  VAE_CONFIG=${VAE_CONFIG:-configs/vae_tiny.json}; RESOLUTION=${RESOLUTION:-64}; MAX_STEPS=${MAX_STEPS:-1000}
  NUM_WORKERS=${NUM_WORKERS:-1}
else
  VAE_CONFIG=${VAE_CONFIG:-configs/sd_vae.json}; RESOLUTION=${RESOLUTION:-256}; MAX_STEPS=${MAX_STEPS:-100000}
  NUM_WORKERS=${NUM_WORKERS:-4}
fi
# The loss weights are left to the entry points' defaults (LDM's) and --recipe: stated here, they would override
# a recipe's, and a KL weight is refused for a deterministic autoencoder (DC-AE, RAE).
COMMON_ARGS=(
  --file_list "$FILE_LIST" --vae_config_file "$VAE_CONFIG" --output_dir "$OUTPUT_DIR"
  --resolution "$RESOLUTION" --per_device_train_batch_size "$BATCH_SIZE" --max_steps "$MAX_STEPS"
  --learning_rate 1e-4
  --logging_steps 50 --image_logging_steps 500 --save_steps 2000 --save_total_limit 3
  --dataloader_num_workers "$NUM_WORKERS" --seed 42
)

# brings_vae FLAGS...: do the user's flags name the VAE to start from (either spelling: --flag X, --flag=X)?
brings_vae() {
  local arg
  for arg in "$@"; do
    case "$arg" in
      --pretrained_model_name_or_path|--pretrained_model_name_or_path=*|--init_from_ckpt|--init_from_ckpt=*) return 0 ;;
      --vae_config_file|--vae_config_file=*) return 0 ;;
    esac
  done
  return 1
}

# drop_vae_config_unless_asked FLAGS...: COMMON_ARGS without its --vae_config_file when the user's flags bring the
# VAE and VAE_CONFIG is unset: the script's default config would replace the given VAE's architecture.
drop_vae_config_unless_asked() {
  if [ -n "$USER_VAE_CONFIG" ] || ! brings_vae "$@"; then return; fi
  echo "scripts: the VAE comes from your flags, so no --vae_config_file is passed (VAE_CONFIG sets one)" >&2
  local kept=() i
  for ((i = 0; i < ${#COMMON_ARGS[@]}; i++)); do
    if [ "${COMMON_ARGS[i]}" = --vae_config_file ]; then i=$((i + 1)); else kept+=("${COMMON_ARGS[i]}"); fi
  done
  COMMON_ARGS=("${kept[@]}")
}

# Paddle's launcher (3.3.1) has no handler for SIGUSR1 (SLURM's --signal=USR1@120): it would die at once, and the
# end of the job step would kill the ranks before they save. Started this way it takes SIGUSR1 as SIGTERM,
# which it forwards to every rank (save and stop: docs/reliability.md).
LAUNCHER_USR1_AS_TERM='import os, runpy, signal
signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
runpy.run_module("paddle.distributed.launch", run_name="__main__", alter_sys=True)'

# launch single|multi SCRIPT [flags...]: one process, or paddle.distributed.launch over GPUs / CPU processes / nodes.
launch() {
  local mode=$1 script=$2; shift 2
  local device=$DEVICE
  drop_vae_config_unless_asked "$@"
  if [ "$mode" = single ]; then
    exec "$PYTHON" "$script" "${COMMON_ARGS[@]}" --device "$device" "$@"
  fi
  local launcher=(-c "$LAUNCHER_USR1_AS_TERM" --log_dir "$OUTPUT_DIR/launch_logs")
  if [ "$device" = cpu ]; then launcher+=(--nproc_per_node "${NPROC:-2}"); else launcher+=(--gpus "$GPUS"); fi
  if [ -n "${NNODES:-}" ]; then launcher+=(--nnodes "$NNODES" --rank "${NODE_RANK:-0}" --master "$MASTER"); fi
  exec "$PYTHON" "${launcher[@]}" "$script" "${COMMON_ARGS[@]}" --device "$device" "$@"
}
