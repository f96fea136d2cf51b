#!/usr/bin/env bash
# The clip demo (`make demo-clips`): the recommended recipe for the Wan / Qwen-Image VAEs, fine-tuning the decoder
# on video clips with the encoder frozen, on CPU in about a quarter of an hour, then the held-out clips before and
# after. Usage: bash scripts/run_clip_demo.sh [OUTPUT_DIR] [extra flags for step 2]
#
# What stands in for what, since nothing can be downloaded here:
# - the clips are pans and zooms over the demo photos (scripts/make_demo_clips.py), not filmed footage;
# - the "downloaded Wan VAE" is configs/wan_tiny.json (Wan 2.1's layout, tiny) trained for a few minutes on the demo
#   photos, i.e. on images only: like a VAE fine-tuned on images, its decoder's temporal weights have never seen
#   a clip. With a real one, step 1 is `--pretrained_model_name_or_path /models/Wan2.1-T2V-1.3B-Diffusers
#   --subfolder vae` in step 2 (docs/fine-tuning.md, "Fine-tuning on clips").
# Re-running starts over in OUTPUT_DIR; the clips are made once (data/demo_clips).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${1:-outputs/demo_clips}; shift || true
CLIPS=data/demo_clips
FRAMES=${FRAMES:-5}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the tiny models' small kernels run fastest on one thread here

if [ ! -f "$CLIPS/.done" ]; then
  "$PYTHON" scripts/make_demo_clips.py --image_dir data/demo/train --output_dir "$CLIPS/train" --num_clips 32 \
    --frames 16 --size 72 --seed 0
  "$PYTHON" scripts/make_demo_clips.py --image_dir data/demo/eval --output_dir "$CLIPS/eval" --num_clips 8 \
    --frames "$FRAMES" --size 64 --seed 1
  touch "$CLIPS/.done"
fi

echo "== 1. the stand-in source VAE: configs/wan_tiny.json on the demo photos (images only)"
"$PYTHON" train_vae_no_trainer.py --vae_config_file configs/wan_tiny.json \
  --file_list data/filelist/demo.filelist.list --output_dir "$OUT/source" --resolution 64 \
  --per_device_train_batch_size 4 --max_steps 150 --learning_rate 1e-3 --warmup_steps 10 --disc_weight 0 \
  --logging_steps 25 --save_steps 0 --image_logging_steps 0 --device cpu --seed 42 --overwrite_output_dir

echo "== 2. decoder-only on clips of $FRAMES frames, a fifth of the samples single frames, the temporal term"
"$PYTHON" train_vae_trainer.py --pretrained_model_name_or_path "$OUT/source/vae" --freeze_encoder \
  --file_list "$CLIPS/train" --num_frames "$FRAMES" --video_image_ratio 0.2 --temporal_loss_weight 0.5 \
  --lpips_num_frames 2 \
  --output_dir "$OUT" --resolution 64 --per_device_train_batch_size 2 --max_steps 40 --learning_rate 5e-4 \
  --warmup_steps 5 --disc_start 25 --disc_weight_warmup_steps 10 --disc_type patchgan3d --disc_norm group \
  --eval_file_list "$CLIPS/eval" --eval_steps 20 --eval_num_images 8 --metric_for_best_model psnr \
  --logging_steps 5 --image_logging_steps 20 --save_steps 20 --save_total_limit 2 \
  --dataloader_num_workers 1 --device cpu --seed 42 "$@"

echo; echo "== held-out clips ($FRAMES frames, 64 px), before and after"
for name in source:"$OUT/source/vae" trained:"$OUT/vae"; do
  "$PYTHON" scripts/eval_vae.py --vae "${name#*:}" --data "$CLIPS/eval" --resolution 64 --num_frames "$FRAMES" \
    --num_images 8 --output_dir "$OUT/eval_${name%%:*}" > "$OUT/eval_${name%%:*}.txt"
done
"$PYTHON" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
before, after = (json.load(open(f"{out}/eval_{name}/metrics.json"))["metrics"] for name in ("source", "trained"))
print(f"{'metric':16} {'source':>10} {'trained':>10}")
for name in ("psnr", "ssim", "lpips", "flicker", *(f"psnr_position_{p}" for p in range(5))):
    print(f"{name:16} {before[name]:10.4f} {after[name]:10.4f}")
print(f"\nprotocol: {out}/eval_trained/metrics.json   frame strips: {out}/eval_trained/reconstructions.png")
print(f"VAE (diffusers AutoencoderKLWan, encoder bit-identical to the source's): {out}/vae")
print(f"VisualDL: .venv/bin/visualdl --logdir {out}/logs   (then open http://localhost:8040)")
PY
