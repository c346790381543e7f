"""The hostile user's polkit agent that never answers (tests/clients/hostile_agent.py), started as that user."""

from __future__ import annotations

import json
import subprocess
import threading

from .testbed import PYTHON, REPO, Testbed


def start_hostile_agent(bed: Testbed, user) -> tuple[subprocess.Popen, str, list[dict]]:
    """The agent, its bus name and its event log (one dict a line it prints, appended as they come)."""
    proc = subprocess.Popen(
        [PYTHON, str(REPO / "tests" / "clients" / "hostile_agent.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=bed.env(),
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert "ready" in first, first
    events: list[dict] = []

    def read() -> None:
        for line in proc.stdout:
            events.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return proc, first["ready"], events
