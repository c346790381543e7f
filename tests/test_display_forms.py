"""The printed forms every front end shares (gpukill/units.py): durations as systemd writes a timespan, energy in
joules, and "–" for a value nobody measured. Pure: no daemon, no root."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from gpukill.text import UNKNOWN
from gpukill.units import format_duration, format_energy


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, UNKNOWN),
        (math.nan, UNKNOWN),
        (math.inf, UNKNOWN),
        (0, "0s"),
        (0.0004, "0s"),
        (0.0006, "1ms"),
        (0.25, "250ms"),
        (0.5, "500ms"),
        (0.9996, "1s"),
        (1, "1s"),
        (1.5, "1.5s"),
        (5.54, "5.5s"),
        (5.55, "5.6s"),
        (2.5, "2.5s"),
        (12.5, "13s"),
        (9.96, "10s"),
        (45, "45s"),
        (59.6, "1min"),
        (60, "1min"),
        (90, "1min 30s"),
        (210, "3min 30s"),
        (241, "4min 1s"),
        (3600, "1h"),
        (3605, "1h 5s"),
        (3661, "1h 1min 1s"),
        (8769, "2h 26min 9s"),
        (8789.6, "2h 26min 30s"),
        (86399.6, "1d"),
        (90061, "1d 1h 1min"),
        (2 * 86400 + 3 * 3600 + 59, "2d 3h 1min"),
        (-3, "0s"),
    ],
)
def test_a_duration_prints_as_systemd_writes_a_timespan(seconds, text):
    assert format_duration(seconds) == text


def test_a_duration_never_has_more_than_three_parts_nor_a_zero_part():
    for seconds in range(0, 3 * 86400, 997):
        parts = format_duration(seconds).split()
        assert len(parts) <= 3 and all(not p.startswith("0") for p in parts[1:]), (seconds, parts)


@pytest.mark.parametrize(
    ("joules", "text"),
    [
        (None, UNKNOWN),
        (math.nan, UNKNOWN),
        (math.inf, UNKNOWN),
        (0, "0 J"),
        (0.4, "0.4 J"),
        (5, "5 J"),
        (8.25, "8.25 J"),
        (850, "850 J"),
        (999.6, "1 kJ"),
        (1000, "1 kJ"),
        (1500, "1.5 kJ"),
        (212_000, "212 kJ"),
        (999_999, "1 MJ"),
        (3.6e6, "3.6 MJ"),
        (3.6e9, "3.6 GJ"),
        (2e12, "2000 GJ"),
    ],
)
def test_energy_prints_in_joules_as_the_exporter_counts_it(joules, text):
    assert format_energy(joules) == text


def test_unknown_is_an_en_dash_never_zero():
    assert UNKNOWN == "\u2013" and format_energy(None) != format_energy(0) and format_duration(None) != "0s"


FORMAT_JS = Path(__file__).resolve().parents[1] / "gpukillctl" / "web" / "static" / "format.js"
SECONDS = [
    None,
    0,
    0.0004,
    0.0006,
    0.25,
    0.5,
    0.9996,
    1,
    1.5,
    2.5,
    5.54,
    5.55,
    9.96,
    12.5,
    45,
    59.6,
    60,
    90,
    210,
    241,
    3600,
    3605,
    3661,
    8769,
    8789.6,
    86399.6,
    90061,
    183659,
    1e9,
    -3,
]
JOULES = [None, 0, 0.4, 5, 8.25, 850, 999.6, 1000, 1500, 212_000, 999_999, 3.6e6, 3.6e9, 2e12]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (the page's own test runs chromium)")
def test_the_page_prints_what_the_cli_prints():
    """format.js's duration and energy give the same text as gpukill/units.py for the same values."""
    script = (
        f"import * as f from {json.dumps(str(FORMAT_JS))};\n"
        f"console.log(JSON.stringify([{json.dumps(SECONDS)}.map(f.duration), {json.dumps(JOULES)}.map(f.energy)]));"
    )
    r = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    durations, energies = json.loads(r.stdout)
    assert durations == [format_duration(s) for s in SECONDS]
    assert energies == [format_energy(j) for j in JOULES]
