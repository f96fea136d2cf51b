"""The scripts that moved from scripts/ to benchmarks/, loaded from their new place, so that commands written
before the move (in earlier docs, issues and users' notes) keep working: `python scripts/NAME.py ...`."""

import importlib.util
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def moved(name: str):
    """The module benchmarks/NAME.py, loaded from its file (this folder's shim of the same name would shadow
    it on sys.path), with benchmarks/ importable for its sibling modules (common.py, benchmark_reference.py)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses defined in it look their module up)
    spec.loader.exec_module(module)
    return module
