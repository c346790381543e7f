"""Limits the daemon enforces that its clients check too, so a client refuses what the daemon would refuse."""

from __future__ import annotations

MAX_GRACE = 300.0  # seconds between SIGTERM and SIGKILL (or giving up): a kill, a reset's kills, a Guard rule
