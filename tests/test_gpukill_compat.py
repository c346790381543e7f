"""`gpukill`, gpu-kill's command line: every flag combination makes the calls gpukillctl makes, and input whose
meaning is not certain is refused in one line that names what to run instead.

The translation runs against a recording client (fast, no daemon); a few combinations run end to end on the
test bed, as other users, against the real daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from unittest.mock import call

import pytest
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, ROOT

from gpukill import errors, rules
from gpukill.condition_types import CONDITION_TYPES
from gpukill.outcome import Outcome
from gpukill.records.audit import AuditSettings
from gpukill.records.guard import GuardStatus, ManagedPolicyEntry, PolicyLoaded
from gpukill.records.manager import Device, Process
from gpukill.records.reclaim import KillReport, Reclaim
from gpukill.records.status import ResetReply
from gpukill.records.usage import UsageReport, UsageRow
from gpukill.units import parse_size
from gpukillctl.cli import compat
from gpukillctl.cli import main as cli
from gpukillctl.client.dbus import ERRORS, DaemonUnavailable, unwrap

POLICY = REPO / "examples" / "guard.yaml"
POLICY_PATH = os.path.abspath(POLICY)
# gpu-kill's own files, as its --guard-export-config and --rogue-export-config write them (serde_json of
# GuardModeConfig, src/guard_mode.rs, and RogueConfig::default(), src/rogue_config.rs) and as it keeps them on
# disk (the same structs in TOML), and what gpukill imports of them.
GPU_KILL_FILES = REPO / "tests" / "data" / "gpu-kill"
GUARD_JSON, GUARD_TOML = GPU_KILL_FILES / "guard_config.json", GPU_KILL_FILES / "guard_mode_config.toml"
ROGUE_JSON, ROGUE_TOML = GPU_KILL_FILES / "rogue_config.json", GPU_KILL_FILES / "rogue_config.toml"
GUARD_IMPORTED = """# gpukill managed Guard policies (gpukillctl guard policy export)
policies:
  - kind: gpu
    target: '0'
    memory_limit: 24GiB
    utilization_limit: 90.0
    allowed_users: ['alice', 'bob']
    reserved_memory: 2GiB
    grace: 300.0
  - kind: group
    target: 'ml'
    memory_limit: 32GiB
    utilization_limit: 80.0
    process_limit: 10
    grace: 300.0
  - kind: user
    target: 'alice'
    memory_limit: 8GiB
    utilization_limit: 70.5
    process_limit: 3
    grace: 300.0
"""
ROGUE_IMPORTED = "[audit]\nmin_score = 70.0\nallowed_users = root admin system\n"

DEVICES = [
    Device(index=0, id="GPU-0", backend="simulated", vendor="nvidia", name="H100"),
    Device(index=1, id="GPU-1", backend="simulated", vendor="amd", name="MI210"),
]


def proc(pid: int, start_time: int, comm: str, device: int = 0) -> Process:
    return Process(
        pid=pid,
        start_time=start_time,
        uid=1000,
        user="alice",
        comm=comm,
        cmdline=comm,
        device=device,
        device_id=f"GPU-{device}",
    )


# 4242 uses both GPUs: listed twice, killed once.
PROCESSES = [proc(4242, 777, "python3"), proc(4242, 777, "python3", device=1), proc(4343, 888, "pytorch")]


EXPORTED_POLICIES = "policies:\n- kind: user\n  target: alice\n  memory_limit: 8589934592\n"
EXPORTED_SETTINGS = "[audit]\nmin_score = 50\n"
GIB = 1 << 30


def daemon_error(shared: type[errors.GpukillError], text: str) -> Exception:
    return ERRORS[shared.dbus_name](shared.dbus_name, text)


class RecordingClient:
    """GpukillClient's methods, recorded as mock calls (the polkit `interactive` flag left out: it depends on the
    terminal). `failures` maps a method name to the exceptions its next calls raise, in turn."""

    unique_name = ":1.42"

    def __init__(self, processes: list[Process] = PROCESSES, failures: dict | None = None) -> None:
        self.calls: list = []
        self.processes = processes
        self.failures = {name: list(excs) for name, excs in (failures or {}).items()}
        self.settings = AuditSettings(allowed_users=("carol",), allowed_processes=("/opt/sim/bin/sim",))
        self.dry_run = False

    def _record(self, name: str, *args, **kw) -> None:
        self.calls.append(getattr(call, name)(*args, **kw))
        if self.failures.get(name):
            exc = self.failures[name].pop(0)
            if exc is not None:
                raise exc

    async def list_devices(self):
        self._record("list_devices")
        return DEVICES

    async def list_processes(self, filter=None):
        self._record("list_processes", unwrap(filter or {}))
        return self.processes

    async def list_suspended(self):
        return []  # `list` shows what gpukilld holds suspended too; gpu-kill's flags translate to nothing of it

    async def suspended(self):
        return await self.list_suspended()

    async def kill(self, pid, start_time, *, force=False, grace=None, interactive=False):
        self._record("kill", pid, start_time, force=force, grace=grace)
        return Outcome.TERMINATED

    async def kill_report(self, pid, start_time, *, force=False, grace=None, interactive=False, checkpoint=False):
        # gpukillctl kill's call (KillProcessReport): the same kill, recorded as one, with the GPU's answer
        self._record("kill", pid, start_time, force=force, grace=grace)
        return KillReport(Outcome.TERMINATED, Reclaim("reclaimed", reclaimed=GIB))

    async def reset(self, device, *, force=False, interactive=False):
        self._record("reset", device, force=force)
        index = next(d.index for d in DEVICES if device in (str(d.index), d.id))
        return ResetReply(device=index, device_id=f"GPU-{index}", message="reset")

    async def guard_status(self):
        self._record("guard_status")
        return GuardStatus(enabled=True, dry_run=self.dry_run, policy_dry_run=False, source="guard.d")

    async def guard_enable(self, enabled=True, *, interactive=False):
        self._record("guard_enable", enabled)

    async def guard_set_dry_run(self, dry_run, *, interactive=False):
        self._record("guard_set_dry_run", dry_run)

    async def guard_load_policy(self, name, text, *, interactive=False):
        self._record("guard_load_policy", name, text)
        return PolicyLoaded(source="loaded", rules=("r",))

    async def guard_test(self, name="", text=""):
        self._record("guard_test", name, text)
        return []

    async def audit_rogue(self, thresholds=None):
        if thresholds is None:
            self._record("audit_rogue")
        else:
            self._record("audit_rogue", thresholds)
        return []

    # the managed policies (contract §1) and the audit's settings (§2), as the client API names them

    async def guard_set_policy(self, kind, target, settings, *, interactive=False):
        self._record("guard_set_policy", kind, target, settings)
        # sizes go as typed; the daemon answers bytes
        return ManagedPolicyEntry(
            kind=kind,
            target=target,
            file=f"/etc/gpukill/guard.d/60-managed-{kind}-{target}.yaml",
            **{
                k: tuple(v) if isinstance(v, list) else parse_size(v) if isinstance(v, str) else v
                for k, v in settings.items()
            },
        )

    async def guard_remove_policy(self, kind, target, *, interactive=False):
        self._record("guard_remove_policy", kind, target)

    async def guard_list_policies(self):
        self._record("guard_list_policies")
        return []

    async def guard_export_policies(self):
        self._record("guard_export_policies")
        return EXPORTED_POLICIES

    async def guard_import_policies(self, name, text, *, replace=False, interactive=False):
        self._record("guard_import_policies", name, text, replace=replace)
        return [ManagedPolicyEntry(kind="user", target="alice", file="f", memory_limit=8 << 30)]

    async def audit_settings(self):
        self._record("audit_settings")
        return self.settings

    async def set_audit_settings(self, changes, *, interactive=False):
        self._record("set_audit_settings", changes)
        return self.settings

    async def export_audit_settings(self):
        self._record("export_audit_settings")
        return EXPORTED_SETTINGS

    async def import_audit_settings(self, name, text, *, interactive=False):
        self._record("import_audit_settings", name, text)
        return self.settings

    async def usage(self, query=None):
        """GetUsage: recorded with since as hours before now (the instant moves; the range asked does not)."""
        query = dict(query or {})
        if "since" in query:
            query["since"] = f"{(time.time() - query['since']) / 3600:.1f}h ago"
        self._record("usage", query)
        now = time.time()
        by = query.get("by", "user")
        row = UsageRow(
            key="alice" if by == "user" else "4343:888",
            uid=1000,
            user="alice",
            processes=1,
            gpu_seconds=3600.0,
            memory_byte_seconds=float(1 << 30) * 3600,
        )
        return UsageReport(since=now - 86400, until=now, by=by, rows=(row,), rows_total=1)


def run(argv: list[str], client: RecordingClient | None = None) -> tuple[int, RecordingClient]:
    client = client or RecordingClient()
    return asyncio.run(compat.plan(argv).run(client)), client


async def watch_until(plan: compat.Plan, client: RecordingClient, enough) -> None:
    """An endless plan (--watch) run until enough(client.calls), then interrupted: stopped by what it did, not
    after a time, so a loaded machine's slower refreshes are waited for (30 s at most). It must not end."""
    run = asyncio.ensure_future(plan.run(client))
    deadline = time.monotonic() + 30
    try:
        while not enough(client.calls):
            assert not run.done(), f"--watch ended after {client.calls}"
            assert time.monotonic() < deadline, f"--watch made only {client.calls} in 30 s"
            await asyncio.sleep(0.01)
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run


