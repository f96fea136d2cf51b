"""The NaN guard across ranks: when only one rank sees a bad value, both skip (or stop) together."""

import json
import math

from conftest import run_entry_point


def test_one_bad_rank_makes_every_rank_skip_or_stop_together(tmp_path):
    run_entry_point("tests/two_rank_guard_worker.py", [tmp_path], nproc=2, log_dir=tmp_path / "launch", timeout=400)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]

    # a. An infinite gradient on rank 1 only, finite losses on both: nobody updates, both count the skip.
    a = [r["inf_gradient"] for r in ranks]
    assert all(math.isfinite(result["loss"]) for result in a)
    assert [result["skipped_steps"] for result in a] == [1, 1]
    assert [result["unchanged"] for result in a] == [True, True]
    assert a[0]["fingerprint"] == a[1]["fingerprint"]

    # b. fp16, a NaN loss on rank 1 only: both ranks treat it as non-finite (not as an overflow) and stop.
    b = [r["nan_loss_fp16"] for r in ranks]
    assert [result["outcome"] for result in b] == ["stopped", "stopped"], b
    assert all("1 consecutive optimizer steps had non-finite" in result["message"] for result in b)
