"""A failure carries one name whichever server says it: the REST API's "error" and the start of the MCP tool
error are the same full D-Bus error name (client.api.error_name), for the daemon's errors, the bus's, a daemon
that is not there, and a failure nobody named."""

from __future__ import annotations

import asyncio

import pytest

from gpukill import errors
from gpukillctl.client.api import ERRORS, ClientError, DaemonUnavailable

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
pytest.importorskip("mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed")
httpx2 = pytest.importorskip("httpx2", reason="the serve extra's HTTP client is not installed")

from gpukillctl.serve.mcp import build_mcp  # noqa: E402
from gpukillctl.serve.rest import build_rest  # noqa: E402


def daemon_error(cls: type[errors.GpukillError], message: str) -> ClientError:
    return ERRORS[cls.dbus_name](cls.dbus_name, message)


FAILURES = [
    (daemon_error(errors.NoSuchDevice, "no GPU 7"), errors.NoSuchDevice.dbus_name),
    (daemon_error(errors.AccessDenied, "not authorized"), errors.AccessDenied.dbus_name),
    (daemon_error(errors.TooBusy, "too many calls"), errors.TooBusy.dbus_name),
    # polkit wanting a password nobody can type: a denial, named as one
    (
        ERRORS["org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"](
            "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired", "a password is needed"
        ),
        errors.AccessDenied.dbus_name,
    ),
    (ClientError("org.freedesktop.DBus.Error.Timeout", "no reply"), "org.freedesktop.DBus.Error.Timeout"),
    (ClientError("", "gpukilld answered an unknown outcome"), errors.GpukillError.dbus_name),
    (
        DaemonUnavailable("org.freedesktop.DBus.Error.ServiceUnknown", "gpukilld is not running"),
        "org.gpukill1.Error.DaemonUnavailable",
    ),
]


class Failing:
    """A connection on which every call fails with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def list_devices(self):
        raise self.error

    def close(self) -> None:
        pass


def names_of(error: Exception) -> tuple[str, str]:
    """The name the REST API and the MCP server give the failure of listing the GPUs."""

    async def connect():
        return Failing(error)

    async def go() -> tuple[str, str]:
        transport = httpx2.ASGITransport(app=build_rest(connect))
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            rest = (await http.get("/v1/devices")).json()["error"]
        result = await build_mcp(connect).call_tool("list_devices", {})
        content = result.content if hasattr(result, "content") else result[0]
        assert result.is_error if hasattr(result, "is_error") else True
        return rest, content[0].text.split(": ", 1)[0]

    return asyncio.run(go())


@pytest.mark.parametrize("error,name", FAILURES, ids=[name for _, name in FAILURES])
def test_rest_and_mcp_name_a_failure_alike(error, name):
    assert names_of(error) == (name, name)
