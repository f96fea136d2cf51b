"""What the benchmarks share; each other file of benchmarks/ answers one question (docs/benchmarks.md, and its
module docstring, say which). Here, once: building the trainer's real components (`build`, `Run`), timing calls
interleaved (`interleaved`), running a setting in a fresh process and reading its peak RSS (`in_fresh_process`,
`serve_worker`, `launch`), thread settings (`thread_env`, `busy_threads`), the photos the readers and runs read
(`photo_files`, `laion_parts`), and the report (`header`, `markdown`).

The one place: `build` and `Run` are the only code of benchmarks/ that calls vae_trainer's builders (build.py), its
training step (step.py) or the model container (VAEWithDiscriminator). That API is being redesigned; the redesign
should have this file only to change.

Why a fresh process per setting: Paddle 3.3.1 sets OMP_NUM_THREADS=1 when it is imported unless it is already set,
and its dygraph CPU kernels take their threads from OpenMP; FLAGS_paddle_num_threads (environment variable or
paddle.set_flags) adds no compute thread in dygraph. So a thread count is fixed per process, in its environment
before Paddle loads (both variables are set; a worker reports how many of its threads did work). And peak RSS
(`ru_maxrss`) is a high-water mark of a whole process: one setting's peak must not be another's.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEVER = 10**9  # a step interval that is never reached: no logging, image logging or saving
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # vae_trainer, as the entry points import it


# ---------------------------------------------------------------- the report
def machine_description() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    except OSError:
        names = []
    cpu = names[0] if names else platform.processor() or platform.machine()
    return f"{os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}"


def load() -> str:
    """The load averages over 1, 5 and 15 minutes (one busy process reads as about 1-2 on these VMs)."""
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def header(script: str, argv: Optional[Sequence[str]]) -> None:
    """The lines a result is quoted with: the command as run, the date, the machine and its load."""
    words = sys.argv[1:] if argv is None else argv
    print(f"$ python benchmarks/{os.path.basename(script)} {' '.join(map(shlex.quote, words))}".rstrip())
    print(f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine_description()}; "
          f"load average before: {load()}", flush=True)


def markdown(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def failed(result: Dict) -> str:
    """The table cell of a setting whose process failed: the end of its error."""
    return "failed: " + " ".join(result["error"])[-120:]


def save_json(path: Optional[str], results: Any) -> None:
    """--json: the raw results (every timed call included)."""
    if path:
        with open(path, "w") as handle:
            json.dump(results, handle, indent=1)


def argv(flags: Dict[str, Any]) -> List[str]:
    """{"max_steps": 4} -> ["--max_steps", "4"]: an entry point's command line."""
    return [word for name, value in flags.items() for word in (f"--{name}", str(value))]


def scalars(logdir: str, tag: str) -> Dict[int, Any]:
    """{step: record (.value, .timestamp in ms)} of a VisualDL scalar over a run's record files; a file cut short by a
    kill, or one without the tag, gives what it holds."""
    from visualdl import LogReader

    records = {}
    for name in sorted(os.listdir(logdir)) if os.path.isdir(logdir) else ():
        if name.startswith("vdlrecords"):
            try:
                reader = LogReader(file_path=os.path.join(logdir, name))
                records.update({record.id: record for record in reader.get_data("scalar", tag)})
            except Exception:  # (VisualDL raises several kinds on a truncated record or a missing tag)
                pass
    return records


