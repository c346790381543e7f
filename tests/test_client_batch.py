"""A batch kill by name, wherever it is made (gpukill --kill --filter --batch, MCP's kill_processes_by_name):
the same patterns refused, and each process once however many GPUs it is on (gpukillctl/client/batch.py)."""

from __future__ import annotations

import pytest

from gpukill import errors
from gpukill.records.manager import Process
from gpukillctl.cli import compat
from gpukillctl.client.batch import by_process, once_per_process

mcp = pytest.importorskip(
    "gpukillctl.serve.mcp", reason="the serve extra (pip install 'gpukill[serve]') is not installed"
)


def refused_by_gpukill(pattern: str) -> bool:
    try:
        compat._check_batch_pattern(pattern)
    except compat.Refused:
        return True
    return False


def refused_by_mcp(pattern: str) -> bool:
    try:
        mcp.batch_pattern(pattern)
    except errors.InvalidArgs:
        return True
    return False


@pytest.mark.parametrize(
    "pattern,refused",
    [
        ("^python3$", False),
        ("py", False),
        ("", True),
        (".*", True),
        ("x*", True),
        ("a|", True),
        ("(a", True),
        (r"(a)\1", True),
    ],
)
def test_gpukill_and_mcp_refuse_the_same_patterns(pattern, refused):
    assert (refused_by_gpukill(pattern), refused_by_mcp(pattern)) == (refused, refused)


def record(pid: int, start_time: int, device: int, memory: int | None) -> Process:
    return Process(
        pid=pid,
        start_time=start_time,
        uid=1000,
        user="alice",
        comm="python3",
        cmdline="python3",
        device=device,
        device_id=f"GPU-{device}",
        gpu_memory=memory,
        gpu_utilization=None,
    )


def test_a_process_on_several_gpus_is_one_process():
    listing = [record(7, 1, 0, 100), record(5, 1, 0, None), record(7, 1, 1, 50), record(7, 2, 1, 10)]
    assert list(by_process(listing)) == [(7, 1), (5, 1), (7, 2)]
    assert once_per_process(listing) == [listing[0], listing[1], listing[3]]
    matches = mcp.batch_matches(listing)
    assert [(m.pid, m.start_time, m.gpus, m.gpu_memory) for m in matches] == [
        (5, 1, [0], None),
        (7, 1, [0, 1], 150),
        (7, 2, [1], 10),
    ]
