"""The REST API of `gpukillctl serve` against the real daemon on simulated GPUs, the server run as an
unprivileged user on its Unix socket (the default): what it lists, that polkit decides as for gpukillctl (403 with the
D-Bus error name, the
denial and the kills in the journal under the server's user), each error's status, and schemathesis against
its own /v1/openapi.json (over TCP, which schemathesis speaks)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
pytest.importorskip("mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from helpers.http_server import Server, request  # noqa: E402
from helpers.marks import needs_root  # noqa: E402
from helpers.testbed import PYTHON, REPO, SYSTEM_PYTHON, Testbed  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

from gpukill.records.base import names  # noqa: E402
from gpukill.records.manager import Device, Process  # noqa: E402
from gpukill.units import format_duration  # noqa: E402
from gpukilld import journal as audit  # noqa: E402

pytestmark = needs_root

GIB = 1 << 30


@pytest.fixture(scope="module")
def server(bed, users):
    s = Server(bed, users["owner"]).wait_ready()
    yield s
    s.stop()


def test_devices_and_processes_as_list_json(server, victims, users):
    """The plain form of the records, as `gpukillctl list --json` writes it for the same user."""
    owner = users["owner"]
    big = victims.victim(owner, gpu=0, mem="14G", comm="python")
    small = victims.victim(owner, gpu=1, mem="2G", comm="python")
    other = victims.victim(users["other"], gpu=0, mem="13G", comm="trainer")
    for v, comm in ((big, "python"), (small, "python"), (other, "trainer")):
        victims.wait_listed(v.pid, comm=comm)  # under its own name: it renames itself once started
    r = server.call("GET", "/v1/devices")
    assert r.status == 200, r
    listed = victims.listing(owner)
    assert [tuple(d) for d in r.body["devices"]] == [names(Device)] * len(listed["devices"])
    assert [d["id"] for d in r.body["devices"]] == [d["id"] for d in listed["devices"]]
    r = server.call("GET", "/v1/processes")
    assert r.status == 200 and all(tuple(p) == names(Process) for p in r.body["processes"]), r
    assert {p["pid"] for p in r.body["processes"]} >= {big.pid, small.pid, other.pid}
    # gpu-kill's scenario: python processes above 12 GiB
    r = server.call("GET", f"/v1/processes?name=python&memory_gt={12 * GIB}")
    assert r.status == 200 and [p["pid"] for p in r.body["processes"]] == [big.pid], r
    assert r.body["processes"][0] == listed_process(victims, owner, big.pid)
    r = server.call("GET", f"/v1/processes?user={owner.name}&device=1")
    assert [p["pid"] for p in r.body["processes"]] == [small.pid], r
    r = server.call("GET", f"/v1/processes?memory_gt={14 * GIB}")  # more than, not at least
    assert big.pid not in [p["pid"] for p in r.body["processes"]], r


def listed_process(bed: Testbed, user, pid: int) -> dict:
    return next(p for p in bed.listing(user)["processes"] if p["pid"] == pid)


def test_the_server_user_cannot_kill_another_users_process(server, victims, users, alive):
    victim = victims.victim(users["other"], gpu=0, comm="theirs")
    listed = victims.wait_listed(victim.pid)
    r = server.call("POST", "/v1/kill", {"pid": victim.pid, "start_time": listed["start_time"], "force": True})
    assert (r.status, r.error) == (403, "org.freedesktop.DBus.Error.AccessDenied"), r
    assert "not authorized" in r.body["message"], r
    entries = victims.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL_DENIED.message_id)
    assert entries and entries[0]["GPUKILL_CALLER_UID"] == str(users["owner"].uid), entries
    time.sleep(0.3)
    assert alive(victim.pid)


def test_a_kill_with_grace_0_reports_the_exit_it_caused(server, victims, users):
    """grace 0 over REST is the daemon's: SIGTERM, then the exit it caused, never "still-alive" for a process
    that died of it."""
    victim = victims.victim(users["owner"], gpu=1, comm="quick")
    listed = victims.wait_listed(victim.pid)
    r = server.call("POST", "/v1/kill", {"pid": victim.pid, "start_time": listed["start_time"], "grace": 0})
    assert r.status == 200 and r.body["outcome"] == "terminated", r
    assert victim.wait(5) == -15


def test_the_server_user_kills_their_own_process(server, victims, users):
    owner = users["owner"]
    victim = victims.victim(owner, gpu=1, comm="mine")
    listed = victims.wait_listed(victim.pid)
    r = server.call("POST", "/v1/kill", {"pid": victim.pid, "start_time": listed["start_time"], "grace": 2})
    assert r.status == 200, r
    assert {k: r.body[k] for k in ("pid", "start_time", "outcome")} == {
        "pid": victim.pid,
        "start_time": listed["start_time"],
        "outcome": "terminated",
    }
    assert r.body["reclaim"]["verdict"] == "reclaimed" and r.body["reclaim"]["first_signal"] == "SIGTERM", r.body
    assert r.body["answer"] == f"GPU memory reclaimed {format_duration(r.body['reclaim']['seconds'])} after SIGTERM"
    assert victim.wait(5) is not None
    entries = victims.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entries, "the kill is not in the journal"
    entry = entries[0]
    assert (entry["GPUKILL_CALLER_UID"], entry["GPUKILL_INITIATOR"], entry["GPUKILL_RESULT"]) == (
        str(owner.uid),
        "user",
        "terminated",
    ), entry
    # without start_time: the listed one is used
    again = victims.victim(owner, gpu=1)
    listed = victims.wait_listed(again.pid)
    r = server.call("POST", "/v1/kill", {"pid": again.pid})
    assert r.status == 200 and r.body["start_time"] == listed["start_time"], r


def test_errors_carry_the_dbus_name_and_their_status(server, victims, users):
    owner = users["owner"]
    victim = victims.victim(owner, gpu=0)
    listed = victims.wait_listed(victim.pid)
    cases = [
        ({"pid": 4194000, "start_time": 1}, 404, "org.gpukill1.Error.NoSuchProcess"),
        (
            {"pid": victim.pid, "start_time": listed["start_time"] + 1},
            409,
            "org.gpukill1.Error.ProcessChanged",
        ),
        ({"pid": 1}, 403, "org.gpukill1.Error.Protected"),
        ({"pid": 0}, 422, "org.freedesktop.DBus.Error.InvalidArgs"),
        ({"pid": victim.pid, "grace": 1e9}, 422, "org.freedesktop.DBus.Error.InvalidArgs"),
        ({"pid": victim.pid, "signal": 9}, 422, "org.freedesktop.DBus.Error.InvalidArgs"),
        ({}, 422, "org.freedesktop.DBus.Error.InvalidArgs"),
    ]
    for body, status, name in cases:
        r = server.call("POST", "/v1/kill", body)
        assert (r.status, r.error) == (status, name), (body, r)
        assert isinstance(r.body["message"], str) and r.body["message"], r
    r = server.call("POST", "/v1/kill", raw=b"{not json")
    assert (r.status, r.error) == (422, "org.freedesktop.DBus.Error.InvalidArgs"), r
    # a reset is for admins (auth_admin: no one can type a password here)
    r = server.call("POST", "/v1/reset", {"device": "0"})
    assert (r.status, r.error) == (403, "org.freedesktop.DBus.Error.AccessDenied"), r
    assert victims.wait_journal(MESSAGE_ID=audit.RESET_DENIED.message_id, GPUKILL_CALLER_UID=str(owner.uid))
    for device in ("no-such-gpu", "\u00b2"):  # "²" is a digit to str.isdigit, and once made gpukilld fail
        r = server.call("POST", "/v1/reset", {"device": device})
        assert (r.status, r.error) == (404, "org.gpukill1.Error.NoSuchDevice"), r
    r = server.call("POST", "/v1/reset", {"device": "a\x00b"})  # D-Bus strings hold no NUL
    assert (r.status, r.error) == (422, "org.freedesktop.DBus.Error.InvalidArgs"), r
    r = server.call("GET", "/v1/processes?name_regex=(")
    assert (r.status, r.error) == (422, "org.freedesktop.DBus.Error.InvalidArgs"), r
    r = server.call("GET", "/v1/processes?memory_gt=-1")
    assert (r.status, r.error) == (422, "org.freedesktop.DBus.Error.InvalidArgs"), r
    r = server.call("GET", "/v1/nothing")
    assert (r.status, r.error) == (404, "NotFound"), r
    r = server.call("DELETE", "/v1/devices")
    assert (r.status, r.error) == (405, "MethodNotAllowed"), r


def test_guard_and_audit(server):
    r = server.call("GET", "/v1/guard/status")
    assert r.status == 200 and isinstance(r.body["enabled"], bool) and isinstance(r.body["rules"], list), r
    policy = (
        "rules:\n  - name: big\n    action: log\n    conditions:\n      - type: process_name\n"
        "        operator: contains_any\n        value: [python]\n"
    )
    r = server.call("POST", "/v1/guard/test", {"name": "mine", "text": policy})
    assert r.status == 200 and isinstance(r.body["decisions"], list), r
    r = server.call("POST", "/v1/guard/test", {"name": "bad", "text": "rules: 12\n"})
    assert (r.status, r.error) == (422, "org.gpukill1.Error.InvalidPolicy"), r
    r = server.call("GET", "/v1/audit/rogue")
    assert r.status == 200 and isinstance(r.body["findings"], list), r


def test_daemon_unreachable_is_503(fresh_bed, users):
    """A bus without gpukilld: every call is 503, with the name the client gives it."""
    s = Server(fresh_bed, users["owner"]).wait_ready()
    try:
        for method, path, body in (
            ("GET", "/v1/devices", None),
            ("POST", "/v1/kill", {"pid": 5, "start_time": 1}),
        ):
            r = s.call(method, path, body)
            assert (r.status, r.error) == (503, "org.gpukill1.Error.DaemonUnavailable"), r
    finally:
        s.stop()


@pytest.mark.timeout(120)
def test_schemathesis_against_the_openapi_schema(bed, victims, users):
    """Generated requests for every operation, with the token, as the unprivileged server user: no 5xx, every
    status documented, every response body as its schema says; and requests without the token are refused
    (ignored_auth). Bounded: a few examples per operation, no stateful phase."""
    st = shutil.which("schemathesis", path=str(Path(PYTHON).parent))
    if st is None:
        pytest.skip("schemathesis is not installed (the test extra)")
    victims.wait_listed(victims.victim(users["owner"], gpu=0, comm="target").pid)  # something to list and kill
    server = Server(bed, users["owner"], tcp=True).wait_ready()
    try:
        _schemathesis(st, server, victims)
    finally:
        server.stop()


def _schemathesis(st: str, server: Server, victims) -> None:
    # Every check but positive_data_acceptance: a request can match the schema and still be refused for what
    # no schema says (a regular expression RE2 cannot compile, a policy that is not valid YAML): 422, rightly.
    r = subprocess.run(
        [
            st,
            "run",
            f"http://127.0.0.1:{server.port}/v1/openapi.json",
            "-H",
            f"Authorization: Bearer {server.token}",
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
            "--max-examples",
            "15",
            "--phases",
            "examples,coverage,fuzzing",
            "--request-timeout",
            "60",
            "--seed",
            "1",
            "--max-time",
            "30",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=victims.workdir,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_an_admins_server_resets_a_gpu(bed, users):
    """An external monitor's POST /v1/reset, to the server of a user polkit lets reset GPUs (group gpukill with
    the example rules): reset, and in the journal under that user."""
    admin = users["admin"]
    s = Server(bed, admin).wait_ready()
    try:
        r = s.call("POST", "/v1/reset", {"device": "2"})
        assert r.status == 200 and r.body["device"] == 2 and r.body["killed"] == [], r
        entries = bed.wait_journal(MESSAGE_ID=audit.RESET.message_id, GPUKILL_CALLER_UID=str(admin.uid))
        assert entries and entries[-1]["GPUKILL_DEVICE"] == r.body["device_id"], entries
    finally:
        s.stop()


def _readme_relay() -> str:
    """The relay's code, as docs/interfaces.md gives it (its section "An external monitor driving POST
    /v1/reset")."""
    readme = (REPO / "docs" / "interfaces.md").read_text()
    found = re.search(r"```python\n(# gpu-reset-relay.*?)```", readme, re.S)
    assert found, "the relay is not in docs/interfaces.md"
    return found.group(1)


