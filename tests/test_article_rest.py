"""The gpu-kill article's REST calls (../shared/gpu-kill-article.txt, its MCP section), word for word, against
`gpukillctl serve --tcp 127.0.0.1:PORT` on the real daemon with real polkitd, on simulated GPUs: an assistant
asked to "scan and kill every GPU process of python using more than 12 GB" calls
GET /v1/processes?filter=python&memory_gt=12884901888, then POST /v1/kill for each PID; then
GET /v1/audit/rogue (a security scan report), GET /v1/guard/status (the active policies and their trigger
counts) and POST /v1/reset (a device recovery). And every endpoint refuses a parameter it does not know
(`?filtr=python`), naming it, instead of answering as if it had not been given.

The server's user is in group gpukill with the example polkit rules (an admin's assistant): the article's
reset is for admins. The bed is this module's own, with the article's Guard policy in dry-run (the article's
advice for a first deployment), so the status has rules with counters and nothing else kills the processes."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra (pip install 'gpukill[serve]') is not installed")

from helpers.http_server import Server  # noqa: E402
from helpers.marks import needs_root  # noqa: E402
from helpers.testbed import REPO, ROOT, Testbed  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

from gpukilld import journal as audit  # noqa: E402

pytestmark = needs_root

ARTICLE_URL = "/v1/processes?filter=python&memory_gt=12884901888"  # the article's, character for character
TWELVE_GB = 12884901888
ARTICLE_POLICY = REPO / "tests" / "guard_policies" / "first-policy.yaml"  # the article's policy, as it prints it
INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"


@pytest.fixture(scope="module")
def abed(users):
    b = Testbed()
    try:
        b.write_conf()
        (b.workdir / "guard.d").mkdir(exist_ok=True)
        b.start_system(args=["--sample-interval", "0.2"])
        for args in (["enable"], ["dry-run", "on"], ["load", str(ARTICLE_POLICY)]):
            r = b.ctl(ROOT, "guard", *args)
            assert r.returncode == 0, r
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def server(abed, users):
    s = Server(abed, users["admin"], tcp=True).wait_ready()
    yield s
    s.stop()


@pytest.fixture
def bed(abed):
    before = len(abed.procs)
    yield abed
    abed.kill_since(before)


def test_the_article_over_rest(bed, server, users):
    me = users["admin"]
    big = bed.victim(me, gpu=0, mem="14GiB", comm="python")  # python, over 12 GB: the one to kill
    trainer = bed.victim(me, gpu=1, mem="20GiB", comm="trainer")  # over 12 GB, not python: must live
    small = bed.victim(me, gpu=1, mem="2GiB", comm="python")  # python, under 12 GB: must live
    miner = bed.victim(me, gpu=3, mem="1GiB", util=99, comm="xmrig")  # for the security scan
    for p, comm in ((big, "python"), (trainer, "trainer"), (small, "python"), (miner, "xmrig")):
        bed.wait_listed(p.pid, comm=comm)

    # "GET /v1/processes?filter=python&memory_gt=12884901888 to get the list of processes"
    r = server.call("GET", ARTICLE_URL)
    assert r.status == 200, r
    assert [p["pid"] for p in r.body["processes"]] == [big.pid], r
    assert r.body["processes"][0]["gpu_memory"] > TWELVE_GB and r.body["processes"][0]["comm"] == "python"

    # "then POST /v1/kill for each PID"
    for p in r.body["processes"]:
        k = server.call("POST", "/v1/kill", {"pid": p["pid"]})
        assert k.status == 200 and k.body["pid"] == p["pid"] and k.body["outcome"] == "terminated", k
    assert big.wait(10) is not None
    entries = bed.wait_journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(big.pid))
    assert entries and entries[0]["GPUKILL_CALLER_UID"] == str(me.uid), entries
    assert trainer.poll() is None and small.poll() is None and miner.poll() is None
    wait_until(lambda: server.call("GET", ARTICLE_URL).body == {"processes": []}, 10, "the kill is still listed")
    assert bed.journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(trainer.pid)) == []

    # "GET /v1/audit/rogue: a security scan report, identifying potential mining or abnormally busy processes"
    r = server.call("GET", "/v1/audit/rogue")
    assert r.status == 200, r
    mined = [f for f in r.body["findings"] if f["pid"] == miner.pid]
    assert [(f["kind"], f["user"]) for f in mined] == [("miner", me.name)], r
    assert mined[0]["score"] > 0 and mined[0]["evidence"], mined

    # "GET /v1/guard/status returns the active policies and their trigger counts"
    def status() -> dict:
        s = server.call("GET", "/v1/guard/status")
        assert s.status == 200, s
        return s.body

    body = status()
    assert body["enabled"] is True and body["files"] == [str(ARTICLE_POLICY)], body
    assert [rule["name"] for rule in body["rules"]] == ["block-crypto-miners", "limit-user-memory"], body
    assert all(isinstance(rule["triggers"], int) for rule in body["rules"]), body
    # the trainer alone holds 20 GiB: over the article's 8 GB per user, a trigger (dry run: nobody is killed)
    wait_until(lambda: _rule(status(), "limit-user-memory")["triggers"] >= 1, 10, lambda: str(status()))
    assert trainer.poll() is None

    # "POST /v1/reset for device recovery" (GPU 2: nothing runs on it)
    r = server.call("POST", "/v1/reset", {"device": "2"})
    assert r.status == 200 and r.body["device"] == 2 and r.body["killed"] == [], r
    entries = bed.wait_journal(MESSAGE_ID=audit.RESET.message_id, GPUKILL_CALLER_UID=str(me.uid))
    assert entries and entries[-1]["GPUKILL_DEVICE"] == r.body["device_id"], entries


def _rule(status: dict, name: str) -> dict:
    return next(rule for rule in status["rules"] if rule["name"] == name)


def test_filter_and_name_combine(bed, server, users):
    """filter is gpu-kill's name for name_regex: with name both must match (as every filter combines); with
    name_regex it is refused (one pattern given twice); a pattern RE2 refuses is 422 naming filter."""
    me = users["admin"]
    torch = bed.victim(me, gpu=0, mem="13GiB", comm="python-torch")
    jax = bed.victim(me, gpu=0, mem="13GiB", comm="python-jax")
    bed.wait_listed(torch.pid, comm="python-torch")
    bed.wait_listed(jax.pid, comm="python-jax")
    r = server.call("GET", "/v1/processes?filter=^python&name=torch")
    assert r.status == 200 and [p["pid"] for p in r.body["processes"]] == [torch.pid], r
    r = server.call("GET", "/v1/processes?filter=jax$")
    assert r.status == 200 and [p["pid"] for p in r.body["processes"]] == [jax.pid], r
    r = server.call("GET", "/v1/processes?filter=python&name_regex=python")
    assert (r.status, r.error) == (422, INVALID_ARGS) and "name_regex" in r.body["message"], r
    r = server.call("GET", "/v1/processes?filter=(")
    assert (r.status, r.error) == (422, INVALID_ARGS) and "filter" in r.body["message"], r
    r = server.call("GET", "/v1/processes?filter=" + "a" * 257)
    assert (r.status, r.error) == (422, INVALID_ARGS) and "filter" in r.body["message"], r


def test_unknown_parameters_are_refused_naming_them(bed, server, users):
    """`?filtr=python` (a typo of the article's parameter) on every endpoint: 422 naming filtr, and nothing
    done; a parameter given twice, and an unknown key of a body, likewise."""
    me = users["admin"]
    victim = bed.victim(me, gpu=0, mem="13GiB", comm="python")
    bed.wait_listed(victim.pid, comm="python")
    calls = [
        ("GET", "/v1/processes?filtr=python&memory_gt=12884901888", None),
        ("GET", "/v1/devices?filtr=python", None),
        ("GET", "/v1/audit/rogue?filtr=python", None),
        ("GET", "/v1/guard/status?filtr=python", None),
        ("POST", "/v1/kill?filtr=python", {"pid": victim.pid}),
        ("POST", "/v1/reset?filtr=python", {"device": "2"}),
        ("POST", "/v1/guard/test?filtr=python", {}),
    ]
    resets = len(bed.journal(MESSAGE_ID=audit.RESET.message_id))
    for method, path, body in calls:
        r = server.call(method, path, body)
        assert (r.status, r.error) == (422, INVALID_ARGS), (path, r)
        assert "filtr" in r.body["message"], (path, r)
    r = server.call("GET", "/v1/processes?name=trainer&name=python")  # which one? refused, not guessed
    assert (r.status, r.error) == (422, INVALID_ARGS) and "name" in r.body["message"], r
    r = server.call("POST", "/v1/kill", {"pid": victim.pid, "filter": "python"})
    assert (r.status, r.error) == (422, INVALID_ARGS) and "filter" in r.body["message"], r
    r = server.call("POST", "/v1/reset", {"device": "2", "all": True})
    assert (r.status, r.error) == (422, INVALID_ARGS) and "all" in r.body["message"], r
    assert victim.poll() is None
    assert bed.journal(MESSAGE_ID=audit.KILL.message_id, GPUKILL_TARGET_PID=str(victim.pid)) == []
    assert len(bed.journal(MESSAGE_ID=audit.RESET.message_id)) == resets
