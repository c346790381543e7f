"""The typed client API without a bus (gpukillctl/client/api.py): what each method sends and how long it waits."""

from __future__ import annotations

import asyncio

import pytest

from gpukill import errors
from gpukill.outcome import Outcome
from gpukillctl.client import api
from gpukillctl.client.api import ClientAPI


class Recorder(ClientAPI):
    """Answers every call with `reply` and keeps what was asked: (member, body, timeout)."""

    unique_name = ":1.1"

    def __init__(self, reply: list) -> None:
        self.reply = reply
        self.calls: list[tuple[str, list, float]] = []

    def close(self) -> None:
        pass

    async def _call(
        self, member, signature="", body=None, *, interface=api.INTERFACE, interactive=False, timeout=api.CALL_TIMEOUT
    ):
        self.calls.append((member, body or [], timeout))
        return self.reply


REPORT = {"outcome": "terminated", "reclaim": {"verdict": "reclaimed"}}


@pytest.mark.parametrize("grace,interactive", [(None, False), (0.0, False), (120.0, False), (30.0, True)])
def test_a_kill_waits_alike_with_or_without_the_gpus_answer(grace, interactive):
    """KillProcess and KillProcessReport make the same kill: their replies are waited for as long."""
    plain, report = Recorder(["terminated"]), Recorder([REPORT])
    assert asyncio.run(plain.kill(4242, 7, grace=grace, interactive=interactive)) is Outcome.TERMINATED
    asyncio.run(report.kill_report(4242, 7, grace=grace, interactive=interactive))
    (_, kill_body, kill_wait), (_, report_body, report_wait) = plain.calls[0], report.calls[0]
    assert kill_body == report_body and kill_wait == report_wait
    assert kill_wait > (grace if grace is not None else api.DEFAULT_GRACE) + api.KILL_REPLY_MARGIN - 1


def test_a_missing_method_is_an_error_like_any_other():
    """gpukilld and its clients ship together: UnknownMethod is the daemon's answer, not a cue to ask otherwise."""

    class Missing(Recorder):
        async def _call(self, member, *args, **kwargs):
            await super()._call(member, *args, **kwargs)
            raise api.error_for("org.freedesktop.DBus.Error.UnknownMethod", f"No such method '{member}'")

    for act in (
        lambda c: c.list_processes(),
        lambda c: c.kill_report(1, 1),
        lambda c: c.usage({}),
        lambda c: c.kill_workload({"unit": api.Var("s", "x.service")}),
    ):
        client = Missing([])
        with pytest.raises(api.ClientError) as caught:
            asyncio.run(act(client))
        assert caught.value.name == "org.freedesktop.DBus.Error.UnknownMethod"
        assert len(client.calls) == 1, client.calls  # asked once, nothing else tried


def test_the_suspended_list_beside_a_listing_is_empty_from_a_gpukilld_that_suspends_nothing():
    """list, top, the page and the exporter show ListSuspended beside the processes: a gpukilld without it (an
    older one over -H, or one that refuses it as NotSupported) has nothing suspended; any other error is said."""

    def failing(name: str) -> Recorder:
        class Failing(Recorder):
            async def _call(self, member, *args, **kwargs):
                await super()._call(member, *args, **kwargs)
                raise api.error_for(name, "no")

        return Failing([])

    for name in ("org.freedesktop.DBus.Error.UnknownMethod", errors.NotSupported.dbus_name):
        client = failing(name)
        assert asyncio.run(client.suspended()) == [] and [c[0] for c in client.calls] == ["ListSuspended"]
    with pytest.raises(api.ClientError) as caught:
        asyncio.run(failing(errors.AccessDenied.dbus_name).suspended())
    assert caught.value.name == errors.AccessDenied.dbus_name
    held = {"pid": 42, "start_time": 7, "uid": 1000, "comm": "train.py", "state": "suspended", "memory": 1 << 30}
    (record,) = asyncio.run(Recorder([[held]]).suspended())
    assert (record.pid, record.state, record.memory) == (42, "suspended", 1 << 30)


# -- plain values as a{sv}: one converter, one policy ------------------------------------------------------


@pytest.mark.parametrize(
    "convert,key,wrong",
    [
        (api.audit_variants, "min_score", "high"),
        (api.audit_variants, "pool_ports", [4444, "x"]),
        (api.audit_variants, "idle_min_memory", -1),
        (api.usage_variants, "limit", 2**40),
        (api.usage_variants, "since", "yesterday"),
        (api.usage_variants, "until", 10**400),
        (api.usage_variants, "user", 1000),
        (api.policy_settings, "process_limit", True),
        (api.policy_settings, "allowed_users", "alice"),
        (api.policy_settings, "utilization_limit", "70%"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(convert, key, wrong):
    """Every converter of plain values refuses what it cannot send as asked, in one line naming the key, rather
    than sending something else (or failing in the transport)."""
    with pytest.raises(errors.InvalidArgs) as caught:
        convert({key: wrong})
    assert isinstance(caught.value, api.ClientError) and caught.value.name == errors.InvalidArgs.dbus_name
    text = str(caught.value)
    assert f" {key}: " in text and "\n" not in text, text


@pytest.mark.parametrize("convert", [api.audit_variants, api.usage_variants, api.policy_settings])
def test_an_unknown_key_is_refused_naming_it(convert):
    with pytest.raises(errors.InvalidArgs, match="unknown .*'colour' \\(known: "):
        convert({"colour": "blue"})


def test_values_of_their_type_go_as_their_signature():
    assert api.audit_variants({"min_score": 70, "pool_ports": (3333, 4444), "allowed_users": ["bob"]}) == {
        "min_score": api.Var("d", 70.0),
        "pool_ports": api.Var("aq", [3333, 4444]),
        "allowed_users": api.Var("as", ["bob"]),
    }
    assert api.policy_settings({"memory_limit": "8GiB", "grace": 30, "process_limit": 3}) == {
        "memory_limit": api.Var("s", "8GiB"),
        "grace": api.Var("d", 30.0),
        "process_limit": api.Var("u", 3),
    }
    given = api.Var("t", 5)
    assert api.usage_variants({"limit": given, "device": None}) == {"limit": given}
