"""The import graph: the clients never reach into the daemon, the shared package depends on neither, no cycles.

Every import counts, those inside functions too: a lazy import still ties two modules together (it only hides
the tie until the function runs). Read from the source with ast, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("gpukill", "gpukilld", "gpukillctl")
# Who may import whom among our packages; anything else of ours is a violation (third-party is not checked).
ALLOWED = {
    "gpukill": {"gpukill"},
    "gpukillctl": {"gpukillctl", "gpukill"},
    "gpukilld": {"gpukilld", "gpukill"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports: `from pkg import mod` names the module mod where it is one."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                continue
            while target not in modules and "." in target:  # `import gpukilld.guard.x as y` names a module
                target = target.rsplit(".", 1)[0]
            if target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"gpukill.policy", "gpukilld.main", "gpukillctl.cli", "gpukillctl.client"} <= set(graph)
    assert "gpukilld.manager" in graph["gpukilld.main"]  # an edge the daemon has: the reader sees imports
    assert any(m.startswith("gpukill.") for m in graph["gpukilld.procfs"])


def test_each_package_imports_only_what_it_may():
    wrong = [f"{importer} imports {target}"
             for importer, targets in import_graph().items() for target in sorted(targets)
             if target.split(".")[0] not in ALLOWED[importer.split(".")[0]]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    # The check above passes on an empty answer: make sure it can say something.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_client_loads_no_daemon_module():
    # At run time too: whatever gpukillctl imports when it starts, nothing of gpukilld comes with it.
    probe = ("import sys; import gpukillctl.cli, gpukillctl.client; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gpukilld'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_one_shot_path_loads_no_event_loop():
    # gpukillctl list/kill/reset/status/guard/audit start in ~1/3 of the time without asyncio and dbus-fast
    # (gpukillctl/blocking_client.py): an eager import of either anywhere on that path undoes it. The path
    # here is what `gpukillctl list --json` and `gpukill --list` import before they connect.
    probe = ("import sys; import gpukillctl.cli, gpukillctl.compat, gpukillctl.blocking_client; "
             "gpukillctl.cli.build_parser(full=False).parse_args(['list', '--json']); "
             "gpukillctl.compat.plan(['--kill', '--pid', '12']); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'dbus_fast')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
