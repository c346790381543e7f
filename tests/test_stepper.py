"""The stepper (tests/helpers/workloads.py) counts the work a reclaim loses, as bench/reclaim --work-lost reads it:
on its declared signal it saves the step in hand and exits 0; with nothing declared, USR1 ends it as it ends any
Python program without a handler, and the steps since its last checkpoint are lost; asked to stop at the end of its
epoch, it saves and exits there. Real processes, no daemon: it runs as whoever runs the suite."""

from __future__ import annotations

import signal
import time

import pytest
from helpers.workloads import Stepper, stepper

STEP, EVERY = 0.01, 10


@pytest.fixture
def jobs(tmp_path):
    made: list[Stepper] = []

    def start(name: str, declare: str | None = None) -> Stepper:
        job = stepper("test-stepper", tmp_path / name, step=STEP, every=EVERY, declare=declare)
        made.append(job)
        return job

    yield start
    for job in made:
        job.cleanup()


def between_checkpoints(job: Stepper, after: int) -> int:
    """Wait until at least `after` steps are done and the job is mid-epoch: 3 to 7 steps past a checkpoint."""
    job.wait_progress(after)
    deadline = time.monotonic() + 10
    while not 3 <= (done := job.progress()) % EVERY <= 7:
        assert time.monotonic() < deadline, "the stepper does not step"
        time.sleep(STEP / 4)
    return done


def test_the_declared_signal_saves_the_step_in_hand_and_exits_0(jobs):
    job = jobs("declared", declare="USR1:120s")
    before = between_checkpoints(job, 2 * EVERY)
    job.proc.send_signal(signal.SIGUSR1)
    assert job.proc.wait(10) == 0
    assert job.checkpoint() == job.progress() >= before
    assert job.lost() == 0


def test_a_declared_term_is_handled_the_same(jobs):
    job = jobs("term", declare="SIGTERM:2m")
    between_checkpoints(job, EVERY)
    job.proc.terminate()
    assert job.proc.wait(10) == 0
    assert job.lost() == 0


def test_without_a_declaration_usr1_kills_it_and_the_steps_since_the_checkpoint_are_lost(jobs):
    job = jobs("undeclared")
    before = between_checkpoints(job, 2 * EVERY)
    job.proc.send_signal(signal.SIGUSR1)
    assert job.proc.wait(10) == -signal.SIGUSR1, "Python's default action for USR1 ends the process"
    saved, done = job.checkpoint(), job.progress()
    assert saved % EVERY == 0 and saved >= EVERY
    assert done >= before and job.lost() == done - saved >= 3


def test_asked_to_stop_it_saves_at_the_end_of_its_epoch_and_exits_0(jobs):
    job = jobs("stop")
    before = between_checkpoints(job, EVERY)
    job.stop_at_epoch_end()
    assert job.proc.wait(10) == 0
    saved = job.checkpoint()
    assert saved == job.progress() and saved % EVERY == 0 and saved > before, "it stopped at an epoch's end"
    assert job.lost() == 0
