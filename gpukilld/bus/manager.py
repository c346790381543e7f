"""org.gpukill1.Manager on the system bus: a thin layer from D-Bus calls to the snapshot and Actions.

What both interfaces share (the Door, the caller, error mapping, output names) is in door.py; this module has
what is the Manager's own: the listings (a{sv} and compact, gpukill/listing.py) and AuditRogue's findings, built
once per snapshot and kind of viewer, the filter query, reply bounds, the early answer to an unfiltered listing
or an AuditRogue that the Door lets it give, and SnapshotChanged.
"""

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbus_fast import Message, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import PropertyAccess
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from gpukill import listing
from gpukill.errors import GpukillError, InvalidArgs, NotSupported, ReplyTooLarge, TooBusy
from gpukill.outcome import INITIATOR_USER
from gpukill.records.audit import AuditSettings
from gpukill.records.reclaim import KillReport, Reclaim, WorkloadReply
from gpukill.records.status import ResetReply, SamplingStatus
from gpukill.records.suspend import SuspendedProcess, SuspendReply
from gpukill.regex import RegexError, compile_regex

from .. import __version__, audit_settings, journal
from ..access.bouncer import KILL_REPORT_METHOD, Bouncer, Caller, Request
from ..access.visibility import FULL, HIDDEN, PROGRAM, Viewer, seen_as
from ..acts.actions import Actions, KillResult
from ..acts.selection import KILL_KEYS, Selection
from ..acts.suspend import Suspender
from ..audit_settings import AuditSettingsKeeper
from ..model import Device, GpuProcess, Snapshot
from ..names import MANAGER_INTERFACE
from ..rogue.score import findings_as_seen
from ..rogue.trusted_exe import untrusted_because
from ..usage.query import parse_query
from . import writer as busio
from .door import current_caller, dbus_errors, name_outputs
from .wire import to_dbus

DEFAULT_GRACE = 5.0
MAX_FILTER_STRING = 4096

# A bus message may carry 32 MiB (dbus-daemon's max_message_size on the system bus). Replies are bounded well
# under it by construction: every string a process controls is bounded when sampled (procfs), so a record is
# at most ~11 KiB, a page of PAGE_MAX records fits, and a whole listing over MAX_REPLY is refused with
# ReplyTooLarge (clients then ask for pages) instead of failing to marshal for every caller.
MAX_REPLY = 16 << 20
PAGE_MAX = 1000
# AuditRogue's findings, highest score first: one per process and kind at most, each bounded (evidence texts of
# 256 bytes), so 1000 fit well inside one reply.
MAX_FINDINGS = 1000
# What may wait in the daemon's own write queue before large replies are refused (TooBusy): callers who
# never read their replies must not grow the daemon's memory.
MAX_BACKLOG = 64 << 20
# AuditRogueWith scores every process again in a worker thread: one scan at a time, a few waiting, and the
# replies of the last scans kept per thresholds and kind of viewer until the next round.
MAX_SCANS_WAITING = 16
MAX_SCAN_REPLIES = 64
MAX_SETTINGS_NAME = 256
# GetUsage sums the store in worker threads (over 300,000 records, bench/usage_query: 0.09 s by user, ~1 s by unit,
# ~3 s by process): at most this many at once, and this many more waiting for a turn; past that, TooBusy.
USAGE_QUERIES_AT_ONCE = 4
USAGE_QUERIES_WAITING = 16
# One person (a uid and its subordinate uids, gpukilld/access/people.py) may have this many in flight, running or
# waiting: a user who floods GetUsage with slow queries (by process over a year) gets TooBusy, not every turn.
USAGE_QUERIES_PER_PERSON = 4
USAGE_OFF = "usage accounting is off in gpukilld.conf ([usage] enabled = no)"
_DEFAULT_SETTINGS = AuditSettings()  # without a keeper (tests of the bus side alone): one object, for the cache


def _option(options: dict[str, Variant], key: str, kinds: str | tuple[str, ...], where: str) -> Any:
    """The option's value if its signature is one of kinds (a string of one-letter signatures, or a tuple)."""
    v = options[key]
    if v.signature not in (tuple(kinds) if isinstance(kinds, str) else kinds):
        raise InvalidArgs(f"{where} {key!r} has type {v.signature[:32]!r}, expected one of {list(kinds)}")
    return v.value


