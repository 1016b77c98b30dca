"""However ``ett train`` ends, nothing of the job is left: no process, nothing in its temp
folder or in /dev/shm. Ctrl-C (SIGINT) exits 130 after the running attempt's emergency
checkpoint, SIGTERM 143, and further signals do not interrupt that cleanup.

Before: every attempt left a ``torchelastic_*`` folder in the temp folder (torchrun's log
folder) and a crashed forked rank a ``pytorch-errorfile-*.pickle``; a warm standby that was
released after it had parked left its checkpoint spool ``ett-ckpt-<job>-r0-p<pid>-*``, and
so did a rank killed while uploading a checkpoint to S3 when no attempt came after it;
Ctrl-C exited 143, and a second Ctrl-C landed inside the cleanup of the first and left the
attempt's ``ett-a*`` control folders (and, with a hung attempt, its processes) behind. A job
that failed with the in-memory tier on leaves no segment in /dev/shm: the orchestrator
removes them whatever the outcome.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.accounting.ledger_format import Span
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import MANIFEST, Manifest, committed_checkpoints
from infra.exit_codes import ExitCode
from infra.job_layout import JobLayout
from tests.reliability.ett_job import EttTrain
from tests.reliability.jobs import job_config, s3_root

LONG = 1_000_000  # steps: a job that runs until it is stopped
PARKED = "ready: parked until promoted"  # the standby's trainer says so once parked


@pytest.fixture
def started() -> Iterator[list[EttTrain]]:
    """The jobs a test starts, ended after it whatever it found."""
    jobs: list[EttTrain] = []
    yield jobs
    for job in jobs:
        job.end()


def start(started: list[EttTrain], tmp_path: Path, data_url: str, *flags: str, **kw: Any):
    job_id = kw.pop("job_id")
    config = job_config(tmp_path, data_url, job_id=job_id, **kw)
    job = EttTrain(config, tmp_path, *flags)
    started.append(job)
    return config, job


def last_step(job_url: str, attempt: int) -> int:
    """The last training step the attempt's rank 0 finished, from its ledger."""
    steps = [
        e.step
        for e in read_events(JobLayout.at(job_url))
        if e.name == Span.TRAIN_STEP and e.attempt == attempt and e.rank == 0
    ]
    assert steps, "no training step in the ledger"
    return max(s for s in steps if s is not None)


def test_a_job_that_succeeds_leaves_nothing(
    tmp_path: Path, data_url: str, started: list[EttTrain]
) -> None:
    _, job = start(started, tmp_path, data_url, steps=20, job_id="clean-ok")
    assert job.wait() == ExitCode.SUCCESS, job.tail()
    assert "succeeded on attempt 0" in job.stdout()
    job.assert_left_nothing()


def test_ctrl_c_exits_130_after_an_emergency_checkpoint(
    tmp_path: Path, data_url: str, started: list[EttTrain]
) -> None:
    # No checkpoint but the emergency one: every_steps is beyond the job's steps.
    config, job = start(
        started,
        tmp_path,
        data_url,
        steps=LONG,
        job_id="clean-ctrl-c",
        checkpoint={"every_steps": LONG},
    )
    job.wait_for("step 25/")
    job.signal(signal.SIGINT)
    assert job.wait() == 130, job.tail()
    assert "stopped: the running attempt was preempted" in job.stderr()
    [checkpoint] = committed_checkpoints(config.layout)
    stopped_at = last_step(config.layout.url, attempt=0)
    assert checkpoint.step == stopped_at >= 25
    assert f"preempted: saving at step {stopped_at} " in job.stderr()
    job.assert_left_nothing()


