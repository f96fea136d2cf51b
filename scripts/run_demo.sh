#!/usr/bin/env bash
# The built-in demo (what `make demo` runs): train the tiny VAE on the demo photos on CPU for about ten
# minutes with the PaddleNLP Trainer entry point, then compare it with the untrained model on
# held-out photos it never saw. Usage: bash scripts/run_demo.sh [OUTPUT_DIR] [extra training flags]
# Re-running starts over in OUTPUT_DIR (--overwrite_output_dir).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${1:-outputs/demo}; shift || true
EVAL_LIST=data/filelist/demo_eval.filelist
STEPS=${STEPS:-200}
# The tiny model at 64 px trains fastest on one thread: its many small kernels slow down with more
# (docs/benchmarks.md, section 1: 2.9-3.3 s/step on 1 thread against 5.8-6.0 on 2, this very config).
# Your own OMP_NUM_THREADS wins; the trainer's default for your own runs stays all usable cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PYTHON" train_vae_trainer.py \
  --file_list data/filelist/demo.filelist.list --vae_config_file configs/vae_tiny.json \
  --output_dir "$OUT" --resolution 64 --per_device_train_batch_size 4 --max_steps "$STEPS" \
  --learning_rate 1e-3 --warmup_steps 10 --disc_start 150 --disc_norm group \
  --use_ema true --ema_decay 0.98 \
  --eval_file_list "$EVAL_LIST" --eval_steps 50 --eval_num_images 28 --metric_for_best_model lpips \
  --logging_steps 10 --image_logging_steps 50 --save_steps 50 --save_total_limit 2 \
  --dataloader_num_workers 1 --device cpu --seed 42 --overwrite_output_dir "$@"

echo; echo "== held-out photos (never seen in training), 64 px =="
"$PYTHON" scripts/eval_vae.py --vae configs/vae_tiny.json --seed 42 --data "$EVAL_LIST" --resolution 64 \
  --num_images 28 --output_dir "$OUT/eval_untrained" > "$OUT/eval_untrained.txt"
"$PYTHON" scripts/eval_vae.py --vae "$OUT/vae" --data "$EVAL_LIST" --resolution 64 \
  --num_images 28 --output_dir "$OUT/eval" > "$OUT/eval_trained.txt"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
untrained = json.load(open(f"{out}/eval_untrained/metrics.json"))["metrics"]
evaluated = json.load(open(f"{out}/eval/metrics.json"))
trained = evaluated["metrics"]
print(f"{'metric':8} {'untrained':>10} {'trained':>10}")
for name in ("psnr", "ssim", "lpips"):
    print(f"{name:8} {untrained[name]:10.4f} {trained[name]:10.4f}")
# The protocol once in the whole demo: training printed it with its first evaluation.
if evaluated["protocol"] == json.loads(open(f"{out}/eval_metrics.jsonl").readline())["protocol"]:
    print(f"protocol: as printed with the first evaluation above (and in {out}/eval/metrics.json)")
else:
    print("protocol:\n" + "\n".join(f"{item}: {text}" for item, text in evaluated["protocol"].items()))
print(f"\nVAE (ppdiffusers and PyTorch diffusers): {out}/vae   reconstructions: {out}/eval/reconstructions.png")
print(f"VisualDL: .venv/bin/visualdl --logdir {out}/logs   (then open http://localhost:8040)")
PY
