"""`gpukillctl mcp`: the MCP server (gpukillctl/serve/mcp.py) for one assistant on stdin/stdout.

Registered by gpukillctl/cli/main.py without importing the SDK, so gpukillctl works where the optional `serve` extra is
not
installed; only this command then fails, in one line that says what to install.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from ..client.dbus import GpukillClient
from ..client.exits import EXIT_FAILURE, EXIT_OK

PROG = "gpukillctl mcp"
INSTALL_HINT = "pip install 'gpukill[serve]', or the package gpukill-serve"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mcp",
        help="serve gpukill's tools to an AI assistant over MCP (stdio)",
        description="The Model Context Protocol server on stdin/stdout, for an assistant that starts it as a "
        "subprocess. Tools: list_devices, list_processes, kill_process, kill_processes_by_name "
        "(a preview, then the kill of the confirmed processes), reset_device, audit_rogue, "
        "guard_status, guard_test_policy, list_policies, create_user_policy, remove_user_policy; "
        "resources gpukill://devices, gpukill://processes, gpukill://guard/status, "
        "gpukill://guard/policies, gpukill://audit. It acts as the user who runs it: polkit decides "
        f"as for gpukillctl. Needs the mcp package ({INSTALL_HINT}). See gpukillctl(1).",
    )
    p.set_defaults(offline=cmd_mcp)


def sdk_missing(e: ModuleNotFoundError) -> bool:
    """Whether the import failed for want of the optional SDK (or what it brings), not for a bug of ours."""
    return (e.name or "").split(".")[0] in ("mcp", "mcp_types", "pydantic", "pydantic_core", "anyio", "starlette")


def cmd_mcp(args: argparse.Namespace) -> int:
    try:
        from . import mcp as mcp_server
    except ModuleNotFoundError as e:
        if not sdk_missing(e):
            raise
        print(f"{PROG}: the MCP server needs the mcp package ({e.name} is missing): {INSTALL_HINT}", file=sys.stderr)
        return EXIT_FAILURE
    asyncio.run(mcp_server.serve_stdio(GpukillClient.connect))
    return EXIT_OK
