"""Whose a shared DRM client is: one (device, drm-client-id) held by several processes, through fork,
dup or an fd passed over a socket with SCM_RIGHTS. Same uid: the first holder. One regular uid and system
accounts: that user's. Several regular uids: no one, every holder flagged shared_usage.

The first tests are pure (process_usages on made-up clients, no root); the last ones run the backend on a fixture
/proc whose status files give each holder its uid, as the kernel's do (they need mknod, hence root)."""

from __future__ import annotations

import os

import pytest
from helpers.drm_fixtures import amdgpu_fdinfo

from gpukilld.backends.drm import DrmBackend
from gpukilld.backends.drm.fdinfo import Region
from gpukilld.backends.drm.usage import UNKNOWN_UID, Client, process_usages
from gpukilld.model import MemoryRegion

GiB = 1 << 30
SYS_MAX = 999
DEV = "GPU-0"


def client(cid: int, *holders: tuple[int, int], vram: int = 6 * GiB, busy: float = 0.5) -> Client:
    """A client on DEV with `vram` bytes and one engine `busy`; holders are (start time, pid)."""
    return Client((DEV, cid), DEV, set(holders), {"gfx": busy}, {"vram": Region(vram, vram)}, has_usage_keys=True)


def usages(clients: list[Client], uids: dict[int, int | None]) -> dict[int, tuple]:
    """pid -> (gpu_memory, gpu_utilization, shared_usage); uids by pid (None: gone since the scan)."""
    asked: list[int] = []

    def uid_of(holder):
        asked.append(holder[1])
        return uids[holder[1]]

    out = {u.pid: (u.gpu_memory, u.gpu_utilization, u.shared_usage) for u in process_usages(clients, uid_of, SYS_MAX)}
    out["asked"] = sorted(set(asked))  # type: ignore[index]
    return out


def test_a_client_with_one_holder_is_its_own_and_no_uid_is_read():
    got = usages([client(1, (100, 10)), client(2, (200, 20), vram=GiB)], {})
    assert got == {10: (6 * GiB, 50.0, False), 20: (GiB, 50.0, False), "asked": []}


def test_same_uid_sharing_counts_once_under_the_first_holder():
    got = usages([client(1, (200, 11), (100, 10), (300, 12))], {10: 1001, 11: 1001, 12: 1001})
    assert got[10] == (6 * GiB, 50.0, False)  # started first
    assert got[11] == got[12] == (None, None, False)  # listed, no usage, nothing charged to no one


def test_different_regular_uids_are_charged_to_no_one():
    # gpkother's process started first (a launcher, or it was handed the fd): charging the first holder bills it all
    own = client(2, (200, 20), vram=GiB, busy=0.25)  # the miner's own context, unshared
    got = usages([client(1, (100, 30), (200, 20)), own], {20: 1001, 30: 1002})
    assert got[30] == (None, None, True)  # never charged for what another user allocated
    assert got[20] == (GiB, 25.0, True)  # its own part, flagged: its figures are lower bounds


def test_a_system_holder_neither_pays_nor_hides():
    # dbus-daemon (uid 100, started long before) holds the miner's fd in a queued message
    got = usages([client(1, (50, 5), (200, 20))], {5: 100, 20: 1001})
    assert got[20] == (6 * GiB, 50.0, False)  # the regular user's, not hidden
    assert got[5] == (None, None, False)
    root_and_user = usages([client(1, (50, 1), (60, 2), (200, 20), (300, 21))], {1: 0, 2: 100, 20: 1001, 21: 1001})
    assert root_and_user[20][0] == 6 * GiB and root_and_user[21][0] is None  # first holder of that regular uid


def test_two_regular_uids_and_a_system_holder_is_no_one_s():
    got = usages([client(1, (50, 5), (100, 30), (200, 20))], {5: 100, 20: 1001, 30: 1002})
    assert {pid: got[pid] for pid in (5, 20, 30)} == {p: (None, None, True) for p in (5, 20, 30)}


