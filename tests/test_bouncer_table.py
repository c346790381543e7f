"""The bouncer's table decides every privileged act, through Bouncer.check and nothing else.

On a private bus of the test's own, the real Door, interfaces, Actions and GuardRunner serve a caller whose
uid the test chooses, with polkit's answer faked (TablePolkit): each privileged method asks polkit the
action its table row names, is refused when polkit says no (audited by the bouncer), and goes ahead once
the row is edited to an action polkit allows or to READ_ONLY. Against the real polkitd of the testbed, the
table's own/any pair decides which action a kill asks, and editing that row changes the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from helpers.marks import needs_root
from helpers.open_bus import open_bus
from helpers.testbed import PYTHON

from gpukill import managed_policy
from gpukill.errors import AccessDenied
from gpukill.records.suspend import SUSPENDED, SuspendedProcess
from gpukilld import journal as audit
from gpukilld.access import bouncer
from gpukilld.access.bouncer import (
    KILL_ANY,
    KILL_METHOD,
    KILL_OWN,
    READ_ONLY,
    RESET_METHOD,
    Bouncer,
    Caller,
    OwnOrAny,
    Request,
)
from gpukilld.access.refusals import RefusalLog
from gpukilld.acts.actions import Actions
from gpukilld.acts.freezer import Frozen
from gpukilld.acts.killer import Killer
from gpukilld.acts.suspend import Suspender, SuspendSettings
from gpukilld.acts.suspended import SuspendedWorkloads, Workload
from gpukilld.audit_settings import AuditSettingsKeeper
from gpukilld.bus.door import Door
from gpukilld.bus.guard import GuardInterface
from gpukilld.bus.manager import ManagerInterface
from gpukilld.guard.notify import NotifyConfig
from gpukilld.guard.runner import GuardRunner
from gpukilld.model import Device, GpuProcess, Snapshot
from gpukilld.names import GUARD_INTERFACE, MANAGER_INTERFACE, OBJECT_PATH
from gpukilld.proc.procfs import ProcFS
from gpukilld.rogue.watch import RogueWatch

CALLER_UID = 4242  # the caller of every call here: no real account, and never root (root skips polkit)
SOMEONE_ELSE = 4343
DENIED = "org.freedesktop.DBus.Error.AccessDenied"
TEST_ACTION = "org.gpukill.test-edited-row"  # an action only the edited row names, which the fake polkit allows

PRIVILEGED = sorted(m for m, action in bouncer.METHOD_ACTIONS.items() if action != READ_ONLY)

# One call of each privileged method: (signature, body); "$PID", "$START" are the victim's.
CALLS = {
    (MANAGER_INTERFACE, "KillProcess"): ("uta{sv}", ["$PID", "$START", {}]),
    (MANAGER_INTERFACE, "KillProcessReport"): ("uta{sv}", ["$PID", "$START", {}]),
    (MANAGER_INTERFACE, "KillWorkload"): ("a{sv}a{sv}", ["$TREE", {}]),  # the victim's tree: itself
    (MANAGER_INTERFACE, "ResetDevice"): ("sa{sv}", ["1", {}]),
    # the victim alone; for a resume, serve() holds it suspended first (Served.call)
    (MANAGER_INTERFACE, "SuspendWorkload"): ("a{sv}a{sv}", ["$PIDSEL", {}]),
    (MANAGER_INTERFACE, "ResumeWorkload"): ("a{sv}a{sv}", ["$PIDSEL", {}]),
    (GUARD_INTERFACE, "Enable"): ("", []),
    (GUARD_INTERFACE, "Disable"): ("", []),
    (GUARD_INTERFACE, "SetDryRun"): ("b", [True]),
    (GUARD_INTERFACE, "LoadPolicy"): ("ss", ["edited.yaml", "rules: []\n"]),
    (GUARD_INTERFACE, "Postpone"): ("utds", ["$PID", "$START", 60.0, "saving"]),
    (MANAGER_INTERFACE, "SetAuditSettings"): ("a{sv}", [{"min_score": Variant("d", 50.0)}]),
    (MANAGER_INTERFACE, "ImportAuditSettings"): ("ss", ["edited.conf", "[audit]\nmin_score = 50\n"]),
    # the managed policies: "$MANAGED" is the user policy that serve() has written into guard.d already
    (GUARD_INTERFACE, "SetPolicy"): ("ssa{sv}", ["user", "nobody", {"memory_limit": Variant("t", 1 << 30)}]),
    (GUARD_INTERFACE, "RemovePolicy"): ("ss", ["user", "$MANAGED"]),
    (GUARD_INTERFACE, "ImportPolicies"): (
        "ssb",
        [
            "import.yaml",
            managed_policy.export_text([managed_policy.ManagedPolicy("group", "nogroup", process_limit=2)]),
            False,
        ],
    ),
}
MANAGED = managed_policy.ManagedPolicy("user", "daemon", memory_limit=1 << 30)
# cuda-checkpoint's command line answered as for a process that is running and whose every step succeeds
STAND_IN = '#!/bin/sh\ncase "$1" in --get-state) echo running ;; esac\nexit 0\n'


class Journal:
    """Audit entries as (kind, message, fields), in the order written."""

    def __init__(self) -> None:
        self.entries: list[tuple[audit.EventKind, str, dict]] = []

    def log(self, kind: audit.EventKind, message: str, **fields: object) -> None:
        self.entries.append((kind, message, fields))


class TablePolkit(Bouncer):
    """The real Bouncer (table, check, audit of denials) with the test's caller and a fake polkit that allows
    the actions in `allowed` and records every question; check() records the methods it decided."""

    def __init__(self, bus: MessageBus, journal: Journal, allowed: set[str]) -> None:
        super().__init__(bus, RefusalLog(journal))  # type: ignore[arg-type]
        self.allowed = allowed
        self.asked: list[str] = []
        self.checked: list[tuple[str, str]] = []

    async def caller(self, msg: Message) -> Caller:
        return Caller(msg.sender, CALLER_UID, os.getpid(), interactive=False)

    async def check(self, caller, method, details, target_uid=None, *, request):
        self.checked.append(method)
        return await super().check(caller, method, details, target_uid, request=request)

    async def _check(
        self, caller: Caller, action: str, details: dict[str, str], left: float | None = None
    ) -> tuple[bool, str]:
        self.asked.append(action)
        return action in self.allowed, "polkit (faked)"


class Backend:
    """A backend whose device resets, recording each reset; NVIDIA's by name and driver, so that a suspend of a
    process on it passes the refusals (the stand-in cuda-checkpoint, STAND_IN, answers every step)."""

    name = "nvidia"
    driver_version = "610.43"

    def __init__(self) -> None:
        self.resets: list[str] = []

    def check_reset(self, device_id: str) -> None:
        pass

    def reset(self, device_id: str) -> str:
        self.resets.append(device_id)
        return "reset (fake)"


@dataclass
class Served:
    bouncer: TablePolkit
    journal: Journal
    backend: Backend
    client: MessageBus
    service: str
    victim: subprocess.Popen
    start_time: int
    suspender: Suspender

    async def call(self, method: tuple[str, str]) -> Message:
        signature, body = CALLS[method]
        tree = {"tree": Variant("(ut)", [self.victim.pid, self.start_time])}
        if method[1] == "ResumeWorkload":
            held = SuspendedProcess(
                self.victim.pid, self.start_time, SOMEONE_ELSE, "victim", SUSPENDED, (0,), ("dev0",)
            )
            self.suspender.kept.add(Workload("PID victim", [held], Frozen("", "", ())))
        body = [{"pid": Variant("(ut)", [self.victim.pid, self.start_time])} if v == "$PIDSEL" else v for v in body]
        body = [
            self.victim.pid
            if v == "$PID"
            else self.start_time
            if v == "$START"
            else MANAGED.target
            if v == "$MANAGED"
            else tree
            if v == "$TREE"
            else v
            for v in body
        ]
        reply = await self.client.call(
            Message(
                destination=self.service,
                path=OBJECT_PATH,
                interface=method[0],
                member=method[1],
                signature=signature,
                body=body,
            )
        )
        assert reply is not None
        return reply


@pytest.fixture(scope="module")
def bus_address(tmp_path_factory) -> Iterator[str]:
    yield from open_bus(tmp_path_factory.mktemp("bus"))


@pytest.fixture
def victim():
    """A real process that the snapshot lists on GPU 0, as another user's unless a test says otherwise."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(5)


