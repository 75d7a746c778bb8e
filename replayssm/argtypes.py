"""argparse types shared by the command line's sub-commands (`cli.py`, `train/command.py`)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {val}")
    return val


def positive_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not val > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {val}")
    return val
