"""The bus layer both interfaces share: the door every message passes first, the call in progress and who
made it, how failures become D-Bus errors, and the names of output arguments (gpukilld's own names on the
bus are in gpukilld/names.py).

dbus-fast hands method bodies their arguments but not the message, and we need the sender (for polkit and
the audit) and its flags (interactive authorization). The Door sees every message first: it holds each person
(a uid and its subordinate uids, gpukilld/access/people.py) to its call rate, denies any member of our interfaces the
bouncer's
table does not map, and otherwise remembers the message in a context variable that current_caller() reads.
dbus-fast starts each async method as a Task, which copies the context at that moment. Whether a mapped call is
then allowed is the bouncer's check, made by the act itself (Actions, the Guard interface).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from dbus_fast import DBusError, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag

from gpukill.errors import AccessDenied, GpukillError, TooBusy

from ..access.bouncer import READ_ONLY, Bouncer, Caller, action_for
from ..access.callrate import BURST, RATE, CallRate
from ..names import INTERFACES, OBJECT_PATH

log = logging.getLogger(__name__)

NO_REPLY_EXPECTED = MessageFlag.NO_REPLY_EXPECTED.value
# Calls answered before the caller's uid is known (the Door asks at its first call; a flood can send hundreds
# meanwhile): at most a burst per connection and a few bursts for all together, each charged to the uid's person
# once it is known (CallRate.charge), so that they count like any other call.
MAX_UNIDENTIFIED = int(BURST)
MAX_UNIDENTIFIED_TOTAL = 4 * int(BURST)

_current_call: ContextVar[Message | None] = ContextVar("gpukill_current_call", default=None)

# Answers a mapped call before its method runs, or returns None to let the method answer (see Door).
EarlyAnswer = Callable[[Message], Message | bool | None]


class Door:
    """First look at every message to our object: hold each person to its call rate, deny members of our
    interfaces that the bouncer's table does not map, drop read-only calls nobody waits to hear answered,
    let `early` answer what it can without the method (the Manager's unfiltered ListProcesses, from a body
    marshalled once per snapshot), and remember the call for current_caller()."""

    def __init__(self, bus: MessageBus, bouncer: Bouncer, early: EarlyAnswer) -> None:
        self.bus = bus
        self.bouncer = bouncer
        self.early = early
        self.rate = CallRate()
        self._unidentified: dict[str, int] = {}  # sender -> calls let through before its uid was known
        self._unidentified_total = 0
        self._lookups: set[asyncio.Future] = set()  # credential lookups the Door started, kept until done

    def __call__(self, msg: Message) -> Message | bool | None:
        if msg.message_type is not MessageType.METHOD_CALL:
            return None
        no_reply = bool(msg.flags.value & NO_REPLY_EXPECTED)
        if msg.path != OBJECT_PATH:
            # Nothing else is exported. A call elsewhere nobody waits on has nothing to do, and dbus-fast would
            # log the error its Properties handler raises for it (no object there) with a traceback.
            return True if no_reply else None
        iface = msg.interface
        caller = self.bouncer.known(msg)  # a connection's first call is looked up by the method, then known
        if caller is None:
            if not self._let_unidentified(msg):
                return (
                    True
                    if no_reply
                    else Message.new_error(
                        msg, TooBusy.dbus_name, "gpukilld has not identified this connection yet; wait for a reply"
                    )
                )
        else:
            person = self._person(caller.uid)
            if self._unidentified:
                self.rate.charge(person, self._identified(msg.sender))
            if not self.rate.allow(person):
                return (
                    True
                    if no_reply
                    else Message.new_error(
                        msg,
                        TooBusy.dbus_name,
                        f"{self.bouncer.people.charged(caller.uid)} calls gpukilld more than "
                        f"{RATE:g} times a second; slow down",
                    )
                )
        if iface in INTERFACES or iface is None:
            action = action_for(iface, msg.member or "")  # a method call always names its member
            if action is None:
                return (
                    True
                    if no_reply
                    else Message.new_error(
                        msg,
                        "org.freedesktop.DBus.Error.AccessDenied",
                        f"{iface or '(no interface)'}.{msg.member} is not a method gpukilld allows",
                    )
                )
            if no_reply and action == READ_ONLY:
                return True  # a question nobody waits to hear answered: nothing to do
            answered = self.early(msg)
            if answered is not None:
                return answered
            _current_call.set(msg)
        elif no_reply:
            # Properties, Introspectable, Peer: only questions. Dropped, so that dbus-fast has no error to log
            # with a traceback for a call nobody waits on (any user could fill the journal with those).
            return True
        elif iface == "org.freedesktop.DBus.Properties" and msg.member == "Set":
            return Message.new_error(
                msg, "org.freedesktop.DBus.Error.PropertyReadOnly", "gpukilld properties are read-only"
            )
        return None

    def _person(self, uid: int) -> int:
        """Whom the call rate charges uid's calls to: its owner for a subordinate uid (gpukilld/access/people.py)."""
        return self.bouncer.people.person(uid) if uid else 0

    def _let_unidentified(self, msg: Message) -> bool:
        """Whether a call from a connection whose uid is not known yet may go on. The first one starts the
        lookup: not every call reaches a method that would (properties, ListDevices)."""
        count = self._unidentified.get(msg.sender, 0)
        if count >= MAX_UNIDENTIFIED or self._unidentified_total >= MAX_UNIDENTIFIED_TOTAL:
            return False
        self._unidentified[msg.sender] = count + 1
        self._unidentified_total += 1
        if count == 0:
            task = asyncio.ensure_future(self.bouncer.caller(msg))
            self._lookups.add(task)
            task.add_done_callback(functools.partial(self._looked_up, msg.sender))
        return True

    def _identified(self, sender: str) -> int:
        """The calls let through before the sender was known, forgotten now that it is."""
        calls = self._unidentified.pop(sender, 0)
        self._unidentified_total -= calls
        return calls

    def _looked_up(self, sender: str, task: asyncio.Future) -> None:
        self._lookups.discard(task)
        if task.cancelled() or task.exception() is not None:  # the connection is gone: nothing to charge
            self._identified(sender)
            if not task.cancelled():
                log.debug("could not identify a caller: %s", task.exception())
            return
        self.rate.charge(self._person(task.result().uid), self._identified(sender))


