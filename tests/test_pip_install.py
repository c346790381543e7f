"""A plain `pip install` of the checkout audits to the journal: MESSAGE_ID, PRIORITY and the GPUKILL_* fields
reach a real journald without systemd-python or any other optional package. The daemon run is the
venv's console script, with nothing of the checkout on its path."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.marks import needs_root
from helpers.testbed import REPO, ROOT, DaemonProcess, NotifyListener, Testbed

from gpukilld import journal as audit

pytestmark = needs_root

SYSTEM_PYTHON = "/usr/bin/python3"


def _checkout_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored): pip builds in the source tree,
    so it builds in this copy and leaves no build/ in the checkout others are working in."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True
    )
    if listed.returncode != 0:  # a tree without git (an unpacked tarball): all but what a build leaves
        shutil.copytree(
            REPO,
            dest,
            ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"),
        )
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file may be deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def _clean_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pip-install")
    src = _checkout_copy(root / "src")
    venv = root / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(src)],
        cwd="/",
        env=_clean_env(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return venv


def _start_installed_daemon(bed: Testbed, venv: Path) -> DaemonProcess:
    """Testbed.start_daemon, but the venv's `gpukilld` script, from /, and no PYTHONPATH."""
    sim = yaml.safe_load((REPO / "examples" / "simulate.yaml").read_text())
    sim["scope"] = bed.scope
    sim_path = bed.workdir / "simulate.yaml"
    sim_path.write_text(yaml.safe_dump(sim))
    conf = bed.workdir / "gpukilld.conf"
    conf.write_text(f"[guard]\npolicy_dir = {bed.workdir / 'guard.d'}\nstate_dir = {bed.workdir / 'state'}\n")
    listener = NotifyListener(bed.workdir / "notify-pip.sock")
    argv = bed.in_journal_ns([str(venv / "bin" / "gpukilld"), "--simulate", str(sim_path), "--config", str(conf)])
    env = _clean_env(bed.env(NOTIFY_SOCKET=listener.path))
    proc = bed._spawn(argv, "gpukilld-pip.log", env=env, cwd="/")
    daemon = DaemonProcess(proc, listener, bed.workdir / "gpukilld-pip.log", sim_path)
    bed.daemon = daemon
    if listener.wait_for("READY=1", 20) is None:
        raise RuntimeError(f"the installed gpukilld did not become ready:\n{daemon.log()}")
    return daemon


def _packages(top: Path) -> set[str]:
    """The dotted names of our packages (folders with an __init__.py) under top."""
    return {
        ".".join(init.parent.relative_to(top).parts)
        for name in ("gpukill", "gpukilld", "gpukillctl")
        for init in (top / name).rglob("__init__.py")
    }


def test_a_pip_install_holds_every_package_of_the_checkout(venv):
    """pyproject lists packages by name: a package missing from the list is missing from every install."""
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import gpukilld; print(gpukilld.__file__)"],
        cwd="/",
        env=_clean_env(dict(os.environ)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert _packages(Path(r.stdout.strip()).parents[1]) == _packages(REPO)


def test_a_pip_install_places_the_notification_user_unit_and_autostart_entry(venv):
    """The data files land under the prefix, where systemd looks for user units ($XDG_DATA_DIRS/systemd/user),
    byte for byte as in the checkout."""
    for placed, source in (
        (
            venv / "share" / "systemd" / "user" / "gpukill-notify.service",
            REPO / "systemd" / "user" / "gpukill-notify.service",
        ),
        (
            venv / "share" / "gpukill" / "autostart" / "gpukill-notify.desktop",
            REPO / "packaging" / "xdg" / "gpukill-notify.desktop",
        ),
    ):
        assert placed.is_file(), f"{placed} was not installed"
        assert placed.read_bytes() == source.read_bytes()


def test_a_pip_installed_daemon_audits_structured_entries_to_the_journal(venv, fresh_bed, users):
    bed = fresh_bed
    site = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import gpukilld, sys; print(gpukilld.__file__)\n"
            "try:\n import systemd\nexcept ImportError:\n sys.exit(0)\nsys.exit(1)",
        ],
        cwd="/",
        env=_clean_env(dict(os.environ)),
        capture_output=True,
        text=True,
    )
    assert site.returncode == 0, "systemd-python must not be needed, nor installed, for the test to mean it"
    installed = Path(site.stdout.strip()).parent
    assert installed.is_relative_to(venv) and not installed.is_relative_to(REPO)

    daemon = _start_installed_daemon(bed, venv)
    victim = bed.victim(users["owner"], gpu=0, comm="pipvictim")
    listed = bed.wait_listed(victim.pid, comm="pipvictim")
    r = bed.manager(ROOT, "KillProcess", "uta{sv}", [victim.pid, listed["start_time"], {}])
    assert r.ok and r.body == ["terminated"], (r, daemon.log())

    [started] = bed.wait_journal(MESSAGE_ID=audit.DAEMON.message_id, GPUKILL_RESULT="started")
    [kill] = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(victim.pid))
    for entry, kind in ((started, audit.DAEMON), (kill, audit.KILL)):
        assert entry["_TRANSPORT"] == "journal", entry  # the native protocol, not a line on stderr
        assert entry["SYSLOG_IDENTIFIER"] == "gpukilld" and entry["PRIORITY"] == str(kind.priority)
        assert entry["GPUKILL_EVENT"] == kind.name
        assert Path(entry["CODE_FILE"]).is_relative_to(installed), entry["CODE_FILE"]  # the venv's code audits
    assert started["MESSAGE"].startswith("gpukilld 0.1.0 started")
    assert {
        k: kill.get(k)
        for k in (
            "GPUKILL_ACTION",
            "GPUKILL_RESULT",
            "GPUKILL_CALLER_UID",
            "GPUKILL_TARGET_UID",
            "GPUKILL_TARGET_COMM",
            "GPUKILL_DEVICE",
            "GPUKILL_FORCE",
        )
    } == {
        "GPUKILL_ACTION": "kill",
        "GPUKILL_RESULT": "terminated",
        "GPUKILL_CALLER_UID": "0",
        "GPUKILL_TARGET_UID": str(users["owner"].uid),
        "GPUKILL_TARGET_COMM": "pipvictim",
        "GPUKILL_DEVICE": listed["device_id"],
        "GPUKILL_FORCE": "0",
    }
    assert "terminated; GPU memory reclaimed" in kill["MESSAGE"] and "; requested by uid 0" in kill["MESSAGE"]
