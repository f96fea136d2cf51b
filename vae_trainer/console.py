"""Start-up noise of third-party libraries that a user cannot act on, silenced by the entry points before Paddle,
PaddleNLP and ppdiffusers are imported. Our own warnings and every other warning stay."""

import logging
import sys
import warnings

UNACTIONABLE_WARNINGS = (
    "No ccache found",  # paddle's C++ extension utilities, at import
    "Setuptools is replacing distutils",  # setuptools' distutils hack, at import
    "When training, we now always track global mean and variance",  # paddle's BatchNorm, at every forward
)
# Printed by Paddle's import whenever OMP_NUM_THREADS > 1, which threads.py chooses on purpose (and says so).
PADDLE_THREAD_WARNING = ("WARNING: OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY")


def quiet_third_party() -> None:
    """Ignore UNACTIONABLE_WARNINGS and the "PyTorch version ... available" INFO lines (datasets, ppdiffusers)."""
    for message in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("datasets", "ppdiffusers.utils.import_utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


class _WithoutThreadWarning:
    """`stream`, less PADDLE_THREAD_WARNING's lines (print writes a line's text and its newline separately)."""

    def __init__(self, stream) -> None:
        self.stream, self.dropping = stream, False

    def write(self, text: str) -> int:
        drop = text.startswith(PADDLE_THREAD_WARNING) or (self.dropping and text == "\n")
        self.dropping = drop and text != "\n"
        return len(text) if drop else self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def import_paddle_quietly() -> None:
    """Import Paddle without PADDLE_THREAD_WARNING. (A stream made during the import, a logging handler's, keeps
    the filter, which passes every other line on.)"""
    real, sys.stderr = sys.stderr, _WithoutThreadWarning(sys.stderr)
    try:
        import paddle  # noqa: F401
    finally:
        sys.stderr = real
