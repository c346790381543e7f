"""A TCP port as every command line takes it: `gpukillctl serve --tcp ADDR:PORT`, `gpukillctl exporter --port`,
`gpukillctl -H HOST:PORT`, gpukill's --server-port and --ssh-port."""

from __future__ import annotations

import argparse

MAX_PORT = 65535


def parse_port(text: str) -> int:
    """ASCII digits for 1 to 65535; ValueError in one line otherwise (int() alone would also take blanks, a sign,
    underscores and other scripts' digits)."""
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= MAX_PORT:
        raise ValueError(f"not a port: {text!r} (a number from 1 to {MAX_PORT})")
    return int(text)


def port_number(text: str) -> int:
    """parse_port as argparse's type of an option."""
    try:
        return parse_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
