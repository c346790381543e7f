"""A long-lived D-Bus client for tests/test_fuzz_bus.py: one process per identity, many calls.

Reads one call spec per line (JSON) on standard input and answers each with one line (JSON) on standard output,
so a fuzz run starts one process per user instead of one per example. Run as any user (the test starts it with
User.popen_kwargs()); it connects to the system bus named by DBUS_SYSTEM_BUS_ADDRESS.

A spec: {"dest", "path", "iface" (null: no interface header), "member", "signature", "body", "flags",
"want_body"}. The body is written in a JSON form that the signature decodes ("wire JSON"):
  y n q i u x t  integers          b  true/false           d  a number, or NaN / Infinity / -Infinity
  s o g          strings           ay a hex string (bytes)
  a{KV}          a list of [key, value] pairs (keys may be of any basic type, so not a JSON object)
  aT             a list            (T...) a list, one item per field
  v              [signature, value of that signature]
Python's json reads and writes NaN and Infinity, and integers of any size.

An answer: {"ok": bool, "error": D-Bus error name or "", "message": the error text (at most 4,000 characters),
"message_len", "signature": the reply's, "size": bytes of the reply body, "elapsed": seconds, and with
want_body the body as plain JSON}; {"noreply": true} for a call sent with NO_REPLY_EXPECTED (followed by a
Peer.Ping to the same destination, so that the next call starts after the daemon read this one);
{"timeout": true} when no reply came in TIMEOUT seconds; {"client_error": text} when this client could not
build or send the message (a bug of the test's generator, not of the daemon); and {"fatal": text} when this
client's bus connection is gone (it exits after saying so).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast._private.marshaller import Marshaller
from dbus_fast.aio import MessageBus
from dbus_fast.signature import SignatureType, get_signature_tree

TIMEOUT = 30.0
NO_REPLY_EXPECTED = 0x1
MAX_MESSAGE = 4000


def decode(t: SignatureType, v: Any) -> Any:
    """Wire JSON of type t -> the Python value dbus-fast marshals as t."""
    tok = t.token
    if tok in "ynqiuxt":
        if type(v) is not int:
            raise TypeError(f"{tok}: not an integer: {v!r}")
        return v
    if tok == "b":
        if type(v) is not bool:
            raise TypeError(f"b: not a boolean: {v!r}")
        return v
    if tok == "d":
        return float(v)
    if tok in "sog":
        if type(v) is not str:
            raise TypeError(f"{tok}: not a string: {v!r}")
        return v
    if tok == "v":
        sig, inner = v
        return Variant(sig, decode(get_signature_tree(sig).types[0], inner))
    if tok == "(":
        if len(v) != len(t.children):
            raise TypeError(f"{t.signature}: {len(v)} fields")
        return [decode(c, x) for c, x in zip(t.children, v, strict=True)]
    if tok == "a":
        child = t.children[0]
        if child.token == "y":
            return bytes.fromhex(v)
        if child.token == "{":
            kt, vt = child.children
            return {decode(kt, k): decode(vt, x) for k, x in v}
        return [decode(child, x) for x in v]
    raise TypeError(f"unsupported type {t.signature!r}")


def decode_body(signature: str, body: list) -> list:
    types = get_signature_tree(signature).types
    if len(types) != len(body):
        raise TypeError(f"signature {signature!r} has {len(types)} types, body {len(body)} values")
    return [decode(t, v) for t, v in zip(types, body, strict=True)]


def plain(value: Any) -> Any:
    """A reply value as plain JSON (variants unwrapped, bytes as latin-1, non-finite floats as strings)."""
    if isinstance(value, Variant):
        return plain(value.value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


async def one_call(bus: MessageBus, spec: dict) -> dict:
    try:
        msg = Message(
            destination=spec.get("dest", "org.gpukill1"),
            path=spec["path"],
            interface=spec.get("iface"),
            member=spec["member"],
            signature=spec.get("signature", ""),
            body=decode_body(spec.get("signature", ""), spec.get("body", [])),
            flags=spec.get("flags", 0),
        )
        msg._marshall(False)  # fail here, as a client error, on a body that does not fit its signature
    except Exception as e:
        return {"client_error": f"{type(e).__name__}: {e}"}
    start = time.monotonic()
    if msg.flags.value & NO_REPLY_EXPECTED:
        try:
            await bus.send(msg)
            ping = await asyncio.wait_for(
                bus.call(
                    Message(destination=msg.destination, path="/", interface="org.freedesktop.DBus.Peer", member="Ping")
                ),
                TIMEOUT,
            )
        except TimeoutError:
            return {"timeout": True, "after": "noreply"}
        except Exception as e:
            return {"client_error": f"{type(e).__name__}: {e}"}
        out = {"noreply": True, "elapsed": time.monotonic() - start}
        if ping is None or ping.message_type == MessageType.ERROR:
            out["ping_error"] = ping.error_name if ping is not None else "none"
        return out
    try:
        reply = await asyncio.wait_for(bus.call(msg), TIMEOUT)
    except TimeoutError:
        return {"timeout": True, "elapsed": time.monotonic() - start}
    except Exception as e:
        return {"client_error": f"{type(e).__name__}: {e}"}
    elapsed = time.monotonic() - start
    if reply is None:
        return {"client_error": "no reply object"}
    size = len(Marshaller(reply.signature, reply.body).marshall()) if reply.signature else 0
    out = {
        "ok": reply.message_type != MessageType.ERROR,
        "signature": reply.signature,
        "size": size,
        "elapsed": elapsed,
        "error": "",
        "message": "",
        "message_len": 0,
    }
    if reply.message_type == MessageType.ERROR:
        text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
        out.update(error=reply.error_name or "", message=text[:MAX_MESSAGE], message_len=len(text))
    elif spec.get("want_body"):
        out["body"] = plain(reply.body)
    return out


async def main() -> None:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": True, "unique_name": bus.unique_name}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        spec = json.loads(line)
        out = await one_call(bus, spec)
        if not bus.connected:
            out = {"fatal": f"the client's bus connection is gone after this call ({out})"}
        print(json.dumps(out), flush=True)
        if "fatal" in out:
            break
    bus.disconnect()


if __name__ == "__main__":
    asyncio.run(main())
