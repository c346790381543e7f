"""A private OpenSSH server on loopback, a child of the test, for `gpukillctl -H`.

It has its own host key, an authorized_keys file of its own (no one's ~/.ssh is touched) and its own port; the
client side is an ssh_config naming the key and the known host, given to gpukillctl through GPUKILL_SSH. The test
users are made with /usr/sbin/nologin and a locked password ("!"), which sshd refuses (it runs the remote command
through the login shell, and with UsePAM no it refuses locked accounts): while the server runs, the user gets /bin/sh
and "*" (no password can match), and both are put back afterwards.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd refuses to start without it


def missing() -> str | None:
    """Why an sshd test cannot run here, or None."""
    for tool in (SSHD, "ssh", "ssh-keygen", "systemd-stdio-bridge", "usermod"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: openssh-server, openssh-client, systemd)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shadow_password(user: str) -> str:
    out = subprocess.run(["getent", "shadow", user], capture_output=True, text=True, check=True).stdout
    return out.split(":")[1]


@contextlib.contextmanager
def login_allowed(user: str, shell: str) -> Iterator[None]:
    """The user may log in over ssh with a key while this lasts."""
    old_shell, old_password = pwd.getpwnam(user).pw_shell, _shadow_password(user)
    subprocess.run(["usermod", "-s", shell, "-p", "*", user], check=True)
    try:
        yield
    finally:
        subprocess.run(["usermod", "-s", old_shell, "-p", old_password, user], check=True)


class Sshd:
    def __init__(self, users: list[str], forwarding: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpukill-sshd-"))
        os.chmod(self.dir, 0o755)  # sshd reads authorized_keys as the user
        self.port = free_port()
        self.users = users
        self.proc: subprocess.Popen | None = None
        self.ssh_config = self.dir / "ssh_config"
        self.forwarding = forwarding  # local forwarding (ssh -L) allowed: the dashboard's tunnel

    def _keygen(self, name: str) -> Path:
        key = self.dir / name
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
        return key

    def start(self) -> None:
        host_key = self._keygen("host_key")
        client_key = self._keygen("client_key")
        authorized = self.dir / "authorized_keys"
        authorized.write_text((self.dir / "client_key.pub").read_text())
        os.chmod(authorized, 0o644)
        config = self.dir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {host_key}",
                    "PidFile none",
                    f"AuthorizedKeysFile {authorized}",
                    "StrictModes no",
                    "UsePAM no",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    f"AllowUsers {' '.join(self.users)}",
                    "X11Forwarding no",
                    f"AllowTcpForwarding {'local' if self.forwarding else 'no'}",
                    "PermitTTY no",
                    "PrintMotd no",
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )
        known_hosts = self.dir / "known_hosts"
        known_hosts.write_text(
            f"[localhost]:{self.port},[127.0.0.1]:{self.port} " + (self.dir / "host_key.pub").read_text()
        )
        # the client: this key, this server's host key and nothing else (no agent, no user or global config)
        self.ssh_config.write_text(
            "\n".join(
                [
                    "Host localhost",
                    f"  Port {self.port}",
                    f"  IdentityFile {client_key}",
                    "  IdentitiesOnly yes",
                    "  IdentityAgent none",
                    f"  UserKnownHostsFile {known_hosts}",
                    "  GlobalKnownHostsFile /dev/null",
                    "  StrictHostKeyChecking yes",
                    "  BatchMode yes",
                    "  ConnectTimeout 10",
                    "",
                ]
            )
        )
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        with open(self.dir / "sshd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start: {self.log()}")
            time.sleep(0.05)

    def client_env(self) -> dict[str, str]:
        return {"GPUKILL_SSH": f"ssh -F {self.ssh_config}"}

    def log(self) -> str:
        return (self.dir / "sshd.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def serving(user: str, forwarding: bool = False) -> Iterator[Sshd]:
    """A module fixture's body: a private sshd on loopback that lets `user` log in with /bin/sh, stopped at the
    end; the test is skipped, with the reason, where sshd cannot run here."""
    import pytest

    reason = missing()
    if reason:
        pytest.skip(reason)
    server = Sshd([user], forwarding)
    try:
        with login_allowed(user, "/bin/sh"):
            server.start()
            yield server
    finally:
        server.stop()
