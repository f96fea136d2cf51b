"""Both entry points end to end on real photos: same numbers, outputs, VisualDL, exact resume, 2 ranks."""

import os
import shutil

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, EVAL_FLAGS, read_scalars, run_entry_point, run_in_process, tiny_args, vae_weights

@pytest.fixture(scope="module")
def runs(photo_filelist, held_out_folder, tmp_path_factory):
    """One 4-step run per driver with identical flags, evaluating on held-out photos every 2 steps."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(driver.split(".")[0]))
        result = run_entry_point(driver, tiny_args(photo_filelist, output_dir, **EVAL_FLAGS(held_out_folder)))
        with open(os.path.join(output_dir, "console.txt"), "w") as console:
            console.write(result.stdout + result.stderr)
        out[driver] = output_dir
    return out


def test_both_drivers_give_the_same_losses_and_weights(runs):
    trainer, loop = runs[DRIVERS[0]], runs[DRIVERS[1]]
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/kl", "eval/psnr", "eval/lpips"):
        a, b = read_scalars(os.path.join(trainer, "logs"), tag), read_scalars(os.path.join(loop, "logs"), tag)
        assert sorted(a) == ([1, 2, 3, 4] if tag.startswith("loss") else [2, 4])
        np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(a)], rtol=1e-6)
    # The GAN is on from step 3 (global_step 2): its losses exist only there, identically.
    a = read_scalars(os.path.join(trainer, "logs"), "loss/discriminator")
    b = read_scalars(os.path.join(loop, "logs"), "loss/discriminator")
    assert sorted(a) == [3, 4] and a == pytest.approx(b, rel=1e-6)
    for folder in ("vae", "vae_raw"):  # EMA and raw weights
        wa, wb = vae_weights(trainer, folder), vae_weights(loop, folder)
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


@pytest.mark.parametrize("driver", DRIVERS)
def test_outputs_and_visualdl(runs, driver):
    output_dir = runs[driver]
    from ppdiffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(os.path.join(output_dir, "vae"))
    assert vae.config.latent_channels == 4
    assert os.path.isfile(os.path.join(output_dir, "discriminator", "model_state.pdparams"))
    assert {"checkpoint-2", "checkpoint-4", "discriminator", "logs", "vae", "vae_raw"} <= set(os.listdir(output_dir))
    assert os.path.isfile(os.path.join(output_dir, "checkpoint-2", "ema.pdparams"))
    ema, raw = vae_weights(output_dir), vae_weights(output_dir, "vae_raw")
    assert any(not np.array_equal(ema[k], raw[k]) for k in ema)  # --use_ema exports the average
    logdir = os.path.join(output_dir, "logs")
    for tag in ("loss/total", "loss/generator", "loss/discriminator", "gan/adaptive_weight", "gan/logits_real",
                "gan/logits_fake", "train/learning_rate", "perf/images_per_second"):
        assert read_scalars(logdir, tag), tag
    from visualdl import LogReader

    reader = LogReader(file_path=os.path.join(logdir, [f for f in os.listdir(logdir) if f.startswith("vdl")][0]))
    images = reader.get_data("image", "reconstructions")
    assert [r.id for r in images] == [2, 4]
    assert [r.id for r in reader.get_data("image", "eval/reconstructions")] == [2, 4]
    for tag in ("eval/psnr", "eval/ssim", "eval/lpips", "eval/latent_mean_0", "eval/latent_std_3"):
        assert sorted(read_scalars(logdir, tag)) == [2, 4], tag


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_run_states_its_evaluation_protocol_once(runs, driver):
    """With the first evaluation's line (eval_metrics.jsonl holds it for every evaluation)."""
    from vae_trainer.evaluation import EvalProtocol
    from vae_trainer.objectives.equivariance import DIAGNOSTICS

    console = open(os.path.join(runs[driver], "console.txt")).read()
    protocol = EvalProtocol(resolution=32, metrics=("psnr", "ssim", "lpips", *DIAGNOSTICS)).text()  # no rFID weights
    assert "eval at step 2 on 6 images" in console and "eval at step 4 on 6 images" in console
    assert console.count(protocol) == 1
    after_first = console.split("eval at step 2 on 6 images", 1)[1]
    assert after_first.index(protocol) < after_first.index("eval at step 4")


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_evaluation_is_recorded_in_eval_metrics_jsonl(runs, driver):
    """One line per evaluation, with the numbers logged to VisualDL and the protocol, to choose a checkpoint."""
    import json

    from vae_trainer.evaluation import EvalProtocol
    from vae_trainer.objectives.equivariance import DIAGNOSTICS

    output_dir = runs[driver]
    with open(os.path.join(output_dir, "eval_metrics.jsonl")) as handle:
        lines = [json.loads(line) for line in handle]
    assert [line["step"] for line in lines] == [2, 4] and {line["weights"] for line in lines} == {"ema"}
    logdir = os.path.join(output_dir, "logs")
    for name in ("psnr", "ssim", "lpips", *DIAGNOSTICS):
        logged = read_scalars(logdir, f"eval/{name}")
        assert [line["metrics"][name] for line in lines] == pytest.approx([logged[2], logged[4]], rel=1e-6), name
    assert lines[0]["protocol"] == EvalProtocol(resolution=32, metrics=("psnr", "ssim", "lpips", *DIAGNOSTICS)).describe()
    assert lines[0]["metric_for_best_model"] == "psnr" and lines[0]["is_best"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_best_checkpoint_and_measured_latent_scale_from_scratch(runs, held_out_folder, driver):
    """From scratch the scale is measured: the exported factor is 1/std of the posterior samples of the exported
    (EMA) weights on the eval set, taken from the final evaluation (no extra pass, issue 12.2)."""
    import json

    from ppdiffusers import AutoencoderKL

    from vae_trainer.data.dataset import build_eval_dataloader

    output_dir = runs[driver]
    psnr = read_scalars(os.path.join(output_dir, "logs"), "eval/psnr")
    state = json.load(open(os.path.join(output_dir, "checkpoint-4", "trainer_state.json")))
    best_step = max(psnr, key=psnr.get)
    assert state["best_metric"] == pytest.approx(psnr[best_step], rel=1e-6)
    assert state["best_model_checkpoint"].endswith(f"checkpoint-{best_step}")
    vae = AutoencoderKL.from_pretrained(os.path.join(output_dir, "vae"))
    means, variances = [], []
    for batch in build_eval_dataloader(held_out_folder, 32, 8, 0, 1, 6):
        posterior = vae.encode(batch["pixel_values"]).latent_dist
        means.append(posterior.mean.numpy().astype(np.float64))
        variances.append(posterior.var.numpy().astype(np.float64))
    means, variances = np.concatenate(means), np.concatenate(variances)
    assert vae.config.scaling_factor == pytest.approx(1 / np.sqrt(means.var() + variances.mean()), rel=1e-5)
    stats = json.load(open(os.path.join(output_dir, "vae", "latent_stats.json")))
    assert stats["source"] == "measured on the evaluation at step 4" and stats["measured"]["num_images"] == 6
    logged = read_scalars(os.path.join(output_dir, "logs"), "eval/suggested_scaling_factor")[4]
    assert vae.config.scaling_factor == pytest.approx(logged, rel=1e-6)


@pytest.mark.parametrize("driver", DRIVERS)
def test_resume_continues_exactly(runs, photo_filelist, held_out_folder, tmp_path, driver):
    """checkpoint-2 of a 4-step run, resumed, reproduces steps 3-4 and the final weights bit for bit."""
    straight = runs[driver]
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(straight, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    run_in_process(driver, tiny_args(photo_filelist, resumed, resume_from_checkpoint="latest",
                                     **EVAL_FLAGS(held_out_folder)))
    for tag in ("loss/total", "loss/discriminator"):
        a = read_scalars(os.path.join(straight, "logs"), tag)
        b = read_scalars(os.path.join(resumed, "logs"), tag)
        assert sorted(b) == [3, 4]
        assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)], tag
    for folder in ("vae", "vae_raw"):  # the EMA is restored exactly too
        wa, wb = vae_weights(straight, folder), vae_weights(resumed, folder)
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_other_entry_points_checkpoint_resumes_exactly_and_rolling_back_is_a_branch(
        runs, photo_filelist, held_out_folder, tmp_path, driver):
    """Issue 17.3, the issue's scenario on the OTHER entry point's 4-step run (saved every 2, evaluated at 2 and
    4): roll back to checkpoint-2 with a 10x lower --learning_rate and train to step 3. Step 3 is this entry
    point's uninterrupted step 3 (the loss comes before the update), at the lower rate; checkpoint-4 and the
    step-4 evaluation of the abandoned branch go to OUT/abandoned/ before the first save, so `latest` is the new
    branch's checkpoint-3 and --save_total_limit 1 does not count checkpoint-4."""
    import json

    from vae_trainer import checkpoint as ckpt

    other = runs[DRIVERS[1 - DRIVERS.index(driver)]]
    resumed = tmp_path / "resumed"
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(os.path.join(other, name), resumed / name)
    shutil.copy(os.path.join(other, ckpt.EVAL_METRICS_NAME), resumed / ckpt.EVAL_METRICS_NAME)
    result = run_entry_point(driver, tiny_args(photo_filelist, resumed, resume_from_checkpoint=resumed / "checkpoint-2",
                                               learning_rate=1e-4, max_steps=3, save_total_limit=1,
                                               **EVAL_FLAGS(held_out_folder)))
    for tag in ("loss/total", "loss/discriminator"):
        a, b = read_scalars(os.path.join(runs[driver], "logs"), tag), read_scalars(str(resumed / "logs"), tag)
        assert sorted(b) == [3] and a[3] == b[3], tag
    a, b = (read_scalars(os.path.join(folder, "logs"), "train/learning_rate") for folder in (runs[driver], resumed))
    assert b[3] == pytest.approx(a[3] / 10)
    branches = os.listdir(resumed / "abandoned")
    assert len(branches) == 1 and branches[0].endswith("-after-checkpoint-2")
    abandoned = resumed / "abandoned" / branches[0]
    assert os.path.isfile(abandoned / "checkpoint-4" / "model_state.pdparams")
    assert "checkpoint-4" in result.stderr.split("not the newest checkpoint", 1)[1].splitlines()[0]
    assert [step for step, _ in ckpt.list_checkpoints(str(resumed))] == [3]
    assert ckpt.resolve_resume(str(resumed), "latest") == str(resumed / "checkpoint-3")

    def eval_steps(path):
        return [json.loads(line)["step"] for line in open(path)]

    assert eval_steps(resumed / ckpt.EVAL_METRICS_NAME) == [2, 3]  # the new branch's history
    assert eval_steps(abandoned / ckpt.EVAL_METRICS_NAME) == [4]