def test_a_second_ctrl_c_does_not_abort_the_cleanup(
    tmp_path: Path, data_url: str, started: list[EttTrain]
) -> None:
    # A hung attempt ignores the SIGTERM that asks it to checkpoint: the cleanup waits the
    # preemption budget + margin before SIGKILL, and the second Ctrl-C lands inside it.
    _, job = start(
        started,
        tmp_path,
        data_url,
        steps=LONG,
        job_id="clean-twice",
        checkpoint={"every_steps": LONG, "preemption_budget_s": 1},
        faults=[{"kind": "hang", "step": 10, "attempt": 0}],
    )
    job.wait_for("injected hang at step 10")
    job.signal(signal.SIGINT)
    job.wait_for("ett train: SIGINT: stopping")  # the first is being handled
    for times in (1, 2):  # each lands inside the cleanup, which waits >= 11 s for the hang
        job.signal(signal.SIGINT)
        job.wait_for("ett train: SIGINT ignored", count=times)
    assert job.wait() == 130, job.tail()
    job.assert_left_nothing()


def test_sigterm_exits_143_and_the_released_standby_leaves_no_spool(
    tmp_path: Path, data_url: str, started: list[EttTrain]
) -> None:
    _, job = start(started, tmp_path, data_url, steps=LONG, job_id="clean-term")
    job.wait_for(PARKED)  # the standby's checkpointer exists: it is released below
    job.signal(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM, job.tail()
    assert not list(job.tmpdir.glob("ett-ckpt-*"))
    job.assert_left_nothing()


def test_a_job_out_of_retries_leaves_nothing(
    tmp_path: Path, data_url: str, started: list[EttTrain]
) -> None:
    # A crash that the attempt does not recover in process ends the job (max_failures 0);
    # the rank dies of an exception, which torch.multiprocessing used to pickle into the
    # temp folder. Its in-memory copies (steps 2 and 4) are the ended job's to remove.
    _, job = start(
        started,
        tmp_path,
        data_url,
        "--max-failures",
        "0",
        steps=LONG,
        job_id="clean-fail",
        checkpoint={"memory_tier": {"every_steps": 2}},
        recovery={"in_process_restart": False},
        faults=[{"kind": "crash", "step": 5, "attempt": 0}],
    )
    assert job.wait() == ExitCode.CRASH, job.tail()
    assert "exceed max_failures=0" in job.stdout(), job.tail()
    job.assert_left_nothing()


def test_a_rank_killed_mid_upload_to_s3_leaves_no_spool(
    tmp_path: Path, data_url: str, started: list[EttTrain], s3_server: str
) -> None:
    # On an object store a checkpoint is written to a local spool, then uploaded: a SIGKILL
    # in between leaves the whole checkpoint there, and the job ends (max_failures 0). The
    # killed rank's in-memory copy of that step (written first) is left in /dev/shm too.
    storage_section = {"root": s3_root(), "s3_endpoint_url": s3_server}
    _, job = start(
        started,
        tmp_path,
        data_url,
        "--max-failures",
        "0",
        steps=LONG,
        job_id="clean-upload",
        storage=storage_section,
        checkpoint={"memory_tier": True},
        faults=[{"kind": "sigkill_mid_upload", "step": 5, "attempt": 0}],
    )
    assert job.wait() == 128 + signal.SIGKILL, job.tail()
    job.assert_left_nothing()


def test_a_fatal_failure_leaves_nothing(
    tmp_path: Path, data_url: str, started: list[EttTrain]
) -> None:
    # A committed checkpoint (as far as its manifest says) of another model: the trainer
    # refuses it (84), which no relaunch can fix.
    other = f"file://{tmp_path}/other/checkpoints/step-000000005"
    manifest = Manifest(step=5, world_size=1, config_hash="another-model", files={})
    storage.write_text(storage.join(other, MANIFEST), manifest.to_json())
    _, job = start(
        started,
        tmp_path,
        data_url,
        steps=20,
        job_id="clean-fatal",
        checkpoint={"resume": other},
    )
    assert job.wait() == ExitCode.CHECKPOINT_INCOMPATIBLE, job.tail()
    assert "not retried" in job.stdout(), job.tail()
    job.assert_left_nothing()
