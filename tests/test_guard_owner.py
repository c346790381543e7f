"""The notify target `owner`: the subject's owner warned on their terminals (real ptys owned by the test
users, named in a utmp file of glibc's format), by mail at the address gpukilld.conf's owner_mail template gives
(aiosmtpd), and on the desktop; each delivery reported for the audit. A terminal nobody reads never holds send()
or the channel; another user's terminal gets nothing; mesg n is respected."""

from __future__ import annotations

import email
import email.policy
import os
import struct
import subprocess
import threading
import time

import pytest

pytest.importorskip("aiosmtpd.controller", reason="aiosmtpd is in the test extra (pip install -e .[test])")

from helpers.sinks import smtp_relay  # noqa: E402
from helpers.testbed import ROOT  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

from gpukill.policy import load_texts  # noqa: E402
from gpukilld.config import ConfigError, load_config  # noqa: E402
from gpukilld.guard import notify, owner_tty  # noqa: E402
from gpukilld.guard.notify import Notice, Notifier, NotifyConfig, owner_address  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chowns ptys to the test users: needs root")

UTMP = struct.Struct("=h2xi32s4s32s256shhi2i4i20s")


def notice(uid: int, name: str = "note\x1b]0;pwned\x07book") -> Notice:
    return Notice(
        "warning",
        "reclaim-idle",
        f"PID 4242 ({name})",
        f"reclaim-idle: PID 4242 ({name}) will be stopped in 5m",
        f"Rule: reclaim-idle\nProcess: 4242 ({name}) on GPU 0, 4.0 GiB\nWhat to do: release the GPU or ask the admin\n",
        {"uid": uid, "pids": [4242]},
    )


class Pty:
    """A login session: a real pty, its slave owned by the user as login(1) leaves it (group tty)."""

    def __init__(self, user, mesg: bool = True) -> None:
        self.master, self.slave = os.openpty()
        self.path = os.ttyname(self.slave)
        os.chown(self.path, user.uid, 5)
        os.chmod(self.path, 0o620 if mesg else 0o600)
        os.set_blocking(self.master, False)
        self.user = user

    def record(self) -> bytes:
        line = self.path.removeprefix("/dev/").encode()
        return UTMP.pack(
            7,
            os.getpid(),
            line,
            line[-4:],
            self.user.name.encode(),
            b"ssh.example",
            0,
            0,
            0,
            int(time.time()),
            0,
            0,
            0,
            0,
            0,
            b"",
        )

    def read(self) -> bytes:
        out = b""
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except BlockingIOError:
                return out
            if not chunk:
                return out
            out += chunk

    def fill(self) -> None:
        """Write to the slave until the pty takes no more: a terminal nobody reads. The kernel moves written
        bytes on to the master asynchronously, so it is full once it has refused for half a second."""
        os.set_blocking(self.slave, False)
        refused_since = None
        while refused_since is None or time.monotonic() - refused_since < 0.5:
            try:
                os.write(self.slave, b"x" * 4096)
                refused_since = None
            except BlockingIOError:
                refused_since = refused_since or time.monotonic()
                time.sleep(0.01)

    def close(self) -> None:
        os.close(self.master)
        os.close(self.slave)


class Recorder:
    def __init__(self) -> None:
        self.warned: list[tuple[str, str, str, str]] = []
        self.desktop: list[Notice] = []
        self.cond = threading.Condition()

    def on_warned(self, channel: str, target: str, n: Notice, outcome: str, detail: str) -> None:
        with self.cond:
            self.warned.append((channel, target, outcome, detail))
            self.cond.notify_all()

    def wait(self, count: int, timeout: float = 5.0) -> list[tuple[str, str, str, str]]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.warned) >= count, timeout)
            return list(self.warned)


@pytest.fixture
def ptys(users, tmp_path):
    made: list[Pty] = []

    def make(user, mesg: bool = True) -> Pty:
        made.append(Pty(user, mesg))
        (tmp_path / "utmp").write_bytes(b"".join(p.record() for p in made))
        return made[-1]

    yield make
    for p in made:
        p.close()


def notifier(rec: Recorder, tmp_path, **kw) -> Notifier:
    kw.setdefault("logind_bus", None)  # utmp's path; test_the_terminals_of_logind_sessions asks a logind
    config = NotifyConfig(utmp=str(tmp_path / "utmp"), smtp_host="127.0.0.1", **kw)
    return Notifier(config, lambda *a: None, lambda n: None, rec.desktop.append, rec.on_warned)


