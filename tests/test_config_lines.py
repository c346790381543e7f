"""The line an error about gpukilld.conf (or its drop-in of audit settings) names is the line configparser read
the key from: option names in any case, headers and keys with inline comments (gpukilld/ini.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpukill.errors import ConfigError
from gpukilld import audit_settings
from gpukilld.config import load_config
from gpukilld.ini import line_of


def _error(conf: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(str(conf))
    return str(e.value)


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("daemon", "Sample_Interval", "soon"),
        ("usage", "KEEP_DAYS", "0"),
        ("notify", "Smtp_Port", "99999"),
        ("audit", "Idle_After", "forever"),
    ],
)
def test_a_mixed_case_key_in_the_main_file_names_its_line(tmp_path: Path, section: str, key: str, value: str):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(f"# comment\n[{section}]   # the section\n\n{key} = {value}\n")
    assert f"{conf}:4: " in _error(conf)


def test_a_mixed_case_key_in_the_drop_in_names_its_line(tmp_path: Path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[audit]\nidle_after = 60\n")
    dropin = Path(audit_settings.dropin_path(str(conf)))
    dropin.parent.mkdir()
    dropin.write_text("[audit]\nmin_score = 5\n; a comment\nAbuser_Share = 200\n")
    assert _error(conf).startswith(f"{dropin}:4: ")
    dropin.write_text("[audit]\nmin_score = 5\nIdle_Min_Memory: lots\n")
    assert _error(conf).startswith(f"{dropin}:3: ")


def test_an_unknown_mixed_case_key_names_its_line(tmp_path: Path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[guard]\npolicy_dir = /srv\nNo_Such_Key = 1\n")
    assert _error(conf).startswith(f"{conf}:3: unknown key 'no_such_key'")


def test_line_of_reads_as_configparser_does():
    text = (
        "; comment\n[daemon] # inline\n#Backends = x\nBackends : nvidia  ; inline\n[ audit ]\nbackends = 1\n[audit]\n"
    )
    assert line_of(text, "daemon", "backends") == 4
    assert line_of(text, "audit", "backends") is None  # "[ audit ]" is the section " audit "
    assert line_of(text, " audit ", "backends") == 6
    assert line_of(text, "daemon", "simulate") is None
