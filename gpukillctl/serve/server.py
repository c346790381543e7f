"""`gpukillctl serve`: the web dashboard (/), the REST API (/v1) and the MCP server (/mcp) over HTTP, in one
uvicorn process, as the user who runs it (gpukillctl/serve/app.py composes the app and runs it;
gpukillctl/http/gate.py checks every request).

The HTTP surface, and why:
- A Unix socket by default, $XDG_RUNTIME_DIR/gpukill/serve.sock (the directory 0700, the socket 0600, both
  the user's): only the user (and root) can connect, and nobody else can take the address while the server
  is down. On loopback TCP any local user can: bind 127.0.0.1:3001 while alice's server is not running
  (logout, crash, restart) and every client that sends its token there hands it to bob. TCP only when asked,
  with `--tcp ADDR:PORT` (one spelling, which says what it is), for what cannot use a socket (an assistant
  configured with an http:// URL, other machines).
- A secret token for the server's life, required on every request, on the socket too (one rule for every
  client, and a second lock behind the file mode). It is made at start (256 bits from `secrets`), written
  0600 beside the socket as serve.token (serve-PORT.token for TCP), removed at exit, and printed once as a
  header ready to paste, as Jupyter prints its URL. Printed only to a terminal: under the user unit stderr goes
  to the journal, which the adm and systemd-journal groups read, so there the line names the file instead.
  `--token-file FILE` uses a token the user keeps (the file must be the user's and unreadable to others), for
  clients configured once, and for other machines.
- TCP on an address not on loopback only with --token-file: a token that changes at each start is no way to
  reach a server from another machine, and a server reachable from the network with an accidental
  default is refused rather than started.
- Host and Origin are checked (DNS rebinding); the hosts are the loopback names (with the port on TCP, bare
  on the socket, where clients write http://localhost/), the --tcp address, the machine's names, and
  --allow-host.
- A person logs in to the dashboard as in Jupyter, with a one-time link (URL/login?code=CODE: single use, 10
  minutes) that sets a session cookie: `--open` opens the browser on it (webbrowser, which honours $BROWSER),
  in a thread, since a browser command may not return until the browser ends, and the server must answer it
  meanwhile; without --open, on TCP, the link is printed once, to a terminal only, like the token. `--open`
  without --tcp listens on 127.0.0.1 on a port the kernel picks: a browser cannot reach the socket, and a fixed
  port is one another user could take first. POST /login/link with the token makes a new link.
- `--host [USER@]HOST[:PORT]` (repeatable) and `--hosts-file FILE` add machines to the dashboard, each read
  over ssh as `gpukillctl -H` does (gpukillctl/web/hosts.py parses them before anything starts).

Registered by gpukillctl/cli/main.py without importing FastAPI, uvicorn or the MCP SDK: they are the optional extra
`serve`,
and only this command needs them (it says what to install, in one line, when they are missing).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import os
import pwd
import secrets
import socket
import stat
import sys
import threading
import webbrowser
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..client.dbus import GpukillClient
from ..client.exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from ..client.ports import port_number
from ..http.listen import ServeError

if TYPE_CHECKING:
    from ..web.session import Sessions

PROG = "gpukillctl serve"
INSTALL_HINT = "pip install 'gpukill[serve]', or the package gpukill-serve"
SOCKET_NAME = "serve.sock"  # in $XDG_RUNTIME_DIR/gpukill/
MIN_TOKEN_CHARS = 32  # a token file's secret: at least this long, so that it cannot be guessed either
MAX_TOKEN_CHARS = 4096
SDK_MODULES = ("mcp", "mcp_types", "pydantic", "pydantic_core", "anyio", "starlette", "fastapi", "uvicorn")


@dataclass(frozen=True)
class TcpAddress:
    host: str  # as given, without the brackets of an IPv6 address
    port: int


def tcp_address(text: str) -> TcpAddress:
    """ADDR:PORT, [IPV6]:PORT."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"not ADDR:PORT: {text!r} (e.g. 127.0.0.1:3001)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"an IPv6 address goes in brackets: [{host}]:{port}")
    return TcpAddress(host, port_number(port))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the web dashboard (/), the REST API (/v1) and MCP (/mcp) over HTTP, token-protected, as you",
        description="One HTTP server, as the user who runs it: the web dashboard at / (log in with the "
        "one-time link --open opens, or that it prints on a terminal), the REST API under /v1 (OpenAPI at "
        "/v1/openapi.json) and the MCP Streamable HTTP endpoint at /mcp, on the Unix socket "
        f"$XDG_RUNTIME_DIR/gpukill/{SOCKET_NAME} (yours alone) unless --tcp or --open is given. Every "
        "request needs the server's token (Authorization: Bearer TOKEN) or the dashboard's session cookie: "
        "the token is made at start, kept beside the socket, printed once. polkit decides each kill and "
        f"reset as for gpukillctl. Needs the optional packages ({INSTALL_HINT}). The user unit "
        "gpukill-serve.service runs it. See gpukillctl(1).",
    )
    p.add_argument(
        "--tcp",
        metavar="ADDR:PORT",
        type=tcp_address,
        help="listen on TCP instead of the Unix socket (e.g. 127.0.0.1:3001; any local user can reach "
        "it, or take the port while the server is down); off loopback it needs --token-file",
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
    p.add_argument(
        "--open",
        action="store_true",
        help="open the dashboard in your browser ($BROWSER) with a one-time login link; without --tcp, on "
        "127.0.0.1 on a port the kernel picks (for a server already running, as the user unit: POST "
        "/login/link with its token answers a new link)",
    )
    p.add_argument(
        "--host",
        dest="hosts",
        metavar="[USER@]HOST[:PORT]",
        action="append",
        default=[],
        help="also show this host on the dashboard, read over ssh as gpukillctl -H does; repeatable",
    )
    p.add_argument(
        "--hosts-file",
        metavar="FILE",
        help="also show the hosts of FILE (one [USER@]HOST[:PORT] a line, # comments) on the dashboard",
    )
    p.set_defaults(offline=cmd_serve)


# -- where and with what secret ---------------------------------------------------------------------------


def is_loopback(address: str) -> bool:
    """Whether every address `address` resolves to is a loopback one."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    # an inet address's host is a str (typeshed's sockaddr allows the int of other families)
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def allowed_hosts(tcp: TcpAddress | None, extra: list[str]) -> list[str]:
    """The Host headers this server answers: host:port for each name clients may use for it on TCP; on the
    socket the bare name that clients put in their URL (http://localhost/...: no port is involved)."""
    if tcp is None:
        return list(dict.fromkeys(h.lower() for h in ["localhost", *extra]))
    names = ["127.0.0.1", "localhost", "[::1]"]
    if not is_loopback(tcp.host):
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(tcp.host)
            if not address.is_unspecified:
                names.append(f"[{address}]" if address.version == 6 else str(address))
        if not _is_ip(tcp.host):
            names.append(tcp.host)
        names += [socket.gethostname(), socket.getfqdn()]
    port = tcp.port
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
                f"--token-file {path}: readable or writable by others (mode {st.st_mode & 0o777:o}): chmod 600 it",
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


ROOT_RUNTIME_DIR = "/run/user/0"  # root's, as logind makes it; made here for a root shell without a login


def runtime_dir(why: str) -> Path:
    """$XDG_RUNTIME_DIR/gpukill, made 0700; refused when it is not the user's own directory. Root without
    XDG_RUNTIME_DIR (sudo -i, su, a unit) uses /run/user/0, made 0700 if logind has not: /run is root's."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if (not base or not os.path.isabs(base)) and os.getuid() == 0:
        base = ROOT_RUNTIME_DIR
        os.makedirs(base, mode=0o700, exist_ok=True)
    if not base or not os.path.isabs(base):
        raise ServeError(f"XDG_RUNTIME_DIR is not set (no login session): {why}", EXIT_USAGE)
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
    def create(cls, directory: Path, name: str) -> TokenFile:
        token = secrets.token_urlsafe(32)
        path = directory / name
        staged = directory / f".{name}.{os.getpid()}"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(staged, path)  # a file left by a server that died is replaced whole
        return cls(path, token)

    def remove(self) -> None:
        """Remove the file if it still holds our token (another server may have replaced it)."""
        with contextlib.suppress(OSError):
            if self.path.read_text().strip() == self.token:
                self.path.unlink()


def token_name(tcp: TcpAddress | None) -> str:
    return "serve.token" if tcp is None else f"serve-{tcp.port}.token"


@dataclass
class Listener:
    """The bound, listening socket, and for a Unix socket what to remove at exit."""

    sock: socket.socket
    path: Path | None = None  # the Unix socket's path
    inode: int = 0  # ... and its inode, so that only our own socket file is removed

    def close(self) -> None:
        self.sock.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                if self.path.lstat().st_ino == self.inode:
                    self.path.unlink()


def bind_tcp(tcp: TcpAddress) -> Listener:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            tcp.host, tcp.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise ServeError(f"cannot listen on {tcp.host}: {getattr(e, 'strerror', None) or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {tcp.host} port {tcp.port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return Listener(sock)


def bind_unix(directory: Path) -> Listener:
    """The socket in the user's own 0700 directory, made 0600. A socket file left by a server that died
    (nothing accepts on it) is replaced; one a running server answers on is left alone, and we do not start."""
    path = directory / SOCKET_NAME
    with contextlib.suppress(FileNotFoundError):
        st = path.lstat()
        if not stat.S_ISSOCK(st.st_mode):
            raise ServeError(f"{path} exists and is not a socket: remove it")
        if _answers(path):
            raise ServeError(f"another server already listens on {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)  # made 0600 at bind: never, even for an instant, open to the group
    try:
        sock.bind(str(path))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {path}: {e.strerror or e}") from None
    finally:
        os.umask(previous)
    sock.set_inheritable(True)
    return Listener(sock, path, path.lstat().st_ino)


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(path))
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise ServeError(f"cannot tell whether a server listens on {path}: {e.strerror}") from None
    return True


def url_of(tcp: TcpAddress | None) -> str:
    if tcp is None:
        return "http://localhost"
    host = "127.0.0.1" if tcp.host in ("0.0.0.0", "::") else tcp.host
    return f"http://[{host}]:{tcp.port}" if ":" in host else f"http://{host}:{tcp.port}"


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
    from ..web.hosts import host_specs  # the client library only: no optional package

    try:
        shown_hosts = host_specs(args.hosts, args.hosts_file)  # every name checked before anything else
    except ValueError as e:
        raise ServeError(str(e), EXIT_USAGE) from None
    tcp: TcpAddress | None = args.tcp
    if tcp is None and args.open:  # a browser reaches TCP only; port 0: the kernel's pick, no one's to take first
        tcp = TcpAddress("127.0.0.1", 0)
    if tcp is not None and not is_loopback(tcp.host) and args.token_file is None:
        raise ServeError(
            f"--tcp {tcp.host}:{tcp.port} is not on loopback: give --token-file FILE too (a token "
            f"the clients of other machines can be given); refusing to start",
            EXIT_USAGE,
        )
    token = read_token_file(args.token_file) if args.token_file is not None else None
    directory: Path | None = None  # set whenever a socket or a token file goes there
    if tcp is None:
        directory = runtime_dir("it is where the socket goes; or give --tcp ADDR:PORT --token-file FILE")
    elif token is None:
        directory = runtime_dir("it is where the token goes; give --token-file FILE")
    try:
        from . import app as serve_app
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SDK_MODULES:
            raise
        raise ServeError(f"the HTTP server needs the optional packages ({e.name} is missing): {INSTALL_HINT}") from None
    from gpukill.kernel import sock_diag

    from ..web.session import Sessions, cookie_name

    if tcp is None:
        assert directory is not None  # the runtime directory, above
        listener = bind_unix(directory)
    else:
        listener = bind_tcp(tcp)
    if tcp is not None and tcp.port == 0:
        tcp = TcpAddress(tcp.host, listener.sock.getsockname()[1])  # the port the kernel gave
    made = None
    if token is None:
        assert directory is not None  # the runtime directory, above
        made = TokenFile.create(directory, token_name(tcp))
        token = made.token
    try:
        hosts = allowed_hosts(tcp, args.allow_host)
        sessions = Sessions()
        app = serve_app.build_app(
            GpukillClient.connect,
            token=token,
            allowed_hosts=hosts,
            allowed_origins=allowed_origins(hosts),
            hosts=shown_hosts,
            sessions=sessions,
            cookie=cookie_name(None if tcp is None else tcp.port),
            base_url=url_of(tcp),
            peer_owner=None if tcp is None else sock_diag.owner,
            tunnel_ports=tcp is not None and is_loopback(tcp.host),
        )
        announce(args, tcp, listener, made, sessions)
        return EXIT_OK if serve_app.run(app, listener.sock) else EXIT_FAILURE
    finally:
        listener.close()
        if made is not None:
            made.remove()


def announce(
    args: argparse.Namespace, tcp: TcpAddress | None, listener: Listener, made: TokenFile | None, sessions: Sessions
) -> None:
    """Once, at start: where, as whom, the header to send, and how a person logs in to the dashboard."""
    user = pwd.getpwuid(os.getuid()).pw_name
    url = url_of(tcp)
    where = f"the socket {listener.path}" if listener.path is not None else url
    say(f"serving as {user} on {where}: the dashboard at {url}/, REST under {url}/v1, MCP at {url}/mcp")
    if listener.path is not None:
        say(f"e.g. curl --unix-socket {listener.path} {url}/v1/devices -H 'Authorization: Bearer ...'")
    if made is None:
        say(f"send the token of {args.token_file}:")
        print(f"    Authorization: Bearer $(cat {args.token_file})", file=sys.stderr, flush=True)
    else:
        say(f"token in {made.path}; send it as the header:")
        shown = made.token if sys.stderr.isatty() else f"$(cat {made.path})"  # not into the journal (see above)
        print(f"    Authorization: Bearer {shown}", file=sys.stderr, flush=True)
    if tcp is None:
        return  # no browser reaches the socket
    if args.open:
        open_browser(f"{url}/login?code={sessions.new_code()}")
    elif sys.stderr.isatty():  # the link is a login: on a terminal only, as the token
        say(f"log in to the dashboard once with: {url}/login?code={sessions.new_code()}")
    else:
        say(f"a one-time login link for the dashboard: POST {url}/login/link with the token, or serve with --open")


def open_browser(link: str) -> None:
    """The browser on the one-time link, in a thread: a browser command ($BROWSER=w3m) may not return until the
    browser ends, and meanwhile the server must answer it (the socket already listens: its request waits)."""

    def opening() -> None:
        if webbrowser.open(link):
            return
        if sys.stderr.isatty():  # a headless box over ssh: the link, to open elsewhere (see the tunnel in docs)
            say(f"no browser could be started (set $BROWSER); log in to the dashboard once with: {link}")
        else:
            base = link.split("/login?", 1)[0]
            say(
                f"no browser could be started (set $BROWSER): POST {base}/login/link with the token answers "
                "a one-time login link"
            )

    threading.Thread(target=opening, name="open-browser", daemon=True).start()