@pytest.mark.parametrize("driver", DRIVERS)
def test_resuming_from_the_final_checkpoint_trains_no_step_and_exports(runs, photo_filelist, held_out_folder, tmp_path,
                                                                        driver):
    """Issue 17.3: --max_steps equal to the checkpoint's step: no extra step is trained (the PaddleNLP Trainer's
    own loop would train one), no loss is logged, the checkpoint is left as it is (not deleted and saved again),
    and the run still exits cleanly with the export of the checkpoint's weights."""
    driver_run = runs[driver]
    resumed = tmp_path / "resumed"
    shutil.copytree(os.path.join(driver_run, "checkpoint-4"), resumed / "checkpoint-4")

    def files(folder):
        return {name: (os.stat(folder / name).st_ino, os.stat(folder / name).st_mtime_ns)
                for name in sorted(os.listdir(folder))}

    before = (os.stat(resumed / "checkpoint-4").st_ino, files(resumed / "checkpoint-4"))
    run_in_process(driver, tiny_args(photo_filelist, resumed, resume_from_checkpoint="latest",
                                     **EVAL_FLAGS(held_out_folder)))
    assert (os.stat(resumed / "checkpoint-4").st_ino, files(resumed / "checkpoint-4")) == before  # not rewritten
    assert [name for name in os.listdir(resumed) if name.startswith("checkpoint")] == ["checkpoint-4"]
    assert read_scalars(str(resumed / "logs"), "loss/total") == {}  # no step trained (no step 5), none logged
    straight, again = vae_weights(driver_run, "vae_raw"), vae_weights(str(resumed), "vae_raw")
    for name in straight:
        np.testing.assert_array_equal(straight[name], again[name], err_msg=name)


