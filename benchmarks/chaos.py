"""Fault injection: N randomized faults on 2-process CPU runs under paddle.distributed.launch, each followed by the
same command with `--resume_from_checkpoint latest`; a table of hangs, lost steps and exact resumes.

    python benchmarks/chaos.py --num_faults 40 --seed 0 --output_dir /tmp/chaos

Each fault takes the next (kind, entry point, --dataloader_num_workers) of a shuffled cycle over all of them, at
a random moment drawn from --seed: a step S in 0..max_steps, then a delay of up to one step (S = 0: up to the
start-up time; S = max_steps: during the final save and export), as timed on the uninterrupted run:

  launcher_term / _int / _usr1  that signal to the launcher
  tree_term     SIGTERM to every process of the tree: launcher, ranks, their data-loader workers (as scancel)
  rank_signal   SIGTERM, SIGINT or SIGUSR1 to one rank's main process
  rank_kill     SIGKILL of one rank (the run fails; resuming the last periodic save must still be exact)
  disk_full     OUTPUT_DIR on a tmpfs with room for 1.. checkpoints; enlarged before the resume (root only)
  stall         a `pipe:` tar shard whose command prints part of the tar, then sleeps (--stall_timeout 20);
                the stall runs on tar shards made from the demo data, with their own uninterrupted reference

A run that does not end within --hang_seconds (default 90 s + 3x the uninterrupted run) is killed and counted
as a hang. "lost" = the last step logged (VisualDL, every step) minus the last checkpoint, after the fault.
"equal" = the final checkpoint's model_state.pdparams is bit-equal to that of an uninterrupted run with the
same flags and processes (run once per entry point, workers and data; cached in OUTPUT_DIR/reference with the
commit and command). A fault's folder is removed when its resume is equal, kept otherwise.
Exit status 0 when there was no hang and every resume was equal, else 1.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import gzip
import hashlib
import io
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import harness
from harness import REPO_ROOT, descendants, send

DRIVERS = ("train_vae_trainer.py", "train_vae_no_trainer.py")
LAUNCHER_SIGNALS = {"launcher_term": signal.SIGTERM, "launcher_int": signal.SIGINT, "launcher_usr1": signal.SIGUSR1}
KINDS = (*LAUNCHER_SIGNALS, "tree_term", "rank_signal", "rank_kill", "disk_full", "stall")
# The launcher's exit code a fault is expected to give (paddle 3.3.1: the signal number when it is signalled, the
# failed rank's code otherwise; -N: killed by signal N). A resume is repeated while it exits 75 or one of these.
EXPECTED = {"launcher_term": {15}, "launcher_int": {2}, "launcher_usr1": {-10}, "tree_term": {15, 75},
            "rank_signal": {75}, "rank_kill": {1, -9, 137, 247}, "disk_full": {1}, "stall": {124}}
PREEMPTED, MAX_RESUMES = 75, 3
SHARD_SCRIPT = """#!/bin/sh
# cat a tar shard; the first command to take the file $CHAOS_STALL_TRIGGER prints that many bytes of it and hangs
t="${CHAOS_STALL_TRIGGER:-}"
if [ -n "$t" ] && mv "$t" "$t.taken" 2>/dev/null; then head -c "$(cat "$t.taken")" "$1"; exec sleep 600; fi
exec cat "$1"
"""


# ------------------------------------------------------------------------------------------ runs and results
def rank_pid(launcher: int, rank: int):
    """The launcher's child with PADDLE_TRAINER_ID == rank (a rank's main process), or None."""
    for pid in harness.children().get(launcher, []):
        try:
            if f"PADDLE_TRAINER_ID={rank}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                return pid
        except OSError:
            pass
    return None


def pipe_data(root: str) -> str:
    """50 WebDataset tar shards of 4 demo images each, read through `pipe:sh shard.sh SHARD`: the stall's data."""
    folder = os.path.join(root, "pipe_data")
    listing = os.path.join(folder, "pipe.filelist")
    if os.path.isfile(listing):
        return listing
    os.makedirs(folder, exist_ok=True)
    images = []
    for part in ("part-00000.gz", "part-00001.gz"):
        with gzip.open(os.path.join(REPO_ROOT, "data", "demo", "train", part), "rt") as handle:
            images += [base64.b64decode(line.rstrip("\n").split("\t")[-1]) for line in handle if line.strip()]
    script = os.path.join(folder, "shard.sh")
    open(script, "w").write(SHARD_SCRIPT)
    lines = []
    for shard in range(len(images) // 4):
        path = os.path.join(folder, f"shard-{shard:03d}.tar")
        with tarfile.open(path, "w") as tar:
            for k in range(4):
                info = tarfile.TarInfo(f"{shard * 4 + k:05d}.jpg")
                info.size = len(images[shard * 4 + k])
                tar.addfile(info, io.BytesIO(images[shard * 4 + k]))
        lines.append(f"pipe:sh {script} {path}\n")
    open(listing + ".part", "w").writelines(lines)
    os.replace(listing + ".part", listing)
    return listing


def command(args, driver, workers, data, out, logs, launch_logs, resume=False) -> list:
    flags = {"file_list": "data/filelist/demo.filelist.list", "vae_config_file": "configs/vae_micro.json",
             "output_dir": out, "logging_dir": logs, "resolution": 32, "per_device_train_batch_size": 2,
             "max_steps": args.max_steps, "disc_start": 2, "logging_steps": 1, "save_steps": args.save_steps,
             "image_logging_steps": 0, "seed": 7, "device": "cpu", "dataloader_num_workers": workers,
             "disc_base_channels": 8, "learning_rate": 1e-3, "disable_tqdm": "true", "use_ema": "false"}
    if data != "demo":  # the stall's tar shards, a small shuffle buffer (so shards open during the run)
        flags.update(file_list=data, shuffle_buffer_size=4, stall_timeout=20)
    if resume:
        flags["resume_from_checkpoint"] = "latest"
    return [args.python, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.nproc), "--log_dir",
            launch_logs, os.path.join(REPO_ROOT, driver), *harness.argv(flags)]


