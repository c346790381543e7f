"""The DRM scan from the kernel's client lists: debugfs dri/N/clients names the processes to look at,
the full fd-table walk stays as a slice-per-sample safety net, and a list that cannot be read or trusted sends
the sample back to the walk. Parsing is pure; the backend tests run on fixture hosts (mknod, hence root)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from helpers.drm_fixtures import DrmHost, amdgpu_fdinfo, clients_header, clients_row

from gpukilld.backends.drm import DrmBackend
from gpukilld.backends.drm.clients import MAX_BYTES, MAX_LINE, parse_clients
from gpukilld.backends.drm.fdinfo import parse_fdinfo as real_parse
from gpukilld.backends.drm.scan import SAFETY_NET_PERIOD

GiB = 1 << 30
needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: fixture /dev/dri nodes are made with mknod")

# What a 6.8 kernel printed on a desktop (no "name" column yet): Xorg as master, a compositor, a browser.
KERNEL_6_8 = """             command  tgid dev master a   uid      magic
                Xorg  1812   0   y    y     0          0
         gnome-shell  2231 128   n    y  1000          0
     Isolated Web Co  4410 128   n    y  1000          0
           <unknown>     0 128   n    y     0          0
"""


# -- parsing -----------------------------------------------------------------------------------------


def test_parse_the_kernel_format_with_and_without_the_name_column():
    # tgid 0: the process is gone, nobody to scan; each tgid with the number of rows (DRM files) naming it
    assert parse_clients(KERNEL_6_8) == {1812: 1, 2231: 1, 4410: 1}
    named = (
        clients_header()
        + clients_row("python3", 77, 128, 1000, name="vllm-worker")
        + clients_row("Xorg", 5, 0, 0, master=True)
        + clients_row("python3", 77, 0, 1000, name="vllm-worker")
    )
    assert parse_clients(named) == {77: 2, 5: 1}
    assert parse_clients(clients_header()) == {}  # a card nobody has open


def test_a_comm_with_spaces_or_none_at_all_still_parses():
    text = clients_header() + clients_row("Web Content x", 900, 128, 1000) + clients_row("", 901, 128, 1000)
    assert parse_clients(text) == {900: 1, 901: 1}


@pytest.mark.parametrize(
    "text",
    [
        "",  # empty: no header
        "garbage\n",
        "command dev master a uid magic\n   x 0 n y 0 0\n",  # no tgid column
        clients_header() + "  evil\n" + clients_row("rest", 12, 128, 0),  # a newline in a comm split its row
        clients_header() + clients_row("a", 12, 128, 0).replace(" 12 ", " 1x "),  # tgid not a number
        clients_header() + clients_row("a", 12, 128, 0).replace("   n    y", "   q    y"),  # master flag not y/n
        clients_header() + "x" * (MAX_LINE + 1) + "\n",
    ],
)
def test_text_that_is_not_a_clients_file_in_full_is_not_trusted(text):
    assert parse_clients(text) is None


# -- the backend on fixture hosts ----------------------------------------------------------------------


@pytest.fixture
def listing_host():
    """A fixture host whose cards have debugfs clients files, kept in step with open_drm/close_fd/exit."""
    root = tempfile.mkdtemp(prefix="gpukill-drm-clients-")
    try:
        yield DrmHost(root, debugfs_clients=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def crowd(host: DrmHost, first: int = 5000, count: int = 60) -> None:
    """Processes with non-DRM fds only: what the walk pays for and the lists let us skip."""
    host.amdgpu()
    for pid in range(first, first + count):
        host.process(pid, "idle", start_time=pid)
        for fd in range(3):
            host.open_file(pid, fd, "/dev/null")


def backend(host: DrmHost) -> DrmBackend:
    return DrmBackend(
        str(host.sys), str(host.proc), str(host.debugfs), clock=lambda: 0.0, use_rsmi=False, revalidate_every=1000
    )


def pids(sample) -> set[int]:
    return {p.pid for p in sample.processes}


@needs_mknod
def test_a_listed_client_is_found_without_walking_every_fd_table(listing_host):
    host = listing_host
    crowd(host)
    b = backend(host)
    b.sample()
    assert b.scanner.stats.walked  # the first sample walks: the cache has to know every process once
    b.sample()
    assert not b.scanner.stats.walked and b.scanner.stats.scanned == 0
    host.process(7000, "trainer", start_time=1)
    host.open_drm(7000, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB))
    s = b.sample()
    assert 7000 in pids(s)
    assert not b.scanner.stats.walked
    assert b.scanner.stats.scanned == 1  # the listed process's fd table, and no other
    assert b.scanner.stats.processes <= 60 // SAFETY_NET_PERIOD + 2  # the listed one and a slice of the rest
    host.exit(7000)
    assert 7000 not in pids(b.sample())


@needs_mknod
def test_an_fd_passed_to_an_unlisted_process_is_found_within_the_safety_net_period(listing_host):
    host = listing_host
    crowd(host)
    host.process(7100, "launcher", start_time=1)
    host.open_drm(7100, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB))
    b = backend(host)
    b.sample()  # sample 1: the walk
    # 7101's slot (7101 % 10 == 1) comes at sample 11, the last of the next SAFETY_NET_PERIOD samples.
    host.process(7101, "worker", start_time=2)
    host.open_drm(7101, 9, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB), listed=False)  # SCM_RIGHTS
    found = [7101 in pids(b.sample()) for _ in range(SAFETY_NET_PERIOD)]
    assert not found[0]  # not in the kernel's list: the listed path alone does not see it
    assert found[-1]  # the safety net does, within its period
    assert 7101 in pids(b.sample())  # and keeps it, now that it is a known holder


@needs_mknod
def test_a_process_started_between_two_listings_of_proc_is_looked_at_within_the_period(listing_host):
    host = listing_host
    crowd(host)
    host.process(7100, "launcher", start_time=1)
    host.open_drm(7100, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB))
    b = backend(host)
    b.sample()  # sample 1: the walk
    listings = []
    for _ in range(SAFETY_NET_PERIOD - 1):  # samples 2..10
        b.sample()
        listings.append(b.scanner.stats.listed_proc)
    assert listings == [False] * (SAFETY_NET_PERIOD - 2) + [True]  # /proc itself only every period
    # Started right after sample 10's listing: its slot (7111 % 10 == 1) is sample 11, before any listing shows
    # it, and sample 21 after; the next listing (sample 20) looks at it as new, SAFETY_NET_PERIOD samples on.
    host.process(7111, "worker", start_time=2)
    host.open_drm(7111, 9, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB), listed=False)  # SCM_RIGHTS
    found = [7111 in pids(b.sample()) for _ in range(SAFETY_NET_PERIOD)]  # samples 11..20
    assert found == [False] * (SAFETY_NET_PERIOD - 1) + [True]
    assert 7111 in pids(b.sample())  # and kept as a known holder


def hostile_texts() -> dict[str, str]:
    return {
        "split row": clients_header() + "  evil\n" + clients_row("rest", 12, 128, 0),
        "long line": clients_header() + "x" * (MAX_LINE + 10) + "\n",
        "oversized": clients_header() + clients_row("spam", 12, 128, 0) * (MAX_BYTES // 100),
    }


@needs_mknod
@pytest.mark.parametrize("kind", ["missing", "unreadable", *hostile_texts()])
def test_an_unreadable_or_malformed_list_falls_back_to_the_walk(listing_host, kind):
    host = listing_host
    crowd(host)
    b = backend(host)
    b.sample()
    b.sample()
    assert not b.scanner.stats.walked
    # An unlisted holder that only the walk can see this sample (its slot is not this round's).
    host.process(7204, "hidden", start_time=1)
    host.open_drm(7204, 5, 128, amdgpu_fdinfo(4, "0000:03:00.0", vram=GiB), listed=False)
    path = host.debugfs / "dri" / "0" / "clients"
    if kind == "missing":
        path.unlink()
    elif kind == "unreadable":  # root reads past any mode bits; a directory in its place cannot be read
        path.unlink()
        path.mkdir()
    else:
        host.write_clients(0, hostile_texts()[kind])
    assert 7204 in pids(b.sample())
    assert b.scanner.stats.walked and b.scanner.stats.processes == 61


@needs_mknod
def test_kfd_processes_are_listed_clients(listing_host):
    host = listing_host
    crowd(host)
    host.kfd_gpu(1, 45678, 128)
    b = backend(host)
    b.sample()
    b.sample()
    host.process(7300, "rocm", start_time=1)
    host.open_drm(7300, 3, 128, amdgpu_fdinfo(7, "0000:03:00.0", vram=GiB), listed=False)
    host.kfd_process(7300, 45678, vram=GiB)
    s = b.sample()
    assert 7300 in pids(s) and not b.scanner.stats.walked and b.scanner.stats.scanned == 1


@needs_mknod
def test_a_newly_listed_process_is_read_in_full_even_behind_an_unchanged_fingerprint(listing_host):
    host = listing_host
    crowd(host)
    b = backend(host)
    b.sample()
    b.sample()
    # fd 0 of 5010 closed and the number reused for a DRM file between two samples: same count, mtime put back
    fd_dir = host.proc / "5010" / "fd"
    before = os.stat(fd_dir)
    host.close_fd(5010, 0)
    host.open_drm(5010, 0, 128, amdgpu_fdinfo(8, "0000:03:00.0", vram=GiB))
    os.utime(fd_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert 5010 in pids(b.sample())  # sample 3, not 5010's slot: only the kernel's list says to look


# -- cost: what a sample with trusted lists skips (goal: <= 10 ms per sample) ------------------------------


@needs_mknod
def test_a_listed_process_is_re_read_when_its_entry_changes_and_only_then(listing_host):
    """With trusted lists, a listed process's entry (rows per card) stands in for the periodic re-read of its
    fd table: no re-read while it stays the same, a full one as soon as a DRM file is opened behind a
    fingerprint that did not move."""
    host = listing_host
    crowd(host, count=9)
    host.process(7400, "trainer", start_time=1)
    host.open_file(7400, 3, "/dev/null")
    host.open_drm(7400, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB))
    b = DrmBackend(
        str(host.sys), str(host.proc), str(host.debugfs), clock=lambda: 0.0, use_rsmi=False, revalidate_every=1
    )  # every look would re-read, but for the entry
    b.sample()  # the walk
    for _ in range(3):
        b.sample()
        assert not b.scanner.stats.walked
        # the slice's processes are re-read (revalidate_every=1); the listed trainer never is
        assert b.scanner.stats.scanned == b.scanner.stats.processes - 1
    fd_dir = host.proc / "7400" / "fd"
    before = os.stat(fd_dir)
    host.close_fd(7400, 3)  # swapped for a second DRM file: same count, the directory's mtime put back
    host.open_drm(7400, 3, 128, amdgpu_fdinfo(9, "0000:03:00.0", vram=2 * GiB))
    os.utime(fd_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    s = b.sample()
    assert by_pid(s, 7400).gpu_memory == 3 * GiB  # both clients: the new row sent the scanner back to the table


@needs_mknod
def test_the_slice_re_reads_an_unchanged_table_every_revalidate_every_looks_not_samples(listing_host):
    host = listing_host
    crowd(host, count=SAFETY_NET_PERIOD)  # 5000 on: one per slot (and one slot with two)
    b = DrmBackend(
        str(host.sys), str(host.proc), str(host.debugfs), clock=lambda: 0.0, use_rsmi=False, revalidate_every=2
    )
    b.sample()  # sample 1, the walk: 5005's first re-read comes at its 5005 % 2 + 1 = 2nd look
    reread = []
    for _ in range(4 * SAFETY_NET_PERIOD):
        b.sample()
        reread.append(b.scanner.stats.scanned)
    # each process is looked at once a period, four times in all; its table is re-read every second look, i.e.
    # every 2 * SAFETY_NET_PERIOD samples, never on every look
    assert sum(reread) == SAFETY_NET_PERIOD * 4 // 2


@needs_mknod
def test_an_unchanged_fdinfo_is_not_parsed_again(listing_host, monkeypatch):
    from gpukilld.backends.drm import scan

    host = listing_host
    crowd(host, count=3)
    host.process(7500, "idle-gpu", start_time=1)
    host.open_drm(7500, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB, gfx_ns=10))
    parsed = []
    monkeypatch.setattr(scan, "parse_fdinfo", lambda text: parsed.append(text) or real_parse(text))
    b = backend(host)
    b.sample()
    b.sample()
    assert len(parsed) == 1  # the same bytes: last sample's result
    host.set_fdinfo(7500, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=2 * GiB, gfx_ns=20))
    assert by_pid(b.sample(), 7500).gpu_memory == 2 * GiB and len(parsed) == 2


@needs_mknod
def test_an_unchanged_list_is_not_parsed_again(listing_host, monkeypatch):
    from gpukilld.backends.drm import clients

    host = listing_host
    crowd(host, count=3)
    b = backend(host)
    b.sample()
    parsed = []
    monkeypatch.setattr(clients, "parse_clients", lambda text: parsed.append(text) or parse_clients(text))
    b.sample()
    assert parsed == []  # the same bytes as the last sample's list: its rows
    host.process(7600, "trainer", start_time=1)
    host.open_drm(7600, 4, 128, amdgpu_fdinfo(3, "0000:03:00.0", vram=GiB))
    assert 7600 in pids(b.sample()) and len(parsed) == 1  # a new row: parsed, and the client found at once


def by_pid(sample, pid: int):
    return next(p for p in sample.processes if p.pid == pid)
