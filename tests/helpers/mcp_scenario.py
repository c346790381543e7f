"""The gpu-kill article's scenario ("scan and kill every python process using more than 12 GB") for an MCP
client of gpukill, whatever its transport: tests/test_mcp.py runs it over stdio (`gpukillctl mcp`),
tests/test_mcp_http.py over Streamable HTTP (`gpukillctl serve`). Only the client's methods are used here, so
this module does not import the SDK."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

from gpukilld import audit

from .testbed import Testbed, User

TWELVE_GB = 12884901888  # the article's "more than 12 GB": 12 GiB in bytes


def structured(result: Any) -> dict:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    # the text content is the same JSON, for clients that do not read structured content
    assert json.loads(result.content[0].text) == result.structured_content
    return result.structured_content


def error_text(result: Any) -> str:
    assert result.is_error, result
    return result.content[0].text


@dataclass
class ArticleVictims:
    big: list[subprocess.Popen]  # python, more than 12 GB: to be killed
    exactly: subprocess.Popen  # python, 12 GB: not *more* than 12 GB
    trainer: subprocess.Popen  # 20 GB, not python
    miner: subprocess.Popen  # for the audit


@dataclass
class ArticleResults:
    devices: list[dict]
    found: list[dict]
    stale: Any
    kills: list[dict]
    audit_result: Any
    left: dict


def start_article_victims(bed: Testbed, owner: User) -> ArticleVictims:
    v = ArticleVictims(
        big=[bed.victim(owner, gpu=0, mem="16GiB"), bed.victim(owner, gpu=1, mem="13GiB")],
        exactly=bed.victim(owner, gpu=1, mem="12GiB"),
        trainer=bed.victim(owner, gpu=2, mem="20GiB", comm="trainer"),
        miner=bed.victim(owner, gpu=3, mem="1GiB", util=99, comm="xmrig"),
    )
    for p in [*v.big, v.exactly]:
        bed.wait_listed(p.pid, comm="python3")
    bed.wait_listed(v.trainer.pid, comm="trainer")
    bed.wait_listed(v.miner.pid, comm="xmrig")
    return v


async def article_session(client: Any, v: ArticleVictims) -> ArticleResults:
    """What the user's assistant does: list, filter, kill each result (and once with a wrong start time),
    audit, list again."""
    devices = structured(await client.call_tool("list_devices", {}))["devices"]
    found = structured(await client.call_tool("list_processes", {"name": "python", "memory_gt": TWELVE_GB}))
    stale = await client.call_tool("kill_process", {"pid": v.big[0].pid, "start_time": 1})
    kills = [structured(await client.call_tool("kill_process", {"pid": p["pid"], "start_time": p["start_time"]}))
             for p in found["processes"]]
    audit_result = await client.call_tool("audit_rogue", {})
    left = json.loads((await client.read_resource("gpukill://processes")).contents[0].text)
    return ArticleResults(devices, found["processes"], stale, kills, audit_result, left)


def check_article(bed: Testbed, owner: User, v: ArticleVictims, r: ArticleResults) -> None:
    """The big python processes killed, nothing else; each kill in the journal under `owner` (the server's
    user); the miner in the audit."""
    assert [d["index"] for d in r.devices] == [0, 1, 2, 3] and r.devices[0]["name"] == "Simulated H100 80GB HBM3"
    assert sorted(p["pid"] for p in r.found) == sorted(p.pid for p in v.big)
    assert all(p["gpu_memory"] > TWELVE_GB and "python" in p["comm"] for p in r.found)
    assert error_text(r.stale).startswith("ProcessChanged: ")  # a wrong start time kills nothing
    assert [k["outcome"] for k in r.kills] == ["terminated", "terminated"]
    for p in v.big:
        assert p.wait(10) is not None
    assert {v.exactly.pid, v.trainer.pid} <= {p["pid"] for p in r.left["processes"]}
    assert v.exactly.poll() is None and v.trainer.poll() is None
    for p in v.big:
        entry = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(p.pid))
        assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(owner.uid), entry
        assert entry[0]["GPUKILL_INITIATOR"] == "user" and entry[0]["GPUKILL_RESULT"] == "terminated"
    findings = structured(r.audit_result)["findings"]  # the audit's rules are tested with gpukilld/rogue.py
    mined = [f for f in findings if f["pid"] == v.miner.pid]
    assert [(f["kind"], f["user"]) for f in mined] == [("miner", owner.name)], findings
    assert mined[0]["score"] > 0 and "miner-name" in {e["rule"] for e in mined[0]["evidence"]}
