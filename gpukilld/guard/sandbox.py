"""TestPolicies for a policy a client sends: evaluated in a child process, never in the daemon.

Anyone may ask what a policy would do (it never acts), so the text is untrusted: a regular expression with
catastrophic backtracking or a huge document must not stall the daemon's event loop, which also carries
every kill. The child gets the policy text and the current snapshot as JSON on stdin, parses and previews it
under CPU and memory limits (as nobody where the daemon may switch users), and prints the result as JSON. The
daemon waits for it with a timeout and kills it when it runs over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import sys
from typing import Any

from ..errors import GpukillError
from ..model import Attribution, Device, GpuProcess, Snapshot
from .policy import PolicyError

CHILD_TIMEOUT = 10.0
CHILD_CPU_SECONDS = 10
CHILD_MEMORY = 1 << 30
MAX_CONCURRENT = 2
MAX_WAITING = 8


class TooBusy(GpukillError):
    dbus_name = "org.gpukill1.Error.Failed"
    result = "busy"


_DEVICE_FIELDS = ("index", "id", "backend", "vendor", "name", "pci_bus_id", "utilization", "memory_used",
                  "memory_total", "temperature", "power", "state", "state_reason")
_PROCESS_FIELDS = ("pid", "start_time", "uid", "user", "comm", "cmdline", "exe", "device", "device_id",
                   "gpu_memory", "gpu_utilization")


def snapshot_to_json(snapshot: Snapshot) -> dict[str, Any]:
    """What conditions look at, and no more (records grow fields the guard does not use)."""
    return {
        "devices": [{k: getattr(d, k) for k in _DEVICE_FIELDS} for d in snapshot.devices],
        "processes": [{**{k: getattr(p, k) for k in _PROCESS_FIELDS}, "unit": p.attribution.unit,
                       "container_id": p.attribution.container_id} for p in snapshot.processes],
    }


def snapshot_from_json(data: dict[str, Any]) -> Snapshot:
    devices = tuple(Device(**{k: d[k] for k in _DEVICE_FIELDS}) for d in data["devices"])
    processes = tuple(
        GpuProcess(**{k: p[k] for k in _PROCESS_FIELDS},
                   attribution=Attribution(unit=p["unit"], container_id=p["container_id"]))
        for p in data["processes"])
    return Snapshot(generation=0, taken_at=0.0, devices=devices, processes=processes, backends=())


class Sandbox:
    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self._waiting = 0

    async def preview(self, name: str, text: str, snapshot: Snapshot, own_pid: int) -> list[dict[str, Any]]:
        """The previews as dicts (see engine.Preview); PolicyError when the policy is invalid."""
        if self._waiting >= MAX_WAITING:
            raise TooBusy("too many policy tests at once; try again in a moment")
        self._waiting += 1
        try:
            async with self._slots:
                return await self._run(name, text, snapshot, own_pid)
        finally:
            self._waiting -= 1

    async def _run(self, name: str, text: str, snapshot: Snapshot, own_pid: int) -> list[dict[str, Any]]:
        request = json.dumps({"name": name, "text": text, "own_pid": own_pid,
                              "snapshot": snapshot_to_json(snapshot)}).encode()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": root, "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpukilld.guard.sandbox", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd="/")
        try:
            out, err = await asyncio.wait_for(proc.communicate(request), CHILD_TIMEOUT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise GpukillError(f"evaluating the policy took longer than {CHILD_TIMEOUT:g}s (a regular expression "
                               "that backtracks without end?); nothing was done") from None
        try:
            reply = json.loads(out)
        except ValueError:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            raise GpukillError(f"evaluating the policy failed: {last[0][:300]}") from None
        if not reply.get("ok"):
            raise PolicyError(reply.get("errors") or [f"{name}:1:1: invalid policy"])
        return reply["previews"]


def _confine() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):  # without CAP_SETUID/CAP_SETGID it stays root, but confined
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)


def main() -> int:
    _confine()
    from .engine import Engine
    from .policy import parse_policy

    request = json.load(sys.stdin)
    try:
        policy = parse_policy(request["text"], request["name"])
    except PolicyError as e:
        json.dump({"ok": False, "errors": e.errors}, sys.stdout)
        return 0
    engine = Engine(policy, own_pid=int(request["own_pid"]))
    previews = engine.preview(snapshot_from_json(request["snapshot"]))
    json.dump({"ok": True, "previews": [dataclasses.asdict(p) for p in previews]}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
