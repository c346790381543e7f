"""A private bus with no access policy, for tests that serve the real Door and interfaces in-process and call
them as whichever uid they pretend (the bus policy is not what they test: tests/helpers/testbed.py has ours)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


def open_bus(where: Path) -> Iterator[str]:
    """Run a dbus-daemon in `where` while the generator is open; yields its address."""
    if shutil.which("dbus-daemon") is None:
        pytest.skip("dbus-daemon is not installed")
    socket = where / "bus.sock"
    (where / "bus.conf").write_text(BUS_CONFIG.format(socket=socket))
    daemon = subprocess.Popen(
        ["dbus-daemon", f"--config-file={where / 'bus.conf'}", "--nofork", "--nopidfile"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not socket.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, "dbus-daemon did not start"
            time.sleep(0.05)
        yield f"unix:path={socket}"
    finally:
        daemon.terminate()
        daemon.wait(5)
