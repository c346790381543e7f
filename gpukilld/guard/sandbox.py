"""TestPolicies for a policy a client sends: evaluated in a child process, never in the daemon.

Anyone may ask what a policy would do (it never acts), so the text is untrusted: a huge document or a costly
condition must not stall the daemon's event loop, which also carries every kill. The child gets the policy text
and the caller's view of the snapshot (what the caller may list, see gpukilld/access/visibility.py: a policy must not
become an
oracle for other users' command lines) as JSON on stdin, parses and previews it, and prints a bounded result
as JSON. It runs confined, and fails closed: it exits before reading anything unless it dropped every
privilege (setgroups, setgid, setuid to a dedicated account, checked afterwards), under CPU, memory, core, file
and process limits, at the lowest CPU priority. The daemon runs at most one test per person (a uid and its
subordinate uids, gpukilld/access/people.py) and MAX_CONCURRENT in all, reads at most MAX_OUTPUT bytes back, and kills a
child
that runs over CHILD_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import pwd
import resource
import signal
import sys
from typing import TYPE_CHECKING, Any

from gpukill.errors import GpukillError, TooBusy
from gpukill.policy import PolicyError
from gpukill.records.audit import Finding
from gpukill.records.base import from_plain, to_plain
from gpukill.text import bounded

from ..access.people import People, shared
from ..model import Device, GpuProcess, Snapshot

if TYPE_CHECKING:
    from .conditions import Protection

CHILD_TIMEOUT = 10.0
CHILD_CPU_SECONDS = 10
CHILD_MEMORY = 1 << 30
CHILD_FILES = 64
MAX_CONCURRENT = 4  # children at once, all callers together
MAX_OUTPUT = 2 << 20  # bytes of JSON read back from a child
MAX_PREVIEWS = 1000  # decisions in one TestPolicies reply; a last record says how many more there were
MAX_REASON = 512  # characters of one decision's reason

SANDBOX_USER = "gpukill-sandbox"  # created by the packages (sysusers.d); see sandbox_ids() without it
DYNAMIC_UIDS = range(65519, 61183, -1)  # systemd's DynamicUser= range, searched from the top
DYNAMIC_UID_LOCKS = "/run/systemd/dynamic-uid"


def sandbox_ids() -> tuple[int, int]:
    """(uid, gid) the child runs as: the gpukill-sandbox account, or without one (a plain pip install), a uid
    of systemd's DynamicUser range that no account, group and dynamic user holds, as DynamicUser= would pick.
    Never nobody: whatever else runs as nobody could signal or trace the child, and the child them."""
    with contextlib.suppress(KeyError):
        pw = pwd.getpwnam(SANDBOX_USER)
        return pw.pw_uid, pw.pw_gid
    import grp

    for uid in DYNAMIC_UIDS:
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            pass
        if not os.path.exists(f"{DYNAMIC_UID_LOCKS}/{uid}"):
            return uid, uid
    raise GpukillError("no uid is free for the policy sandbox; create the gpukill-sandbox user")


def snapshot_to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The devices and processes as the bus carries them (records.to_plain), each process with what the daemon
    holds beside it: its system unit (conditions read it) and where its Slurm job came from."""
    return {
        "devices": [to_plain(d) for d in snapshot.devices],
        "processes": [
            {**to_plain(p), "system_unit": p.system_unit, "job_from_environ": p.job_from_environ}
            for p in snapshot.processes
        ],
        "findings": [to_plain(f) for f in snapshot.findings],  # what rogue_score and rogue_kind read
    }


def snapshot_from_json(data: dict[str, Any]) -> Snapshot:
    devices = tuple(from_plain(Device, d) for d in data["devices"])
    processes = tuple(
        dataclasses.replace(
            from_plain(GpuProcess, p), system_unit=p["system_unit"], job_from_environ=bool(p.get("job_from_environ"))
        )
        for p in data["processes"]
    )
    findings = tuple(from_plain(Finding, f) for f in data.get("findings", ()))
    return Snapshot(generation=0, taken_at=0.0, devices=devices, processes=processes, backends=(), findings=findings)


class Sandbox:
    def __init__(self, people: People | None = None) -> None:
        self._people = people if people is not None else shared()  # whom a uid's test is charged to
        self._running: set[int] = set()  # persons with a test in a child now
        self._ids: tuple[int, int] | None = None

    async def preview(
        self, name: str, text: str, snapshot: Snapshot, own_pid: int, uid: int, protection: Protection
    ) -> list[dict[str, Any]]:
        """The previews as dicts (see engine.Preview); PolicyError when the policy is invalid, TooBusy when
        the caller's person already has a test running or all children are busy."""
        person = self._people.person(uid)
        if person in self._running:
            raise TooBusy(f"{self._people.charged(uid)} already has a policy test running; wait for it")
        if len(self._running) >= MAX_CONCURRENT:
            raise TooBusy("too many policy tests at once; try again in a moment")
        self._running.add(person)
        try:
            return await self._run(name, text, snapshot, own_pid, protection)
        finally:
            self._running.discard(person)

    async def _run(
        self, name: str, text: str, snapshot: Snapshot, own_pid: int, protection: Protection
    ) -> list[dict[str, Any]]:
        if self._ids is None:
            self._ids = sandbox_ids()
        uid, gid = self._ids
        request = json.dumps(
            {
                "name": name,
                "text": text,
                "own_pid": own_pid,
                "snapshot": snapshot_to_json(snapshot),
                "protection": {"uid_max": protection.uid_max, "units": list(protection.units)},
            }
        ).encode()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # the package root and what of sys.path lies under it: the packages' bundled libraries
        # (/usr/lib/gpukill/vendor: re2, PyYAML where not Debian's) that the policy code imports
        paths = [root] + [p for p in sys.path if p != root and p.startswith(root + os.sep)]
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(paths), "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpukilld.guard.sandbox",
            str(uid),
            str(gid),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd="/",
        )
        pidfd = _pidfd(proc.pid)  # before anything can end it: the child takes tens of ms to start Python
        try:
            out, err = await asyncio.wait_for(_exchange(proc, request), CHILD_TIMEOUT)
        except TimeoutError:
            raise GpukillError(f"evaluating the policy took longer than {CHILD_TIMEOUT:g}s; nothing was done") from None
        except OverflowError:
            raise GpukillError(
                f"evaluating the policy gave more than {MAX_OUTPUT >> 20} MiB of results; nothing was done"
            ) from None
        finally:
            _stop(proc, pidfd)
            await proc.wait()
        try:
            reply = json.loads(out)
        except ValueError:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            raise GpukillError(f"evaluating the policy failed: {bounded(last[0], 300)}") from None
        if not reply.get("ok"):
            raise PolicyError(reply.get("errors") or [f"{name}:1:1: invalid policy"])
        return reply["previews"]


