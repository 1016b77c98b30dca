"""The real trainer in tiny jobs, with what a user sets that other tests leave at its default
(serial init, checkpoints by the clock, resume from one checkpoint's URL), and run by the
orchestrator's attempt loop as ``ett train`` runs it: its progress record reaches the
orchestrator, and a relaunch resumes from the newest commit (its ``resume`` mark says so).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.accounting.ett import report_for_job
from infra.accounting.ledger_format import INIT_SPANS, Mark, Span
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import committed_checkpoints
from infra.control import Phase, Progress
from infra.exit_codes import Outcome
from infra.settings import JobConfig
from tasks.orchestrator import JobObserver, run
from tests.factories import (
    assert_bit_identical,
    resume_marks,
    run_trainer,
    tiny_config,
    write_dataset,
)

STEPS = 6


@pytest.fixture(scope="module")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tiny_config(tmp_path_factory.mktemp("options-data"))
    write_dataset(config)
    return config.data.url


@pytest.fixture(scope="module")
def serial_job(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> JobConfig:
    """One attempt with serial init and a checkpoint due by the clock after every step
    (every_seconds far below a step's time; every_steps off)."""
    tmp_path = tmp_path_factory.mktemp("serial")
    config = tiny_config(
        tmp_path,
        job_id="serial",
        data={"url": data_url},
        train={"steps": STEPS, "parallel_init": False},
        checkpoint={"every_steps": None, "every_seconds": 1e-6, "keep_latest_k": 3},
    )
    result = run_trainer(config, tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return config


def _rank0(config: JobConfig, attempt: int = 0) -> list:
    return [e for e in read_events(config.layout) if e.rank == 0 and e.attempt == attempt]


def test_serial_init_runs_its_stages_one_after_another(serial_job: JobConfig) -> None:
    events = _rank0(serial_job)
    [device] = [e for e in events if e.name == Span.DEVICE_INIT]
    assert device.attrs["parallel"] is False
    stages = sorted(
        (e for e in events if e.name in INIT_SPANS and e.name != Span.DEVICE_INIT),
        key=lambda e: e.start,
    )
    names = [e.attrs.get("stage", e.name) for e in stages]
    assert {"process_group_init", "train_module_creation", "get_first_batch_data"} <= set(names)
    assert "restore" in names and names.index("restore") < names.index("get_first_batch_data")
    overlapping = [
        (a.attrs.get("stage", a.name), b.attrs.get("stage", b.name))
        for a, b in zip(stages, stages[1:], strict=False)
        if b.start < a.end
    ]
    assert overlapping == [], f"serial init ran stages at the same time: {overlapping}"
    assert device.end <= stages[0].start
    first_step = min(e.start for e in events if e.name == Span.TRAIN_STEP)
    assert stages[-1].end <= first_step
    assert [e.step for e in events if e.name == Span.TRAIN_STEP] == list(range(1, STEPS + 1))


def test_every_seconds_checkpoints_by_the_clock(serial_job: JobConfig) -> None:
    """every_seconds below a step's time: a checkpoint after every step, then the anchor."""
    events = _rank0(serial_job)
    commits = [e.step for e in events if e.name == Mark.CHECKPOINT_COMMITTED]
    assert commits == list(range(1, STEPS + 1))
    [interval] = [e.attrs for e in events if e.name == Mark.CHECKPOINT_INTERVAL]
    assert interval["reason"] == "fixed" and interval["interval_s"] == 1e-6
    kept = committed_checkpoints(serial_job.layout)
    assert [c.step for c in kept] == [6, 5, 4] and kept[0].manifest.anchor


def test_resume_from_an_explicit_checkpoint_url(
    tmp_path: Path, data_url: str, serial_job: JobConfig
) -> None:
    """Another job resumes from the serial job's step-4 checkpoint, named by its URL: it
    trains steps 5 and 6 only and ends bit-identical to the job it came from."""
    [source] = [c for c in committed_checkpoints(serial_job.layout) if c.step == 4]
    config = tiny_config(
        tmp_path,
        job_id="from-url",
        data={"url": data_url},
        train={"steps": STEPS},
        checkpoint={"resume": source.url},
    )
    result = run_trainer(config, tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert resume_marks(config) == [(0, 4, False)]
    events = _rank0(config)
    [mark] = [e for e in events if e.name == Mark.RESUME]
    assert mark.attrs["url"] == source.url
    assert [e.step for e in events if e.name == Span.TRAIN_STEP] == [5, 6]
    assert_bit_identical(serial_job, config, STEPS)


class ProgressSeen(JobObserver):
    """Every progress record the orchestrator sampled."""

    def __init__(self) -> None:
        self.seen: list[Progress] = []

    def progress(self, progress: Progress) -> None:
        self.seen.append(progress)


def test_progress_reaches_the_orchestrator_and_every_recovery_resumes_at_its_commit(
    tmp_path: Path, data_url: str
) -> None:
    """Two crashes in attempt 0: in step 5, recovered in process from the commit of step 4;
    in step 7, within the in-process window, so it escalates: the attempt fails and the
    relaunch resumes from the commit of step 6. The orchestrator learns from the trainer's
    progress record where attempt 0 was (step 6: step 7 never ran to its end), every recovery
    shows its resume mark at the step expected (identical weights alone cannot tell a resume
    from a retrain), and each failure counts once."""
    steps = 8
    config = tiny_config(
        tmp_path,
        job_id="watched",
        data={"url": data_url},
        train={"steps": steps, "eval": "off"},
        checkpoint={"every_steps": 2, "preemption_budget_s": 20},
        recovery={
            "standby": False,
            "in_process_window_s": 3600,
            "max_failures": 1,
            "backoff_s": 0,
        },
        faults=[
            {"kind": "crash", "step": 5, "attempt": 0},
            {"kind": "crash", "step": 7, "attempt": 0},
        ],
    )
    watcher = ProgressSeen()
    outcome = run(config, watcher, env={"OMP_NUM_THREADS": "1"}).outcome
    seen = watcher.seen

    assert [a.outcome for a in outcome.attempts] == [Outcome.CRASH, Outcome.SUCCESS]
    assert [a.last_step for a in outcome.attempts] == [6, steps]
    assert [a.total_steps for a in outcome.attempts] == [steps, steps]
    assert [a.restarts_in_process for a in outcome.attempts] == [1, 0]
    assert all(a.reached_trainer_s is not None for a in outcome.attempts)
    # The observer sees the record as sampled (every 50 ms): not every step, but only steps
    # that ran, of this job's total.
    training = [p for p in seen if p.phase == Phase.TRAINING]
    assert training and all(0 < p.step <= steps and p.total == steps for p in training)
    assert {p.phase for p in seen} <= {Phase.INIT, Phase.TRAINING, Phase.DONE}

    assert resume_marks(config) == [(0, 4, True), (1, 6, False)]
    events = read_events(config.layout)
    [failure] = [e for e in events if e.name == Mark.FAILURE]
    assert (failure.attempt, failure.step, failure.attrs["cause"]) == (0, 6, "crash")
    restarts = [e for e in events if e.name == Mark.IN_PROCESS_RESTART]
    assert [(e.attempt, e.step) for e in restarts] == [(0, 5)]  # not the escalated one
    # The relaunch's interval policy knows both failures: the one survived in process too.
    intervals = [e for e in events if e.name == Mark.CHECKPOINT_INTERVAL]
    assert [(e.attempt, e.attrs["failures"]) for e in intervals] == [(0, 0), (1, 2)]
    launches = [e for e in events if e.name == Span.LAUNCHER_INIT]
    assert [e.attrs["reached_trainer"] for e in launches] == [True, True]
    report = report_for_job(config.layout)
    assert report.finished
    assert [(f.attempt, f.cause, f.last_step, f.in_process) for f in report.failures] == [
        (0, "crash", 5, True),
        (0, "crash", 6, False),
    ]
    assert report.buckets["unknown"] == 0  # the ledger saw everything the orchestrator did
