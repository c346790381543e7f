"""`gpukillctl suspend` and `gpukillctl resume`: a workload's GPU memory set aside in host memory, and given back.

Their command lines are in main.py, beside kill's.
The workload is named as a kill's: a PID, --tree PID, --unit UNIT or --job ID (a Slurm job on this host); gpukilld
suspends every GPU process of it together, or none. The answer is one line for the act, then one per process; a
process left stuck says its remedy. Exit status 0 when done, 1 when a step failed (everything running again, or
stuck), and the daemon's refusal's status otherwise (9 where it cannot work: AMD/Intel, MIG, an old driver).
"""

from __future__ import annotations

import argparse

from gpukill.records.suspend import DONE, STUCK, SuspendReply
from gpukill.units import format_size

from ..client.api import ClientAPI, Var
from ..client.exits import EXIT_FAILURE, EXIT_OK
from ..client.format import shown


async def _selection(client: ClientAPI, args: argparse.Namespace) -> dict[str, Var]:
    """The bus selection: a PID (or tree root) with its start time as gpukilld lists it (on a GPU, or suspended),
    else as this host's /proc says; 0 lets another host's daemon say what it finds."""
    if args.unit:
        return {"unit": Var("s", args.unit)}
    if args.job:
        return {"job": Var("s", args.job)}
    pid = args.tree or args.pid
    listed = await (client.list_processes() if args.command == "suspend" else client.list_suspended())
    start_time = next((p.start_time for p in listed if p.pid == pid), None)
    if start_time is None and not args.host:
        from gpukill.procstat import read_stat

        stat = read_stat(pid)
        start_time = stat.start_time if stat else 0
    return {"tree" if args.tree else "pid": Var("(ut)", (pid, start_time or 0))}


def answer(reply: SuspendReply) -> int:
    """The act's line, then each process's; the exit status."""
    print(shown(f"{reply.selection}: {reply.message}"))
    for e in reply.entries:
        line = f"  PID {e.pid} ({e.comm or '?'}): {e.state}"
        if e.memory:
            line += f", {format_size(e.memory)}"
        if e.error:
            line += f" - {e.error}"
        if e.state == STUCK and e.remedy:
            line += f"; {e.remedy}"
        print(shown(line))
    return EXIT_OK if reply.result == DONE else EXIT_FAILURE


async def cmd_suspend(client: ClientAPI, args: argparse.Namespace) -> int:
    from ..client.polkit_agent import PolkitAgent

    agent = PolkitAgent()
    try:
        selection = await _selection(client, args)
        if args.command == "suspend":
            reply = await client.suspend_workload(selection, interactive=agent.active)
        else:
            reply = await client.resume_workload(selection, interactive=agent.active)
    finally:
        agent.close()
    return answer(reply)