def _check_keys(options: dict[str, Variant], known: tuple[str, ...], where: str) -> None:
    for key in options:
        if key not in known:
            raise InvalidArgs(f"unknown {where} {key[:64]!r} (known: {', '.join(known)})")


def _plain(values: dict[str, Variant]) -> dict[str, Any]:
    """An a{sv} of settings as plain values, bounded before anything looks at them."""
    if len(values) > len(audit_settings.KEYS):
        raise InvalidArgs(f"{len(values)} settings given; there are {len(audit_settings.KEYS)}")
    return {k: v.value for k, v in values.items()}


async def _check_new_executables(values: dict[str, Any], current: AuditSettings, where: str = "") -> None:
    """An executable added to allowed_processes must be one a process could be allowed for
    (gpukilld/rogue/trusted_exe.py);
    looked at in a worker thread (a path may lie on a network filesystem)."""
    added = [p for p in values.get("allowed_processes", ()) if p not in current.allowed_processes]
    for path in added:
        why = await asyncio.to_thread(untrusted_because, path)
        if why is not None:
            raise InvalidArgs(f"{where}allowed_processes: {why}")


def _reported(findings: Any, viewer: Viewer, min_score: float) -> list[dict[str, Variant]]:
    """An audit's reply: the findings the viewer may see, of min_score or more, at most MAX_FINDINGS."""
    seen = [f for f in findings_as_seen(findings, viewer) if f.score >= min_score][:MAX_FINDINGS]
    return [to_dbus(f) for f in seen]


def _reclaim_as_seen(reclaim: Reclaim, viewer: Viewer) -> Reclaim:
    """The answer with other users' holders as the caller's listing shows them (visibility.py): where /proc
    hides their names (hidepid=noaccess), the PID, owner and memory stay and the name goes; where it hides the
    processes (hidepid=invisible), they are not named at all, only counted in `more`."""
    if viewer.others in (FULL, PROGRAM) or all(h.uid == viewer.uid for h in reclaim.holders):
        return reclaim
    if viewer.others == HIDDEN:
        holders = tuple(h for h in reclaim.holders if h.uid == viewer.uid)
        return dataclasses.replace(reclaim, holders=holders, more=reclaim.more + len(reclaim.holders) - len(holders))
    holders = tuple(h if h.uid == viewer.uid else dataclasses.replace(h, comm="") for h in reclaim.holders)
    return dataclasses.replace(reclaim, holders=holders)


def _workload_as_seen(reply: WorkloadReply, viewer: Viewer) -> WorkloadReply:
    """KillWorkload's answer as the caller's listing would show its processes: another user's named only where
    /proc names it, and left out (counted in `hidden`) where /proc hides it."""
    mine_or_seen = viewer.others in (FULL, PROGRAM)
    entries = tuple(
        e if e.uid == viewer.uid or mine_or_seen else dataclasses.replace(e, comm="")
        for e in reply.entries
        if e.uid == viewer.uid or viewer.others != HIDDEN
    )
    return dataclasses.replace(
        reply,
        entries=entries,
        hidden=len(reply.entries) - len(entries),
        reclaim=_reclaim_as_seen(reply.reclaim, viewer),
    )


def _suspended_as_seen(records: list[SuspendedProcess], viewer: Viewer) -> list[SuspendedProcess]:
    """Suspended processes as the caller's listing would show them: another user's named only where /proc names
    it, and left out where /proc hides it."""
    mine_or_seen = viewer.others in (FULL, PROGRAM)
    return [
        r if r.uid == viewer.uid or mine_or_seen else dataclasses.replace(r, comm="")
        for r in records
        if r.uid == viewer.uid or viewer.others != HIDDEN
    ]


def _suspend_reply_as_seen(reply: SuspendReply, viewer: Viewer) -> SuspendReply:
    return dataclasses.replace(reply, entries=tuple(_suspended_as_seen(list(reply.entries), viewer)))


ProcessFilter = Callable[[GpuProcess], bool]


@dataclass(frozen=True, slots=True)
class Query:
    tests: list[ProcessFilter]
    limit: int | None  # records per page; None: all at once (ReplyTooLarge when they do not fit)
    after: tuple[int, int] | None  # (device, pid) of the last record of the previous page


