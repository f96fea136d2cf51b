"""benchmarks/chaos.py (issue 29.7), without running anything: its flags, its plan of faults and its table."""

import os
import signal
import sys

import pytest

from conftest import DRIVERS, REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import chaos  # noqa: E402


def test_help_parses(capsys):
    with pytest.raises(SystemExit) as done:
        chaos.main(["--help"])
    assert done.value.code == 0 and "--num_faults" in capsys.readouterr().out


def args(**overrides):
    values = dict(seed=3, num_faults=40, drivers=list(DRIVERS), workers=[0, 2], max_steps=24, save_steps=4, nproc=2)
    return type("Args", (), {**values, **overrides})


def test_the_plan_covers_every_kind_driver_and_workers_and_depends_only_on_the_seed():
    plan = chaos.plan(args(), list(chaos.KINDS))
    assert len(plan) == 40 and plan == chaos.plan(args(), list(chaos.KINDS))
    assert plan != chaos.plan(args(seed=4), list(chaos.KINDS))
    combos = {(f["kind"], f["driver"], f["workers"]) for f in plan}
    assert len(combos) == len(chaos.KINDS) * 2 * 2  # 32 combinations: each at least once in 40 faults
    assert all(0 <= f["step"] <= 24 and 1 <= f["keep"] <= 5 and f["rank"] in (0, 1) for f in plan)
    assert {f["signal"] for f in plan} == {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}


def test_the_table_counts_hangs_lost_steps_and_equal_resumes_per_kind():
    results = [dict(kind="tree_term", missed=False, hung=False, lost=3, equal=True),
               dict(kind="tree_term", missed=True, hung=False, lost=0, equal=True),
               dict(kind="rank_kill", missed=False, hung=True, lost=2, equal=False)]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in chaos.table(results).splitlines()]
    assert rows[0][0] == "kind" and rows[2:] == [["tree_term", "2", "1", "0", "3 / 3", "2/2"],
                                                 ["rank_kill", "1", "0", "1", "2 / 2", "0/1"],
                                                 ["all", "3", "1", "1", "5 / 3", "2/3"]]
