"""Guard settings in gpukilld.conf ([guard], [notify]) and the state kept across restarts (state.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from gpukill.errors import ConfigError
from gpukilld.config import DEFAULT_PROTECTED_UNITS, load_config, read_sys_uid_max
from gpukilld.guard.state import STATE_FILE, GuardState, load_state, save_state


def test_guard_and_notify_sections(tmp_path: Path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(
        "[guard]\npolicy_dir = /srv/guard.d\nstate_dir = /srv/state\n"
        "[notify]\nsmtp_host = relay.example\nsmtp_port = 2525\nfrom = gpu@example.com\ntimeout = 2.5\n"
    )
    c = load_config(str(conf))
    assert (c.guard_policy_dir, c.guard_state_dir) == ("/srv/guard.d", "/srv/state")
    assert (c.smtp_host, c.smtp_port, c.mail_from, c.notify_timeout) == ("relay.example", 2525, "gpu@example.com", 2.5)
    defaults = load_config(str(tmp_path / "missing.conf"))
    assert (defaults.guard_policy_dir, defaults.guard_state_dir) == ("/etc/gpukill/guard.d", "/var/lib/gpukill")
    assert (defaults.smtp_host, defaults.smtp_port) == ("localhost", 25)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[notify]\nsmtp_port = 99999\n", ":2: smtp_port must be between 1 and 65535"),
        ("[notify]\n\nsmtp_port = twenty-five\n", ":3: smtp_port must be a number"),
        ("[notify]\ntimeout = nan\n", ":2: timeout must be between"),
        ("[notify]\nsmtp_server = x\n", ":2: unknown key 'smtp_server' in [notify]"),
        ("[guard]\npolicy_dir =\n", ":2: policy_dir must not be empty"),
        ("[guard]\n\nprotect_system_users = maybe\n", ":3: protect_system_users must be yes or no"),
        ("[guard]\nprotected_units = dbus.service sshd\n", ":2: protected_units: 'sshd' is not a unit name or pattern"),
    ],
)
def test_bad_guard_settings_name_the_line(tmp_path: Path, text: str, message: str):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(conf))
    assert str(info.value).startswith(str(conf)) and message in str(info.value)


def test_protection_settings(tmp_path: Path):
    conf = tmp_path / "gpukilld.conf"
    conf.write_text("[guard]\nprotect_system_users = no\nprotected_units = dbus.service, getty@*.service\n")
    c = load_config(str(conf))
    assert (c.guard_protected_uid_max, c.guard_protected_units) == (None, ("dbus.service", "getty@*.service"))
    conf.write_text("[guard]\nprotect_system_users = yes\nprotected_units =\n")  # empty: no unit is protected
    c = load_config(str(conf))
    assert (c.guard_protected_uid_max, c.guard_protected_units) == (read_sys_uid_max(), ())
    defaults = load_config(str(tmp_path / "missing.conf"))
    assert defaults.guard_protected_uid_max == read_sys_uid_max()
    assert defaults.guard_protected_units == DEFAULT_PROTECTED_UNITS
    assert {"dbus.service", "systemd-*.service", "gpukilld.service", "sshd.service"} <= set(DEFAULT_PROTECTED_UNITS)


def test_sys_uid_max_comes_from_login_defs(tmp_path: Path):
    defs = tmp_path / "login.defs"
    defs.write_text("#SYS_UID_MAX\t\t  999\nUID_MIN\t\t\t 1000\n")  # Debian's: commented out
    assert read_sys_uid_max(str(defs)) == 999
    defs.write_text("SYS_UID_MIN   201\nSYS_UID_MAX   499\n")  # an older layout: regular users from 500
    assert read_sys_uid_max(str(defs)) == 499
    defs.write_text("SYS_UID_MAX lots\n")
    assert read_sys_uid_max(str(defs)) == 999
    assert read_sys_uid_max(str(tmp_path / "absent")) == 999


def test_state_round_trip_is_atomic_and_private(tmp_path: Path):
    state = GuardState(
        enabled=False,
        dry_run=True,
        stats={"miners": {"kills": 3}},
        recent=[{"time": 1.0, "rule": "miners"}],
        policy_source="loaded",
        policy_files=[("p.yaml", "rules: []\n")],
    )
    save_state(str(tmp_path / "state"), state)
    path = tmp_path / "state" / STATE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "state").iterdir()] == [STATE_FILE]  # no temporary file left
    loaded, warning = load_state(str(tmp_path / "state"))
    assert warning is None and loaded == state


def test_an_unreadable_state_is_kept_aside_and_defaults_are_used(tmp_path: Path):
    (tmp_path / STATE_FILE).write_text("{not json")
    loaded, warning = load_state(str(tmp_path))
    assert loaded == GuardState() and "kept as guard-state.json.broken" in warning
    assert (tmp_path / f"{STATE_FILE}.broken").read_text() == "{not json"
    (tmp_path / STATE_FILE).write_text(json.dumps({"enabled": "yes", "dry_run": True, "stats": [1]}))
    loaded, warning = load_state(str(tmp_path))  # wrong types: that field only falls back to its default
    assert warning is None and loaded.enabled is True and loaded.dry_run is True and loaded.stats == {}


def test_a_missing_state_is_the_default(tmp_path: Path):
    assert load_state(str(tmp_path / "nowhere")) == (GuardState(), None)
    assert not os.path.exists(tmp_path / "nowhere")  # reading never creates the directory
