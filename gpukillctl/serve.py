"""`gpukillctl serve`: the REST API (/v1) and the MCP server (/mcp) over HTTP, in one uvicorn process, as the
user who runs it (gpukillctl/serve_app.py composes the app; gpukillctl/http_gate.py checks every request).

The HTTP surface, and why:
- A secret token for the server's life, required on every request. Loopback TCP is reachable by every local
  user: without it, bob could act as alice through alice's server. It is made at start (256 bits from
  `secrets`), written 0600 to $XDG_RUNTIME_DIR/gpukill/serve-PORT.token (the directory 0700, both the user's),
  removed at exit, and printed once as a header ready to paste, as Jupyter prints its URL. Printed only to a
  terminal: under the user unit stderr goes to the journal, which the adm and systemd-journal groups read, so
  there the line names the file instead. `--token-file FILE` uses a token the user keeps (the file must be
  the user's and unreadable to others), for clients configured once, and for other machines.
- 127.0.0.1 unless --listen names another address, and then only with --token-file: a token that changes at
  each start is no way to reach a server from another machine, and a server reachable from the network with
  an accidental default is refused rather than started.
- Host and Origin are checked (DNS rebinding); the hosts are the loopback names, the --listen address, the
  machine's names, and --allow-host.

Registered by cli.py without importing FastAPI, uvicorn or the MCP SDK: they are the optional extra `serve`,
and only this command needs them (it says what to install, in one line, when they are missing).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import pwd
import secrets
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from .client import GpukillClient
from .exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

PROG = "gpukillctl serve"
INSTALL_HINT = "pip install 'gpukill[serve]'"
DEFAULT_PORT = 3001
MIN_TOKEN_CHARS = 32  # a token file's secret: at least this long, so that it cannot be guessed either
MAX_TOKEN_CHARS = 4096
SDK_MODULES = ("mcp", "mcp_types", "pydantic", "pydantic_core", "anyio", "starlette", "fastapi", "uvicorn")


class ServeError(Exception):
    """Why the server does not start: one line, with the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def port_number(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the REST API (/v1) and MCP (/mcp) over HTTP, token-protected, as you",
        description="One HTTP server, as the user who runs it: the REST API under /v1 (OpenAPI at "
        "/v1/openapi.json) and the MCP Streamable HTTP endpoint at /mcp. Every request needs the "
        "server's token (Authorization: Bearer TOKEN): made at start, kept in "
        "$XDG_RUNTIME_DIR/gpukill/serve-PORT.token, printed once. polkit decides each kill and "
        f"reset as for gpukillctl. Needs the optional packages ({INSTALL_HINT}). The user unit "
        "gpukill-serve.service runs it. See gpukillctl(1).",
    )
    p.add_argument(
        "--listen",
        metavar="ADDR",
        default="127.0.0.1",
        help="the address to bind (default 127.0.0.1); one not on loopback needs --token-file",
    )
    p.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="use the token in FILE (yours, unreadable to others) instead of making one",
    )
    p.add_argument(
        "--allow-host",
        metavar="NAME",
        action="append",
        default=[],
        help="also answer requests whose Host is NAME (a name clients use for this machine); repeatable",
    )
    p.set_defaults(offline=cmd_serve)


# -- where and with what secret ---------------------------------------------------------------------------