@contextlib.asynccontextmanager
async def serve(
    address: str, tmp_path: Path, victim: subprocess.Popen, allowed: set[str], victim_uid: int = SOMEONE_ELSE
) -> AsyncIterator[Served]:
    """gpukilld's bus side as main wires it, on the private bus, over a snapshot of two devices."""
    start_time = ProcFS().start_time(victim.pid)
    assert start_time is not None
    devices = tuple(
        Device(index=i, id=f"dev{i}", backend=Backend.name, vendor="test", name="Test GPU") for i in range(2)
    )
    listed = GpuProcess(
        pid=victim.pid,
        start_time=start_time,
        uid=victim_uid,
        user="victim",
        comm="victim",
        cmdline="victim",
        exe=None,
        device=0,
        device_id="dev0",
        gpu_memory=None,
        gpu_utilization=None,
    )
    snapshot = Snapshot(generation=1, taken_at=0.0, devices=devices, processes=(listed,), backends=())
    service = await MessageBus(bus_address=address).connect()
    client = await MessageBus(bus_address=address).connect()
    journal, backend = Journal(), Backend()
    table_polkit = TablePolkit(service, journal, allowed)

    async def resample() -> Snapshot:
        return snapshot

    stand_in = tmp_path / "cuda-checkpoint"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    killer = Killer()
    suspender = Suspender(
        snapshot=lambda: snapshot,
        resample=resample,
        backends=lambda: {Backend.name: backend},  # type: ignore[dict-item]
        bouncer=table_polkit,
        killer=killer,
        auditor=journal,  # type: ignore[arg-type]
        kept=SuspendedWorkloads(str(tmp_path / "state"), journal, killer.procfs),  # type: ignore[arg-type]
        settings=lambda: SuspendSettings(str(stand_in)),
        on_suspended=lambda *_: None,
        on_resumed=lambda *_: None,
    )
    actions = Actions(
        snapshot=lambda: snapshot,
        backends={Backend.name: backend},
        bouncer=table_polkit,
        killer=killer,
        auditor=journal,
        on_killed=lambda *_: None,  # type: ignore[arg-type]
        on_reset=lambda *_: None,
        resample=resample,
        suspender=suspender,
    )
    (tmp_path / "guard.d").mkdir(exist_ok=True)
    (tmp_path / "guard.d" / managed_policy.file_name(MANAGED)).write_text(managed_policy.render(MANAGED))
    runner = GuardRunner(
        actions.kill,
        journal,
        NotifyConfig(),
        str(tmp_path / "guard.d"),  # type: ignore[arg-type]
        str(tmp_path / "state"),
    )
    settings = AuditSettingsKeeper(
        str(tmp_path / "gpukilld.conf.d" / "50-audit.conf"), RogueWatch("/nonexistent"), journal
    )
    manager = ManagerInterface(
        lambda: snapshot,
        actions,
        table_polkit,
        lambda: 1.0,
        bus=service,
        audit_settings=settings,
        suspender=suspender,
    )
    service.add_message_handler(Door(service, table_polkit, manager.early_answer))
    service.export(OBJECT_PATH, manager)
    service.export(OBJECT_PATH, GuardInterface(runner, table_polkit, lambda: snapshot))
    try:
        yield Served(table_polkit, journal, backend, client, service.unique_name, victim, start_time, suspender)
    finally:
        client.disconnect()
        service.disconnect()


