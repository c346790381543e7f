"""A hostile user's tool, run as that user by tests/test_hostile.py: a polkit authentication agent that never
answers, and floods of requests to gpukilld from one connection.

It registers itself with polkitd as the authentication agent of its own process, so every interactive
authorization of its requests ends in BeginAuthentication here, which is never answered: each such request
stays pending in gpukilld for as long as gpukilld lets it. Commands, one JSON object per line on stdin:

  {"flood": N, "member": "KillProcess", "signature": "uta{sv}", "body": [...], "interactive": true, "wait": S,
   "batch": B, "pause": P}
      send N copies of the call, B at a time (default 100), waiting up to S seconds for each wave and P more
      seconds after it (default 0: a paced flood stays under gpukilld's per-uid call rate); print how
      they ended (error names counted, "pending" for those still unanswered: they stay pending until this
      process exits)

Lines printed: {"ready": UNIQUE_NAME}, {"begin": COOKIE} / {"cancel": COOKIE} as polkitd calls the agent,
and {"flood": {...}} per flood.
"""

import asyncio
import json
import os
import sys

from dbus_call import to_dbus  # this folder: the tests' one encoding of variants in JSON
from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag
from dbus_fast.service import ServiceInterface, method

from gpukilld.bus import writer as busio

AGENT_PATH = "/org/gpukill/test/HostileAgent"


def say(obj) -> None:
    print(json.dumps(obj), flush=True)


class NeverAnswers(ServiceInterface):
    def __init__(self) -> None:
        super().__init__("org.freedesktop.PolicyKit1.AuthenticationAgent")

    @method()
    async def BeginAuthentication(
        self, action_id: "s", message: "s", icon_name: "s", details: "a{ss}", cookie: "s", identities: "a(sa{sv})"
    ):
        say({"begin": cookie})
        await asyncio.Event().wait()  # the password that never comes

    @method()
    def CancelAuthentication(self, cookie: "s"):
        say({"cancel": cookie})


def start_time() -> int:
    with open(f"/proc/{os.getpid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


async def flood(bus: MessageBus, spec: dict) -> dict:
    """spec["flood"] calls, spec.get("batch", 100) at a time: dbus-daemon lets one connection wait for at most
    128 replies, so a flood bigger than that comes in waves."""
    flags = MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if spec.get("interactive") else MessageFlag.NONE
    outcome: dict[str, int] = {"pending": 0}
    left, batch = spec["flood"], spec.get("batch", 100)
    while left > 0:
        calls = [
            asyncio.ensure_future(
                bus.call(
                    Message(
                        destination="org.gpukill1",
                        path="/org/gpukill1",
                        interface=spec.get("interface", "org.gpukill1.Manager"),
                        member=spec["member"],
                        signature=spec["signature"],
                        body=to_dbus(spec["body"]),
                        flags=flags,
                    )
                )
            )
            for _ in range(min(left, batch))
        ]
        left -= len(calls)
        done, pending = await asyncio.wait(calls, timeout=spec.get("wait", 5.0))
        outcome["pending"] += len(pending)
        await asyncio.sleep(spec.get("pause", 0.0))
        for fut in done:
            reply = fut.result()
            key = reply.error_name if reply.message_type == MessageType.ERROR else "ok"
            outcome[key] = outcome.get(key, 0) + 1
    return outcome


async def main() -> None:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    busio.tolerate_full_socket(bus)  # a thousand calls at once fill the socket: dbus-fast would drop the bus
    bus.export(AGENT_PATH, NeverAnswers())
    subject = [
        "unix-process",
        {"pid": Variant("u", os.getpid()), "start-time": Variant("t", start_time()), "uid": Variant("i", os.getuid())},
    ]
    reply = await bus.call(
        Message(
            destination="org.freedesktop.PolicyKit1",
            path="/org/freedesktop/PolicyKit1/Authority",
            interface="org.freedesktop.PolicyKit1.Authority",
            member="RegisterAuthenticationAgent",
            signature="(sa{sv})ss",
            body=[subject, "C", AGENT_PATH],
        )
    )
    if reply.message_type == MessageType.ERROR:
        say({"error": f"{reply.error_name}: {reply.body}"})
        return
    say({"ready": bus.unique_name})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        spec = json.loads(line)
        say({"flood": await flood(bus, spec)})


if __name__ == "__main__":
    asyncio.run(main())
