"""Every port option of every command line reads a port alike (gpukillctl/client/ports.py): gpukillctl serve
--tcp, gpukillctl exporter --port, gpukillctl -H HOST:PORT, gpukill --server-port and --ssh-port."""

from __future__ import annotations

import sys

import pytest

from gpukillctl.cli import compat
from gpukillctl.cli.main import build_parser
from gpukillctl.client.remote import Host


def _parsed(parse, argv: list[str], dest: str):
    try:
        value = getattr(parse(argv), dest)
    except (SystemExit, compat.Refused) as e:  # argparse's one-line refusal; gpukill's, with what to run instead
        if isinstance(e, compat.Refused):
            print(e, file=sys.stderr)
        return None
    return value.port if hasattr(value, "port") else value


def readings(text: str) -> dict[str, int | None]:
    """Each option's reading of a port text: the port, or None when refused."""
    try:
        remote: int | None = Host.parse(f"gpu-host:{text}").port
    except ValueError:
        remote = None
    gpukillctl, gpukill = build_parser().parse_args, compat.build_parser().parse_args
    return {
        "serve --tcp": _parsed(gpukillctl, ["serve", "--tcp", f"127.0.0.1:{text}"], "tcp"),
        "exporter --port": _parsed(gpukillctl, ["exporter", "--port", text], "port"),
        "-H HOST:PORT": remote,
        "gpukill --server-port": _parsed(gpukill, ["--server", "--server-port", text], "server_port"),
        "gpukill --ssh-port": _parsed(gpukill, ["--list", "--remote", "h", "--ssh-port", text], "ssh_port"),
    }


@pytest.mark.parametrize(
    "text,port",
    [
        ("8080", 8080),
        ("1", 1),
        ("65535", 65535),
        ("0", None),
        ("65536", None),
        (" 8080", None),
        ("+8080", None),
        ("8_080", None),
        ("٨٠٨٠", None),
        ("", None),
        ("http", None),
    ],
)
def test_every_port_option_reads_a_port_alike(text, port, capsys):
    assert readings(text) == dict.fromkeys(readings("1"), port)
    if port is None:
        assert "not a port" in capsys.readouterr().err
