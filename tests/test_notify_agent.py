"""`gpukillctl notify-agent` with real components: our gpukilld on the private system bus, a real
notification server (python-dbusmock's notification_daemon) on a private session bus of gpkowner's, and the
agent running as gpkowner. What the server received is read back with its GetCalls.

One agent runs for the whole module, as in a desktop session; each test looks only at the Notify calls that
came after its start (`mark`). The tests run in file order: the last ones restart gpukilld, the server and the
agent.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from helpers.desktop_session import MOCK_IFACE, SERVER, SERVER_PATH, DesktopSession, Notify, dbusmock_missing
from helpers.marks import needs_root
from helpers.testbed import ROOT, Testbed, User, _kill_group
from helpers.waiting import wait_until

pytestmark = [needs_root, pytest.mark.skipif(dbusmock_missing() is not None, reason=dbusmock_missing() or "")]

INTERVAL = 0.2
GRACE = 3
HOG_POLICY = f"""\
rules:
  - name: "no-hogs"
    description: "processes named gpuhog are stopped"
    conditions:
      - type: "process_name"
        operator: "contains_any"
        value: ["gpuhog"]
    action: "kill"
    grace_period: "{GRACE}s"
"""
CRITICAL, NORMAL = 2, 1
BURST = 100


@pytest.fixture(scope="module")
def desk(users):
    """The bed with Guard set up, gpkowner's session with a notification server, and the agent in it."""
    bed = Testbed()
    try:
        (bed.workdir / "guard.d").mkdir()
        bed.write_conf()
        bed.start_system(args=["--sample-interval", str(INTERVAL)])
        session = DesktopSession(bed, users["owner"])
        session.start_bus()
        session.start_server()
        agent = session.start_agent()
        _warm_up(bed, session, users["owner"])
        yield bed, session, agent
    finally:
        bed.stop()


def _kill(bed: Testbed, pid: int) -> None:
    bed.wait_listed(pid)
    r = bed.ctl(ROOT, "kill", str(pid))
    assert r.returncode == 0, r


def _warm_up(bed: Testbed, session: DesktopSession, owner: User) -> None:
    """Until the agent has subscribed on the system bus (nothing tells when), a kill may go unseen: kill
    throwaway processes until one is shown."""
    for _ in range(10):
        before = len(session.notifications())
        victim = bed.victim(owner, gpu=0, comm="warmup")
        _kill(bed, victim.pid)
        if wait_until(lambda b=before: len(session.notifications()) > b, 3, fail=False):
            return
    raise AssertionError(f"the agent never showed a kill:\n{session.agent_log()}")


def _since(session: DesktopSession, mark: int) -> list[Notify]:
    return session.notifications()[mark:]


def test_a_kill_of_the_users_process_is_one_notification_and_another_users_is_none(desk, users):
    bed, session, agent = desk
    mark = len(session.notifications())
    theirs = bed.victim(users["other"], gpu=1, comm="theirs")
    mine = bed.victim(users["owner"], gpu=0, comm="a<b>&c\x1b[1m")  # a name with markup and an escape
    _kill(bed, theirs.pid)
    _kill(bed, mine.pid)  # after the other's: once this one is shown, the other's was seen and passed over
    shown = wait_until(lambda: _since(session, mark), 10, "no notification for the kill")
    time.sleep(1.0)  # nothing more comes
    shown = _since(session, mark)
    assert len(shown) == 1, shown
    n = shown[0]
    assert n.replaces_id == 0 and n.urgency == NORMAL
    assert n.summary == f"GPU process stopped: a<b>&c\\x1b[1m (PID {mine.pid})"  # plain text: only escapes
    assert n.body == (
        f"a&lt;b&gt;&amp;c\\x1b[1m (PID {mine.pid}) on GPU-8f1c6a2e-0b7d-4c1e-9a55-3d2e7f10a001: "
        "terminated, asked by root."
    )  # the server reads body markup: <, >, & escaped
    assert agent.poll() is None


def _hog_stopped(bed: Testbed, session: DesktopSession, owner: User, comm: str):
    """A process of owner's named comm, stopped by HOG_POLICY's rule at the end of its grace: (the process, the
    mark of the notifications before it, those that said it was terminated)."""
    policy = bed.workdir / "hogs.yaml"
    policy.write_text(HOG_POLICY)
    bed.enforce(policy)
    mark = len(session.notifications())
    try:
        hog = bed.victim(owner, gpu=2, comm=comm)
        wait_until(lambda: hog.poll() is not None, GRACE + 10, "the hog was not stopped")
        final = wait_until(
            lambda: [n for n in _since(session, mark) if "terminated" in n.body],
            10,
            lambda: f"no outcome notification: {_since(session, mark)}",
        )
    finally:
        assert bed.ctl(ROOT, "guard", "disable").returncode == 0
    return hog, mark, final


