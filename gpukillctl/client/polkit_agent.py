"""On a terminal, pkttyagent for our bus connection, so polkit can ask for a password."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


class PolkitAgent:
    """Runs pkttyagent for this process while an authorized call is made (not as root, not without a tty)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        agent = shutil.which("pkttyagent")
        if not agent or not sys.stdin.isatty() or os.geteuid() == 0:
            return
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [agent, "--notify-fd", str(write_fd), "--process", str(os.getpid())], pass_fds=(write_fd,)
        )
        os.close(write_fd)
        os.read(read_fd, 1)  # EOF once the agent is registered (or has died)
        os.close(read_fd)

    @property
    def active(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
