"""`gpukillctl mcp` driven by the MCP SDK's own client over stdio, the server running as an unprivileged user
against the real daemon on simulated GPUs: the gpu-kill article's scenario (with kill_process, and with
kill_processes_by_name's preview and confirm), polkit's answers as tool errors, the journal naming the server's
user, arguments a tool does not declare refused. The policy tools: tests/test_mcp_policies.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers.marks import needs_root
from helpers.mcp_scenario import (
    article_session,
    batch_session,
    check_article,
    check_batch,
    error_text,
    refs,
    start_article_victims,
    structured,
)
from helpers.testbed import PYTHON, REPO, Testbed, User, start_time_of

from gpukill import errors
from gpukilld import journal as audit

mcp_client = pytest.importorskip("mcp.client.client", reason="the mcp SDK is not installed: pip install '.[serve]'")
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

READ_ONLY_TOOLS = {
    "list_devices",
    "list_processes",
    "list_suspended",
    "audit_rogue",
    "guard_status",
    "guard_test_policy",
    "list_policies",
    "usage",
}
DESTRUCTIVE_TOOLS = {
    "kill_process",
    "reset_device",
    "kill_processes_by_name",
    "create_user_policy",
    "remove_user_policy",
}
RESOURCES = {
    "gpukill://devices",
    "gpukill://processes",
    "gpukill://suspended",
    "gpukill://guard/status",
    "gpukill://guard/policies",
    "gpukill://audit",
    "gpukill://usage",
}
POLKIT_POLICY = REPO / "polkit" / "org.gpukill.policy"


def run_mcp(bed: Testbed, user: User, session: Callable[[Any], Awaitable[Any]], **env: str) -> Any:
    """session(client) with the SDK's Client connected over stdio to `gpukillctl mcp` run as `user` (setpriv:
    the same process, only its ids changed, so it is that user's D-Bus client)."""
    ids = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--"] if user.uid else []
    argv = [*ids, PYTHON, "-m", "gpukillctl", "mcp"]
    params = StdioServerParameters(command=argv[0], args=argv[1:], cwd="/", env=bed.env(**env))

    async def main() -> Any:
        with tempfile.TemporaryFile("w+") as errlog:
            try:
                async with mcp_client.Client(stdio_client(params, errlog=errlog), read_timeout_seconds=60) as client:
                    return await session(client)
            finally:
                errlog.seek(0)
                if log := errlog.read():
                    print(f"server stderr:\n{log}")

    return asyncio.run(asyncio.wait_for(main(), 120))


@needs_root
def test_tools_declare_hints_and_output_schemas(bed, users):
    async def session(client):
        return (await client.list_tools()).tools, (await client.list_resources()).resources

    tools, resources = run_mcp(bed, users["other"], session)
    by_name = {t.name: t for t in tools}
    assert set(by_name) == READ_ONLY_TOOLS | DESTRUCTIVE_TOOLS
    for name in READ_ONLY_TOOLS:
        hints = by_name[name].annotations
        assert hints.read_only_hint is True and hints.destructive_hint is False, name
    for name in DESTRUCTIVE_TOOLS:
        hints = by_name[name].annotations
        assert hints.read_only_hint is False and hints.destructive_hint is True, name
    outputs = {name: t.output_schema for name, t in by_name.items()}
    assert all(schema and schema["type"] == "object" for schema in outputs.values()), outputs
    assert outputs["list_processes"]["properties"]["processes"]["type"] == "array"
    process = outputs["list_processes"]["$defs"]["Process"]["properties"]
    assert {"pid", "start_time", "comm", "user", "gpu_memory"} <= set(process)
    held = outputs["list_suspended"]["$defs"]["SuspendedProcess"]["properties"]
    assert {"pid", "start_time", "uid", "state", "devices", "memory", "workload", "remedy"} <= set(held)
    assert set(outputs["kill_process"]["properties"]["outcome"]["enum"]) == {"terminated", "killed", "still-alive"}
    assert "Finding" in outputs["audit_rogue"]["$defs"] and "GuardStatus" in outputs["guard_status"]["$defs"]
    kill_args = by_name["kill_process"].input_schema
    assert set(kill_args["required"]) == {"pid", "start_time"}  # the safe way: the start time as listed
    assert set(by_name["list_processes"].input_schema["properties"]) == {
        "name",
        "name_regex",
        "user",
        "device",
        "memory_gt",
    }
    assert {str(r.uri) for r in resources} == RESOURCES
    batch = by_name["kill_processes_by_name"]
    assert batch.input_schema["required"] == ["pattern"]  # no confirm: the preview
    confirm = batch.input_schema["properties"]["confirm"]["anyOf"][0]
    assert confirm["maxItems"] == 32 and "32" in batch.description
    assert {"matches", "killed", "not_killed", "confirmed"} <= set(outputs["kill_processes_by_name"]["properties"])
    assert set(by_name["create_user_policy"].input_schema["properties"]) == {
        "username",
        "memory_limit_gb",
        "utilization_limit_pct",
        "process_limit",
        "grace_seconds",
    }
    assert all(t.input_schema.get("additionalProperties") is False for t in tools)
    assert set(by_name["usage"].input_schema["properties"]) == {
        "hours",
        "by",
        "user",
        "name",
        "unit",
        "job",
        "pod",
        "device",
        "limit",
    }
    assert "UsageRow" in outputs["usage"]["$defs"]