# ---------------------------------------------------------------- data
def photo_files() -> List[str]:
    """The real photographs shipped in installed packages (scikit-image, scikit-learn, matplotlib)."""
    import matplotlib
    import skimage.data
    import sklearn.datasets

    candidates = [os.path.join(os.path.dirname(skimage.data.__file__), name) for name in
                  ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")]
    candidates += [os.path.join(os.path.dirname(sklearn.datasets.__file__), "images", name)
                   for name in ("china.jpg", "flower.jpg")]
    candidates.append(os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg"))
    return [path for path in candidates if os.path.isfile(path)]


def laion_parts(folder: str, images: int, shorter_side=(400, 1000), lines_per_part: int = 100,
                seed: int = 0) -> tuple:
    """LAION-style gzip parts (`caption<TAB>-<TAB>base64(JPEG)`) of random crops (60-100% of each side) of
    `photo_files`, rescaled so the shorter side is in `shorter_side` px, JPEG quality 90, and their .filelist;
    returns (the filelist, the mean JPEG KiB)."""
    import base64
    import gzip
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = [Image.open(path).convert("RGB") for path in photo_files()]
    lines, sizes = [], []
    for index in range(images):
        photo = photos[index % len(photos)]
        width, height = photo.size
        crop_w, crop_h = int(width * rng.uniform(0.6, 1.0)), int(height * rng.uniform(0.6, 1.0))
        left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
        image = photo.crop((left, top, left + crop_w, top + crop_h))
        scale = rng.uniform(*shorter_side) / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        sizes.append(len(buffer.getvalue()))
        lines.append(b"photo %d\t-\t" % index + base64.b64encode(buffer.getvalue()) + b"\n")
    names = [f"part-{start // lines_per_part:05d}.gz" for start in range(0, images, lines_per_part)]
    for name, start in zip(names, range(0, images, lines_per_part)):
        with open(os.path.join(folder, name), "wb") as handle:
            handle.write(gzip.compress(b"".join(lines[start:start + lines_per_part]), compresslevel=6))
    with open(os.path.join(folder, "bench.filelist"), "w") as handle:
        handle.writelines(name + "\n" for name in names)
    return os.path.join(folder, "bench.filelist"), float(np.mean(sizes)) / 1024


# ---------------------------------------------------------------- processes, threads, memory
def thread_env(threads: int, without_torch: bool = False) -> Dict[str, str]:
    """This environment with `threads` OpenMP threads (0: unset, each program's default) and the repository
    importable. `without_torch`: ppdiffusers does not import PyTorch (USE_TORCH=0 unless the caller's environment
    says otherwise), as those benchmarks' figures were taken; the others run as the environment says."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FLAGS_paddle_num_threads")}
    if threads > 0:
        env.update(OMP_NUM_THREADS=str(threads), FLAGS_paddle_num_threads=str(threads))
    env["PYTHONPATH"] = REPO_ROOT
    if without_torch:
        env["USE_TORCH"] = os.environ.get("USE_TORCH", "0")
    return env


def in_fresh_process(script: str, setting: Dict, threads: int, without_torch: bool = False,
                     label: Optional[str] = None) -> Dict:
    """`python SCRIPT --worker SETTING --worker_output FILE` (the script's `serve_worker`) with `threads` threads: the
    setting, what the worker measured, the process's wall and CPU seconds (its workers' included) and the load after
    it; or the setting and the last lines of its stderr as "error". `label`: progress on stderr."""
    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    with tempfile.TemporaryDirectory() as tmp:
        output, cpu, started = os.path.join(tmp, "result.json"), children_cpu(), time.perf_counter()
        process = subprocess.run([sys.executable, os.path.abspath(script), "--worker", json.dumps(setting),
                                  "--worker_output", output], env=thread_env(threads, without_torch), cwd=REPO_ROOT,
                                 capture_output=True, text=True)
        result = {"setting": setting, "wall_seconds": time.perf_counter() - started,
                  "cpu_seconds": children_cpu() - cpu, "load_after": load()}
        if process.returncode != 0 or not os.path.isfile(output):
            result["error"] = process.stderr.strip().splitlines()[-3:] or [f"exit {process.returncode}"]
        else:
            with open(output) as handle:
                result.update(json.load(handle))
    if label:
        done = failed(result) if "error" in result else f"done in {result['wall_seconds']:.0f} s"
        print(f"  {label}: {done} (load after {result['load_after']})", file=sys.stderr, flush=True)
    return result


def serve_worker(args: Optional[Sequence[str]], measure: Callable[[Dict], Dict]) -> bool:
    """In a process `in_fresh_process` started: write what `measure(setting)` returns, and say True."""
    args = sys.argv[1:] if args is None else list(args)
    if args[:1] != ["--worker"]:
        return False
    result = measure(json.loads(args[1]))
    with open(args[3], "w") as handle:
        json.dump(result, handle)
    return True


def peak_rss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    """The peak resident set of this process (or, RUSAGE_CHILDREN, of its largest finished child) so far."""
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


def busy_threads(min_share: float = 0.1) -> Optional[int]:
    """Threads of this process that used at least `min_share` of the busiest one's CPU time (Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    cpu_ticks = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        cpu_ticks.append(int(fields[11]) + int(fields[12]))  # utime + stime
    return sum(ticks >= min_share * max(cpu_ticks) for ticks in cpu_ticks)


def parameter_count(parameters) -> int:
    """Of a layer's parameters, or of a list of them."""
    return sum(int(p.size) for p in (parameters.parameters() if hasattr(parameters, "parameters") else parameters))


# ---------------------------------------------------------------- timing
def interleaved(calls: Dict[str, Callable[[], Any]], repeats: int, warmup: int = 0) -> Dict[str, Dict[str, Any]]:
    """Time `repeats` calls of each variant, taking turns call by call, so that load from other processes, which
    changes during a run, hits them alike. Before, `warmup` untimed calls of each, variant by variant, the first
    variant first: its `rss_after_warmup_bytes` is then its own peak. Per variant: the wall and CPU seconds of every
    call (CPU: all threads of this process), their medians, and `ratio_to_first`, the median over the turns of its
    time over the first variant's (steadier than a ratio of medians when the load drifts)."""
    results = {}
    for name, call in calls.items():
        warm = []
        for _ in range(warmup):
            started = time.perf_counter()
            call()
            warm.append(time.perf_counter() - started)
        results[name] = {"warmup_s": warm, "rss_after_warmup_bytes": peak_rss_bytes(), "times_s": [], "cpu_s": []}
    for _ in range(repeats):
        for name, call in calls.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            call()
            results[name]["cpu_s"].append(time.process_time() - cpu_started)
            results[name]["times_s"].append(time.perf_counter() - started)
    first = results[next(iter(calls))]["times_s"]
    for result in results.values():
        result.update(median_s=statistics.median(result["times_s"]), cpu_median_s=statistics.median(result["cpu_s"]),
                      ratio_to_first=statistics.median(b / a for a, b in zip(first, result["times_s"])))
    return results


# ---------------------------------------------------------------- the trainer's components: the ONE place
def build(flags: Dict[str, Any]) -> "Run":
    """A run with these entry-point flags (beside a stand-in file list, CPU, no reports), built as the entry points
    build it: parse_arguments, init_process, build_networks (the resolution checked), build_optimization,
    seed_training."""
    from vae_trainer.argument_parser import parse_arguments
    from vae_trainer.build import build_networks, build_optimization, init_process, seed_training

    scratch = tempfile.TemporaryDirectory()
    flags = {"file_list": "unused", "output_dir": scratch.name, "device": "cpu", "report_to": "none",
             "disable_tqdm": "true", **flags}
    model_args, data_args, loss_args, training_args = parse_arguments(argv(flags))
    init_process(training_args)
    networks = build_networks(model_args, loss_args, training_args, data_args.resolution)
    step = build_optimization(networks, loss_args, training_args)
    seed_training(training_args.seed)
    return Run(networks, step, loss_args, scratch)


class Run:
    """A built run's networks and training step, and what the benchmarks do with them."""

    def __init__(self, networks, step, loss_args, scratch):
        self.model, self.step, self.loss_args, self.scratch = networks.model, step, loss_args, scratch
        self.vae, self.discriminator, self.lpips = networks.model.vae, networks.model.discriminator, networks.lpips

    def train_step(self, pixel_values, global_step: int) -> float:
        """Our optimizer step on one micro-batch, as vae_trainer.loop runs it (TrainStep.forward_backward, then
        TrainStep.optimizer_step and TrainStep.schedule); returns the seconds of the update alone (sync, norms,
        finite check, clipping, both optimizers, EMA, schedules)."""
        self.step.forward_backward(pixel_values, global_step, 0)
        started = time.perf_counter()
        self.step.optimizer_step(global_step)
        self.step.schedule(global_step)
        return time.perf_counter() - started

    @contextlib.contextmanager
    def losses(self, **values):
        """The step with these loss arguments for the calls inside (e.g. perceptual_weight=0.0: without LPIPS)."""
        saved = {name: getattr(self.loss_args, name) for name in values}
        for name, value in values.items():
            setattr(self.loss_args, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self.loss_args, name, value)


# ---------------------------------------------------------------- multi-process launches (clean_exits.py, chaos.py)
def children(zombies: bool = False) -> Dict[int, List[int]]:
    """{ppid: [pid, ...]} of every process (zombies only if asked), from /proc."""
    tree: Dict[int, List[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if zombies or fields[0] != "Z":
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> List[int]:
    tree, found, todo = children(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def send(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _runs(pid: int, script: str) -> bool:
    """A launcher, rank or data-loader worker of `script` (not a pipe: command some process left behind)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            command = handle.read().decode(errors="replace")
    except OSError:
        return False
    return "paddle.distributed.launch" in command or os.path.basename(script) in command


def _reap_orphans(keep: int) -> None:
    """Collect the exited orphans a child subreaper (chaos.py) inherits from the launcher; `keep` is Popen's to wait."""
    for pid in children(zombies=True).get(os.getpid(), []):
        if pid != keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def launch(command: List[str], env, log_path: str, bound: float, fire=None, due=None) -> Dict[str, Any]:
    """A `python -m paddle.distributed.launch ... SCRIPT ARGS` command, in its own session, until it and every rank it
    started (orphans included) ended; its output to `log_path`. `fire(launcher pid)` is called once `due(seconds
    elapsed)` is true, until it returns True. After `bound` seconds: SIGKILL to all, a hang. Processes left once the
    ranks ended (pipe: commands) are killed and counted."""
    script = next(word for word in command if word.endswith(".py"))
    start = time.monotonic()
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    fired, hung, wall = None, False, time.time()
    try:
        while True:
            elapsed = time.monotonic() - start
            if fire is not None and fired is None and launcher.poll() is None and due(elapsed) and fire(launcher.pid):
                fired = elapsed
            mine = descendants(os.getpid())
            if launcher.poll() is not None and not any(_runs(pid, script) for pid in mine):
                break
            if elapsed > bound:
                hung = True
                send([launcher.pid] + mine, signal.SIGKILL)
                launcher.wait()
            _reap_orphans(launcher.pid)
            time.sleep(0.2)
    except BaseException:  # Ctrl-C, an error here: leave no run behind
        send([launcher.pid] + descendants(os.getpid()), signal.SIGKILL)
        raise
    leftovers = descendants(os.getpid())
    send(leftovers, signal.SIGKILL)
    time.sleep(0.2)
    _reap_orphans(launcher.pid)
    return {"code": launcher.returncode, "hung": hung, "fired": fired, "leftovers": len(leftovers),
            "seconds": time.monotonic() - start, "wall": wall}