LISTING = [call.list_devices(), call.list_processes({})]
BY_REGEX = call.list_processes({"name_regex": "^py"})
ON_GPU_1 = call.list_processes({"device": "1"})


# (gpukill arguments, the client calls gpukillctl makes for the same request)
MAPPINGS = [
    (["--list"], LISTING),
    (["--list", "--details"], LISTING),
    (["--list", "--output", "json"], LISTING),
    (["--list", "--output=table", "--details"], LISTING),
    (["--kill", "--pid", "4343"], [call.list_processes({}), call.kill(4343, 888, force=False, grace=None)]),
    (["--kill", "--pid", "4343", "--force"], [call.list_processes({}), call.kill(4343, 888, force=True, grace=None)]),
    (
        ["--kill", "--pid", "4343", "--force", "--timeout-secs", "2.5"],
        [call.list_processes({}), call.kill(4343, 888, force=True, grace=2.5)],
    ),
    (
        ["--kill", "--filter", "^py", "--batch"],
        [BY_REGEX, call.kill(4242, 777, force=False, grace=None), call.kill(4343, 888, force=False, grace=None)],
    ),
    (
        ["--kill", "--filter", "^py", "--batch", "--force", "--timeout-secs", "1"],
        [BY_REGEX, call.kill(4242, 777, force=True, grace=1.0), call.kill(4343, 888, force=True, grace=1.0)],
    ),
    (["--kill", "--filter", "^py"], [call.list_devices(), BY_REGEX]),  # gpu-kill's preview: lists, kills nothing
    (["--kill", "--filter", "^py", "--dry-run"], [call.list_devices(), BY_REGEX]),
    # --dry-run/--safe: the kill's own listing, and no Kill call
    (["--kill", "--pid", "4343", "--dry-run"], [call.list_processes({})]),
    (["--kill", "--pid", "4343", "--safe", "--force"], [call.list_processes({})]),
    (["--kill", "--filter", "^py", "--batch", "--dry-run"], [BY_REGEX]),
    (["--kill", "--gpu", "1", "--batch", "--safe"], [ON_GPU_1]),
    # --kill --gpu: alone a preview, with --batch each process on it by the PID and start time listed
    (["--kill", "--gpu", "1"], [call.list_devices(), ON_GPU_1]),
    (
        ["--kill", "--gpu", "1", "--batch"],
        [ON_GPU_1, call.kill(4242, 777, force=False, grace=None), call.kill(4343, 888, force=False, grace=None)],
    ),
    (
        ["--kill", "--gpu", "1", "--batch", "--force", "--timeout-secs", "2"],
        [ON_GPU_1, call.kill(4242, 777, force=True, grace=2.0), call.kill(4343, 888, force=True, grace=2.0)],
    ),
    (
        ["--kill", "--gpu", "GPU-1", "--filter", "^py", "--batch"],
        [
            call.list_processes({"name_regex": "^py", "device": "GPU-1"}),
            call.kill(4242, 777, force=False, grace=None),
            call.kill(4343, 888, force=False, grace=None),
        ],
    ),
    (["--audit", "--rogue"], [call.audit_rogue()]),
    (["--audit", "--rogue", "--output", "json"], [call.audit_rogue()]),
    (["--reset", "--gpu", "1"], [call.reset("1", force=False)]),
    (["--reset", "--gpu", "1", "--force"], [call.reset("1", force=True)]),
    (["--reset", "--gpu", "GPU-1"], [call.reset("GPU-1", force=False)]),
    (["--reset", "--all"], [call.list_devices(), call.reset("0", force=False), call.reset("1", force=False)]),
    (["--reset", "--all", "--force"], [call.list_devices(), call.reset("0", force=True), call.reset("1", force=True)]),
    (["--guard"], [call.guard_status()]),
    (["--guard", "--guard-config"], [call.guard_status()]),
    (["--guard", "--output", "json"], [call.guard_status()]),
    # after each change the status: whether the state could be saved (and what holds dry run on)
    (["--guard", "--guard-enable"], [call.guard_enable(True), call.guard_status()]),
    (["--guard", "--guard-disable"], [call.guard_enable(False), call.guard_status()]),
    (["--guard", "--guard-dry-run"], [call.guard_set_dry_run(True), call.guard_status()]),
    (["--guard", "--guard-enforce"], [call.guard_set_dry_run(False), call.guard_status()]),  # does a policy hold it
    (["--guard", "--guard-test-policies"], [call.guard_test("", "")]),
    (["--guard", "--guard-test-policies", "--output", "json"], [call.guard_test("", "")]),
    (
        ["--guard", "--guard-test-policies", "--policy-file", str(POLICY)],
        [call.guard_test(POLICY_PATH, POLICY.read_text())],
    ),
    (
        ["--guard", "--policy-file", str(POLICY)],
        [call.guard_load_policy(POLICY_PATH, POLICY.read_text()), call.guard_status()],
    ),
    # --vendor: only that vendor's GPUs and their processes; --containers: the column gpukillctl list always has
    (["--list", "--vendor", "amd"], LISTING),
    (["--list", "--vendor", "all", "--output", "json"], LISTING),
    (["--list", "--containers", "--details"], LISTING),
    # gpu-kill's cheat-sheet shorthands
    (["4343"], [call.list_processes({}), call.kill(4343, 888, force=False, grace=None)]),
    (["4343", "--safe"], [call.list_processes({})]),
    (["--reset", "1"], [call.reset("1", force=False)]),
    # user, group and GPU policies: the limits given in GB (GiB), gpu-kill's defaults for the others
    (
        [
            "--guard",
            "--guard-add-user",
            "developer",
            "--guard-memory-limit",
            "8.0",
            "--guard-utilization-limit",
            "70.0",
            "--guard-process-limit",
            "3",
        ],
        [
            call.guard_set_policy(
                "user", "developer", {"memory_limit": "8GiB", "utilization_limit": 70.0, "process_limit": 3}
            )
        ],
    ),
    (
        ["--guard", "--guard-add-user", "bob", "--guard-memory-limit", "1.5"],
        [call.guard_set_policy("user", "bob", {"memory_limit": "1.5GiB"})],
    ),
    (["--guard", "--guard-remove-user", "developer"], [call.guard_remove_policy("user", "developer")]),
    (
        ["--guard", "--guard-add-group", "testers", "--guard-group-memory-limit", "16.0"],
        [call.guard_set_policy("group", "testers", {"memory_limit": "16GiB"})],
    ),
    (
        [
            "--guard",
            "--guard-add-group",
            "ml",
            "--guard-group-utilization-limit",
            "50",
            "--guard-group-process-limit",
            "15",
        ],
        [call.guard_set_policy("group", "ml", {"utilization_limit": 50.0, "process_limit": 15})],
    ),
    (["--guard", "--guard-remove-group", "developers"], [call.guard_remove_policy("group", "developers")]),
    (
        [
            "--guard",
            "--guard-add-gpu",
            "0",
            "--guard-gpu-allowed-users",
            "alice, bob,",
            "--guard-gpu-memory-limit",
            "24.0",
            "--guard-gpu-utilization-limit",
            "90.0",
            "--guard-gpu-reserved-memory",
            "2.0",
        ],
        [
            call.guard_set_policy(
                "gpu",
                "0",
                {
                    "memory_limit": "24GiB",
                    "utilization_limit": 90.0,
                    "reserved_memory": "2GiB",
                    "allowed_users": ("alice", "bob"),
                },
            )
        ],
    ),
    (
        ["--guard", "--guard-add-gpu", "1", "--guard-gpu-memory-limit", "16.0"],
        [call.guard_set_policy("gpu", "1", {"memory_limit": "16GiB"})],
    ),
    (["--guard", "--guard-remove-gpu", "0"], [call.guard_remove_policy("gpu", "0")]),
    (["--guard", "--guard-export-config"], [call.guard_export_policies()]),
    (
        ["--guard", "--guard-import-config", str(GUARD_JSON)],
        [call.guard_import_policies(str(GUARD_JSON), GUARD_IMPORTED, replace=True)],
    ),
    (["--guard", "--guard-toggle-dry-run"], [call.guard_status(), call.guard_set_dry_run(True), call.guard_status()]),
    # the audit's settings
    (["--audit", "--rogue-config"], [call.audit_settings()]),
    (["--audit", "--rogue-config", "--output", "json"], [call.audit_settings()]),
    (["--audit", "--rogue-confidence-threshold", "0.5"], [call.set_audit_settings({"min_score": 50.0})]),
    (["--audit", "--rogue", "--rogue-confidence-threshold", "0.9"], [call.audit_rogue({"min_score": 90.0})]),
    (
        ["--audit", "--rogue-whitelist-user", "developer"],
        [call.audit_settings(), call.set_audit_settings({"allowed_users": ["carol", "developer"]})],
    ),
    (
        ["--audit", "--rogue-unwhitelist-user", "carol"],
        [call.audit_settings(), call.set_audit_settings({"allowed_users": []})],
    ),
    (
        ["--audit", "--rogue-whitelist-process", "/usr/bin/my-app", "--rogue-confidence-threshold", "0.7"],
        [
            call.set_audit_settings({"min_score": 70.0}),
            call.audit_settings(),
            call.set_audit_settings({"allowed_processes": ["/opt/sim/bin/sim", "/usr/bin/my-app"]}),
        ],
    ),
    (
        ["--audit", "--rogue-unwhitelist-process", "/opt/sim/bin/sim"],
        [call.audit_settings(), call.set_audit_settings({"allowed_processes": []})],
    ),
    (["--audit", "--rogue-export-config"], [call.export_audit_settings()]),
    (
        ["--audit", "--rogue-import-config", str(ROGUE_JSON)],
        [call.import_audit_settings(str(ROGUE_JSON), ROGUE_IMPORTED)],
    ),
    # gpu-kill's usage audit: gpukillctl usage (its records per process; the summary's top users and processes)
    (["--audit"], [call.usage({"by": "process"})]),
    (["--audit", "--output", "json"], [call.usage({"by": "process"})]),
    (["--audit", "--audit-hours", "6"], [call.usage({"by": "process", "since": "6.0h ago"})]),
    (["--audit", "--audit-user", "john"], [call.usage({"by": "process", "user": "john"})]),
    (
        ["--audit", "--audit-process", "tensorflow", "--audit-hours", "1.5"],
        [call.usage({"by": "process", "name": "tensorflow", "since": "1.5h ago"})],
    ),
    (["--audit", "--audit-summary"], [call.usage({"by": "user"}), call.usage({"by": "process"})]),
    (
        ["--audit", "--audit-summary", "--audit-user", "alice", "--audit-hours", "168"],
        [
            call.usage({"by": "user", "user": "alice", "since": "168.0h ago"}),
            call.usage({"by": "process", "user": "alice", "since": "168.0h ago"}),
        ],
    ),
]