def checkpoints(out: str) -> list:
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted(int(m.group(1)) for m in map(re.compile(r"checkpoint-(\d+)$").match, names)
                  if m and os.path.isfile(os.path.join(out, m.group(0), "trainer_state.json")))


def step_times(logs: str) -> dict:
    """{step: wall time} of the steps rank 0 logged to VisualDL (--logging_steps 1; the writer flushes each step)."""
    return {step: record.timestamp / 1000 for step, record in harness.scalars(logs, "perf/seconds_per_step").items()}


def same_weights(a: str, b: str) -> bool:
    if not (os.path.isfile(a) and os.path.isfile(b)):
        return False
    if open(a, "rb").read() == open(b, "rb").read():
        return True
    import numpy as np
    import paddle

    x, y = paddle.load(a, return_numpy=True), paddle.load(b, return_numpy=True)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def what_ranks_said(launch_logs: str, nproc: int) -> str:
    notes = []
    for r in range(nproc):
        try:
            text = open(os.path.join(launch_logs, f"workerlog.{r}"), errors="replace").read()
        except OSError:
            continue
        saved = re.findall(r"stopped by (SIG\w+|a signal to another rank) after step (\d+): saved", text)
        found = [f"saved {saved[-1][1]} ({saved[-1][0].replace('a signal to another rank', 'peer')})"] if saved else []
        found += ["DataLoader worker killed"] * ("DataLoader process" in text and "killed by signal" in text)
        found += ["stall reported"] * ("stalled: rank" in text)
        found += [re.sub(r"/\S*/", "", e)[:90] for e in re.findall(r"^error: (.*)$", text, re.M)[:1]]  # paths cut
        notes.append(f"r{r}: {', '.join(found) or '-'}")
    return "; ".join(notes) or "no rank started"


