"""List processes both ways, ListProcesses (a{sv}) and ListProcessesCompact, for each filter given, and print
what each gave as plain records (run as any user by tests/test_listing.py).

Standard input: a JSON list of filters, variants written as {"$variant": [signature, value]}. Output: a JSON
list, per filter {"records": [...], "compact": [...]}, each a list of to_plain records or {"error": NAME}.
"""

import asyncio
import json
import sys

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpukill import listing
from gpukill.records import Process, from_plain, to_plain


def to_dbus(value):
    if isinstance(value, dict):
        if set(value) == {"$variant"}:
            sig, inner = value["$variant"]
            return Variant(sig, to_dbus(inner))
        return {k: to_dbus(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_dbus(v) for v in value]
    return value


def unwrap(value):
    if isinstance(value, Variant):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    return value


async def call(bus, member, signature, filter_):
    reply = await bus.call(Message(destination="org.gpukill1", path="/org/gpukill1",
                                   interface="org.gpukill1.Manager", member=member, signature="a{sv}",
                                   body=[to_dbus(filter_)]))
    if reply.message_type == MessageType.ERROR:
        return {"error": reply.error_name}
    assert reply.signature == signature, reply.signature
    if member == listing.METHOD:
        return [to_plain(p) for p in listing.processes_from_reply(reply.body)]
    return [to_plain(from_plain(Process, unwrap(r))) for r in reply.body[0]]


async def main(filters):
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    out = [{"records": await call(bus, "ListProcesses", "aa{sv}", f),
            "compact": await call(bus, listing.METHOD, listing.OUT_SIGNATURE, f)} for f in filters]
    bus.disconnect()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.load(sys.stdin)))))