@pytest.mark.parametrize("argv,calls", MAPPINGS, ids=[" ".join(a) for a, _ in MAPPINGS])
def test_each_combination_makes_gpukillctls_calls(argv, calls, capsys):
    code, client = run(argv)
    assert code == 0, capsys.readouterr()
    assert client.calls == calls


def test_output_is_gpukillctls(capsys):
    """Same client, same records: gpukill's output is gpukillctl's, JSON included."""
    for gpukill_argv, gpukillctl_argv in [
        (["--list", "--output", "json"], ["list", "--json"]),
        (["--list"], ["list"]),
        (["--guard", "--output", "json"], ["guard", "status", "--json"]),
        (["--kill", "--pid", "4343"], ["kill", "4343"]),
        (["--reset", "--gpu", "1", "--force"], ["reset", "1", "--force"]),
    ]:
        run(gpukill_argv)
        ours = capsys.readouterr()
        args = cli.build_parser().parse_args(gpukillctl_argv)
        asyncio.run(cli.COMMANDS[args.command](RecordingClient(), args))
        assert ours == capsys.readouterr(), gpukill_argv
    run(["--list", "--output", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == cli.JSON_FORMAT and [p["pid"] for p in doc["processes"]] == [4242, 4242, 4343]


def test_filter_without_batch_kills_nothing_and_says_so(capsys):
    code, client = run(["--kill", "--filter", "^py"])
    assert code == 0 and not [c for c in client.calls if c[0] == "kill"]
    assert "nothing was killed: add --batch" in capsys.readouterr().err


def test_batch_tries_every_match_and_exits_with_the_first_failure(capsys):
    denied = daemon_error(errors.AccessDenied, "not authorized to kill PID 4242")
    code, client = run(["--kill", "--filter", "^py", "--batch"], RecordingClient(failures={"kill": [denied]}))
    assert code == 4
    assert client.calls[-1] == call.kill(4343, 888, force=False, grace=None)  # still tried after the denial
    err = capsys.readouterr().err
    assert err == "gpukill: PID 4242 (python3): not authorized to kill PID 4242\n"


def test_batch_with_no_match_kills_nothing(capsys):
    code, client = run(["--kill", "--filter", "^py", "--batch"], RecordingClient(processes=[]))
    assert code == 5 and client.calls == [BY_REGEX]
    assert "no GPU process matches '^py'; nothing was killed" in capsys.readouterr().err


def test_reset_all_goes_on_after_a_gpu_that_cannot_be_reset(capsys):
    unsupported = daemon_error(errors.NotSupported, "GPU 0 cannot be reset: not supported")
    code, client = run(["--reset", "--all"], RecordingClient(failures={"reset": [unsupported]}))
    assert code == 9
    assert client.calls[-1] == call.reset("1", force=False)
    out = capsys.readouterr()
    assert "gpukill: GPU 0: GPU 0 cannot be reset" in out.err and "GPU 1 (GPU-1): reset" in out.out


def test_watch_refreshes_until_interrupted_and_survives_a_failed_refresh(monkeypatch, capsys):
    monkeypatch.setattr(compat, "WATCH_INTERVAL", 0.01)
    gone = DaemonUnavailable("", "gpukilld is not running (org.gpukill1 is not on the system bus)")
    client = RecordingClient(failures={"list_devices": [None, gone]})
    p = compat.plan(["--list", "--watch", "--output", "json"])
    assert p.endless

    # went on after the failed second refresh
    asyncio.run(watch_until(p, client, lambda calls: calls.count(call.list_devices()) >= 4))
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) >= 3 and all(json.loads(line)["format"] == 1 for line in lines)  # JSON lines
    assert out.err.count("gpukill: gpukilld is not running") == 1


# (gpukill arguments, exit status, what the one line must say: the problem and what to run instead)
REFUSALS = [
    ([], 2, ["one of --list, --kill, --reset, --guard", "gpukillctl --help"]),
    (["--kill", "--reset", "--pid", "5"], 2, ["--kill and --reset together", "gpukillctl kill PID; gpukillctl reset"]),
    (["--list", "--guard"], 2, ["--list and --guard together", "gpukillctl list; gpukillctl guard status"]),
    (
        ["--list", "--force"],
        2,
        ["--force is an option of --kill or --reset, not of --list", "instead: gpukillctl list"],
    ),
    (["--list", "--filter", "py"], 2, ["--filter is an option of --kill", "gpukillctl list --name-regex py"]),
    (["--list", "--pid", "5"], 2, ["--pid is an option of --kill", "gpukillctl list"]),
    (["--kill", "--watch", "--pid", "5"], 2, ["--watch is an option of --list", "gpukillctl kill 5"]),
    (["--reset", "--gpu", "0", "--details"], 2, ["--details is an option of --list", "gpukillctl reset 0"]),
    (["--guard", "--force"], 2, ["--force is an option of --kill or --reset", "gpukillctl guard status"]),
    (["--kill"], 2, ["--kill needs --pid PID, or --filter REGEX or --gpu GPU with --batch", "gpukillctl kill PID"]),
    (["--kill", "--pid", "5", "--gpu", "0"], 2, ["--pid and --gpu together", "gpukillctl kill 5"]),
    (["--kill", "--gpu", "0", "--force"], 2, ["--force without --batch", "gpukillctl list --device 0"]),
    (["--kill", "--gpu", "0", "--all"], 2, ["--all is an option of --reset, not of --kill", "list --device 0"]),
    (["--list", "--dry-run"], 2, ["--dry-run (--safe) is an option of --kill, not of --list", "gpukillctl list"]),
    (
        ["--reset", "--gpu", "0", "--safe"],
        2,
        ["--dry-run (--safe) is an option of --kill, not of --reset", "gpukillctl reset 0"],
    ),
    (
        ["--guard", "--guard-enable", "--dry-run"],
        2,
        ["is an option of --kill, not of --guard", "gpukillctl guard enable"],
    ),
    (["--safe", "--pid", "5"], 2, ["without an operation", "gpukillctl kill 5"]),
    (["--kill", "--pid", "5", "--filter", "py"], 2, ["--pid and --filter together", "gpukillctl kill 5"]),
    (["--kill", "--pid", "5", "--batch"], 2, ["--batch goes with --filter", "gpukillctl kill 5"]),
    (["--kill", "--batch"], 2, ["--kill needs --pid PID", "gpukillctl kill PID"]),
    (["--kill", "--filter", "py", "--force"], 2, ["--force without --batch", "gpukillctl list --name-regex py"]),
    (["--kill", "--filter", "py", "--timeout-secs", "3"], 2, ["--timeout-secs without --batch", "--name-regex py"]),
    (["--kill", "--filter", "", "--batch"], 2, ["--filter '' matches the empty string", "gpukillctl kill PID"]),
    (["--kill", "--filter", ".*", "--batch"], 2, ["--filter '.*' matches the empty string", "gpukillctl list"]),
    (["--kill", "--filter", "py|", "--batch"], 2, ["matches the empty string", "gpukillctl list"]),
    (["--kill", "--filter", "(a", "--batch"], 2, ["not a valid regular expression", "gpukillctl list --name-regex"]),
    (["--kill", "--pid", "5", "--output", "json"], 2, ["--output json does not go with --kill", "gpukillctl kill 5"]),
    (["--kill", "--pid", "abc"], 2, ["not a PID", "gpukillctl --help"]),
    (["--kil", "--pid", "5"], 2, ["unrecognized arguments: --kil", "gpukillctl --help"]),  # no abbreviations
    (["--list", "stray"], 2, ["unrecognized arguments: stray", "gpukillctl --help"]),
    (["--reset"], 2, ["--reset needs --gpu GPU or --all", "gpukillctl reset GPU"]),
    (["--reset", "--gpu", "1", "--all"], 2, ["--gpu and --all together", "gpukillctl reset 1"]),
    (["--reset", "--gpu", "1", "--output", "json"], 2, ["--output json does not go with --reset", "reset 1"]),
    (
        ["--guard", "--guard-enable", "--guard-dry-run"],
        2,
        ["--guard-enable and --guard-dry-run together", "gpukillctl guard enable; gpukillctl guard dry-run on"],
    ),
    (["--guard", "--guard-disable", "--guard-test-policies"], 2, ["together", "gpukillctl guard disable"]),
    (
        ["--guard", "--guard-enable", "--policy-file", "p.yaml"],
        2,
        ["--policy-file with --guard-enable", "gpukillctl guard load p.yaml; then gpukillctl guard enable"],
    ),
    (
        ["--guard", "--guard-enforce", "--output", "json"],
        2,
        ["--output json does not go with --guard-enforce", "gpukillctl guard dry-run off"],
    ),
    (
        ["--guard", "--policy-file", "p.yaml", "--output", "json"],
        2,
        ["does not go with --policy-file", "gpukillctl guard load p.yaml"],
    ),
    (
        ["--guard-enable"],
        2,
        ["--guard-enable without an operation: it is an option of --guard", "instead: gpukillctl guard enable"],
    ),
    (["--pid", "5", "--force"], 2, ["--pid without an operation", "instead: gpukillctl kill 5"]),
    (["--rogue"], 2, ["--rogue without an operation: it is an option of --audit", "instead: gpukillctl audit"]),
    (["--list", "--rogue"], 2, ["--rogue is an option of --audit, not of --list", "gpukillctl list"]),
    # gpu-kill's usage audit is gpukillctl usage; with the rogue scan or a settings request it is a second request
    (
        ["--audit", "--rogue", "--audit-hours", "48"],
        2,
        [
            "--audit-hours with --rogue: the usage over time and the rogue-activity audit of the GPUs now are two "
            "requests",
            "instead: gpukillctl usage --by process --since 48h; then gpukillctl audit\n",
        ],
    ),
    (
        ["--audit", "--audit-user", "bob", "--rogue-whitelist-user", "x"],
        2,
        ["two requests", "gpukillctl usage --by process --user bob; then gpukillctl audit settings allow-user x"],
    ),
    (["--audit", "--audit-hours", "0"], 2, ["a number of hours must be more than 0"]),
    (["--audit", "--audit-hours", "a day"], 2, ["not a number of hours"]),
    (["--list", "--audit-summary"], 2, ["--audit-summary is an option of --audit, not of --list"]),
    (
        ["--kill", "--pid", "5", "--vendor", "amd"],
        2,
        ["--vendor is an option of --list, not of --kill", "gpukillctl kill 5"],
    ),
    (["--reset", "--gpu", "0", "--containers"], 2, ["--containers is an option of --list", "gpukillctl reset 0"]),
    (["--list", "--vendor", "nv;idia"], 2, ["not a vendor", "gpukillctl --help"]),
    (["--list", "--ssh-user", "bob"], 2, ["--ssh-user goes with --remote HOST", "gpukillctl -H"]),
    (["--remote=-bad", "--list"], 2, ["--remote: not a host", "gpukillctl -H"]),
    (["--remote", "h", "--server"], 2, ["--remote with --server", "gpukillctl serve"]),
    (
        ["--server", "--server-host", "0.0.0.0"],
        2,
        ["--server-host 0.0.0.0: off loopback", "gpukillctl serve --tcp 0.0.0.0:8080 --token-file FILE"],
    ),
    (["--server", "--server-port", "0"], 2, ["not a port", "gpukillctl --help"]),
    (["--list", "--open"], 2, ["--open is an option of --server, not of --list", "instead: gpukillctl list"]),
    (
        ["--guard", "--guard-memory-limit", "16"],
        2,
        [
            "--guard-memory-limit goes with --guard-add-user: alone it changes nothing",
            "instead: gpukillctl guard policy add user USER --memory-limit 16GiB\n",
        ],
    ),
    (
        ["--guard", "--guard-add-user", "bob"],
        2,
        [
            "--guard-add-user bob names no limit: gpu-kill filled in its defaults (16GB memory, 80% utilization, 5 "
            "processes)",
            "instead: gpukillctl guard policy add user bob --memory-limit 16GiB --utilization-limit 80 "
            "--process-limit 5\n",
        ],
    ),
    (
        ["--guard", "--guard-add-gpu", "2"],
        2,
        [
            "names no limit",
            "gpukillctl guard policy add gpu 2 --memory-limit 24GiB --utilization-limit 90 --reserved-memory 2GiB\n",
        ],
    ),
    (
        ["--guard", "--guard-add-user", "a", "--guard-group-memory-limit", "4"],
        2,
        ["--guard-group-memory-limit does not go with --guard-add-user", "gpukillctl guard policy add user a"],
    ),
    (
        ["--guard", "--guard-add-user", "a", "--guard-remove-user", "b"],
        2,
        ["--guard-add-user and --guard-remove-user together", "gpukillctl guard policy remove user b"],
    ),
    (["--guard", "--guard-add-user", "a", "--guard-memory-limit", "-1"], 2, ["not a size: '-1'", "--help"]),
    (["--guard", "--guard-add-user", "a", "--guard-memory-limit", "0.0001"], 2, ["under 1 MiB, likely a mistake"]),
    (["--guard", "--guard-add-user", "a", "--guard-utilization-limit", "101"], 2, ["percentage must be"]),
    (["--guard", "--guard-add-gpu", "x"], 2, ["not a GPU index"]),
    (
        ["--guard", "--guard-export-config", "--output", "json"],
        2,
        ["--output json does not go with", "gpukillctl guard policy export"],
    ),
    (
        ["--guard", "--guard-add-group", "ml", "--guard-group-members", "a,b"],
        2,
        [
            "--guard-group-members: a group's members are the system's",
            "instead: gpasswd -a a ml; gpasswd -a b ml; then "
            "gpukillctl guard policy add group ml --memory-limit SIZE\n",
        ],
    ),
    (
        ["--guard", "--guard-add-group", "ml", "--guard-group-members", "a", "--guard-group-memory-limit", "4"],
        2,
        ["instead: gpasswd -a a ml; then gpukillctl guard policy add group ml --memory-limit 4GiB\n"],
    ),
    (
        ["--guard", "--guard-group-members", "a"],
        2,
        ["instead: gpasswd -a a GROUP; then gpukillctl guard policy add group GROUP --memory-limit SIZE\n"],
    ),
    (
        ["--audit", "--rogue-whitelist-process", "my-app"],
        2,
        ["absolute path, not a process name", "gpukillctl audit settings allow-process /PATH/OF/my-app"],
    ),
    (["--audit", "--rogue-confidence-threshold", "2"], 2, ["confidence must be between 0 and 1"]),
    (
        ["--audit", "--rogue-memory-threshold", "15"],
        2,
        ["--rogue-memory-threshold is not supported", "gpukillctl audit settings set abuser_share=PCT"],
    ),
    (
        ["--audit", "--rogue-config", "--rogue-export-config"],
        2,
        ["together: one request at a time", "gpukillctl audit settings show"],
    ),
    (
        ["--audit", "--rogue", "--rogue-whitelist-user", "bob"],
        2,
        ["a scan and a change of settings are two requests", "gpukillctl audit settings allow-user bob"],
    ),
    (
        ["--audit", "--rogue-export-config", "--output", "json"],
        2,
        ["--output json does not go", "gpukillctl audit settings export"],
    ),
    (["--list", "--ssh-key", "k"], 2, ["--ssh-key is not supported", "IdentityFile KEY", "gpukillctl -H HOST list"]),
]


@pytest.mark.parametrize("argv,code,texts", REFUSALS, ids=[" ".join(a) or "(nothing)" for a, _, _ in REFUSALS])
def test_refused_in_one_line_naming_what_to_run(argv, code, texts, capsys):
    """Refused before any connection: a refusal that slipped through would reach the bus (exit 3, not 2)."""
    assert compat.main(argv) == code
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("gpukill: ") and out.err.count("\n") == 1 and "; instead: " in out.err, out.err
    for text in texts:
        assert text in out.err, out.err


def test_every_unsupported_gpu_kill_flag_names_its_replacement(capsys):
    for flag, instead in compat.UNSUPPORTED.items():
        assert compat.main(["--list", flag]) == 2
        assert capsys.readouterr().err == f"gpukill: gpu-kill's {flag} is not supported; instead: {instead}\n"


def gpukillctl_commands(text: str) -> list[list[str]]:
    """The gpukillctl command lines a message names, as words: from "gpukillctl" to the end of the clause."""
    return [m.split() for m in re.findall(r"gpukillctl ([^;(),]*)", text)]


def missing_in_gpukillctl(words: list[str]) -> str | None:
    """What of this gpukillctl command line gpukillctl's parser does not have (a subcommand, an option, a word
    where it takes none), or None. Placeholders (PID, FILE) stand where values go, so values are not parsed."""
    parser = cli.build_parser()
    words = list(words)
    if words[:1] == ["-H"]:
        words = words[2:]
    path = []
    while words:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            break
        if words[0] not in sub.choices:
            return f"no command {' '.join([*path, words[0]])!r}"
        path.append(words[0])
        parser = sub.choices[words.pop(0)]
    if not path:
        return "no command"
    positionals = [a for a in parser._actions if not a.option_strings]
    if words and not words[0].startswith("-") and not positionals:
        return f"{' '.join(path)} takes no {words[0]!r}"
    for word in words:
        if word.startswith("--") and word.split("=")[0] not in parser._option_string_actions:
            return f"{' '.join(path)} has no {word}"
    return None


def test_every_replacement_names_what_exists():
    """The gpukillctl commands, condition types and scopes the refusals name are real ones."""
    for flag, instead in compat.UNSUPPORTED.items():
        commands = gpukillctl_commands(instead)
        assert commands, (flag, instead)
        for words in commands:
            assert missing_in_gpukillctl(words) is None, (flag, words, missing_in_gpukillctl(words))
        for condition in re.findall(r"type: (\w+)", instead):
            assert condition in CONDITION_TYPES, (flag, condition)
        for scope in re.findall(r"scope: (\w+)", instead):
            assert scope in rules.SCOPES, (flag, scope)
    assert "gpukillctl -H HOST" in compat.UNSUPPORTED["--register-node"]
    assert "gpukillctl exporter" in compat.UNSUPPORTED["--register-node"]


@pytest.mark.parametrize(
    "argv,commands",
    [
        (["--audit"], ["gpukillctl usage --by process"]),
        (
            ["--audit", "--audit-summary", "--audit-hours", "168", "--output", "json"],
            ["gpukillctl usage --by user --since 168h --json", "gpukillctl usage --by process --since 168h --json"],
        ),
        (
            ["--audit", "--audit-user", "alice", "--audit-process", "pytorch", "--audit-hours", "12"],
            ["gpukillctl usage --by process --user alice --name pytorch --since 12h"],
        ),
    ],
)
def test_usage_audit_is_gpukillctl_usage(argv, commands):
    """gpu-kill's usage audit flags are gpukillctl usage's options, parsed by gpukillctl's own parser."""
    assert list(compat.plan(argv).commands) == commands
    for command in commands:
        assert missing_in_gpukillctl(command.split()[1:]) is None, command


@pytest.mark.parametrize(
    "argv,serve",
    [
        (["--server"], ("serve",)),
        (["up"], ("serve",)),  # gpu-kill's shorthand
        (["--server", "--server-port", "9000"], ("serve", "--tcp", "127.0.0.1:9000")),
        (["--server", "--server-host", "::1"], ("serve", "--tcp", "[::1]:8080")),
        (["--server", "--server-host", "localhost", "--server-port", "3001"], ("serve", "--tcp", "localhost:3001")),
        # the dashboard in a browser: TCP (a browser cannot reach the socket), on gpu-kill's port unless given
        (["--server", "--open"], ("serve", "--tcp", "127.0.0.1:8080", "--open")),
        (["--server", "--open", "--server-port", "9000"], ("serve", "--tcp", "127.0.0.1:9000", "--open")),
    ],
)
def test_server_is_gpukillctl_serve(argv, serve):
    p = compat.plan(argv)
    assert p.run is None and p.gpukillctl == serve
    args = cli.build_parser().parse_args(list(serve))  # what gpukillctl serve takes
    assert args.command == "serve" and (args.tcp is None) == (len(serve) == 1)
    if "--server-host" not in argv:  # where gpukill differs from gpu-kill's 0.0.0.0:8080, said first
        assert "not on gpu-kill's 0.0.0.0" in p.note


@pytest.mark.parametrize(
    "argv,host",
    [
        (["--remote", "gpu01", "--list"], "gpu01"),
        (["--remote", "gpu01", "--ssh-user", "admin", "--ssh-port", "2222", "--list"], "admin@gpu01:2222"),
        (["--remote", "fe80::1%eth0", "--ssh-port", "22", "--list"], "[fe80::1%eth0]:22"),
        (["--remote", "ops@gpu01", "--guard", "--guard-enable"], "ops@gpu01"),
    ],
)
def test_remote_is_gpukillctl_H(argv, host):
    assert compat.plan(argv).host == host
    assert cli.build_parser().parse_args(["-H", host, "list"]).host == host  # as -H takes it


def test_remote_kill_of_a_pid_it_does_not_list_asks_that_host(capsys):
    """Over -H, this host's /proc says nothing of the PID: start time 0 lets that daemon say why (as gpukillctl
    -H kill does), not this host's process of the same PID."""
    p = compat.plan(["--remote", "gpu01", "--kill", "--pid", "1"])
    client = RecordingClient(processes=[])
    asyncio.run(p.run(client))
    assert client.calls == [call.list_processes({}), call.kill(1, 0, force=False, grace=None)]


@pytest.mark.parametrize(
    "argv,commands",
    [
        (
            [
                "--guard",
                "--guard-add-user",
                "dev",
                "--guard-memory-limit",
                "8.0",
                "--guard-utilization-limit",
                "70.5",
                "--guard-process-limit",
                "3",
            ],
            ["gpukillctl guard policy add user dev --memory-limit 8GiB --utilization-limit 70.5 --process-limit 3"],
        ),
        (
            ["--guard", "--guard-add-user", "dev", "--guard-memory-limit", "0.3"],  # not a whole number of MiB: bytes
            ["gpukillctl guard policy add user dev --memory-limit 322122547B"],
        ),
        (
            ["--guard", "--guard-add-gpu", "3", "--guard-gpu-allowed-users", "a,b", "--guard-gpu-reserved-memory", "2"],
            ["gpukillctl guard policy add gpu 3 --reserved-memory 2GiB --allowed-users a,b"],
        ),
        (["--guard", "--guard-remove-gpu", "03"], ["gpukillctl guard policy remove gpu 3"]),
        (["--guard", "--guard-import-config", "g.json"], ["gpukillctl guard policy import g.json --replace"]),
        (["--audit", "--rogue-config", "--output", "json"], ["gpukillctl audit settings show --json"]),
        (
            [
                "--audit",
                "--rogue-confidence-threshold",
                "0.123",
                "--rogue-whitelist-user",
                "u",
                "--rogue-unwhitelist-process",
                "/bin/x",
            ],
            [
                "gpukillctl audit settings set min_score=12.3",
                "gpukillctl audit settings disallow-process /bin/x",
                "gpukillctl audit settings allow-user u",
            ],
        ),
        (
            ["--audit", "--rogue", "--rogue-confidence-threshold", "0.5", "--output", "json"],
            ["gpukillctl audit --json --min-score 50"],
        ),
    ],
)
def test_settings_flags_run_gpukillctls_commands(argv, commands):
    """gpu-kill's policy and audit settings flags are gpukillctl guard policy and audit settings commands, parsed
    by gpukillctl's own parser: sizes exact (GB as GiB), numbers as given."""
    assert list(compat.plan(argv).commands) == commands


def test_toggle_dry_run_turns_the_daemons_state_over(capsys):
    for now, then in ((False, True), (True, False)):
        client = RecordingClient()
        client.dry_run = now
        code, client = run(["--guard", "--guard-toggle-dry-run"], client)
        # the status before (to turn it over) and after (whether it was saved; off: whether a policy keeps it on)
        assert code == 0 and client.calls == [call.guard_status(), call.guard_set_dry_run(then), call.guard_status()]
        assert capsys.readouterr().out == f"guard dry run {'on' if then else 'off'}\n"


def test_version_is_the_packages(capsys):
    with pytest.raises(SystemExit) as exited:
        compat.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"gpukill {importlib.metadata.version('gpukill')}\n"
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl.cli.compat", "--version"], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"gpukill {importlib.metadata.version('gpukill')}\n", "")


def test_dry_run_prints_the_decisions_and_kills_nothing(capsys):
    code, client = run(["--kill", "--filter", "^py", "--batch", "--dry-run", "--force", "--timeout-secs", "2"])
    assert code == 0 and not [c for c in client.calls if c[0] == "kill"]
    out = capsys.readouterr()
    assert out.out == (
        "2 process(es) match '^py': 4242 (python3), 4343 (pytorch)\n"
        "would kill PID 4242 (python3), start time 777: SIGTERM, then SIGKILL if alive after 2s\n"
        "would kill PID 4343 (pytorch), start time 888: SIGTERM, then SIGKILL if alive after 2s\n"
    )
    assert out.err == "gpukill: dry run: nothing was killed (polkit decides at the kill)\n"
    code, client = run(["--kill", "--pid", "4343", "--safe"])
    assert code == 0 and client.calls == [call.list_processes({})]
    assert capsys.readouterr().out == "would kill PID 4343 (pytorch), start time 888: SIGTERM\n"


def test_dry_run_of_what_the_kill_would_refuse_or_not_find(capsys):
    code, client = run(["--kill", "--pid", "999", "--dry-run"])
    assert code == 5 and client.calls == [call.list_processes({})]
    assert "PID 999 is not a GPU process gpukilld lists" in capsys.readouterr().err
    code, client = run(["--kill", "--gpu", "1", "--batch", "--dry-run"], RecordingClient(processes=[]))
    assert code == 5 and client.calls == [ON_GPU_1, call.list_devices()]  # GPU 1 exists: none on it
    assert capsys.readouterr().err == "gpukill: no GPU process on GPU 1; nothing would be killed\n"


def test_kill_by_gpu_without_batch_kills_nothing_and_says_so(capsys):
    code, client = run(["--kill", "--gpu", "1"])
    assert code == 0 and not [c for c in client.calls if c[0] == "kill"]
    assert "nothing was killed: add --batch" in capsys.readouterr().err


def test_kill_by_gpu_batch_names_what_it_kills_and_exits_5_on_none(capsys):
    code, _ = run(["--kill", "--gpu", "1", "--batch"])
    assert code == 0
    assert capsys.readouterr().out.startswith("2 process(es) on GPU 1: 4242 (python3), 4343 (pytorch)\n")
    code, client = run(["--kill", "--gpu", "1", "--batch"], RecordingClient(processes=[]))
    assert code == 5 and client.calls == [ON_GPU_1, call.list_devices()]
    assert capsys.readouterr().err == "gpukill: no GPU process on GPU 1; nothing was killed\n"


@pytest.mark.parametrize(
    "argv,done",
    [
        (["--kill", "--gpu", "9", "--batch"], "nothing was killed"),
        (["--kill", "--gpu", "9", "--batch", "--dry-run"], "nothing would be killed"),
    ],
)
def test_kill_on_a_gpu_that_does_not_exist_is_exit_status_15(capsys, argv, done):
    """A typo in --gpu is not "no process on it": gpukillctl's exit status for a name that does not exist."""
    code, client = run(argv, RecordingClient(processes=[]))
    assert code == 15 and client.calls == [call.list_processes({"device": "9"}), call.list_devices()]
    assert capsys.readouterr().err == (
        f"gpukill: no such GPU '9' (GPUs here: 0, 1; an index, UUID or PCI bus id); {done}\n"
    )


def test_list_on_a_gpu_that_does_not_exist_is_exit_status_15(capsys):
    code, _ = run(["--kill", "--gpu", "9"], RecordingClient(processes=[]))  # without --batch: the listing
    assert code == 15
    assert capsys.readouterr().err == "gpukillctl: no such GPU '9' (GPUs here: 0, 1; an index, UUID or PCI bus id)\n"


@pytest.mark.parametrize("path", [GUARD_JSON, GUARD_TOML])
def test_guard_import_config_reads_gpu_kills_guard_mode_file(capsys, path):
    """Its export (JSON) and its own file (TOML) alike: each user, group and GPU policy becomes the managed
    policy of the same limits (GB as GiB, the grace from enforcement), replacing the managed ones, as gpu-kill's
    import replaced its configuration; each setting without a meaning here is one line saying why."""
    code, client = run(["--guard", "--guard-import-config", str(path)])
    assert code == 0 and client.calls == [call.guard_import_policies(str(path), GUARD_IMPORTED, replace=True)]
    out = capsys.readouterr()
    assert out.out == f"1 policies from {path} in force: user alice\n"  # what the recording daemon answers
    ignored = [line.split(" ignored: ")[0].removeprefix(f"gpukill: {path}: ") for line in out.err.splitlines()]
    assert ignored == [
        "global.enabled",
        "global.default_memory_limit_gb",
        "global.default_utilization_limit_pct",
        "global.default_duration_limit_hours",
        "global.check_interval_seconds",
        "global.dry_run",
        "enforcement.soft_enforcement",
        "enforcement.hard_enforcement",
        "enforcement.max_warnings",
        "enforcement.notifications",
        "user_policies.*.duration_limit_hours",
        "user_policies.*.priority",
        "group_policies.*.priority",
        "group_policies.*.members",
    ]
    assert "gpukill: " + f"{path}: group_policies.*.members ignored: a group's members are the system's" in out.err


@pytest.mark.parametrize("path", [ROGUE_JSON, ROGUE_TOML])
def test_rogue_import_config_reads_gpu_kills_rogue_file(capsys, path):
    """The confidence threshold is min_score (its f32 in TOML, 0.699999988079071, is 0.7), the user whitelist the
    allowed users; the thresholds, patterns, weights and alerts that mean nothing here are one line each."""
    code, client = run(["--audit", "--rogue-import-config", str(path)])
    assert code == 0 and client.calls == [call.import_audit_settings(str(path), ROGUE_IMPORTED)]
    err = capsys.readouterr().err
    ignored = [line.split(" ignored: ")[0].removeprefix(f"gpukill: {path}: ") for line in err.splitlines()]
    assert ignored == [
        "detection.max_memory_usage_gb",
        "detection.max_utilization_pct",
        "detection.max_duration_hours",
        "detection.enabled_detections",
        "scoring",
        "patterns.crypto_miner_patterns",
        "patterns.suspicious_process_names",
        "patterns.process_whitelist",
        "alerts",
    ]
    assert (
        f"{path}: patterns.process_whitelist ignored: python, jupyter, tensorflow, pytorch, nvidia-smi: names, "
        "not executables' paths"
    ) in err


def test_import_config_takes_gpukills_own_exports_as_they_are(tmp_path):
    policies, settings = tmp_path / "policies.yaml", tmp_path / "audit.conf"
    policies.write_text(EXPORTED_POLICIES)
    settings.write_text(EXPORTED_SETTINGS)
    code, client = run(["--guard", "--guard-import-config", str(policies)])
    assert code == 0 and client.calls == [call.guard_import_policies(str(policies), EXPORTED_POLICIES, replace=True)]
    code, client = run(["--audit", "--rogue-import-config", str(settings)])
    assert code == 0 and client.calls == [call.import_audit_settings(str(settings), EXPORTED_SETTINGS)]


@pytest.mark.parametrize(
    "flag,content,formats",
    [
        (
            "--rogue-import-config",
            "not a configuration\n",
            "gpu-kill's rogue detection configuration (the JSON of "
            "gpu-kill --audit --rogue-export-config, or its rogue_config.toml) or gpukill's [audit] section",
        ),
        ("--rogue-import-config", GUARD_JSON.read_text(), "gpu-kill's rogue detection configuration"),
        (
            "--guard-import-config",
            ROGUE_JSON.read_text(),
            "gpu-kill's Guard Mode configuration (the JSON of gpu-kill "
            "--guard --guard-export-config, or its TOML file) or gpukill's managed policies (gpukillctl guard policy "
            "export)",
        ),
        ("--guard-import-config", POLICY.read_text(), "gpu-kill's Guard Mode configuration"),  # a policy file
    ],
)
def test_import_config_of_another_format_is_one_line_naming_the_formats(capsys, tmp_path, flag, content, formats):
    path = tmp_path / "some.file"
    path.write_text(content)
    op = "--audit" if flag.startswith("--rogue") else "--guard"
    code, client = run([op, flag, str(path)])
    assert code == 2 and client.calls == []
    err = capsys.readouterr().err
    assert err.startswith(f"gpukill: {path}: not {formats}") and err.count("\n") == 1, err


def test_import_config_with_a_wrong_value_says_where(capsys, tmp_path):
    path = tmp_path / "guard.json"
    path.write_text(json.dumps({"user_policies": {"alice": {"memory_limit_gb": "8GB"}}}))
    code, client = run(["--guard", "--guard-import-config", str(path)])
    assert code == 2 and client.calls == []
    assert capsys.readouterr().err == (
        f'gpukill: {path}: user_policies.alice.memory_limit_gb must be a number, not "8GB"\n'
    )
    path.write_text(json.dumps({"gpu_policies": {"0": {"max_memory_gb": 0.0}}}))
    code, client = run(["--guard", "--guard-import-config", str(path)])
    assert code == 2 and "gpu_policies.0: memory_limit must be a whole number of bytes" in capsys.readouterr().err
    code, client = run(["--audit", "--rogue-import-config", str(tmp_path / "missing.json")])
    assert code == 2 and client.calls == []
    assert (
        capsys.readouterr().err == f"gpukill: {tmp_path / 'missing.json'}:1:1: cannot read: No such file or directory\n"
    )


def test_every_option_has_a_help_text():
    """gpukill(1) and the completions are written from this parser."""
    for action in compat.build_parser()._actions:
        assert action.help and len(action.help) > 10, action.option_strings


# -- end to end: the real daemon on the test bed, gpukill run as the users -------------------------------------


@needs_root
def test_kill_by_pid(victims, users, alive):
    bed, owner = victims, users["owner"]
    victim = bed.victim(owner, gpu=0, comm="compatpid")
    bed.wait_listed(victim.pid, comm="compatpid")
    r = bed.gpukill(owner, "--kill", "--pid", str(victim.pid))
    assert r.returncode == 0, r
    # the GPU's answer too
    assert re.fullmatch(
        rf"PID {victim.pid} \(compatpid\) terminated; GPU memory reclaimed \S+ after SIGTERM\n", r.stdout
    )
    assert not alive(victim.pid)


@needs_root
def test_filter_batch_kills_every_match_and_nothing_else(victims, users, alive):
    bed, owner = victims, users["owner"]
    matches = [bed.victim(owner, gpu=0, comm="batchme"), bed.victim(owner, gpu=1, comm="batchme")]
    bystander = bed.victim(owner, gpu=0, comm="batchmenot")
    for v, comm in [(matches[0], "batchme"), (matches[1], "batchme"), (bystander, "batchmenot")]:
        bed.wait_listed(v.pid, comm=comm)
    preview = bed.gpukill(owner, "--kill", "--filter", "^batchme$")
    assert preview.returncode == 0 and all(str(v.pid) in preview.stdout for v in matches), preview
    assert all(alive(v.pid) for v in matches)
    r = bed.gpukill(owner, "--kill", "--filter", "^batchme$", "--batch")
    assert r.returncode == 0, r
    assert f"2 process(es) match '^batchme$': {matches[0].pid} (batchme), {matches[1].pid} (batchme)" in r.stdout
    assert not any(alive(v.pid) for v in matches)
    assert alive(bystander.pid)


@needs_root
def test_dry_run_signals_nothing_and_names_the_process(victims, users, alive):
    bed, owner = victims, users["owner"]
    one = bed.victim(owner, gpu=0, comm="dryrunpid")
    batch = [bed.victim(owner, gpu=0, comm="dryrunme"), bed.victim(owner, gpu=1, comm="dryrunme")]
    for v, comm in [(one, "dryrunpid"), (batch[0], "dryrunme"), (batch[1], "dryrunme")]:
        bed.wait_listed(v.pid, comm=comm)
    r = bed.gpukill(owner, "--kill", "--pid", str(one.pid), "--dry-run")
    assert r.returncode == 0, r
    assert r.stdout.startswith(f"would kill PID {one.pid} (dryrunpid), start time ") and alive(one.pid)
    r = bed.gpukill(owner, "--kill", "--filter", "^dryrunme$", "--batch", "--safe", "--force")
    assert r.returncode == 0, r
    assert all(f"would kill PID {v.pid} (dryrunme)" in r.stdout for v in batch), r
    assert r.stderr == "gpukill: dry run: nothing was killed (polkit decides at the kill)\n"
    assert alive(one.pid) and all(alive(v.pid) for v in batch)


@needs_root
def test_kill_by_gpu_kills_what_is_on_it_and_nothing_else(victims, users, alive):
    bed, owner = victims, users["owner"]
    on_it = bed.victim(owner, gpu=3, comm="ongpu3")
    elsewhere = bed.victim(owner, gpu=2, comm="ongpu2")
    for v, comm in [(on_it, "ongpu3"), (elsewhere, "ongpu2")]:
        bed.wait_listed(v.pid, comm=comm)
    preview = bed.gpukill(owner, "--kill", "--gpu", "3")
    assert preview.returncode == 0 and str(on_it.pid) in preview.stdout, preview
    assert "nothing was killed: add --batch" in preview.stderr and alive(on_it.pid)
    r = bed.gpukill(owner, "--kill", "--gpu", "3", "--batch")
    assert r.returncode == 0, r
    assert f"1 process(es) on GPU 3: {on_it.pid} (ongpu3)" in r.stdout
    assert not alive(on_it.pid)
    assert alive(elsewhere.pid)


@needs_root
def test_reset_gpu_with_force_kills_the_holder_first(victims, users, alive):
    bed = victims
    holder = bed.victim(users["owner"], gpu=1, ignore_term=True, comm="holder")
    bed.wait_listed(holder.pid, comm="holder")
    busy = bed.gpukill(ROOT, "--reset", "--gpu", "1")
    assert busy.returncode == 8 and busy.stderr.startswith("gpukill: ") and alive(holder.pid), busy
    r = bed.gpukill(ROOT, "--reset", "--gpu", "1", "--force")
    assert r.returncode == 0, r
    assert f"killed first: {holder.pid}" in r.stdout
    assert not alive(holder.pid)


@needs_root
def test_list_json_is_gpukillctls(victims, users):
    bed, other = victims, users["other"]
    victim = bed.victim(users["owner"], gpu=2, mem="700MiB", comm="compatjson")
    bed.wait_listed(victim.pid, comm="compatjson")
    ours = bed.gpukill(other, "--list", "--output", "json")
    assert ours.returncode == 0, ours
    assert json.loads(ours.stdout) == bed.listing(other)


def _ctrl_c_as_a_shell_leaves_it() -> None:
    """SIGINT at its default and unblocked in the child, as an interactive shell starts a command: ignored or
    blocked signals pass through exec, and this test process (a background job, or state a test left in it)
    may have SIGINT so, which would make the watcher deaf to the Ctrl-C under test."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _blocked_in(pid: int) -> str:
    """Where a process waits (its kernel wait channel, its system call) and what it does with signals."""
    found = []
    for name in ("wchan", "syscall"):
        try:
            found.append(f"{name} {Path(f'/proc/{pid}/{name}').read_text().split()[:1]}")
        except OSError as e:
            found.append(f"{name} unreadable ({e.strerror})")
    with contextlib.suppress(OSError):
        found += [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Sig")]
    return ", ".join(found)


@needs_root
def test_watch_refreshes_until_ctrl_c(bed, users):
    other = users["other"]
    watcher = subprocess.Popen(
        [PYTHON, "-m", "gpukillctl.cli.compat", "--list", "--watch", "--output", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=bed.env(),
        cwd="/",
        preexec_fn=_ctrl_c_as_a_shell_leaves_it,
        **other.popen_kwargs(),
    )
    try:
        assert watcher.stdout is not None
        docs = [json.loads(watcher.stdout.readline()) for _ in range(2)]  # two refreshes, one line each
        assert all(d["format"] == 1 and len(d["devices"]) == 4 for d in docs)
        watcher.send_signal(signal.SIGINT)
        try:  # read on while it ends: a refresh larger than the pipe holds would wait for a reader
            _, err = watcher.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"--watch did not end on SIGINT: {_blocked_in(watcher.pid)}") from None
        assert watcher.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


@needs_root
def test_refusal_from_the_command_line(bed, users):
    """As the admin types it: one line, exit 2, the gpukillctl command named; nothing reaches the daemon."""
    r = bed.gpukill(users["other"], "--kill", "--reset", "--pid", "1")
    assert (r.returncode, r.stdout) == (2, ""), r
    assert r.stderr == (
        "gpukill: --kill and --reset together: one operation at a time; "
        "instead: gpukillctl kill PID; gpukillctl reset GPU\n"
    )


def test_console_script_is_declared():
    """pyproject's `gpukill` runs this module's main (the .deb and .rpm ship packaging/bin/gpukill, the same)."""
    text = (REPO / "pyproject.toml").read_text()
    assert 'gpukill = "gpukillctl.cli.compat:main"' in text
    wrapper = (REPO / "packaging" / "bin" / "gpukill").read_text()
    assert "from gpukillctl.cli.compat import main" in wrapper
    script = Path(PYTHON).parent / "gpukill"
    if script.exists():  # installed by `pip install -e .` (make test)
        r = subprocess.run(
            [str(script), "--audit", "--rogue", "--audit-hours", "2"], capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 2 and r.stderr.startswith("gpukill: --audit-hours with --rogue"), r


@needs_root
def test_names_that_do_not_exist_end_to_end(bed, users):
    """gpu-kill's flags that name a user or GPU: a name this host does not have is gpukillctl's exit status 15;
    a group policy for a group it does not have is in force, with a warning (the group may come later)."""
    other = users["other"]
    r = bed.gpukill(other, "--audit", "--audit-user", "gpk-nosuch")
    assert (r.returncode, r.stdout) == (15, ""), r
    assert r.stderr == "gpukillctl: usage: no such user 'gpk-nosuch' on this host\n"
    r = bed.gpukill(other, "--kill", "--gpu", "9", "--batch")
    assert (r.returncode, r.stdout) == (15, ""), r
    assert r.stderr.startswith("gpukill: no such GPU '9' (GPUs here: 0, 1, 2, 3;")
    try:
        r = bed.gpukill(ROOT, "--guard", "--guard-add-group", "gpk-nosuchgrp", "--guard-group-memory-limit", "8")
        assert r.returncode == 0 and "group policy for gpk-nosuchgrp in force" in r.stdout, r
        assert r.stderr == (
            "gpukillctl: warning: no such group 'gpk-nosuchgrp' on this host: the policy matches "
            "nobody until it exists\n"
        )
    finally:
        bed.gpukill(ROOT, "--guard", "--guard-remove-group", "gpk-nosuchgrp")
