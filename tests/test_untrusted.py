"""Units of the hardening against hostile users: escaping and bounding text, reading /proc's access rules and
what each caller sees, folding refusals, bounding command lines where they are read."""

from __future__ import annotations

import io

import pytest

from gpukill.text import bounded, shown
from gpukilld import journal as audit
from gpukilld.access.callrate import BURST as CALL_BURST
from gpukilld.access.callrate import RATE, CallRate
from gpukilld.access.refusals import BURST, TOTAL_BURST, WINDOW, RefusalLog
from gpukilld.access.visibility import (
    ANONYMOUS,
    FULL,
    HIDDEN,
    HIDEPID_INVISIBLE,
    HIDEPID_NOACCESS,
    PROGRAM,
    ProcRules,
    as_seen_by,
    parse_mountinfo,
    viewer_for,
)
from gpukilld.model import GpuProcess
from gpukilld.proc.procfs import CUT_MARKER, MAX_CMDLINE, read_cmdline


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("python", "python"),
        ("ev\x1b[2Jil", "ev\\x1b[2Jil"),
        ("a\nb\r<0>", "a\\x0ab\\x0d<0>"),
        ("\u202eevil", "\\u202eevil"),  # right-to-left override: reorders what the admin reads
        ("x\u2028y\x85z", "x\\u2028y\\x85z"),  # line separator, NEL
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("°C µs ü 漢字 🙂", "°C µs ü 漢字 🙂"),  # printable text stays as it is
        ("back\\slash", "back\\slash"),
    ],
)
def test_shown_escapes_what_a_terminal_would_act_on(text, expected):
    assert shown(text) == expected
    assert shown(shown(text)) == shown(text)  # idempotent: the daemon and a client may both escape


def test_bounded_cuts_on_a_character_boundary_and_says_so():
    assert bounded("abc", 3) == "abc"
    cut = bounded("é" * 10, 5)
    assert cut.startswith("éé") and "cut 16 bytes" in cut and len(cut.split(" ")[0].encode()) <= 5


def test_command_lines_are_bounded_where_they_are_read():
    long = b"\0".join([b"prog"] + [b"x" * 131071] * 15) + b"\0"
    text = read_cmdline(io.BytesIO(long))
    assert text.startswith("prog x") and text.endswith(CUT_MARKER)
    assert len(text.removesuffix(CUT_MARKER).encode()) <= MAX_CMDLINE
    invalid = read_cmdline(io.BytesIO(b"\xff" * 5000))  # each bad byte is a 3-byte U+FFFD
    assert len(invalid.removesuffix(CUT_MARKER).encode()) <= MAX_CMDLINE
    assert read_cmdline(io.BytesIO(b"a\0b\0")) == "a b"


MOUNTINFO = """22 27 0:21 / /proc rw,relatime - proc proc rw{opts}
30 22 0:25 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw
"""


@pytest.mark.parametrize(
    ("opts", "rules"),
    [
        ("", ProcRules()),
        (",hidepid=2,gid=27", ProcRules(HIDEPID_INVISIBLE, 27)),
        (",hidepid=invisible", ProcRules(HIDEPID_INVISIBLE)),
        (",hidepid=noaccess", ProcRules(HIDEPID_NOACCESS)),
        (",hidepid=1", ProcRules(HIDEPID_NOACCESS)),
        (",hidepid=ptraceable", ProcRules(HIDEPID_INVISIBLE)),
        (",hidepid=somethingnew", ProcRules(HIDEPID_INVISIBLE)),  # unknown: read as the strictest
    ],
)
def test_proc_rules_from_mountinfo(opts, rules):
    assert parse_mountinfo(MOUNTINFO.format(opts=opts), "/proc") == rules


