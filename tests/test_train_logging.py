"""Training telemetry: image grids are made only where they are written."""

import numpy as np
import paddle
import pytest

from vae_trainer.arguments import VAETrainingArguments
from vae_trainer.train_logging import TrainMonitor


@pytest.mark.parametrize("is_main_process", [True, False])
def test_only_the_writing_rank_asks_for_the_image_grid(tmp_path, is_main_process):
    """With EMA the grid costs a VAE forward with the EMA weights; ranks that write nothing must not pay it."""
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, logging_steps=100, image_logging_steps=2,
                                report_to=["visualdl"])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=is_main_process)
    asked = []

    def images():
        asked.append(1)
        return paddle.zeros([2, 3, 8, 8]), paddle.ones([2, 3, 8, 8])

    for step in range(1, 5):
        monitor.micro_step_end({"loss/total": paddle.ones([])})
        monitor.optimizer_step_end(step, {"train/learning_rate": 1e-4}, images)
    monitor.close()
    assert len(asked) == (2 if is_main_process else 0)  # steps 2 and 4 on the writing rank
    if is_main_process:
        from visualdl import LogReader

        files = [f for f in (tmp_path / "logs").iterdir() if f.name.startswith("vdlrecords")]
        records = LogReader(file_path=str(files[0])).get_data("image", "reconstructions")
        assert [r.id for r in records] == [2, 4]
        assert np.asarray(records[0].value).size > 0