# The two-process runs below train without LPIPS (--perceptual_weight 0): its VGG16 is most of a tiny step's time on
# CPU, and it has no trainable weight, random stream or state to keep in sync or to resume (runs with it on two ranks:
# test_alignment, test_dc_ae, test_wan, test_rae).
@pytest.mark.parametrize("driver", DRIVERS)
def test_two_processes_stay_in_sync_and_read_different_data(photo_filelist, tmp_path, driver):
    output_dir = tmp_path / "out"
    run_entry_point(driver, tiny_args(photo_filelist, output_dir, max_steps=3, save_steps=3, image_logging_steps=0,
                                      perceptual_weight=0), nproc=2, log_dir=tmp_path / "launch")
    checkpoint = output_dir / "checkpoint-3"
    states = [paddle.load(str(checkpoint / f"rank_state_{r}.pdparams")) for r in (0, 1)]
    np.testing.assert_array_equal(states[0]["parameter_fingerprint"], states[1]["parameter_fingerprint"])
    # ... and they cover every trainable parameter (two empty fingerprints would agree too).
    from vae_trainer.argument_parser import parse_arguments
    from vae_trainer.build import build_networks
    from vae_trainer.distributed import FINGERPRINT_SIZE

    flags = tiny_args(photo_filelist, tmp_path / "unused", perceptual_weight=0)
    model_args, _, loss_args, args = parse_arguments([str(flag) for flag in flags])
    trainable = [p for p in build_networks(model_args, loss_args, args).model.parameters() if not p.stop_gradient]
    assert states[0]["parameter_fingerprint"].size == FINGERPRINT_SIZE * len(trainable) > 0
    # The GAN ran (disc_start 2), so the discriminator was trained too and is included in the fingerprint.
    assert read_scalars(str(output_dir / "logs"), "loss/discriminator")
    shards = [set(s["data"]["positions"]) for s in states]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    # Rank 1's own random streams differ from rank 0's (posterior noise, augmentation).
    assert not np.array_equal(states[0]["rng"]["numpy"][1], states[1]["rng"]["numpy"][1])