def _accepts(port: int) -> bool:
    """Whether a request to the port is answered (the listener takes connections before the relay runs)."""
    try:
        return request(port, "GET", "/").status > 0
    except OSError:
        return False


# the listener at fd 3, then the script: what systemd does for a socket unit's service
_AS_FD_3 = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.execv(sys.executable, [sys.executable, sys.argv[2]])"


def test_the_readme_relay_resets_a_gpu(bed, users):
    """The Alertmanager relay of docs/interfaces.md, run as the server's user on a listening socket passed as
    fd 3 (as its socket unit does): no secret, 401 and nothing reset; Alertmanager's JSON with it, the GPU reset through
    the server's Unix socket, in the journal under that user."""
    admin = users["admin"]
    s = Server(bed, admin).wait_ready()
    home = bed.workdir / "relay-home"
    home.mkdir(exist_ok=True)
    os.chown(home, admin.uid, admin.gid)
    script = home / "gpu-reset-relay.py"
    script.write_text(_readme_relay())
    secret_file = home / "gpu-reset.secret"
    secret = "r" * 40
    secret_file.write_text(secret + "\n")
    os.chown(secret_file, admin.uid, admin.gid)
    os.chmod(secret_file, 0o600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with open(bed.workdir / "relay.log", "wb") as log:  # the fd 3 the socket unit would pass: the listener
        relay = subprocess.Popen(
            [SYSTEM_PYTHON, "-c", _AS_FD_3, str(listener.fileno()), str(script)],
            pass_fds=[listener.fileno()],
            env={"XDG_RUNTIME_DIR": str(s.runtime), "RELAY_SECRET_FILE": str(secret_file), "PATH": "/usr/bin:/bin"},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
            **admin.popen_kwargs(),
        )
    bed.procs.append(relay)
    listener.close()
    try:
        device = next(d for d in s.call("GET", "/v1/devices").body["devices"] if d["index"] == 2)
        labels = {"alertname": "GpuXidErrors", "UUID": device["id"]}  # NVIDIA's UUID; the simulated GPU's id
        alert = {"alerts": [{"status": "firing", "labels": labels}]}
        resets = {
            "MESSAGE_ID": audit.RESET.message_id,
            "GPUKILL_DEVICE": device["id"],
            "GPUKILL_CALLER_UID": str(admin.uid),
        }
        before = len(bed.journal(**resets))  # another test may have reset it as this user already
        wait_until(lambda: relay.poll() is not None or _accepts(port), 10, "the relay does not start")
        assert relay.poll() is None, (bed.workdir / "relay.log").read_text()
        r = request(port, "POST", "/alert", body=alert)  # any local user can reach the port: not the secret
        assert r.status == 401, r
        r = request(port, "POST", "/alert", body=alert, headers={"Authorization": "Bearer " + "x" * 40})
        assert r.status == 401, r
        time.sleep(0.5)
        assert len(bed.journal(**resets)) == before
        r = request(port, "POST", "/alert", body=alert, headers={"Authorization": f"Bearer {secret}"})
        assert r.status == 200, (r, (bed.workdir / "relay.log").read_text())
        wait_until(
            lambda: len(bed.journal(**resets)) > before,
            10,
            lambda: f"no reset in the journal: {(bed.workdir / 'relay.log').read_text()}",
        )
        out = (bed.workdir / "relay.log").read_text()
        line = next(x for x in out.splitlines() if x.startswith(device["id"] + " "))
        _, status, reply = line.split(" ", 2)  # what the relay prints: the UUID, the status, the reply
        assert status == "200" and json.loads(reply)["device"] == 2, out
    finally:
        relay.terminate()
        relay.wait(10)
        s.stop()


def test_managed_policies_polkit_decides_for_the_servers_user(server, bed, users):
    """The Guard page's routes: an administrator's server (gpkadmin: polkit/49-gpukill-admins.rules lets it
    manage policies) creates, lists and removes a user policy; the ordinary user's server (the module's, as
    gpkowner) lists them and gets polkit's refusal, 403 AccessDenied with the daemon's message, for each change,
    and nothing is made. Bad kinds, targets and settings are 422 naming them."""
    from helpers.mcp_scenario import no_user_policy
    from helpers.testbed import OTHER

    path = f"/v1/guard/policies/user/{OTHER}"
    settings = {"memory_limit": 8 * GIB, "process_limit": 3, "grace": 10}
    admin = Server(bed, users["admin"]).wait_ready()
    try:
        with no_user_policy(bed, OTHER):
            r = server.call("PUT", path, settings)
            assert (r.status, r.error) == (403, "org.freedesktop.DBus.Error.AccessDenied"), r
            assert "not authorized" in r.body["message"], r
            listed = server.call("GET", "/v1/guard/policies")
            assert listed.status == 200 and OTHER not in [p["target"] for p in listed.body["policies"]], listed
            r = admin.call("PUT", path, settings)
            assert r.status == 200, r
            assert (
                r.body["kind"],
                r.body["target"],
                r.body["memory_limit"],
                r.body["process_limit"],
                r.body["grace"],
                r.body["utilization_limit"],
            ) == ("user", OTHER, 8 * GIB, 3, 10.0, None), r
            assert r.body["file"].endswith(".yaml") and r.body["edited"] is False, r
            # sizes and durations as the dashboard's form types them: the one grammar, read by the daemon
            r = admin.call("PUT", path, {"memory_limit": "8GiB", "grace": "2min"})
            assert r.status == 200 and (r.body["memory_limit"], r.body["grace"]) == (8 * GIB, 120.0), r
            listed = server.call("GET", "/v1/guard/policies")  # listing needs nothing: the owner sees it too
            assert [p for p in listed.body["policies"] if p["target"] == OTHER] == [r.body], listed
            r = server.call("DELETE", path)
            assert (r.status, r.error) == (403, "org.freedesktop.DBus.Error.AccessDenied"), r
            r = admin.call("DELETE", path)
            assert (r.status, r.body) == (200, {"removed": True}), r
            r = admin.call("DELETE", path)  # none left
            assert (r.status, r.error) == (422, "org.freedesktop.DBus.Error.InvalidArgs"), r
            assert OTHER not in [p["target"] for p in admin.call("GET", "/v1/guard/policies").body["policies"]]
            for where, body, named in (
                ("/v1/guard/policies/team/x", settings, "kind"),
                (path, {"memory_limit": 0}, "memory_limit"),
                (path, {"memory_limit": "8"}, "a bare number is not a size: '8' (write a unit: 8GiB"),
                (path, {"memory_limit": 4096}, "memory_limit: a limit of 4096 is under 1 MiB, likely a mistake"),
                (path, {"grace": "5 parsecs"}, "not a duration: '5 parsecs'"),
                (path, {"memory": 1}, "memory"),
                (path, {}, "at least one limit"),
                ("/v1/guard/policies/user/a%00b", settings, "NUL"),
                (f"/v1/guard/policies/user/{OTHER}?force=1", settings, "force"),
                ("/v1/guard/policies/gpu/0", {"process_limit": 2}, "process_limit does not apply"),
            ):
                r = admin.call("PUT", where, body)
                assert (r.status, r.error) == (422, "org.freedesktop.DBus.Error.InvalidArgs"), (where, body, r)
                assert named in r.body["message"], (where, body, r)
        changes = bed.wait_journal(
            MESSAGE_ID=audit.GUARD_MANAGED_POLICY.message_id,
            GPUKILL_POLICY_TARGET=OTHER,
            GPUKILL_CALLER_UID=str(users["admin"].uid),
        )
        assert {"set", "remove"} <= {e["GPUKILL_OPERATION"] for e in changes if e["GPUKILL_RESULT"] == "changed"}
    finally:
        admin.stop()
