"""What a child process the daemon runs (Slurm's commands, cuda-checkpoint) writes, read without trusting it.

A child may write more than anyone reads: its output is read to the end, so it never blocks on a full pipe, and
only the first `limit` bytes are kept.
"""

from __future__ import annotations

import asyncio


async def read_bounded(stream: asyncio.StreamReader | None, limit: int) -> bytes:
    """The stream's first `limit` bytes; the rest is read and dropped."""
    if stream is None:
        return b""
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept)
