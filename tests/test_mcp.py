"""`gpukillctl mcp` driven by the MCP SDK's own client over stdio, the server running as an unprivileged user
against the real daemon on simulated GPUs: the gpu-kill article's scenario, polkit's answers as tool errors,
the journal naming the server's user."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers.marks import needs_root
from helpers.mcp_scenario import article_session, check_article, error_text, start_article_victims, structured
from helpers.testbed import PYTHON, REPO, Testbed, User

from gpukilld import audit

mcp_client = pytest.importorskip("mcp.client.client", reason="the mcp SDK is not installed: pip install '.[serve]'")
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

READ_ONLY_TOOLS = {"list_devices", "list_processes", "audit_rogue", "guard_status", "guard_test_policy"}
DESTRUCTIVE_TOOLS = {"kill_process", "reset_device"}


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
    assert set(outputs["kill_process"]["properties"]["outcome"]["enum"]) == {"terminated", "killed", "still-alive"}
    assert "Finding" in outputs["audit_rogue"]["$defs"] and "GuardStatus" in outputs["guard_status"]["$defs"]
    kill_args = by_name["kill_process"].input_schema
    assert set(kill_args["required"]) == {"pid", "start_time"}  # the safe way: the start time as listed
    assert set(by_name["list_processes"].input_schema["properties"]) == {
        "name", "name_regex", "user", "device", "memory_gt"}
    assert {str(r.uri) for r in resources} == {"gpukill://devices", "gpukill://processes",
                                                "gpukill://guard/status"}


@needs_root
def test_article_scenario_kills_the_big_python_processes(victims, users):
    """"Scan and kill every python process using more than 12 GB", as gpkowner's assistant would."""
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
        kill = await client.call_tool("kill_process", {"pid": victim.pid, "start_time": listed["start_time"],
                                                       "force": True})
        reset = await client.call_tool("reset_device", {"device": 3})
        gone = await client.call_tool("kill_process", {"pid": 4194000, "start_time": 1})
        return kill, reset, gone

    kill, reset, gone = run_mcp(bed, other, session)
    assert error_text(kill).startswith("AccessDenied: ") and "not authorized to kill" in error_text(kill)
    assert error_text(reset).startswith("AccessDenied: ")
    assert error_text(gone).startswith("NoSuchProcess: ")
    assert victim.poll() is None
    denied = bed.wait_journal(MESSAGE_ID=audit.KILL_DENIED.message_id, GPUKILL_TARGET_PID=str(victim.pid))
    assert denied and denied[0]["GPUKILL_CALLER_UID"] == str(other.uid) and denied[0]["GPUKILL_RESULT"] == "denied"


@needs_root
def test_guard_tools(bed, users):
    policy = ("rules:\n  - name: mcp-test\n    action: log\n"
              "    conditions: [{type: process_name, operator: ==, value: nothing-runs-this}]\n")

    async def session(client):
        return (await client.call_tool("guard_status", {}),
                await client.call_tool("guard_test_policy", {"policy": policy, "name": "mine.yaml"}),
                await client.call_tool("guard_test_policy", {"policy": "rules: [", "name": "broken.yaml"}),
                await client.read_resource("gpukill://guard/status"))

    status, tested, broken, resource = run_mcp(bed, users["other"], session)
    guard = structured(status)["guard"]
    assert isinstance(guard["enabled"], bool) and isinstance(guard["rules"], list)
    assert json.loads(resource.contents[0].text)["guard"]["source"] == guard["source"]
    assert structured(tested) == {"decisions": []}
    assert error_text(broken).startswith("InvalidPolicy: ") and "broken.yaml" in error_text(broken)


@needs_root
def test_daemon_unreachable_is_a_tool_error(bed, users):
    async def session(client):
        return await client.call_tool("list_devices", {})

    result = run_mcp(bed, users["other"], session, DBUS_SYSTEM_BUS_ADDRESS="unix:path=/nonexistent")
    assert error_text(result).startswith("DaemonUnavailable: cannot connect to the system bus")


def test_without_the_sdk_it_says_what_to_install():
    code = "import sys; sys.modules['mcp'] = None\nfrom gpukillctl.cli import main\nsys.exit(main(['mcp']))"
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("gpukillctl mcp: ") and "pip install 'gpukill[serve]'" in r.stderr