def test_descriptions_say_what_polkit_decides():
    """Every tool's description names the polkit action the daemon asks for (or says it needs none), and every
    action named is one of polkit/org.gpukill.policy."""
    from gpukillctl.serve.mcp import build_mcp

    tools = asyncio.run(build_mcp(None).list_tools())  # type: ignore[arg-type]  (nothing is called)
    actions = set(re.findall(r'<action id="([^"]+)"', POLKIT_POLICY.read_text()))
    needs = {
        "kill_process": {"org.gpukill.kill-own-process", "org.gpukill.kill-any-process"},
        "kill_processes_by_name": {"org.gpukill.kill-own-process", "org.gpukill.kill-any-process"},
        "reset_device": {"org.gpukill.reset-device"},
        "create_user_policy": {"org.gpukill.manage-policies"},
        "remove_user_policy": {"org.gpukill.manage-policies"},
    }
    for t in tools:
        text = " ".join(t.description.split())
        named = set(re.findall(r"org\.gpukill\.[a-z-]+[a-z]", text))
        assert named <= actions, (t.name, named - actions)
        if t.name in needs:
            assert needs[t.name] <= named and "only to administrators" in text, (t.name, text)
        else:
            assert "needs no authorization" in text.lower(), (t.name, text)


@needs_root
def test_article_scenario_kills_the_big_python_processes(victims, users):
    """ "Scan and kill every python process using more than 12 GB", as gpkowner's assistant would."""
    owner = users["owner"]
    v = start_article_victims(victims, owner)

    async def session(client):
        return await article_session(client, v)

    check_article(victims, owner, v, run_mcp(victims, owner, session))


@needs_root
def test_another_users_process_is_a_tool_error_and_audited(victims, users):
    bed = victims
    owner, other = users["owner"], users["other"]
    victim = bed.victim(owner, gpu=3, mem="1GiB", comm="notyours")
    listed = bed.wait_listed(victim.pid, comm="notyours")

    async def session(client):
        kill = await client.call_tool(
            "kill_process", {"pid": victim.pid, "start_time": listed["start_time"], "force": True}
        )
        reset = await client.call_tool("reset_device", {"device": 3})
        gone = await client.call_tool("kill_process", {"pid": 4194000, "start_time": 1})
        return kill, reset, gone

    kill, reset, gone = run_mcp(bed, other, session)
    assert error_text(kill).startswith(
        "org.freedesktop.DBus.Error.AccessDenied: "
    ) and "not authorized to kill" in error_text(kill)
    assert error_text(reset).startswith("org.freedesktop.DBus.Error.AccessDenied: ")
    assert error_text(gone).startswith("org.gpukill1.Error.NoSuchProcess: ")
    assert victim.poll() is None
    denied = bed.wait_journal(MESSAGE_ID=audit.KILL_DENIED.message_id, GPUKILL_TARGET_PID=str(victim.pid))
    assert denied and denied[0]["GPUKILL_CALLER_UID"] == str(other.uid) and denied[0]["GPUKILL_RESULT"] == "denied"


@needs_root
def test_guard_tools(bed, users):
    policy = (
        "rules:\n  - name: mcp-test\n    action: log\n"
        "    conditions: [{type: process_name, operator: ==, value: nothing-runs-this}]\n"
    )

    async def session(client):
        return (
            await client.call_tool("guard_status", {}),
            await client.call_tool("guard_test_policy", {"policy": policy, "name": "mine.yaml"}),
            await client.call_tool("guard_test_policy", {"policy": "rules: [", "name": "broken.yaml"}),
            await client.read_resource("gpukill://guard/status"),
        )

    status, tested, broken, resource = run_mcp(bed, users["other"], session)
    guard = structured(status)["guard"]
    assert isinstance(guard["enabled"], bool) and isinstance(guard["rules"], list)
    assert json.loads(resource.contents[0].text)["guard"]["source"] == guard["source"]
    assert structured(tested) == {"decisions": []}
    assert error_text(broken).startswith("org.gpukill1.Error.InvalidPolicy: ") and "broken.yaml" in error_text(broken)


@needs_root
def test_daemon_unreachable_is_a_tool_error(bed, users):
    async def session(client):
        return await client.call_tool("list_devices", {})

    result = run_mcp(bed, users["other"], session, DBUS_SYSTEM_BUS_ADDRESS="unix:path=/nonexistent")
    assert error_text(result).startswith("org.gpukill1.Error.DaemonUnavailable: cannot connect to the system bus")


