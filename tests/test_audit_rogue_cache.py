"""AuditRogue is answered from a reply built once per snapshot and kind of viewer, as ListProcesses is.

Before: every call filtered, sorted and converted all findings again (4.5 ms at 300 findings, 18 ms at 1,000), at
the 200 calls a second each person may make. Here the real Door and Manager on a private bus of the test's own,
a real client calling AuditRogue 50 times over 1,000 findings: the findings are read for it once per snapshot
generation and kind of viewer, and every caller still gets what it may see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from helpers.open_bus import open_bus

from gpukill.records.audit import Evidence, Finding
from gpukilld.access.bouncer import Bouncer, Caller
from gpukilld.access.people import People
from gpukilld.bus import manager as manager_module
from gpukilld.bus.door import Door
from gpukilld.bus.manager import ManagerInterface
from gpukilld.model import Snapshot
from gpukilld.names import MANAGER_INTERFACE, OBJECT_PATH

ALICE, BOB = 4242, 4343


@pytest.fixture(scope="module")
def bus_address(tmp_path_factory) -> Iterator[str]:
    yield from open_bus(tmp_path_factory.mktemp("bus"))


class ChosenCaller(Bouncer):
    """The real Bouncer with the caller's uid chosen by the test and polkit saying no to view-all."""

    def __init__(self, bus: MessageBus) -> None:
        super().__init__(bus, people=People("/nonexistent/subuid"))
        self.uid = ALICE

    async def caller(self, msg: Message) -> Caller:
        return Caller(msg.sender, self.uid, None, False)

    def known(self, msg: Message) -> Caller | None:
        return Caller(msg.sender, self.uid, None, False)

    async def _check(self, caller, action, details, left=None) -> tuple[bool, str]:
        return False, "not authorized (faked)"


def findings(n: int) -> tuple[Finding, ...]:
    return tuple(
        Finding(
            kind="miner",
            score=i % 100,
            uid=ALICE if i % 2 else BOB,
            user="u",
            pid=1000 + i,
            start_time=i,
            comm=f"proc{i}",
            evidence=(Evidence("miner-name", 40, f"name {i}"),),
        )
        for i in range(n)
    )


def test_audit_rogue_is_built_once_per_snapshot_and_viewer(bus_address, monkeypatch):
    reads: list[int] = []
    real = manager_module.findings_as_seen

    def counted(found, viewer):
        reads.append(viewer.uid)
        return real(found, viewer)

    monkeypatch.setattr(manager_module, "findings_as_seen", counted)

    async def run() -> tuple[list, list, list]:
        snapshot = [
            Snapshot(generation=1, taken_at=0.0, devices=(), processes=(), backends=(), findings=findings(1000))
        ]
        service = await MessageBus(bus_address=bus_address).connect()
        client = await MessageBus(bus_address=bus_address).connect()
        bouncer = ChosenCaller(service)
        manager = ManagerInterface(
            lambda: snapshot[0],
            None,
            bouncer,
            lambda: 1.0,  # type: ignore[arg-type]
            bus=service,
        )
        service.add_message_handler(Door(service, bouncer, manager.early_answer))
        service.export(OBJECT_PATH, manager)

        async def audit() -> list:
            reply = await client.call(
                Message(
                    destination=service.unique_name, path=OBJECT_PATH, interface=MANAGER_INTERFACE, member="AuditRogue"
                )
            )
            assert reply.message_type is MessageType.METHOD_RETURN, reply.body
            return reply.body[0]

        try:
            alice = [await audit() for _ in range(50)]
            bouncer.uid = BOB
            bob = await audit()
            snapshot[0] = Snapshot(
                generation=2, taken_at=0.0, devices=(), processes=(), backends=(), findings=findings(10)
            )
            bouncer.uid = ALICE
            newer = await audit()
            return alice, [bob], [newer]
        finally:
            client.disconnect()
            service.disconnect()

    alice, (bob,), (newer,) = asyncio.run(run())
    assert reads == [ALICE, BOB, ALICE]  # before: 52 reads, one per call
    assert all(reply == alice[0] for reply in alice) and len(alice[0]) == 1000
    assert [f["score"].value for f in alice[0][:3]] == [99, 99, 99]  # highest first
    # each viewer sees its own processes by name and others' without (as ListProcesses shows them)
    assert {f["comm"].value for f in alice[0] if f["uid"].value == ALICE and "comm" in f} != set()
    assert alice[0] != bob
    assert len(newer) == 10  # a new generation is read again