def is_loopback(address: str) -> bool:
    """Whether every address `address` resolves to is a loopback one."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def allowed_hosts(listen: str, port: int, extra: list[str]) -> list[str]:
    """The Host headers this server answers: host:port for each name clients may use for it."""
    names = ["127.0.0.1", "localhost", "[::1]"]
    if not is_loopback(listen):
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(listen)
            if not address.is_unspecified:
                names.append(f"[{address}]" if address.version == 6 else str(address))
        if not _is_ip(listen):
            names.append(listen)
        names += [socket.gethostname(), socket.getfqdn()]
    hosts = [f"{name}:{port}" for name in names]
    for name in extra:  # as given (a proxy on port 80 sends no port) and with this port
        hosts += [name, f"{name}:{port}"] if ":" not in name.strip("[]") or name.startswith("[") else [name]
    return list(dict.fromkeys(h.lower() for h in hosts))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def allowed_origins(hosts: list[str]) -> list[str]:
    return [f"{scheme}://{host}" for host in hosts for scheme in ("http", "https")]


def read_token_file(path: str) -> str:
    """The token in a file of the user's that nobody else can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError as e:
        raise ServeError(f"--token-file {path}: {e.strerror}", EXIT_USAGE) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ServeError(f"--token-file {path}: not a regular file", EXIT_USAGE)
        if st.st_uid != os.getuid():
            raise ServeError(f"--token-file {path}: not yours (owned by uid {st.st_uid})", EXIT_USAGE)
        if st.st_mode & 0o077:
            raise ServeError(
                f"--token-file {path}: readable or writable by others (mode {st.st_mode & 0o777:o}): "
                f"chmod 600 it",
                EXIT_USAGE,
            )
        raw = f.read(MAX_TOKEN_CHARS + 1)
    token = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_TOKEN_CHARS or not token.isprintable() or " " in token or len(token) < MIN_TOKEN_CHARS:
        raise ServeError(
            f"--token-file {path}: the token must be one line of {MIN_TOKEN_CHARS} to "
            f"{MAX_TOKEN_CHARS} printable ASCII characters without spaces "
            f"(e.g. `openssl rand -hex 32`)",
            EXIT_USAGE,
        )
    return token


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/gpukill, made 0700; refused when it is not the user's own directory."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if not base or not os.path.isabs(base):
        raise ServeError("XDG_RUNTIME_DIR is not set (no login session): give --token-file FILE", EXIT_USAGE)
    path = Path(base) / "gpukill"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ServeError(f"{path} is not a directory of yours that only you can use", EXIT_FAILURE)
    return path


@dataclass
class TokenFile:
    """The token made at start, in its file while the server runs."""

    path: Path
    token: str

    @classmethod
    def create(cls, directory: Path, port: int) -> TokenFile:
        token = secrets.token_urlsafe(32)
        path = directory / f"serve-{port}.token"
        staged = directory / f".serve-{port}.token.{os.getpid()}"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(staged, path)  # a file left by a server that died is replaced whole
        return cls(path, token)

    def remove(self) -> None:
        """Remove the file if it still holds our token (another server on this port may have replaced it)."""
        with contextlib.suppress(OSError):
            if self.path.read_text().strip() == self.token:
                self.path.unlink()


def bind(listen: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            listen, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise ServeError(f"cannot listen on {listen}: {getattr(e, 'strerror', None) or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {listen} port {port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def url_of(listen: str, port: int) -> str:
    host = "127.0.0.1" if listen in ("0.0.0.0", "::") else listen
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# -- running ---------------------------------------------------------------------------------------------


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        return serve(args)
    except ServeError as e:
        say(str(e))
        return e.code


def serve(args: argparse.Namespace) -> int:
    if not is_loopback(args.listen) and args.token_file is None:
        raise ServeError(
            f"--listen {args.listen} is not a loopback address: give --token-file FILE too (a token "
            f"the clients of other machines can be given); refusing to start",
            EXIT_USAGE,
        )
    token = read_token_file(args.token_file) if args.token_file is not None else None
    directory = runtime_dir() if token is None else None
    try:
        from . import serve_app
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SDK_MODULES:
            raise
        raise ServeError(
            f"the HTTP server needs the optional packages ({e.name} is missing): {INSTALL_HINT}"
        ) from None
    sock = bind(args.listen, args.port)
    made = TokenFile.create(directory, args.port) if directory is not None else None
    try:
        hosts = allowed_hosts(args.listen, args.port, args.allow_host)
        app = serve_app.build_app(
            GpukillClient.connect,
            token=token or made.token,
            allowed_hosts=hosts,
            allowed_origins=allowed_origins(hosts),
        )
        announce(args, made)
        return EXIT_OK if serve_app.run(app, sock) else EXIT_FAILURE
    finally:
        sock.close()
        if made is not None:
            made.remove()


def announce(args: argparse.Namespace, made: TokenFile | None) -> None:
    """Once, at start: where, as whom, and the header to send."""
    user = pwd.getpwuid(os.getuid()).pw_name
    url = url_of(args.listen, args.port)
    say(f"serving as {user} on {url}: REST under {url}/v1, MCP at {url}/mcp")
    if made is None:
        say(f"send the token of {args.token_file}:")
        print(f"    Authorization: Bearer $(cat {args.token_file})", file=sys.stderr, flush=True)
        return
    say(f"token in {made.path}; send it as the header:")
    shown = made.token if sys.stderr.isatty() else f"$(cat {made.path})"  # not into the journal (see above)
    print(f"    Authorization: Bearer {shown}", file=sys.stderr, flush=True)
