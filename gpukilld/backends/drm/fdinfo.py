"""Parsing /proc/PID/fdinfo/FD of a DRM file: the keys of Documentation/gpu/drm-usage-stats.rst, with units.

    drm-driver, drm-pdev, drm-client-id, drm-client-name      who the client is
    drm-engine-<e>: <uint> ns, drm-engine-capacity-<e>         busy time per engine (i915, amdgpu, panfrost)
    drm-cycles-<e>, drm-total-cycles-<e>                       busy and elapsed GPU cycles (xe)
    drm-cycles-<e>, drm-maxfreq-<e>: <uint> [Hz|KHz|MHz]       busy cycles and the engine's top clock (msm, panfrost)
    drm-total-<r>, drm-resident-<r>, drm-memory-<r>: <uint> [KiB|MiB|GiB]   memory per region

drm-memory-<r> is the deprecated alias of drm-resident-<r> (amdgpu still prints it). "drm-total-cycles-" is an
engine key although it starts like the memory key "drm-total-", so it is matched first. Keys a parser does not
know are ignored, as the specification asks; a malformed value drops that key only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SIZE_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
FREQ_UNITS = {"": 1, "Hz": 1, "KHz": 1_000, "kHz": 1_000, "MHz": 1_000_000, "GHz": 1_000_000_000}


@dataclass(slots=True)
class EngineCounters:
    """One engine's counters from one fdinfo read; a utilization needs two reads (usage.UtilizationTracker)."""

    busy_ns: int | None = None
    capacity: int = 1  # "In the absence of this tag parser shall assume capacity of one"
    cycles: int | None = None
    total_cycles: int | None = None
    maxfreq_hz: int | None = None


@dataclass(slots=True)
class Region:
    total: int | None = None  # every buffer created, instantiated or not
    resident: int | None = None  # buffers with backing store present


@dataclass(slots=True)
class FdInfo:
    driver: str | None = None
    pdev: str | None = None
    client_id: int | None = None
    client_name: str | None = None
    ino: int | None = None  # the generic fdinfo line: the inode of the opened file
    engines: dict[str, EngineCounters] = field(default_factory=dict)
    regions: dict[str, Region] = field(default_factory=dict)
    # The region lines as parsed, in order: regions is a function of them alone, so a client whose next fdinfo
    # has equal region lines (only its engine counters moved) has equal regions (usage.UsageRecords).
    region_lines: tuple = field(default=(), repr=False, compare=False)

    @property
    def is_drm(self) -> bool:
        return self.driver is not None


_NS = {"ns": 1}

# What a key means, worked out once per distinct key: a kernel prints a few dozen, so a parse then costs one dict
# look-up per line instead of a chain of prefix tests (the backend parses every client's fdinfo every sample).
# Keys come from drivers, not from processes; the bound only keeps a strange kernel from growing it without end.
_KINDS: dict[str, tuple[int, str]] = {}
_KINDS_MAX = 4096
# In this order: parse_fdinfo tells engine keys (_CAPACITY.._MAXFREQ) and sizes (_TOTAL.._MEMORY) by range.
(
    _IGNORED,
    _DRIVER,
    _PDEV,
    _CLIENT_ID,
    _CLIENT_NAME,
    _INO,
    _CAPACITY,
    _BUSY,
    _TOTAL_CYCLES,
    _CYCLES,
    _MAXFREQ,
    _TOTAL,
    _RESIDENT,
    _MEMORY,
) = range(14)
_EXACT = {
    "drm-driver": _DRIVER,
    "drm-pdev": _PDEV,
    "drm-client-id": _CLIENT_ID,
    "drm-client-name": _CLIENT_NAME,
    "ino": _INO,
}
# Longest first where one prefix starts another: "drm-engine-capacity-" before "drm-engine-", "drm-total-cycles-"
# (an engine key) before the memory key "drm-total-".
_PREFIXES = (
    ("drm-engine-capacity-", _CAPACITY),
    ("drm-engine-", _BUSY),
    ("drm-total-cycles-", _TOTAL_CYCLES),
    ("drm-cycles-", _CYCLES),
    ("drm-maxfreq-", _MAXFREQ),
    ("drm-total-", _TOTAL),
    ("drm-resident-", _RESIDENT),
    ("drm-memory-", _MEMORY),
)
_SIZE_KINDS = frozenset((_TOTAL, _RESIDENT, _MEMORY))