def build_query(raw: dict[str, Variant], snapshot: Snapshot) -> Query:
    _check_keys(raw, ("device", "user", "name", "name_regex", "min_memory", "limit", "after"), "filter key")
    tests: list[ProcessFilter] = []
    if "device" in raw:
        dev = _option(raw, "device", "suy", "filter")
        device = snapshot.find_device(str(dev)[:MAX_FILTER_STRING])
        index = device.index if device else -1
        tests.append(lambda p: p.device == index)
    if "user" in raw:
        user = _option(raw, "user", "suy", "filter")
        if isinstance(user, int):
            tests.append(lambda p: p.uid == user)
        else:
            user = user[:MAX_FILTER_STRING]
            tests.append(lambda p: p.user == user or str(p.uid) == user)
    if "name" in raw:
        name = _option(raw, "name", "s", "filter")[:MAX_FILTER_STRING]
        tests.append(lambda p: name in p.comm)
    if "name_regex" in raw:
        try:
            rx = compile_regex(_option(raw, "name_regex", "s", "filter"))
        except RegexError as e:
            raise InvalidArgs(f"filter 'name_regex': {e}") from None
        decided: dict[str, bool] = {}  # names repeat: one RE2 search per distinct name

        def matches(p: GpuProcess) -> bool:
            hit = decided.get(p.comm)
            if hit is None:
                hit = decided[p.comm] = rx.search(p.comm) is not None
            return hit

        tests.append(matches)
    if "min_memory" in raw:
        floor = _option(raw, "min_memory", "tuiyqx", "filter")
        tests.append(lambda p: (p.gpu_memory or 0) >= floor)
    limit = None
    if "limit" in raw:
        limit = _option(raw, "limit", "uqy", "filter")
        if not 1 <= limit <= PAGE_MAX:
            raise InvalidArgs(f"filter 'limit' must be from 1 to {PAGE_MAX}, not {limit}")
    after = None
    if "after" in raw:
        after = tuple(_option(raw, "after", ("(uu)",), "filter"))
    return Query(tests, limit, after)


def _value_size(sig: str, value: Any) -> int:
    """An upper bound of the marshalled size of one value (alignment padding included)."""
    if sig == "s":
        return 8 + len(value.encode())
    if sig in ("u", "b", "y", "q", "n", "i"):
        return 8
    if sig in ("t", "d", "x"):
        return 16
    if sig in ("as", "au"):
        return 8 + sum(_value_size(sig[1], v) for v in value)
    return len(busio.marshal_body(sig, [value])) + 8


def record_size(record: dict[str, Variant]) -> int:
    """An upper bound of the marshalled size of an a{sv} record, to bound replies before marshalling them."""
    return 8 + sum(16 + len(k) + _value_size(v.signature, v.value) for k, v in record.items())


# The process as seen, its a{sv}, the a{sv}'s size bound, its compact row. Both forms are bounded by the a{sv}'s
# size (the larger), so that a listing is refused as ReplyTooLarge in either form exactly when in the other.
Record = tuple[GpuProcess, dict[str, Variant], int, tuple]


def _record(p: GpuProcess) -> Record:
    d = to_dbus(p)
    return (p, d, record_size(d), listing.encode_row(p))


def _check_size(records: list[Record], what: str) -> None:
    size = sum(r[2] for r in records)
    if size > MAX_REPLY:
        raise ReplyTooLarge(
            f"{what} ({len(records)} records, up to {size / (1 << 20):.1f} MiB) does not fit in one reply "
            f"({MAX_REPLY >> 20} MiB); ask for pages with the filter keys 'limit' (at most {PAGE_MAX}) and 'after'"
        )


