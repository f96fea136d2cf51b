"""Start-up noise of third-party libraries that a user cannot act on, silenced by the entry points before Paddle,
PaddleNLP and ppdiffusers are imported. Our own warnings and every other warning stay."""

import logging
import warnings

UNACTIONABLE_WARNINGS = (
    "No ccache found",  # paddle's C++ extension utilities, at import
    "Setuptools is replacing distutils",  # setuptools' distutils hack, at import
    "When training, we now always track global mean and variance",  # paddle's BatchNorm, at every forward
)


def quiet_third_party() -> None:
    """Ignore UNACTIONABLE_WARNINGS and the "PyTorch version ... available" INFO lines (datasets, ppdiffusers)."""
    for message in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("datasets", "ppdiffusers.utils.import_utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