def _classify(raw_key: str) -> tuple[int, str]:
    key = raw_key.strip()
    kind = (_EXACT[key], "") if key in _EXACT else (_IGNORED, "")
    if kind[0] == _IGNORED and key.startswith("drm-"):
        for prefix, what in _PREFIXES:
            if key.startswith(prefix):
                kind = (what, key[len(prefix) :])
                break
    if len(_KINDS) < _KINDS_MAX:
        _KINDS[raw_key] = kind
    return kind


def _number(value: str, units: dict[str, int]) -> int | None:
    number, _, unit = value.partition(" ")
    unit = unit.strip()
    if unit not in units or not number.isdigit():
        return None
    return int(number) * units[unit]


# Lines already parsed, by their text: between two samples most of a client's lines are the same (driver, pdev,
# client id, most memory and engine counters), so a parse looks those up instead of splitting and converting them
# again. Moving counters add a few new lines per client per sample, so the table is bounded in two generations:
# when the current one is full it becomes the old one (the previous old one is dropped) and a line found only in
# the old one is carried over, so the lines that repeat stay and a rotation costs no sample a full re-parse of
# every client (as emptying the table did). Long lines (none of the specification's keys makes one) are not kept.
_LINES: dict[str, tuple[int, str, str | int | None]] = {}
_OLD_LINES: dict[str, tuple[int, str, str | int | None]] = {}
_LINES_MAX = 8192  # per generation
_LINE_MAX = 256
_SKIP: tuple[int, str, None] = (_IGNORED, "", None)


def _parse_line(line: str) -> tuple[int, str, str | int | None]:
    """(kind, engine or region name, value) of one line; _SKIP for a line without a known key or a valid value."""
    key, sep, value = line.partition(":")
    if not sep:
        return _SKIP
    kind = _KINDS.get(key)
    what, name = _classify(key) if kind is None else kind
    if what == _IGNORED:
        return _SKIP
    value = value.strip()
    number: str | int | None
    if what in _SIZE_KINDS:
        number = _number(value, SIZE_UNITS)
    elif what == _BUSY:
        number = _number(value, _NS)
    elif what == _MAXFREQ:
        number = _number(value, FREQ_UNITS) or None  # 0 Hz would divide by zero: not a clock
    elif what in (_DRIVER, _CLIENT_NAME):
        number = value
    elif what == _PDEV:
        number = value.lower()
    elif what == _CAPACITY:
        number = int(value) if value.isdigit() and int(value) > 0 else None  # zero is not allowed: default one
    else:  # ino, client id, cycles, total cycles
        number = int(value) if value.isdigit() else None
    return _SKIP if number is None else (what, name, number)


def _missed(line: str) -> tuple[int, str, str | int | None]:
    """A line not in the current generation of _LINES: from the old one, or parsed; kept in the current one."""
    global _LINES, _OLD_LINES
    parsed = _OLD_LINES.get(line)
    if parsed is None:
        parsed = _parse_line(line)
    if len(line) <= _LINE_MAX:
        if len(_LINES) >= _LINES_MAX:
            _OLD_LINES, _LINES = _LINES, {}
        _LINES[line] = parsed
    return parsed


# What the text before a client's first engine line parsed to (identity, memory), by that text: a busy client's
# counters move every sample, its memory much less often, and the kernel prints the engine lines last (amdgpu,
# i915, xe, msm, panfrost...). So parse_fdinfo looks the head up and parses only the engine lines after it; the
# result is what parsing it all gives, since the head holds no engine line and the tail nothing but engine
# lines (else: the whole text is parsed). Two generations, like _LINES; heads are shared, never changed.
_HEADS: dict[str, FdInfo] = {}
_OLD_HEADS: dict[str, FdInfo] = {}
_HEADS_MAX = 2048  # per generation; a head is a few hundred bytes
_HEAD_CHARS = 4096  # a longer one is not kept (at most ~16 MiB in all)
_ENGINE_KINDS = range(_CAPACITY, _MAXFREQ + 1)


