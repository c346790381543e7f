"""The parts of suspend that need no daemon: the cuda-checkpoint seam (a hung call costs its child only, output
bounded, the utility looked up), the freezer's choice between a workload's own cgroup and SIGSTOP, the kept
records, and the selection of a workload."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.nvml_host import fake_nvidia_host

from gpukill.errors import InvalidArgs
from gpukill.records.suspend import (
    DONE,
    FROZEN_CGROUP,
    FROZEN_SIGSTOP,
    PARTIAL,
    STUCK,
    SUSPENDED,
    SuspendedProcess,
    SuspendReply,
)
from gpukilld import journal
from gpukilld.acts import cuda_checkpoint as checkpoint
from gpukilld.acts import suspend
from gpukilld.acts.cuda_checkpoint import CheckpointError, CudaCheckpoint, find_cuda_checkpoint
from gpukilld.acts.freezer import Frozen, freeze, thaw
from gpukilld.acts.selection import Selection
from gpukilld.acts.suspend import Suspender, SuspendSettings
from gpukilld.acts.suspended import SuspendedWorkloads, Workload
from gpukilld.model import EMPTY_SNAPSHOT, Snapshot
from gpukilld.proc.procfs import ProcFS

GIB = 2**30
NOBODY = 4_190_000  # PIDs no process has (pid_max is at most 2^22): nothing here may signal a real process


def tool(tmp_path: Path, body: str) -> str:
    path = tmp_path / "cuda-checkpoint"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_hung_call_is_killed_at_its_timeout_and_said_in_one_line(tmp_path):
    pid_file = tmp_path / "child.pid"
    seam = CudaCheckpoint(tool(tmp_path, f"echo $$ > {pid_file}; exec sleep 60"), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"did not finish within 0.5s"):
        asyncio.run(seam.act("lock", NOBODY))
    assert time.monotonic() - started < 5
    child = int(pid_file.read_text())
    assert not os.path.exists(f"/proc/{child}") or "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_output_is_bounded_and_a_failure_says_the_utilitys_message(tmp_path):
    seam = CudaCheckpoint(tool(tmp_path, "head -c 10000000 /dev/zero | tr '\\0' x >&2; exit 3"))
    with pytest.raises(CheckpointError) as failed:
        asyncio.run(seam.act("checkpoint", NOBODY))
    assert len(str(failed.value)) < 700 and str(failed.value).startswith(f"checkpoint of PID {NOBODY} failed: xxx")
    seam = CudaCheckpoint(tool(tmp_path, 'echo "Error: not a CUDA process" >&2; exit 1'))
    with pytest.raises(CheckpointError, match="not a CUDA process"):
        asyncio.run(seam.act("lock", NOBODY))


def test_the_state_and_the_lock_timeout_are_passed_as_the_utility_takes_them(tmp_path):
    args = tmp_path / "args"
    seam = CudaCheckpoint(tool(tmp_path, f'echo "$@" >> {args}; echo checkpointed'))
    assert asyncio.run(seam.state(42)) == checkpoint.CHECKPOINTED
    asyncio.run(seam.act("lock", 42, lock_timeout_ms=2500))
    asyncio.run(seam.act("unlock", 42))
    assert args.read_text().splitlines() == [
        "--get-state --pid 42",
        "--action lock --pid 42 --timeout 2500",
        "--action unlock --pid 42",
    ]


def test_the_utility_is_the_configured_one_or_looked_up(tmp_path, monkeypatch):
    path = tool(tmp_path, "exit 0")
    assert find_cuda_checkpoint(path) == path
    assert find_cuda_checkpoint(str(tmp_path / "absent")) is None
    monkeypatch.setattr(checkpoint, "SEARCH_PATH", (str(tmp_path / "none"), str(tmp_path)))
    assert find_cuda_checkpoint(None) == path


def cgroup_host(tmp_path: Path, procs: list[int]) -> tuple[ProcFS, str, Path]:
    """A /proc whose NOBODY and NOBODY+1 are in job.scope (cgroup v2), that cgroup holding `procs`."""
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    for pid in (NOBODY, NOBODY + 1):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text("0::/work.slice/job.scope\n")
    cgroup = sys_root / "fs/cgroup/work.slice/job.scope"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.freeze").write_text("0\n")
    (cgroup / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    (cgroup / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    return ProcFS(str(proc)), str(sys_root), cgroup


def test_a_workload_alone_in_its_cgroup_is_frozen_there(tmp_path):
    procfs, sys_root, cgroup = cgroup_host(tmp_path, [NOBODY, NOBODY + 1])
    frozen = freeze(procfs, sys_root, [(NOBODY, 1), (NOBODY + 1, 1)])
    assert (frozen.kind, frozen.control) == (FROZEN_CGROUP, str(cgroup / "cgroup.freeze"))
    assert (cgroup / "cgroup.freeze").read_text() == "1"
    thaw(procfs, frozen)
    assert (cgroup / "cgroup.freeze").read_text() == "0"


def test_a_cgroup_shared_with_another_process_is_never_frozen(tmp_path):
    procfs, sys_root, cgroup = cgroup_host(tmp_path, [NOBODY, NOBODY + 1, NOBODY + 2])
    frozen = freeze(procfs, sys_root, [(NOBODY, 1), (NOBODY + 1, 1)])
    assert frozen.kind == FROZEN_SIGSTOP and frozen.control == ""
    assert (cgroup / "cgroup.freeze").read_text() == "0\n"  # the other process runs on


def record(pid: int, state: str = SUSPENDED) -> SuspendedProcess:
    return SuspendedProcess(
        pid, 7, 1000, "train", state, (0,), ("GPU-0",), 2 << 30, (2 << 30,), f"tree of PID {pid}", 1.0
    )


class Journal:
    def __init__(self) -> None:
        self.entries: list[tuple[journal.EventKind, dict]] = []

    def log(self, kind: journal.EventKind, message: str, **fields: object) -> None:
        self.entries.append((kind, fields))


def test_kept_workloads_survive_a_restart_and_a_gone_process_is_dropped_and_said(tmp_path):
    me = os.getpid()
    alive = ProcFS().start_time(me)
    assert alive is not None
    log = Journal()
    kept = SuspendedWorkloads(str(tmp_path / "state"), log, ProcFS())  # type: ignore[arg-type]
    mine = SuspendedProcess(me, alive, 0, "pytest", SUSPENDED, (0,), ("GPU-0",), 1 << 30, (1 << 30,), "PID", 1.0)
    kept.add(Workload("PID", [mine], Frozen(FROZEN_SIGSTOP, "", ((me, alive),)), ("a.service",), ("12",)))
    kept.add(Workload("tree of PID 1", [record(NOBODY), record(NOBODY + 1, STUCK)], Frozen("", "", ())))
    assert json.loads((tmp_path / "state" / "suspended.json").read_text())["version"] == 1
    assert oct((tmp_path / "state" / "suspended.json").stat().st_mode & 0o777) == "0o600"

    again = SuspendedWorkloads(str(tmp_path / "state"), log, ProcFS())  # type: ignore[arg-type]
    again.load()
    assert [w.processes for w in again.workloads] == [[mine]]
    assert again.workloads[0].frozen == Frozen(FROZEN_SIGSTOP, "", ((me, alive),))
    gone = [f["target_pid"] for kind, f in log.entries if kind is journal.SUSPEND and f["action"] == "gone"]
    assert gone == [NOBODY, NOBODY + 1]
    assert again.held_memory() == 1 << 30
    assert again.selected("unit", "a.service") == again.selected("job", "12") == again.selected("pid", str(me))
    assert again.selected("unit", "b.service") == []


def test_a_workload_selection_is_one_key_of_four():
    assert Selection.parse_workload({"pid": (42, 7)}) == Selection("pid", "42", 7)
    assert Selection.parse_workload({"job": "0123"}) == Selection("job", "123")
    assert Selection.parse_workload({"pid": (42, 7)}).text == "PID 42"
    for bad in ({}, {"pid": (1, 2), "unit": "a.service"}, {"container": "0" * 12}, {"job": "12_3"}):
        with pytest.raises(InvalidArgs):
            Selection.parse_workload(bad)


def test_the_configuration_keys_are_read_and_bad_values_are_one_line(tmp_path):
    from gpukill.errors import ConfigError
    from gpukilld.config import load_config

    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[daemon]\ncuda_checkpoint = /opt/nvidia/cuda-checkpoint\nsuspend_host_memory_max = 64GiB\n")
    config = load_config(str(conf))
    assert (config.cuda_checkpoint, config.suspend_host_memory_max) == ("/opt/nvidia/cuda-checkpoint", 64 << 30)
    assert load_config(str(tmp_path / "absent")).suspend_host_memory_max is None  # half of MemTotal
    for text, why in (
        ("cuda_checkpoint = cuda-checkpoint", ":2: cuda_checkpoint must be an absolute path"),
        ("suspend_host_memory_max = lots", ":2: suspend_host_memory_max: not a size: 'lots'"),
    ):
        conf.write_text(f"[daemon]\n{text}\n")
        with pytest.raises(ConfigError) as e:
            load_config(str(conf))
        assert why in str(e.value) and "\n" not in str(e.value), e.value


def resumed_on_the_fake(tmp_path: Path, monkeypatch, restore_before_thaw: bool) -> tuple[SuspendReply, str, int]:
    """A child on the fake NVIDIA host, locked, checkpointed and SIGSTOPped as a suspend leaves it, then resumed by
    the daemon's Suspender.resume through the fake cuda-checkpoint; restore_before_thaw: with the resume's order
    reversed (the thaw held back until the restore step has run). (the reply, the driver's state of the child,
    its GPU's allocated memory)."""
    host = fake_nvidia_host(tmp_path / "nvml", devices=1)
    tool = str(host.install_cuda_checkpoint())
    host.set_checkpoint_stopped_wait(0.5)
    procfs = ProcFS()
    child = subprocess.Popen(["sleep", "600"])
    try:
        start = procfs.start_time(child.pid)
        assert start is not None
        host.add_process(0, child.pid, 2 * GIB)
        host.write()
        for action in ("lock", "checkpoint"):
            asyncio.run(CudaCheckpoint(tool).act(action, child.pid))
        frozen = freeze(procfs, "/sys", [(child.pid, start)])
        assert frozen.kind == FROZEN_SIGSTOP  # the child shares the test's cgroup
        log = Journal()
        kept = SuspendedWorkloads(str(tmp_path / "state"), log, procfs)  # type: ignore[arg-type]
        held = SuspendedProcess(child.pid, start, os.getuid(), "sleep", SUSPENDED, (), (), 2 * GIB, (), "PID", 1.0)
        kept.add(Workload(f"PID {child.pid}", [held], frozen))
        if restore_before_thaw:
            held_back: list[Frozen] = []
            monkeypatch.setattr(suspend, "thaw", lambda _procfs, frozen: held_back.append(frozen))
            step = Suspender._step

            async def thaw_after_restore(self, tool, action, targets, moved=None):
                errors = await step(self, tool, action, targets, moved)
                if action == "restore":
                    for f in held_back:
                        thaw(procfs, f)
                return errors

            monkeypatch.setattr(Suspender, "_step", thaw_after_restore)

        async def sample() -> Snapshot:
            return EMPTY_SNAPSHOT

        suspender = Suspender(
            lambda: EMPTY_SNAPSHOT,
            sample,
            dict,
            None,  # type: ignore[arg-type]  # no caller: polkit is not asked
            SimpleNamespace(procfs=procfs),  # type: ignore[arg-type]  # resume sends no signal through the killer
            log,  # type: ignore[arg-type]
            kept,
            lambda: SuspendSettings(cuda_checkpoint=tool),
            lambda _r, _c: None,
            lambda _r, _c: None,
        )
        reply = asyncio.run(suspender.resume(None, Selection("pid", str(child.pid), start)))
        return reply, host.checkpoint_states()[child.pid], host.refresh()["devices"][0]["memory_allocated"]
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def test_resume_thaws_before_the_restore_or_the_driver_cannot_restore(tmp_path, monkeypatch):
    """The driver restores through a thread of the process: the daemon's order (thaw, restore, unlock) gives the
    memory back; restore before thaw leaves the stopped process checkpointed, the restore timed out."""
    reply, state, allocated = resumed_on_the_fake(tmp_path / "ordered", monkeypatch, restore_before_thaw=False)
    assert (reply.result, state, allocated) == (DONE, "running", 2 * GIB), reply.message
    reply, state, allocated = resumed_on_the_fake(tmp_path / "reversed", monkeypatch, restore_before_thaw=True)
    assert (reply.result, state, allocated) == (PARTIAL, "checkpointed", 0), reply.message
    (entry,) = reply.entries
    assert entry.state == STUCK and '"the operation timed out"' in entry.error, entry