@pytest.mark.parametrize("driver", DRIVERS)
def test_nonfinite_run_stops_with_a_checkpoint_of_the_last_good_step(photo_filelist, tmp_path, driver):
    """A learning rate far too high makes every step non-finite after the first: the run stops cleanly."""
    output_dir = tmp_path / "out"
    with pytest.raises(AssertionError) as failure:
        run_entry_point(driver, tiny_args(photo_filelist, output_dir, learning_rate=1e30, max_steps=20,
                                          save_steps=100, max_consecutive_nonfinite_steps=2, disc_start=100))
    message = str(failure.value)
    assert "2 consecutive optimizer steps had non-finite" in message and "Last good weights" in message
    checkpoints = sorted(p for p in os.listdir(output_dir) if p.startswith("checkpoint-"))
    assert len(checkpoints) == 1
    state = paddle.load(str(output_dir / checkpoints[0] / "model_state.pdparams"))
    assert all(np.isfinite(v.numpy()).all() for v in state.values())


TWO_RANK_RESUME = dict(gradient_accumulation_steps=2, dataloader_num_workers=1, image_logging_steps=0,
                       perceptual_weight=0)


@pytest.fixture(scope="module")
def two_rank_straight(photo_filelist, tmp_path_factory):
    """A 4-step run on 2 ranks x (2 micro-batches, 1 loader worker), by the plain loop, saved at steps 2 and 4."""
    root = tmp_path_factory.mktemp("two_rank_straight")
    run_entry_point(DRIVERS[1], tiny_args(photo_filelist, root / "straight", **TWO_RANK_RESUME), nproc=2,
                    log_dir=root / "logs")
    return root / "straight"


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_process_resume_with_accumulation_and_workers_is_exact(two_rank_straight, photo_filelist, tmp_path,
                                                                   driver):
    """2 ranks x (2 micro-batches, 1 loader worker): 4 steps straight == 2 steps + resume + 2 steps, each entry point
    resuming the plain loop's checkpoint-2 (both entry points train to the same numbers and read each other's
    checkpoints: test_both_drivers_give_the_same_losses_and_weights, test_the_other_entry_points_checkpoint...)."""
    straight, resumed = two_rank_straight, tmp_path / "resumed"
    os.makedirs(resumed)
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    run_entry_point(driver, tiny_args(photo_filelist, resumed, resume_from_checkpoint="latest", **TWO_RANK_RESUME),
                    nproc=2, log_dir=tmp_path / "l2")
    a, b = read_scalars(str(straight / "logs"), "loss/total"), read_scalars(str(resumed / "logs"), "loss/total")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]
    for r in (0, 1):
        fa = paddle.load(str(straight / "checkpoint-4" / f"rank_state_{r}.pdparams"))["parameter_fingerprint"]
        fb = paddle.load(str(resumed / "checkpoint-4" / f"rank_state_{r}.pdparams"))["parameter_fingerprint"]
        assert np.array_equal(fa, fb)


@pytest.mark.parametrize("ema, folder", [(False, "vae_raw"), (True, "vae")])
def test_export_vae_script_exports_a_from_scratch_checkpoint_as_the_run_did(runs, tmp_path, ema, folder):
    """`scripts/export_vae.py CHECKPOINT_DIR OUT_DIR` as the issue writes it: a from-scratch run's factor is
    measured on the images the run measured on (export_config.json), so the last checkpoint exports with the
    factor the run wrote for the same weights (vae_raw: raw weights, vae: EMA weights). The default (EMA) export
    runs as that command, from another directory; --no_ema through the script's main()."""
    import json
    import subprocess
    import sys

    from conftest import REPO, load_script
    from ppdiffusers import AutoencoderKL

    run = runs[DRIVERS[0]]
    argv = [os.path.join(run, "checkpoint-4"), str(tmp_path / "out")] + ([] if ema else ["--no_ema"])
    if ema:
        completed = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "export_vae.py"), *argv],
                                   cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr[-3000:]
    else:
        load_script("export_vae").main(argv)
    exported = AutoencoderKL.load_config(str(tmp_path / "out"))["scaling_factor"]
    assert exported == pytest.approx(AutoencoderKL.load_config(os.path.join(run, folder))["scaling_factor"], rel=1e-5)
    stats = json.load(open(tmp_path / "out" / "latent_stats.json"))
    assert stats["source"].startswith("measured on an encoder-only pass over 6 images of ")
