"""Run by test_step_two_ranks.py under `paddle.distributed.launch --nproc_per_node 2` (CPU, gloo).

The NaN guard when only rank 1 is bad; each rank writes what happened to OUT_DIR/rank_R.json.
  a. float32: finite losses everywhere, an infinite gradient on rank 1 only;
  b. fp16 (scalers forced on, as in test_loss_scaling.py): a NaN loss on rank 1 only, with
     --max_consecutive_nonfinite_steps 1. Rank 0's own losses and (all-reduced) gradients would call
     this an fp16 overflow; only the rank-global check makes rank 0 stop with rank 1.
"""

import json
import os
import sys

import paddle
import paddle.distributed as dist
from conftest import enabled_scaler, pretend_fp16_autocast
from test_step import full_step, images, make_model, make_step, poison_gradient, unchanged, weights

from vae_trainer.distributed import parameter_fingerprint
from vae_trainer.step import NonFiniteError


def inf_gradient_on_rank_1(out_dir: str, rank: int) -> dict:
    model = make_model()
    step = make_step(model, out_dir)
    if rank == 1:
        poison_gradient(model.vae.encoder.conv_in.weight)
    before = weights(model)
    logs = step.forward_backward(images(seed=rank), 0, 0)
    report = step.optimizer_step(global_step=0)[0]
    return {"loss": logs["loss/total"].item(), "skipped_steps": report["train/skipped_steps"],
            "unchanged": unchanged(model, before), "fingerprint": parameter_fingerprint(model).tolist()}


def nan_loss_on_rank_1_under_fp16(out_dir: str, rank: int) -> dict:
    pretend_fp16_autocast()
    model = make_model()
    step = make_step(model, out_dir, scalers=(enabled_scaler(8.0), enabled_scaler(8.0)), max_nonfinite=1)
    batch = images(seed=rank)
    if rank == 1:
        batch[0, 0, 0, 0] = float("nan")
    try:
        full_step(step, batch, global_step=0)
        return {"outcome": "continued", "overflow_steps": step.guard.overflow_steps}
    except NonFiniteError as error:
        return {"outcome": "stopped", "message": str(error)}


def main(out_dir: str) -> None:
    paddle.set_device("cpu")
    dist.init_parallel_env()
    rank = dist.get_rank()
    results = {"inf_gradient": inf_gradient_on_rank_1(out_dir, rank),
               "nan_loss_fp16": nan_loss_on_rank_1_under_fp16(out_dir, rank)}
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    from vae_trainer.distributed import run_and_exit

    run_and_exit(lambda: main(sys.argv[1]))  # ends as the entry points do (no SIGABRT at exit)