def _head(text: str) -> FdInfo:
    global _HEADS, _OLD_HEADS
    info = _OLD_HEADS.get(text)
    if info is None:
        info = _parse_all(text)
    if len(_HEADS) >= _HEADS_MAX:
        _OLD_HEADS, _HEADS = _HEADS, {}
    _HEADS[text] = info
    return info


def _count(engines: dict[str, EngineCounters], what: int, name: str, value: int) -> None:
    """One engine counter line into its engine's counters."""
    engine = engines.get(name)
    if engine is None:
        engine = engines[name] = EngineCounters()
    if what == _BUSY:
        engine.busy_ns = value
    elif what == _CAPACITY:
        engine.capacity = value
    elif what == _CYCLES:
        engine.cycles = value
    elif what == _TOTAL_CYCLES:
        engine.total_cycles = value
    else:
        engine.maxfreq_hz = value


def _tail_engines(text: str) -> dict[str, EngineCounters] | None:
    """The engines of lines that are all engine counters (or ignored); None if any is something else."""
    engines: dict[str, EngineCounters] = {}
    known = _LINES
    for line in text.splitlines():
        parsed = known.get(line)
        if parsed is None:
            parsed = _missed(line)
        what, name, value = parsed
        if what == _IGNORED:
            continue
        if what not in _ENGINE_KINDS:
            return None
        _count(engines, what, name, value)  # type: ignore[arg-type]  # an engine counter's value is an int
    return engines


def parse_fdinfo(text: str) -> FdInfo:
    at = text.find("\ndrm-engine-")
    cycles = text.find("\ndrm-cycles-")
    if cycles >= 0 and (at < 0 or cycles < at):
        at = cycles
    if 0 <= at < _HEAD_CHARS:
        head_text = text[: at + 1]
        head = _HEADS.get(head_text)
        if head is None:
            head = _head(head_text)
        if not head.engines:
            engines = _tail_engines(text[at + 1 :])
            if engines is not None:
                return FdInfo(
                    head.driver,
                    head.pdev,
                    head.client_id,
                    head.client_name,
                    head.ino,
                    engines,
                    head.regions,
                    head.region_lines,
                )
    return _parse_all(text)


def _parse_all(text: str) -> FdInfo:
    info = FdInfo()
    engines = info.engines
    regions = info.regions
    deprecated_memory: dict[str, int] = {}
    region_lines = []
    known = _LINES
    for line in text.splitlines():
        parsed = known.get(line)
        if parsed is None:
            parsed = _missed(line)
        # The value's type follows what (_parse_line: an int for sizes, counters and ids, a str for names), which
        # mypy cannot narrow by: hence the ignores below
        what, name, value = parsed
        if what == _IGNORED:
            continue
        if what >= _TOTAL:  # a region's size
            region_lines.append(parsed)
            if what == _MEMORY:
                deprecated_memory[name] = value  # type: ignore[assignment]
                continue
            region = regions.get(name)
            if region is None:
                region = regions[name] = Region()
            if what == _TOTAL:
                region.total = value  # type: ignore[assignment]
            else:
                region.resident = value  # type: ignore[assignment]
        elif what >= _CAPACITY:  # an engine's counter
            _count(engines, what, name, value)  # type: ignore[arg-type]
        elif what == _INO:
            info.ino = value  # type: ignore[assignment]
        elif what == _DRIVER:
            info.driver = value  # type: ignore[assignment]
        elif what == _PDEV:
            info.pdev = value  # type: ignore[assignment]
        elif what == _CLIENT_ID:
            info.client_id = value  # type: ignore[assignment]
        else:
            info.client_name = value  # type: ignore[assignment]
    for name, size in deprecated_memory.items():  # an alias of drm-resident-<r>; the new key wins if both exist
        region = regions.setdefault(name, Region())
        if region.resident is None:
            region.resident = size
    info.region_lines = tuple(region_lines)
    return info
