"""The typed client API without a bus (gpukillctl/client/api.py): what each method sends and how long it waits."""

from __future__ import annotations

import asyncio

import pytest

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

    async def _call(self, member, signature="", body=None, *, interface=api.INTERFACE, interactive=False,
                    timeout=api.CALL_TIMEOUT):
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

    for act in (lambda c: c.list_processes(), lambda c: c.kill_report(1, 1), lambda c: c.usage({}),
                lambda c: c.kill_workload({"unit": api.Var("s", "x.service")})):
        client = Missing([])
        with pytest.raises(api.ClientError) as caught:
            asyncio.run(act(client))
        assert caught.value.name == "org.freedesktop.DBus.Error.UnknownMethod"
        assert len(client.calls) == 1, client.calls  # asked once, nothing else tried
