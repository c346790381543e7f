"""The HTTP front ends, `gpukillctl serve` (server.py: listening, tokens; app.py composes the app) with the
REST API (rest.py) and the MCP server (mcp.py), and `gpukillctl mcp` on stdio (mcp_cli.py). It imports
gpukill, client/, http/ and itself; never another front end nor cli/.
"""
