"""The dashboard's page and its assets: `/` is static/index.html, `/static/NAME` each file of the package's
static/ directory (gpukillctl/web/static/, shipped as package data), nothing else.

The files are read once, when the app is built: what can be served is that fixed set, looked up by its exact
name, so no request path (`/static/../gate.py`, `%2e%2e`, a symlink made later) reaches anything else on disk.
Only the kinds of file the page uses are served, each with its own Content-Type (a browser told nosniff runs
a script only when it is text/javascript). The assets are revalidated on each load (no-cache with an ETag: an
upgraded package is seen at once, an unchanged file costs a 304); the gate (gpukillctl/http/gate.py) gives
every other response, `/` included, no-store and the security headers.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

STATIC_DIR = Path(__file__).parent / "static"
INDEX = "index.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".txt": "text/plain; charset=utf-8",  # a vendored library's licence
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
MAX_FILE = 4 << 20  # bytes; the page's files are far smaller: anything bigger is not ours


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(directory: Path = STATIC_DIR) -> dict[str, Asset]:
    """The files of `directory` that may be served, by name: regular files (not links) of a known kind."""
    found: dict[str, Asset] = {}
    if not directory.is_dir():
        return found
    for path in sorted(directory.iterdir()):
        kind = CONTENT_TYPES.get(path.suffix.lower())
        if kind is None or not _NAME.fullmatch(path.name) or path.is_symlink() or not path.is_file():
            continue
        body = path.read_bytes()[: MAX_FILE + 1]
        if len(body) > MAX_FILE:
            continue
        found[path.name] = Asset(body, kind, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return found


def page_routes(directory: Path = STATIC_DIR) -> list[Route]:
    """`/` and `/static/{name}`, from the files of `directory` as they are now."""
    assets = load_assets(directory)

    async def index(request: Request) -> Response:
        asset = assets.get(INDEX)
        if asset is None:
            return JSONResponse(
                {"error": "NotFound", "message": f"the dashboard's {INDEX} is not installed"}, status_code=404
            )
        return Response(asset.body, media_type=asset.content_type)

    async def static(request: Request) -> Response:
        asset = assets.get(request.path_params["name"])
        if asset is None:
            return JSONResponse({"error": "NotFound", "message": "no such file of the dashboard"}, status_code=404)
        cache = {"cache-control": "no-cache", "etag": asset.etag}
        if request.headers.get("if-none-match") == asset.etag:
            return Response(status_code=304, headers=cache)
        return Response(asset.body, media_type=asset.content_type, headers=cache)

    return [Route("/", index, methods=["GET"]), Route("/static/{name}", static, methods=["GET"])]
