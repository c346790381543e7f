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
(_IGNORED, _DRIVER, _PDEV, _CLIENT_ID, _CLIENT_NAME, _INO, _CAPACITY, _BUSY, _TOTAL_CYCLES, _CYCLES, _MAXFREQ,
 _TOTAL, _RESIDENT, _MEMORY) = range(14)
_EXACT = {"drm-driver": _DRIVER, "drm-pdev": _PDEV, "drm-client-id": _CLIENT_ID, "drm-client-name": _CLIENT_NAME,
          "ino": _INO}
# Longest first where one prefix starts another: "drm-engine-capacity-" before "drm-engine-", "drm-total-cycles-"
# (an engine key) before the memory key "drm-total-".
_PREFIXES = (("drm-engine-capacity-", _CAPACITY), ("drm-engine-", _BUSY), ("drm-total-cycles-", _TOTAL_CYCLES),
             ("drm-cycles-", _CYCLES), ("drm-maxfreq-", _MAXFREQ), ("drm-total-", _TOTAL),
             ("drm-resident-", _RESIDENT), ("drm-memory-", _MEMORY))
_SIZE_KINDS = frozenset((_TOTAL, _RESIDENT, _MEMORY))


def _classify(raw_key: str) -> tuple[int, str]:
    key = raw_key.strip()
    kind = (_EXACT[key], "") if key in _EXACT else (_IGNORED, "")
    if kind[0] == _IGNORED and key.startswith("drm-"):
        for prefix, what in _PREFIXES:
            if key.startswith(prefix):
                kind = (what, key[len(prefix):])
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
# again. Cleared when full, since moving counters add a few new lines per client per sample; long lines (none
# of the specification's keys makes one) are not kept.
_LINES: dict[str, tuple[int, str, str | int | None]] = {}
_LINES_MAX = 16384
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


def parse_fdinfo(text: str) -> FdInfo:
    info = FdInfo()
    engines = info.engines
    regions = info.regions
    deprecated_memory: dict[str, int] = {}
    known = _LINES
    for line in text.splitlines():
        parsed = known.get(line)
        if parsed is None:
            parsed = _parse_line(line)
            if len(line) <= _LINE_MAX:
                if len(known) >= _LINES_MAX:
                    known.clear()
                known[line] = parsed
        what, name, value = parsed
        if what == _IGNORED:
            continue
        if what >= _TOTAL:  # a region's size
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
            engine = engines.get(name)
            if engine is None:
                engine = engines[name] = EngineCounters()
            if what == _BUSY:
                engine.busy_ns = value  # type: ignore[assignment]
            elif what == _CAPACITY:
                engine.capacity = value  # type: ignore[assignment]
            elif what == _CYCLES:
                engine.cycles = value  # type: ignore[assignment]
            elif what == _TOTAL_CYCLES:
                engine.total_cycles = value  # type: ignore[assignment]
            else:
                engine.maxfreq_hz = value  # type: ignore[assignment]
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
    return info
