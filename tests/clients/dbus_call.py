"""Make one D-Bus method call on the system bus and print the outcome as JSON (run as any user by tests).

Standard input: a JSON object {dest, path, iface, member, signature, body} (stdin, as bodies can be huge). Variants in
the body are written as
{"$variant": [signature, value]}. Output: {"ok", "body", "error", "message"}.
"""

import asyncio
import json
import sys

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus


def to_dbus(value):
    if isinstance(value, dict):
        if set(value) == {"$variant"}:
            sig, inner = value["$variant"]
            return Variant(sig, to_dbus(inner))
        return {k: to_dbus(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_dbus(v) for v in value]
    return value


def from_dbus(value):
    if isinstance(value, Variant):
        return from_dbus(value.value)
    if isinstance(value, dict):
        return {k: from_dbus(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [from_dbus(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return value


async def call(spec):
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    reply = await bus.call(
        Message(
            destination=spec["dest"],
            path=spec["path"],
            interface=spec["iface"],
            member=spec["member"],
            signature=spec["signature"],
            body=to_dbus(spec["body"]),
        )
    )
    bus.disconnect()
    if reply.message_type == MessageType.ERROR:
        return {"ok": False, "error": reply.error_name, "message": reply.body[0] if reply.body else ""}
    return {"ok": True, "body": from_dbus(reply.body)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(call(json.load(sys.stdin)))))
