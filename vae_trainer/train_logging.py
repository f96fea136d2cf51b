"""Training telemetry of both drivers: VisualDL scalars and image grids (frame strips of clips), throughput, the
skipped-data summary. Micro-step scalars are summed on the device; a logging step reads them to the host at once.
Only rank 0 writes. Tags: docs/measuring.md; the skip counts and summary: docs/data.md."""

import functools
import logging
import resource
import sys
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import paddle
import paddle.distributed as dist
from visualdl import LogWriter

from . import watchdog
from .data.position import NOTES, OPAQUE, merge_file_skips
from .distributed import world_size
from .evaluation import make_grid
from .output_dir import note_log_file

logger = logging.getLogger("vae_trainer")

SUMMARY_FILES = 20  # files named in the end-of-run summary of skipped records, those with the most bad records

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("num_logged_images",), lambda f: not (f.visualdl and (f.image_logging_steps > 0 or f.evaluates)),
     "no image grid is logged (it needs VisualDL logs, --report_to visualdl, and --image_logging_steps > 0 or "
     "evaluation): drop it"),
    (("image_logging_steps",), lambda f: f.image_logging_steps > 0 and not f.visualdl,
     "images are logged to VisualDL only: drop it or --report_to none"),
    (("logging_dir",), lambda f: not f.visualdl,
     "it is the VisualDL log folder, and --report_to none writes none: drop one of them"),
)


def peak_memory_gb() -> float:
    """Peak memory of this process: device memory on GPU, resident set size on CPU."""
    if paddle.device.is_compiled_with_cuda() and "gpu" in paddle.get_device():
        return paddle.device.cuda.max_memory_allocated() / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb / 2**20 if sys.platform.startswith("linux") else kb / 2**30


