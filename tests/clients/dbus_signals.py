"""Print every org.gpukill1.Manager and org.gpukill1.Guard signal on the system bus as one JSON line (run as
any user by tests)."""

import asyncio
import json

from dbus_call import from_dbus
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

INTERFACES = ("org.gpukill1.Manager", "org.gpukill1.Guard")


async def main():
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    for iface in INTERFACES:
        await bus.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="AddMatch",
                signature="s",
                body=[f"type='signal',interface='{iface}'"],
            )
        )

    def on_message(msg):
        if msg.message_type == MessageType.SIGNAL and msg.interface in INTERFACES:
            print(json.dumps({"member": msg.member, "body": from_dbus(msg.body)}), flush=True)

    bus.add_message_handler(on_message)
    print(json.dumps({"member": "_ready"}), flush=True)
    await bus.wait_for_disconnect()


asyncio.run(main())
