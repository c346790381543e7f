"""List processes both ways, ListProcesses (a{sv}) and ListProcessesCompact, for each filter given, and print
what each gave as plain records (run as any user by tests/test_listing.py).

Standard input: a JSON list of filters, variants written as {"$variant": [signature, value]}. Output: a JSON
list, per filter {"records": [...], "compact": [...]}, each a list of to_plain records or {"error": NAME}.
"""

import asyncio
import json
import sys

from dbus_call import from_dbus, to_dbus  # this folder's generic caller: JSON <-> D-Bus values
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from gpukill import listing
from gpukill.records.base import from_plain, to_plain
from gpukill.records.manager import Process


async def call(bus, member, signature, filter_):
    reply = await bus.call(
        Message(
            destination="org.gpukill1",
            path="/org/gpukill1",
            interface="org.gpukill1.Manager",
            member=member,
            signature="a{sv}",
            body=[to_dbus(filter_)],
        )
    )
    if reply.message_type == MessageType.ERROR:
        return {"error": reply.error_name}
    assert reply.signature == signature, reply.signature
    if member == listing.METHOD:
        return [to_plain(p) for p in listing.processes_from_reply(reply.body)]
    return [to_plain(from_plain(Process, from_dbus(r))) for r in reply.body[0]]


async def main(filters):
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    out = [
        {
            "records": await call(bus, "ListProcesses", "aa{sv}", f),
            "compact": await call(bus, listing.METHOD, listing.OUT_SIGNATURE, f),
        }
        for f in filters
    ]
    bus.disconnect()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.load(sys.stdin)))))
