"""`gpukillctl serve`'s MCP endpoint driven by the MCP SDK's own Streamable HTTP client, the server running as
an unprivileged user against the real daemon on simulated GPUs, reached on its Unix socket (the default) and
on TCP (--tcp): the gpu-kill article's scenario end to end
with the token as the Authorization header (the kills in the journal under the server's user), with
kill_process and with kill_processes_by_name's preview and confirm; a user policy made and removed by an
administrator's server, refused (AccessDenied) to an ordinary user's; and the same client without the token
refused before any session starts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
mcp_client = pytest.importorskip(
    "mcp.client.client", reason="the serve extra (pip install 'gpukill[serve]') is not installed"
)

import httpx2  # noqa: E402  (the SDK's HTTP client)
from helpers.http_server import Server  # noqa: E402
from helpers.marks import needs_root  # noqa: E402
from helpers.mcp_scenario import (  # noqa: E402
    article_session,
    batch_session,
    check_article,
    check_batch,
    check_policy_made,
    check_policy_refused,
    no_user_policy,
    policy_session,
    start_article_victims,
)
from helpers.testbed import OTHER  # noqa: E402
from mcp import MCPError  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

pytestmark = needs_root


@pytest.fixture(scope="module", params=["unix", "tcp"])
def server(bed, users, request):
    s = Server(bed, users["owner"], tcp=request.param == "tcp").wait_ready()
    yield s
    s.stop()


def run_http(server: Server, session, headers: dict[str, str], statuses: list[int], mode: str = "auto") -> Any:
    """session(client) with the SDK's Client over Streamable HTTP at the server's /mcp, sending `headers` on
    every request (the SDK's way: an HTTP client of our making, passed to its transport); the status of every
    answer is appended to `statuses`. mode: the SDK's ("auto": server/discover, the stateless protocol when
    the server has it, else the handshake; "legacy": the initialize handshake and a session, as assistants
    of the handshake era connect). On the socket: the SDK's HTTP client with a transport to the socket's path
    (httpx's uds), and http://localhost/mcp as the URL."""
    url = f"http://{server.host}/mcp"
    uds = {} if server.port is not None else {"transport": httpx2.AsyncHTTPTransport(uds=str(server.socket_path))}

    async def record(response: httpx2.Response) -> None:
        statuses.append(response.status_code)

    async def main() -> Any:
        http = httpx2.AsyncClient(
            headers=headers, timeout=httpx2.Timeout(30, read=60), event_hooks={"response": [record]}, **uds
        )
        transport = streamable_http_client(url, http_client=http)
        async with http, mcp_client.Client(transport, read_timeout_seconds=60, mode=mode) as client:
            return await session(client)

    try:
        return asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        print(f"server output:\n{server.output()}\nstatuses: {statuses}")


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_article_scenario_over_streamable_http(server, victims, users, mode):
    """ "Scan and kill every python process using more than 12 GB", as gpkowner's assistant would, through
    `gpukillctl serve` with its token."""
    owner = users["owner"]
    v = start_article_victims(victims, owner)

    async def session(client):
        return await article_session(client, v)

    statuses: list[int] = []
    results = run_http(server, session, {"Authorization": f"Bearer {server.token}"}, statuses, mode)
    check_article(victims, owner, v, results)
    assert statuses and all(200 <= s < 300 for s in statuses), statuses


def test_kill_by_name_over_streamable_http(server, victims, users):
    """The same request through gpu-kill's kill_processes_by_name: preview, then the confirmed kill."""
    owner = users["owner"]
    v = start_article_victims(victims, owner)

    async def session(client):
        return await batch_session(client, v)

    statuses: list[int] = []
    results = run_http(server, session, {"Authorization": f"Bearer {server.token}"}, statuses)
    check_batch(victims, owner, v, results)


@pytest.fixture(scope="module")
def admin_server(bed, users):
    """An administrator's `gpukillctl serve` (gpkadmin: polkit/49-gpukill-admins.rules lets it manage policies),
    on its socket."""
    s = Server(bed, users["admin"]).wait_ready()
    yield s
    s.stop()


def test_user_policy_over_streamable_http(server, admin_server, bed):
    """create_user_policy and remove_user_policy: made and removed through the administrator's server; the
    ordinary user's server (the module's, as gpkowner) gets polkit's AccessDenied and makes nothing."""

    async def session(client):
        return await policy_session(client, OTHER)

    with no_user_policy(bed, OTHER):
        refused = run_http(server, session, {"Authorization": f"Bearer {server.token}"}, [])
        made = run_http(admin_server, session, {"Authorization": f"Bearer {admin_server.token}"}, [])
    check_policy_refused(refused, OTHER)
    check_policy_made(made, OTHER)


def test_without_the_token_the_client_cannot_connect(server, victims, users):
    """The same client, no token: the first request is answered 401 and no session starts; nothing runs."""
    victim = victims.victim(users["owner"], gpu=0, mem="16GiB")
    victims.wait_listed(victim.pid, comm="python3")
    called = []

    async def session(client):
        called.append(client)
        return await client.call_tool("list_processes", {})

    statuses: list[int] = []
    with pytest.raises(BaseException) as caught:  # noqa: B017  (the SDK raises it inside exception groups)
        run_http(server, session, {}, statuses)
    assert any(isinstance(e, MCPError) for e in _leaves(caught.value)), repr(caught.value)
    assert statuses and set(statuses) == {401}, statuses  # every request refused at the gate
    assert called == [] and victim.poll() is None


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]
