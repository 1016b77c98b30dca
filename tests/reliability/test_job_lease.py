"""One job id, one job: a second job with the same job_id refuses to start while the first
runs (JOB_LOCKED, naming the job URL and the holder), and the lease itself on local disk and
on S3: exclusive, renewed, released, taken over when its holder died or stopped renewing.

Before: two jobs with one job_id ran at once, sharing ledgers, purging each other's
in-flight checkpoints and resuming from each other's state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.exit_codes import ExitCode, Outcome, outcome_of
from infra.job_layout import JobLayout
from tests.factories import ROOT
from tests.reliability.jobs import Trainer, job_config, run_to_end


# -- the trainer side -------------------------------------------------------------------------
@pytest.mark.slow
def test_second_job_with_the_same_job_id_refuses_to_start(tmp_path: Path, data_url: str) -> None:
    first = job_config(tmp_path, data_url, steps=1_000_000)
    running = Trainer(first, tmp_path)
    try:
        pids: list[int] = []

        def training() -> bool:
            events = read_events(first.layout)
            pids.extend(int(e.attrs["pid"]) for e in events if e.name == "attempt_start")
            return any(e.name == "checkpoint_committed" for e in events)

        running.wait_until("the first job's first checkpoint", training)
        second = job_config(tmp_path, data_url, steps=20)  # same job_id, shorter
        code, out = run_to_end(second, tmp_path, nproc=2)
        assert code == ExitCode.JOB_LOCKED, out[-3000:]
        assert outcome_of(code) is Outcome.JOB_LOCKED and Outcome.JOB_LOCKED.fatal
        [line] = [line for line in out.splitlines() if "is in use by another job" in line]
        assert first.layout.url in line and f"pid {pids[0]}" in line, line
        # The refused job left no trace in the running one's ledger.
        assert {(e.attempt, e.rank) for e in read_events(first.layout)} == {(0, 0)}

        os.kill(pids[0], signal.SIGTERM)  # the first job is preempted: it saves and exits
        assert running.wait() == ExitCode.PREEMPTED, running.tail()
    finally:
        if running.proc.poll() is None:
            running.kill()
        running.assert_gone()
    code, out = run_to_end(second, tmp_path)  # the job id is free again
    assert code == ExitCode.SUCCESS, out[-3000:]
    assert [e.attempt for e in read_events(second.layout) if e.name == "resume"] == [1]


@pytest.mark.slow
def test_trainers_with_the_orchestrators_token_share_its_lease(
    tmp_path: Path, data_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator holds the lease for the whole job and passes its token: its trainers
    run (any number at once only check it); a trainer without the token is refused."""
    from infra.lease import ENV_VAR, acquire_job_lease, trainer_lease

    config = job_config(tmp_path, data_url, steps=5)
    with acquire_job_lease(config.layout) as lease:
        code, out = run_to_end(config, tmp_path, env=lease.env())
        assert code == ExitCode.SUCCESS, out[-3000:]
        code, out = run_to_end(config, tmp_path)
        assert code == ExitCode.JOB_LOCKED, out[-3000:]
        assert f"pid {os.getpid()}" in out
        # An attempt and the standby of the next one, with the same token, at the same time.
        monkeypatch.setenv(ENV_VAR, lease.token)
        entered = threading.Barrier(3, timeout=30)

        def group() -> None:
            with trainer_lease(config.layout, rank=0):
                entered.wait()

        threads = [threading.Thread(target=group) for _ in range(2)]
        for t in threads:
            t.start()
        entered.wait()  # both groups are inside at once
        for t in threads:
            t.join()


