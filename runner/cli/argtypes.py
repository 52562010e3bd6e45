"""argparse types shared by the verbs: a bad value is argparse's one line naming the option."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number >= 1 (`sample --max-new-tokens`, `launch --max-steps`, `data prepare --workers`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (`data prepare --validation-fraction`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value
