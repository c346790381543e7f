"""Device telemetry from sysfs and hwmon, per driver; a value that is not there is None, never 0.

    amdgpu     gpu_busy_percent, mem_info_vram_used/_total (bytes), hwmon temp*_input (m°C, "edge" first),
               power1_average or power1_input (µW), hwmon freq1_input labelled "sclk" (Hz)
    i915       gt_act_freq_mhz on the card (or gt/gt0/rps_act_freq_mhz); discrete cards: hwmon energy1_input
    xe         tile0/gt0/freq0/act_freq (MHz), hwmon temp*_input, energy1_input or energy2_input
    others     whatever of the above exists, and devfreq cur_freq (Hz) for SoC GPUs (panfrost, msm, ...)

Power from an energy counter (µJ) is the difference between two samples over the time between them, so the
first sample has none. Device utilization for drivers without gpu_busy_percent is derived from fdinfo by the
backend, not here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .discovery import DrmCard
from .sysfs import listdir, read_int, read_text

TEMP_LABELS = ("edge", "pkg", "junction", "gpu", "mem", "vram")  # the first one present is "the" temperature


@dataclass(slots=True)
class Telemetry:
    utilization: float | None = None  # percent
    memory_used: int | None = None  # bytes
    memory_total: int | None = None
    temperature: float | None = None  # °C
    power: float | None = None  # W
    clock_mhz: float | None = None


def _hwmon(device_path: str) -> str | None:
    names = sorted(n for n in listdir(f"{device_path}/hwmon") if n.startswith("hwmon"))
    return f"{device_path}/hwmon/{names[0]}" if names else None


def _temperature_input(hwmon: str) -> str | None:
    """The file of "the" temperature: the first label of TEMP_LABELS present, else the lowest-numbered input."""
    inputs = {}
    for name in listdir(hwmon):
        m = re.fullmatch(r"temp(\d+)_input", name)
        if m:
            inputs[int(m.group(1))] = read_text(f"{hwmon}/temp{m.group(1)}_label") or ""
    if not inputs:
        return None
    by_label = {label.lower(): n for n, label in inputs.items()}
    chosen = next((by_label[label] for label in TEMP_LABELS if label in by_label), min(inputs))
    return f"temp{chosen}_input"


def _sclk_input(hwmon: str) -> str | None:
    for name in listdir(hwmon):
        m = re.fullmatch(r"freq(\d+)_input", name)
        if m and (read_text(f"{hwmon}/freq{m.group(1)}_label") or "").lower() == "sclk":
            return name
    return None


# Which files of a hwmon directory hold the temperature and the clock, by the directory's inode: its attributes
# and their labels are made when the driver registers it and stay until it is removed (a new one is a new inode),
# so the labels are read once, not every sample.
_LAYOUTS_MAX = 64


def _devfreq_clock(device_path: str) -> float | None:
    for name in sorted(listdir(f"{device_path}/devfreq")):
        hz = read_int(f"{device_path}/devfreq/{name}/cur_freq")
        if hz is not None:
            return hz / 1e6
    return None


def _intel_clock(card: DrmCard) -> float | None:
    for path in (
        f"{card.card_path}/gt_act_freq_mhz",
        f"{card.card_path}/gt/gt0/rps_act_freq_mhz",
        f"{card.device_path}/tile0/gt0/freq0/act_freq",
    ):
        mhz = read_int(path)
        if mhz is not None:
            return float(mhz)
    return None


class TelemetryReader:
    """Reads each card's sysfs; keeps the last energy reading per card for power from deltas."""

    def __init__(self) -> None:
        self._energy: dict[str, tuple[int, float]] = {}
        self._layouts: dict[str, tuple[tuple[int, int], tuple[str | None, str | None]]] = {}  # hwmon -> (inode, files)

    def _layout(self, hwmon: str) -> tuple[str | None, str | None]:
        """(temperature input, sclk input) file names of one hwmon directory."""
        try:
            st = os.stat(hwmon)
        except OSError:
            return None, None
        inode = (st.st_ino, st.st_ctime_ns)  # with its change time: a file system that reuses inode numbers
        known = self._layouts.get(hwmon)
        if known is not None and known[0] == inode:
            return known[1]
        layout = (_temperature_input(hwmon), _sclk_input(hwmon))
        if len(self._layouts) >= _LAYOUTS_MAX:
            self._layouts.clear()
        self._layouts[hwmon] = (inode, layout)
        return layout

    def _power(self, card: DrmCard, hwmon: str, now: float) -> float | None:
        for name in ("power1_average", "power1_input"):
            microwatts = read_int(f"{hwmon}/{name}")
            if microwatts is not None:
                return microwatts / 1e6
        for name in ("energy1_input", "energy2_input"):  # xe: card, or package where there is no card sensor
            microjoules = read_int(f"{hwmon}/{name}")
            if microjoules is None:
                continue
            previous = self._energy.get(card.id)
            self._energy[card.id] = (microjoules, now)
            if previous is None or now <= previous[1] or microjoules < previous[0]:
                return None  # first sample, or the counter wrapped
            return (microjoules - previous[0]) / 1e6 / (now - previous[1])
        return None

    def read(self, card: DrmCard, now: float) -> Telemetry:
        t = Telemetry()
        dev = card.device_path
        busy = read_int(f"{dev}/gpu_busy_percent")
        t.utilization = None if busy is None else float(busy)
        t.memory_used = read_int(f"{dev}/mem_info_vram_used")
        t.memory_total = read_int(f"{dev}/mem_info_vram_total")
        hwmon = _hwmon(dev)
        if hwmon is not None:
            temperature, sclk = self._layout(hwmon)
            milli = read_int(f"{hwmon}/{temperature}") if temperature else None
            t.temperature = None if milli is None else milli / 1000.0
            t.power = self._power(card, hwmon, now)
            hz = read_int(f"{hwmon}/{sclk}") if sclk else None
            t.clock_mhz = None if hz is None else hz / 1e6
        if t.clock_mhz is None:
            t.clock_mhz = _intel_clock(card) if card.driver in ("i915", "xe") else _devfreq_clock(dev)
        return t

    def forget(self, keep: set[str]) -> None:
        for card_id in self._energy.keys() - keep:
            del self._energy[card_id]
