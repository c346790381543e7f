"""Interactive authorization end to end: gpukillctl on a real terminal (a pty) starts pkttyagent, polkitd asks
it for the user's password, polkit-agent-helper-1 checks it through PAM, and only then does gpukilld kill.

The setuid helper ignores DBUS_SYSTEM_BUS_ADDRESS, so the client runs in a mount namespace where the test's
private bus is bind-mounted over /run/dbus: from its point of view, the test bus is the system bus.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

import pytest
from helpers.marks import needs_root
from helpers.testbed import PYTHON, User

from gpukilld import journal as audit

pytestmark = needs_root

PASSWORD = "Gpk-test-pass-7"
AUTH_SELF_RULE = """polkit.addRule(function(action, subject) {
    if (action.id == "org.gpukill.kill-any-process" && subject.user == "gpkother") {
        return polkit.Result.AUTH_SELF;
    }
});
"""


def run_on_terminal(bed, user: User, args: list[str], answer: str | None, timeout: float = 60) -> tuple[int, str]:
    """Run gpukillctl as `user` with a pty as its terminal; type `answer` at the password prompt."""
    script = (
        f"mount --bind {bed.workdir} /run/dbus && exec setpriv --reuid={user.uid} --regid={user.gid} "
        f"--init-groups {PYTHON} -m gpukillctl {' '.join(args)}"
    )
    pid, fd = os.forkpty()
    if pid == 0:  # child: never returns
        try:
            os.execve(
                "/usr/bin/unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", script], bed.env()
            )
        finally:
            os._exit(127)
    out = b""
    typed_at = None  # the agent turns echo off with TCSAFLUSH, which may eat what was typed too early
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        now = time.monotonic()
        if answer is not None and out.rstrip().endswith(b"Password:") and (typed_at is None or now - typed_at > 5):
            time.sleep(0.3)
            os.write(fd, answer.encode() + b"\n")
            typed_at = now
        if not ready:
            continue
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out += data
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


@pytest.fixture
def interactive_bed(fresh_bed, users, tmp_path):
    os.makedirs("/run/dbus", exist_ok=True)
    subprocess.run(["chpasswd"], input=f"gpkother:{PASSWORD}\n", text=True, check=True)
    rule = tmp_path / "50-gpukill-test-auth-self.rules"
    rule.write_text(AUTH_SELF_RULE)
    fresh_bed.start_polkit([rule])
    fresh_bed.start_daemon()
    try:
        yield fresh_bed
    finally:
        subprocess.run(["passwd", "-d", "gpkother"], capture_output=True)  # lock the test account again
        subprocess.run(["usermod", "-L", "gpkother"], capture_output=True)


def test_password_on_the_terminal_authorizes_the_kill(interactive_bed, users, alive):
    bed = interactive_bed
    victim = bed.victim(users["owner"], gpu=0, comm="victim")
    bed.wait_listed(victim.pid, comm="victim")
    code, out = run_on_terminal(bed, users["other"], ["kill", str(victim.pid)], PASSWORD)
    assert "AUTHENTICATING FOR org.gpukill.kill-any-process" in out, out
    assert "AUTHENTICATION COMPLETE" in out and code == 0, out
    assert f"PID {victim.pid} (victim) terminated" in out
    victim.wait(5)
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(users["other"].uid)


def test_wrong_password_denies_and_nothing_is_signalled(interactive_bed, users, alive):
    bed = interactive_bed
    victim = bed.victim(users["owner"], gpu=0, comm="victim")
    bed.wait_listed(victim.pid, comm="victim")
    code, out = run_on_terminal(bed, users["other"], ["kill", str(victim.pid)], "wrong-password", timeout=90)
    assert "AUTHENTICATION FAILED" in out, out
    assert code == 4, out
    assert "Traceback" not in out
    assert alive(victim.pid)
    assert bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL_DENIED.message_id)
