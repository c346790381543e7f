"""`gpukillctl -H user@host`: D-Bus over a real OpenSSH server on loopback, through systemd-stdio-bridge, to the
test bed's bus (the "host's" system bus): the bed's polkit judges the SSH user and the bed's journal records it."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess

import pytest
from helpers import sshd
from helpers.testbed import PYTHON, REPO

from gpukillctl.cli import main as cli
from gpukillctl.client import exits
from gpukillctl.client.remote import Host, bridge_command
from gpukilld import journal as audit

NO_LOCAL_BUS = "unix:path=/nonexistent/system_bus_socket"  # so nothing can reach the bed but through ssh


@pytest.fixture(scope="module")
def server(users):
    yield from sshd.serving(users["owner"].name)


def remote_ctl(bed, server, user, host: str, *args: str):
    env = {**server.client_env(), "GPUKILL_REMOTE_BUS": bed.bus_address, "DBUS_SYSTEM_BUS_ADDRESS": NO_LOCAL_BUS}
    return bed.run_as(user, [PYTHON, "-m", "gpukillctl", "-H", host, *args], env=env, timeout=60)


def test_list_json_over_ssh(victims, users, server):
    bed = victims
    victim = bed.victim(users["owner"], gpu=1)
    bed.wait_listed(victim.pid)
    r = remote_ctl(bed, server, users["root"], f"{users['owner'].name}@localhost", "list", "--json")
    assert r.returncode == 0, (r.stderr, server.log())
    listed = json.loads(r.stdout)
    assert victim.pid in [p["pid"] for p in listed["processes"]]
    assert listed["devices"]


def test_kill_of_own_process_is_done_and_journaled_as_the_ssh_user(victims, users, server, alive):
    bed = victims
    owner = users["owner"]
    victim = bed.victim(owner, gpu=0)
    bed.wait_listed(victim.pid)
    # run as root here: the remote side is still gpkowner, as ssh logged in
    r = remote_ctl(bed, server, users["root"], f"{owner.name}@localhost", "kill", str(victim.pid), "--grace", "2")
    assert r.returncode == 0, (r.stderr, server.log())
    assert victim.wait(10) is not None
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(owner.uid)


def test_kill_of_another_users_process_is_denied_by_that_hosts_polkit(victims, users, server, alive):
    bed = victims
    victim = bed.victim(users["other"], gpu=0)
    bed.wait_listed(victim.pid)
    r = remote_ctl(bed, server, users["root"], f"{users['owner'].name}@localhost", "kill", str(victim.pid))
    assert r.returncode == exits.EXIT_DENIED, (r.stderr, server.log())
    assert r.stderr.startswith(f"gpukillctl: host {users['owner'].name}@localhost: ") and r.stderr.count("\n") == 1
    assert alive(victim.pid)
    denied = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL_DENIED.message_id)
    assert denied and denied[0]["GPUKILL_CALLER_UID"] == str(users["owner"].uid)


def test_forwardings_of_the_users_ssh_config_are_not_used(victims, users, server, tmp_path):
    """A ~/.ssh/config that forwards the agent, X11 and a port to every host: -H uses none of them (the command
    line's -a, -x and ClearAllForwardings win over the configuration). The local forward is to a port already
    taken, with ExitOnForwardFailure: had ssh tried it, it would have exited; the agent request is read from
    ssh's own debug log."""
    bed = victims
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(str(tmp_path / "agent"))  # an agent socket ssh would forward (none is used to log in)
    agent.listen(1)
    config = tmp_path / "ssh_config"
    config.write_text(
        server.ssh_config.read_text().replace(
            "Host localhost\n",
            "Host localhost\n"
            + "".join(
                f"  {line}\n"
                for line in (
                    f"ForwardAgent {tmp_path / 'agent'}",
                    "ForwardX11 yes",
                    "ExitOnForwardFailure yes",
                    f"LocalForward 127.0.0.1:{busy.getsockname()[1]} 127.0.0.1:9",
                )
            ),
        )
    )
    debug = tmp_path / "ssh-debug.log"
    try:
        env = {
            "GPUKILL_SSH": f"ssh -F {config} -v -E {debug}",
            "DISPLAY": ":0",
            "GPUKILL_REMOTE_BUS": bed.bus_address,
            "DBUS_SYSTEM_BUS_ADDRESS": NO_LOCAL_BUS,
        }
        r = bed.run_as(
            users["root"],
            [PYTHON, "-m", "gpukillctl", "-H", f"{users['owner'].name}@localhost", "status"],
            env=env,
            timeout=60,
        )
        log = debug.read_text(errors="replace")
        assert r.returncode == 0, (r.stderr, log[-3000:], server.log())
        assert "Authenticated to" in log, log[-3000:]  # the debug log is that of the connection made
        # what ssh logs as it asks for each (OpenSSH's clientloop.c, ssh.c, at -v)
        asked = (
            "Requesting authentication agent forwarding",
            "Requesting X11 forwarding",
            "Local connections to",
            "Remote connections from",
            "Local forwarding listening",
        )
        requested = [ln for ln in log.splitlines() if ln.startswith("debug1: ") and ln.startswith(asked, 8)]
        assert not requested, requested
    finally:
        busy.close()
        agent.close()


def test_unreachable_host_is_one_line_naming_it(bed, users, server):
    host = f"{users['owner'].name}@localhost:{sshd.free_port()}"  # nothing listens there
    r = remote_ctl(bed, server, users["root"], host, "status")
    assert r.returncode == exits.EXIT_UNAVAILABLE, r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"gpukillctl: host {host}: ssh: ")
    assert "refused" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "text,expected",
    [
        ("node7", Host(None, "node7", None)),
        ("gk@node7", Host("gk", "node7", None)),
        ("gk@node7:2222", Host("gk", "node7", 2222)),
        ("gk@[fe80::1]:22", Host("gk", "fe80::1", 22)),
        ("fe80::1", Host(None, "fe80::1", None)),
        ("gk@[fe80::1%eth0]:22", Host("gk", "fe80::1%eth0", 22)),
        ("gpu_node-7.example.org", Host(None, "gpu_node-7.example.org", None)),
        ("alice@corp.example@node7", Host("alice@corp.example", "node7", None)),  # a domain user
        ("CORP\\alice@node7:22", Host("CORP\\alice", "node7", 22)),  # winbind's
    ],
)
def test_host_syntax(text, expected):
    assert Host.parse(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "@node",
        "gk@",
        "-oProxyCommand=x",
        "a b",
        "node:0",
        "node:x",
        "[fe80::1",
        "$(reboot)",
        "gk@node`id`",
        "node;id",
        "[fe80::1|id]:22",
        "n'o",
    ],
)
def test_bad_host_is_refused_before_ssh_runs(text):
    with pytest.raises(ValueError):
        Host.parse(text)


