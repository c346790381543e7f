"""sock_diag reader vs pyroute2's DiagSocket vs /proc/net/tcp, on one namespace holding N loopback connections
(2N sockets) of which a few go to a "pool" port: what one audit dump of a padded namespace costs.

    .venv/bin/python bench/sock_diag/run.py [N]      (root not needed; pyroute2 optional)

Runs in a fresh network namespace of its own when it can (unshare -rn), so the host's sockets do not count.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from gpukill.kernel import sock_diag  # noqa: E402


def best(f, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def read_table(path: str) -> list[list[str]]:
    with open(path) as f:
        return [line.split() for line in f.read().splitlines()]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * n + 256), hard))
    padding = socket.socket()
    padding.bind(("127.0.0.1", 0))
    padding.listen(4096)
    pool = socket.socket()
    pool.bind(("127.0.0.1", 23333))
    pool.listen(64)
    held = []
    for _ in range(n):
        held.append(socket.create_connection(padding.getsockname()))
        held.append(padding.accept()[0])
    held += [socket.create_connection(("127.0.0.1", 23333)) for _ in range(3)]
    program = sock_diag.bytecode(sock_diag.port_ranges([3333, 4444, 23333]), remote=True)
    everything = sock_diag.bytecode([(0, 65535)], remote=True)
    s = sock_diag.open_in(None)
    rows = {
        "own reader, kernel filter on ports": lambda: sock_diag.dump(
            s, socket.AF_INET, sock_diag.CONNECTING, program, 64 << 20
        ),
        "own reader, every connection": lambda: sock_diag.dump(
            s, socket.AF_INET, sock_diag.CONNECTING, everything, 64 << 20
        ),
        "/proc/self/net/tcp read and split": lambda: read_table("/proc/self/net/tcp"),
    }
    try:
        from pyroute2 import DiagSocket

        ds = DiagSocket()
        ds.bind()
        rows["pyroute2 DiagSocket (no filter)"] = lambda: ds.get_sock_stats(
            family=socket.AF_INET, states=sock_diag.CONNECTING
        )
    except ImportError:
        pass
    print(f"{2 * n + 3} connected sockets, 3 to a pool port")
    for name, f in rows.items():
        print(f"  {name:<40} {best(f) * 1000:8.2f} ms")


if __name__ == "__main__":
    if os.environ.get("_SOCK_DIAG_BENCH") is None and os.system("unshare -rn true 2>/dev/null") == 0:
        os.environ["_SOCK_DIAG_BENCH"] = "1"
        os.execvp(
            "unshare", ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, *sys.argv]
        )
    main()
