"""The audit trail's own journal client (gpukilld/journal.py): the native protocol's encoding, entries read back
from a real journald byte for byte, the sealed memfd that carries an entry too large for a datagram, a stalled
journald, and the one escaped stderr line when there is no journal."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import textwrap
import time
import uuid

import pytest
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, Testbed

from gpukilld import journal as audit

# -- the encoder, no root needed ------------------------------------------------------------------------------


def test_values_without_a_newline_are_plain_lines():
    assert audit.encode([("MESSAGE", "PID 42 (sleep) terminated"), ("GPUKILL_TARGET_PID", "42")]) == (
        b"MESSAGE=PID 42 (sleep) terminated\nGPUKILL_TARGET_PID=42\n"
    )
    assert audit.encode([("GPUKILL_TARGET_COMM", "caf\u00e9 \x1b[2J")]) == b"GPUKILL_TARGET_COMM=caf\xc3\xa9 \x1b[2J\n"


def test_a_newline_forces_the_length_prefixed_binary_form():
    """The protocol document's own example: FOO with BAR, here with a newline inside."""
    forged = "x\nGPUKILL_RESULT=allowed"
    assert audit.encode([("FOO", forged)]) == b"FOO\n" + struct.pack("<Q", 24) + forged.encode() + b"\n"
    assert audit.encode([("FOO", "\n")]) == b"FOO\n\x01\x00\x00\x00\x00\x00\x00\x00\n\n"


def test_field_names_are_made_what_journald_accepts():
    assert audit.field_name("target_pid") == "GPUKILL_TARGET_PID"
    assert audit.field_name("odd-name \u00fc") == "GPUKILL_ODD_NAME__"  # journald drops '-', ' ', non-ASCII
    assert audit.field_name("x" * 100) == "GPUKILL_" + "X" * 56  # at most 64 characters


# -- stderr, no root needed -----------------------------------------------------------------------------------

EVIL = "evil\n<0>forged\x1b[2J\r"
EVIL_MESSAGE = f"PID 42 ({EVIL}) terminated"


