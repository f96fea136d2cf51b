"""benchmarks/training_step.py at its smallest setting, end to end (a fresh process, as users run it): the harness's
one place into the trainer (harness.build, Run.train_step) builds and steps the real components, and the figures are
real: the micro VAE's and the PatchGAN's parameters, positive times, a peak."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import training_step  # noqa: E402

VAE_MICRO, PATCHGAN = 43_711, 2_767_425  # configs/vae_micro.json's AutoencoderKL; the default PatchGAN (batch norm)


def test_our_step_of_the_micro_vae_reports_real_figures(tmp_path, capsys):
    output = tmp_path / "step.json"
    training_step.main(["--configs", "configs/vae_micro.json", "--resolution", "32", "--batch_size", "1",
                        "--threads", "1", "--steps", "1", "--warmup", "1", "--json", str(output)])
    [result] = json.loads(output.read_text())
    assert "error" not in result, result
    assert (result["vae_params"], result["disc_params"]) == (VAE_MICRO, PATCHGAN)
    assert len(result["our step"]["times_s"]) == 1 and result["our step"]["median_s"] > 0
    assert result["busy_threads"] == 1
    assert result["peak_rss_mib_end"] >= result["peak_rss_mib"] > 500  # Paddle, ppdiffusers and LPIPS's VGG16 loaded
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| vae_micro 32 px b1 1 thr"))
    assert "| 0.04 M / " in row and " / 2.77 M |" in row