def test_without_the_sdk_it_says_what_to_install():
    code = "import sys; sys.modules['mcp'] = None\nfrom gpukillctl.cli.main import main\nsys.exit(main(['mcp']))"
    r = subprocess.run(
        [PYTHON, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("gpukillctl mcp: ") and "pip install 'gpukill[serve]'" in r.stderr


@needs_root
def test_article_scenario_with_kill_processes_by_name(victims, users):
    """The same request through gpu-kill's own tool: the preview kills nothing; the confirm kills exactly the
    confirmed processes that still match, refuses a pair with another start time and those that do not match."""
    owner = users["owner"]
    v = start_article_victims(victims, owner)

    async def session(client):
        return await batch_session(client, v)

    check_batch(victims, owner, v, run_mcp(victims, owner, session))


@needs_root
def test_kill_by_name_refusals(victims, users):
    """Another user's matching process: polkit refuses its kill (not_killed AccessDenied, in the journal) while
    the caller's own is killed; a confirmed PID that is no GPU process: NoSuchProcess; patterns that match every
    name or do not compile, an empty or oversized confirm, and an argument no tool declares: tool errors, and
    nothing killed."""
    bed = victims
    owner, other = users["owner"], users["other"]
    mine = bed.victim(owner, gpu=0, mem="1GiB", comm="batchmine")
    theirs = bed.victim(other, gpu=1, mem="1GiB", comm="batchtheirs")
    for p, comm in ((mine, "batchmine"), (theirs, "batchtheirs")):
        bed.wait_listed(p.pid, comm=comm)
    gone = 4194000

    async def session(client):
        preview = structured(await client.call_tool("kill_processes_by_name", {"pattern": "^batch"}))
        bad = [
            await client.call_tool("kill_processes_by_name", args)
            for args in (
                {"pattern": ".*"},
                {"pattern": "a|"},
                {"pattern": "("},
                {"pattern": "^batch", "confirm": []},
                {"pattern": "^batch", "confirm": refs(*((n, 1) for n in range(1, 34)))},
                {"pattern": "^batch", "confirm": [{"pid": mine.pid, "start_time": 1, "force": True}]},
                {"pattern": "^batch", "filter": "x"},
            )
        ]
        unknown = await client.call_tool("list_processes", {"filter": "batchmine"})
        alive = [mine.poll() is None, theirs.poll() is None]
        listed = [(m["pid"], m["start_time"]) for m in preview["matches"]]
        confirmed = structured(
            await client.call_tool("kill_processes_by_name", {"pattern": "^batch", "confirm": refs(*listed, (gone, 1))})
        )
        return preview, bad, unknown, alive, confirmed

    preview, bad, unknown, alive, confirmed = run_mcp(bed, owner, session)
    assert sorted(m["pid"] for m in preview["matches"]) == sorted([mine.pid, theirs.pid]), preview
    texts = [error_text(r) for r in bad]
    assert [t.split(":")[0] for t in texts[:3]] == ["org.freedesktop.DBus.Error.InvalidArgs"] * 3, texts
    assert "matches the empty string" in texts[0] and "matches the empty string" in texts[1], texts
    assert "RE2" in texts[2], texts
    assert "confirm" in texts[3] and "confirm" in texts[4] and "force" in texts[5], texts
    assert "filter" in texts[6] and "Extra inputs are not permitted" in texts[6], texts
    assert "filter" in error_text(unknown) and "Extra inputs are not permitted" in error_text(unknown)
    assert alive == [True, True]  # nothing above killed anything

    assert [(k["pid"], k["outcome"]) for k in confirmed["killed"]] == [(mine.pid, "terminated")], confirmed
    assert sorted((n["pid"], n["reason"]) for n in confirmed["not_killed"]) == sorted(
        [(theirs.pid, errors.AccessDenied.dbus_name), (gone, errors.NoSuchProcess.dbus_name)]
    ), confirmed
    assert mine.wait(10) is not None and theirs.poll() is None
    denied = bed.wait_journal(
        MESSAGE_ID=audit.KILL_DENIED.message_id,
        GPUKILL_TARGET_PID=str(theirs.pid),
        GPUKILL_TARGET_START_TIME=str(start_time_of(theirs.pid)),
    )
    assert denied and denied[0]["GPUKILL_CALLER_UID"] == str(owner.uid)


@needs_root
def test_kill_by_name_is_bounded(victims, users):
    """More matches than one call takes: the preview lists 32 (by pid), counts the rest and says so."""
    owner = users["owner"]
    procs = [victims.victim(owner, gpu=n % 4, mem="1MiB", comm="boundvictim") for n in range(33)]
    for p in procs:
        victims.wait_listed(p.pid, comm="boundvictim", timeout=30)

    async def session(client):
        return structured(await client.call_tool("kill_processes_by_name", {"pattern": "^boundvictim$"}))

    preview = run_mcp(victims, owner, session)
    assert [m["pid"] for m in preview["matches"]] == sorted(p.pid for p in procs)[:32], preview
    assert all(m["start_time"] == start_time_of(m["pid"]) for m in preview["matches"])
    assert preview["more"] == 1 and "at most 32 a call" in preview["next_step"], preview
    assert all(p.poll() is None for p in procs)
