"""Fixtures with real components (see testbed.py). Tests that need them skip, with the reason, when not root."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import testbed  # noqa: E402
from testbed import ADMIN, OTHER, OWNER, REPO, Testbed, User  # noqa: E402


def _why_not() -> str | None:
    if not testbed.is_root():
        return "needs root: starts dbus-daemon, polkitd and journald in mount namespaces and switches users"
    if missing := testbed.missing_tools():
        return f"missing: {', '.join(missing)} (make test installs them)"
    return None


SKIP_REASON = _why_not()
needs_root = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@pytest.fixture(scope="session")
def users() -> dict[str, User]:
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    testbed.ensure_users()
    testbed.make_traversable(REPO)
    return {"root": testbed.ROOT, "owner": User.get(OWNER), "other": User.get(OTHER), "admin": User.get(ADMIN)}


@pytest.fixture(scope="session")
def bed(users) -> Testbed:
    """One private system for the session: bus with our policy, journald, polkitd with the example rules,
    gpukilld on the example simulated GPUs."""
    b = Testbed()
    try:
        b.start_bus()
        b.start_journal()
        b.start_polkit([REPO / "polkit" / "49-gpukill-admins.rules"])
        b.start_daemon()
        yield b
    finally:
        b.stop()


@pytest.fixture
def victims(bed):
    """Victims started in a test are killed after it, so tests do not see each other's processes."""
    before = len(bed.procs)
    yield bed
    bed.kill_since(before)


@pytest.fixture
def fresh_bed(users):
    """A private bus and journal of the test's own, for tests that start or break daemons themselves."""
    b = Testbed()
    try:
        b.start_bus()
        b.start_journal()
        yield b
    finally:
        b.stop()


@pytest.fixture
def host():
    """A DRM fixture host (drm_fixtures.DrmHost: /sys, /proc and debugfs in the kernel's formats) of the test's
    own, under /tmp (0755: an unprivileged reader can walk it)."""
    from drm_fixtures import DrmHost

    root = tempfile.mkdtemp(prefix="gpukill-drm-")
    try:
        yield DrmHost(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


@pytest.fixture
def alive():
    return pid_alive


os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
