"""benchmarks/tiny_students.py at a tiny size: the SD VAE's decoder against its TAESD-shaped student, end to end
(one fresh process per network, as users run it): real counts, real shapes, positive times and peaks."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import tiny_students  # noqa: E402


def test_the_students_layout_follows_the_teachers_factor():
    f8, f32 = tiny_students.student_config(16, 8), tiny_students.student_config(32, 32)
    assert f8["num_decoder_blocks"] == [3, 3, 3, 1] and f8["num_encoder_blocks"] == [1, 3, 3, 3]
    assert f32["num_decoder_blocks"] == [3] * 5 + [1] and f32["decoder_block_out_channels"] == [64] * 6
    assert (f8["latent_channels"], f32["latent_channels"]) == (16, 32)


def test_sd_at_64_px_prints_positive_figures_and_a_far_smaller_student(tmp_path, capsys):
    output = tmp_path / "tiny.json"
    tiny_students.main(["--resolution", "64", "--families", "sd", "--runs", "1", "--json", str(output)])
    [[teacher, student]] = json.loads(output.read_text())
    assert "error" not in teacher and "error" not in student, (teacher, student)
    # The SD VAE's decoder side (post_quant_conv + decoder) and TAESD's decoder, counted by the script.
    assert teacher["decoder_parameters"] == 49_490_199 and student["decoder_parameters"] == 1_222_531
    assert teacher["encoder_parameters"] + teacher["decoder_parameters"] == 83_653_863
    assert teacher["latent_shape"] == [1, 4, 8, 8]
    assert teacher["image_shape"] == student["image_shape"] == [1, 3, 64, 64]  # the student upsamples by 8 too
    for result in (teacher, student):
        assert result["median_seconds"] > 0 and result["peak_rss_bytes"] >= result["built_rss_bytes"] > 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| SD |"))
    assert "49.49 M / 1.22 M | 40x" in row