def test_the_owner_reads_the_warning_escaped_and_another_users_terminal_gets_nothing(users, ptys, tmp_path):
    mine, theirs = ptys(users["owner"]), ptys(users["other"])
    rec = Recorder()
    n = notifier(rec, tmp_path)
    try:
        n.send(("owner",), notice(users["owner"].uid))
        assert n.wait_idle(5)
        got = rec.wait(2)
        text = mine.read()
        assert b"Message from gpukilld@" in text and b"will be stopped in 5m" in text and b"What to do" in text
        assert b"\x1b" not in text and b"note\\x1b]0;pwned\\x07book" in text  # the name's escape sequence, shown
        assert theirs.read() == b""
        assert ("tty", mine.path, "written", "") in got and (
            "desktop",
            f"uid {users['owner'].uid}",
            "signalled",
            "",
        ) in got
        assert len(rec.desktop) == 1
        n.send(("owner", "desktop"), notice(users["owner"].uid))
        assert n.wait_idle(5) and len(rec.desktop) == 2  # one signal for both targets
    finally:
        n.close()


def test_a_terminal_claimed_by_utmp_for_the_owner_but_owned_by_another_uid_is_refused(users, ptys, tmp_path):
    forged = ptys(users["owner"])
    os.chown(forged.path, users["other"].uid, 5)  # utmp says owner; the tty says other: the tty wins
    rec = Recorder()
    n = notifier(rec, tmp_path)
    try:
        n.send(("owner",), notice(users["owner"].uid))
        (tty,) = [w for w in rec.wait(2) if w[0] == "tty"]
        assert tty[2] == "skipped" and f"belongs to uid {users['other'].uid}" in tty[3]
        assert forged.read() == b""
    finally:
        n.close()


def test_mesg_n_is_respected_unless_the_config_ignores_it(users, ptys, tmp_path):
    quiet = ptys(users["owner"], mesg=False)
    rec = Recorder()
    n = notifier(rec, tmp_path)
    try:
        n.send(("owner",), notice(users["owner"].uid))
        (tty,) = [w for w in rec.wait(2) if w[0] == "tty"]
        assert tty[2] == "skipped" and "mesg n" in tty[3] and quiet.read() == b""
        assert n.wait_idle(5) and (n.stats()["tty"].delivered, n.stats()["tty"].skipped) == (0, 1)
    finally:
        n.close()
    rec = Recorder()
    n = notifier(rec, tmp_path, owner_mesg=False)
    try:
        n.send(("owner",), notice(users["owner"].uid))
        assert n.wait_idle(5) and b"will be stopped" in quiet.read()
    finally:
        n.close()


def test_a_warning_counts_as_delivered_only_when_a_terminal_took_it(users, ptys, tmp_path):
    """No login session: skipped, as the journal says, never delivered; with the owner's terminal: delivered."""
    owner = users["owner"]
    (tmp_path / "utmp").write_bytes(b"")
    rec = Recorder()
    n = notifier(rec, tmp_path)
    try:
        n.send(("owner",), notice(owner.uid))
        assert n.wait_idle(5)
        assert ("tty", f"uid {owner.uid}", "skipped", "no login session with a terminal") in rec.wait(2)
        tty = n.stats()["tty"]
        assert (tty.queued, tty.delivered, tty.skipped, tty.failed) == (1, 0, 1, 0)
        mine = ptys(owner)
        n.send(("owner",), notice(owner.uid))
        assert n.wait_idle(5) and b"will be stopped in 5m" in mine.read()
        assert (tty.queued, tty.delivered, tty.skipped, tty.failed) == (2, 1, 1, 0)
        assert n.stats()["desktop"].announced == 2  # the owner's desktop: announced, whoever shows it
    finally:
        n.close()


def test_a_warning_without_a_single_owner_is_counted_skipped(users, tmp_path):
    rec = Recorder()
    n = notifier(rec, tmp_path, owner_mail="{user}@example.org")
    try:
        n.send(("owner",), Notice("violation", "per-gpu", "GPU 0", "per-gpu: GPU 0", "Rule: per-gpu\n", {"uid": None}))
        assert ("owner", "", "skipped", "the subject has no single owner") in rec.wait(1)
        assert n.stats()["tty"].skipped == 1 and n.stats()["owner-mail"].skipped == 1
        assert n.stats()["tty"].queued == 0 and n.stats()["desktop"].announced == 0
    finally:
        n.close()


