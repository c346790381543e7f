"""`make test-package`: the .rpm spec's packages hold what the .debs hold (the same programs, private tree,
units, accounts, bus and polkit files, split the same way into gpukill, gpukill-serve and gpukill-exporter), so
that the spec, which no test installs, cannot drift from debian/rules, which the booted test installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DIST = Path(__file__).resolve().parents[2] / "dist"
PACKAGES = ("gpukill", "gpukill-serve", "gpukill-exporter")
# what both must carry in the same place (the rest, docs, completions and the like, follows each distribution's
# layout); /lib/systemd is the .deb's (bookworm), /usr/lib/systemd the rpm's
COMPARED = (
    "usr/lib/gpukill/",
    "usr/lib/systemd/",
    "usr/lib/sysusers.d/",
    "usr/bin/",
    "usr/sbin/",
    "usr/share/dbus-1/",
    "usr/share/polkit-1/",
    "etc/gpukill/",
)


def _one(pattern: str) -> Path:
    found = sorted(DIST.glob(pattern))
    if not found:
        pytest.skip(f"no {pattern} in dist/ (make deb rpm)")
    return found[-1]


def _compared(paths: list[str]) -> set[str]:
    normal = {p.lstrip("./").removeprefix("/") for p in paths}
    normal = {("usr/" + p) if p.startswith("lib/systemd/") else p for p in normal}
    return {p for p in normal if p.startswith(COMPARED) and p not in {c.rstrip("/") for c in COMPARED}}


@pytest.mark.skipif(not shutil.which("rpm") or not shutil.which("dpkg-deb"), reason="needs rpm and dpkg-deb")
@pytest.mark.parametrize("package", PACKAGES)
def test_the_rpm_holds_what_the_deb_holds(package):
    arch = "all" if package == "gpukill-exporter" else "amd64"
    deb = _one(f"{package}_*_{arch}.deb")
    rpm = _one(f"{package}-[0-9]*.rpm")
    deb_files = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    listed = subprocess.run(["tar", "-t"], input=deb_files, capture_output=True, check=True).stdout.decode()
    from_deb = _compared([p for p in listed.splitlines() if not p.endswith("/")])
    rpm_files = subprocess.run(["rpm", "-qlp", "--noartifact", str(rpm)], capture_output=True, text=True, check=True)
    dirs = subprocess.run(
        ["rpm", "-qp", "--qf", "[%{FILEMODES:perms} %{FILENAMES}\n]", str(rpm)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    directories = {line.split(" ", 1)[1] for line in dirs.splitlines() if line.startswith("d")}
    from_rpm = _compared([p for p in rpm_files.stdout.splitlines() if p not in directories])
    assert from_deb, deb
    assert from_rpm == from_deb, {
        "only in the .deb": sorted(from_deb - from_rpm)[:20],
        "only in the .rpm": sorted(from_rpm - from_deb)[:20],
    }