class TrainMonitor:
    """A run's telemetry: scalars averaged over the logging window, throughput, skip counts, image grids."""

    def __init__(self, args, global_batch_size: int, is_main_process: bool):
        self.args, self.global_batch_size, self.is_main, self.writer = args, global_batch_size, is_main_process, None
        if is_main_process and {"visualdl", "all"} & set(args.report_to or []):
            self.writer = LogWriter(logdir=args.logging_dir)
            note_log_file(args.output_dir, self.writer.file_name)  # so --overwrite_output_dir deletes only ours
        self._sums, self._counts = {}, {}  # the window's device sums and counts, per name
        self._window_start, self._window_steps, self._data_seconds = time.perf_counter(), 0, 0.0
        self._frames = np.zeros(2)  # the window's samples and frames on this rank (clips [B, C, T, H, W]: B * T)
        self.data_position = None  # this rank's data.position.StreamPosition: its skip counts are logged
        self._skipped: Optional[tuple] = None  # all ranks' (skips per reason, per file, as of step)

    def timed(self, loader: Iterable) -> Iterator:
        """`loader`'s batches, each wait counted as data time (nothing else); `close()` ends the loader's workers."""
        batches = iter(loader)
        try:
            while True:
                start = time.perf_counter()
                watchdog.doing("waiting for data (the data reader)")  # what a stall report says (watchdog.py)
                batch = next(batches, None)
                self._data_seconds += time.perf_counter() - start
                watchdog.doing("in the training step (forward, backward, or the optimizer step's collectives)")
                if batch is None:
                    return
                shape = list(getattr(batch.get("pixel_values") if isinstance(batch, dict) else batch, "shape", [0]))
                self._frames += [shape[0], shape[0] * (shape[2] if len(shape) == 5 else 1)]
                yield batch
        finally:
            getattr(batches, "close", lambda: None)()

    def micro_step_end(self, logs: Dict[str, paddle.Tensor]) -> None:
        for name, value in logs.items():
            self._sums[name] = self._sums[name] + value if name in self._sums else value
            self._counts[name] = self._counts.get(name, 0) + 1

    def optimizer_step_end(self, step: int, report: Dict[str, object],
                           images: Optional[Callable[[], tuple]] = None) -> Optional[Dict[str, float]]:
        """Call after optimizer step `step` (1-based) with the step's report (TrainStep.optimizer_step) and
        a function giving (inputs, reconstructions) for the image grid. Returns the numbers at logging steps."""
        self._window_steps += 1
        if images is not None and self.writer is not None and self.args.image_logging_steps > 0 \
                and step % self.args.image_logging_steps == 0:
            self.log_grid(step, make_grid(*images(), self.args.num_logged_images), "reconstructions")
        if step % self.args.logging_steps != 0 and step != self.args.max_steps:
            return None
        averages = {name: total / self._counts[name] for name, total in self._sums.items()}
        on_device = {**averages, **{k: v for k, v in report.items() if isinstance(v, paddle.Tensor)}}
        scalars = {k: float(v) for k, v in report.items() if not isinstance(v, paddle.Tensor)}
        if on_device:  # the logging step's one device-to-host read
            values = paddle.stack([v.astype("float32").reshape([]) for v in on_device.values()]).numpy()
            scalars.update(zip(on_device, values.tolist()))
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        per_step, data = elapsed / self._window_steps, self._data_seconds / self._window_steps
        self._window_start, self._window_steps, self._data_seconds = time.perf_counter(), 0, 0.0
        scalars.update({"perf/images_per_second": self.global_batch_size / per_step, "perf/seconds_per_step": per_step,
                        "perf/data_seconds_per_step": data, "perf/compute_seconds_per_step": per_step - data,
                        "perf/peak_memory_gb": peak_memory_gb()})
        samples, frames = self._frames
        if frames > samples:  # clips came: images_per_second counts samples, scaled by this rank's frames per sample
            scalars["perf/frames_per_second"] = scalars["perf/images_per_second"] * frames / samples
        self._frames = np.zeros(2)
        if self.data_position is not None:  # data/skipped_<reason>, all ranks (a collective: every rank logs)
            self._skipped = (*self._skip_counts(), step)
            scalars.update({f"data/skipped_{reason}": float(count) for reason, count in self._skipped[0].items()
                            if reason not in NOTES})
            if self._skipped[0][OPAQUE]:  # (a 4-channel VAE's images without alpha, read as opaque)
                scalars["data/opaque_images"] = float(self._skipped[0][OPAQUE])
        self.log_scalars(step, scalars)
        self._sums, self._counts = {}, {}
        return scalars

    def _skip_counts(self) -> Tuple[Dict[str, int], Dict[str, List[int]]]:
        """(skips per reason, per file [skips, distinct bad records, *numbers]) summed over ranks: one small gather,
        a collective on several ranks."""
        mine = (self.data_position.skipped_totals(), self.data_position.skipped_by_file())
        gathered = [mine]
        if world_size() > 1:
            gathered = []
            dist.all_gather_object(gathered, mine)
        totals = {reason: sum(rank_totals[reason] for rank_totals, _ in gathered) for reason in mine[0]}
        return totals, functools.reduce(merge_file_skips, (files for _, files in gathered), {})

    def log_scalars(self, step: int, scalars: Dict[str, float]) -> None:
        """Numbers to VisualDL at `step` (training scalars, evaluation metrics, latent statistics)."""
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(tag=name, value=value, step=step)
            self.writer.flush()

    def log_grid(self, step: int, grid: np.ndarray, tag: str) -> None:
        """An image (uint8 HxWx3) to VisualDL."""
        if self.writer is not None:
            self.writer.add_image(tag=tag, img=np.asarray(grid), step=step)
            self.writer.flush()

    def close(self) -> None:
        """Close the writer; rank 0 prints the skips per reason and the files with the most bad records: at the end on
        one rank, else as of the last logging step (ranks may end at different moments: no collective here)."""
        if self.writer is not None:
            self.writer.close()
        if self.data_position is not None and world_size() == 1:
            self._skipped = (*self._skip_counts(), None)
        if not self.is_main or self._skipped is None:
            return
        totals, files, step = self._skipped
        when = "" if step is None else f" (as of step {step})"
        if totals[OPAQUE]:
            logger.info("data: %d training images had no alpha channel and were read as opaque (alpha 1)%s; see "
                        "data/opaque_images", totals[OPAQUE], when)
        skipped = {reason: count for reason, count in totals.items() if count and reason not in NOTES}
        if not skipped:
            logger.info("data: no training record was skipped%s", when)
            return
        worst = sorted(files.items(), key=lambda item: (-item[1][1], -item[1][0], item[0]))[:SUMMARY_FILES]
        shown = ""
        for path, (skips, bad, *numbers) in worst:  # distinct bad records, skips, path, first bad records (1-based)
            first = ", ".join(str(number + 1) for number in numbers) + (", ..." if bad > len(numbers) else "")
            shown += f"\n  {bad:>8}  {skips:>8}  {path}" + (f": {first}" if numbers else "")
        logger.warning("data: %d training records skipped (all ranks, resumed runs included)%s: %s; see the "
                       "data/skipped_* scalars. Files with skips: %d, the worst %d (bad records, skips: each read of "
                       "one counts, file: the first bad line or tar sample numbers):%s", sum(skipped.values()), when,
                       skipped, len(files), len(worst), shown)


def format_scalars(scalars: Dict[str, float]) -> str:
    """A compact console line: the losses first, then throughput."""
    keys = ["loss/total", "loss/pixel", "loss/perceptual", "loss/kl", "loss/generator", "loss/discriminator",
            "train/learning_rate", "perf/images_per_second"]
    return " ".join(f"{k.split('/')[-1]}={scalars[k]:.4g}" for k in keys if k in scalars)
