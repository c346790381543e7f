"""Guard notifications against real servers on loopback: aiosmtpd for e-mail, http.server for webhooks, and a
TCP listener that never answers for a dead relay. send() must return at once whatever the relay does."""

from __future__ import annotations

import dataclasses
import email
import email.policy
import threading
import time

import pytest

pytest.importorskip("aiosmtpd.controller", reason="aiosmtpd is in the test extra (pip install -e .[test])")

from helpers.sinks import Blackhole, Hooks, smtp_relay  # noqa: E402

from gpukilld.guard.notify import Notice, Notifier, NotifyConfig  # noqa: E402

NOTICE = Notice(
    "violation",
    "block-crypto-miners",
    "PID 42 (xmrig, user bob)",
    "block-crypto-miners: PID 42 violates",
    "Rule: block-crypto-miners\n",
    {"event": "violation", "rule": "block-crypto-miners", "pids": [42]},
)


@pytest.fixture
def smtp_server():
    with smtp_relay() as relay:
        yield relay


class Recorder:
    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []
        self.journal: list[Notice] = []
        self.desktop: list[Notice] = []
        self.cond = threading.Condition()

    def failed(self, target: str, notice: Notice, error: str) -> None:
        with self.cond:
            self.failures.append((target, error))
            self.cond.notify_all()

    def notifier(self, config: NotifyConfig) -> Notifier:
        return Notifier(config, self.failed, self.journal.append, self.desktop.append)


def test_email_reaches_a_real_smtp_server(smtp_server):
    box, port = smtp_server
    rec = Recorder()
    n = rec.notifier(NotifyConfig(smtp_port=port, smtp_host="127.0.0.1", mail_from="gpukilld@test.example"))
    try:
        n.send(("admin@company.com", "ops@company.com", "journal", "desktop"), NOTICE)
        assert box.wait(1), rec.failures
        mail_from, rcpts, content = box.messages[0]
        assert mail_from == "gpukilld@test.example" and rcpts == ["admin@company.com", "ops@company.com"]
        text = content.decode()
        assert "Subject: [gpukill] block-crypto-miners: PID 42 violates" in text
        assert "X-Gpukill-Rule: block-crypto-miners" in text and "Rule: block-crypto-miners" in text
        assert [x.rule for x in rec.journal] == ["block-crypto-miners"] and len(rec.desktop) == 1
        assert n.wait_idle(5) and n.stats()["email"].delivered == 1
    finally:
        n.close()


def test_webhook_posts_json():
    hooks = Hooks()
    rec = Recorder()
    n = rec.notifier(NotifyConfig())
    try:
        n.send((f"webhook:http://127.0.0.1:{hooks.port}/gpu/alerts",), NOTICE)
        assert hooks.wait(1)
        path, body, ctype = hooks.posts[0]
        assert path == "/gpu/alerts" and ctype == "application/json"
        assert body == {"event": "violation", "rule": "block-crypto-miners", "pids": [42]}
    finally:
        n.close()
        hooks.close()


def test_failures_are_retried_then_reported():
    hooks = Hooks(status=503)
    rec = Recorder()
    n = rec.notifier(NotifyConfig(retries=3, backoff=0.05))
    try:
        n.send((f"webhook:http://127.0.0.1:{hooks.port}/x",), NOTICE)
        with rec.cond:
            assert rec.cond.wait_for(lambda: rec.failures, 15)
        assert len(hooks.posts) == 3  # three attempts reached the endpoint
        assert "HTTP 503" in rec.failures[0][1] and n.stats()["webhook"].failed == 1
    finally:
        n.close()
        hooks.close()


def test_a_blackholed_relay_never_blocks_send_nor_other_channels():
    hole = Blackhole()
    hooks = Hooks()
    rec = Recorder()
    n = rec.notifier(NotifyConfig(smtp_host="127.0.0.1", smtp_port=hole.port, timeout=3.0, retries=2, backoff=0.1))
    try:
        t0 = time.monotonic()
        for _ in range(20):
            n.send(("admin@company.com", f"webhook:http://127.0.0.1:{hooks.port}/x"), NOTICE)
        # wall time, as a send() that waited for the relay would spend it asleep: one such wait is 3 s, 20
        # of them a minute; 20 enqueues take milliseconds, and 2 s leaves room for a loaded machine
        assert time.monotonic() - t0 < 2.0, "send() must only enqueue"
        assert hooks.wait(20, timeout=10), "webhooks must not queue behind a dead SMTP relay"
        with rec.cond:  # the first e-mail fails after 2 attempts of 3 s each
            assert rec.cond.wait_for(lambda: rec.failures, 30)
        assert "timed out" in rec.failures[0][1] and rec.failures[0][0] == "('admin@company.com',)"
    finally:
        n.close()
        hooks.close()
        hole.close()


def test_the_queue_is_bounded():
    hole = Blackhole()
    rec = Recorder()
    n = rec.notifier(NotifyConfig(smtp_host="127.0.0.1", smtp_port=hole.port, timeout=5.0, queue_size=4))
    try:
        for _ in range(10):
            n.send(("admin@company.com",), NOTICE)
        stats = n.stats()["email"]
        # one is being delivered (stuck), four wait, the rest are dropped and reported
        assert stats.queued + stats.dropped == 10 and stats.dropped >= 5
        assert sum("queue is full" in e for _, e in rec.failures) == stats.dropped
    finally:
        n.close()
        hole.close()


