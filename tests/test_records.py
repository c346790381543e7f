"""One declaration per record (gpukill/records/), and everything derived from it agrees: the daemon's
marshalling carries every field with its declared signature, the client's typed records read back what was
sent, the sandbox's JSON carries every field, the daemon's own types map to the records by name, and every
field is documented. A field added to a record and missed by any of them fails here. No root needed."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from dbus_fast import Variant
from helpers.testbed import REPO

from gpukill import errors
from gpukill.records.audit import Finding
from gpukill.records.base import from_plain, names, specs, to_plain
from gpukill.records.guard import (
    Decision,
    GuardStatus,
    ManagedPolicyEntry,
    PolicyLoaded,
    PostponeAnswer,
    ViolationDetails,
)
from gpukill.records.manager import Device, MemoryRegion, Process
from gpukill.records.status import ResetReply
from gpukillctl.client import exits
from gpukillctl.client.dbus import (
    DEVICE_KEYS,
    PROCESS_KEYS,
    ClientError,
    DaemonUnavailable,
    error_for,
    unwrap,
)
from gpukilld.bus.wire import to_dbus
from gpukilld.guard.sandbox import snapshot_from_json, snapshot_to_json
from gpukilld.model import ATTRIBUTED, DeviceReading, GpuProcess, ProcessUsage, Snapshot, numbered
from gpukilld.proc.procfs import ProcInfo
from gpukilld.sampling import sampler

SCALARS = {"u": 7, "t": 1 << 40, "d": 1.5, "b": True, "as": ("a", "b"), "au": (1, 2)}
# Every record a client meets, with the bus method whose comment in dbus/org.gpukill1.xml lists its keys.
DOCUMENTED_IN = {
    Device: "ListDevices",
    Process: "ListProcesses",
    ResetReply: "ResetDevice",
    GuardStatus: "GetStatus",
    Decision: "TestPolicies",
    ViolationDetails: "PolicyViolated",
    PolicyLoaded: "LoadPolicy",
    Finding: "AuditRogue",
    ManagedPolicyEntry: "ListPolicies",
    PostponeAnswer: "Postpone",
}


def full(cls: type, tag: str = "x") -> object:
    """A record with every field set to a value that is not left out and not its default."""
    values = {}
    for name, spec in specs(cls):
        if spec.of is not None:
            values[name] = tuple(
                dataclasses.replace(full(spec.of, f"{tag}{i}"), **({spec.key: f"{name}-{i}"} if spec.key else {}))
                for i in range(2)
            )
        elif spec.sig == "s":
            values[name] = f"{name}-{tag}"
        else:
            values[name] = SCALARS[spec.sig]
    return cls(**values)


def daemons(record: Process, system_unit: str) -> GpuProcess:
    """The daemon's process holding the record's values."""
    return GpuProcess(**{n: getattr(record, n) for n in names(Process)}, system_unit=system_unit)


def nested(cls: type) -> list[type]:
    """The record and the records inside it."""
    return [cls, *(t for _, spec in specs(cls) if spec.of for t in nested(spec.of))]


ALL_RECORDS = sorted({t for cls in DOCUMENTED_IN for t in nested(cls)}, key=lambda t: t.__name__)


@pytest.mark.parametrize("cls", ALL_RECORDS, ids=lambda c: c.__name__)
def test_marshalling_carries_every_field_with_its_signature(cls):
    record = full(cls)
    marshalled = to_dbus(record)
    assert list(marshalled) == list(names(cls))
    assert {k: v.signature for k, v in marshalled.items()} == {name: spec.sig for name, spec in specs(cls)}


@pytest.mark.parametrize("cls", ALL_RECORDS, ids=lambda c: c.__name__)
def test_the_client_reads_back_what_the_daemon_sent(cls):
    record = full(cls)
    assert from_plain(cls, unwrap(to_dbus(record))) == record
    # and the plain (JSON) form reads back the same
    assert from_plain(cls, json.loads(json.dumps(to_plain(record)))) == record


def test_left_out_values_come_back_as_defaults_and_json_nulls():
    device = Device(0, "GPU-0", "simulated", "nvidia", "H100", utilization=0.0, memory_used=0)
    sent = to_dbus(device)
    # Unknown is left out; a measured 0 is a value; an empty reason is left out.
    assert set(sent) == {"index", "id", "backend", "vendor", "name", "state", "utilization", "memory_used"}
    assert sent["utilization"] == Variant("d", 0.0) and sent["memory_used"] == Variant("t", 0)
    assert from_plain(Device, unwrap(sent)) == device
    plain = to_plain(from_plain(Device, unwrap(sent)))
    assert list(plain) == list(DEVICE_KEYS)
    assert plain["temperature"] is None and plain["state_reason"] is None and plain["utilization"] == 0.0

    proc = Process(
        pid=1,
        start_time=2,
        uid=3,
        user="u",
        comm="c",
        cmdline="c",
        device=0,
        device_id="GPU-0",
        memory_regions=(MemoryRegion("vram", 5, None),),
    )
    sent = to_dbus(proc)
    assert "shared_usage" not in sent and "exe" not in sent
    assert sent["memory_regions"] == Variant("a{sa{st}}", {"vram": {"total": 5}})
    plain = to_plain(from_plain(Process, unwrap(sent)))
    assert list(plain) == list(PROCESS_KEYS)
    assert plain["shared_usage"] is False and plain["exe"] is None  # a flag is false, unknown is null
    assert plain["memory_regions"] == {"vram": {"total": 5}}  # entries keep only what is known
    assert (
        to_plain(from_plain(Process, unwrap(to_dbus(dataclasses.replace(proc, memory_regions=())))))["memory_regions"]
        is None
    )


def test_unknown_keys_and_wrong_types_from_the_daemon_are_ignored():
    sent = {**to_dbus(full(Device)), "fan_speed": Variant("d", 30.0), "temperature": Variant("s", "hot")}
    device = from_plain(Device, unwrap(sent))
    assert device.temperature is None and not hasattr(device, "fan_speed")


def test_the_daemons_process_is_the_record_and_the_system_unit():
    # The record's fields, and two more that are not on the bus: marshalled and listed exactly as a Process.
    assert [f.name for f in dataclasses.fields(GpuProcess)] == [*names(Process), "system_unit", "job_from_environ"]
    assert names(GpuProcess) == names(Process)
    p = daemons(full(Process), system_unit="cron.service")
    assert to_dbus(p) == to_dbus(full(Process)) and to_plain(p) == to_plain(full(Process))
    # the cgroup's attribution lands in the process's fields of the same names
    assert set(ATTRIBUTED) <= {f.name for f in dataclasses.fields(GpuProcess)}


def test_the_sampler_joins_every_field_of_a_process():
    # What /proc and the backend say, and the device index: together exactly the daemon's process.
    joined = set(sampler._FROM_HOST) | set(ATTRIBUTED) | set(sampler._FROM_BACKEND) | {"device"}
    assert joined == {f.name for f in dataclasses.fields(GpuProcess)}
    assert {f.name for f in dataclasses.fields(ProcInfo)} - {"attribution"} <= joined
    assert {f.name for f in dataclasses.fields(ProcessUsage)} <= joined


def test_a_reading_becomes_a_device_with_every_value():
    device = full(Device)
    reading = DeviceReading(**{n: getattr(device, n) for n in names(Device) if n not in ("index", "backend")})
    assert numbered(reading, device.index, device.backend) == device


def test_the_sandbox_carries_every_field():
    process = dataclasses.replace(daemons(full(Process), system_unit="cron.service"), job_from_environ=True)
    snapshot = Snapshot(
        generation=0,
        taken_at=0.0,
        devices=(full(Device),),
        processes=(process,),
        backends=(),
        findings=(full(Finding),),
    )
    assert snapshot_from_json(json.loads(json.dumps(snapshot_to_json(snapshot)))) == snapshot


def _xml_doc(method: str) -> str:
    """The comment just before the method or signal in the interface XML."""
    xml = (REPO / "dbus" / "org.gpukill1.xml").read_text()
    at = re.search(rf'<(method|signal) name="{method}"', xml)
    assert at, method
    return xml[xml.rindex("<!--", 0, at.start()) : at.start()]


def _mentions(text: str, key: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", text) is not None


@pytest.mark.parametrize("cls", list(DOCUMENTED_IN), ids=lambda c: c.__name__)
def test_every_field_is_documented_in_the_interface(cls):
    doc = _xml_doc(DOCUMENTED_IN[cls])
    missing = [
        f"{t.__name__}.{name}"
        for t in nested(cls)
        for name, spec in specs(t)
        if name != spec.key and not _mentions(doc, name)
    ]
    # keys of keyed maps are the map's keys, not fields: memory_regions' region names, notifications' channels
    missing = [m for m in missing if m not in ("MemoryRegion.name", "NotificationCounters.channel")]
    assert not missing, f"not in the documentation of {DOCUMENTED_IN[cls]}: {missing}"


def test_every_listed_key_is_documented_in_the_readme_json_section():
    readme = (REPO / "docs" / "using.md").read_text()
    section = readme[readme.index("## JSON (`gpukillctl list --json`)") :]
    section = section[: section.index("\n## ")]
    missing = [key for key in DEVICE_KEYS + PROCESS_KEYS if f"`{key}`" not in section]
    assert not missing, missing


def test_each_daemon_error_is_a_typed_client_error():
    shared = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.GpukillError)]
    assert errors.NoSuchProcess in shared and errors.InvalidPolicy in shared
    for cls in shared:
        e = error_for(cls.dbus_name, "why")
        assert isinstance(e, ClientError) and isinstance(e, cls), cls
        assert e.name == cls.dbus_name and str(e) == "why"
    denied = error_for("org.freedesktop.DBus.Error.InteractiveAuthorizationRequired", "password needed")
    assert isinstance(denied, errors.AccessDenied)
    unknown = error_for("org.example.Error.New", "new")
    assert type(unknown) is ClientError and unknown.name == "org.example.Error.New"
    assert isinstance(error_for("org.freedesktop.DBus.Error.ServiceUnknown", ""), DaemonUnavailable)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.NoSuchProcess, exits.EXIT_NOT_FOUND),
        (errors.InvalidPolicy, exits.EXIT_INVALID_POLICY),
        (errors.AccessDenied, exits.EXIT_DENIED),
        (errors.TooBusy, exits.EXIT_BUSY_TRY_AGAIN),
        (errors.InvalidArgs, exits.EXIT_USAGE),
        (errors.GpukillError, exits.EXIT_FAILURE),
    ],
)
def test_exit_codes_follow_the_error_class(error, code):
    assert exits.exit_code(error_for(error.dbus_name, "")) == code


def test_a_missing_daemon_exits_unavailable():
    e = error_for("org.freedesktop.DBus.Error.NameHasNoOwner", "")
    assert exits.exit_code(e) == exits.EXIT_UNAVAILABLE