class ManagerInterface(ServiceInterface):
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        actions: Actions,
        bouncer: Bouncer,
        sample_interval: Callable[[], float],
        sampling: Callable[[], SamplingStatus] | None = None,
        *,
        bus: MessageBus | None = None,
        audit_settings: AuditSettingsKeeper | None = None,
        usage: Callable[[], Any] = lambda: None,
        suspender: Suspender | None = None,
    ) -> None:
        super().__init__(MANAGER_INTERFACE)
        self._suspender = suspender  # suspend and resume; None: NotSupported
        self._sampling = sampling  # the sampler's: the proc connector, or polling and why
        self._snapshot = snapshot
        self._actions = actions
        self._bouncer = bouncer
        self._sample_interval = sample_interval
        self._cache_generation = -1
        self._devices_reply: list[dict[str, Variant]] = []
        self._full: list[Record] = []  # every process in full, in (device, pid) order
        self._reduced: dict[str, list[Record | None]] = {}  # others' processes in one reduced form, by index
        self._views: dict[tuple[int, str], list[Record]] = {}  # a viewer's listing
        self._bodies: dict[tuple[int, str], bytes] = {}  # a viewer's whole listing, marshalled
        self._compact_bodies: dict[tuple[int, str], bytes] = {}  # the same in the compact form
        self._audits: dict[tuple[int, str], list[dict[str, Variant]]] = {}  # a viewer's AuditRogue reply
        self._audit_bodies: dict[tuple[int, str], bytes] = {}  # the same, marshalled
        self.bus = bus  # replies are refused while its queue is backed up
        # The audit's settings: what GetAuditSettings shows and SetAuditSettings changes.
        self.audit_settings = audit_settings
        self._audit_settings: AuditSettings | None = None  # the settings the cached AuditRogue replies were made with
        self._scans: dict[tuple[AuditSettings, tuple[int, str]], list[dict[str, Variant]]] = {}
        self._scans_basis: object = None  # the round the cached scans were made from
        self._scan_turn = asyncio.Semaphore(1)
        self._scans_waiting = 0
        self._published = 0  # the generation the last SnapshotChanged announced (0: the empty snapshot)
        # GPU usage accounting now (gpukilld/usage/keeper.py's UsageKeeper, with .live() and .store); None while
        # it is not running ([usage] enabled = no, or before the daemon owns its name)
        self._usage = usage
        self._usage_turn = asyncio.Semaphore(USAGE_QUERIES_AT_ONCE)
        self._usage_calls = 0  # running and waiting
        self._usage_calls_of: dict[int, int] = {}  # the same per person

    # -- listings, built once per snapshot and kind of viewer ------------------------------------------------

    def _fresh(self) -> None:
        snap = self._snapshot()
        if snap.generation != self._cache_generation:
            self._devices_reply = [to_dbus(d) for d in snap.devices]
            self._full = [_record(p) for p in snap.processes]
            self._reduced, self._views, self._bodies, self._compact_bodies = {}, {}, {}, {}
            self._audits, self._audit_bodies = {}, {}
            self._cache_generation = snap.generation

    def _view(self, viewer: Viewer) -> list[Record]:
        self._fresh()
        if viewer.others == FULL:
            return self._full
        view = self._views.get(viewer.key)
        if view is None:
            reduced = self._reduced.get(viewer.others)
            if reduced is None:
                reduced = self._reduced[viewer.others] = [
                    None if (q := seen_as(p, viewer.others)) is None else _record(q) for p, *_ in self._full
                ]
            view = [
                row
                for full, other in zip(self._full, reduced, strict=True)
                if (row := full if full[0].uid == viewer.uid else other) is not None
            ]
            if len(self._views) > 256:  # distinct callers in one sample interval: bound the cache
                self._views.clear()
                self._bodies.clear()
                self._compact_bodies.clear()
            self._views[viewer.key] = view
        return view

    def all_processes_body(self, viewer: Viewer) -> bytes:
        """The marshalled body of an unfiltered ListProcesses reply for this viewer, built once per snapshot;
        ReplyTooLarge when it would not fit, TooBusy while the connection is backed up."""
        view = self._view(viewer)
        body = self._bodies.get(viewer.key)
        if body is None:
            _check_size(view, "the listing")
            body = self._bodies[viewer.key] = busio.marshal_body("aa{sv}", [[r[1] for r in view]])
        self._check_backlog()
        return body

    def all_processes_compact_body(self, viewer: Viewer) -> bytes:
        """all_processes_body in the compact form (gpukill/listing.py)."""
        view = self._view(viewer)
        body = self._compact_bodies.get(viewer.key)
        if body is None:
            _check_size(view, "the listing")
            body = self._compact_bodies[viewer.key] = busio.marshal_body(
                listing.OUT_SIGNATURE, listing.reply_body([r[3] for r in view])
            )
        self._check_backlog()
        return body

    def _settings(self) -> AuditSettings:
        return self.audit_settings.current if self.audit_settings is not None else _DEFAULT_SETTINGS

    def _audit(self, viewer: Viewer) -> list[dict[str, Variant]]:
        """AuditRogue's reply for this viewer, built once per snapshot, settings and kind of viewer (sorting and
        filtering 1,000 findings costs ~18 ms: not at every call of a caller's 200 a second)."""
        self._fresh()
        settings = self._settings()
        if settings is not self._audit_settings:  # min_score changed what is reported: nothing cached holds
            self._audits.clear()
            self._audit_bodies.clear()
            self._audit_settings = settings
        reply = self._audits.get(viewer.key)
        if reply is None:
            if len(self._audits) > 256:  # distinct callers in one sample interval: bound the cache
                self._audits.clear()
                self._audit_bodies.clear()
            reply = self._audits[viewer.key] = _reported(self._snapshot().findings, viewer, settings.min_score)
        return reply

    def audit_body(self, viewer: Viewer) -> bytes:
        """The marshalled body of AuditRogue's reply for this viewer, built once per snapshot; TooBusy while the
        connection is backed up."""
        reply = self._audit(viewer)
        body = self._audit_bodies.get(viewer.key)
        if body is None:
            body = self._audit_bodies[viewer.key] = busio.marshal_body("aa{sv}", [reply])
        self._check_backlog()
        return body

    def _check_backlog(self) -> None:
        if self.bus is not None and (queued := busio.backlog_bytes(self.bus)) > MAX_BACKLOG:
            raise TooBusy(f"gpukilld has {queued >> 20} MiB of replies waiting for the bus; try again shortly")

    def early_answer(self, msg: Message) -> Message | bool | None:
        """The Door's EarlyAnswer: an unfiltered ListProcesses (or its compact form) or an AuditRogue answered from
        the body marshalled once per snapshot and kind of viewer, when the caller's kind is known without a round
        trip; else None (the method answers, and asks who the caller is)."""
        if msg.member == "AuditRogue":
            if msg.signature != "":
                return None
            signature, body_of = "aa{sv}", self.audit_body
        else:
            if msg.member == "ListProcesses":
                signature, body_of = "aa{sv}", self.all_processes_body
            elif msg.member == listing.METHOD:
                signature, body_of = listing.OUT_SIGNATURE, self.all_processes_compact_body
            else:
                return None
            if msg.signature != "a{sv}" or msg.body[0]:
                return None
        known = self._bouncer.known(msg)
        viewer = None if known is None else self._bouncer.known_viewer(known)
        if viewer is None:
            return None
        try:
            body = body_of(viewer)
        except GpukillError as e:
            return Message.new_error(msg, e.dbus_name, str(e))
        if self.bus is not None and busio.send_premarshalled_reply(self.bus, msg, signature, body):
            return True
        return None

    def published(self, snap: Snapshot) -> None:
        """A new snapshot is in force (main calls this once per sample): SnapshotChanged when its generation
        differs from the last one's. The sampler moves the generation only when the content (devices,
        processes, backends, findings) differs from the previous sample's, so observers list again only then,
        at most once per sample. The signal carries the generation only: every listener hears it, so it says
        nothing of a process a caller may not see beyond that something changed, which ListDevices'
        memory_used tells as well."""
        if snap.generation != self._published:
            self._published = snap.generation
            self.SnapshotChanged(snap.generation)

    # -- methods ---------------------------------------------------------------------------------------

    @method()
    def ListDevices(self) -> "aa{sv}":
        self._fresh()
        return self._devices_reply

    async def _selected(self, filter: dict[str, Variant]) -> list[Record]:
        """The caller's records that the filter selects: one page, or all of them when they fit one reply."""
        viewer = await self._bouncer.viewer(await current_caller(self._bouncer))
        view = self._view(viewer)
        query = build_query(filter, self._snapshot())
        selected = [r for r in view if all(t(r[0]) for t in query.tests)] if query.tests else view
        if query.after is not None:
            after = query.after
            selected = [r for r in selected if (r[0].device, r[0].pid) > after]
        if query.limit is not None:
            selected = selected[: query.limit]
        _check_size(selected, "the page" if query.limit else "the listing")
        self._check_backlog()
        return selected

    @method()
    @dbus_errors
    async def ListProcesses(self, filter: "a{sv}") -> "aa{sv}":
        return [r[1] for r in await self._selected(filter)]

    @method()
    @dbus_errors
    async def ListProcessesCompact(self, filter: "a{sv}") -> "ua(uutussssustdssssua(sytt)b)":
        return listing.reply_body([r[3] for r in await self._selected(filter)])

    @method()
    @dbus_errors
    async def AuditRogue(self) -> "aa{sv}":
        viewer = await self._bouncer.viewer(await current_caller(self._bouncer))
        reply = self._audit(viewer)
        self._check_backlog()
        return reply

    @method()
    @dbus_errors
    async def AuditRogueWith(self, thresholds: "a{sv}") -> "aa{sv}":
        viewer = await self._bouncer.viewer(await current_caller(self._bouncer))
        keeper = self._keeper()
        values = audit_settings.checked(_plain(thresholds), audit_settings.PER_CALL_KEYS, where="threshold")
        base = keeper.current
        if values.get("idle_min_memory", base.idle_min_memory) < base.idle_min_memory:
            raise InvalidArgs(
                f"idle_min_memory below the configured {base.idle_min_memory} bytes cannot be used "
                "for one scan: idle clocks run only for holders of at least that (lower it with "
                "SetAuditSettings)"
            )
        basis = keeper.watch.basis
        if basis is None:
            raise NotSupported("the audit has not run yet: try again after the first sample")
        settings = dataclasses.replace(base, **values)
        if basis is not self._scans_basis:
            self._scans, self._scans_basis = {}, basis
        key = (settings, viewer.key)
        reply = self._scans.get(key)
        if reply is None:
            if self._scans_waiting >= MAX_SCANS_WAITING:
                raise TooBusy("too many one-off audit scans at once; try again shortly")
            self._scans_waiting += 1
            try:
                async with self._scan_turn:  # scored in a worker thread, never on the loop
                    findings = await asyncio.to_thread(basis.rescored, settings)
            finally:
                self._scans_waiting -= 1
            reply = _reported(findings, viewer, settings.min_score)
            if basis is self._scans_basis:
                if len(self._scans) >= MAX_SCAN_REPLIES:
                    self._scans.clear()
                self._scans[key] = reply
        self._check_backlog()
        return reply

    @method()
    @dbus_errors
    async def GetAuditSettings(self) -> "a{sv}":
        return to_dbus(self._keeper().current)

    @method()
    @dbus_errors
    async def ExportAuditSettings(self) -> "s":
        return audit_settings.export_text(self._keeper().current)

    @method()
    @dbus_errors
    async def SetAuditSettings(self, changes: "a{sv}") -> "a{sv}":
        keeper = self._keeper()
        values = audit_settings.checked(_plain(changes))
        await _check_new_executables(values, keeper.current)
        caller = await self._authorize_settings("SetAuditSettings", "set", " ".join(values) or "nothing")
        new = await keeper.change(values, operation="set", caller_uid=caller.uid, caller_pid=caller.pid)
        return to_dbus(new)

    @method()
    @dbus_errors
    async def ImportAuditSettings(self, name: "s", text: "s") -> "a{sv}":
        keeper = self._keeper()
        name = name[:MAX_SETTINGS_NAME] if name and name[:MAX_SETTINGS_NAME].isprintable() else "import"
        try:
            values = audit_settings.parse_text(name, text)
        except ValueError as e:
            raise InvalidArgs(str(e)) from None
        await _check_new_executables(values, keeper.current, f"{name}: ")
        caller = await self._authorize_settings("ImportAuditSettings", "import", name)
        new = await keeper.change(values, operation="import", caller_uid=caller.uid, caller_pid=caller.pid, source=name)
        return to_dbus(new)

    @method()
    @dbus_errors
    async def GetUsage(self, query: "a{sv}") -> "a{sv}":
        usage = self._usage()
        if usage is None:
            raise NotSupported(USAGE_OFF)
        q = parse_query(query, time.time())
        if isinstance(q.device, str):  # a GPU present now by its PCI bus id or any spelling of its UUID
            device = self._snapshot().find_device(q.device)
            if device is not None:
                q = dataclasses.replace(q, device=device.id)
        caller = await current_caller(self._bouncer)
        viewer = await self._bouncer.viewer(caller)
        person = self._bouncer.people.person(caller.uid)
        if self._usage_calls_of.get(person, 0) >= USAGE_QUERIES_PER_PERSON:
            raise TooBusy(
                f"{USAGE_QUERIES_PER_PERSON} usage queries of yours are still running or waiting; "
                "try again when they are answered"
            )
        if self._usage_calls >= USAGE_QUERIES_AT_ONCE + USAGE_QUERIES_WAITING:
            raise TooBusy("too many usage queries at once; try again shortly")
        self._usage_calls += 1
        self._usage_calls_of[person] = self._usage_calls_of.get(person, 0) + 1
        try:
            async with self._usage_turn:
                live = usage.live()  # on the loop: the accountant's records as of the latest snapshot
                report = await asyncio.to_thread(usage.store.query, q, viewer, live)
        finally:
            self._usage_calls -= 1
            left = self._usage_calls_of.pop(person) - 1
            if left:
                self._usage_calls_of[person] = left
        self._check_backlog()
        return to_dbus(report)

    def _keeper(self) -> AuditSettingsKeeper:
        if self.audit_settings is None:
            raise NotSupported("this gpukilld keeps no audit settings")
        return self.audit_settings

    async def _authorize_settings(self, member: str, operation: str, what: str) -> Any:
        caller = await current_caller(self._bouncer)
        request = Request(
            journal.AUDIT_SETTINGS,
            "Change of the audit settings",
            "change the rogue-activity audit's settings",
            {"operation": operation},
        )
        await self._bouncer.check(caller, (MANAGER_INTERFACE, member), {"settings": what[:256]}, request=request)
        return caller

    @staticmethod
    def _kill_options(options: dict[str, Variant]) -> tuple[float, bool, bool]:
        """(grace, force, checkpoint) from a kill's options."""
        _check_keys(options, ("force", "grace", "checkpoint"), "option")
        force = bool(_option(options, "force", "b", "option")) if "force" in options else False
        grace = float(_option(options, "grace", "duiyqxt", "option")) if "grace" in options else DEFAULT_GRACE
        if math.isnan(grace):
            raise InvalidArgs("option 'grace' is not a number")
        checkpoint = bool(_option(options, "checkpoint", "b", "option")) if "checkpoint" in options else False
        return grace, force, checkpoint

    @method()
    @dbus_errors
    async def KillProcess(self, pid: "u", start_time: "t", options: "a{sv}") -> "s":
        caller = await current_caller(self._bouncer)
        grace, force, checkpoint = self._kill_options(options)
        result = await self._actions.kill(caller, pid, start_time, grace, force, INITIATOR_USER, checkpoint=checkpoint)
        return result.outcome

    @method()
    @dbus_errors
    async def KillProcessReport(self, pid: "u", start_time: "t", options: "a{sv}") -> "a{sv}":
        caller = await current_caller(self._bouncer)
        grace, force, checkpoint = self._kill_options(options)
        result = await self._actions.kill(
            caller, pid, start_time, grace, force, INITIATOR_USER, method=KILL_REPORT_METHOD, checkpoint=checkpoint
        )
        viewer = await self._bouncer.viewer(caller)
        return to_dbus(KillReport(result.outcome, _reclaim_as_seen(result.reclaim, viewer), result.checkpoint))

    @method()
    @dbus_errors
    async def KillWorkload(self, selection: "a{sv}", options: "a{sv}") -> "a{sv}":
        caller = await current_caller(self._bouncer)
        grace, force, checkpoint = self._kill_options(options)
        if len(selection) > len(KILL_KEYS):
            raise InvalidArgs(f"give exactly one of the selection keys {', '.join(KILL_KEYS)}")
        chosen = await self._as_seen(Selection.parse({k: v.value for k, v in selection.items()}), caller)
        reply = await self._actions.kill_workload(caller, chosen, grace, force, INITIATOR_USER, checkpoint=checkpoint)
        return to_dbus(_workload_as_seen(reply, await self._bouncer.viewer(caller)))

    async def _as_seen(self, chosen: Selection, caller: Caller) -> Selection:
        """A job selection as the caller's listing shows the job (Selection.viewer); the others as they are."""
        if chosen.kind != "job":
            return chosen
        return dataclasses.replace(chosen, viewer=await self._bouncer.viewer(caller))

    @method()
    @dbus_errors
    async def ResetDevice(self, device: "s", options: "a{sv}") -> "a{sv}":
        caller = await current_caller(self._bouncer)
        _check_keys(options, ("force",), "option")
        force = bool(_option(options, "force", "b", "option")) if "force" in options else False
        result = await self._actions.reset(caller, device, force)
        return to_dbus(result)

    def _suspend_side(self) -> Suspender:
        if self._suspender is None:
            raise NotSupported("this gpukilld does not suspend workloads")
        return self._suspender

    @staticmethod
    def _workload_selection(selection: dict[str, Variant], options: dict[str, Variant]) -> Selection:
        _check_keys(options, (), "option")
        if len(selection) > 4:
            raise InvalidArgs("give exactly one of the selection keys pid, tree, unit, job")
        return Selection.parse_workload({k: v.value for k, v in selection.items()})

    @method()
    @dbus_errors
    async def SuspendWorkload(self, selection: "a{sv}", options: "a{sv}") -> "a{sv}":
        caller = await current_caller(self._bouncer)
        chosen = await self._as_seen(self._workload_selection(selection, options), caller)
        reply = await self._suspend_side().suspend(caller, chosen)
        return to_dbus(_suspend_reply_as_seen(reply, await self._bouncer.viewer(caller)))

    @method()
    @dbus_errors
    async def ResumeWorkload(self, selection: "a{sv}", options: "a{sv}") -> "a{sv}":
        caller = await current_caller(self._bouncer)
        chosen = self._workload_selection(selection, options)
        reply = await self._suspend_side().resume(caller, chosen)
        return to_dbus(_suspend_reply_as_seen(reply, await self._bouncer.viewer(caller)))

    @method()
    @dbus_errors
    async def ListSuspended(self) -> "aa{sv}":
        records = self._suspender.records() if self._suspender is not None else []
        viewer = await self._bouncer.viewer(await current_caller(self._bouncer))
        return [to_dbus(r) for r in _suspended_as_seen(records, viewer)]

    # -- properties ------------------------------------------------------------------------------------

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> "s":
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    def Backends(self) -> "a(sbs)":
        return [[b.name, b.available, b.detail] for b in self._snapshot().backends]

    @dbus_property(access=PropertyAccess.READ)
    def SampleInterval(self) -> "d":
        return self._sample_interval()

    @dbus_property(access=PropertyAccess.READ)
    def Sampling(self) -> "a{sv}":
        status = self._sampling() if self._sampling else SamplingStatus("polling", "no sampler")
        return to_dbus(status)

    # -- signals ---------------------------------------------------------------------------------------

    @signal()
    def ProcessKilled(self, result: KillResult, caller_uid: int) -> "utusassusa{sv}":
        return [
            result.pid,
            result.start_time,
            result.uid,
            result.comm,
            list(result.device_ids),
            result.outcome,
            caller_uid,
            result.initiator,
            to_dbus(result.reclaim),
        ]

    @signal()
    def DeviceReset(self, result: ResetReply, success: bool) -> "usbsau":
        return [result.device, result.device_id, success, result.message, list(result.killed)]

    @signal()
    def DeviceStateChanged(self, device: Device) -> "usss":
        return [device.index, device.id, device.state, device.state_reason]

    @signal()
    def SnapshotChanged(self, generation: int) -> "t":
        return generation

    @signal()
    def ProcessSuspended(self, record: SuspendedProcess, caller_uid: int) -> "a{sv}u":
        return [to_dbus(record), caller_uid]

    @signal()
    def ProcessResumed(self, record: SuspendedProcess, caller_uid: int) -> "a{sv}u":
        return [to_dbus(record), caller_uid]


