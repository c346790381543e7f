"""DRM fdinfo parsing and utilization arithmetic: pure functions on the kernel's own text, no root needed."""

from __future__ import annotations

import pytest
from helpers.drm_fixtures import (
    amdgpu_fdinfo,
    amdgpu_fdinfo_legacy,
    i915_fdinfo,
    msm_fdinfo,
    panfrost_fdinfo,
    print_size,
    xe_fdinfo,
)

from gpukilld.backends.drm.fdinfo import parse_fdinfo
from gpukilld.backends.drm.usage import UtilizationTracker, gpu_memory

PREFIX = "pos:\t0\nflags:\t02100002\nmnt_id:\t24\nino:\t531\n"
MiB = 1 << 20


def test_panfrost_documentation_sample_verbatim():
    # The example of Documentation/gpu/panfrost.rst, indentation and all.
    text = """      pos:    0
      flags:  02400002
      mnt_id: 27
      ino:    531
      drm-driver:     panfrost
      drm-client-id:  14
      drm-engine-fragment:    1846584880 ns
      drm-cycles-fragment:    1424359409
      drm-maxfreq-fragment:   799999987 Hz
      drm-curfreq-fragment:   799999987 Hz
      drm-engine-vertex-tiler:        71932239 ns
      drm-cycles-vertex-tiler:        52617357
      drm-maxfreq-vertex-tiler:       799999987 Hz
      drm-curfreq-vertex-tiler:       799999987 Hz
      drm-total-memory:       290 MiB
      drm-shared-memory:      0 MiB
      drm-active-memory:      226 MiB
      drm-resident-memory:    36496 KiB
      drm-purgeable-memory:   128 KiB
"""
    info = parse_fdinfo(text)
    assert (info.driver, info.client_id, info.pdev, info.ino) == ("panfrost", 14, None, 531)
    frag = info.engines["fragment"]
    assert (frag.busy_ns, frag.cycles, frag.maxfreq_hz, frag.capacity) == (1846584880, 1424359409, 799999987, 1)
    assert info.engines["vertex-tiler"].cycles == 52617357
    assert (info.regions["memory"].total, info.regions["memory"].resident) == (290 * MiB, 36496 * 1024)


def test_xe_total_cycles_are_engine_keys_not_a_memory_region():
    info = parse_fdinfo(
        PREFIX
        + xe_fdinfo(3, "0000:03:00.0", rcs=28257900, ccs=0, total_cycles=7655183225, vram0=23992 * 1024, gtt=192 * 1024)
    )
    assert set(info.regions) == {"system", "gtt", "vram0", "stolen"}  # no region called "cycles-rcs"
    assert info.engines["rcs"].cycles == 28257900 and info.engines["rcs"].total_cycles == 7655183225
    assert info.engines["ccs"].capacity == 4 and info.engines["vcs"].capacity == 2
    assert info.regions["vram0"].resident == 23992 * 1024 and info.regions["gtt"].total == 192 * 1024


def test_amdgpu_new_keys_win_over_the_deprecated_alias_and_the_odd_space():
    text = PREFIX + amdgpu_fdinfo(
        7, "0000:03:00.0", vram=3 * MiB, vram_resident=2 * MiB, gtt=5 * MiB, gfx_ns=1203400000
    )
    assert "drm-memory-gtt: \t5120 KiB\n" in text  # amdgpu's own spelling, space before the tab
    info = parse_fdinfo(text)
    assert info.pdev == "0000:03:00.0" and info.client_id == 7
    assert (info.regions["vram"].total, info.regions["vram"].resident) == (3 * MiB, 2 * MiB)
    assert info.regions["gtt"].resident == 5 * MiB
    assert info.engines["gfx"].busy_ns == 1203400000 and "compute" not in info.engines  # unused engines unprinted


def test_amdgpu_before_6_11_has_only_the_deprecated_keys():
    info = parse_fdinfo(amdgpu_fdinfo_legacy(9, "0000:03:00.0", vram=65536 * 1024, gtt=2048 * 1024, gfx_ns=5))
    assert info.regions["vram"].resident == 64 * MiB and info.regions["vram"].total is None
    assert info.regions["gtt"].resident == 2 * MiB


def test_i915_regions_and_capacity():
    info = parse_fdinfo(
        PREFIX
        + i915_fdinfo(
            7, "0000:00:02.0", render_ns=9288864723, copy_ns=2035071108, system0=6044 * 1024, local0=512 * MiB
        )
    )
    assert info.engines["video"].capacity == 2 and info.engines["render"].capacity == 1
    assert info.engines["video-enhance"].busy_ns == 0
    assert set(info.regions) == {"system0", "local0", "stolen-system0"}
    assert gpu_memory(info.regions) == 512 * MiB  # a discrete card: device memory only


def test_units_and_malformed_values():
    assert print_size("total", "vram", 3 * MiB) == "drm-total-vram:\t3 MiB\n"
    assert print_size("total", "vram", 1536) == "drm-total-vram:\t1536\n"  # not a whole KiB: bytes
    info = parse_fdinfo(
        "drm-driver:\tmsm\ndrm-maxfreq-gpu:\t650 MHz\ndrm-total-memory:\t2 GiB\n"
        "drm-client-id:\tseven\ndrm-engine-gpu:\t12 parsecs\ndrm-engine-capacity-gpu:\t0\n"
        "drm-resident-memory:\t-4\nno colon here\n"
    )
    assert info.engines["gpu"].maxfreq_hz == 650_000_000 and info.engines["gpu"].busy_ns is None
    assert info.engines["gpu"].capacity == 1  # zero is not allowed: the default stands
    assert info.client_id is None and info.regions["memory"].total == 2 << 30
    assert info.regions["memory"].resident is None
    assert not parse_fdinfo(PREFIX).is_drm  # an fd that is not a DRM client