def acted(served: Served, method: tuple[str, str]) -> bool:
    """Whether the method's act was done: the victim killed, the device reset, the guard's audit of a change."""
    if method == KILL_METHOD or method[1] in ("KillProcessReport", "KillWorkload"):
        return served.victim.poll() is not None  # the kill path waits for the exit before it answers
    if method == RESET_METHOD:
        return served.backend.resets == ["dev1"]
    if method[1] in ("SuspendWorkload", "ResumeWorkload"):  # the driver's steps ran (an undone suspend too)
        act = "suspend" if method[1] == "SuspendWorkload" else "resume"
        return any(
            kind in (audit.SUSPEND, audit.SUSPEND_FAILED)
            and fields.get("action") == act
            and not fields.get("error")
            or kind is audit.SUSPEND_FAILED
            and fields.get("result") == "undone"
            for kind, _, fields in served.journal.entries
        )
    if method[1] in ("SetAuditSettings", "ImportAuditSettings"):
        return any(
            kind is audit.AUDIT_SETTINGS and fields.get("result") == "changed"
            for kind, _, fields in served.journal.entries
        )
    if method[1] == "Postpone":  # answered (no grace runs on the victim: refused by the runner, not polkit)
        return any(
            kind is audit.GUARD_POSTPONE and fields.get("result") != "denied"
            for kind, _, fields in served.journal.entries
        )
    if method[1] in ("SetPolicy", "RemovePolicy", "ImportPolicies"):  # a file of guard.d written or removed
        return any(
            kind is audit.GUARD_MANAGED_POLICY and fields.get("result") == "changed"
            for kind, _, fields in served.journal.entries
        )
    results = {"Enable": "enabled", "Disable": "disabled", "SetDryRun": "dry-run-on", "LoadPolicy": "loaded"}
    return any(
        kind is audit.GUARD_POLICY and fields.get("result") == results[method[1]]
        for kind, _, fields in served.journal.entries
    )


