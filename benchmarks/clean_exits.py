"""Does a finished multi-process run exit 0 every time? One command run N times under `python -m
paddle.distributed.launch`, counting the launches that did not exit 0.

    python benchmarks/clean_exits.py --runs 100 --nproc 2 -- train_vae_no_trainer.py \
        --file_list data/filelist/demo.filelist.list --vae_config_file configs/vae_micro.json \
        --output_dir {work}/out --resolution 32 --max_steps 4 --device cpu ...

A scheduler reads a non-zero exit as a failed job (requeue, alert) and CI as a failed submission. Each run gets its
own folder (`{work}` in the command's arguments is replaced by it) holding the launcher's log folder and output; a
failed run's folder is kept and the others are removed. For each failure the table says which rank ended how:
"exit N" or "signal NAME", read from the launcher's "Container rank R status failed ... code C" lines (code -N =
killed by signal N). A run past --timeout counts as hung and is killed with its workers (which would otherwise load
the next runs).

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
import sys
import tempfile
from typing import Dict, List, Optional

import harness

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


def main(argv: Optional[List[str]] = None) -> int:
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
    root = args.work_dir or tempfile.mkdtemp(prefix="clean_exits_")
    os.makedirs(root, exist_ok=True)
    print(f"{args.runs} runs of: paddle.distributed.launch --nproc_per_node {args.nproc} {' '.join(command)}\n"
          f"run folders under {root} (failed runs are kept)", flush=True)
    outcomes, seconds, failed = collections.Counter(), [], 0
    for index in range(args.runs):
        work = os.path.join(root, f"run_{index:04d}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        output = os.path.join(work, "launcher_output.txt")
        launcher = [args.python, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.nproc), "--log_dir",
                    os.path.join(work, "launch_logs")]
        run = harness.launch(launcher + [word.replace("{work}", work) for word in command], None, output, args.timeout)
        seconds.append(run["seconds"])
        if run["code"] == 0 and not run["hung"]:
            shutil.rmtree(work, ignore_errors=True)
            continue
        failed += 1
        how = "hung (timeout)" if run["hung"] else f"launcher exit {run['code']}"
        with open(output) as handle:
            ranks = failed_ranks(handle.read())
        for rank, what in ranks.items():
            outcomes[f"rank {rank}: {what}"] += 1
        if not ranks:
            outcomes[how] += 1
        named = ", ".join(f"rank {r}: {what}" for r, what in sorted(ranks.items())) or "no rank named"
        print(f"run {index}: {how}; {named}; logs in {work}", flush=True)
    seconds.sort()
    print(f"\n{args.runs} runs, {failed} non-zero exits ({100.0 * failed / max(args.runs, 1):.1f}%); "
          f"median {seconds[len(seconds) // 2]:.1f} s per run")
    for outcome, count in outcomes.most_common():
        print(f"  {count:4d} x {outcome}")
    print(f"{args.runs - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
