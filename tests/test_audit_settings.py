"""The rogue-activity audit's settings as admins manage them (gpu-kill's --rogue-*-threshold, --rogue-whitelist-*,
--rogue-export-config / --rogue-import-config): GetAuditSettings, SetAuditSettings, ExportAuditSettings,
ImportAuditSettings, AuditRogueWith and `gpukillctl audit settings ...`, on the real test bed (private bus with
our policy, real polkitd with the example rules: gpkadmin administers, gpkother does not; real journald; the
daemon; real processes as real users), as tests/test_rogue_daemon.py runs the audit itself.

What must hold: a change is applied at once (the next AuditRogue reflects it) and journalled; an ordinary user is
refused by polkit (journalled); allowed users and processes are never reported and Guard's rogue_score reads 0
for them, while a miner that takes an allowed process's name is still reported; export -> import is byte-equal;
the settings survive a restart; an invalid change or import changes nothing; thresholds for one scan change
only that scan.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import pools
from helpers.marks import needs_root
from helpers.testbed import PYTHON, ROOT, SYSTEM_PYTHON, Testbed
from helpers.waiting import wait_until
from test_rogue_daemon import INTERVAL, MINER_CODE, STRATUM, finding_of, findings, start_miner

from gpukill.records.audit import AuditSettings
from gpukillctl.client.exits import EXIT_DENIED, EXIT_USAGE
from gpukilld import audit_settings
from gpukilld import journal as audit

pytestmark = needs_root

IDLE_AFTER = 3600.0  # as configured in gpukilld.conf: nothing is idle for that long in a test
TRUSTED = os.path.realpath(SYSTEM_PYTHON)  # /usr/bin/python3.X: root's, in root's folders


@pytest.fixture(scope="module")
def sbed(users):
    b = Testbed()
    pool = pools.listen(pools.free_pool_port(), 16)
    folder = f"/tmp/x-{b.scope}"
    os.makedirs(folder)
    os.chmod(folder, 0o755)
    renamed = f"{folder}/{os.path.basename(TRUSTED)}"  # a copy by the allowed executable's very name
    shutil.copy(SYSTEM_PYTHON, renamed)
    try:
        (b.workdir / "guard.d").mkdir()
        b.write_conf(
            audit={"idle_after": IDLE_AFTER, "idle_min_memory": "1MiB", "pool_ports": f"{pool.getsockname()[1]} 3333"}
        )
        b.start_system(args=["--sample-interval", str(INTERVAL)])
        b.pool_port, b.renamed = pool.getsockname()[1], renamed  # type: ignore[attr-defined]
        yield b
    finally:
        b.stop()
        pool.close()
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(folder)


@pytest.fixture
def abed(sbed):
    """The bed with the settings of gpukilld.conf again (the daemon's file removed, as an admin would, and
    reloaded), and what the test started killed after it."""
    before = len(sbed.procs)
    yield sbed
    sbed.kill_since(before)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dropin(sbed))
    r = sbed.ctl(ROOT, "audit", "settings", "import", str(defaults_file(sbed)))
    assert r.returncode == 0, r


def dropin(bed: Testbed) -> str:
    return audit_settings.dropin_path(str(bed.workdir / "gpukilld.conf"))


def defaults_file(bed: Testbed):
    """The bed's gpukilld.conf settings as an import: what every test starts from."""
    path = bed.workdir / "bed-defaults.conf"
    path.write_text(
        f"[audit]\nidle_after = {IDLE_AFTER:g}\nidle_min_memory = 1MiB\n"
        f"pool_ports = {bed.pool_port} 3333\nmin_score = 0\nallowed_users =\nallowed_processes =\n"
    )
    return path


def settings_of(bed: Testbed, user=ROOT) -> dict:
    r = bed.ctl(user, "audit", "settings", "show", "--json")
    assert r.returncode == 0, r
    return json.loads(r.stdout)["settings"]


def export(bed: Testbed) -> str:
    r = bed.ctl(ROOT, "audit", "settings", "export")
    assert r.returncode == 0, r
    return r.stdout


def journal_of(bed: Testbed, **match: str) -> list[dict]:
    return bed.journal(MESSAGE_ID=audit.AUDIT_SETTINGS.message_id, **match)


