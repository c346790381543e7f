"""The import graph: the clients never reach into the daemon, the shared package depends on neither, no cycles;
and inside each package the folders by concern, with their arrows one way (LAYERS below).

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


# The folders, each one concern, and who may import whom inside a package (the other packages: ALLOWED).
# gpukillctl: client/ (the typed API and its transports) and http/ (what both HTTP servers share) at the bottom,
# one folder per front end above them, and cli/, the commands, whose dispatcher alone reaches the front ends.
FRONT_ENDS = ("top", "notify", "serve", "exporter")
CLIENT_FOLDERS: dict[str, set[str]] = {
    "client": {"client"},
    "http": {"http", "client"},  # client/ for the exit codes (http/listen.py: ServeError's default status)
    **{front_end: {front_end, "client", "http"} for front_end in FRONT_ENDS},
    "web": {"web", "client", "http"},  # the dashboard's parts, which serve/ composes into its app
    "serve": {"serve", "client", "http", "web"},
    "cli": {"cli", "client", *FRONT_ENDS},  # the front ends through DISPATCHED only
    "root": {"root", "cli"},  # `python -m gpukillctl` is the CLI
}
CLIENT_ROOT = {"gpukillctl", "gpukillctl.__main__"}  # the modules gpukillctl/ may hold outside a folder
# What of a front end cli/ may import, and from where: the entry points (register, cmd_*) it dispatches to.
DISPATCHER = "gpukillctl.cli.main"
DISPATCHED = {
    "gpukillctl.top.app",
    "gpukillctl.top.monitor",
    "gpukillctl.notify.agent",
    "gpukillctl.serve.server",
    "gpukillctl.serve.mcp_cli",
    "gpukillctl.exporter.main",
}
# gpukilld: data flows up this list, from the base (the snapshot's records, the configuration and the audit's
# settings it reads, the journal writer, the bus names) through /proc, the backends, sampling, access, the
# rogue audit, the acts on processes and devices, Guard and usage accounting, to the bus; main.py wires them
# all. A folder imports its own and those before it, never one after it.
DAEMON_FLOW = ("base", "proc", "backends", "sampling", "access", "rogue", "acts", "guard", "usage", "bus", "main")
DAEMON_ROOT = {
    "gpukilld": "base",
    "gpukilld.model": "base",
    "gpukilld.config": "base",
    "gpukilld.audit_settings": "base",
    "gpukilld.journal": "base",
    "gpukilld.names": "base",
    "gpukilld.files": "base",
    "gpukilld.ini": "base",
    "gpukilld.main": "main",
    "gpukilld.__main__": "main",
}
# No folder holds more than about 12 modules at one level (gpukill/ holds 13, all one concern: the records and
# rules both sides read); __init__ and __main__ are not counted.
MAX_MODULES = 13


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules(root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


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


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    modules = our_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def folders_of(root: Path = REPO) -> dict[str, str | None]:
    """Each module's folder (a subpackage of its package is its folder's, backends/drm/ is backends/), "root",
    "base" or "main" for the modules a package may hold outside a folder, or None: in no known folder."""
    out: dict[str, str | None] = {}
    for name, path in our_modules(root).items():
        parts = path.relative_to(root).parent.parts
        pkg, folder = parts[0], parts[1] if len(parts) > 1 else None
        if pkg == "gpukill":
            out[name] = "gpukill"
        elif pkg == "gpukillctl":
            out[name] = (
                folder
                if folder in CLIENT_FOLDERS and folder != "root"
                else "root"
                if folder is None and name in CLIENT_ROOT
                else None
            )
        else:
            out[name] = folder if folder in DAEMON_FLOW[1:-1] else DAEMON_ROOT.get(name) if folder is None else None
    return out


def folder_violations(graph: dict[str, set[str]], folders: dict[str, str | None]) -> list[str]:
    """Every import against the folders' directions; modules in no folder are reported by outside_folders."""
    wrong = []
    for importer, targets in sorted(graph.items()):
        pkg, here = importer.split(".")[0], folders.get(importer)
        for target in sorted(targets):
            there = folders.get(target)
            if target.split(".")[0] != pkg or here is None or there is None or here == there:
                continue
            if pkg == "gpukillctl":
                if there not in CLIENT_FOLDERS[here]:
                    wrong.append(
                        f"{importer} ({here}/) imports {target} ({there}/): "
                        f"{here}/ may import only {', '.join(sorted(CLIENT_FOLDERS[here]))}"
                    )
                elif here == "cli" and there in FRONT_ENDS and (importer != DISPATCHER or target not in DISPATCHED):
                    wrong.append(
                        f"{importer} imports {target}: cli/ reaches a front end only from {DISPATCHER}, "
                        f"and only its entry point ({', '.join(sorted(DISPATCHED))})"
                    )
            elif pkg == "gpukilld" and DAEMON_FLOW.index(there) > DAEMON_FLOW.index(here):
                wrong.append(
                    f"{importer} ({here}) imports {target} ({there}): against the flow {' <- '.join(DAEMON_FLOW)}"
                )
    return wrong


def outside_folders(folders: dict[str, str | None]) -> list[str]:
    return sorted(name for name, folder in folders.items() if folder is None)


