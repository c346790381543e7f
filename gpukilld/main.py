"""gpukilld start-up and life cycle: config, backends, sampler, bus, sd_notify, signals.

The one place where the parts are wired: Actions and the GuardRunner report what they did through
callbacks of the Daemon (_on_killed, _on_reset, and the GuardSignals violated, action_taken, notification,
reclaim_pending), which emit the interfaces' D-Bus signals; neither interface reaches into the runner or Actions
for that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import resource
import signal
import sys
import threading
import time

import sdnotify
from dbus_fast import BusType, RequestNameReply
from dbus_fast.aio import MessageBus
from dbus_fast.constants import NameFlag

from gpukill.errors import ConfigError, ResetFailed
from gpukill.records.status import ResetReply
from gpukill.records.suspend import SuspendedProcess
from gpukill.units import parse_duration

from . import __version__, journal
from .access.bouncer import Bouncer, Caller
from .access.refusals import RefusalLog
from .access.visibility import ProcRules, read_proc_rules
from .acts.actions import Actions, KillResult
from .acts.killer import Killer
from .acts.slurm import Slurm
from .acts.suspend import Suspender, SuspendSettings
from .acts.suspended import SuspendedWorkloads
from .audit_settings import AuditSettingsKeeper, dropin_path
from .backends import Backend
from .backends.registry import build_backends
from .bus import writer as busio
from .bus.door import Door
from .bus.guard import GuardInterface
from .bus.manager import ManagerInterface
from .config import DEFAULT_PATH, Config, check_interval, load_config
from .guard.engine import Target, Violation
from .guard.notify import Notice
from .guard.runner import GuardRunner, notify_config, protection_of
from .model import EMPTY_SNAPSHOT, STATE_OK, Snapshot
from .names import BUS_NAME, OBJECT_PATH
from .proc.procfs import ProcFS
from .rogue.watch import RogueWatch
from .sampling.proc_events import ProcEvents
from .sampling.proc_events import open_for as open_proc_events
from .sampling.sampler import Sampler, StateChange
from .usage.keeper import UsageKeeper, still_running
from .usage.store import UsageStore

log = logging.getLogger("gpukilld")

FIRST_SAMPLE_WAIT = 10.0


def status_line(snap: Snapshot) -> str:
    lost = sum(1 for d in snap.devices if d.state != STATE_OK)
    names = ", ".join(b.name if b.available else f"{b.name} (unavailable)" for b in snap.backends) or "none"
    lost_text = f" ({lost} lost)" if lost else ""
    return f"{len(snap.devices)} GPUs{lost_text}, {len(snap.processes)} GPU processes; backends: {names}"


class Daemon:
    """Every part of gpukilld, each named here with its type. The configuration and the backends are made at
    once (a broken file fails before the bus); the parts that serve or act are made by _build, in one place,
    once the system bus is connected; the usage keeper only once the bus name is ours (run)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config: Config = self._load_config()
        self.backends: list[Backend] = build_backends(self.config)  # a broken device file fails here
        self.snapshot: Snapshot = EMPTY_SNAPSHOT
        self.notifier: sdnotify.SystemdNotifier = sdnotify.SystemdNotifier()  # READY, STATUS, WATCHDOG
        self.audit: journal.Audit = journal.Audit()  # the journal entries of every act and change
        self._status = ""
        self._snapshot_waiters: list[asyncio.Future[Snapshot]] = []
        self._stop = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.usage: UsageKeeper | None = None  # GPU usage accounting, while [usage] enabled and the name is ours
        # Made by _build, in this order (a MessageBus needs the running loop):
        self.bus: MessageBus  # the system bus connection
        self.proc_rules: ProcRules  # hidepid: what /proc shows users of each other
        self.bouncer: Bouncer  # who may do what (polkit), refusals journalled
        self.procfs: ProcFS
        self.proc_events: ProcEvents  # the kernel's proc connector, where it can listen
        self.rogue: RogueWatch  # the rogue-activity audit, run by the sampler
        self.sampler: Sampler
        self.suspender: Suspender  # suspend and resume, with the suspended workloads it keeps
        self.actions: Actions  # the kill and reset paths
        self.audit_settings: AuditSettingsKeeper  # the audit's settings as admins change them
        self.manager: ManagerInterface
        self.guard: GuardRunner
        self.guard_interface: GuardInterface

    # -- configuration ---------------------------------------------------------------------------------

    def _load_config(self) -> Config:
        config = load_config(self.args.config, required=self.args.config != DEFAULT_PATH)
        if self.args.simulate:
            config = dataclasses.replace(config, simulate=self.args.simulate)
        if self.args.sample_interval is not None:
            try:  # gpukill.units' duration grammar; refused in one line, as the configuration's errors are
                seconds = parse_duration(self.args.sample_interval)
            except ValueError as e:
                raise ConfigError(f"--sample-interval: {e}") from None
            interval = check_interval(seconds, "--sample-interval")
            config = dataclasses.replace(config, sample_interval=interval)
        return config

    def _watchdog_interval(self) -> float | None:
        usec = os.environ.get("WATCHDOG_USEC")
        wd_pid = os.environ.get("WATCHDOG_PID")
        if not usec or (wd_pid and wd_pid != str(os.getpid())):
            return None
        return int(usec) / 1e6 / 2  # sd_watchdog_enabled(3): ping at half the timeout

    # -- snapshot flow (sampler thread -> loop) --------------------------------------------------------

    def _publish(self, snap: Snapshot, changes: list[StateChange]) -> None:
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self._on_snapshot, snap, changes)
        except RuntimeError:  # the loop closed while this sample ran: shutting down
            self.sampler.stop()

    def _on_snapshot(self, snap: Snapshot, changes: list[StateChange]) -> None:
        self.snapshot = snap
        self.manager.published(snap)  # SnapshotChanged, when its content differs from the last one's
        for change in changes:
            dev = change.device
            self.audit.log(
                journal.DEVICE_STATE,
                f"GPU {dev.index} ({dev.id}) is {dev.state}" + (f": {dev.state_reason}" if dev.state_reason else ""),
                device=dev.id,
                device_index=dev.index,
                state=dev.state,
                previous_state=change.previous,
                reason=dev.state_reason or None,
            )
            self.manager.DeviceStateChanged(dev)
        line = status_line(snap)
        if line != self._status:
            self._status = line
            self.notifier.notify(f"STATUS={line}")
        self.bouncer.refusals.flush()  # folded refusals are reported when their window is over
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(snap)
        self.guard.on_snapshot(snap)  # evaluates and starts kills as tasks; never raises, never waits
        if self.usage is not None:
            self.usage.on_snapshot(snap)  # O(1) while the generation does not move; never raises
        self.sampler.taken(snap)  # the loop is alive: the sampler may ping the watchdog again

    async def next_snapshot(self) -> Snapshot:
        """A snapshot taken after this call: for acts that must not trust one up to an interval old."""
        assert self.loop is not None
        fut: asyncio.Future[Snapshot] = self.loop.create_future()
        self._snapshot_waiters.append(fut)
        try:
            return await asyncio.wait_for(fut, self.sampler.interval * 2 + 5)
        except TimeoutError:
            raise ResetFailed("the GPU backends are not answering; nothing was done") from None

    # -- signals from actions and the guard (GuardSignals) ----------------------------------------------

    def _on_killed(self, result: KillResult, caller: Caller | None) -> None:
        self.manager.ProcessKilled(result, caller.uid if caller else 0)

    def _on_reset(self, result: ResetReply, success: bool) -> None:
        self.manager.DeviceReset(result, success)

    def _on_suspended(self, record: SuspendedProcess, caller: Caller | None) -> None:
        self.manager.ProcessSuspended(record, caller.uid if caller else 0)

    def _on_resumed(self, record: SuspendedProcess, caller: Caller | None) -> None:
        self.manager.ProcessResumed(record, caller.uid if caller else 0)

    def _suspend_settings(self) -> SuspendSettings:
        return SuspendSettings(self.config.cuda_checkpoint, self.config.suspend_host_memory_max, self.config.sys_root)

    def violated(self, event: Violation, dry_run: bool) -> None:
        self.guard_interface.PolicyViolated(event, dry_run)

    def action_taken(
        self, rule: str, subject: str, action: str, pid: int, start_time: int, outcome: str, dry_run: bool
    ) -> None:
        self.guard_interface.GuardActionTaken(rule, subject, action, pid, start_time, outcome, dry_run)

    def notification(self, notice: Notice, uid: int | None) -> None:
        self.guard_interface.Notification(notice, uid)

    def reclaim_pending(self, target: Target, rule: str, deadline: float) -> None:
        self.guard_interface.ReclaimPending(target, rule, deadline)

    # -- reload ----------------------------------------------------------------------------------------

    def reload(self) -> None:
        self.notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            config = self._load_config()
            # Backends whose settings did not change are kept, not rebuilt (build_backends says why).
            backends = build_backends(config, previous=(self.config, self.backends))
        except ConfigError as e:
            log.error("reload failed, keeping the configuration in force: %s", e)
            self.audit.log(
                journal.DAEMON, f"Reload failed, configuration unchanged: {e}", result="reload-failed", error=str(e)
            )
        else:
            replaced = [b for b in self.backends if not any(b is kept for kept in backends)]
            self.config = config
            self.proc_rules = read_proc_rules(config.proc_root)  # /proc may have been remounted with hidepid
            self.sampler.interval = config.sample_interval
            self.rogue.settings = config.audit
            self.backends = backends
            self.sampler.backends = backends
            self.actions.backends = {b.name: b for b in backends}
            self._close_when_unused(replaced)
            self.guard.configure(
                notify_config(config), config.guard_policy_dir, config.guard_state_dir, protection_of(config)
            )
            self._configure_usage()
            self.audit.log(journal.DAEMON, "Configuration reloaded", result="reloaded")
        self.guard.reload_files()  # a broken policy file leaves the policy in force (and says so)
        self.notifier.notify(f"READY=1\nSTATUS={self._status}")

    def _configure_usage(self) -> None:
        """[usage] enabled: the keeper started (the saved totals restored, the store opened) or stopped (the
        totals saved, what closed written); keep_days as configured."""
        if self.config.usage_enabled and self.usage is None:
            state_dir = self.config.guard_state_dir
            try:
                store = UsageStore(os.path.join(state_dir, "usage.sqlite"), self.audit)
                self.usage = UsageKeeper(
                    self.audit,
                    store,
                    state_dir,
                    keep_days=self.config.usage_keep_days,
                    alive=still_running(self.config.proc_root),
                )
            except Exception:  # the daemon serves and enforces without the accounting rather than not at all
                log.exception("GPU usage accounting could not be set up; it is off")
            else:
                self.usage.start()  # never raises
        elif not self.config.usage_enabled and self.usage is not None:
            self.usage.stop()
            self.usage = None
        if self.usage is not None:
            self.usage.keep_days = self.config.usage_keep_days

    def _close_when_unused(self, replaced: list) -> None:
        """Close the backends a reload replaced (NVML handles, threads, ROCm SMI) once no sample uses them.

        The sampler takes its backend list once per sample, so the sample in progress at the swap may still be
        reading the old backends, and any sample begun after the swap reads only the new ones. Each sample ends
        with a snapshot delivered to this loop: once two more have come (the one in progress, if any, then one
        begun after the swap), the old backends are unused. They are then closed in a thread of their own, never
        on this loop, since a vendor call may hang there; a daemon thread, so that it cannot hold up the exit.
        A sampler that never delivers again is stuck in a backend, and those backends must not be closed."""
        if not replaced:
            return
        assert self.loop is not None
        loop = self.loop

        def close() -> None:
            for backend in replaced:
                try:
                    backend.close()
                except Exception:  # one failing close must not keep the others open
                    log.exception("closing the %s backend replaced by the reload failed", backend.name)
            log.debug("closed the backends replaced by the reload: %s", ", ".join(b.name for b in replaced))

        def after_snapshots(left: int) -> None:
            if left == 0:
                threading.Thread(target=close, name="backend-close", daemon=True).start()
                return
            fut: asyncio.Future[Snapshot] = loop.create_future()
            fut.add_done_callback(lambda f: None if f.cancelled() else after_snapshots(left - 1))
            self._snapshot_waiters.append(fut)  # resolved by _on_snapshot, on this loop

        after_snapshots(2)

    # -- main ------------------------------------------------------------------------------------------

    def _build(self, bus: MessageBus) -> None:
        """The parts that serve and act, each handed what it uses: none is wired from outside afterwards."""
        self.bus = bus
        self.proc_rules = read_proc_rules(self.config.proc_root)
        self.bouncer = Bouncer(bus, RefusalLog(self.audit), proc_rules=lambda: self.proc_rules)
        self.procfs = ProcFS(self.config.proc_root)
        # What processes become, from the kernel (gpukilld/sampling/proc_events.py); where it cannot, the sampler polls.
        self.proc_events = open_proc_events(self.procfs.is_this_hosts())
        if not self.proc_events.listening:
            log.info("the kernel's proc connector is unavailable (%s): polling", self.proc_events.reason)
        self.rogue = RogueWatch(self.config.proc_root, self.config.audit)
        self.sampler = Sampler(
            self.backends,
            self.config.sample_interval,
            self.procfs,
            self._publish,
            watchdog=lambda: self.notifier.notify("WATCHDOG=1"),
            watchdog_interval=self._watchdog_interval(),
            audit=self.rogue,
            events=self.proc_events,
        )
        killer = Killer()
        # Suspended workloads are kept beside Guard's state; read once the bus name is ours (run).
        self.suspender = Suspender(
            snapshot=lambda: self.snapshot,
            resample=self.next_snapshot,
            backends=lambda: self.actions.backends,
            bouncer=self.bouncer,
            killer=killer,
            auditor=self.audit,
            kept=SuspendedWorkloads(self.config.guard_state_dir, self.audit, killer.procfs),
            settings=self._suspend_settings,
            on_suspended=self._on_suspended,
            on_resumed=self._on_resumed,
        )
        self.actions = Actions(
            snapshot=lambda: self.snapshot,
            backends={b.name: b for b in self.backends},
            bouncer=self.bouncer,
            killer=killer,
            auditor=self.audit,
            on_killed=self._on_killed,
            on_reset=self._on_reset,
            resample=self.next_snapshot,
            suspender=self.suspender,
        )
        # The audit's settings as admins change them (SetAuditSettings): kept beside the configuration file.
        self.audit_settings = AuditSettingsKeeper(
            dropin_path(self.args.config), self.rogue, self.audit, self.next_snapshot
        )
        # GetUsage answers NotSupported while no keeper runs (until the name is ours, or [usage] is off).
        self.manager = ManagerInterface(
            lambda: self.snapshot,
            self.actions,
            self.bouncer,
            lambda: self.sampler.interval,
            self.sampler.sampling_status,
            bus=bus,
            audit_settings=self.audit_settings,
            usage=lambda: self.usage,
            suspender=self.suspender,
        )
        slurm = Slurm()  # Slurm's commands: Guard's requeue and cancel, a job's declared checkpoint signal
        self.guard = GuardRunner(
            self.actions.kill,
            self.audit,
            notify_config(self.config),
            self.config.guard_policy_dir,
            self.config.guard_state_dir,
            protection=protection_of(self.config),
            signals=self,
            reset=self.actions.reset,
            proc_root=self.config.proc_root,
            kill_workload=self.actions.kill_workload,
            ask_to_save=self.actions.ask_to_save,
            slurm=slurm,
            suspend=self.suspender.suspend,
        )
        # a Slurm job's `#SBATCH --signal` declares the checkpoint signal of its processes that declare none
        self.actions.checkpoints.job_signal = slurm.declared_signal
        # a kill's checkpoint wait is capped by the policy in force (max_checkpoint_wait), Guard's or a manual one
        self.actions.checkpoints.cap = lambda: self.guard.policy.settings.max_checkpoint_wait
        self.guard_interface = GuardInterface(self.guard, self.bouncer, lambda: self.snapshot, bus=bus)

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        try:
            bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        except Exception as e:
            log.error("cannot connect to the system bus: %s", e)
            return 1
        self._build(bus)
        busio.tolerate_full_socket(bus)
        bus.add_message_handler(
            Door(
                bus, self.bouncer, lambda msg: self.manager.early_answer(msg) or self.guard_interface.early_answer(msg)
            )
        )
        bus.export(OBJECT_PATH, self.manager)
        bus.export(OBJECT_PATH, self.guard_interface)

        first: asyncio.Future[Snapshot] = self.loop.create_future()
        self._snapshot_waiters.append(first)
        self.sampler.start()
        try:
            await asyncio.wait_for(first, FIRST_SAMPLE_WAIT)
        except TimeoutError:
            log.warning("the first sample took over %gs; serving an empty list until it comes", FIRST_SAMPLE_WAIT)

        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            log.error("the bus name %s is owned by another process; is gpukilld already running?", BUS_NAME)
            self.sampler.stop()
            bus.disconnect()
            return 1

        # Only now that the name is ours: a second gpukilld that loses the name must never enforce anything.
        self.guard.start()
        # Usage accounting too: a second daemon must not write the first one's records, nor its state file.
        self._configure_usage()
        # The workloads suspended before a restart: kept suspended (never resumed by themselves), those gone dropped.
        self.suspender.kept.load()
        # Observers that list on SnapshotChanged (clients check a signal's sender against the name's owner, so
        # the first sample's signal, sent before the name was ours, reached no one): list now, a new daemon.
        self.manager.SnapshotChanged(self.snapshot.generation)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stop.set)
        self.loop.add_signal_handler(signal.SIGHUP, self.reload)

        # What start-up made (modules, classes, the bus, the first samples) lives as long as the daemon: out of the
        # collector's sight, so that its full collections walk only what came since (unfrozen, they walk all of it
        # each time, 15-20 ms, about once a minute of 1 Hz samples: bench/README.md).
        gc.freeze()
        # READY only now: the name is ours, so a client started after READY finds us.
        self.notifier.notify(f"READY=1\nSTATUS={self._status or 'starting'}\nMAINPID={os.getpid()}")
        self.audit.log(journal.DAEMON, f"gpukilld {__version__} started: {self._status}", result="started")
        log.info("gpukilld %s ready on %s", __version__, BUS_NAME)

        disconnected = asyncio.ensure_future(bus.wait_for_disconnect())
        stopped = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({disconnected, stopped}, return_when=asyncio.FIRST_COMPLETED)
        self.notifier.notify("STOPPING=1")
        self.sampler.stop()
        self.guard.stop()  # saves counters; notices still queued are dropped (the journal has every event)
        if self.usage is not None:
            self.usage.stop()  # saves the open records' totals, writes what closed
        if disconnected in done:
            log.error("lost the system bus connection")
            self.audit.log(journal.DAEMON, "gpukilld lost the system bus; exiting", result="bus-lost")
            return 1
        self.audit.log(journal.DAEMON, "gpukilld stopped", result="stopped")
        bus.disconnect()
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line; packaging/completions.py and the man page test read it too."""
    p = argparse.ArgumentParser(
        prog="gpukilld",
        description="The gpukill daemon: samples GPUs, serves org.gpukill1 on the system bus, kills and resets "
        "on request after asking polkit, and audits every act to the journal. Runs as root under systemd.",
        epilog="manual pages:\n"
        "  man gpukilld          options, signals, files\n"
        "  man gpukilld.conf     the configuration file\n"
        "  man gpukill-policy    Guard Mode policies",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=DEFAULT_PATH, help=f"configuration file (default {DEFAULT_PATH})")
    p.add_argument("--simulate", metavar="FILE", help="simulated GPUs described in FILE (see man gpukilld.conf)")
    p.add_argument("--sample-interval", metavar="DURATION", help="time between samples, e.g. 500ms or 2s (default 1s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--version", action="version", version=f"gpukilld {__version__}")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def raise_fd_limit() -> None:
    """The soft descriptor limit up to the hard one (at most 65,536): the 1,024 default guards select(), which
    nothing here uses (asyncio and the exit watch use epoll), and every followed GPU process holds a pidfd."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    logging.basicConfig(level=args.log_level.upper(), format="gpukilld: %(message)s", stream=sys.stderr)
    try:
        daemon = Daemon(args)
    except ConfigError as e:
        print(f"gpukilld: {e}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(daemon.run())
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
