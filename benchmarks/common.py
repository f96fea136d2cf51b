"""What the benchmarks share: the repository's root, the photos they crop, and how a result names its machine."""

from __future__ import annotations

import os
import platform

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