def test_ranks_without_an_orchestrator_take_rank_0s_attempt_number_after_a_resize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job run without an orchestrator on 2 ranks, then on 1, now on 2 again: rank 1 has
    one ledger file where rank 0 has two. Counting its own files, rank 1 would call this
    launch attempt 1, the 1-rank launch's number: its events filed with another launch's
    (an MFU weighed against that launch's devices). It takes rank 0's number, 2, from the
    lease rank 0 holds."""
    from infra.accounting.ledger import Ledger
    from infra.accounting.ledger_format import Mark
    from infra.control import ENV_ATTEMPT
    from infra.lease import ENV_VAR, trainer_lease
    from trainer.train import attempt_number

    layout = JobLayout.at(f"file://{tmp_path}/jobs/resized")
    for attempt, rank in [(0, 0), (0, 1), (1, 0)]:  # 2 ranks, then 1
        with Ledger(layout, attempt=attempt, rank=rank) as ledger:
            ledger.mark(Mark.ATTEMPT_START, pid=os.getpid())
    for name in (ENV_VAR, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "third-launch")
    assert [attempt_number(layout, rank) for rank in (0, 1)] == [2, 1]  # the ranks' counts
    both_in = threading.Barrier(2, timeout=60)
    numbers: dict[int, int] = {}

    def rank(r: int) -> None:
        with trainer_lease(layout, r, attempt_number(layout, r)) as number:
            numbers[r] = number
            both_in.wait()  # rank 0 holds its lease until rank 1 has read it

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert numbers == {0: 2, 1: 2}


# -- the lease --------------------------------------------------------------------------------
@pytest.fixture(params=["file", "s3"])
def job_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/jobs/leased"
    request.getfixturevalue("s3_server")
    storage.configure(None)
    return f"s3://ett/{uuid.uuid4().hex[:12]}/jobs/leased"


def test_lease_is_exclusive_and_names_its_holder(job_url: str) -> None:
    from infra.lease import JobLocked, acquire_job_lease, check_job_lease

    with acquire_job_lease(JobLayout.at(job_url)) as held:
        with pytest.raises(JobLocked, match=f"job {job_url} is in use") as err:
            acquire_job_lease(JobLayout.at(job_url))
        assert f"pid {os.getpid()}" in str(err.value) and held.token[:8] in str(err.value)
        check_job_lease(JobLayout.at(job_url), held.token)
        with pytest.raises(JobLocked, match="no longer owns the job"):
            check_job_lease(JobLayout.at(job_url), "someone-else")
    with acquire_job_lease(JobLayout.at(job_url)):  # released: free at once
        pass


def test_only_one_of_many_racing_jobs_gets_the_lease(job_url: str) -> None:
    from infra.lease import JobLease, JobLocked, acquire_job_lease

    won: list[JobLease] = []
    refused: list[JobLocked] = []
    start = threading.Barrier(6)

    def race() -> None:
        start.wait()
        try:
            won.append(acquire_job_lease(JobLayout.at(job_url)))
        except JobLocked as exc:
            refused.append(exc)

    threads = [threading.Thread(target=race) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert (len(won), len(refused)) == (1, 5)
    finally:
        for lease in won:
            lease.release()


def test_lease_renewed_while_held_and_taken_over_once_expired(job_url: str) -> None:
    from infra.lease import JobLocked, acquire_job_lease, current_lease

    held = acquire_job_lease(JobLayout.at(job_url), ttl_s=1.5)
    time.sleep(2.5)  # longer than the TTL: the heartbeat renewed it
    with pytest.raises(JobLocked):
        acquire_job_lease(JobLayout.at(job_url), ttl_s=1.5)
    held._stop.set()  # the holder hangs: it stops renewing, but its process lives on
    held._thread.join()
    taker = acquire_job_lease(JobLayout.at(job_url), ttl_s=30, wait_s=10)
    try:
        current = current_lease(JobLayout.at(job_url))
        assert current is not None and current.token == taker.token
        assert not held.renew() and held.lost.is_set()  # the old holder learns it lost it
    finally:
        taker.release()


def test_lease_of_a_dead_process_is_taken_over_at_once(job_url: str) -> None:
    from infra.lease import acquire_job_lease, current_lease

    code = (
        "from infra.job_layout import JobLayout\nfrom infra.lease import acquire_job_lease\n"
        f"acquire_job_lease(JobLayout.at({job_url!r}), ttl_s=600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)  # never released
    dead = current_lease(JobLayout.at(job_url))
    assert dead is not None and not dead.released and not dead.live()
    with acquire_job_lease(JobLayout.at(job_url), ttl_s=600) as lease:
        current = current_lease(JobLayout.at(job_url))
        assert current is not None and current.token == lease.token
