"""The mark of tests with real components: they skip, with the reason, when not root or when a tool is missing."""

from __future__ import annotations

import pytest

from . import testbed


def _why_not() -> str | None:
    if not testbed.is_root():
        return "needs root: starts dbus-daemon, polkitd and journald in mount namespaces and switches users"
    if missing := testbed.missing_tools():
        return f"missing: {', '.join(missing)} (make test installs them)"
    return None


SKIP_REASON = _why_not()
needs_root = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
# Tests that take over ~60 s: they still run in CI (make test); `pytest -m "not slow"` leaves them out of a quick
# local run.
slow = pytest.mark.slow
