"""A real terminal for full-screen programs: a tmux server of a user's own, keys sent, the screen read back.

Each TmuxPane runs its own tmux server (its socket in a directory only that user may enter, no config file)
as that user, with the bed's environment, so the program in it reaches the bed's bus as that user and polkit
judges that user. The command is followed by `echo "[exited N]"` so a test sees how it ended.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from .testbed import Testbed, User

EXITED = "[exited "


def missing() -> str | None:
    return None if shutil.which("tmux") else "tmux is not installed (make test installs it)"


class TmuxPane:
    def __init__(self, bed: Testbed, user: User, width: int = 160, height: int = 50) -> None:
        self.bed, self.user, self.width, self.height = bed, user, width, height
        self.dir = Path(bed.workdir) / f"tmux-{user.name}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(mode=0o700)
        os.chown(self.dir, user.uid, user.gid)
        self.socket = self.dir / "socket"
        # SHELL: tmux runs the command with it, and without it falls back to the user's login shell, which for the
        # bed's users is nologin (the pane dies at once and the server with it, as on CI where SHELL is unset).
        self.env = bed.env(LC_ALL="C.UTF-8", HOME=str(self.dir), TERM="xterm-256color", SHELL="/bin/sh")

    def tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            ["tmux", "-f", "/dev/null", "-S", str(self.socket), *args],
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=15,
            **self.user.popen_kwargs(),
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)}: {r.stderr.strip()}")
        return r

    def start(self, argv: list[str]) -> None:
        command = f'{shlex.join(argv)}; echo "{EXITED}$?]"; sleep 600'
        self.tmux("new-session", "-d", "-s", "t", "-x", str(self.width), "-y", str(self.height), command)

    def keys(self, *keys: str, literal: bool = False) -> None:
        """tmux key names (Enter, Escape, Down, C-c) or, with literal, text typed as it is."""
        self.tmux("send-keys", "-t", "t", *(["-l"] if literal else []), *keys)

    def screen(self, escapes: bool = False) -> str:
        """The screen as text; with escapes, its attributes and colours as SGR sequences (capture-pane -e)."""
        return self.tmux("capture-pane", "-p", *(["-e"] if escapes else []), "-t", "t").stdout

    def wait_for(self, cond: str | Callable[[str], object], timeout: float = 15.0) -> str:
        """The screen once it shows `cond` (text) or cond(screen) holds; AssertionError with the screen if not."""
        check = (lambda s: cond in s) if isinstance(cond, str) else cond
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed {cond!r} (after {timeout}s):\n{screen}")
            time.sleep(0.05)

    def close(self) -> None:
        self.tmux("kill-server", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