def code_version() -> str:
    """The commit and a hash of the uncommitted changes: an uninterrupted run is redone when either changes."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True).stdout  # noqa: E731
    return git("rev-parse", "HEAD").strip() + "+" + hashlib.sha1(git("diff", "HEAD").encode()).hexdigest()[:12]


def reference(args, driver, workers, data, env, cache: dict) -> dict:
    """The uninterrupted run of (driver, workers, data): its final weights, time and checkpoint size (cached)."""
    name = f"{driver[:-3]}-w{workers}-{'demo' if data == 'demo' else 'pipe'}"
    if name in cache:
        return cache[name]
    folder = os.path.join(args.output_dir, "reference", name)
    out, logs, launch = (os.path.join(folder, x) for x in ("out", "logs", "launch_logs"))
    cmd, meta = command(args, driver, workers, data, out, logs, launch), os.path.join(folder, "reference.json")
    key = {"code": code_version(), "command": cmd}
    done = json.load(open(meta)) if os.path.isfile(meta) else {}
    if done.get("key") != key:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        result = harness.launch(cmd, env, os.path.join(folder, "launcher.txt"), bound=3600)
        if result["code"] != 0 or not checkpoints(out) or checkpoints(out)[-1] != args.max_steps:
            sys.exit(f"error: the uninterrupted run {name} failed (exit {result['code']}); see {folder}")
        final = os.path.join(out, f"checkpoint-{args.max_steps}")
        times = step_times(logs)
        done = {"key": key, "seconds": result["seconds"], "first_step": times[1] - result["wall"],
                "step_seconds": (times[args.max_steps] - times[1]) / max(args.max_steps - 1, 1),
                "weights": os.path.join(final, "model_state.pdparams"),
                "checkpoint_bytes": sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))}
        json.dump(done, open(meta, "w"), indent=1)
        print(f"uninterrupted {name}: {done['seconds']:.1f} s", flush=True)
    cache[name] = done
    return done


def one_fault(args, index, fault, env, cache) -> dict:
    kind, driver, workers = fault["kind"], fault["driver"], fault["workers"]
    data = pipe_data(args.output_dir) if kind == "stall" else "demo"
    ref = reference(args, driver, workers, data, env, cache)
    work = os.path.join(args.output_dir, "faults", f"{index:03d}-{kind}-{driver[:-3]}-w{workers}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out, logs = os.path.join(work, "disk" if kind == "disk_full" else "", "out"), os.path.join(work, "logs")
    bound = args.hang_seconds or 90 + 3 * ref["seconds"]
    trigger = os.path.join(work, "stall_trigger")
    env = {**env, "CHAOS_STALL_TRIGGER": trigger} if kind == "stall" else env
    # The moment: `delay` after rank 0 logged step `step` (read from its VisualDL file), or after the launch (step 0).
    delay = fault["delay"] * (ref["step_seconds"] if fault["step"] else ref["first_step"])
    detail = f"at step {fault['step']} + {delay:.1f} s"
    seen = {}

    def due(elapsed: float) -> bool:
        if fault["step"] == 0:
            return elapsed >= delay
        if "at" not in seen:
            size = sum(os.path.getsize(os.path.join(logs, n)) for n in os.listdir(logs)) if os.path.isdir(logs) else 0
            if size != seen.get("size"):  # parse only when rank 0 wrote something
                seen["size"] = size
                if max(step_times(logs), default=0) >= fault["step"]:
                    seen["at"] = elapsed + delay
        return elapsed >= seen.get("at", float("inf"))
    sig = LAUNCHER_SIGNALS.get(kind) or (fault["signal"] if kind == "rank_signal" else signal.SIGKILL)
    if kind == "disk_full":
        size_k = int((fault["keep"] + 0.5) * ref["checkpoint_bytes"] / 1024) + 64
        os.makedirs(os.path.join(work, "disk"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", os.path.join(work, "disk")],
                       check=True)
        detail = f"tmpfs {size_k} kB"
    elif kind.startswith("rank_"):
        detail += f", {sig.name} to rank {fault['rank']}"
    elif kind == "stall":
        detail += f", {fault['bytes']} bytes then sleep"

    def fire(launcher: int) -> bool:
        if kind in LAUNCHER_SIGNALS:
            send([launcher], sig)
        elif kind == "tree_term":
            send([launcher] + descendants(launcher), signal.SIGTERM)
        elif kind.startswith("rank_"):
            pid = rank_pid(launcher, fault["rank"])
            if pid is None:
                return False  # not started yet
            send([pid], sig)
        elif kind == "stall":
            open(trigger + ".new", "w").write(str(fault["bytes"]))
            os.replace(trigger + ".new", trigger)
        return True

    try:
        first = harness.launch(command(args, driver, workers, data, out, logs, os.path.join(work, "launch_0")), env,
                               os.path.join(work, "launcher_0.txt"), bound, fire=None if kind == "disk_full" else fire,
                               due=due)
        saved = (checkpoints(out) or [0])[-1]
        lost = max(0, max(step_times(logs), default=0) - saved)
        if kind == "stall":
            missed = not os.path.exists(trigger + ".taken")  # no shard opened after the trigger
        else:
            missed = kind != "disk_full" and first["fired"] is None  # the run ended first
        said = what_ranks_said(os.path.join(work, "launch_0"), args.nproc)
        if kind == "disk_full":
            subprocess.run(["mount", "-o", "remount,size=256m", os.path.join(work, "disk")], check=True)
        if os.path.exists(trigger):
            os.remove(trigger)  # not taken: the resume must not stall
        runs = [first]
        while len(runs) == 1 or len(runs) <= MAX_RESUMES and runs[-1]["code"] in EXPECTED[kind] | {PREEMPTED}:
            k = len(runs)
            resume = command(args, driver, workers, data, out, logs, os.path.join(work, f"launch_{k}"), True)
            runs.append(harness.launch(resume, env, os.path.join(work, f"launcher_{k}.txt"), bound))
        final = os.path.join(out, f"checkpoint-{args.max_steps}", "model_state.pdparams")
        equal = runs[-1]["code"] == 0 and same_weights(final, ref["weights"])
    finally:
        if kind == "disk_full":
            subprocess.run(["umount", "-l", os.path.join(work, "disk")], capture_output=True)
    result = {**fault, "detail": detail, "codes": [r["code"] for r in runs], "hung": any(r["hung"] for r in runs),
              "lost": lost, "saved": saved, "missed": missed, "equal": equal, "said": said,
              "leftovers": sum(r["leftovers"] for r in runs), "seconds": sum(r["seconds"] for r in runs)}
    if equal and not result["hung"] and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    notes = [f"exits {result['codes']}", f"last save {saved}", f"lost {lost}"] + ["MISSED"] * missed + \
        ["HUNG"] * result["hung"] + [f"{result['leftovers']} leftover processes killed"] * bool(result["leftovers"])
    print(f"fault {index}: {kind} {driver} workers={workers} {detail}: {', '.join(notes)}; "
          f"{'equal' if equal else 'DIFFERS (kept: ' + work + ')'}; {said}; {result['seconds']:.0f} s", flush=True)
    return result


def table(results) -> str:
    """One row per fault kind and a total: faults, missed, hangs, lost steps (sum, max), resumes equal."""
    rows = []
    groups = {k: [r for r in results if r["kind"] == k] for k in dict.fromkeys(r["kind"] for r in results)}
    for name, group in [*groups.items(), ("all", results)]:
        lost = [r["lost"] for r in group]
        rows.append((name, len(group), sum(r["missed"] for r in group), sum(r["hung"] for r in group),
                     f"{sum(lost)} / {max(lost, default=0)}", f"{sum(r['equal'] for r in group)}/{len(group)}"))
    return harness.markdown(("kind", "faults", "missed", "hangs", "lost steps (sum / max)", "resumes equal"), rows)


def plan(args, kinds) -> list:
    """The faults: a shuffled cycle over (kind, driver, workers), each with its random moment and details."""
    rng = random.Random(args.seed)
    combos = list(itertools.product(kinds, args.drivers, args.workers))
    rng.shuffle(combos)
    saves = args.max_steps // args.save_steps
    return [{"kind": k, "driver": d, "workers": w, "step": rng.randint(0, args.max_steps), "delay": rng.random(),
             "rank": rng.randrange(args.nproc), "signal": rng.choice([signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]),
             "keep": rng.randint(1, max(1, saves - 1)), "bytes": rng.randrange(512, 20000)}
            for k, d, w in itertools.islice(itertools.cycle(combos), args.num_faults)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_faults", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0, help="draws the order of the faults and their moments")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="default: all")
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 2], help="--dataloader_num_workers values")
    parser.add_argument("--drivers", nargs="+", choices=DRIVERS, default=list(DRIVERS), help="entry points")
    parser.add_argument("--output_dir", default="/tmp/chaos", help="scratch (uninterrupted runs are cached here)")
    parser.add_argument("--max_steps", type=int, default=24)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2, help="processes per launch (--nproc_per_node)")
    parser.add_argument("--hang_seconds", type=float, default=0, help="0: 90 s + 3x the uninterrupted run")
    parser.add_argument("--keep", action="store_true", help="keep every fault's folder (default: only unequal ones)")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    kinds = list(dict.fromkeys(args.kinds))
    if "disk_full" in kinds and os.geteuid() != 0:
        print("note: disk_full skipped: mounting a tmpfs needs root", flush=True)
        kinds.remove("disk_full")
    if not kinds:
        parser.error("no fault kind left to run")
    # Orphans (the ranks of a launcher killed by SIGUSR1, a hung pipe: command) become our children, to wait for.
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    args.output_dir = os.path.abspath(args.output_dir)
    os.makedirs(args.output_dir, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "USE_TORCH": os.environ.get("USE_TORCH", "0")}
    start, cache = time.monotonic(), {}
    print(f"{args.num_faults} faults ({', '.join(kinds)}), {args.nproc} processes, max_steps {args.max_steps}, "
          f"save_steps {args.save_steps}, seed {args.seed}; folders under {args.output_dir}", flush=True)
    results = [one_fault(args, i, fault, env, cache) for i, fault in enumerate(plan(args, kinds))]
    per_fault = sorted(r["seconds"] for r in results)[len(results) // 2] if results else 0
    print(f"\n{table(results)}\n\nmachine: {harness.machine_description()}\ntotal {time.monotonic() - start:.0f} s "
          f"(uninterrupted runs included); median {per_fault:.0f} s per fault (its run and resumes)")
    return 0 if results and not any(r["hung"] or not r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