def test_the_calls_here_are_the_tables_privileged_methods():
    assert sorted(CALLS) == PRIVILEGED


@pytest.mark.parametrize("method", PRIVILEGED, ids=lambda m: m[1])
def test_a_privileged_method_asks_its_rows_action_and_a_denial_is_audited(bus_address, tmp_path, victim, method):
    async def run() -> None:
        async with serve(bus_address, tmp_path, victim, allowed=set()) as served:
            reply = await served.call(method)
            assert reply.message_type == MessageType.ERROR and reply.error_name == DENIED, reply.body
            assert "not authorized to" in reply.body[0]
            assert served.bouncer.checked == [method]
            row = bouncer.METHOD_ACTIONS[method]
            assert served.bouncer.asked == [str(row)]  # another user's target: an own/any row asks for any
            denials = [f for _, _, f in served.journal.entries if f.get("result") == "denied"]
            assert len(denials) == 1 and denials[0]["polkit_action"] == str(row), served.journal.entries
            assert denials[0]["caller_uid"] == CALLER_UID
            assert not acted(served, method)

    asyncio.run(run())


@pytest.mark.parametrize("row", [TEST_ACTION, READ_ONLY], ids=["another-action", "read-only"])
@pytest.mark.parametrize("method", PRIVILEGED, ids=lambda m: m[1])
def test_editing_a_row_changes_what_the_method_needs(bus_address, tmp_path, victim, monkeypatch, method, row):
    """The same call, polkit allowing only TEST_ACTION: denied with the shipped row, done with the edited one."""
    monkeypatch.setitem(bouncer.METHOD_ACTIONS, method, row)

    async def run() -> None:
        async with serve(bus_address, tmp_path, victim, allowed={TEST_ACTION}) as served:
            reply = await served.call(method)
            assert reply.message_type == MessageType.METHOD_RETURN, reply.body
            # READ_ONLY asks nobody; VIEW_ALL is no method's action: a kill's answer, which may name other
            # users' processes holding the GPU, asks it (without interaction) to decide what the reply shows
            asked = [a for a in served.bouncer.asked if a != bouncer.VIEW_ALL]
            assert asked == ([TEST_ACTION] if row else [])
            assert served.bouncer.asked.count(bouncer.VIEW_ALL) <= 1
            assert acted(served, method)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("victim_uid", "action"), [(CALLER_UID, KILL_OWN), (SOMEONE_ELSE, KILL_ANY)], ids=["own", "any"]
)
def test_a_kill_asks_the_own_or_any_action_of_its_row(bus_address, tmp_path, victim, victim_uid, action):
    async def run() -> None:
        async with serve(bus_address, tmp_path, victim, allowed={action}, victim_uid=victim_uid) as served:
            reply = await served.call(KILL_METHOD)
            assert reply.message_type == MessageType.METHOD_RETURN, reply.body
            assert served.bouncer.asked == [action]
            assert acted(served, KILL_METHOD)

    asyncio.run(run())