def test_what_each_viewer_sees():
    p = GpuProcess(
        pid=7,
        start_time=1,
        uid=1001,
        user="bob",
        comm="train",
        cmdline="python train.py --token=s3cret",
        exe="/usr/bin/python3.11",
        device=0,
        device_id="G",
        gpu_memory=1 << 30,
        gpu_utilization=50.0,
        unit="job.service",
        container_id="c" * 64,
        system_unit="job.service",
        container_pid=3,
    )
    off, noaccess, invisible = ProcRules(), ProcRules(HIDEPID_NOACCESS), ProcRules(HIDEPID_INVISIBLE, gid=50)
    assert viewer_for(0, (), False, invisible).others == FULL  # root
    assert viewer_for(1002, (), True, invisible).others == FULL  # view-all-processes
    assert viewer_for(1002, (), False, off).others == PROGRAM
    assert viewer_for(1002, (), False, noaccess).others == ANONYMOUS
    assert viewer_for(1002, (), False, invisible).others == HIDDEN
    assert viewer_for(1002, (50,), False, invisible).others == PROGRAM  # the hidepid gid= group
    assert as_seen_by(p, viewer_for(1001, (), False, invisible)) is p  # one's own: always in full
    program = as_seen_by(p, viewer_for(1002, (), False, off))
    assert (program.cmdline, program.exe, program.comm) == ("python", None, "train")
    assert (program.unit, program.container_id, program.system_unit) == (p.unit, p.container_id, p.system_unit)
    anon = as_seen_by(p, viewer_for(1002, (), False, noaccess))
    assert (anon.comm, anon.cmdline, anon.exe, anon.container_pid) == ("", "", None, None)
    # every trace of the cgroup but the system unit (systemd tells anyone a PID's unit) is gone
    assert (anon.unit, anon.container_id, anon.pod_uid, anon.slurm_job) == (None, None, None, None)
    assert anon.system_unit == "job.service" and anon.gpu_memory == 1 << 30
    assert as_seen_by(p, viewer_for(1002, (), False, invisible)) is None


class Recorder:
    def __init__(self) -> None:
        self.entries: list[tuple[str, str, dict]] = []

    def log(self, kind, message, **fields) -> None:
        self.entries.append((kind.name, message, fields))


def test_refusals_are_folded_per_uid_and_reported_when_the_window_ends():
    rec, now = Recorder(), [100.0]
    log = RefusalLog(rec, clock=lambda: now[0])  # type: ignore[arg-type]
    written = [log.log(1001, audit.KILL_DENIED, "denied", caller_uid=1001) for _ in range(BURST + 30)]
    assert written.count(True) == BURST and len(rec.entries) == BURST
    assert log.log(1002, audit.KILL_FAILED, "refused")  # another user has a budget of its own
    assert log.log(0, audit.KILL_FAILED, "root") and log.log(None, audit.KILL, "the daemon")  # never folded
    now[0] += WINDOW
    log.flush()
    folded = [e for e in rec.entries if e[2].get("result") == "folded"]
    assert [(k, f["folded"], f["caller_uid"]) for k, _, f in folded] == [("kill-denied", 30, 1001)]
    assert log.log(1001, audit.KILL_DENIED, "denied again")  # a new window


def test_all_users_together_have_a_budget():
    rec, now = Recorder(), [0.0]
    log = RefusalLog(rec, clock=lambda: now[0])  # type: ignore[arg-type]
    for uid in range(2000, 2000 + TOTAL_BURST // BURST + 5):
        for _ in range(BURST):
            log.log(uid, audit.RESET_DENIED, "x")
    assert len(rec.entries) == TOTAL_BURST


def test_each_uid_has_its_call_rate():
    now = [0.0]
    rate = CallRate(clock=lambda: now[0])
    assert sum(rate.allow(1001) for _ in range(int(CALL_BURST) + 50)) == int(CALL_BURST)
    assert rate.allow(1002) and rate.allow(0)  # another user's bucket; root is not limited
    now[0] += 10 / RATE
    assert sum(rate.allow(1001) for _ in range(50)) == 10  # refilled at RATE a second