def test_a_guard_grace_is_a_critical_countdown_replaced_in_place_by_the_outcome(desk, users):
    bed, session, agent = desk
    hog, mark, final = _hog_stopped(bed, session, users["owner"], "gpuhog")
    time.sleep(2.5)  # a ProcessKilled left unclaimed would show by itself after 2 s
    shown = _since(session, mark)
    first, rest = shown[0], shown[1:]
    assert first.replaces_id == 0 and first.urgency == CRITICAL, shown
    subject = f"PID {hog.pid} (gpuhog, user gpkowner)"
    assert first.summary == f"{subject} will be stopped in {GRACE}s", shown
    assert first.body == (
        "Guard rule no-hogs: process_name contains_any [gpuhog].\n"
        f"It gets SIGTERM in {GRACE}s unless it comes back within the rule."
    )
    popup = sum(n.replaces_id == 0 for n in session.notifications()[: mark + 1])  # the server's ids count from 1
    assert all(n.replaces_id == popup for n in rest), ("one pop-up, updated in place", shown)
    countdown = [n for n in rest if n.urgency == CRITICAL]
    assert [n.summary for n in countdown][:2] == [
        f"{subject} will be stopped in {GRACE - 1}s",
        f"{subject} will be stopped in {GRACE - 2}s",
    ]
    assert rest[-1] == final[-1] and final[-1].urgency == NORMAL  # the ProcessKilled made no pop-up of its own
    assert final[-1].summary == f"Guard rule no-hogs: gpuhog (PID {hog.pid}) terminated"
    assert (
        final[-1].body == f"Guard rule no-hogs: process_name contains_any [gpuhog].\ngpuhog (PID {hog.pid}) terminated."
    )
    assert agent.poll() is None


def test_a_newline_in_a_process_name_adds_no_line_to_any_pop_up(desk, users):
    """The hog names itself "gpuhog\\nForged": its countdown, its outcome and a kill of the user's own process
    each name it inside one line of the pop-up."""
    bed, session, agent = desk
    hog, mark, _final = _hog_stopped(bed, session, users["owner"], "gpuhog\nForged")
    mine = bed.victim(users["owner"], gpu=0, comm="mine\nForged")
    _kill(bed, mine.pid)
    wait_until(
        lambda: [n for n in _since(session, mark) if f"PID {mine.pid}" in n.summary],
        10,
        lambda: f"no notification for the kill: {_since(session, mark)}",
    )
    shown = _since(session, mark)
    assert any(
        n.summary == f"PID {hog.pid} (gpuhog\\x0aForged, user gpkowner) will be stopped in {GRACE}s" for n in shown
    ), shown
    assert any(n.body.endswith(f"gpuhog\\x0aForged (PID {hog.pid}) terminated.") for n in shown), shown
    assert any(n.summary == f"GPU process stopped: mine\\x0aForged (PID {mine.pid})" for n in shown), shown
    for n in shown:
        assert "\n" not in n.summary and not [line for line in n.body.split("\n") if line.startswith("Forged")], n
    assert agent.poll() is None


def test_a_burst_of_100_kills_is_a_handful_of_notifications(desk, users):
    bed, session, agent = desk
    owner = users["owner"]
    env = {"PATH": "/usr/bin:/bin", "GPUKILL_SIM_GPU": "1", "GPUKILL_SIM_SCOPE": bed.scope}
    sleepers = [
        subprocess.Popen(["sleep", "600"], env=env, start_new_session=True, **owner.popen_kwargs())
        for _ in range(BURST)
    ]
    bed.procs.extend(sleepers)
    wait_until(lambda: sum(p["device"] == 1 for p in bed.processes()) >= BURST, 15, "the sleepers are not listed")
    mark = len(session.notifications())
    t0 = time.monotonic()
    r = bed.ctl(ROOT, "reset", "1", "--force")  # stops every process on the GPU, one ProcessKilled each
    assert r.returncode == 0, r
    assert all(p.wait(10) is not None for p in sleepers)
    assert time.monotonic() - t0 < 3, "not a burst"
    # On a loaded machine the burst's signals may reach the agent over more than one of its windows, and each
    # window then makes a summary of its own: wait until every kill is shown or counted, then count pop-ups.
    wait_until(
        lambda: _accounted(_since(session, mark)) >= BURST,
        20,
        lambda: f"{_accounted(_since(session, mark))} of {BURST} kills shown or counted",
    )
    time.sleep(1.0)
    shown = _since(session, mark)
    summaries = [n for n in shown if _held(n)]
    assert summaries, shown
    assert len(shown) <= 5 * len(summaries), shown
    assert len(summaries) <= 3, ("a burst over at most a few windows", [n.summary for n in shown])
    assert all(n.replaces_id == 0 for n in shown)
    assert _accounted(shown) == BURST, "every kill is shown or counted, once"
    for summary in summaries:  # the summary lists the first six it holds and counts the rest
        assert summary.body.count("\n") == min(_held(summary), 7) - 1, summary.body
        if _held(summary) > 6:
            assert f"and {_held(summary) - 6} more" in summary.body
    assert agent.poll() is None