def _pidfd(pid: int) -> int | None:
    with contextlib.suppress(OSError, AttributeError):  # gone already, descriptors exhausted, a kernel before 5.3
        return os.pidfd_open(pid)
    return None


def _stop(proc: asyncio.subprocess.Process, pidfd: int | None) -> None:
    """SIGKILL the child (done or not) without reaping it: asyncio's child watcher reaps it and reports its
    status. Not Process.kill(): Popen.send_signal() polls first, and when the child has just exited that poll
    reaps it under the watcher's waitpid(), which then logs "Unknown child process pid N" (a line in the
    daemon's journal for any caller's test). The pidfd names this child even once it is reaped."""
    if pidfd is None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)  # still ours: the watcher has not reported it reaped
        return
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


async def _exchange(proc: asyncio.subprocess.Process, request: bytes) -> tuple[bytes, bytes]:
    """Send the request, read stdout to its end (at most MAX_OUTPUT bytes: OverflowError past it) and the
    last of stderr."""
    assert proc.stdin and proc.stdout and proc.stderr
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the child may exit without reading
        proc.stdin.write(request)
        await proc.stdin.drain()
        proc.stdin.close()

    async def drain(stream: asyncio.StreamReader, limit: int, keep_tail: bool) -> bytes:
        data = bytearray()
        while chunk := await stream.read(65536):
            data += chunk
            if len(data) > limit:
                if not keep_tail:
                    raise OverflowError
                del data[:-limit]
        return bytes(data)

    out, err = await asyncio.gather(drain(proc.stdout, MAX_OUTPUT, False), drain(proc.stderr, 4096, True))
    return out, err


PR_SET_NO_NEW_PRIVS = 38


def _confine(uid: int, gid: int) -> None:
    """Limits first (they survive the drop), then the drop; any failure raises and the child exits."""
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the daemon's data
    resource.setrlimit(resource.RLIMIT_NOFILE, (CHILD_FILES, CHILD_FILES))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # neither fork nor threads: the child needs neither
    os.nice(19)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # runs only when nothing else wants the CPU
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if uid == 0 or gid == 0:
        raise PermissionError("the sandbox account must not be root")
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    # Fail closed: whatever the calls above returned, go on only as that account and nothing more.
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups() or os.geteuid() == 0:
        raise PermissionError("the sandbox could not drop its privileges")


def main() -> int:
    # Everything the evaluation needs is imported while the files are certainly readable, before the drop;
    # nothing the caller sent is read before it.
    from gpukill.policy import parse_policy

    from .conditions import Protection
    from .engine import Engine

    try:
        _confine(int(sys.argv[1]), int(sys.argv[2]))
    except (OSError, ValueError, IndexError) as e:
        print(f"gpukilld sandbox: refusing to evaluate the policy: {e}", file=sys.stderr)
        return 70  # EX_SOFTWARE: no output, the daemon reports the failure
    request = json.loads(sys.stdin.buffer.read(CHILD_MEMORY // 4))
    try:
        policy = parse_policy(request["text"], request["name"])
    except PolicyError as e:
        json.dump({"ok": False, "errors": e.errors[:100]}, sys.stdout)
        return 0
    protection = request["protection"]
    engine = Engine(
        policy,
        own_pid=int(request["own_pid"]),
        protection=Protection(protection["uid_max"], tuple(protection["units"])),
    )
    previews = [dataclasses.asdict(p) for p in engine.preview(snapshot_from_json(request["snapshot"]))]
    json.dump({"ok": True, "previews": bounded_previews(previews), "ran_as": [os.getuid(), os.getgid()]}, sys.stdout)
    return 0


def bounded_previews(previews: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most MAX_PREVIEWS decisions with reasons of at most MAX_REASON characters; when some were left out,
    a last record with status "truncated" says how many. The engine's reason_for_others is not sent: where it
    applies, gpukilld/bus/guard.py has put it in place of the reason already."""
    out = [
        {**{k: v for k, v in p.items() if k != "reason_for_others"}, "reason": p["reason"][:MAX_REASON]}
        for p in previews[:MAX_PREVIEWS]
    ]
    if len(previews) > MAX_PREVIEWS:
        out.append(
            {
                "rule": "",
                "subject": "",
                "action": "",
                "status": "truncated",
                "wait": 0.0,
                "pids": [],
                "reason": f"{len(previews) - MAX_PREVIEWS} more decisions not shown",
                "more": len(previews) - MAX_PREVIEWS,
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
