"""Run one command N times under `python -m paddle.distributed.launch` and count the runs that did not exit 0.

    python benchmarks/stress_launch.py --runs 100 --nproc 2 -- train_vae_no_trainer.py \
        --file_list data/filelist/demo.filelist.list --vae_config_file configs/vae_micro.json \
        --output_dir {work}/out --resolution 32 --max_steps 4 --device cpu ...

A finished multi-process run must exit 0 every time: a scheduler reads a non-zero exit as a failed job
(requeue, alert) and CI as a failed submission. Each run gets its own folder (`{work}` in the command's
arguments is replaced by it) holding the launcher's log folder; a failed run's folder is kept and the
others are removed. For each failure the table says which rank ended how: "exit N" or "signal NAME", read
from the launcher's "Container rank R status failed ... code C" lines (code -N = killed by signal N).

Prints one line per failed run as it happens, then a summary, and a final `N passed, N failed` line.
The exit status is 0 when every run exited 0, else 1.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# paddle 3.3.1, distributed/launch/controllers/controller.py: "Container rank 0 status failed"
# followed, in the container's description, by "code -6" (the Popen return code).
_FAILED_RANK = re.compile(r"Container rank (\d+) status failed")
_CODE = re.compile(r"\bcode:? (-?\d+)")


def describe_code(code: int) -> str:
    """'exit 3', or 'signal SIGABRT' for a negative Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def failed_ranks(launcher_output: str) -> Dict[int, str]:
    """{rank: 'signal SIGABRT' | 'exit 1' | 'unknown'} from the launcher's console output."""
    ranks: Dict[int, str] = {}
    lines = launcher_output.splitlines()
    for i, line in enumerate(lines):
        match = _FAILED_RANK.search(line)
        if not match:
            continue
        code = None
        for j, following in enumerate(lines[i:i + 12]):  # the description follows, until the next rank's line
            if j > 0 and _FAILED_RANK.search(following):
                break
            found = _CODE.search(following)
            if found:
                code = int(found.group(1))
                break
        ranks[int(match.group(1))] = describe_code(code) if code is not None else "unknown"
    return ranks


def run_once(python: str, nproc: int, command: List[str], work: str, timeout: float) -> dict:
    log_dir = os.path.join(work, "launch_logs")
    args = [a.replace("{work}", work) for a in command]
    launcher = [python, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", log_dir]
    start = time.monotonic()
    # Its own session: a hung run is ended with its workers, which would otherwise load the next runs.
    process = subprocess.Popen(launcher + args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        returncode = None
        output = _end_session(process)
    with open(os.path.join(work, "launcher_output.txt"), "w") as handle:
        handle.write(output)
    return {"returncode": returncode, "seconds": time.monotonic() - start, "ranks": failed_ranks(output)}


def _end_session(process: subprocess.Popen) -> str:
    """SIGTERM to the launcher and its workers, SIGKILL after 30 s; what they printed."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return process.communicate(timeout=wait)[0] or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="how many launches")
    parser.add_argument("--nproc", type=int, default=2, help="processes per launch (--nproc_per_node)")
    parser.add_argument("--work_dir", default=None, help="where each run's folder goes (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run counts as hung")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]; {work} = this run's folder")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- train_vae_no_trainer.py --output_dir {work}/out ...")
    root = args.work_dir or tempfile.mkdtemp(prefix="stress_launch_")
    os.makedirs(root, exist_ok=True)
    print(f"{args.runs} runs of: paddle.distributed.launch --nproc_per_node {args.nproc} {' '.join(command)}\n"
          f"run folders under {root} (failed runs are kept)", flush=True)

    outcomes = collections.Counter()
    seconds = []
    failed = 0
    for index in range(args.runs):
        work = os.path.join(root, f"run_{index:04d}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        result = run_once(args.python, args.nproc, command, work, args.timeout)
        seconds.append(result["seconds"])
        if result["returncode"] == 0:
            shutil.rmtree(work, ignore_errors=True)
            continue
        failed += 1
        how = "hung (timeout)" if result["returncode"] is None else f"launcher exit {result['returncode']}"
        ranks = ", ".join(f"rank {r}: {what}" for r, what in sorted(result["ranks"].items())) or "no rank named"
        for r, what in result["ranks"].items():
            outcomes[f"rank {r}: {what}"] += 1
        if not result["ranks"]:
            outcomes[how] += 1
        print(f"run {index}: {how}; {ranks}; logs in {work}", flush=True)

    seconds.sort()
    print(f"\n{args.runs} runs, {failed} non-zero exits ({100.0 * failed / max(args.runs, 1):.1f}%); "
          f"median {seconds[len(seconds) // 2]:.1f} s per run")
    for outcome, count in outcomes.most_common():
        print(f"  {count:4d} x {outcome}")
    print(f"{args.runs - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
