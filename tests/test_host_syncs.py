"""Device-to-host synchronisations: ONE per optimizer step when nothing is logged (README, "Host syncs").

On CPU nothing ever waits for a device, so the reads are counted instead of timed: every way a Paddle
tensor's value reaches Python (numpy, item, tolist, bool/float/int/index, __array__, format, cpu) and
explicit device synchronisations are patched to count (a read made inside another counts once).
"""

import threading
import traceback

import paddle
import pytest
from conftest import DRIVERS, tiny_args
from test_step import images, make_model, make_step

from vae_trainer.train_logging import TrainMonitor

HOST_READS = ("numpy", "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__array__", "__format__",
              "cpu")


class HostReads:
    """Counts host reads of tensor values, remembering where each came from."""

    def __init__(self, monkeypatch):
        self.calls = []
        self._local = threading.local()
        for name in HOST_READS:
            monkeypatch.setattr(paddle.Tensor, name, self._counting(name, getattr(paddle.Tensor, name)))
        for module in (paddle.device, paddle.device.cuda):
            monkeypatch.setattr(module, "synchronize", self._counting("synchronize", module.synchronize))

    def _counting(self, name, original):
        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                caller = traceback.extract_stack(limit=2)[0]
                self.calls.append(f"{name} at {caller.filename.split('/')[-1]}:{caller.lineno}")
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return counted

    def since(self, mark: int):
        return self.calls[mark:]


def test_the_step_reads_the_device_once_per_optimizer_step(tmp_path, monkeypatch):
    """GAN on, EMA, 2 micro-batches per optimizer step: the micro-steps read nothing; the optimizer step once."""
    from ppdiffusers.training_utils import EMAModel

    model = make_model()
    step = make_step(model, tmp_path, accumulation=2)
    step.ema = EMAModel(model.vae.parameters(), decay=0.9)
    batches = [images(seed=s) for s in range(6)]
    reads = HostReads(monkeypatch)
    for global_step in range(3):
        mark = len(reads.calls)
        for micro in range(2):
            step.forward_backward(batches[2 * global_step + micro], global_step, micro)
        assert reads.since(mark) == []
        step.optimizer_step(global_step)
        assert len(reads.since(mark)) == 1, reads.since(mark)


def test_the_monitor_reads_nothing_between_logging_steps_and_once_at_one(tmp_path, monkeypatch):
    from vae_trainer.arguments import VAETrainingArguments

    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, logging_steps=3, report_to=[])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)
    reads = HostReads(monkeypatch)
    for step in (1, 2, 3):
        mark = len(reads.calls)
        monitor.micro_step_end({"loss/total": paddle.full([], float(step)), "train/logvar": paddle.zeros([])})
        scalars = monitor.optimizer_step_end(step, {"train/learning_rate": 0.1, "train/grad_norm": paddle.full([], 2.0)})
        assert len(reads.since(mark)) == (1 if step == 3 else 0), reads.since(mark)
    assert scalars["loss/total"] == 2.0 and scalars["train/grad_norm"] == 2.0 and scalars["train/learning_rate"] == 0.1


@pytest.mark.parametrize("driver", DRIVERS)
def test_each_driver_reads_the_device_once_per_unlogged_step(photo_filelist, tmp_path, monkeypatch, driver):
    """The whole loop of each entry point, in this process: data, micro-steps with LPIPS and the GAN, the
    update, EMA, and the driver's own per-step work (the PaddleNLP Trainer's included). Counted between
    consecutive optimizer steps that neither log, save, evaluate nor log images."""
    import importlib

    entry_point = importlib.import_module(driver[: -len(".py")])
    marks = []
    original = TrainMonitor.optimizer_step_end

    def mark_each_step(self, step, *args, **kwargs):
        marks.append(len(reads.calls))
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(TrainMonitor, "optimizer_step_end", mark_each_step)
    reads = HostReads(monkeypatch)
    flags = tiny_args(photo_filelist, tmp_path / "out", max_steps=4, disc_start=1, logging_steps=100, save_steps=100,
                      image_logging_steps=0, gradient_accumulation_steps=2)
    entry_point.main([str(flag) for flag in flags])
    assert len(marks) == 4
    for before, after in zip(marks, marks[1:]):
        assert len(reads.calls[before:after]) == 1, reads.calls[before:after]