def test_a_full_terminal_nobody_reads_delays_neither_send_nor_the_next_warning(users, ptys, tmp_path):
    full = ptys(users["owner"])
    full.fill()
    rec = Recorder()
    n = notifier(rec, tmp_path)
    try:
        started = time.monotonic()
        for _ in range(3):
            n.send(("owner",), notice(users["owner"].uid))
        assert time.monotonic() - started < 0.1
        assert n.wait_idle(5)
        ttys = [w for w in rec.wait(6) if w[0] == "tty"]
        assert len(ttys) == 3 and all(w[2] == "failed" and "full" in w[3] for w in ttys), ttys
        tty = n.stats()["tty"]
        assert (tty.delivered, tty.skipped, tty.failed) == (0, 0, 3)
        assert time.monotonic() - started < 2
    finally:
        n.close()


def test_one_owners_4096_terminals_do_not_delay_another_owners_warning(users, ptys, tmp_path):
    """bob registers 4,096 terminals in utmp (utempter lets a user add their own ptys): 256 real ones and the
    rest named, and has 40 warnings queued; alice's one warning, sent after them all, is written after at most
    one of bob's, within half a second, and each of bob's warnings writes at most MAX_TTYS terminals."""
    bob, alice = users["other"], users["owner"]
    hers = ptys(alice)
    his = [Pty(bob) for _ in range(256)]
    try:
        named = [
            UTMP.pack(
                7,
                os.getpid(),
                f"pts/{90000 + i}".encode(),
                b"%04d" % i,
                bob.name.encode(),
                b"",
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                b"",
            )
            for i in range(4096 - len(his))
        ]
        (tmp_path / "utmp").write_bytes(hers.record() + b"".join(p.record() for p in his) + b"".join(named))
        rec = Recorder()
        n = notifier(rec, tmp_path)
        try:
            for _ in range(40):
                n.send(("owner",), notice(bob.uid, "bobs-job"))
            sent = time.monotonic()
            n.send(("owner",), notice(alice.uid, "alices-job"))
            wait_until(
                lambda: b"alices-job" in hers.read(), 5, "alice's warning never reached her terminal", interval=0.01
            )
            took = time.monotonic() - sent
            before = [w for w in rec.warned if w[0] == "tty"]
            assert took < 0.5, f"alice waited {took:.2f} s behind bob's warnings"
            bobs = {w[1] for w in before if not w[1].endswith(hers.path)}
            assert len([w for w in before if w[1] == his[0].path]) <= 2, "alice waited behind more than one of bob's"
            assert n.wait_idle(30)
            per_warning = [w for w in rec.warned if w[0] == "tty" and w[1] == his[0].path]
            dropped = n.stats()["tty"].dropped
            assert len(per_warning) + dropped == 40 and dropped >= 40 - notify.PER_OWNER - 1, (
                len(per_warning),
                dropped,
            )
            written = {w[1] for w in rec.warned if w[0] == "tty" and w[2] in ("written", "partial")}
            assert len(written - {hers.path}) <= owner_tty.MAX_TTYS, len(written)
            assert any("more terminals" in w[1] and w[2] == "skipped" for w in rec.warned), bobs
        finally:
            n.close()
    finally:
        for p in his:
            p.close()


def test_the_owner_mail_goes_to_the_address_the_template_gives(users, ptys, tmp_path):
    with smtp_relay() as (box, port):
        rec = Recorder()
        n = notifier(rec, tmp_path, smtp_port=port, owner_mail="{user}@example.org")
        try:
            n.send(("owner",), notice(users["owner"].uid))
            assert box.wait(1), rec.wait(3)
            _from, rcpts, content = box.messages[0]
            assert rcpts == [f"{users['owner'].name}@example.org"] and b"What to do: release the GPU" in content
            assert ("mail", f"{users['owner'].name}@example.org", "delivered", "") in rec.wait(3)
        finally:
            n.close()


