"""`gpukillctl top` without a terminal: what one sample holds, the state of the view, keys, and the screen as text.

Pure: no bus, no curses, no clock. gpukillctl/top/app.py feeds it samples from the client library and keys from the
terminal, and paints the lines `render` returns. So every rule of the view (sorting, filtering, the selection
that follows a process across refreshes, Guard's windows and graces against the processes they concern, the
suspended processes apart from the running ones, escaping) is tested without a terminal, and the cost of a frame
is measured without one.

Durations print as everywhere else (gpukill.units.format_duration, systemd's "2h 26min 9s"), an unknown value
as "–". Colour is a style of a segment, as nvitop's users read it: utilization and memory green, yellow or red
by load (`load`), a hot temperature yellow or red, a Guard grace red; app.py maps styles to colours, or to no
colour under NO_COLOR.

Everything a process chose (comm, cmdline, user and unit names, Guard subjects) goes through `shown` before it
is laid out, so a name holding an escape sequence prints as `\\x1b[2J` and cannot repaint the screen. The
frame itself is ASCII but for the "–" of an unknown value, which app.py draws as "-" where the locale is not
UTF-8, so it draws on any terminal curses knows, whatever its locale.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from gpukill.outcome import Outcome
from gpukill.records.guard import GuardStatus
from gpukill.records.manager import STATE_OK, Device, Process
from gpukill.records.suspend import STUCK, SuspendedProcess
from gpukill.records.usage import UsageReport
from gpukill.text import UNKNOWN, shown
from gpukill.units import format_duration

from ..client.format import percent, size
from ..client.usage import totals_line

# -- one sample -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """What one refresh fetched from gpukilld, and when (CLOCK_BOOTTIME seconds, to age processes)."""

    devices: tuple[Device, ...]
    processes: tuple[Process, ...]
    guard: GuardStatus | None  # None: GetStatus failed (the message line says why)
    interval: float  # the daemon's sample interval: the view refreshes at this pace, never faster
    boottime: float
    clock_ticks: int = 100  # sysconf(SC_CLK_TCK): the unit of Process.start_time
    # What gpukilld holds suspended (ListSuspended): off the GPU's lists, its memory held in host memory.
    suspended: tuple[SuspendedProcess, ...] = ()
    user_names: tuple[tuple[int, str], ...] = ()  # (uid, name) of the suspended processes' owners
    wall: float = 0.0  # the wall clock at `boottime`: how long each has been suspended

    def at(self, boottime: float) -> Sample:
        """The same sample, seen later: runtimes move on, nothing else does (no change was signalled)."""
        return dataclasses.replace(self, boottime=boottime, wall=self.wall + (boottime - self.boottime))

    @property
    def guard_counts_time(self) -> bool:
        """Guard has windows or graces running: their seconds change every sample with nothing signalled."""
        return self.guard is not None and bool(self.guard.windows or self.guard.graces)

    def runtime(self, p: Process) -> float | None:
        """Seconds since the process started, None if its start time says nothing sensible."""
        started = p.start_time / self.clock_ticks
        return self.boottime - started if 0 < started <= self.boottime else None


# Seconds: top fetches at least this often even when gpukilld signalled no change (a safety net).
FULL_REFRESH = 30.0


def must_fetch(sample: Sample, now: float, *, listening_since: float | None, changed: bool, fetched_at: float) -> bool:
    """Whether top's refresh tick at `now` (monotonic seconds) fetches from gpukilld, or only redraws the sample
    it holds. It fetches when gpukilld signalled something since the last fetch (SnapshotChanged or any other
    signal), while Guard has windows or graces running (their seconds move with every sample, unsignalled),
    every FULL_REFRESH seconds, and at every tick while signals are not heard: no listener, or one started
    less than an interval ago (it may not be subscribed yet: a change then would be missed)."""
    trusted = listening_since is not None and now - listening_since > sample.interval + 1.0
    return not trusted or changed or sample.guard_counts_time or now - fetched_at >= FULL_REFRESH


EMPTY = Sample(devices=(), processes=(), guard=None, interval=1.0, boottime=0.0)


# -- Guard's windows and graces against processes ---------------------------------------------------------

# Guard names a subject by its label (gpukilld/guard/conditions.py): "PID 12 (comm, user u)", "user u",
# "GPU 0 (id)". Windows and graces carry the uid besides; the PID and the device index are read from the label.
_PROCESS_SUBJECT = re.compile(r"PID (\d+) \(")
_DEVICE_SUBJECT = re.compile(r"GPU (\d+) \(")
_USER_SUBJECT = "user "


@dataclass(frozen=True, slots=True)
class GuardMark:
    """A Guard window or grace that concerns a process (directly, or through its user or device)."""

    kind: str  # "grace": a kill rule is counting down; "window": a condition is holding, its duration running
    rule: str
    subject: str
    seconds: float  # grace: seconds left; window: seconds it has held
    duration: float = 0.0  # window: seconds it must hold
    condition: str = ""

    @property
    def short(self) -> str:
        if self.kind == "grace":
            return shown(f"KILL in {format_duration(self.seconds)}: {self.rule}")
        return shown(f"window {format_duration(self.seconds)}/{format_duration(self.duration)}: {self.rule}")

    @property
    def long(self) -> str:
        if self.kind == "grace":
            return shown(
                f"grace: rule {self.rule} kills {self.subject} in {format_duration(self.seconds)} unless it comes "
                "back under"
            )
        return shown(
            f"window: rule {self.rule}, {self.condition} has held "
            f"{format_duration(self.seconds)} of {format_duration(self.duration)} for {self.subject}"
        )


@dataclass(slots=True)
class GuardMarks:
    """The marks of one GuardStatus, indexed by what they concern. Graces come before windows, the nearest
    first: the column shows the most urgent."""

    by_pid: dict[int, list[GuardMark]] = field(default_factory=dict)
    by_uid: dict[int, list[GuardMark]] = field(default_factory=dict)
    by_device: dict[int, list[GuardMark]] = field(default_factory=dict)

    @classmethod
    def of(cls, status: GuardStatus | None) -> GuardMarks:
        marks = cls()
        if status is None:
            return marks
        found = [GuardMark("grace", g.rule, g.subject, g.remaining) for g in status.graces]
        found += [GuardMark("window", w.rule, w.subject, w.elapsed, w.duration, w.condition) for w in status.windows]
        uids = [g.uid for g in status.graces] + [w.uid for w in status.windows]
        for mark, uid in zip(found, uids, strict=True):
            if m := _PROCESS_SUBJECT.match(mark.subject):
                marks.by_pid.setdefault(int(m.group(1)), []).append(mark)
            elif m := _DEVICE_SUBJECT.match(mark.subject):
                marks.by_device.setdefault(int(m.group(1)), []).append(mark)
            elif mark.subject.startswith(_USER_SUBJECT) and uid is not None:
                marks.by_uid.setdefault(uid, []).append(mark)
        return marks

    def of_process(self, p: Process) -> list[GuardMark]:
        found = self.by_pid.get(p.pid, []) + self.by_uid.get(p.uid, []) + self.by_device.get(p.device, [])
        return sorted(found, key=lambda m: (m.kind != "grace", m.seconds if m.kind == "grace" else -m.seconds))


# -- sorting and filtering ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SortOrder:
    key: str  # the key that selects it
    name: str  # as the title line says it
    column: str  # the header it marks
    value: Callable[[Sample, Process], float | str]
    descending: bool  # the natural order: biggest users first, names A to Z


def _number(v: float | None) -> float:
    return -1.0 if v is None else float(v)  # unknown sorts below every known value


SORTS: dict[str, SortOrder] = {
    s.key: s
    for s in (
        SortOrder("m", "GPU memory", "GPU MEM", lambda s, p: _number(p.gpu_memory), True),
        SortOrder("u", "utilization", "UTIL", lambda s, p: _number(p.gpu_utilization), True),
        SortOrder("n", "user", "USER", lambda s, p: p.user, False),
        SortOrder("t", "runtime", "RUNTIME", lambda s, p: _number(s.runtime(p)), True),
    )
}
DEFAULT_SORT = "m"


def suspended_haystack(s: SuspendedProcess, user: str) -> str:
    """What the filter looks in for a suspended process: its PID, user, name, workload and state, lower case."""
    return " ".join((str(s.pid), user, s.comm, s.workload, s.state)).casefold()


def haystack(p: Process) -> str:
    """What the filter looks in: names, command line, user, PID and where the process runs, lower case."""
    return " ".join(
        str(v)
        for v in (p.pid, p.user, p.comm, p.cmdline, p.unit, p.container_id, p.pod_uid, p.slurm_job)
        if v is not None
    ).casefold()


# -- the state of the view, and keys ---------------------------------------------------------------------


class Mode(Enum):
    BROWSE = "browse"
    FILTER = "filter"  # typing after `/`
    CONFIRM = "confirm"  # `k` asked: kill the selected process?


@dataclass(frozen=True, slots=True)
class KillRequest:
    """What the view asks the daemon after a confirmation (the start time makes a reused PID refused)."""

    pid: int
    start_time: int
    comm: str
    force: bool


QUIT = "quit"
PAGE = 10  # rows PgUp/PgDn move when the view has not said how many it shows


@dataclass(slots=True)
class TopState:
    sample: Sample = EMPTY
    sort: str = DEFAULT_SORT
    reverse: bool = False  # the sort key pressed again: the other way round
    filter: str = ""
    mode: Mode = Mode.BROWSE
    typed: str = ""  # the filter being typed
    selected: tuple[int, int] | None = None  # (pid, device): follows the process when rows move
    index: int = 0  # the selection's row, kept when the selected process goes away
    top: int = 0  # the first process row shown
    page: int = PAGE
    message: str = ""
    message_is_error: bool = False
    target: Process | None = None  # the process `k` asked about: a refresh while asking never changes it
    pending: KillRequest | None = None  # a kill the daemon has not answered yet
    # The session's totals (GetUsage since top started, asked every USAGE_EVERY seconds by the app), or why not.
    usage: UsageReport | None = None
    usage_note: str = ""
    _rows: list[Process] | None = None
    _haystacks: dict[int, str] = field(default_factory=dict)
    _marks: GuardMarks = field(default_factory=GuardMarks)

    # -- data --

    def update(self, sample: Sample) -> None:
        """A new sample: rows are sorted and filtered again, the selection stays on its process."""
        self.sample = sample
        self._haystacks = {}
        self._marks = GuardMarks.of(sample.guard)
        self._invalidate()

    def _invalidate(self) -> None:
        self._rows = None
        rows = self.rows()
        if self.selected is not None:
            at = next((i for i, p in enumerate(rows) if (p.pid, p.device) == self.selected), None)
            if at is not None:
                self.index = at
        self._select(self.index)

    def rows(self) -> list[Process]:
        """The processes shown, filtered and in order (computed once per sample, sort or filter)."""
        if self._rows is None:
            procs = list(self.sample.processes)
            if self.filter:
                needle = self.filter.casefold()
                procs = [p for p in procs if needle in self._haystack(p)]
            order = SORTS[self.sort]
            # ties in (device, pid) order, so equal rows do not swap places from one refresh to the next
            procs.sort(key=lambda p: (p.device, p.pid))
            procs.sort(key=lambda p: order.value(self.sample, p), reverse=order.descending != self.reverse)
            self._rows = procs
        return self._rows

    def suspended_rows(self) -> list[SuspendedProcess]:
        """The suspended processes shown (the filter applies to them too), the longest suspended first."""
        held = list(self.sample.suspended)
        if self.filter:
            needle = self.filter.casefold()
            held = [s for s in held if needle in suspended_haystack(s, self.user_of(s))]
        return sorted(held, key=lambda s: (s.suspended_at, s.pid))

    def user_of(self, s: SuspendedProcess) -> str:
        return dict(self.sample.user_names).get(s.uid, str(s.uid))

    def _haystack(self, p: Process) -> str:
        key = id(p)
        if key not in self._haystacks:
            self._haystacks[key] = haystack(p)
        return self._haystacks[key]

    def marks(self, p: Process) -> list[GuardMark]:
        return self._marks.of_process(p)

    def current(self) -> Process | None:
        rows = self.rows()
        return rows[self.index] if rows and 0 <= self.index < len(rows) else None

    def _select(self, index: int) -> None:
        rows = self.rows()
        self.index = max(0, min(index, len(rows) - 1))
        self.selected = (rows[self.index].pid, rows[self.index].device) if rows else None

    def say(self, text: str, error: bool = False) -> None:
        self.message, self.message_is_error = text, error

    # -- keys --

    def key(self, key: str) -> KillRequest | str | None:
        """One key, by name: a character, or UP, DOWN, PGUP, PGDN, HOME, END, ENTER, ESC, BACKSPACE, CLEAR (^U).
        Returns a KillRequest to carry out, QUIT, or None."""
        if self.mode is Mode.FILTER:
            self._filter_key(key)
            return None
        if self.mode is Mode.CONFIRM:
            return self._confirm_key(key)
        moves = {"UP": -1, "DOWN": 1, "PGUP": -self.page, "PGDN": self.page}
        if key in moves:
            self._select(self.index + moves[key])
        elif key == "HOME":
            self._select(0)
        elif key == "END":
            self._select(len(self.rows()) - 1)
        elif key in SORTS:
            self.reverse = not self.reverse if key == self.sort else False
            self.sort = key
            self._invalidate()
        elif key == "/":
            self.mode, self.typed = Mode.FILTER, self.filter
        elif key == "k":
            self._ask_kill()
        elif key in ("q", "Q"):
            return QUIT
        elif key == "ESC" and self.filter:
            self.filter = ""
            self._invalidate()
        return None

    def _filter_key(self, key: str) -> None:
        if key == "ENTER":
            self.mode, self.filter = Mode.BROWSE, self.typed.strip()
            self._invalidate()
        elif key == "ESC":
            self.mode = Mode.BROWSE
        elif key == "BACKSPACE":
            self.typed = self.typed[:-1]
        elif key == "CLEAR":
            self.typed = ""
        elif len(key) == 1 and key.isprintable() and len(self.typed) < 200:
            self.typed += key

    def _ask_kill(self) -> None:
        p = self.current()
        if p is None:
            self.say("no process selected", error=True)
        elif self.pending is not None:
            self.say(f"waiting for the daemon to answer the kill of PID {self.pending.pid}", error=True)
        else:
            self.mode, self.target = Mode.CONFIRM, p

    def _confirm_key(self, key: str) -> KillRequest | None:
        p, self.mode, self.target = self.target, Mode.BROWSE, None
        if key not in ("y", "f") or p is None:
            self.say("kill cancelled")
            return None
        self.pending = KillRequest(p.pid, p.start_time, p.comm, force=key == "f")
        self.say(f"stopping PID {p.pid} ({shown(p.comm)})...")
        return self.pending

    def killed(self, request: KillRequest, outcome: Outcome | None, error: str = "") -> None:
        """The daemon's answer to a kill: its outcome, or the error's one line (polkit's denial among them)."""
        self.pending = None
        who = f"PID {request.pid} ({shown(request.comm)})"
        if outcome is None:
            self.say(f"{who} not stopped: {shown(error)}", error=True)
        elif outcome == Outcome.STILL_ALIVE:
            self.say(f"{who} is {outcome.text}; select it and press k, then f, to send SIGKILL", error=True)
        else:
            self.say(f"{who} {outcome.text}")


# -- laying out the screen ---------------------------------------------------------------------------------

# A line is a tuple of (text, style) segments; app.py maps styles to terminal attributes.
Segment = tuple[str, str]
Line = tuple[Segment, ...]
NORMAL, TITLE, HEADER, SELECTED, ERROR, GRACE, WINDOW, BAR, DIM = (
    "normal",
    "title",
    "header",
    "selected",
    "error",
    "grace",
    "window",
    "bar",
    "dim",
)
LIGHT, MODERATE, HEAVY = "light", "moderate", "heavy"  # a load: green, yellow, red


def cells(ch: str) -> int:
    """Terminal cells a character takes: 2 for wide East Asian characters, 0 for combining marks."""
    if ch < "\u0300":
        return 1
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def fit(text: str, width: int) -> str:
    """`text` cut or padded to exactly `width` cells (a cut ends in `~`)."""
    if width <= 0:
        return ""
    if text.isascii():
        return text.ljust(width) if len(text) <= width else text[: width - 1] + "~"
    total = sum(map(cells, text))
    if total <= width:
        return text + " " * (width - total)
    out, used = [], 0
    for ch in text:
        if used + cells(ch) > width - 1:
            break
        out.append(ch)
        used += cells(ch)
    return "".join(out) + "~" + " " * (width - 1 - used)


def bar(fraction: float | None, width: int) -> str:
    """[|||||     ] for a fraction from 0 to 1; [   n/a   ] when unknown."""
    inner = max(width - 2, 1)
    if fraction is None:
        return "[" + "n/a".center(inner) + "]"
    filled = round(max(0.0, min(fraction, 1.0)) * inner)
    return "[" + "|" * filled + " " * (inner - filled) + "]"


KEYS_HELP = "Up/Down PgUp/PgDn select  m u n t sort (again: reverse)  / filter  Esc clear filter  k kill  q quit"
# (header, width) of the process table; COMMAND and GUARD share what is left
_COLUMNS = (("PID", 8), ("USER", 10), ("GPU", 4), ("GPU MEM", 10), ("UTIL", 5), ("RUNTIME", 14))
_DETAIL_LINES = 4
_MIN_HEIGHT = 12


# Load levels as nvitop colours them: green below the first threshold, yellow from it, red from the second.
# Utilization and memory (percent of the device's) as nvitop's defaults; temperature (°C) only from "warm" on,
# uncoloured below: a cool GPU needs no colour.
UTIL_LEVELS, MEMORY_LEVELS, TEMPERATURE_LEVELS = (10.0, 75.0), (10.0, 80.0), (75.0, 85.0)


def load(value: float | None, levels: tuple[float, float], low: str = LIGHT) -> str:
    """The style of a value by its load: `low` below levels[0], MODERATE from it, HEAVY from levels[1]; NORMAL
    when unknown."""
    if value is None:
        return NORMAL
    return HEAVY if value >= levels[1] else MODERATE if value >= levels[0] else low


def clip(segments: list[Segment], width: int) -> Line:
    """Segments cut or padded together to exactly `width` cells."""
    out: list[Segment] = []
    left = width
    for text, style in segments:
        n = len(text) if text.isascii() else sum(map(cells, text))
        if left <= 0:
            break
        if n >= left:
            out.append((fit(text, left), style))
            left = 0
            break
        out.append((text, style))
        left -= n
    if left > 0:
        out.append((" " * left, NORMAL))
    return tuple(out)


def _device_line(d: Device, width: int) -> Line:
    name = fit(shown(d.name), 26)
    util = d.utilization / 100 if d.utilization is not None else None
    mem = d.memory_used / d.memory_total if d.memory_used is not None and d.memory_total else None
    util_style = load(d.utilization, UTIL_LEVELS)
    mem_style = load(None if mem is None else mem * 100, MEMORY_LEVELS)
    temp = UNKNOWN if d.temperature is None else f"{d.temperature:.0f}C"
    power = UNKNOWN if d.power is None else f"{d.power:.0f}W"
    state = "" if d.state == STATE_OK else shown(f"  {d.state.upper()} {d.state_reason}")
    bar_width = min(max((width - 82) // 2, 10), 32)
    used = f"{size(d.memory_used)} / {size(d.memory_total)}"
    segments = [
        (f"{d.index:<3} {name} util ", NORMAL),
        (bar(util, bar_width), util_style),
        (f" {percent(d.utilization):>4}", util_style),
        ("  mem ", NORMAL),
        (bar(mem, bar_width), mem_style),
        (f" {used:<21} ", NORMAL),
        (temp, load(d.temperature, TEMPERATURE_LEVELS, low=NORMAL)),
        (f"  {power}", NORMAL),
    ]
    if state:
        return (*clip(segments, width - len(state)), (state, ERROR))
    return clip(segments, width)


def _command_width(rest: int) -> int:
    """Of the cells left after the fixed columns, COMMAND's: GUARD gets up to 34 ("KILL in 120s: " and a rule)."""
    return max(rest - min(34, rest // 2), 8)


def _process_header(state: TopState, width: int) -> Line:
    order = SORTS[state.sort]
    arrow = "^" if order.descending == state.reverse else "v"
    heads = [(f"{h} {arrow}" if h == order.column else h).ljust(w) for h, w in _COLUMNS]
    rest = width - sum(w for _, w in _COLUMNS)
    command = _command_width(rest)
    return ((fit("".join(heads) + "COMMAND".ljust(command) + "GUARD", width), HEADER),)


def _process_line(state: TopState, p: Process, width: int, selected: bool) -> Line:
    cols = [
        str(p.pid),
        shown(p.user),
        str(p.device),
        size(p.gpu_memory),
        percent(p.gpu_utilization),
        format_duration(state.sample.runtime(p)),
    ]
    laid = [fit(c, w - 1) + " " for c, (_, w) in zip(cols, _COLUMNS, strict=True)]
    text = "".join(laid)
    rest = width - len(text)
    command = _command_width(rest)
    name = shown(p.comm or UNKNOWN) + ("  " + shown(p.cmdline) if p.cmdline else "")
    marks = state.marks(p)
    guard = marks[0].short + (f" (+{len(marks) - 1})" if len(marks) > 1 else "") if marks else ""
    guard_width = max(width - len(text) - command, 0)
    if selected:
        return ((fit(text + fit(name, command - 1) + " " + guard, width), SELECTED),)
    style = GRACE if marks and marks[0].kind == "grace" else WINDOW
    # the UTIL cell (the fifth column) coloured by the process's own utilization
    return (
        ("".join(laid[:4]), NORMAL),
        (laid[4], load(p.gpu_utilization, UTIL_LEVELS)),
        ("".join(laid[5:]), NORMAL),
        (fit(name, command - 1) + " ", DIM),
        (fit(guard, guard_width), style if marks else NORMAL),
    )


# (header, width) of the suspended table; COMMAND and WORKLOAD / REMEDY share what is left
_SUSPENDED_COLUMNS = (("PID", 8), ("USER", 10), ("GPU", 4), ("HOST MEM", 10), ("STATE", 10), ("FOR", 14))
_SUSPENDED_COMMAND = 24  # COMMAND's most cells: the workload, or a stuck process's remedy, needs the rest
_SUSPENDED_MIN_ROOM = 4  # process rows below which the suspended section is left out (the title counts them)


def _suspended_section(state: TopState, rows: list[SuspendedProcess], shown_rows: int, width: int) -> list[Line]:
    """The suspended processes apart from the running ones: a header saying how many and the host memory they
    hold, then `shown_rows` of them, the longest suspended first."""
    held = sum(r.memory for r in rows)
    more = f" ({shown_rows} shown)" if shown_rows < len(rows) else ""
    count = f"{len(rows)} process{'es' if len(rows) != 1 else ''}"
    title = f"SUSPENDED: {count}, {size(held)} held in host memory{more}"
    heads = "".join(h.ljust(w) for h, w in _SUSPENDED_COLUMNS)
    command = min(_command_width(width - len(heads)), _SUSPENDED_COMMAND)
    lines: list[Line] = [
        ((fit(title, width), HEADER),),
        ((fit(heads + "COMMAND".ljust(command) + "WORKLOAD / REMEDY", width), HEADER),),
    ]
    for r in rows[:shown_rows]:
        since = state.sample.wall - r.suspended_at if r.suspended_at and state.sample.wall else None
        cols = [
            str(r.pid),
            shown(state.user_of(r)),
            ",".join(map(str, r.devices)) or UNKNOWN,
            size(r.memory),
            r.state,
            format_duration(since if since is None or since >= 0 else None),
        ]
        text = "".join(fit(c, w - 1) + " " for c, (_, w) in zip(cols, _SUSPENDED_COLUMNS, strict=True))
        what = shown(f"{r.remedy} ({r.error})" if r.state == STUCK else r.workload)
        style = ERROR if r.state == STUCK else DIM
        lines.append(
            (
                (text, NORMAL),
                (fit(shown(r.comm or UNKNOWN), command - 1) + " ", DIM),
                (fit(what, max(width - len(text) - command, 0)), style),
            )
        )
    return [clip(list(line), width) for line in lines]


def _details(state: TopState, p: Process | None, width: int) -> list[Line]:
    if p is None:
        return [((fit("no process selected" if not state.filter else "no process matches the filter", width), DIM),)]
    where = [
        f"unit {p.unit}" if p.unit else "no unit",
        f"container {p.container_id}" if p.container_id else "",
        f"pod {p.pod_uid}" if p.pod_uid else "",
        f"Slurm job {p.slurm_job}" if p.slurm_job else "",
        f"PID {p.container_pid} in its namespace" if p.container_pid not in (None, p.pid) else "",
    ]
    lines = [
        f"PID {p.pid} ({p.comm}) of {p.user} (uid {p.uid}) on GPU {p.device} ({p.device_id})"
        + ("; shares a GPU context with other users" if p.shared_usage else ""),
        "  " + ", ".join(w for w in where if w),
        f"  {p.exe or UNKNOWN}: {p.cmdline}",
    ]
    out: list[Line] = [((fit(shown(text), width), NORMAL),) for text in lines]
    marks = state.marks(p)
    guard = "  guard: " + ("; ".join(m.long for m in marks) if marks else "nothing pending")
    return [*out, ((fit(guard, width), GRACE if marks else NORMAL),)]


def _title(state: TopState, width: int) -> Line:
    s = state.sample
    guard = (
        "guard: ?"
        if s.guard is None
        else (
            "guard: off"
            if not s.guard.enabled
            else "guard: on (dry run)"
            if s.guard.dry_run or s.guard.policy_dry_run
            else "guard: on"
        )
    )
    if s.guard is not None and s.guard.policy_error:
        guard += ", policy files rejected (gpukillctl guard status says why)"
    shown_rows = len(state.rows())
    count = f"{len(s.processes)} processes" + (f", {shown_rows} match /{state.filter}" if state.filter else "")
    if s.suspended:
        count += f", {len(s.suspended)} suspended"
    order = SORTS[state.sort]
    text = (
        f"gpukill top - {len(s.devices)} GPUs, {count} - sorted by {order.name}"
        f"{' (reversed)' if state.reverse else ''} - every {format_duration(s.interval)} - {guard}"
    )
    return ((fit(shown(text), width), TITLE),)


def _bottom(state: TopState, width: int) -> list[Line]:
    if state.mode is Mode.FILTER:
        prompt = (
            (
                fit(shown(f"filter: {state.typed}_") + "   (Enter: apply, Esc: cancel, ^U: erase, empty: all)", width),
                HEADER,
            ),
        )
    elif state.mode is Mode.CONFIRM and (p := state.target) is not None:
        prompt = (
            (
                fit(
                    shown(
                        f"Kill PID {p.pid} ({p.comm}) of {p.user} on GPU {p.device}? "
                        "y: SIGTERM, f: SIGTERM then SIGKILL after the grace, any other key: no"
                    ),
                    width,
                ),
                ERROR,
            ),
        )
    else:
        prompt = ((fit(state.message, width), ERROR if state.message_is_error else NORMAL),)
    return [prompt, ((fit(KEYS_HELP, width), DIM),)]


def _usage_line(state: TopState, width: int) -> Line:
    """The session's totals: GPU time, memory and energy of the processes you may see, since top started."""
    if state.usage is None:
        text = f"session: {state.usage_note}" if state.usage_note else ""
    else:
        u = state.usage
        text = f"session ({format_duration(u.until - u.since)}): {totals_line(u)}" + (
            " (usage store rebuilding)" if u.rebuilding else ""
        )
    return ((fit(shown(text), width), DIM),)


def render(state: TopState, width: int, height: int) -> list[Line]:
    """The whole screen, `height` lines of exactly `width` cells; scrolls so the selection is in view."""
    if height < _MIN_HEIGHT or width < 40:
        return [((fit(f"terminal too small for top ({width}x{height}; needs 40x{_MIN_HEIGHT})", width), ERROR),)]
    lines: list[Line] = [_title(state, width)]
    devices = state.sample.devices[: max(height - _MIN_HEIGHT, 1)]
    lines += [_device_line(d, width) for d in devices]
    if len(devices) < len(state.sample.devices):
        lines.append(((fit(f"... {len(state.sample.devices) - len(devices)} more GPUs", width), DIM),))
    lines.append(_usage_line(state, width))  # the line between the GPUs and the processes
    lines.append(_process_header(state, width))
    room = height - len(lines) - 1 - _DETAIL_LINES - 2
    held = state.suspended_rows()
    section: list[Line] = []
    if held and room >= _SUSPENDED_MIN_ROOM + 3:
        shown_held = min(len(held), max((room - 2) // 3, 1))
        section = _suspended_section(state, held, shown_held, width)
        room -= len(section)
    state.page = max(room - 1, 1)
    rows = state.rows()
    if state.index < state.top:
        state.top = state.index
    elif state.index >= state.top + room:
        state.top = state.index - room + 1
    state.top = max(0, min(state.top, max(len(rows) - room, 0)))
    for i in range(state.top, state.top + room):
        if i < len(rows):
            lines.append(_process_line(state, rows[i], width, i == state.index))
        else:
            lines.append(((" " * width, NORMAL),))
    lines += section
    current = state.current()
    lines.append(((("-- selected " + "-" * width)[:width], DIM),))
    details = _details(state, current, width)
    lines += details + [((" " * width, NORMAL),)] * (_DETAIL_LINES - len(details))
    lines += _bottom(state, width)
    return lines


def text_of(lines: list[Line]) -> str:
    """The screen as plain text (what a terminal shows, without attributes)."""
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines)
