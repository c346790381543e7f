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


def _number(value: str, units: dict[str, int]) -> int | None:
    number, _, unit = value.partition(" ")
    unit = unit.strip()
    if unit not in units or not number.isdigit():
        return None
    return int(number) * units[unit]


def parse_fdinfo(text: str) -> FdInfo:
    info = FdInfo()
    engines = info.engines
    regions = info.regions
    deprecated_memory: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        value = value.strip()
        if not key.startswith("drm-"):
            if key == "ino" and value.isdigit():
                info.ino = int(value)
            continue
        if key == "drm-driver":
            info.driver = value
        elif key == "drm-pdev":
            info.pdev = value.lower()
        elif key == "drm-client-id":
            if value.isdigit():
                info.client_id = int(value)
        elif key == "drm-client-name":
            info.client_name = value
        elif key.startswith("drm-engine-capacity-"):
            if value.isdigit() and int(value) > 0:  # zero capacity is not allowed: keep the default of one
                engines.setdefault(key[20:], EngineCounters()).capacity = int(value)
        elif key.startswith("drm-engine-"):
            ns = _number(value, {"ns": 1})
            if ns is not None:
                engines.setdefault(key[11:], EngineCounters()).busy_ns = ns
        elif key.startswith("drm-total-cycles-"):
            if value.isdigit():
                engines.setdefault(key[17:], EngineCounters()).total_cycles = int(value)
        elif key.startswith("drm-cycles-"):
            if value.isdigit():
                engines.setdefault(key[11:], EngineCounters()).cycles = int(value)
        elif key.startswith("drm-maxfreq-"):
            hz = _number(value, FREQ_UNITS)
            if hz:
                engines.setdefault(key[12:], EngineCounters()).maxfreq_hz = hz
        elif key.startswith("drm-total-"):
            size = _number(value, SIZE_UNITS)
            if size is not None:
                regions.setdefault(key[10:], Region()).total = size
        elif key.startswith("drm-resident-"):
            size = _number(value, SIZE_UNITS)
            if size is not None:
                regions.setdefault(key[13:], Region()).resident = size
        elif key.startswith("drm-memory-"):
            size = _number(value, SIZE_UNITS)
            if size is not None:
                deprecated_memory[key[11:]] = size
    for name, size in deprecated_memory.items():  # an alias of drm-resident-<r>; the new key wins if both exist
        region = regions.setdefault(name, Region())
        if region.resident is None:
            region.resident = size
    return info
