"""Emit one D-Bus signal on the system bus, as whoever runs it (tests run it as an unprivileged user to forge
gpukilld's signals: the bus lets any connection send a signal with any path, interface and member).

Standard input: a JSON object {path, iface, member, signature, body}, variants as in dbus_call.py. The signal
is broadcast (no destination). Output: {"sender": the unique name it was sent from}, once it is flushed.
"""

import asyncio
import json
import sys

from dbus_call import to_dbus
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus


async def emit(spec):
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    await bus.send(
        Message(
            message_type=MessageType.SIGNAL,
            path=spec["path"],
            interface=spec["iface"],
            member=spec["member"],
            signature=spec["signature"],
            body=to_dbus(spec["body"]),
        )
    )
    # a round trip to the bus: it has read the signal before it answers this
    await bus.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member="GetId",
        )
    )
    sender = bus.unique_name
    bus.disconnect()
    return {"sender": sender}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(emit(json.load(sys.stdin)))))
