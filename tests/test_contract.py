"""The API contract and the shipped system files: introspection equals dbus/org.gpukill1.xml, the bouncer maps
every method, and the systemd, journal, polkit and bus files are accepted by the real tools."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from helpers.marks import needs_root
from helpers.testbed import REPO, ROOT

from gpukilld import journal as audit
from gpukilld.access.bouncer import METHOD_ACTIONS, READ_ONLY

XML = REPO / "dbus" / "org.gpukill1.xml"


def interface_shape(root: ET.Element, name: str) -> dict:
    """Methods, signals and properties with every argument's name, type and direction; docs ignored."""
    iface = next(i for i in root.iter("interface") if i.get("name") == name)
    shape: dict = {"method": {}, "signal": {}, "property": {}}
    for el in iface:
        if el.tag in ("method", "signal"):
            shape[el.tag][el.get("name")] = [
                (a.get("name"), a.get("type"), a.get("direction") or ("out" if el.tag == "signal" else "in"))
                for a in el.findall("arg")
            ]
        elif el.tag == "property":
            shape["property"][el.get("name")] = (el.get("type"), el.get("access"))
    return shape


@needs_root
def test_live_introspection_equals_the_xml(bed, users):
    r = bed.call_as(
        users["other"], "org.gpukill1", "/org/gpukill1", "org.freedesktop.DBus.Introspectable", "Introspect"
    )
    assert r.ok, r
    live = ET.fromstring(r.body[0])
    contract = ET.parse(XML).getroot()
    for name in ("org.gpukill1.Manager", "org.gpukill1.Guard"):
        assert interface_shape(live, name) == interface_shape(contract, name), name
    ours = {i.get("name") for i in live.iter("interface") if i.get("name").startswith("org.gpukill1")}
    assert ours == {i.get("name") for i in contract.iter("interface")}


def test_every_method_in_the_contract_is_mapped_by_the_bouncer():
    contract = ET.parse(XML).getroot()
    methods = {(i.get("name"), m.get("name")) for i in contract.iter("interface") for m in i.findall("method")}
    assert methods == set(METHOD_ACTIONS)
    policy = ET.parse(REPO / "polkit" / "org.gpukill.policy").getroot()
    actions = {a.get("id") for a in policy.iter("action")}
    assert {a for a in METHOD_ACTIONS.values() if a != READ_ONLY} <= actions


def test_polkit_defaults_are_as_specified():
    policy = ET.parse(REPO / "polkit" / "org.gpukill.policy").getroot()
    defaults = {a.get("id"): a.find("defaults/allow_any").text for a in policy.iter("action")}
    assert defaults == {
        "org.gpukill.kill-own-process": "yes",
        "org.gpukill.kill-any-process": "auth_admin_keep",
        "org.gpukill.reset-device": "auth_admin",
        "org.gpukill.manage-guard": "auth_admin_keep",
        "org.gpukill.manage-policies": "no",  # auth_admin_keep for an active session only
        "org.gpukill.configure-audit": "no",  # auth_admin_keep for an active session only
        "org.gpukill.view-all-processes": "no",
        "org.gpukill.postpone-own": "yes",
        "org.gpukill.postpone-any": "auth_admin_keep",
        "org.gpukill.suspend-own-process": "yes",  # as kill-own: a suspend is gentler than the kill one may do
        "org.gpukill.suspend-any-process": "auth_admin_keep",
        "org.gpukill.resume-own-process": "yes",
        "org.gpukill.resume-any-process": "auth_admin_keep",
    }


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    gpukilld = shutil.which("gpukilld") or str(REPO / ".venv" / "bin" / "gpukilld")
    unit = tmp_path / "gpukilld.service"
    unit.write_text((REPO / "systemd" / "gpukilld.service").read_text().replace("/usr/sbin/gpukilld", gpukilld))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    text = unit.read_text()
    for needed in ("Type=notify", "BusName=org.gpukill1", "WatchdogSec=", "ExecReload=", "CapabilityBoundingSet="):
        assert needed in text


@pytest.mark.skipif(shutil.which("journalctl") is None, reason="journalctl not installed")
def test_catalog_documents_every_message_id(tmp_path):
    catalog_dir = tmp_path / "usr" / "lib" / "systemd" / "catalog"
    catalog_dir.mkdir(parents=True)
    shutil.copy(REPO / "systemd" / "gpukill.catalog", catalog_dir)
    subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"], check=True)
    listed = subprocess.run(
        ["journalctl", f"--root={tmp_path}", "--list-catalog"], capture_output=True, text=True, check=True
    ).stdout
    ids = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert ids == {k.message_id for k in audit.ALL_KINDS}


@needs_root
def test_daemon_start_is_audited_with_its_message_id(bed, users):
    entries = bed.wait_journal(MESSAGE_ID=audit.DAEMON.message_id)
    assert entries and entries[0]["GPUKILL_RESULT"] == "started"
    assert entries[0]["SYSLOG_IDENTIFIER"] == "gpukilld" and entries[0]["PRIORITY"] == "6"


def test_bus_policy_lets_only_root_own_the_name():
    conf = ET.parse(REPO / "dbus" / "org.gpukill1.conf").getroot()
    owners = [
        (p.get("user") or p.get("context"), a.get("own"))
        for p in conf.iter("policy")
        for a in p.findall("allow")
        if a.get("own")
    ]
    assert owners == [("root", "org.gpukill1")]
    activation = (REPO / "dbus" / "org.gpukill1.service").read_text()
    assert "SystemdService=gpukilld.service" in activation and "Name=org.gpukill1" in activation


@needs_root
def test_bus_policy_is_enforced(bed, users):
    """An unprivileged connection cannot take the name: the bus itself refuses, before gpukilld sees it."""
    r = bed.call_as(
        users["other"],
        "org.freedesktop.DBus",
        "/org/freedesktop/DBus",
        "org.freedesktop.DBus",
        "RequestName",
        "su",
        ["org.gpukill1", 4],
    )
    assert r.error == "org.freedesktop.DBus.Error.AccessDenied", r
    r = bed.call_as(
        ROOT,
        "org.freedesktop.DBus",
        "/org/freedesktop/DBus",
        "org.freedesktop.DBus",
        "GetNameOwner",
        "s",
        ["org.gpukill1"],
    )
    assert r.ok
