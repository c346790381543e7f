"""`gpukillctl kill --job ID`: every GPU process of a Slurm job on this host, each through the normal kill.

Each process is killed as `kill PID` kills it: by (pid, start time) as listed, polkit asked per process (own or
any), so a PID reused since the listing is refused and nothing else is signalled. The processes are stopped
together, as Slurm signals a job's tasks: the grace runs once, not once per process. Each line ends with the
GPU's answer, as a single kill's does (reclaimed, held by whom, stuck and why): the Slurm epilog passes it on,
and drains the node on exit status 14 where GPUKILL_EPILOG_DRAIN asks it to.
"""

from __future__ import annotations

import argparse
import sys

from gpukill import errors
from gpukill.records.manager import Process
from gpukill.text import shown

from ..client.api import ClientAPI, ClientError
from ..client.exits import EXIT_OK, batch_exit, exit_code


def slurm_job_id(text: str) -> str:
    """A Slurm job id as the daemon lists it (decimal); an array task's or a het job's component's own id, not
    "123_4" or "123+1" (SLURM_JOB_ID in the epilog is already the plain one)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 10):
        raise argparse.ArgumentTypeError(f"not a Slurm job id: {text!r}")
    return str(int(text))


def job_processes(procs: list[Process], job: str) -> list[Process]:
    """The processes of `job`, each once (a process on several GPUs is listed once per GPU), by PID."""
    chosen: dict[tuple[int, int], Process] = {}
    for p in procs:
        if p.slurm_job == job:
            chosen.setdefault((p.pid, p.start_time), p)
    return sorted(chosen.values(), key=lambda p: p.pid)


async def _kill_one(client: ClientAPI, p: Process, args: argparse.Namespace, interactive: bool) -> int:
    """Kill one process; print what became of it and the GPU's answer (kill_answer.answer); its exit status."""
    from .kill_answer import answer

    what = f"PID {p.pid} ({shown(p.comm)})"
    try:
        report = await client.kill_report(
            p.pid, p.start_time, force=args.force, grace=args.grace, interactive=interactive, checkpoint=args.checkpoint
        )
    except (errors.NoSuchProcess, errors.ProcessChanged):
        print(f"{what} already gone")  # ended between the listing and the kill: what was asked is done
        return EXIT_OK
    except ClientError as e:
        print(f"gpukillctl: {what}: {shown(str(e))}", file=sys.stderr)
        return exit_code(e)
    return answer(what, report.outcome, report.reclaim, report.checkpoint)


async def kill_job(client: ClientAPI, args: argparse.Namespace, interactive: bool) -> int:
    """Kill every listed GPU process of Slurm job args.job; the first failure's exit status (14 when a process
    ended but memory it shared is still held), else 0 (also when the job has no GPU process here: nothing is
    left to stop)."""
    procs = job_processes(await client.list_processes(), args.job)
    if not procs:
        print(f"no GPU processes of Slurm job {shown(args.job)} on this host")
        return EXIT_OK
    import asyncio  # here: gpukillctl's start (which imports slurm_job_id) does without asyncio

    codes = await asyncio.gather(*(_kill_one(client, p, args, interactive) for p in procs))
    return batch_exit(codes)