def variants(values: dict) -> dict:
    """An a{sv} as tests/clients/dbus_call.py takes it: KEY -> [signature, value]."""
    return {k: {"$variant": v} for k, v in values.items()}


def rogue_scores(bed: Testbed) -> set[int]:
    """The PIDs Guard's rogue_score reads above 0 for, through a policy tested (never acted on) as root."""
    policy = bed.workdir / "any-score.yaml"
    policy.write_text(
        "rules:\n  - name: any-score\n    action: kill\n    conditions:\n"
        "      - {type: rogue_score, operator: '>', value: 0}\n"
    )
    r = bed.ctl(ROOT, "guard", "test", "--policy", str(policy), "--json")
    assert r.returncode == 0, r
    return {pid for d in json.loads(r.stdout)["decisions"] for pid in d["pids"]}


def start_in_namespace(bed: Testbed, user, over: str, with_file: str) -> subprocess.Popen:
    """start_miner's miner, run as `over` after binding `with_file` over it in a user and mount namespace."""
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": "0",
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_MEM": "6GiB",
        "GPUKILL_SIM_UTIL": "99",
    }
    script = f'mount --bind {with_file} {over} && exec {over} "$@"'
    proc = subprocess.Popen(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            script,
            "sh",
            "-c",
            MINER_CODE,
            str(bed.pool_port),
            "-o",
            STRATUM,
            "--threads",
            "8",
        ],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **user.popen_kwargs(),
    )
    bed.procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def idle_notebook(bed: Testbed, users, held: float = 1.5):
    notebook = bed.victim(users["owner"], gpu=1, mem="2GiB", util=0, comm="notebook")
    bed.wait_listed(notebook.pid, comm="notebook")
    time.sleep(held)  # idle that long: well under IDLE_AFTER
    return notebook


def test_an_admin_changes_a_threshold_and_the_next_audit_reflects_it(abed, users):
    bed, admin = abed, users["admin"]
    notebook = idle_notebook(bed, users)
    assert finding_of(bed, ROOT, notebook.pid, "idle") is None

    r = bed.ctl(admin, "audit", "settings", "set", "idle_after=1")
    assert r.returncode == 0, r
    # applied at once: the very next AuditRogue, no wait for a sample
    found = finding_of(bed, ROOT, notebook.pid, "idle")
    assert found is not None and found["score"] == 50, findings(bed, ROOT)
    assert settings_of(bed)["idle_after"] == 1.0
    # the file the daemon keeps is the export, and gpu-kill's confidence threshold is min_score (0.7 -> 70)
    assert Path(dropin(bed)).read_text() == export(bed)
    r = bed.ctl(admin, "audit", "settings", "set", "confidence_threshold=0.7")
    assert r.returncode == 0, r
    assert settings_of(bed)["min_score"] == pytest.approx(70.0)
    assert finding_of(bed, ROOT, notebook.pid, "idle") is None  # 50 < 70: not reported any more
    assert notebook.pid in rogue_scores(bed)  # Guard's rogue_score still reads the idle finding

    entries = wait_until(
        lambda: journal_of(bed, GPUKILL_CALLER_UID=str(admin.uid), GPUKILL_RESULT="changed"),
        10,
        "the change is not in the journal",
    )
    assert {e["GPUKILL_KEYS"] for e in entries} >= {"idle_after", "min_score"}, entries
    assert all(e["GPUKILL_OPERATION"] == "set" and e["GPUKILL_FILE"] == dropin(bed) for e in entries)
    # gpu-kill's thresholds that mean nothing here are refused in one line saying why and what to use
    r = bed.ctl(admin, "audit", "settings", "set", "memory_threshold=20")
    assert r.returncode == EXIT_USAGE and len(r.stderr.strip().splitlines()) == 1, r
    assert "no meaning" in r.stderr and "guard policy add user" in r.stderr, r


def test_an_ordinary_user_is_refused_by_polkit_and_it_is_journalled(abed, users):
    bed = abed
    other = users["other"]
    before = export(bed)
    for argv in (["set", "min_score=10"], ["allow-user", other.name]):
        r = bed.ctl(other, "audit", "settings", *argv)
        assert r.returncode == EXIT_DENIED and "not authorized" in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1, r
    path = bed.workdir / "import.conf"
    path.write_text("[audit]\nmin_score = 10\n")
    os.chmod(path, 0o644)
    r = bed.ctl(other, "audit", "settings", "import", str(path))
    assert r.returncode == EXIT_DENIED, r
    assert export(bed) == before
    # reading is everyone's
    assert settings_of(bed, other)["min_score"] == 0.0
    denied = wait_until(
        lambda: journal_of(bed, GPUKILL_CALLER_UID=str(other.uid), GPUKILL_RESULT="denied"),
        10,
        "the denial is not in the journal",
    )
    assert denied[0]["GPUKILL_POLKIT_ACTION"] == "org.gpukill.configure-audit", denied


