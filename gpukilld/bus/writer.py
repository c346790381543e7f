"""Two changes to how gpukilld's bus connection writes, over dbus-fast internals; each is feature-detected
and falls back to dbus-fast's own behaviour, and tests/test_busio.py checks both against the library.

1. A full socket buffer is not a disconnect. dbus-fast's asyncio writer treats EAGAIN from send() as a fatal
   error and drops the connection (python-dbus-next issue #153, still so in dbus-fast 5.2). Large replies to
   many concurrent callers fill the buffer whenever dbus-daemon falls behind, so any user could make the
   daemon fall off the bus. We make EAGAIN mean "0 bytes written": the writer then keeps the buffer and waits
   for the socket to become writable, as it already does after a partial write.

2. ListProcesses without a filter is the hot call, and its reply body is the same for every caller who sees
   the same processes until the next sample. We marshal that body once per snapshot and kind of caller, and
   only build the small header per call.

And one measurement: backlog_bytes(), what waits in the writer, so large replies can be refused while the
connection is backed up instead of queueing without bound in the daemon's memory.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

from dbus_fast import Message
from dbus_fast._private.marshaller import Marshaller
from dbus_fast.aio import MessageBus

log = logging.getLogger(__name__)

LITTLE_ENDIAN = ord("l")
METHOD_RETURN = 2
PROTOCOL_VERSION = 1
HEADER_REPLY_SERIAL = 5
HEADER_DESTINATION = 6
HEADER_SIGNATURE = 8
# endianness, type, flags, version, body length, serial, length of the header fields' array
_FIXED_HEAD = struct.Struct("<BBBBIII")
# a header field holding a u (or an s's length): code, its signature (length 1, the letter, NUL), the u32
_FIELD_HEAD = struct.Struct("<BBcxI")
# the signature field: code, signature "g", the signature's length byte (its bytes and NUL follow)
_SIGNATURE_FIELD_HEAD = struct.Struct("<BBcxB")


class _FullBufferIsNotFatal:
    """A socket whose send() reports a full buffer as 0 bytes written instead of raising."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def send(self, data: Any, *args: Any) -> int:
        try:
            return self._sock.send(data, *args)
        except (BlockingIOError, InterruptedError):
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def tolerate_full_socket(bus: MessageBus) -> bool:
    """Apply fix 1 to a connected bus. False (and a warning) if this dbus-fast is shaped differently."""
    writer = getattr(bus, "_writer", None)
    if writer is None or not hasattr(writer, "sock") or getattr(bus, "_negotiate_unix_fd", False):
        log.warning("dbus-fast internals changed: a full bus socket may still drop the connection")
        return False
    writer.sock = _FullBufferIsNotFatal(writer.sock)
    return True


def backlog_bytes(bus: MessageBus, give_up_after: int = 4096) -> int:
    """Bytes of messages queued on the connection and not yet taken by dbus-daemon (a large number when more
    than give_up_after messages wait: counting them would itself cost)."""
    writer: Any = getattr(bus, "_writer", None)  # dbus-fast's private writer: untyped
    messages = getattr(writer, "messages", None)
    if messages is None:
        return 0
    if len(messages) > give_up_after:
        return 1 << 62
    current = writer.buf  # the message being written, partly sent
    pending = len(current) - writer.offset if current is not None else 0
    return pending + sum(len(m[0]) for m in messages)


def marshal_body(signature: str, body: list) -> bytes:
    return bytes(Marshaller(signature, body).marshall())


def _reply_header(call: Message, signature: str, body_len: int, serial: int) -> bytes:
    """The header dbus-fast's Marshaller writes for a METHOD_RETURN (fields: reply serial, destination,
    signature), packed by hand: it is built for every answered call, and Variants plus a Marshaller cost ~10x
    more. tests/test_busio.py checks it byte for byte against dbus-fast's own reply."""
    dest = call.sender.encode()
    sig = signature.encode()
    destination = _FIELD_HEAD.pack(HEADER_DESTINATION, 1, b"s", len(dest)) + dest + b"\0"
    fields = (
        _FIELD_HEAD.pack(HEADER_REPLY_SERIAL, 1, b"u", call.serial)
        + destination
        + b"\0" * (-len(destination) % 8)  # each field starts on an 8-byte boundary
        + _SIGNATURE_FIELD_HEAD.pack(HEADER_SIGNATURE, 1, b"g", len(sig))
        + sig
        + b"\0"
    )
    raw = _FIXED_HEAD.pack(LITTLE_ENDIAN, METHOD_RETURN, 0, PROTOCOL_VERSION, body_len, serial, len(fields)) + fields
    return raw + b"\0" * (-len(raw) % 8)  # the body starts on an 8-byte boundary


def build_reply(call: Message, signature: str, body: bytes, serial: int) -> bytes:
    """The bytes of a METHOD_RETURN to `call` carrying an already marshalled body."""
    return _reply_header(call, signature, len(body), serial) + body


def send_premarshalled_reply(bus: MessageBus, call: Message, signature: str, body: bytes) -> bool:
    """Send a reply with a cached body (fix 2). False when dbus-fast's writer is not as expected.

    With nothing queued, the reply is written at once, header and body gathered by one sendmsg (no copy of
    the body), as dbus-fast's own schedule_write does when its queue is empty; what the socket does not take
    is queued for the writer. Going through the queue every time costs an event-loop round (add_writer, a
    writable event, remove_writer): for 32 observers each listing once a second, about half of gpukilld's CPU
    per call (bench/README.md, list_latency)."""
    writer: Any = getattr(bus, "_writer", None)  # dbus-fast's private writer: untyped
    messages = getattr(writer, "messages", None)
    if messages is None or not hasattr(writer, "schedule_write") or not hasattr(writer, "buf"):
        return False
    header = _reply_header(call, signature, len(body), bus.next_serial())
    sent = 0
    if not messages and writer.buf is None:  # nothing ahead of it: order is kept
        try:
            sent = writer.sock.sendmsg([header, body])
        except OSError:  # a full buffer (EAGAIN) or a broken connection: the writer finds out and says which
            sent = 0
        if sent == len(header) + len(body):
            return True
    messages.append((bytearray((header + body)[sent:]), None, None))
    writer.schedule_write()
    return True