def _held(n) -> int:
    """How many kills a summary pop-up ("N GPU notifications at once") stands for; 0 for any other."""
    return int(n.summary.split()[0]) if "GPU notifications at once" in n.summary else 0


def _accounted(shown) -> int:
    """Kills shown one by one or counted in a summary."""
    return sum(_held(n) or 1 for n in shown)


def test_restarting_gpukilld_and_the_notification_server_loses_no_later_event(desk, users):
    bed, session, agent = desk
    owner = users["owner"]
    bed.stop_daemon()
    session.stop_server()
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
    first = bed.victim(owner, gpu=0, comm="during")
    _kill(bed, first.pid)  # the agent hears it and waits for a server
    time.sleep(0.5)
    session.start_server()  # a new server: its own ids, its own calls
    wait_until(lambda: session.notifications(), 10, lambda: f"nothing shown after the restart:\n{session.agent_log()}")
    second = bed.victim(owner, gpu=0, comm="after")
    _kill(bed, second.pid)
    shown = wait_until(
        lambda: len(session.notifications()) >= 2 and session.notifications(),
        10,
        lambda: f"the second kill was not shown: {session.notifications()}",
    )
    assert [n.summary for n in shown] == [
        f"GPU process stopped: during (PID {first.pid})",
        f"GPU process stopped: after (PID {second.pid})",
    ]
    assert all(n.replaces_id == 0 for n in shown)
    assert agent.poll() is None, session.agent_log()


def _new_server(session: DesktopSession, capabilities: str) -> None:
    """A new notification server (a new owner of the name, so the agent asks it again) whose GetCapabilities
    runs this dbusmock code instead of the template's."""
    session.stop_server()
    session.start_server()
    session._call(
        SERVER, SERVER_PATH, MOCK_IFACE, "AddMethod", "sssss", [SERVER, "GetCapabilities", "", "as", capabilities]
    )


def _shown_kill(bed: Testbed, session: DesktopSession, owner: User, comm: str) -> tuple[int, Notify]:
    mark = len(session.notifications())
    victim = bed.victim(owner, gpu=0, comm=comm)
    _kill(bed, victim.pid)
    shown = wait_until(
        lambda: [n for n in _since(session, mark) if f"(PID {victim.pid})" in n.summary],
        10,
        lambda: f"the kill was not shown: {_since(session, mark)}\n{session.agent_log()}",
    )
    return victim.pid, shown[0]


def test_the_body_is_escaped_when_the_servers_capabilities_are_unknown(desk, users):
    """A fresh agent whose first server fails GetCapabilities: the server may read markup, so <, > and & are
    escaped; not knowing is no reason to send a process's name as markup."""
    bed, session, agent = desk
    _kill_group(agent)
    _new_server(session, "raise dbus.exceptions.DBusException('broken', name='org.freedesktop.DBus.Error.Failed')")
    agent = session.start_agent()
    _warm_up(bed, session, users["owner"])
    pid, n = _shown_kill(bed, session, users["owner"], "a<b>&c")
    assert n.body.startswith(f"a&lt;b&gt;&amp;c (PID {pid}) on "), n
    assert n.summary == f"GPU process stopped: a<b>&c (PID {pid})"  # the summary is plain text: as it is
    assert agent.poll() is None, session.agent_log()


def test_the_body_is_sent_as_it_is_to_a_server_that_reads_no_markup(desk, users):
    """A server that answers GetCapabilities without "body-markup" shows the body as plain text: escaping it
    would show `&lt;` to the user."""
    bed, session, _ = desk
    _new_server(session, "ret = ['body', 'actions']")
    pid, n = _shown_kill(bed, session, users["owner"], "x<y>&z")
    assert n.body.startswith(f"x<y>&z (PID {pid}) on "), n