def test_allowed_users_and_processes_are_not_reported_and_read_rogue_score_0(abed, users):
    bed = abed
    owner, other, admin = users["owner"], users["other"], users["admin"]
    trusted = start_miner(bed, owner, SYSTEM_PYTHON, bed.pool_port)  # /usr/bin/python3.X -c MINER: score 80
    renamed = start_miner(bed, owner, bed.renamed, bed.pool_port)  # a copy named like it, under /tmp
    others = start_miner(bed, other, bed.renamed, bed.pool_port)
    assert bed.wait_listed(trusted.pid, comm="python3")["exe"] == TRUSTED
    assert bed.wait_listed(renamed.pid, comm="python3")["exe"] == bed.renamed
    bed.wait_listed(others.pid, comm="python3")
    everyone = {trusted.pid, renamed.pid, others.pid}
    wait_until(
        lambda: everyone <= {f["pid"] for f in findings(bed, ROOT) if f["kind"] == "miner"},
        10,
        "the miners were not found",
    )
    assert everyone <= rogue_scores(bed)

    # an allow-list by name is refused: a process chooses its own name
    r = bed.ctl(admin, "audit", "settings", "allow-process", os.path.basename(TRUSTED))
    assert r.returncode == EXIT_USAGE and "not an absolute path" in r.stderr, r
    # and so is a file that a process could never be allowed for: under /tmp (anyone may replace it), a link
    for path, why in ((bed.renamed, "/tmp is not a folder owned by root"), (SYSTEM_PYTHON, "symbolic link")):
        r = bed.ctl(admin, "audit", "settings", "allow-process", path)
        assert r.returncode == EXIT_USAGE and why in r.stderr and len(r.stderr.splitlines()) == 1, r
    for argv in (["allow-process", TRUSTED], ["allow-user", other.name]):
        r = bed.ctl(admin, "audit", "settings", *argv)
        assert r.returncode == 0, r
    reported = {f["pid"] for f in findings(bed, ROOT)}
    assert trusted.pid not in reported and others.pid not in reported, reported
    assert renamed.pid in reported  # the same name, comm and command line, but not the allowed file
    scored = rogue_scores(bed)
    assert trusted.pid not in scored and others.pid not in scored and renamed.pid in scored, scored
    assert STRATUM in json.dumps(finding_of(bed, ROOT, renamed.pid, "miner"))
    # a miner that binds a file over the allowed path, in a user and mount namespace of its own: the kernel
    # shows it running /usr/bin/python3.X, of root's (the copy is root's too), but it is not that file
    disguised = start_in_namespace(bed, owner, over=TRUSTED, with_file=bed.renamed)
    assert bed.wait_listed(disguised.pid, comm="python3")["exe"] == TRUSTED
    wait_until(lambda: finding_of(bed, ROOT, disguised.pid, "miner"), 10, "the disguised miner was not reported")
    assert disguised.pid in rogue_scores(bed)
    # a scan with other thresholds leaves them out as well
    r = bed.ctl(ROOT, "audit", "--json", "--min-score", "1")
    assert r.returncode == 0, r
    assert {f["pid"] for f in json.loads(r.stdout)["findings"]} & {trusted.pid, others.pid} == set()

    # taken off the lists, they are reported again
    for argv in (["disallow-process", TRUSTED], ["disallow-user", other.name]):
        r = bed.ctl(admin, "audit", "settings", *argv)
        assert r.returncode == 0, r
    assert everyone <= {f["pid"] for f in findings(bed, ROOT)}