def _two_samples(first: str, second: str, dt: float) -> dict[str, float]:
    tracker = UtilizationTracker()
    a, b = parse_fdinfo(first), parse_fdinfo(second)
    assert tracker.update(("dev", 1), a.engines, 10.0) is None  # the first sample has no utilization yet
    tracker.end_round()
    fractions = tracker.update(("dev", 1), b.engines, 10.0 + dt)
    assert fractions is not None
    return fractions


def test_the_parsed_line_cache_stays_bounded_and_never_changes_a_result():
    """parse_fdinfo remembers parsed lines (most of a client's lines repeat between samples); counters that move
    every sample, or a strange kernel's keys, must not grow that memory without end, nor change what a parse
    returns after it was emptied."""
    from gpukilld.backends.drm import fdinfo

    text = PREFIX + amdgpu_fdinfo(7, "0000:03:00.0", vram=64 * MiB, gtt=2 * MiB, gfx_ns=5)
    expected = repr(parse_fdinfo(text))
    for n in range(fdinfo._LINES_MAX + 100):  # a counter moving every sample: a new line each time
        parse_fdinfo(f"drm-driver:\tamdgpu\ndrm-engine-gfx:\t{n} ns\n")
        assert len(fdinfo._LINES) <= fdinfo._LINES_MAX
    assert parse_fdinfo("drm-engine-gfx:\t77 ns\n").engines["gfx"].busy_ns == 77
    long_name = "drm-client-name:\t" + "x" * fdinfo._LINE_MAX + "\n"
    assert parse_fdinfo(long_name).client_name == "x" * fdinfo._LINE_MAX
    assert long_name.rstrip("\n") not in fdinfo._LINES  # too long to keep
    assert repr(parse_fdinfo(text)) == expected


def test_ns_engines_divided_by_elapsed_time_and_capacity():
    f = _two_samples(
        i915_fdinfo(1, "0000:00:02.0", render_ns=1_000_000_000, video_ns=0),
        i915_fdinfo(1, "0000:00:02.0", render_ns=1_500_000_000, video_ns=400_000_000),
        dt=2.0,
    )
    assert f["render"] == pytest.approx(0.25)  # 0.5 s busy in 2 s
    assert f["video"] == pytest.approx(0.10)  # 0.4 s over 2 s on two engines


def test_xe_cycles_over_total_cycles_and_capacity():
    f = _two_samples(
        xe_fdinfo(3, "p", rcs=1000, ccs=0, total_cycles=10_000),
        xe_fdinfo(3, "p", rcs=7000, ccs=16_000, total_cycles=20_000),
        dt=99.0,
    )
    assert f["rcs"] == pytest.approx(0.6)  # GPU clock domain: the CPU-side dt does not matter
    assert f["ccs"] == pytest.approx(0.4)  # 16,000 of 4 x 10,000


def test_msm_cycles_over_maxfreq_and_elapsed_time():
    f = _two_samples(
        msm_fdinfo(2, elapsed_ns=0, cycles=0, maxfreq_hz=500_000_000),
        msm_fdinfo(2, elapsed_ns=10, cycles=350_000_000, maxfreq_hz=500_000_000),
        dt=1.0,
    )
    assert f["gpu"] == pytest.approx(0.7)  # cycles win over ns: they account for the clock


def test_panfrost_uses_cycles_and_maxfreq():
    f = _two_samples(
        panfrost_fdinfo(1, fragment_ns=0, fragment_cycles=0, vertex_ns=0, vertex_cycles=0, maxfreq_hz=800_000_000),
        panfrost_fdinfo(
            1,
            fragment_ns=999_999_999,
            fragment_cycles=400_000_000,
            vertex_ns=0,
            vertex_cycles=80_000_000,
            maxfreq_hz=800_000_000,
        ),
        dt=2.0,
    )
    assert f["fragment"] == pytest.approx(0.25) and f["vertex-tiler"] == pytest.approx(0.05)


def test_a_counter_that_goes_backwards_stays_at_the_larger_value_until_it_catches_up():
    tracker = UtilizationTracker()
    samples = [
        (0.0, 5_000_000_000),
        (1.0, 5_500_000_000),
        (2.0, 5_200_000_000),
        (3.0, 5_400_000_000),
        (4.0, 6_000_000_000),
    ]
    seen = []
    for t, ns in samples:
        seen.append(tracker.update(("d", 1), parse_fdinfo(f"drm-engine-gfx:\t{ns} ns\n").engines, t))
        tracker.end_round()
    assert seen[0] is None
    assert seen[1]["gfx"] == pytest.approx(0.5)
    assert seen[2]["gfx"] == 0.0 and seen[3]["gfx"] == 0.0  # below the 5.5 s mark: held there, never negative
    assert seen[4]["gfx"] == pytest.approx(0.5)  # climbs past it: only the part above 5.5 s counts


def test_a_client_not_seen_in_a_round_starts_afresh():
    tracker = UtilizationTracker()
    engines = parse_fdinfo("drm-engine-gfx:\t100 ns\n").engines
    tracker.update(("d", 1), engines, 0.0)
    tracker.end_round()
    tracker.end_round()  # a round without the client: it exited
    assert tracker.update(("d", 1), engines, 2.0) is None
