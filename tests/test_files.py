"""replace_file (gpukilld/files.py), the one atomic write of the daemon's files: Guard's state, the usage
totals, the audit's settings and guard.d's managed policies."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpukilld import files
from gpukilld.guard import managed


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("umask, mode", [(0o077, 0o644), (0o000, 0o600), (0o277, 0o644)])
def test_the_mode_is_the_callers_whatever_the_umask(tmp_path: Path, umask: int, mode: int):
    path = tmp_path / "kept"
    old = os.umask(umask)
    try:
        files.replace_file(str(path), "text\n", mode)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"text\n"
    assert _mode(path) == mode


def test_bytes_and_text_are_written_alike(tmp_path: Path):
    path = tmp_path / "kept"
    files.replace_file(str(path), "caf\u00e9", sync_dir=False)
    assert path.read_bytes() == "caf\u00e9".encode()
    files.replace_file(str(path), b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    assert os.listdir(tmp_path) == ["kept"]


def test_a_link_in_the_way_is_replaced_never_followed(tmp_path: Path):
    target = tmp_path / "target"
    target.write_text("untouched")
    path = tmp_path / "kept"
    path.symlink_to(target)
    files.replace_file(str(path), "new")
    assert not path.is_symlink() and path.read_text() == "new"
    assert target.read_text() == "untouched"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "kept"
    path.write_text("old")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        files.replace_file(str(path), "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["kept"]


def test_managed_policies_are_written_by_replace_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """guard.d's files go through the one atomic write (readable by all), the directory synced once."""
    written, synced = [], []
    monkeypatch.setattr(managed, "replace_file", lambda path, data, mode, **kw: written.append((path, mode, kw)))
    monkeypatch.setattr(managed, "fsync_dir", lambda d: synced.append(d))

    class Runner:
        policy_dir = str(tmp_path)

    policies = managed.ManagedPolicies(Runner(), None)  # type: ignore[arg-type]
    policies._write({"50-user-alice.yaml": "rules: []\n", "50-user-bob.yaml": "rules: []\n"})
    assert [(os.path.basename(p), mode, kw) for p, mode, kw in written] == [
        ("50-user-alice.yaml", managed.FILE_MODE, {"sync_dir": False}),
        ("50-user-bob.yaml", managed.FILE_MODE, {"sync_dir": False}),
    ]
    assert synced == [str(tmp_path)]
