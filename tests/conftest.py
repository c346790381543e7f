"""Fixtures with real components (see helpers/testbed.py) and the hooks of the suite; the helpers themselves are
in the package helpers/. Tests that need real components skip, with the reason, when not root."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# tests/ on sys.path, so that test modules import `helpers.X` whatever pytest's import mode
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import testbed  # noqa: E402
from helpers.drm_fixtures import DrmHost  # noqa: E402
from helpers.marks import SKIP_REASON  # noqa: E402
from helpers.procs import pid_alive  # noqa: E402
from helpers.testbed import ADMIN, OTHER, OWNER, REPO, Testbed, User  # noqa: E402


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
        b.start_system()
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
    """A DRM fixture host (helpers.drm_fixtures.DrmHost: /sys, /proc and debugfs in the kernel's formats) of the
    test's own, under /tmp (0755: an unprivileged reader can walk it)."""
    root = tempfile.mkdtemp(prefix="gpukill-drm-")
    try:
        yield DrmHost(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def alive():
    return pid_alive


os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
