"""A PID as the commands take it (`kill PID`, `postpone PID`, `--tree PID`): decimal, within the kernel's range."""

from __future__ import annotations

import argparse

PID_MAX_LIMIT = 2**22  # the kernel's largest PID_MAX


def pid_number(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a PID: {text!r}") from None
    if not 0 < value < PID_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"PID out of range: {value}")
    return value