def test_an_allowed_executable_running_a_users_preloaded_library_is_scored_and_reported(abed, users):
    """`LD_PRELOAD=~/miner.so /usr/bin/python3.X`: the allowed file, and a user's code in it. The mapped library
    is the fact: the process is scored as any, with the reason in its evidence; without the library the same
    program stays allowed."""
    bed = abed
    owner, admin = users["owner"], users["admin"]
    home = bed.workdir / "preload-home"
    home.mkdir(exist_ok=True)
    os.chown(home, owner.uid, owner.gid)
    source = home / "miner.c"
    source.write_text("__attribute__((constructor)) static void start(void) {}\n")
    library = home / "miner.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chown(library, owner.uid, owner.gid)  # the user's own file, which the user can change at will
    r = bed.ctl(admin, "audit", "settings", "allow-process", TRUSTED)
    assert r.returncode == 0, r
    plain = start_miner(bed, owner, SYSTEM_PYTHON, bed.pool_port)
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUKILL_SIM_GPU": "0",
        "GPUKILL_SIM_SCOPE": bed.scope,
        "GPUKILL_SIM_MEM": "6GiB",
        "GPUKILL_SIM_UTIL": "99",
        "LD_PRELOAD": str(library),
    }
    preloaded = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", MINER_CODE, str(bed.pool_port), "-o", STRATUM],
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
        start_new_session=True,
        **owner.popen_kwargs(),
    )
    bed.procs.append(preloaded)
    assert preloaded.stdout is not None and preloaded.stdout.readline().strip() == b"ready"
    assert bed.wait_listed(preloaded.pid, comm="python3")["exe"] == TRUSTED
    bed.wait_listed(plain.pid, comm="python3")
    found = wait_until(
        lambda: finding_of(bed, ROOT, preloaded.pid, "miner"),
        10,
        "an allowed program running a user's library was not reported",
    )
    why = next(e for e in found["evidence"] if e["rule"] == "allowed-untrusted")
    assert str(library) in why["detail"] and "LD_PRELOAD=" in why["detail"], why
    assert {e["rule"] for e in found["evidence"]} >= {"stratum-url", "pool-port"}, found
    scored = rogue_scores(bed)
    assert preloaded.pid in scored and plain.pid not in scored, scored
    assert plain.pid not in {f["pid"] for f in findings(bed, ROOT)}


SET_THEN_AUDIT = """\
import json, sys
from gpukillctl.client.blocking import BlockingClient, finish
client = BlockingClient.connect()
finish(client.set_audit_settings({"idle_after": 1}))
print(json.dumps([f.pid for f in finish(client.audit_rogue()) if f.kind == "idle"]))
"""


def test_a_change_is_in_force_when_the_call_returns_even_between_samples(abed, users):
    """With samples 6 s apart, the AuditRogue right after SetAuditSettings (same connection, no pause) already
    has findings made with the new settings: the call returned only once a sample had used them."""
    bed = abed
    bed.stop_daemon()
    try:
        bed.start_daemon(args=["--sample-interval", "6"])
        notebook = idle_notebook(bed, users, held=2.0)
        r = bed.run_as(users["admin"], [PYTHON, "-c", SET_THEN_AUDIT])
        assert r.returncode == 0, r
        assert notebook.pid in json.loads(r.stdout), r
    finally:
        bed.stop_daemon()
        bed.start_daemon(args=["--sample-interval", str(INTERVAL)])


def test_export_then_import_round_trips_byte_equal(abed, users):
    bed = abed
    admin = users["admin"]
    r = bed.ctl(
        admin,
        "audit",
        "settings",
        "set",
        "min_score=42.5",
        "abuser_share=66",
        f"allowed_users={users['other'].name},nobody",
        f"allowed_processes={TRUSTED}",
    )
    assert r.returncode == 0, r
    exported = bed.workdir / "exported.conf"  # the bed's folder: readable by the admin, who imports it
    exported.write_text(export(bed))
    os.chmod(exported, 0o644)
    r = bed.ctl(admin, "audit", "settings", "set", "min_score=1", "allowed_users=")
    assert r.returncode == 0, r
    assert settings_of(bed)["allowed_users"] == []
    r = bed.ctl(admin, "audit", "settings", "import", str(exported))
    assert r.returncode == 0, r
    assert export(bed).encode() == exported.read_bytes()
    assert settings_of(bed)["allowed_users"] == [users["other"].name, "nobody"]
    assert journal_of(bed, GPUKILL_OPERATION="import", GPUKILL_SOURCE=str(exported))