def crowded_folders(root: Path = REPO) -> list[str]:
    """The folders holding more than MAX_MODULES modules side by side."""
    out = []
    for directory in sorted({p.parent for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}):
        modules = [p.name for p in directory.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > MAX_MODULES:
            out.append(f"{directory.relative_to(root)}/ holds {len(modules)} modules (at most {MAX_MODULES})")
    return out


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
    assert {"gpukill.policy", "gpukilld.main", "gpukillctl.cli.main", "gpukillctl.client.dbus"} <= set(graph)
    assert "gpukilld.bus.manager" in graph["gpukilld.main"]  # an edge the daemon has: the reader sees imports
    assert any(m.startswith("gpukill.") for m in graph["gpukilld.proc.procfs"])


def test_each_package_imports_only_what_it_may():
    wrong = [
        f"{importer} imports {target}"
        for importer, targets in import_graph().items()
        for target in sorted(targets)
        if target.split(".")[0] not in ALLOWED[importer.split(".")[0]]
    ]
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
    probe = (
        "import sys; import gpukillctl.cli.main, gpukillctl.client.dbus; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gpukilld'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_one_shot_path_loads_no_event_loop():
    # gpukillctl list/kill/reset/status/guard/audit start in ~1/3 of the time without asyncio and dbus-fast
    # (gpukillctl/client/blocking.py): an eager import of either anywhere on that path undoes it. The path
    # here is what `gpukillctl list --json` and `gpukill --list` import before they connect.
    probe = (
        "import sys; import gpukillctl.cli.main, gpukillctl.cli.compat, gpukillctl.client.blocking; "
        "gpukillctl.cli.main.build_parser(full=False).parse_args(['list', '--json']); "
        "gpukillctl.cli.compat.plan(['--kill', '--pid', '12']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'dbus_fast')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_module_lies_in_a_known_folder():
    # A new module goes into the folder of its concern, or a new folder into the rules above with its place.
    folders = folders_of()
    assert not outside_folders(folders), "modules outside every folder:\n" + "\n".join(outside_folders(folders))
    # and every folder the rules name holds modules (a rule for a folder that is gone would check nothing)
    assert set(CLIENT_FOLDERS) | set(DAEMON_FLOW) <= set(folders.values())


def test_the_folders_import_only_what_they_may():
    wrong = folder_violations(import_graph(), folders_of())
    assert not wrong, "\n".join(wrong)


def test_no_folder_is_crowded():
    crowded = crowded_folders()
    assert not crowded, "\n".join(crowded)


def test_the_folder_rules_report_what_breaks_them():
    # The checks above pass on an empty answer: on a small graph with each kind of wrong arrow, they must speak.
    folders = {
        "gpukillctl.top.app": "top",
        "gpukillctl.serve.server": "serve",
        "gpukillctl.client.api": "client",
        "gpukillctl.cli.main": "cli",
        "gpukillctl.cli.compat": "cli",
        "gpukillctl.top.model": "top",
        "gpukilld.rogue.score": "rogue",
        "gpukilld.bus.door": "bus",
        "gpukilld.model": "base",
        "gpukilld.main": "main",
        "gpukilld.stray": None,
    }
    graph = {
        "gpukillctl.top.app": {"gpukillctl.serve.server", "gpukillctl.client.api"},  # a front end on another
        "gpukillctl.client.api": {"gpukillctl.cli.main"},  # the bottom reaching up
        "gpukillctl.cli.compat": {"gpukillctl.top.app"},  # a front end, not from the dispatcher
        "gpukillctl.cli.main": {"gpukillctl.top.model", "gpukillctl.top.app"},  # past the entry point
        "gpukilld.rogue.score": {"gpukilld.bus.door", "gpukilld.model"},  # a lower folder on a higher one
        "gpukilld.main": {"gpukilld.bus.door", "gpukilld.rogue.score", "gpukilld.stray"},
    }
    wrong = folder_violations(graph, folders)
    assert [w.split(" imports ")[0] for w in wrong] == [
        "gpukillctl.cli.compat",
        "gpukillctl.cli.main",
        "gpukillctl.client.api (client/)",
        "gpukillctl.top.app (top/)",
        "gpukilld.rogue.score (rogue)",
    ], "\n".join(wrong)
    assert "gpukillctl.top.model" in wrong[1] and "gpukillctl.serve.server" in wrong[3] and "bus" in wrong[4]
    assert outside_folders(folders) == ["gpukilld.stray"]


def test_a_flat_package_is_reported(tmp_path):
    # A tree without folders (one module per concern side by side at the package's root): every
    # module outside a folder is named, and the crowded root too.
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for i in range(MAX_MODULES + 1):
        (tmp_path / "gpukillctl" / f"front_end_{i}.py").write_text("from . import front_end_0\n" if i else "")
    (tmp_path / "gpukilld" / "bouncer.py").write_text("from . import model\n")
    (tmp_path / "gpukilld" / "model.py").write_text("")
    folders = folders_of(tmp_path)
    assert outside_folders(folders) == sorted(
        [f"gpukillctl.front_end_{i}" for i in range(MAX_MODULES + 1)] + ["gpukilld.bouncer"]
    )
    assert crowded_folders(tmp_path) == [f"gpukillctl/ holds {MAX_MODULES + 1} modules (at most {MAX_MODULES})"]