def test_owner_address_is_checked_after_the_template():
    assert owner_address("{user}@example.org", 0) == "root@example.org"
    assert owner_address("{uid}", 0) == "0"
    assert owner_address("{user}@example.org", 2**31 - 2) is None  # no such user: no mail


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("owner_mail = admin@example.org", "must name the user"),
        ("owner_mail = {user}@example.org, boss@example.org", "one address"),
        ("owner_mail = {user}@exa\\mple.org", "one address"),
        ("owner_mesg = sometimes", "respect or ignore"),
    ],
)
def test_a_bad_owner_mail_template_is_refused_at_its_line(tmp_path, line, says):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(f"[notify]\nsmtp_host = localhost\n{line}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(conf))
    assert f"{conf}:3:" in str(e.value) and says in str(e.value), str(e.value)


def test_owner_mail_and_mesg_reach_the_notifier(tmp_path):
    from gpukilld.guard.runner import notify_config

    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[notify]\nowner_mail = {user}@example.org\nowner_mesg = ignore\n")
    config = notify_config(load_config(str(conf)))
    assert config.owner_mail == "{user}@example.org" and config.owner_mesg is False


def test_owner_is_a_notify_target_of_a_policy():
    p = load_texts(
        [
            (
                "o.yaml",
                "rules:\n  - name: r\n    conditions:\n      - {type: gpu_utilization, operator: '<', "
                "value: 5}\n    action: notify\n    notify: [owner, journal]\n",
            )
        ]
    )
    assert p.rules[0].notify == ("owner", "journal")


LOGIND_BUS = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>session</type><listen>unix:path={socket}</listen><auth>EXTERNAL</auth>
  <policy context="default"><allow user="*"/><allow send_destination="*" eavesdrop="true"/><allow eavesdrop="true"/>
    <allow own="*"/></policy>
</busconfig>
"""


@pytest.fixture
def logind(tmp_path):
    """python-dbusmock's logind template on a private bus: the address, and add(uid, name, tty) for a session."""
    from helpers.desktop_session import dbusmock_missing
    from helpers.testbed import SYSTEM_PYTHON, _kill_group
    from helpers.waiting import wait_until
    from jeepney import DBusAddress, Properties, new_method_call
    from jeepney.io.blocking import open_dbus_connection

    if why := dbusmock_missing():
        pytest.skip(why)
    socket_path = tmp_path / "logind-bus"
    (tmp_path / "logind.conf").write_text(LOGIND_BUS.format(socket=socket_path))
    address = f"unix:path={socket_path}"
    bus = subprocess.Popen(
        ["dbus-daemon", f"--config-file={tmp_path / 'logind.conf'}", "--nofork", "--nopidfile"], start_new_session=True
    )
    mock = None
    try:
        wait_until(socket_path.exists, 10, "the bus did not create its socket")
        mock = subprocess.Popen(
            [SYSTEM_PYTHON, "-m", "dbusmock", "--template", "logind"],
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "DBUS_SYSTEM_BUS_ADDRESS": address},  # a system template
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        conn = open_dbus_connection(bus=address)
        manager = DBusAddress("/org/freedesktop/login1", "org.freedesktop.login1", "org.freedesktop.DBus.Mock")
        wait_until(
            lambda: conn.send_and_get_reply(
                new_method_call(
                    DBusAddress("/org/freedesktop/DBus", "org.freedesktop.DBus", "org.freedesktop.DBus"),
                    "NameHasOwner",
                    "s",
                    ("org.freedesktop.login1",),
                )
            ).body[0],
            15,
            "the logind mock did not take its name",
        )
        count = iter(range(1, 100))

        def add(uid: int, name: str, tty: str) -> None:
            path = conn.send_and_get_reply(
                new_method_call(manager, "AddSession", "ssusb", (f"c{next(count)}", "seat0", uid, name, True))
            ).body[0]
            session = DBusAddress(path, "org.freedesktop.login1", "org.freedesktop.login1.Session")
            conn.send_and_get_reply(Properties(session).set("TTY", "s", tty))

        yield address, add
        conn.close()
    finally:
        for p in (mock, bus):
            if p is not None:
                _kill_group(p)


def test_the_terminals_of_logind_sessions_are_found_there_and_checked_as_utmps(users, ptys, tmp_path, logind):
    address, add = logind
    owner, other = users["owner"], users["other"]
    mine, theirs = ptys(owner), ptys(other)
    (tmp_path / "utmp").write_bytes(b"")  # nothing in utmp: what reaches the terminal came through logind
    add(owner.uid, owner.name, mine.path.removeprefix("/dev/"))  # pts/N, as logind has it
    add(other.uid, other.name, theirs.path.removeprefix("/dev/"))
    add(owner.uid, owner.name, theirs.path)  # a session of the owner's naming the other user's terminal
    rec = Recorder()
    n = notifier(rec, tmp_path, logind_bus=address)
    try:
        n.send(("owner",), notice(owner.uid))
        assert n.wait_idle(5)
        got = rec.wait(3)
        assert b"will be stopped in 5m" in mine.read()
        assert theirs.read() == b""
        assert ("tty", mine.path, "written", "") in got
        assert ("tty", theirs.path, "skipped", f"{theirs.path} belongs to uid {other.uid}, not {owner.uid}") in got
    finally:
        n.close()


# -- in the daemon: the owner's pty named in a utmp bind-mounted over /run/utmp, in the daemon's own mount namespace

OWNER_RULE = (
    "rules:\n  - name: idle-owner\n    action: kill\n    grace_period: 2s\n    warn: [at_start, 1s]\n"
    "    notify: [owner]\n    conditions:\n"
    "      - {type: gpu_memory, operator: '>', value: 1GiB}\n"
    "      - {type: gpu_utilization, operator: '<', value: 5, duration: 1s, over: mean}\n"
)


def _utmp_of_the_daemon(bed, utmp) -> None:
    """The daemon started next reads utmp as /run/utmp: bound over it in a mount namespace of its own."""
    enter = bed.in_journal_ns
    bed.in_journal_ns = lambda argv: enter(
        [  # type: ignore[method-assign]
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            '[ -e /run/utmp ] || : > /run/utmp; mount --bind "$0" /run/utmp && exec "$@"',
            str(utmp),
            *argv,
        ]
    )


def test_in_the_daemon_the_owner_is_warned_on_a_full_terminal_and_still_killed_at_the_end_of_the_grace(
    fresh_bed, users, ptys, tmp_path
):
    from gpukilld import journal as audit

    bed = fresh_bed
    mine, theirs, full = ptys(users["owner"]), ptys(users["other"]), ptys(users["owner"])
    full.fill()  # a terminal nobody reads
    _utmp_of_the_daemon(bed, tmp_path / "utmp")
    (bed.workdir / "guard.d").mkdir(exist_ok=True)
    (bed.workdir / "guard.d" / "10-idle.yaml").write_text(OWNER_RULE)
    bed.start_daemon(args=["--sample-interval", "0.2"])
    t0 = time.monotonic()
    victim = bed.victim(users["owner"], gpu=0, util=0, mem="4GiB", comm="note\x1b]0;x")
    deadline = time.monotonic() + 20
    while victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    t_exit = time.monotonic()
    assert victim.returncode is not None and victim.returncode < 0, "not killed"
    assert t_exit - t0 <= 1 + 2 + 3, t_exit - t0  # duration + grace + slack: the full terminal cost nothing
    entries = bed.wait_journal(
        MESSAGE_ID=audit.GUARD_WARNING.message_id, GPUKILL_CHANNEL="tty", GPUKILL_TARGET=full.path
    )
    assert entries and all(e["GPUKILL_OUTCOME"] == "failed" for e in entries), entries
    written = bed.journal(MESSAGE_ID=audit.GUARD_WARNING.message_id, GPUKILL_CHANNEL="tty", GPUKILL_TARGET=mine.path)
    assert written and written[0]["GPUKILL_OUTCOME"] == "written"
    text = mine.read()
    assert b"idle-owner" in text and b"\x1b" not in text and b"note\\x1b]0;x" in text
    assert theirs.read() == b""


def test_only_terminal_lines_of_utmp_are_ever_opened(users, tmp_path):
    from gpukilld.guard.owner_tty import user_ttys

    records = b"".join(
        UTMP.pack(7, 1, line, b"x", b"gpkowner", b"", 0, 0, 0, 0, 0, 0, 0, 0, 0, b"")
        for line in (b"watchdog", b"../sda", b":0", b"pts/../../sda", b"tty", b"pts/3", b"tty1")
    )
    (tmp_path / "utmp").write_bytes(
        records + UTMP.pack(8, 1, b"pts/4", b"x", b"", b"", 0, 0, 0, 0, 0, 0, 0, 0, 0, b"")
    )  # DEAD_PROCESS: a session that ended
    assert user_ttys(users["owner"].uid, str(tmp_path / "utmp")) == ("/dev/pts/3", "/dev/tty1")


TELL_RULE = (
    "rules:\n  - name: tell-owner\n    action: notify\n"
    "    notify: [owner, admin@company.com, desktop, journal]\n"
    "    conditions: [{type: process_name, operator: contains_any, value: [gk]}]\n"
)


def _lines_from(text: str) -> list[str]:
    return [line for line in text.replace("\r\n", "\n").split("\n") if line.startswith("Forged")]


def test_in_the_daemon_a_newline_in_a_name_adds_no_line_to_any_notice_and_each_delivery_is_counted(
    fresh_bed, users, ptys, tmp_path
):
    """A process named "gk\\nForged: yes" (prctl PR_SET_NAME): its name stays inside its line on the owner's
    terminal, in the owner's and the admin's mail (Subject and body), in the desktop's Notification and in the
    journal target's MESSAGE (its fields keep the exact name). guard status counts the tty delivered with the owner's
    terminal, skipped without one."""
    from gpukilld import journal as audit

    bed = fresh_bed
    owner = users["owner"]
    mine = ptys(owner)
    _utmp_of_the_daemon(bed, tmp_path / "utmp")
    with smtp_relay() as (box, port):
        (bed.workdir / "guard.d").mkdir(exist_ok=True)
        (bed.workdir / "guard.d" / "10-tell.yaml").write_text(TELL_RULE)
        bed.write_conf(
            notify={
                "smtp_host": "127.0.0.1",
                "smtp_port": port,
                "from": "gpukilld@test.example",
                "owner_mail": "{user}@example.org",
            }
        )
        bed.start_daemon(args=["--sample-interval", "0.2"])
        rec = bed.record_signals(owner)
        victim = bed.victim(owner, gpu=0, comm="gk\nForged: yes")
        escaped = "gk\\x0aForged: yes"

        note = rec.wait_for("Notification", where=lambda b: b[1] == "tell-owner")
        assert note is not None
        _uid, _rule, summary, body = note["body"]
        assert escaped in summary and "\n" not in summary and escaped in body and not _lines_from(body), body

        assert box.wait(2), box.messages
        for _from, rcpts, content in box.messages:
            mail = email.message_from_bytes(content, policy=email.policy.default)
            assert mail["Forged"] is None and escaped in mail["Subject"], (rcpts, mail["Subject"])
            text = mail.get_content()
            assert escaped in text and not _lines_from(text), (rcpts, text)
        assert sorted(r for _f, rcpts, _c in box.messages for r in rcpts) == [
            "admin@company.com",
            f"{owner.name}@example.org",
        ]

        assert bed.wait_journal(
            MESSAGE_ID=audit.GUARD_WARNING.message_id, GPUKILL_CHANNEL="tty", GPUKILL_OUTCOME="written"
        )
        text = mine.read().decode()
        assert escaped in text and not _lines_from(text), text

        entries = bed.wait_journal(MESSAGE_ID=audit.GUARD_NOTICE.message_id, GPUKILL_RULE="tell-owner")
        assert entries and escaped in entries[0]["MESSAGE"] and "\n" not in entries[0]["MESSAGE"]
        assert entries[0]["GPUKILL_SUBJECT"] == f"PID {victim.pid} (gk\nForged: yes, user {owner.name})"

        (tmp_path / "utmp").write_bytes(b"")  # the owner logs out; the same file, bound in the daemon's namespace
        bed.victim(owner, gpu=1, comm="gk again")
        assert bed.wait_journal(
            MESSAGE_ID=audit.GUARD_WARNING.message_id, GPUKILL_CHANNEL="tty", GPUKILL_OUTCOME="skipped"
        )

        def counts() -> dict:
            r = bed.guard_call(ROOT, "GetStatus")
            assert r.ok, r
            return r.body[0]["notifications"]

        assert wait_until(lambda: counts()["owner-mail"]["delivered"] == 2, 10, fail=False), counts()
        got = counts()
        assert {k: got["tty"][k] for k in ("queued", "delivered", "skipped", "failed")} == {
            "queued": 2,
            "delivered": 1,
            "skipped": 1,
            "failed": 0,
        }
        assert got["email"]["delivered"] == 2 and got["desktop"]["announced"] == 2, got
        cli = bed.ctl(ROOT, "guard", "status")
        assert cli.returncode == 0, cli
        assert "  tty: 1 delivered, 1 skipped, 0 failed, 0 dropped" in cli.stdout.splitlines(), cli.stdout
        assert "  desktop: 2 announced (signalled on the bus; shown or not, no agent says)" in cli.stdout, cli.stdout