def test_the_settings_survive_a_restart(abed, users):
    bed = abed
    r = bed.ctl(users["admin"], "audit", "settings", "set", "min_score=33", f"allowed_users={users['other'].name}")
    assert r.returncode == 0, r
    before = export(bed)
    bed.stop_daemon()
    bed.start_daemon(args=["--sample-interval", str(INTERVAL)])
    assert export(bed) == before
    shown = settings_of(bed)
    assert shown["min_score"] == 33.0 and shown["allowed_users"] == [users["other"].name]
    assert shown["idle_after"] == IDLE_AFTER  # gpukilld.conf's, kept in the file too


def test_an_invalid_change_or_import_leaves_the_settings_in_force(abed, users):
    bed = abed
    admin = users["admin"]
    before = export(bed)
    bad = bed.workdir / "bad.conf"
    bad.write_text("[audit]\nmin_score = 50\nabuser_share = 500\n")
    os.chmod(bad, 0o644)
    r = bed.ctl(admin, "audit", "settings", "import", str(bad))
    assert r.returncode == EXIT_USAGE, r
    assert r.stderr.strip() == f"gpukillctl: {bad}:3: abuser_share must be between 1 and 100 percent", r
    for argv in (
        ["set", "pool_ports=0"],
        ["set", "idle_after=-1"],
        ["set", "allowed_users=a;b"],
        ["set", "colour=red"],
    ):
        r = bed.ctl(admin, "audit", "settings", *argv)
        assert r.returncode == EXIT_USAGE and len(r.stderr.strip().splitlines()) == 1, (argv, r)
    # over the bus as well: too many entries, a wrong type, a key nobody knows; nothing of the rest applies
    for changes in (
        {"min_score": ["d", 5.0], "allowed_users": ["as", [f"u{i}" for i in range(300)]]},
        {"min_score": ["s", "high"]},
        {"min_score": ["d", 5.0], "frobnicate": ["b", True]},
        {"allowed_processes": ["as", ["/usr/bin/../../tmp/x"]]},
    ):
        reply = bed.manager(ROOT, "SetAuditSettings", "a{sv}", [variants(changes)])
        assert not reply.ok and reply.error == "org.freedesktop.DBus.Error.InvalidArgs", reply
        assert "\n" not in reply.message
    assert export(bed) == before
    assert not os.path.exists(dropin(bed)) or Path(dropin(bed)).read_text() == before


def test_thresholds_for_one_scan_change_only_that_scan(abed, users):
    bed = abed
    notebook = idle_notebook(bed, users)
    r = bed.ctl(ROOT, "audit", "--json", "--idle-after", "1")
    assert r.returncode == 0, r
    seen = [f for f in json.loads(r.stdout)["findings"] if f["pid"] == notebook.pid]
    assert [f["kind"] for f in seen] == ["idle"], seen
    # the settings in force, and the plain audit, are as they were
    assert finding_of(bed, ROOT, notebook.pid, "idle") is None
    assert settings_of(bed)["idle_after"] == IDLE_AFTER
    r = bed.ctl(ROOT, "audit", "--json", "--idle-after", "1", "--min-score", "51")
    assert r.returncode == 0 and not [f for f in json.loads(r.stdout)["findings"] if f["pid"] == notebook.pid], r
    # another user sees the scan filtered as AuditRogue is (GPU figures of the idle finding, as listed)
    r = bed.ctl(users["other"], "audit", "--json", "--idle-after", "1")
    assert r.returncode == 0 and notebook.pid in {f["pid"] for f in json.loads(r.stdout)["findings"]}, r
    # a key that cannot be a scan's is refused with why; a floor below the configured one too
    reply = bed.manager(ROOT, "AuditRogueWith", "a{sv}", [variants({"pool_ports": ["aq", [4444]]})])
    assert not reply.ok and "cannot be set for one scan" in reply.message, reply
    reply = bed.manager(ROOT, "AuditRogueWith", "a{sv}", [variants({"idle_min_memory": ["t", 1]})])
    assert not reply.ok and "below the configured" in reply.message, reply


def test_the_record_is_the_daemons_settings():
    """One declaration: the daemon's AuditSettings is the record the client reads."""
    from gpukilld.config import AuditSettings as daemons

    assert daemons is AuditSettings
    text = audit_settings.export_text(AuditSettings())
    again = audit_settings.export_text(AuditSettings(**audit_settings.parse_text("x", text)))
    assert again == text