# Names for return values and signal arguments, as in dbus/org.gpukill1.xml.
OUTPUT_NAMES = {
    "ListDevices": ["devices"],
    "ListProcesses": ["processes"],
    "ListProcessesCompact": ["format", "processes"],
    "AuditRogue": ["findings"],
    "AuditRogueWith": ["findings"],
    "GetAuditSettings": ["settings"],
    "SetAuditSettings": ["settings"],
    "ExportAuditSettings": ["text"],
    "ImportAuditSettings": ["settings"],
    "GetUsage": ["report"],
    "KillProcess": ["outcome"],
    "KillProcessReport": ["report"],
    "KillWorkload": ["reply"],
    "ResetDevice": ["result"],
    "SuspendWorkload": ["reply"],
    "ResumeWorkload": ["reply"],
    "ListSuspended": ["processes"],
    "ProcessKilled": ["pid", "start_time", "uid", "comm", "devices", "outcome", "caller_uid", "initiator", "reclaim"],
    "DeviceReset": ["index", "id", "success", "message", "killed"],
    "DeviceStateChanged": ["index", "id", "state", "reason"],
    "SnapshotChanged": ["generation"],
    "ProcessSuspended": ["process", "caller_uid"],
    "ProcessResumed": ["process", "caller_uid"],
}


name_outputs(ManagerInterface, OUTPUT_NAMES)
