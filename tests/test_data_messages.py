"""Data messages that say what is wrong and what to do: a shard with no record names the numbers (records,
parts, processes x workers); a filelist's `.counts` warnings concern training, never the evaluation list."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from PIL import Image

from vae_trainer.data.dataset import ImageStream, build_eval_dataloader


def png(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 40, 3), value, np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def part_file(path, num_lines: int):
    import base64

    path.write_text("".join(f"c\t-\t{base64.b64encode(png(i)).decode()}\n" for i in range(num_lines)))
    return path


def first_sample_error(source: str, rank: int, world_size: int) -> str:
    stream = ImageStream(source, 32, rank=rank, world_size=world_size)
    with pytest.raises(RuntimeError) as failed:
        next(iter(stream))
    return str(failed.value)


def test_a_folder_with_fewer_images_than_shards_says_the_numbers_and_what_to_do(tmp_path):
    (tmp_path / "one.png").write_bytes(png(1))
    message = first_sample_error(str(tmp_path), rank=0, world_size=2)  # shard 1 gets the image, shard 0 nothing
    assert "shard 0 of 2 (rank 0)" in message
    assert ("the data holds 1 records in 1 part(s), fewer than the 2 shards (2 process(es) x 1 DataLoader worker(s) "
            "each") in message
    assert "Use fewer --dataloader_num_workers or processes, or more images." in message


def test_a_part_file_with_fewer_lines_than_shards_says_so_too(tmp_path):
    part_file(tmp_path / "part-0.txt", 1)
    (tmp_path / "x.filelist").write_text("part-0.txt\n")  # no .counts: the lines per part are not known
    message = first_sample_error(str(tmp_path / "x.filelist"), rank=1, world_size=2)
    assert ("the data's 1 part(s) hold too few records for the 2 shards (2 process(es) x 1 DataLoader worker(s) each"
            in message)
    assert "--dataloader_num_workers" in message


def test_a_shard_whose_records_are_all_bad_keeps_the_skip_message(tmp_path):
    (tmp_path / "part-0.txt").write_text("c\t-\tnot base64!\n" * 3)
    (tmp_path / "x.filelist").write_text("part-0.txt\n")
    message = first_sample_error(str(tmp_path / "x.filelist"), rank=0, world_size=1)
    assert "got no usable sample" in message and "skipped so far" in message and "DataLoader worker" not in message


def test_counts_warnings_are_for_training_not_for_the_evaluation_list(tmp_path, caplog):
    for index in range(2):
        part_file(tmp_path / f"part-{index}.txt", 3)
    (tmp_path / "held_out.filelist").write_text("part-0.txt\npart-1.txt\n")  # no .counts file
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        batches = list(build_eval_dataloader(str(tmp_path / "held_out.filelist"), 32, 2, 0, 1, 6))
    assert sum(batch["pixel_values"].shape[0] for batch in batches) == 6
    assert ".counts" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        ImageStream(str(tmp_path / "held_out.filelist"), 32)  # the same list for training: the warning is due
    assert "no .counts file" in caplog.text