# ssh refuses these users itself, later and host by host; the dashboard would show them as a host's name
@pytest.mark.parametrize(
    "user",
    [
        "<img/src=x/onerror=alert(1)>",
        "</script><script>alert(1)</script>",
        "$(reboot)",
        "gk;id",
        "`id`",
        "-oProxyCommand=x",
        "gk\\",
        "gk'",
        "a|b",
    ],
)
def test_a_user_that_is_no_login_name_is_refused_before_ssh_runs(user):
    with pytest.raises(ValueError, match=r"^not a user name: .* in .*@node7:22['\"]$"):
        Host.parse(f"{user}@node7:22")


def test_ssh_command_line():
    argv = Host("gk", "node7", 2222).ssh_argv(["ssh"], bridge_command(None))
    assert argv == [
        "ssh",
        "-xTa",
        "-o",
        "ClearAllForwardings=yes",
        "-p",
        "2222",
        "-l",
        "gk",
        "--",
        "node7",
        "systemd-stdio-bridge",
    ]
    assert bridge_command("unix:path=/x y") == "systemd-stdio-bridge '--bus-path=unix:path=/x y'"


@pytest.mark.parametrize("command", [["mcp"], ["guard", "validate", "/dev/null"]])
def test_commands_that_run_here_refuse_a_host(command, capsys):
    assert cli.main(["-H", "gk@node7", *command]) == exits.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("gpukillctl: -H is not supported by ") and err.count("\n") == 1


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed (apt install jq)")
def test_the_readmes_many_hosts_example_runs_no_host_name_as_code(tmp_path):
    """The `xargs ... sh -c` fan-out of docs/using.md, run as written, with a gpukillctl that prints an empty
    listing and host names that a shell would run if they were part of its script."""
    readme = (REPO / "docs" / "using.md").read_text()
    start = readme.index("```sh\nprintf '%s\\n' node01 node02 node03 | xargs")
    block = readme[start + len("```sh\n") : readme.index("```", start + 3)]
    fan_out = block[: block.index("> fleet.jsonl") + len("> fleet.jsonl")]
    names = ["node01", f"$(touch {tmp_path}/ran)", f"`touch {tmp_path}/ran`", "a;touch ran"]
    script = fan_out.replace("node01 node02 node03", " ".join(shlex.quote(n) for n in names), 1)
    assert script != fan_out
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gpukillctl").write_text('#!/bin/sh\nprintf \'{"format": 1, "devices": [], "processes": []}\\n\'\n')
    (bin_dir / "gpukillctl").chmod(0o755)
    r = subprocess.run(
        ["sh", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    assert r.returncode == 0, r
    assert not (tmp_path / "ran").exists(), "a host name ran as a command"
    hosts = sorted(json.loads(line)["host"] for line in (tmp_path / "fleet.jsonl").read_text().splitlines())
    assert hosts == sorted(names)
