"""How long the GPU memory took to come back after a kill: the Watch times it from the kill's first signal to the
sample that showed it back (a clock and samples injected here), the record carries it to every client, the text
and the journal say it; and the kill path sends SIGTERM before any SIGKILL, force or not."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from helpers.guard_inputs import proc

from gpukill.outcome import Outcome, reclaim_text
from gpukill.records.base import from_plain, to_plain
from gpukill.records.reclaim import Holder, Reclaim
from gpukilld.acts.killer import Killer, PinnedProcess
from gpukilld.acts.reclaim import FirstSignal, Watch, reclaim_fields
from gpukilld.model import GpuProcess, Snapshot
from gpukilld.proc.procfs import ProcFS

GIB = 1 << 30


def _gpu(pid: int, unit: str = "train.service", mem: int = GIB) -> GpuProcess:
    return proc(pid, comm=f"p{pid}", mem=mem, user="u", start=pid, unit=unit)


class Samples:
    """The daemon's sampler as the Watch sees it: each resample is the next sample, one interval later on the
    clock; `still` says how many of them still show the trainer's worker holding memory."""

    def __init__(self, still: int, interval: float = 1.0, now: float = 100.0) -> None:
        self.still = still
        self.interval = interval
        self.now = now
        self.taken = 0

    def clock(self) -> float:
        return self.now

    async def resample(self) -> Snapshot:
        self.now += self.interval
        self.taken += 1
        held = (_gpu(11),) if self.taken <= self.still else ()
        return Snapshot(self.taken + 1, 0.0, (), held, ())


def _watch(tmp_path, samples: Samples) -> Watch:
    # the trainer (10) and a worker of its unit (11), 4 GiB between them
    before = Snapshot(1, 0.0, (), (_gpu(10, mem=3 * GIB), _gpu(11)), ())
    return Watch(ProcFS(str(tmp_path)), before, [(10, 10)], {}, clock=samples.clock)


def test_the_seconds_run_from_the_first_signal_to_the_sample_that_showed_the_memory_back(tmp_path):
    samples = Samples(still=1)
    watch = _watch(tmp_path, samples)
    sent = FirstSignal("SIGTERM", 99.7)  # 0.3 s before the clock's 100: the exit took that long
    r = asyncio.run(watch.after_exit(samples.resample, sent))
    assert r.verdict == "reclaimed" and r.reclaimed == 4 * GIB and r.samples == 2
    assert r.seconds == pytest.approx(2.3) and r.first_signal == "SIGTERM"
    assert reclaim_text(r) == "GPU memory reclaimed (4.0 GiB) 2.3s after SIGTERM"


def test_a_signal_sent_before_the_term_moves_the_start_earlier(tmp_path):
    """A checkpoint signal sent first is what the seconds count from, and the text names it."""
    samples = Samples(still=0)
    r = asyncio.run(_watch(tmp_path, samples).after_exit(samples.resample, FirstSignal("SIGUSR1", 40.0)))
    assert r.seconds == pytest.approx(61.0) and r.first_signal == "SIGUSR1"
    assert reclaim_text(r).endswith(" 1min 1s after SIGUSR1")


def test_memory_still_held_after_the_watch_has_no_figure(tmp_path):
    samples = Samples(still=5)
    r = asyncio.run(_watch(tmp_path, samples).after_exit(samples.resample, FirstSignal("SIGTERM", 99.0)))
    assert r.verdict == "held" and r.samples == 3 and samples.taken == 3
    assert r.seconds is None and r.first_signal == ""
    assert "still held" in reclaim_text(r) and " after SIGTERM" not in reclaim_text(r)
    assert reclaim_fields(r)["reclaim_seconds"] is None


def test_a_stuck_or_living_target_has_no_figure_and_its_text_says_the_memory_is_not_back(tmp_path):
    watch = _watch(tmp_path, Samples(still=0))
    stuck = watch.stuck(10)
    assert stuck.seconds is None
    assert "its GPU memory is not back until gpukillctl reset 0" in reclaim_text(stuck)
    alive = Reclaim("alive", devices=(0,), remedy="kill --force sends SIGKILL")
    assert alive.seconds is None and reclaim_text(alive) == "GPU memory not reclaimed: it still runs"


def test_the_figure_reaches_the_journal_the_record_and_the_words():
    r = Reclaim("reclaimed", reclaimed=4 * GIB, devices=(0,), samples=1, seconds=1.2996, first_signal="SIGTERM")
    fields = reclaim_fields(r)
    assert fields["reclaim_seconds"] == "1.300" and fields["reclaim_first_signal"] == "SIGTERM"
    # the plain form (JSON, REST, MCP, a{sv} unwrapped) keeps it; an older gpukilld's record has none
    assert from_plain(Reclaim, to_plain(r)) == r
    old = from_plain(Reclaim, {"verdict": "reclaimed", "reclaimed": 4 * GIB})
    assert old.seconds is None and reclaim_text(old) == "GPU memory reclaimed (4.0 GiB)"
    # the signal's name is as a record gives it: escaped like any text of the reply
    odd = Reclaim("reclaimed", seconds=0.25, first_signal="SIG\x1b[2J")
    assert reclaim_text(odd) == "GPU memory reclaimed 250ms after SIG\\x1b[2J"
    held = Reclaim("held", held=GIB, holders=(Holder(7, 1, 1000, "w", 0, GIB, "orphan", 1),), remedy="r")
    assert "reclaim_seconds" in reclaim_fields(held) and reclaim_fields(held)["reclaim_first_signal"] is None


# -- SIGTERM before SIGKILL, always ----------------------------------------------------------------------------


def _ignores_term() -> subprocess.Popen:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


@pytest.mark.parametrize("grace", [0.0, 0.2])
def test_force_sends_sigterm_before_sigkill_even_with_no_grace(monkeypatch, grace):
    """The signals the kill path sends, in order, to a process that ignores SIGTERM: TERM first, KILL only after
    it (grace 0 included, where nothing waits between them)."""
    sent: list[signal.Signals] = []
    real = signal.pidfd_send_signal

    def recorded(pidfd: int, sig: signal.Signals, *args: object) -> None:
        sent.append(sig)
        real(pidfd, sig)

    monkeypatch.setattr(signal, "pidfd_send_signal", recorded)
    proc = _ignores_term()
    target = PinnedProcess(proc.pid, 0, 0, "u", "x", ("GPU-0",), os.pidfd_open(proc.pid))
    try:
        assert asyncio.run(Killer().terminate(target, grace, force=True)) == Outcome.KILLED
        assert sent == [signal.SIGTERM, signal.SIGKILL]
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        target.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