def test_control_characters_in_a_process_name_neither_break_nor_reach_the_mail(smtp_server):
    """A process names itself: a CR/LF in the name made EmailMessage refuse the Subject (the notice was lost),
    and an escape sequence would reach the admin's terminal. Both arrive escaped, in one piece."""
    box, port = smtp_server
    rec = Recorder()
    hooks = Hooks()
    n = rec.notifier(NotifyConfig(smtp_port=port, smtp_host="127.0.0.1", mail_from="gpukilld@test.example"))
    evil = Notice(
        "action",
        "block-crypto-miners",
        "PID 42 (x\r\nBcc: all@corp\x1b[2J, user bob)",
        "block-crypto-miners: PID 42 (x\r\nBcc: all@corp\x1b[2J) terminated",
        "Subject: PID 42 (x\r\nBcc: all@corp\x1b[2J)\n",
        {"summary": "block-crypto-miners: PID 42 (x\r\nBcc: all@corp\x1b[2J) terminated", "pids": [42]},
    )
    try:
        n.send(("admin@company.com", f"webhook:http://127.0.0.1:{hooks.port}/h"), evil)
        assert box.wait(1) and hooks.wait(1), rec.failures
        content = box.messages[0][2].decode()
        headers = content.split("\r\n\r\n", 1)[0]
        assert "\x1b" not in content and "\nBcc:" not in headers and "\r" not in content.replace("\r\n", "")
        parsed = email.message_from_string(content, policy=email.policy.default)
        assert (
            parsed["Subject"] == "[gpukill] block-crypto-miners: PID 42 (x\\x0d\\x0aBcc: all@corp\\x1b[2J) terminated"
        )
        assert parsed["Bcc"] is None and box.messages[0][1] == ["admin@company.com"]  # no header from a name
        assert (
            hooks.posts[0][1]["summary"] == "block-crypto-miners: PID 42 (x\\x0d\\x0aBcc: all@corp\\x1b[2J) terminated"
        )
    finally:
        n.close()
        hooks.close()


def test_a_mail_the_server_refuses_is_counted_failed_never_delivered():
    """Delivered means the server's 250 after DATA: a 554 there, after every attempt, is a failure, reported."""
    with smtp_relay(refuse="554 5.7.1 relaying denied") as (box, port):
        rec = Recorder()
        n = rec.notifier(NotifyConfig(smtp_port=port, smtp_host="127.0.0.1", retries=2, backoff=0.05))
        try:
            n.send(("admin@company.com",), NOTICE)
            with rec.cond:
                assert rec.cond.wait_for(lambda: rec.failures, 15)
            assert n.wait_idle(5) and box.refused == 2 and "554" in rec.failures[0][1]
            mail = n.stats()["email"]
            assert (mail.queued, mail.delivered, mail.skipped, mail.failed) == (1, 0, 0, 1)
        finally:
            n.close()


def test_a_recipient_refused_among_others_is_reported_and_the_mail_counted_delivered():
    with smtp_relay(unknown=("nobody@company.com",)) as (box, port):
        rec = Recorder()
        n = rec.notifier(NotifyConfig(smtp_port=port, smtp_host="127.0.0.1"))
        try:
            n.send(("admin@company.com", "nobody@company.com"), NOTICE)
            assert box.wait(1) and n.wait_idle(5)
            assert box.messages[0][1] == ["admin@company.com"]
            assert rec.failures == [
                ("nobody@company.com", "refused by the mail server: nobody@company.com: 550 5.1.1 no such mailbox")
            ]
            assert (n.stats()["email"].delivered, n.stats()["email"].failed) == (1, 0)
        finally:
            n.close()


def test_the_desktop_counts_what_it_announced_not_delivered():
    rec = Recorder()
    n = rec.notifier(NotifyConfig())
    try:
        n.send(("desktop", "journal"), NOTICE)
        desktop = n.stats()["desktop"]
        assert len(rec.desktop) == 1 and (desktop.announced, desktop.delivered) == (1, 0)
    finally:
        n.close()


class Audit:
    def __init__(self) -> None:
        self.entries: list[tuple[object, str, dict]] = []

    def log(self, kind: object, message: str, **fields: object) -> None:
        self.entries.append((kind, message, fields))


def test_a_new_relay_after_a_reload_keeps_the_counts_and_the_owners_audit(tmp_path):
    """gpukilld.conf's [notify] changed and reloaded: the new notifier counts on from the old one's counts and
    still audits each warning to an owner."""
    from gpukilld.guard.runner import GuardRunner

    async def kill(*args):
        raise AssertionError("nothing is killed here")

    audit = Audit()
    config = NotifyConfig(utmp=str(tmp_path / "no-utmp"), logind_bus=None)
    runner = GuardRunner(kill, audit, config, str(tmp_path / "g"), str(tmp_path / "s"))  # type: ignore[arg-type]
    try:
        runner.notifier.send(("desktop",), NOTICE)
        runner.configure(
            dataclasses.replace(config, smtp_port=2525),
            str(tmp_path / "g"),
            str(tmp_path / "s"),
            runner.engine.protection,
        )
        runner.notifier.send(("owner",), dataclasses.replace(NOTICE, data={"uid": 4242}))
        assert runner.notifier.wait_idle(5)
        counts = {c.channel: c for c in runner.status().notifications}
        assert counts["desktop"].announced == 2 and (counts["tty"].queued, counts["tty"].skipped) == (1, 1)
        warned = [f for _kind, _message, f in audit.entries if f.get("result") == "owner-warned"]
        assert sorted((f["channel"], f["outcome"]) for f in warned) == [("desktop", "signalled"), ("tty", "skipped")]
    finally:
        runner.stop()
