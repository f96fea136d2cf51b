"""What the benchmarks share: the repository's root, the photos they crop, and how a result names its machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Dict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field")  # shipped with scikit-image


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def machine_description() -> str:
    return f"{os.cpu_count()} CPU cores ({cpu_model()}), Python {platform.python_version()}"


def run_setting(script: str, setting: Dict, threads: int) -> Dict:
    """`python SCRIPT --worker SETTING --worker_output FILE` in a fresh process with `threads` OpenMP threads (fixed
    when Paddle loads): the JSON the worker wrote, or the setting with the last lines of its stderr as "error"."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), FLAGS_paddle_num_threads=str(threads), PYTHONPATH=REPO_ROOT,
               USE_TORCH=os.environ.get("USE_TORCH", "0"))
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "result.json")
        process = subprocess.run([sys.executable, os.path.abspath(script), "--worker", json.dumps(setting),
                                  "--worker_output", output], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
        if process.returncode != 0 or not os.path.isfile(output):
            return {"setting": setting, "error": process.stderr.strip().splitlines()[-3:]}
        with open(output) as handle:
            return json.load(handle)