def test_an_unmapped_method_is_denied_without_asking_polkit():
    journal = Journal()

    async def run() -> None:
        table_polkit = TablePolkit(None, journal, allowed={KILL_ANY})  # type: ignore[arg-type]
        request = Request(audit.KILL_DENIED, "Frobnication", "frobnicate", {"action": "kill"})
        with pytest.raises(AccessDenied, match="not a method gpukilld allows"):
            await table_polkit.check(
                Caller(":1.1", CALLER_UID, 1, False), (MANAGER_INTERFACE, "Frobnicate"), {}, request=request
            )
        assert table_polkit.asked == []

    asyncio.run(run())
    assert [(k, f["result"]) for k, _, f in journal.entries] == [(audit.KILL_DENIED, "denied")]


def test_every_action_of_the_table_is_defined_by_the_policy_file():
    import xml.etree.ElementTree as ET

    from helpers.testbed import REPO

    defined = {a.get("id") for a in ET.parse(REPO / "polkit" / "org.gpukill.policy").getroot().iter("action")}
    named = {a.own for a in bouncer.METHOD_ACTIONS.values() if isinstance(a, OwnOrAny)}
    named |= {str(a) for a in bouncer.METHOD_ACTIONS.values() if a != READ_ONLY}
    assert KILL_OWN in named and named <= defined


# -- the real polkitd --------------------------------------------------------------------------------------

HOLD_A_CONNECTION = """
import asyncio, sys
from dbus_fast import BusType
from dbus_fast.aio import MessageBus

async def main():
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    print(bus.unique_name, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


@needs_root
def test_real_polkit_answers_the_action_the_table_picks(bed, users, monkeypatch):
    """'other' may kill its own processes (kill-own-process: yes) but not 'owner's (kill-any-process needs an
    admin's password, and nothing here is interactive); with KillProcess's row edited to kill-any alone,
    'other' may no longer kill its own either."""
    other = users["other"]
    holder = subprocess.Popen(
        [PYTHON, "-c", HOLD_A_CONNECTION],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=bed.env(),
        cwd="/",
        start_new_session=True,
        **other.popen_kwargs(),
    )
    bed.procs.append(holder)
    name = holder.stdout.readline().strip()
    assert name.startswith(":"), name
    caller = Caller(name, other.uid, holder.pid, interactive=False)
    journal = Journal()

    async def decide(target_uid: int) -> str:
        bus = await MessageBus(bus_address=bed.bus_address).connect()
        try:
            request = Request(audit.KILL_DENIED, "Kill of a test target", "kill a test target", {"action": "kill"})
            try:
                return await Bouncer(bus, RefusalLog(journal)).check(  # type: ignore[arg-type]
                    caller, KILL_METHOD, {"pid": "1"}, target_uid, request=request
                )
            except AccessDenied:
                return "denied"
        finally:
            bus.disconnect()

    try:
        assert asyncio.run(decide(other.uid)) == KILL_OWN
        assert asyncio.run(decide(users["owner"].uid)) == "denied"
        assert journal.entries[-1][2]["polkit_action"] == KILL_ANY
        monkeypatch.setitem(bouncer.METHOD_ACTIONS, KILL_METHOD, KILL_ANY)
        assert asyncio.run(decide(other.uid)) == "denied"
        assert journal.entries[-1][2]["polkit_action"] == KILL_ANY
    finally:
        holder.stdin.close()
        holder.wait(5)