def test_system_holders_only():
    same = usages([client(1, (50, 5), (60, 6))], {5: 0, 6: 0})
    assert same[5] == (6 * GiB, 50.0, False) and same[6] == (None, None, False)
    mixed = usages([client(1, (50, 5), (60, 6))], {5: 0, 6: 100})  # root and messagebus: no one's
    assert mixed[5] == mixed[6] == (None, None, True)


def test_a_holder_gone_since_the_scan_is_left_out_and_an_unreadable_one_counts_against_charging():
    gone = usages([client(1, (100, 30), (200, 20))], {20: 1001, 30: None})  # 30 exited after the scan
    assert gone[20] == (6 * GiB, 50.0, False)
    unknown = usages([client(1, (100, 30), (200, 20))], {20: 1001, 30: UNKNOWN_UID})
    assert unknown[20] == unknown[30] == (None, None, True)


def test_uids_are_read_only_for_shared_clients():
    got = usages([client(1, (100, 10)), client(2, (200, 20), (300, 21)), client(3, (400, 40))], {20: 1001, 21: 1001})
    assert got["asked"] == [20, 21]


# -- the backend on a fixture /proc -----------------------------------------------------------------------------

needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: fixture /dev/dri nodes are made with mknod")


@needs_mknod
def test_backend_reads_holder_uids_from_proc_status(host):
    host.amdgpu()
    pdev = "0000:03:00.0"
    passed = amdgpu_fdinfo(40, pdev, vram=6 * GiB)  # one drm_file, in the fd tables of 500 and 501
    host.process(500, "launcher", start_time=1000, uid=1002)
    host.process(501, "miner", start_time=2000, uid=1001)
    host.process(502, "dbus-daemon", start_time=10, uid=100)
    host.process(503, "miner2", start_time=3000, uid=1001)
    host.open_drm(500, 5, 128, passed)
    host.open_drm(501, 7, 128, passed)
    queued = amdgpu_fdinfo(41, pdev, vram=3 * GiB)  # another, sitting in dbus-daemon's queue
    host.open_drm(502, 9, 128, queued)
    host.open_drm(503, 4, 128, queued)
    b = DrmBackend(str(host.sys), str(host.proc), str(host.debugfs), use_rsmi=False, system_uid_max=SYS_MAX)
    got = {u.pid: (u.gpu_memory, u.shared_usage) for u in b.sample().processes}
    assert got == {500: (None, True), 501: (None, True), 502: (None, False), 503: (3 * GiB, False)}


@needs_mknod
def test_backend_leaves_out_a_holder_whose_pid_was_reused(host):
    """A holder whose start time changed since the scan is a newcomer: its uid says nothing about the client."""
    host.amdgpu()
    text = amdgpu_fdinfo(40, "0000:03:00.0", vram=2 * GiB)
    host.process(600, "launcher", start_time=1000, uid=1002)
    host.process(601, "job", start_time=2000, uid=1001)
    host.open_drm(600, 5, 128, text)
    host.open_drm(601, 5, 128, text)
    b = DrmBackend(str(host.sys), str(host.proc), str(host.debugfs), use_rsmi=False, system_uid_max=SYS_MAX)
    uid_of = b._holder_uids()
    assert uid_of((1000, 600)) == 1002
    assert uid_of((999, 600)) is None  # the scan saw another process under this PID
    assert uid_of((5, 4242)) is None  # exited


def test_a_process_with_one_client_gets_that_client_s_own_figures():
    # the common case, which process_usages takes without adding up (usage._one_client)
    regions = {"vram": Region(GiB, GiB // 2), "gtt": Region(4 << 20, None)}
    idle = Client((DEV, 1), DEV, {(100, 10)}, {}, regions, has_usage_keys=True)  # engines printed, none moved
    first = Client((DEV, 2), DEV, {(200, 20)}, None, regions, has_usage_keys=True)  # first sample: unknown
    got = {u.pid: u for u in process_usages([idle, first], lambda h: None, SYS_MAX)}
    assert (got[10].gpu_utilization, got[20].gpu_utilization) == (0.0, None)
    assert got[10].gpu_memory == got[20].gpu_memory == GiB // 2  # device memory, resident
    assert got[10].memory_regions == (MemoryRegion("gtt", 4 << 20, None), MemoryRegion("vram", GiB, GiB // 2))
