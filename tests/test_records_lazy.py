"""gpukill.records loads each group of records on first use (gpukill/records/__init__.py): every public name
still comes from `gpukill.records`, and the one-shot listing path builds only the listing's records."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gpukill.records as records

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpukill" / "records"
LAZY_MODULES = ("manager", "status", "audit", "guard", "signals")


def declared(module: str) -> set[str]:
    """The public names a module of the package defines at its top level (not those it imports), read with ast."""
    out: set[str] = set()
    for node in ast.parse((PACKAGE / f"{module}.py").read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {name for name in out if not name.startswith("_")}


@pytest.mark.parametrize("module", LAZY_MODULES)
def test_every_public_name_is_found_from_the_package(module):
    names = declared(module)
    assert names, module
    homes = {name: home for name, home in records._HOME.items() if home == module}
    assert set(homes) == names, f"records._HOME and gpukill/records/{module}.py disagree"
    declaring = __import__(f"gpukill.records.{module}", fromlist=["_"])
    for name in names:
        assert getattr(records, name) is getattr(declaring, name)
        assert name in records.__all__ and name in dir(records)


def test_base_names_are_in_all():
    for name in declared("base"):
        assert getattr(records, name) is not None and name in records.__all__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nonesuch'"):
        records.Nonesuch  # noqa: B018
    with pytest.raises(ImportError):
        from gpukill.records import Nonesuch  # noqa: F401


def test_the_listing_path_builds_only_the_listings_records():
    # What `gpukillctl list --json` imports before it connects: the audit's, the Guard's and the signals'
    # records (21 of the 24 dataclasses, ~7 ms) must not come with it.
    probe = ("import sys; import gpukillctl.cli.main, gpukillctl.client.blocking; "
             "gpukillctl.cli.main.build_parser(full=False).parse_args(['list', '--json']); "
             "print(sorted(m for m in sys.modules if m.startswith('gpukill.records.')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['gpukill.records.base', 'gpukill.records.manager']", out.stdout
