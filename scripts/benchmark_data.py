"""Moved to benchmarks/benchmark_data.py; this path still runs it."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _moved import moved  # noqa: E402

main = moved("benchmark_data").main

if __name__ == "__main__":
    sys.exit(main())
