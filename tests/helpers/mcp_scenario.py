"""The gpu-kill article's scenario ("scan and kill every python process using more than 12 GB") for an MCP
client of gpukill, whatever its transport: tests/test_mcp.py runs it over stdio (`gpukillctl mcp`),
tests/test_mcp_http.py over Streamable HTTP (`gpukillctl serve`). The same request through gpu-kill's own tool
(kill_processes_by_name: a preview, then the confirmed kill), and a user policy made and removed with gpu-kill's
create_user_policy / remove_user_policy (tests/test_mcp_policies.py and test_mcp_http.py), are here too. Only
the client's methods are used here, so this module does not import the SDK."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpukill import errors
from gpukilld import journal as audit

from .testbed import ROOT, Testbed, User, start_time_of

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
    kills = [
        structured(await client.call_tool("kill_process", {"pid": p["pid"], "start_time": p["start_time"]}))
        for p in found["processes"]
    ]
    audit_result = await client.call_tool("audit_rogue", {})
    left = json.loads((await client.read_resource("gpukill://processes")).contents[0].text)
    return ArticleResults(devices, found["processes"], stale, kills, audit_result, left)


def check_article(bed: Testbed, owner: User, v: ArticleVictims, r: ArticleResults) -> None:
    """The big python processes killed, nothing else; each kill in the journal under `owner` (the server's
    user); the miner in the audit."""
    assert [d["index"] for d in r.devices] == [0, 1, 2, 3] and r.devices[0]["name"] == "Simulated H100 80GB HBM3"
    assert sorted(p["pid"] for p in r.found) == sorted(p.pid for p in v.big)
    assert all(p["gpu_memory"] > TWELVE_GB and "python" in p["comm"] for p in r.found)
    assert error_text(r.stale).startswith("org.gpukill1.Error.ProcessChanged: ")  # a wrong start time kills nothing
    assert [k["outcome"] for k in r.kills] == ["terminated", "terminated"]
    # each kill ends with the GPU's answer: nothing related to it holds its memory
    assert [k["reclaim"]["verdict"] for k in r.kills] == ["reclaimed", "reclaimed"], r.kills
    assert all(
        k["reclaim"]["reclaimed"] > TWELVE_GB and k["answer"].startswith("GPU memory reclaimed (") for k in r.kills
    ), r.kills
    for p in v.big:
        assert p.wait(10) is not None
    assert {v.exactly.pid, v.trainer.pid} <= {p["pid"] for p in r.left["processes"]}
    assert v.exactly.poll() is None and v.trainer.poll() is None
    for p in v.big:
        entry = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(p.pid))
        assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(owner.uid), entry
        assert entry[0]["GPUKILL_INITIATOR"] == "user" and entry[0]["GPUKILL_RESULT"] == "terminated"
    findings = structured(r.audit_result)["findings"]  # the audit's rules are tested with gpukilld/rogue/score.py
    mined = [f for f in findings if f["pid"] == v.miner.pid]
    assert [(f["kind"], f["user"]) for f in mined] == [("miner", owner.name)], findings
    assert mined[0]["score"] > 0 and "miner-name" in {e["rule"] for e in mined[0]["evidence"]}


# -- the same request in gpu-kill's one tool: kill_processes_by_name, a preview, then the confirmed kill ------


@dataclass
class BatchResults:
    preview: dict
    alive_after_preview: list[bool]  # each big process, right after the preview returned
    stale: dict  # a listed pid passed back with another start time
    big0_alive_after_stale: bool
    confirmed: dict
    audit_resource: dict  # gpukill://audit


def refs(*pairs: tuple[int, int]) -> list[dict]:
    return [{"pid": pid, "start_time": start_time} for pid, start_time in pairs]


async def batch_session(client: Any, v: ArticleVictims) -> BatchResults:
    """What the user's assistant does with gpu-kill's kill_processes_by_name: the preview, a confirm of a listed
    PID with another start time (as if it were a newcomer on a reused PID), then the confirm of what the preview
    listed plus two processes the selection does not match (the 12 GiB python, the trainer); the audit resource."""
    selection = {"pattern": "python", "memory_gt": TWELVE_GB}
    preview = structured(await client.call_tool("kill_processes_by_name", selection))
    alive = [p.poll() is None for p in v.big]
    listed = {m["pid"]: m["start_time"] for m in preview["matches"]}
    big0 = v.big[0].pid
    stale = structured(
        await client.call_tool(
            "kill_processes_by_name", {**selection, "confirm": refs((big0, listed.get(big0, 0) + 1))}
        )
    )
    big0_alive = v.big[0].poll() is None
    extra = {p.pid: start_time_of(p.pid) for p in (v.exactly, v.trainer)}
    confirmed = structured(
        await client.call_tool(
            "kill_processes_by_name", {**selection, "confirm": refs(*listed.items(), *extra.items())}
        )
    )
    audit_resource = json.loads((await client.read_resource("gpukill://audit")).contents[0].text)
    return BatchResults(preview, alive, stale, big0_alive, confirmed, audit_resource)


def check_batch(bed: Testbed, owner: User, v: ArticleVictims, r: BatchResults) -> None:
    """The preview listed the big python processes and killed nothing; the stale pair killed nothing; the
    confirm killed exactly the big python processes (in the journal under `owner`) and refused the two that do
    not match; the miner is in the audit resource."""
    p = r.preview
    assert p["confirmed"] is False and p["killed"] == [] and p["not_killed"] == [] and p["more"] == 0, p
    assert [m["pid"] for m in p["matches"]] == sorted(x.pid for x in v.big), p
    expected = {v.big[0].pid: ([0], 16 << 30), v.big[1].pid: ([1], 13 << 30)}  # start_article_victims'
    for m in p["matches"]:
        assert m["start_time"] == start_time_of(m["pid"]) and m["name"] == "python3", m
        assert m["user"] == owner.name and m["uid"] == owner.uid, m
        assert (m["gpus"], m["gpu_memory"]) == expected[m["pid"]], m
    assert "confirm" in p["next_step"], p
    assert r.alive_after_preview == [True, True]  # the preview never kills

    s = r.stale
    assert s["confirmed"] is True and s["killed"] == [], s
    assert [(n["pid"], n["reason"]) for n in s["not_killed"]] == [(v.big[0].pid, errors.ProcessChanged.dbus_name)], s
    assert r.big0_alive_after_stale

    c = r.confirmed
    assert sorted(k["pid"] for k in c["killed"]) == sorted(x.pid for x in v.big), c
    assert {k["outcome"] for k in c["killed"]} == {"terminated"}, c
    assert sorted((n["pid"], n["reason"]) for n in c["not_killed"]) == sorted(
        [(v.exactly.pid, "NotMatching"), (v.trainer.pid, "NotMatching")]
    ), c
    for x in v.big:
        assert x.wait(10) is not None
    assert v.exactly.poll() is None and v.trainer.poll() is None and v.miner.poll() is None
    for m in p["matches"]:  # by pid and start time: PIDs are reused within a session (pid_max may be 32768)
        entry = bed.wait_journal(
            MESSAGE_ID=audit.KILL.message_id,
            GPUKILL_TARGET_PID=str(m["pid"]),
            GPUKILL_TARGET_START_TIME=str(m["start_time"]),
        )
        assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(owner.uid), entry
    for x in (v.exactly, v.trainer):  # refused before any kill was asked: nothing in the journal
        assert (
            bed.journal(
                MESSAGE_ID=audit.KILL.message_id,
                GPUKILL_TARGET_PID=str(x.pid),
                GPUKILL_TARGET_START_TIME=str(start_time_of(x.pid)),
            )
            == []
        )
    mined = [f for f in r.audit_resource["findings"] if f["pid"] == v.miner.pid]
    assert [(f["kind"], f["user"]) for f in mined] == [("miner", owner.name)], r.audit_resource


# -- gpu-kill's create_user_policy / remove_user_policy -------------------------------------------------------


@dataclass
class PolicyResults:
    created: Any
    listed: Any
    resource: dict  # gpukill://guard/policies
    removed: Any
    listed_after: Any
    removed_again: Any


@contextlib.contextmanager
def no_user_policy(bed: Testbed, target: str) -> Iterator[None]:
    """No user policy for target before or after, whatever the test leaves (removed as root, on the bus; an
    error when there is none is fine), so that no other test of the session meets it."""
    bed.guard_call(ROOT, "RemovePolicy", "ss", ["user", target])
    try:
        yield
    finally:
        bed.guard_call(ROOT, "RemovePolicy", "ss", ["user", target])


async def policy_session(client: Any, target: str) -> PolicyResults:
    """Create a user policy as gpu-kill's tool takes it (memory in GB, a process limit), list it (tool and
    resource), remove it, list again, remove again."""
    created = await client.call_tool(
        "create_user_policy", {"username": target, "memory_limit_gb": 8, "process_limit": 3}
    )
    listed = await client.call_tool("list_policies", {})
    resource = json.loads((await client.read_resource("gpukill://guard/policies")).contents[0].text)
    removed = await client.call_tool("remove_user_policy", {"username": target})
    listed_after = await client.call_tool("list_policies", {})
    removed_again = await client.call_tool("remove_user_policy", {"username": target})
    return PolicyResults(created, listed, resource, removed, listed_after, removed_again)


def user_policies(result: Any) -> list[str]:
    return [p["target"] for p in structured(result)["policies"] if p["kind"] == "user"]


def check_policy_made(r: PolicyResults, target: str) -> None:
    """As an administrator: created with exactly the limits given (8 GiB, 3 processes, no utilization limit),
    listed by the tool and the resource, removed; a second removal is InvalidArgs."""
    policy = structured(r.created)["policy"]
    assert (policy["kind"], policy["target"]) == ("user", target), policy
    assert policy["memory_limit"] == 8 << 30 and policy["process_limit"] == 3, policy
    assert policy["utilization_limit"] is None and policy["edited"] is False, policy
    assert policy["file"].endswith(".yaml") and target in policy["file"], policy
    assert target in user_policies(r.listed)
    assert [p for p in r.resource["policies"] if p["target"] == target] == [policy], r.resource
    assert structured(r.removed) == {"kind": "user", "target": target, "removed": True}
    assert target not in user_policies(r.listed_after)
    assert error_text(r.removed_again).startswith("org.freedesktop.DBus.Error.InvalidArgs: ") and target in error_text(
        r.removed_again
    )


def check_policy_refused(r: PolicyResults, target: str) -> None:
    """As an ordinary user: polkit refuses both changes (AccessDenied, as a tool error); listing works; no
    policy was made."""
    assert error_text(r.created).startswith("org.freedesktop.DBus.Error.AccessDenied: "), error_text(r.created)
    assert error_text(r.removed).startswith("org.freedesktop.DBus.Error.AccessDenied: ")
    assert error_text(r.removed_again).startswith("org.freedesktop.DBus.Error.AccessDenied: ")
    assert target not in user_policies(r.listed) and target not in user_policies(r.listed_after)
    assert [p for p in r.resource["policies"] if p["target"] == target] == []
