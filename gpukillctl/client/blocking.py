"""The client library's blocking transport, for one-shot commands: jeepney's blocking connection to the system bus.

A one-shot `gpukillctl list` is mostly interpreter start-up and imports: asyncio (~27 ms) and dbus-fast (~35 ms
more) cost more than the whole call, while jeepney (pure Python, blocking API) costs ~6 ms. So the one-shot
commands (list, kill PID, reset, status, guard, audit) run on this transport and the long-lived front ends keep
dbus-fast on asyncio (gpukillctl/client/dbus.py). The typed API is api.ClientAPI's, written once: its
coroutines, run here, never suspend (each call blocks until its reply), so `finish` runs a command's coroutine
to its end with no event loop at all.
"""

from __future__ import annotations

from collections.abc import Coroutine
from functools import lru_cache
from typing import Any, TypeVar

from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import DBusConnection, open_dbus_connection
from jeepney.low_level import (
    Array,
    DictEntry,
    HeaderFields,
    MessageFlag,
    MessageType,
    Struct,
    Variant,
    parse_signature,
)

from .api import (
    BUS_NAME,
    CALL_TIMEOUT,
    INTERFACE,
    OBJECT_PATH,
    TIMEOUT,
    ClientAPI,
    ClientError,
    DaemonUnavailable,
    error_for,
)

T = TypeVar("T")


class BlockingClient(ClientAPI):
    def __init__(self, connection: DBusConnection) -> None:
        self.connection = connection

    @property
    def unique_name(self) -> str:
        return self.connection.unique_name

    @classmethod
    def connect(cls) -> BlockingClient:
        """The system bus here (DBUS_SYSTEM_BUS_ADDRESS, else the standard socket)."""
        try:
            return cls(open_dbus_connection(bus="SYSTEM"))
        except Exception as e:
            raise DaemonUnavailable("", f"cannot connect to the system bus: {e}") from None

    def close(self) -> None:
        self.connection.close()

    async def _call(
        self,
        member: str,
        signature: str = "",
        body: list | None = None,
        *,
        interface: str = INTERFACE,
        interactive: bool = False,
        timeout: float = CALL_TIMEOUT,
    ) -> list:
        msg = new_method_call(DBusAddress(OBJECT_PATH, BUS_NAME, interface), member, signature, tuple(body or ()))
        if interactive:
            msg.header.flags |= MessageFlag.allow_interactive_authorization
        try:
            reply = self.connection.send_and_get_reply(msg, timeout=timeout)
        except TimeoutError:
            raise ClientError(TIMEOUT, f"gpukilld did not answer within {timeout:g}s") from None
        except (OSError, EOFError) as e:
            raise DaemonUnavailable("", f"lost the system bus: {e}") from None
        fields = reply.header.fields
        if reply.header.message_type == MessageType.error:
            name = fields.get(HeaderFields.error_name, "")
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else name
            raise error_for(name, text)
        return plain_body(fields.get(HeaderFields.signature, ""), reply.body)


def finish(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (a command on BlockingClient), run without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    # Something awaited an event loop's future: that command belongs on the asyncio transport.
    raise RuntimeError("a one-shot command waited for an event loop")


@lru_cache(maxsize=256)
def _types(signature: str) -> tuple:
    chars = list(signature)
    types = []
    while chars:
        types.append(parse_signature(chars))
    return tuple(types)


def plain_body(signature: str, body: tuple) -> list:
    """A reply's body as the asyncio transport gives it: variants unwrapped, structs as lists. A body with no
    variant inside is already plain but for its structs, which stay jeepney's tuples (read by index or unpacked
    alike): walking the compact listing's 256 rows to make lists of them would cost ~0.7 ms for nothing."""
    if "v" not in signature:
        return list(body)
    return [_plain(t, v) for t, v in zip(_types(signature), body, strict=True)]


def _plain(kind: Any, value: Any) -> Any:
    if isinstance(kind, Variant):
        signature, inner = value
        (inner_kind,) = _types(signature)
        return _plain(inner_kind, inner)
    if isinstance(kind, Array):
        element = kind.elt_type
        if isinstance(element, DictEntry):
            value_kind = element.fields[1]
            return {k: _plain(value_kind, v) for k, v in value.items()}
        if isinstance(value, bytes):
            return value
        return [_plain(element, v) for v in value]
    if isinstance(kind, Struct):
        return [_plain(k, v) for k, v in zip(kind.fields, value, strict=True)]
    return value
