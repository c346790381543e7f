"""The documentation in rooms: README.md is the front door, under 250 lines, that opens on the commands to set up
(`make demo`, `make test`, `make sandbox`) and links every page of docs/; every relative link of README.md and
docs/*.md reaches a file that exists, and each #anchor a heading of that file (as GitHub makes anchors from
headings); every repository path the pages write in backticks exists; the Architecture table of
docs/development.md lists exactly the folders of Python modules in gpukill/, gpukilld/ and gpukillctl/, so a
folder added, moved or removed without the table fails here; and the policy the README's first five minutes
load is a valid one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpukill.policy import load_texts

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DEVELOPMENT = REPO / "docs" / "development.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
PACKAGES = ("gpukill", "gpukilld", "gpukillctl")
# top-level folders of the repository: a backticked path starting with one of them names a file of the checkout
TOP = (
    "gpukill",
    "gpukilld",
    "gpukillctl",
    "tests",
    "bench",
    "deploy",
    "dbus",
    "systemd",
    "polkit",
    "packaging",
    "examples",
    "man",
    "docs",
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and code spans: where a link is a link."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(text: str) -> list[str]:
    """The headings of a Markdown text, fenced code blocks (a `# comment` in a shell block) left out."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            found.append(m.group(1).strip())
    return found


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces as hyphens, and a repeated
    one numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def test_the_readme_is_a_front_door_under_250_lines():
    assert len(README.read_text().splitlines()) < 250


def test_the_readme_opens_on_the_commands_to_set_up():
    """Before the first section, after what gpukill is: the first code block, with make demo, test, sandbox."""
    text = README.read_text()
    before_sections = text[: text.index("\n## ")]
    blocks = re.findall(r"^```sh\n(.*?)^```", before_sections, re.M | re.S)
    assert blocks, "the README's opening shows no commands"
    commands = [line.split("#")[0].strip() for line in blocks[0].splitlines()]
    assert commands == ["make demo", "make test", "make sandbox"], commands
    makefile = (REPO / "Makefile").read_text()
    assert all(re.search(rf"^{c.split()[1]}:", makefile, re.M) for c in commands)


def test_there_are_docs_pages_and_the_readme_links_every_one():
    assert len(DOCS) >= 5, DOCS
    linked = {(README.parent / target.split("#")[0]).resolve() for target in links(README)}
    missing = [page.name for page in DOCS if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (where.suffix != ".md" or anchor not in anchors(where.read_text())):
            broken.append(f"{target}: no heading with that anchor in {where.relative_to(REPO)}")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_in_backticks_exists(page: Path):
    """`gpukilld/rogue/score.py`, `tests/test_rest.py`, `deploy/kubernetes/`: what a reader is sent to read is
    there, so a module moved without its documentation fails here."""
    spans = re.findall(r"`([^`\s]+)`", page.read_text())
    paths = {s.rstrip(".,;:") for s in spans if re.fullmatch(rf"(?:{'|'.join(TOP)})/[\w./-]*", s)}
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"named in {page.relative_to(REPO)} but not in the repository: {missing}"


def architecture_rows() -> list[tuple[str, str]]:
    text = DEVELOPMENT.read_text()
    section = text[text.index("\n## Architecture\n") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return [(folder.strip("`").rstrip("/"), job) for folder, job, *_ in cells]


def package_folders() -> set[str]:
    """Every folder of gpukill/, gpukilld/ and gpukillctl/ that holds Python modules."""
    return {
        str(d.relative_to(REPO))
        for top in PACKAGES
        for d in [REPO / top, *(REPO / top).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }


def test_the_architecture_table_lists_exactly_the_package_folders():
    rows = architecture_rows()
    folders = [folder for folder, _ in rows]
    assert len(folders) == len(set(folders)), folders
    assert all(job for _, job in rows), rows
    assert set(folders) == package_folders(), (
        f"in the table, not the tree: {sorted(set(folders) - package_folders())}; "
        f"in the tree, not the table: {sorted(package_folders() - set(folders))}"
    )


def test_the_readmes_guard_policy_is_valid():
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README's first five minutes show no policy"
    for block in blocks:
        policy = load_texts([("README.md", block)])
        assert policy.rules and policy.settings.dry_run, "the README's first policy is tried in a dry run"


EXAMPLE_POLICIES = sorted((REPO / "examples").glob("**/*.yaml"))
GUARD_TEST = re.compile(r"gpukillctl guard test\b([^\n`#]*)")


def _header(path: Path) -> str:
    """An example's leading comment: where it says how to install and try it."""
    lines = path.read_text().splitlines()
    return "\n".join(
        line for line in lines[: next((i for i, x in enumerate(lines) if not x.startswith("#")), len(lines))]
    )


@pytest.mark.parametrize("path", [p for p in EXAMPLE_POLICIES if "guard test" in _header(p)], ids=lambda p: p.name)
def test_an_example_policys_header_tests_the_file_it_installs(path: Path):
    """`guard test` alone tests the policy in force, not the file just copied into guard.d: the header names
    the file it installs."""
    header = re.sub(r"\s+", " ", _header(path).replace("#", " "))
    installed = re.findall(r"(/etc/gpukill/guard\.d/[\w.-]+\.yaml)", header)
    assert installed, f"{path.name}: its header names no file in /etc/gpukill/guard.d"
    tests = GUARD_TEST.findall(header)
    assert tests and all(f"--policy {installed[0]}" in t for t in tests), (path.name, tests)


def test_the_readme_tests_policy_files_not_the_policy_in_force():
    text = re.sub(r"\s+", " ", README.read_text())
    tests = GUARD_TEST.findall(text)
    assert tests and all(t.strip().startswith("--policy ") for t in tests), tests