def _run(code: str, socket_path: str) -> subprocess.CompletedProcess:
    prelude = f"from gpukilld import journal as audit\naudit.JOURNAL_SOCKET = {socket_path!r}\n"
    return subprocess.run(
        [PYTHON, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        timeout=30,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_without_a_journal_socket_each_entry_is_one_escaped_line():
    """A process name must not start a line of its own, nor a `<N>` priority that systemd would read."""
    r = _run(
        f"""
        a = audit.Audit()
        assert not a.to_journal
        a.log(audit.KILL, {EVIL_MESSAGE!r}, target_comm={EVIL!r}, target_pid=42, device=None)
        a.log(audit.KILL_DENIED, "denied", target_comm="x GPUKILL_RESULT=allowed", rule="")
        a.log(audit.DAEMON, "right \\u202eto left", comm='a" GPUKILL_RESULT="allowed')
    """,
        "/nonexistent/socket",
    )
    assert r.returncode == 0 and r.stdout == b"", r.stderr
    assert r.stderr.split(b"\n") == [
        b"<5>PID 42 (evil\\x0a<0>forged\\x1b[2J\\x0d) terminated "
        b"[GPUKILL_TARGET_COMM=evil\\x0a<0>forged\\x1b[2J\\x0d GPUKILL_TARGET_PID=42 GPUKILL_EVENT=kill]",
        b'<4>denied [GPUKILL_TARGET_COMM="x GPUKILL_RESULT=allowed" GPUKILL_RULE="" GPUKILL_EVENT=kill-denied]',
        b'<6>right \\u202eto left [GPUKILL_COMM="a\\x22 GPUKILL_RESULT=\\x22allowed" GPUKILL_EVENT=daemon]',
        b"",
    ]


def test_a_failed_send_is_one_line_with_the_reason(tmp_path):
    """The socket file is there but nobody listens (journald died): the entry is not lost, nor split."""
    path = tmp_path / "socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
    r = _run(
        f"""
        a = audit.Audit()
        assert a.to_journal
        a.log(audit.KILL, "PID 42 terminated", target_comm={EVIL!r})
    """,
        str(path),
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == (
        b"<5>PID 42 terminated [GPUKILL_TARGET_COMM=evil\\x0a<0>forged\\x1b[2J\\x0d "
        b"GPUKILL_EVENT=kill] (not in the journal: Connection refused)\n"
    )


# -- through a real journald ----------------------------------------------------------------------------------

CHILD_PRELUDE = """
import os, sys
from gpukilld import journal as audit
memfds = []  # each entry that went by memfd
_memfd_create = os.memfd_create
os.memfd_create = lambda *a: memfds.append(a) or _memfd_create(*a)
"""


@pytest.fixture(scope="module")
def journal(users):
    bed = Testbed()
    try:
        bed.start_journal()
        yield bed
    finally:
        bed.stop()


def _child(bed: Testbed, code: str, uid: int | None = None, gid: int | None = None) -> tuple[list[str], dict]:
    """argv and Popen arguments that run `code` (after CHILD_PRELUDE) in the bed's journal namespace, as uid:gid
    if given."""
    ids = ["-S", str(uid), "-G", str(gid)] if uid is not None else []
    argv = [
        "nsenter",
        "-t",
        str(bed.journal_pid),
        "-m",
        *ids,
        "--",
        PYTHON,
        "-c",
        CHILD_PRELUDE + textwrap.dedent(code),
    ]
    return argv, {"env": bed.env(), "cwd": "/"}


def _run_child(bed: Testbed, code: str, **ids) -> str:
    argv, kw = _child(bed, code, **ids)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # nothing fell back to stderr
    return r.stdout


def _entries(bed: Testbed, message_id: str, n: int = 1, timeout: float = 10.0) -> list[dict]:
    """Entries with this MESSAGE_ID, every value as bytes: journalctl shows a value with a control character
    as a list of byte values, and a large one only with --all."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            bed.in_journal_ns(["journalctl", "--all", "--no-pager", "-o", "json", f"MESSAGE_ID={message_id}"]),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        entries = [json.loads(line) for line in out.splitlines() if line.strip()]
        if len(entries) >= n or time.monotonic() > deadline:
            return [{k: bytes(v) if isinstance(v, list) else v.encode() for k, v in e.items()} for e in entries]
        time.sleep(0.1)


@needs_root
def test_fields_arrive_exactly(journal):
    mid = uuid.uuid4().hex
    _run_child(
        journal,
        f"""
        kind = audit.EventKind("test-plain", {mid!r}, 5)
        def kill_something():
            audit.Audit().log(kind, "Kill of PID 42 allowed", target_pid=42, caller_uid=0, device=None, rule="r1")
        kill_something()
    """,
    )
    [e] = _entries(journal, mid)
    assert e["MESSAGE"] == b"Kill of PID 42 allowed" and e["PRIORITY"] == b"5"
    assert e["SYSLOG_IDENTIFIER"] == b"gpukilld" and e["_TRANSPORT"] == b"journal"
    assert {k: v for k, v in e.items() if k.startswith("GPUKILL_")} == {
        "GPUKILL_TARGET_PID": b"42",
        "GPUKILL_CALLER_UID": b"0",
        "GPUKILL_RULE": b"r1",
        "GPUKILL_EVENT": b"test-plain",
    }  # None left out, the event's name by default
    assert e["CODE_FUNC"] == b"kill_something" and e["CODE_FILE"] == b"<string>"  # the caller, not journal.py
    assert e["CODE_LINE"].isdigit()


@needs_root
def test_newlines_and_escapes_arrive_byte_for_byte_and_forge_no_field(journal):
    mid = uuid.uuid4().hex
    message = "first line\nsecond \x1b[31mred\x1b[0m\n<0>forged"
    comm = "evil\nGPUKILL_RESULT=allowed\nPRIORITY=0\x1b]0;title\x07"
    _run_child(
        journal,
        f"""
        audit.Audit().log(audit.EventKind("test-nl", {mid!r}, 4), {message!r}, target_comm={comm!r},
                          result="denied", **{{"odd-name": "x\\n"}})
    """,
    )
    [e] = _entries(journal, mid)
    assert e["MESSAGE"] == message.encode() and e["GPUKILL_TARGET_COMM"] == comm.encode()
    assert e["GPUKILL_RESULT"] == b"denied" and e["PRIORITY"] == b"4" and e["GPUKILL_ODD_NAME"] == b"x\n"


@needs_root
def test_non_ascii_text_arrives_as_utf8(journal):
    mid = uuid.uuid4().hex
    message = "GPU 0 \u2014 caf\u00e9 \u2713 \u65e5\u672c\u8a9e \U0001f680"
    _run_child(
        journal,
        f"""
        audit.Audit().log(audit.EventKind("test-utf8", {mid!r}, 6), {message!r}, user="j\u00fcrgen")
    """,
    )
    [e] = _entries(journal, mid)
    assert e["MESSAGE"].decode() == message and e["GPUKILL_USER"] == "j\u00fcrgen".encode()


@needs_root
def test_an_entry_over_the_datagram_limit_goes_in_a_sealed_memfd(journal, users):
    """An unprivileged sender, so that journald accepts the memfd only if it is sealed; a 64 KiB send buffer,
    so that the 200 KB entry does not fit in one datagram."""
    mid = uuid.uuid4().hex
    other = users["other"]
    blob = "".join(f"{i:07d} \x1b\n" for i in range(20_000))  # 200 000 bytes, with newlines and escapes
    path = journal.workdir / f"{mid}.blob"
    path.write_text(blob, newline="")
    out = _run_child(
        journal,
        f"""
        audit.SNDBUF_SIZE = 64 * 1024
        blob = open({str(path)!r}, encoding="utf-8", newline="").read()
        audit.Audit().log(audit.EventKind("test-big", {mid!r}, 5), "big", blob=blob, after="end")
        print(len(memfds), os.getuid())
    """,
        uid=other.uid,
        gid=other.gid,
    )
    assert out.split() == ["1", str(other.uid)]
    [e] = _entries(journal, mid)
    assert len(blob) == 200_000 and e["GPUKILL_BLOB"] == blob.encode()
    assert e["GPUKILL_AFTER"] == b"end" and e["MESSAGE"] == b"big" and e["_UID"] == str(other.uid).encode()


@needs_root
def test_an_entry_over_the_default_send_buffer_goes_in_a_memfd(journal):
    """As the daemon runs (root, default buffer): 17 MB is over the doubled 8 MiB buffer on any kernel."""
    mid = uuid.uuid4().hex
    out = _run_child(
        journal,
        f"""
        audit.Audit().log(audit.EventKind("test-huge", {mid!r}, 5), "huge", blob="q" * 17_000_000)
        print(len(memfds))
    """,
    )
    assert out.split() == ["1"]
    [e] = _entries(journal, mid)
    assert e["GPUKILL_BLOB"] == b"q" * 17_000_000


@needs_root
def test_a_stalled_journal_costs_one_timeout_then_entries_go_to_stderr(journal):
    """journald stopped: its queue fills, one send waits SEND_TIMEOUT, the next ones do not wait; each goes
    to stderr as one line. Once journald reads again, entries go to the journal again."""
    mid = uuid.uuid4().hex
    argv, kw = _child(
        journal,
        f"""
        import json, time
        audit.SEND_TIMEOUT = 0.5
        a = audit.Audit()
        sys.stdin.readline()
        kind = audit.EventKind("test-stall", {mid!r}, 5)
        times, slow = [], None
        for i in range(5000):  # until the queue (net.unix.max_dgram_qlen datagrams) is full, and 3 more
            t0 = time.monotonic()
            a.log(kind, f"entry {{i}}", n=i)
            times.append(time.monotonic() - t0)
            slow = i if slow is None and times[-1] > 0.3 else slow
            if slow is not None and i == slow + 3:
                break
        print(json.dumps(times), flush=True)
        sys.stdin.readline()
        a.log(kind, "after", n="after")
        print("done", flush=True)
    """,
    )
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )
    journal.procs.append(proc)  # killed by the bed if the test fails half-way
    os.kill(journal.journal_pid, signal.SIGSTOP)
    try:
        proc.stdin.write("\n")  # the child starts logging only now that journald is stopped
        proc.stdin.flush()
        times = json.loads(proc.stdout.readline())
    finally:
        os.kill(journal.journal_pid, signal.SIGCONT)
    slow = [t for t in times if t > 0.3]
    assert len(slow) == 1 and slow[0] < 3, times
    queued = times.index(slow[0])
    assert len(_entries(journal, mid, n=queued)) == queued  # what was queued arrives once journald runs
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "done\n"
    err = proc.communicate(timeout=30)[1]
    lines = err.splitlines()
    assert len(lines) == len(times) - queued, err
    assert all(
        line.startswith("<5>entry ") and line.endswith("(not in the journal: Resource temporarily unavailable)")
        for line in lines
    ), err
    assert [e["GPUKILL_N"] for e in _entries(journal, mid, n=queued + 1)][-1] == b"after"
