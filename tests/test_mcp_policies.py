"""gpu-kill's create_user_policy / remove_user_policy over `gpukillctl mcp` (stdio), driven by the MCP SDK's own
client, the server running as a real user against the real daemon: an administrator (gpkadmin, in group gpukill,
whom polkit/49-gpukill-admins.rules lets manage policies) makes and removes a user policy, which the daemon then
lists; an ordinary user's server gets polkit's refusal as a tool error naming AccessDenied, and nothing is made.
Over Streamable HTTP: tests/test_mcp_http.py."""

from __future__ import annotations

import pytest
from helpers.marks import needs_root
from helpers.mcp_scenario import (
    check_policy_made,
    check_policy_refused,
    no_user_policy,
    policy_session,
    structured,
)
from helpers.testbed import OTHER

from gpukilld import journal as audit

pytest.importorskip("mcp.client.client", reason="the mcp SDK is not installed: pip install '.[serve]'")

from test_mcp import run_mcp  # noqa: E402  (the stdio client, as the other MCP tests run it)

pytestmark = needs_root
TARGET = OTHER  # the user the policy limits: gpkother runs nothing in these tests


@pytest.fixture
def no_policy(bed):
    with no_user_policy(bed, TARGET):
        yield


def test_admin_creates_and_removes_a_user_policy(bed, users, no_policy):
    admin = users["admin"]

    async def session(client):
        return await policy_session(client, TARGET)

    check_policy_made(run_mcp(bed, admin, session), TARGET)
    # each change in the journal under the server's user: the administrator
    changes = bed.wait_journal(
        MESSAGE_ID=audit.GUARD_MANAGED_POLICY.message_id,
        GPUKILL_POLICY_TARGET=TARGET,
        GPUKILL_CALLER_UID=str(admin.uid),
    )
    assert {"set", "remove"} <= {e["GPUKILL_OPERATION"] for e in changes if e["GPUKILL_RESULT"] == "changed"}, changes


def test_ordinary_user_is_refused_by_polkit(bed, users, no_policy):
    owner = users["owner"]

    async def session(client):
        return await policy_session(client, TARGET)

    check_policy_refused(run_mcp(bed, owner, session), TARGET)
    denied = bed.wait_journal(
        MESSAGE_ID=audit.GUARD_MANAGED_POLICY.message_id,
        GPUKILL_POLICY_TARGET=TARGET,
        GPUKILL_CALLER_UID=str(owner.uid),
        GPUKILL_RESULT="denied",
    )
    assert denied, "polkit's refusal is not in the journal under the user's uid"


def test_create_user_policy_takes_only_what_it_is_given(bed, users, no_policy):
    """No gpu-kill defaults filled in (8 GB, 70 %, 3 processes): only the limit given is set; none at all is the
    daemon's InvalidArgs; an argument the tool does not declare is refused, not dropped."""
    admin = users["admin"]

    async def session(client):
        made = await client.call_tool(
            "create_user_policy", {"username": TARGET, "utilization_limit_pct": 90, "grace_seconds": 60}
        )
        none = await client.call_tool("create_user_policy", {"username": TARGET + "x"})
        stray = await client.call_tool(
            "create_user_policy", {"username": TARGET, "process_limit": 2, "memory_limit": 1}
        )
        listed = await client.call_tool("list_policies", {})
        removed = await client.call_tool("remove_user_policy", {"username": TARGET})
        return made, none, stray, listed, removed

    made, none, stray, listed, removed = run_mcp(bed, admin, session)
    policy = structured(made)["policy"]
    assert policy["utilization_limit"] == 90 and policy["grace"] == 60, policy
    assert policy["memory_limit"] is None and policy["process_limit"] is None, policy
    assert none.is_error and none.content[0].text.startswith("org.freedesktop.DBus.Error.InvalidArgs: "), none.content
    assert stray.is_error and "memory_limit" in stray.content[0].text, stray.content
    assert "Extra inputs are not permitted" in stray.content[0].text, stray.content
    assert [p for p in structured(listed)["policies"] if p["target"] == TARGET] == [policy]  # the stray call: no change
    assert structured(removed)["removed"] is True