async def current_caller(bouncer: Bouncer) -> Caller:
    """Who made the call in progress (the message the Door remembered); AccessDenied when that is unknown."""
    msg = _current_call.get()
    if msg is None:  # cannot happen while the Door is installed; refuse rather than act unidentified
        raise AccessDenied("caller could not be identified")
    try:
        return await bouncer.caller(msg)
    except Exception as e:
        raise AccessDenied(f"caller could not be identified: {e}") from None


def dbus_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Our failures become the D-Bus errors named in gpukill/errors.py; the caller gets one line, never a
    traceback. A call sent with NO_REPLY_EXPECTED gets no error at all: dbus-fast would log it with a
    traceback, and that would let any user write to the journal at will (the refusal itself is audited,
    folded per person)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except (GpukillError, DBusError) as e:
            msg = _current_call.get()
            if msg is not None and msg.flags.value & NO_REPLY_EXPECTED:
                return None
            if isinstance(e, DBusError):
                raise
            raise DBusError(e.dbus_name, str(e)) from None

    return wrapper


def name_outputs(cls: type, names: dict[str, list[str]]) -> None:
    """Name the return values and signal arguments of an interface class as dbus/org.gpukill1.xml does
    (dbus-fast leaves them unnamed): names maps each method and signal to its argument names."""
    for member in vars(cls).values():
        d = getattr(member, "__dict__", {})
        item = d.get("__DBUS_METHOD") or d.get("__DBUS_SIGNAL")
        if item is None:
            continue
        args = item.introspection.out_args if "__DBUS_METHOD" in d else item.introspection.args
        for arg, name in zip(args, names[item.name], strict=True):
            arg.name = name
