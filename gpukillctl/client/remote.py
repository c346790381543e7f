"""The system bus of another host, over SSH: what `gpukillctl -H [user@]host[:port]` connects through.

As `systemctl -H` and `busctl -H` do, ssh runs `systemd-stdio-bridge` on the host, which joins its stdin/stdout to
that host's system bus as the SSH user: the host's polkit judges that user and its journal records what is done.
dbus-fast speaks only to `unix:` and `tcp:` addresses, so the pipe reaches it through a unix socket in a private
(0700) directory: dbus-fast connects, the accepted end becomes ssh's stdin and stdout, and the socket file is gone
before a byte is sent. Nothing is relayed by this process and no port is opened anywhere.

Two environment variables serve tests and odd setups; production needs neither:
- GPUKILL_SSH: the ssh command line (default `ssh`), e.g. `ssh -F CONFIG` for a private client configuration.
- GPUKILL_REMOTE_BUS: the D-Bus address the bridge connects to on the host, instead of the host's system bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import BinaryIO

from dbus_fast.aio import MessageBus

from .ports import parse_port

SSH_ENV = "GPUKILL_SSH"
REMOTE_BUS_ENV = "GPUKILL_REMOTE_BUS"
BRIDGE = "systemd-stdio-bridge"
CONNECT_TIMEOUT = 90.0  # ssh's own handshake, and a password prompt on the terminal if there is one, happen inside it
HOST_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:%")
# A login name's: POSIX's portable ones, "@" of a domain user (alice@corp.example) and "\" of winbind's
# (CORP\alice). ssh refuses the shell's others, and the dashboard shows the user as part of the host's name.
USER_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_@\\")
SSH_EXIT_WAIT = 2.0  # after the bus closes, ssh sees end of input and leaves; past this it is stopped


class RemoteError(Exception):
    """The host could not be reached or its bus not joined; the message is one line."""


@dataclass(frozen=True)
class Host:
    """Where to ssh: [user@]host[:port], as systemctl -H takes it ([v6addr]:port for an IPv6 address)."""

    user: str | None
    name: str
    port: int | None

    @classmethod
    def parse(cls, text: str) -> Host:
        user, at, rest = text.rpartition("@")
        if not rest or (at and not user) or rest.startswith("-") or any(c.isspace() for c in text):
            raise ValueError(f"not a host: {text!r}")
        port_text = ""
        if rest.startswith("["):
            name, bracket, tail = rest[1:].partition("]")
            if not bracket or (tail and not tail.startswith(":")):
                raise ValueError(f"not a host: {text!r}")
            port_text = tail[1:]
        elif rest.count(":") == 1:
            name, _, port_text = rest.partition(":")
        else:
            name = rest
        # a host name, an IPv4 address or an IPv6 one (with a %scope): nothing a shell would act on, should
        # the user's ssh configuration hand %h to one (ProxyCommand, LocalCommand, Match exec)
        if not name or not set(name) <= HOST_CHARACTERS:
            raise ValueError(f"not a host: {text!r}")
        # the user too, should the configuration hand %r to a shell; "-" first would be an option of ssh's
        if user and (not set(user) <= USER_CHARACTERS or user.startswith("-") or user.endswith("\\")):
            raise ValueError(f"not a user name: {user!r} in {text!r}")
        port = None
        if port_text or rest.endswith(":"):
            try:
                port = parse_port(port_text)
            except ValueError as e:
                raise ValueError(f"{e} in {text!r}") from None
        return cls(user or None, name, port)

    def ssh_argv(self, ssh: list[str], remote_command: str) -> list[str]:
        # -x: no X11, -T: no terminal (the pipe carries binary D-Bus), -a and ClearAllForwardings: no agent and
        # no port forwarding, whatever ~/.ssh/config says (the bus is all this connection is for: a forwarded
        # agent or port would give the host, and whoever is root there, a way back into this machine);
        # options on the command line win over the configuration's. `--` so nothing after is an option.
        argv = [*ssh, "-xTa", "-o", "ClearAllForwardings=yes"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.user:
            argv += ["-l", self.user]
        return [*argv, "--", self.name, remote_command]


def bridge_command(bus_address: str | None) -> str:
    """The command ssh runs on the host (one shell line there)."""
    if not bus_address:
        return BRIDGE
    return shlex.join([BRIDGE, f"--bus-path={bus_address}"])


def ssh_command(env: dict[str, str] | os._Environ) -> list[str]:
    argv = shlex.split(env.get(SSH_ENV) or "ssh")
    if not argv or shutil.which(argv[0]) is None:
        raise RemoteError(f"ssh not found: {argv[0] if argv else '(empty ' + SSH_ENV + ')'}")
    return argv


class RemoteBus(MessageBus):
    """A MessageBus whose far end is ssh; disconnecting also ends ssh."""

    ssh: subprocess.Popen | None = None

    def disconnect(self) -> None:
        super().disconnect()
        if self.ssh is not None:
            # ssh leaves when it reads the end of its input; waiting for that (up to SSH_EXIT_WAIT) in a thread
            # keeps this event loop going: `gpukillctl serve` follows several hosts on one loop, and a host
            # whose ssh hangs must not hold the others up. Not a daemon thread: a command still reaps its ssh
            # before the interpreter exits.
            threading.Thread(target=end_process, args=(self.ssh,), name="gpukill ssh exit").start()


def end_process(proc: subprocess.Popen) -> None:
    try:
        proc.wait(SSH_EXIT_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ssh_failure(stderr: BinaryIO, proc: subprocess.Popen, cause: str) -> str:
    """One line for why the bus could not be joined: ssh's last word (its error), else the bus's."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(SSH_EXIT_WAIT)  # its last words are written before it exits
    stderr.seek(0)
    lines = [ln.strip() for ln in stderr.read().decode(errors="replace").splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    if proc.returncode not in (None, 0):
        return f"ssh exited with status {proc.returncode}: {cause}"
    return cause


async def connect(host_text: str, env: dict[str, str] | os._Environ = os.environ) -> MessageBus:
    """A connected bus on that host's system bus (or GPUKILL_REMOTE_BUS there). RemoteError says why not."""
    try:
        host = Host.parse(host_text)
    except ValueError as e:
        raise RemoteError(str(e)) from None
    argv = host.ssh_argv(ssh_command(env), bridge_command(env.get(REMOTE_BUS_ENV)))
    # ssh's messages go to a file, read only if joining fails: a pipe nobody reads could block ssh later
    with tempfile.TemporaryFile() as stderr:
        try:
            return await _join(argv, stderr)
        except OSError as e:
            raise RemoteError(f"cannot start ssh: {e}") from None


async def _join(argv: list[str], stderr: BinaryIO) -> RemoteBus:
    loop = asyncio.get_running_loop()
    rendezvous = tempfile.mkdtemp(prefix="gpukillctl-ssh-")  # 0700: no one else can connect in between
    path = os.path.join(rendezvous, "bus")
    bus = RemoteBus(bus_address=f"unix:path={path}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        try:
            listener.bind(path)
            listener.listen(1)
            listener.setblocking(False)
            joining = asyncio.ensure_future(bus.connect())  # queued by the kernel before it is accepted
            try:
                ours, _ = await asyncio.wait_for(loop.sock_accept(listener), CONNECT_TIMEOUT)
            except BaseException:
                joining.cancel()
                raise
        finally:
            shutil.rmtree(rendezvous, ignore_errors=True)
    with ours:
        ours.setblocking(True)
        proc = subprocess.Popen(argv, stdin=ours.fileno(), stdout=ours.fileno(), stderr=stderr)
    bus.ssh = proc
    try:
        await asyncio.wait_for(joining, CONNECT_TIMEOUT)
    except Exception as e:
        cause = "timed out joining the bus" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
        message = await asyncio.to_thread(ssh_failure, stderr, proc, cause)  # it waits for ssh: not on the loop
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        raise RemoteError(message) from None
    return bus
