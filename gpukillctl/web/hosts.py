"""The machines one dashboard shows: this one (host 0, its own system bus) and those named with `gpukillctl serve
--host [USER@]HOST[:PORT]` (repeatable) or `--hosts-file FILE`, each reached as `gpukillctl -H` reaches it (ssh
and systemd-stdio-bridge, gpukillctl/client/remote.py): that host's polkit decides and its journal records.

Every name is parsed with remote.Host.parse before anything runs, so a name that ssh (or a shell its
configuration hands %h to) would act on is refused at start, in one line that says where it came from. The list
is bounded: each host is one ssh connection and one feed of listings in the server, and past a few dozen nodes
Prometheus and the shipped Grafana dashboard are the tool (README.md).
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass

from ..client.dbus import Connect, GpukillClient
from ..client.remote import Host

MAX_HOSTS = 64  # other hosts, --host and --hosts-file together
MAX_FILE_BYTES = 64 * 1024  # 64 lines of [user@]host:port fit many times over; a larger file is not a hosts list


@dataclass(frozen=True)
class HostSpec:
    id: int  # 0 = this machine (its own system bus, no ssh); 1.. = --host/--hosts-file in the order given
    name: str  # shown on the page: socket.gethostname() for 0, else the text given ("alice@node2:2222")
    connect: Connect  # a fresh client of this host's gpukilld

    @property
    def api(self) -> str:
        """Where this host's REST API is served (gpukillctl/serve/app.py mounts one per host)."""
        return "/v1" if self.id == 0 else f"/hosts/{self.id}/v1"


def local_host() -> HostSpec:
    return HostSpec(0, socket.gethostname(), GpukillClient.connect)


def remote_host(id: int, text: str) -> HostSpec:
    return HostSpec(id, text, functools.partial(GpukillClient.connect, host=text))


def host_specs(hosts: list[str], hosts_file: str | None) -> list[HostSpec]:
    """Host 0, then the --host entries, then the file's; ValueError with one line (FILE:LINE for the file's)."""
    named: list[tuple[str, str]] = [(f"--host {text!r}", text) for text in hosts]  # (where it was given, text)
    if hosts_file is not None:
        named += [(f"{hosts_file}:{n}", text) for n, text in _file_lines(hosts_file)]
    if len(named) > MAX_HOSTS:
        raise ValueError(
            f"{len(named)} hosts given: at most {MAX_HOSTS} (past a few dozen, use the exporter "
            f"with Prometheus and the shipped Grafana dashboard)"
        )
    specs = [local_host()]
    seen: dict[Host, str] = {}  # where each was given
    for where, text in named:
        try:
            host = Host.parse(text)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if host in seen:  # the same ssh target twice: two feeds and two cards of one machine
            raise ValueError(f"{where}: {text!r} is given twice (first at {seen[host]})")
        seen[host] = where
        specs.append(remote_host(len(specs), text))
    return specs


def _file_lines(path: str) -> list[tuple[int, str]]:
    """(line number, host text) for each line that names a host: `#` starts a comment, blank lines are skipped."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--hosts-file {path}: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"--hosts-file {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        number = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{number}: not UTF-8 text") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()  # no host name holds a "#"
        if entry:
            out.append((n, entry))
    return out
