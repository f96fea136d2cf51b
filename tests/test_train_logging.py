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


def test_data_seconds_count_only_the_wait_for_batches(tmp_path, monkeypatch):
    """Issue 17.7: the time from one micro-step's end to the next one's start counted as data time, so the optimizer
    step, logging, evaluation and saves in between showed up in perf/data_seconds_per_step. A fake clock: exact
    numbers, whatever the machine's load."""
    from types import SimpleNamespace

    from vae_trainer import train_logging

    now = [100.0]
    monkeypatch.setattr(train_logging, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=2, report_to=[])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)

    def slow_loader():
        while True:
            now[0] += 0.125  # waiting for the batch
            yield {}

    batches = monitor.timed(slow_loader())  # as both drivers iterate their batches
    iteration = iter(batches)
    for step in (1, 2):
        next(iteration)
        monitor.micro_step_end({"loss/total": paddle.ones([])})
        now[0] += 0.25  # the optimizer step, evaluation, a save: not waiting for data
        scalars = monitor.optimizer_step_end(step, {})
    batches.close()
    monitor.close()
    assert scalars["perf/data_seconds_per_step"] == 0.125
    assert scalars["perf/seconds_per_step"] == 0.375 and scalars["perf/compute_seconds_per_step"] == 0.25
    assert scalars["perf/images_per_second"] == 2 / 0.375
    with pytest.raises(StopIteration):  # closed: the loader's iteration has ended
        next(iteration)


def test_the_skip_summary_is_complete_at_the_end_and_names_the_worst_files(tmp_path, caplog):
    """Issue 17.7: the summary was as of the last logging step and named no file; the console names only each
    file's first few problems, so a part that broke after that could not be found. Issue 38.1: it gave each file's
    skips (a bad line read twice counted twice); it gives its distinct bad records and their first numbers."""
    import logging
    from collections import Counter

    from vae_trainer.data.position import StreamPosition, encode_position, note_bad

    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, logging_steps=2, report_to=[])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)
    position = StreamPosition(0, 1, 0, 1000)
    position.files = [f"/data/part-{i:05d}.gz" for i in range(30)]
    monitor.data_position = position
    skips, bad = Counter(), {}
    for index in range(25):  # part i: i // 2 bad lines (0-based numbers 0, 3, 6, ...), met at every step
        for number in range(0, 3 * (index // 2), 3):
            note_bad(bad, index, number)
    for step in (1, 2, 3):  # the run ends after step 3 (a non-finite stop, a signal): not a logging step
        for index in range(25):
            skips[index] += index
            skips["not_image"] += index
        position.update(encode_position(0, 0, 8 * step, skips, [], bad))
        monitor.micro_step_end({"loss/total": paddle.ones([])})
        monitor.optimizer_step_end(step, {})
    with caplog.at_level(logging.INFO, logger="vae_trainer"):
        monitor.close()
    assert "data: 900 training records skipped" in caplog.text and "{'not_image': 900}" in caplog.text
    assert "Files with skips: 24, the worst 20 (bad records, skips: each read of one counts, file: the first bad " \
           "line or tar sample numbers):" in caplog.text
    assert "      12        72  /data/part-00024.gz: 1, 4, 7, 10, 13, 16, 19, 22, ..." in caplog.text
    assert "       2        15  /data/part-00005.gz: 1, 4\n" in caplog.text
    assert "part-00004.gz" not in caplog.text  # 2 bad lines too, fewer skips

    # Checkpoints keep the per-file counts by path, so a resumed run goes on counting for the right files.
    state = position.state_dict()
    assert state["skipped_files"]["0"]["/data/part-00024.gz"] == 72
    assert state["bad_records"]["0"]["/data/part-00024.gz"] == [12, 0, 3, 6, 9, 12, 15, 18, 21]
    restored = StreamPosition.from_state(state)
    restored.files = list(reversed(position.files))  # another order of the same parts
    assert restored.start_of(0)[3][5] == 72 and restored.skipped_by_file() == position.skipped_by_file()
    assert restored.start_of(0)[4][5] == [12, 0, 3, 6, 9, 12, 15, 18, 21]
    # A checkpoint of an earlier version (no bad records) still resumes: its files' bad lines count from then on.
    old = StreamPosition.from_state({name: value for name, value in state.items() if name != "bad_records"})
    old.files = position.files
    assert old.start_of(0)[4] == {} and old.skipped_by_file()["/data/part-00024.gz"] == [72, 0]


def test_the_skip_summary_of_several_ranks_adds_every_ranks_files(tmp_path, monkeypatch):
    """Issue 38.1: the ranks' shards read different records, so their distinct bad records add up per file and the
    first numbers merge; a file only one rank met is named too."""
    from collections import Counter

    from vae_trainer import train_logging
    from vae_trainer.data.position import StreamPosition, encode_position

    positions = []
    for rank, skips, bad in ((0, Counter({0: 3}), {0: [2, 1, 5]}), (1, Counter({0: 2, 1: 1}), {0: [1, 2], 1: [1, 0]})):
        positions.append(StreamPosition(0, 2, 0, 1000))
        positions[-1].files = ["/data/a.gz", "/data/b.gz"]
        positions[-1].update(encode_position(rank, 0, 4, skips + Counter(not_image=sum(skips.values())), [], bad))
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, report_to=[])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)
    monitor.data_position = positions[0]
    monkeypatch.setattr(train_logging, "world_size", lambda: 2)
    monkeypatch.setattr(train_logging.dist, "all_gather_object", lambda gathered, mine: gathered.extend(
        [mine, (positions[1].skipped_totals(), positions[1].skipped_by_file())]))
    totals, files = monitor._skip_counts()
    assert totals["not_image"] == 6 and files == {"/data/a.gz": [5, 3, 1, 2, 5], "/data/b.gz": [1, 1, 0]}
