"""What the Prometheus exporter exposes: one reading of gpukilld (records) turned into metric families.

Pure: no bus, no HTTP. Names follow Prometheus conventions (base units, `_bytes`, `_ratio`, `_celsius`,
`_watts`, `_hertz`, `_total` for counters). Attribution is summed per user, unit, Slurm job, pod and container
so that the number of series stays bounded by what runs on the host, not by how many processes came and went;
per-process series only when asked for (`per_process`), since each PID is a new series.
The mapping to dcgm-exporter's DCGM_FI_DEV_* names is in docs/fleets.md ("Prometheus exporter").

The accounting's counters (UsageCounters) are GetUsage's totals since the exporter started, per user, unit and
Slurm job: `sum by (user) (increase(gpukill_gpu_seconds_total{user!=""}[24h]))` is `gpukillctl usage --since 24h`
for a fleet (docs/accounting.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpukill.records.guard import GuardStatus
from gpukill.records.manager import STATE_OK, Device, Process
from gpukill.records.signals import DeviceReset, ProcessKilled
from gpukill.records.status import BackendStatus
from gpukill.records.suspend import SuspendedProcess
from gpukill.records.usage import UsageReport

DEVICE_LABELS = ["gpu", "uuid", "pci_bus_id", "vendor", "model"]
MHZ = 1_000_000.0

# Attribution dimensions: the label, the process field it comes from.
GROUPINGS = (
    ("user", "user"),
    ("unit", "unit"),
    ("slurm_job", "slurm_job"),
    ("pod_uid", "pod_uid"),
    ("container", "container_id"),
)

# GuardStatus rule counters: the RuleStatus field, the outcome label its count is exposed under.
GUARD_OUTCOMES = (
    ("kills", "killed"),
    ("would_kill", "would_kill"),
    ("cancelled", "cancelled"),
    ("failed", "failed"),
    ("resets", "reset"),
    ("would_reset", "would_reset"),
)


@dataclass
class SignalCounts:
    """Kills and resets heard as gpukilld's signals since the exporter started: the daemon keeps no such counter
    (Guard's per-rule counters aside). The initiator is counted by kind (user, reset, guard), not by rule, so
    that the series stay few; Guard's per-rule numbers are gpukill_guard_actions_total."""

    kills: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # (outcome, initiator kind) -> count
    resets: dict[str, int] = dataclasses.field(default_factory=dict)  # "ok" or "failed" -> count

    def count(self, event: object) -> None:
        if isinstance(event, ProcessKilled):
            key = (event.outcome, event.initiator.split(":", 1)[0])
            self.kills[key] = self.kills.get(key, 0) + 1
        elif isinstance(event, DeviceReset):
            result = "ok" if event.success else "failed"
            self.resets[result] = self.resets.get(result, 0) + 1

    def families(self) -> list[Metric]:
        kills = CounterMetricFamily(
            "gpukill_kills",
            "kills finished, per outcome and initiator kind (user, reset, guard), since the exporter started",
            labels=["outcome", "initiator"],
        )
        for (outcome, initiator), n in sorted(self.kills.items()):
            kills.add_metric([outcome, initiator], float(n))
        resets = CounterMetricFamily(
            "gpukill_resets", "device resets attempted, per result, since the exporter started", labels=["result"]
        )
        for result, n in sorted(self.resets.items()):
            resets.add_metric([result], float(n))
        return [kills, resets]


# The accounting's counters: GetUsage's grouping, the label its key goes in. Each series has one of the three
# labels set (the others empty, which Prometheus reads as absent): select one with {user!=""}.
USAGE_GROUPINGS = (("user", "user"), ("unit", "unit"), ("job", "slurm_job"))
USAGE_LABELS = [label for _, label in USAGE_GROUPINGS]
# The row's total, the counter (prometheus_client adds _total), its help. SM seconds and energy only for the
# groups where some record measured them: an unknown total is left out, never 0.
USAGE_COUNTERS = (
    (
        "gpu_seconds",
        "gpukill_gpu_seconds",
        "seconds GPU processes were on a GPU (a process on two GPUs counts on each), since the exporter started",
    ),
    (
        "memory_byte_seconds",
        "gpukill_memory_byte_seconds",
        "GPU memory held over time, bytes times seconds, since the exporter started",
    ),
    (
        "sm_seconds",
        "gpukill_sm_seconds",
        "utilization-weighted GPU seconds where the backend measures a "
        "process's utilization, since the exporter started",
    ),
    (
        "energy_joules",
        "gpukill_energy_joules",
        "the processes' share of the GPUs' energy where the device reports power, since the exporter started",
    ),
)
RECENT_USAGE = 15 * 60.0  # seconds: a group seen this recently keeps its series; older ones are dropped


@dataclass
class UsageCounters:
    """The accounting's totals since the exporter started, one counter per (total, label, key). Fed GetUsage's
    reports (since = the exporter's start); a key keeps its series while it runs and RECENT_USAGE after its last
    sample, so the series stay bounded by what ran lately, as the gauges by what runs now. A counter never
    goes down: each value is the largest seen for its key (a record's prorated share only grows as it runs,
    but a daemon that answers from a store still being rebuilt must not make a counter reset)."""

    values: dict[tuple[str, str, str], float] = dataclasses.field(default_factory=dict)  # (total, label, key)

    def update(self, label: str, report: UsageReport, now: float) -> None:
        """Take a report grouped for `label`: its recent rows' totals; the label's other keys are dropped."""
        kept: dict[tuple[str, str, str], float] = {k: v for k, v in self.values.items() if k[1] != label}
        for row in report.rows:
            if row.hidden or not row.key or not (row.live or row.last_seen >= now - RECENT_USAGE):
                continue  # another user's unit we may not see, no unit at all, or long gone: no series
            for field, _, _ in USAGE_COUNTERS:
                value = getattr(row, field)
                if value is None:
                    continue
                key = (field, label, row.key)
                kept[key] = max(float(value), self.values.get(key, 0.0))
        self.values = kept

    def copy(self) -> UsageCounters:
        return UsageCounters(dict(self.values))

    def families(self) -> list[Metric]:
        out: list[Metric] = []
        for field, name, doc in USAGE_COUNTERS:
            family = CounterMetricFamily(name, doc + "; labelled by one of user, unit, slurm_job", labels=USAGE_LABELS)
            for (total, label, key), value in sorted(self.values.items()):
                if total == field:
                    family.add_metric([key if label == other else "" for other in USAGE_LABELS], value)
            out.append(family)
        return out


@dataclass(frozen=True, slots=True)
class Reading:
    """One scrape's worth of the daemon: None where the daemon did not answer that part."""

    devices: tuple[Device, ...] = ()
    processes: tuple[Process, ...] = ()
    backends: tuple[BackendStatus, ...] = ()
    guard: GuardStatus | None = None
    daemon_up: bool = False
    version: str = ""
    seconds: float = 0.0  # how long reading the daemon took
    age: float = 0.0  # how long ago that reading started, when served (the HTTP server serves one per interval)
    signals: SignalCounts | None = None
    usage: UsageCounters | None = None  # None: the daemon keeps no accounting (or has not answered GetUsage yet)
    # What gpukilld holds suspended (ListSuspended), and the names of their owners' uids: (uid, name)
    suspended: tuple[SuspendedProcess, ...] = ()
    user_names: tuple[tuple[int, str], ...] = ()


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def device_families(devices: Iterable[Device]) -> list[Metric]:
    up = _gauge(
        "gpukill_device_up", "1 when the GPU answers without a critical error (state ok), else 0", DEVICE_LABELS
    )
    util = _gauge("gpukill_device_utilization_ratio", "GPU utilization, 0 to 1", DEVICE_LABELS)
    used = _gauge("gpukill_device_memory_used_bytes", "GPU memory in use", DEVICE_LABELS)
    total = _gauge("gpukill_device_memory_total_bytes", "GPU memory in all", DEVICE_LABELS)
    temp = _gauge("gpukill_device_temperature_celsius", "GPU temperature", DEVICE_LABELS)
    power = _gauge("gpukill_device_power_watts", "GPU power draw", DEVICE_LABELS)
    limit = _gauge("gpukill_device_power_limit_watts", "GPU enforced power limit", DEVICE_LABELS)
    clock = _gauge("gpukill_device_clock_hertz", "GPU graphics clock", DEVICE_LABELS)
    for d in devices:
        labels = [str(d.index), d.id, d.pci_bus_id or "", d.vendor, d.name]
        up.add_metric(labels, 1.0 if d.state == STATE_OK else 0.0)
        # An unknown value is left out, never exposed as 0 (a missing sensor is not a cold GPU).
        for family, value in (
            (util, None if d.utilization is None else d.utilization / 100.0),
            (used, d.memory_used),
            (total, d.memory_total),
            (temp, d.temperature),
            (power, d.power),
            (limit, d.power_limit),
            (clock, None if d.clock_mhz is None else d.clock_mhz * MHZ),
        ):
            if value is not None:
                family.add_metric(labels, float(value))
    return [up, util, used, total, temp, power, limit, clock]


def attribution_families(processes: Iterable[Process]) -> list[Metric]:
    """GPU memory and distinct processes per user, unit, Slurm job, pod UID and container."""
    processes = list(processes)
    families: list[Metric] = []
    for label, field in GROUPINGS:
        memory: dict[str, float] = {}
        pids: dict[str, set[int]] = {}
        for p in processes:
            key = getattr(p, field)
            if not key:  # not in a unit, job, pod or container: no series with an empty label
                continue
            memory[key] = memory.get(key, 0.0) + float(p.gpu_memory or 0)
            pids.setdefault(key, set()).add(p.pid)
        mem = _gauge(f"gpukill_{label}_gpu_memory_bytes", f"GPU memory held by the processes of each {label}", [label])
        count = _gauge(f"gpukill_{label}_gpu_processes", f"GPU processes of each {label}", [label])
        for key in sorted(memory):
            mem.add_metric([key], memory[key])
            count.add_metric([key], float(len(pids[key])))
        families += [mem, count]
    return families


def process_families(processes: Iterable[Process]) -> list[Metric]:
    """One series per (process, GPU): only with --per-process (a new series for every PID)."""
    labels = ["pid", "user", "comm", "gpu"]
    mem = _gauge("gpukill_process_gpu_memory_bytes", "GPU memory a process holds on a GPU", labels)
    util = _gauge("gpukill_process_gpu_utilization_ratio", "a process's share of a GPU, 0 to 1", labels)
    for p in processes:
        key = [str(p.pid), p.user, p.comm, str(p.device)]
        if p.gpu_memory is not None:
            mem.add_metric(key, float(p.gpu_memory))
        if p.gpu_utilization is not None:
            util.add_metric(key, p.gpu_utilization / 100.0)
    return [mem, util]


SUSPENDED_LABELS = ["user", "gpu", "state"]


def suspended_families(
    records: Iterable[SuspendedProcess], user_names: Iterable[tuple[int, str]], per_process: bool
) -> list[Metric]:
    """The suspended processes (gpukillctl suspend) per user, GPU and state ("suspended", or "stuck" after a failed
    step): how many, and the GPU memory they hold in host memory. A process suspended off several GPUs is one
    series whose gpu label lists them ("0,1"); its memory is not split among them (the record holds its total).
    With per_process, one series per suspended process besides."""
    names = dict(user_names)
    count = _gauge(
        "gpukill_suspended_processes",
        "processes gpukilld holds suspended (off the GPU, their memory in host memory) or stuck, per user, GPU and "
        "state",
        SUSPENDED_LABELS,
    )
    held = _gauge(
        "gpukill_suspended_host_memory_bytes",
        "GPU memory of suspended processes held in host memory, per user, GPU and state",
        SUSPENDED_LABELS,
    )
    one = _gauge(
        "gpukill_suspended_process_host_memory_bytes",
        "GPU memory a suspended process holds in host memory",
        ["pid", "user", "comm", "gpu", "state"],
    )
    totals: dict[tuple[str, str, str], tuple[int, int]] = {}
    for r in records:
        user, gpu = names.get(r.uid, str(r.uid)), ",".join(map(str, r.devices))
        n, memory = totals.get((user, gpu, r.state), (0, 0))
        totals[(user, gpu, r.state)] = (n + 1, memory + r.memory)
        if per_process:
            one.add_metric([str(r.pid), user, r.comm, gpu, r.state], float(r.memory))
    for key, (n, memory) in sorted(totals.items()):
        count.add_metric(list(key), float(n))
        held.add_metric(list(key), float(memory))
    return [count, held, one] if per_process else [count, held]


def guard_families(guard: GuardStatus) -> list[Metric]:
    enabled = _gauge("gpukill_guard_enabled", "1 when Guard evaluates its policy", [])
    enabled.add_metric([], 1.0 if guard.enabled else 0.0)
    dry = _gauge("gpukill_guard_dry_run", "1 when Guard signals nothing (SetDryRun or the policy)", [])
    dry.add_metric([], 1.0 if guard.dry_run or guard.policy_dry_run else 0.0)
    violations = CounterMetricFamily(
        "gpukill_guard_violations",
        "subjects starting to violate a rule, since gpukilld started",
        labels=["rule", "action"],
    )
    actions = CounterMetricFamily(
        "gpukill_guard_actions",
        "what Guard did about violations, per rule and outcome, since gpukilld started",
        labels=["rule", "action", "outcome"],
    )
    for rule in guard.rules:
        violations.add_metric([rule.name, rule.action], float(rule.triggers))
        for field, outcome in GUARD_OUTCOMES:
            actions.add_metric([rule.name, rule.action, outcome], float(getattr(rule, field)))
    evaluations = CounterMetricFamily("gpukill_guard_evaluations", "Guard evaluations since gpukilld started")
    evaluations.add_metric([], float(guard.evaluations))
    last = _gauge("gpukill_guard_last_evaluation_seconds", "how long the last Guard evaluation took", [])
    last.add_metric([], guard.last_eval_ms / 1000.0)
    notices = CounterMetricFamily(
        "gpukill_guard_notifications",
        "Guard notices per channel and result: queued; "
        "delivered (written to a terminal, accepted by the mail server or webhook), "
        "skipped (nothing to deliver to), failed, dropped; desktop: announced",
        labels=["channel", "result"],
    )
    for n in guard.notifications:
        results = ("announced",) if n.channel == "desktop" else ("queued", "delivered", "skipped", "failed", "dropped")
        for result in results:
            notices.add_metric([n.channel, result], float(getattr(n, result)))
    return [enabled, dry, violations, actions, evaluations, last, notices]


def families(reading: Reading, per_process: bool) -> Iterator[Metric]:
    up = _gauge(
        "gpukill_up",
        "1 when gpukilld answered the exporter's latest reading on the system bus (one "
        "reading serves the scrapes of a sample interval)",
        [],
    )
    up.add_metric([], 1.0 if reading.daemon_up else 0.0)
    yield up
    duration = _gauge("gpukill_exporter_scrape_duration_seconds", "how long reading gpukilld took", [])
    duration.add_metric([], reading.seconds)
    yield duration
    age = _gauge(
        "gpukill_exporter_reading_age_seconds",
        "how long ago the reading served was started (one reading serves every scrape of a sample interval)",
        [],
    )
    age.add_metric([], reading.age)
    yield age
    if reading.signals is not None:
        yield from reading.signals.families()
    if not reading.daemon_up:
        return
    info = _gauge("gpukill_daemon_info", "gpukilld's version", ["version"])
    info.add_metric([reading.version], 1.0)
    yield info
    backend = _gauge("gpukill_backend_up", "1 when the backend reads devices", ["backend"])
    for b in reading.backends:
        backend.add_metric([b.name], 1.0 if b.available else 0.0)
    yield backend
    yield from device_families(reading.devices)
    yield from attribution_families(reading.processes)
    if per_process:
        yield from process_families(reading.processes)
    yield from suspended_families(reading.suspended, reading.user_names, per_process)
    if reading.guard is not None:
        yield from guard_families(reading.guard)
    if reading.usage is not None:
        yield from reading.usage.families()
