"""The core recovery paths, each in one short run of the real trainer (fast tier).

Every faulted job is compared with one clean run of the same config (a module fixture): the
final anchors must hold bit-identical model and optimizer tensors, and each recovery must show
its ``resume`` mark at the step expected (identical weights alone cannot tell a resume from a
retrain: training is deterministic). Checkpoints every ``EVERY`` steps, so the commits are at
5 and 10 and the anchor at ``STEPS``.

- in-process restart several steps after a commit: it resumes at the commit and redoes the
  steps since (the one-step case is in tests/trainer/test_run_options.py);
- restore fallback: the newest commit corrupt, the previous one loaded, the first batch taken
  from ITS data position (the early peek read the corrupt one's);
- a warm standby promoted after it parked: it resumes from the newest commit at promotion;
- two ranks checkpointing by the clock (``every_seconds``): both at the same steps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ett import report_for_job
from infra.accounting.ledger_format import Event, Mark, Span
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import QUARANTINE, committed_checkpoints, rank_state_name
from infra.exit_codes import ExitCode, Outcome
from infra.settings import JobConfig
from tasks.attempt import AttemptProcess
from tasks.orchestrator import Orchestrator
from tests.factories import assert_bit_identical, resume_marks
from tests.reliability.jobs import job_config, run_to_end, step_folder

STEPS = 15
EVERY = 5  # job_config's every_steps
HELD_S = 120  # the longest attempt 0 of the standby test waits for its standby to park


def _steps(config: JobConfig, attempt: int) -> list[int]:
    """The train steps rank 0 of ``attempt`` ran to their end, in order."""
    return [
        e.step
        for e in read_events(config.layout)
        if e.name == Span.TRAIN_STEP and e.rank == 0 and e.attempt == attempt
    ]


def _anchor_loader(config: JobConfig) -> dict:
    """Rank 0's data position saved with the job's anchor."""
    anchor = committed_checkpoints(config.layout)[0]
    assert anchor.manifest.anchor and anchor.step == STEPS
    path = Path(storage.local_path(anchor.url) or "") / rank_state_name(0)
    return json.loads(path.read_text())["loader"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> JobConfig:
    """The reference: the same job, uninterrupted."""
    tmp_path = tmp_path_factory.mktemp("clean")
    config = job_config(tmp_path, data_url, STEPS, job_id="clean")
    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    assert [c.step for c in committed_checkpoints(config.layout)] == [15, 10, 5]
    return config


def test_an_in_process_restart_steps_after_a_commit_redoes_them_exactly(
    tmp_path: Path, data_url: str, clean: JobConfig
) -> None:
    """Commit at 10, exception in step 14: the restart loads step 10 back (model, optimizer,
    RNG and the data position) and steps 11-14 run again, on the same batches."""
    config = job_config(
        tmp_path,
        data_url,
        STEPS,
        job_id="restarted",
        faults=[{"kind": "crash", "step": 14, "attempt": 0}],
        recovery={"standby": False},
    )
    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    assert resume_marks(config) == [(0, 10, True)]
    restarts = [e for e in read_events(config.layout) if e.name == Mark.IN_PROCESS_RESTART]
    assert [(e.attempt, e.step) for e in restarts] == [(0, 14)]
    # Step 14 failed before it ran; 11-13 ran twice, the second time from the commit of 10.
    assert _steps(config, 0) == [*range(1, 14), *range(11, STEPS + 1)]
    assert _anchor_loader(config) == _anchor_loader(clean)
    assert_bit_identical(clean, config, STEPS)


def test_a_corrupt_newest_commit_falls_back_to_the_previous_one_and_its_data_position(
    tmp_path: Path, data_url: str, clean: JobConfig
) -> None:
    """A job whose commits are 5 and 10 (the clean run's, copied) with step 10 corrupt: the
    attempt loads 5, quarantines 10, takes its first batch from step 5's data position (the
    early peek had read step 10's) and ends bit-identical to the uninterrupted run."""
    config = job_config(tmp_path, data_url, STEPS, job_id="fallback")
    for step in (5, 10):
        src = storage.local_path(step_folder(clean.layout.url, step)) or ""
        shutil.copytree(src, storage.local_path(step_folder(config.layout.url, step)) or "")
    newest = Path(storage.local_path(step_folder(config.layout.url, 10)) or "")
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    assert resume_marks(config) == [(0, 5, False)]
    assert _steps(config, 0) == list(range(EVERY + 1, STEPS + 1))
    quarantine = Path(storage.local_path(config.layout.checkpoints) or "") / QUARANTINE
    assert [p.name.split("-")[1] for p in quarantine.iterdir()] == ["000000010"]
    # The first batch was fetched from the peeked step 10 while restore ran; restore fell
    # back to step 5, so the loader was put back at step 5's position and fetched again.
    assert "first batch re-fetched: restore resumed at step 5" in out
    assert _anchor_loader(config) == _anchor_loader(clean)
    assert_bit_identical(clean, config, STEPS)
    # The report names the fallback: where it resumed, what it skipped, and why.
    [resume] = report_for_job(config.layout).resumes
    assert (resume.how, resume.step, resume.newest_step) == ("cold", 5, 10)
    assert resume.skipped == ((10, f"checksum mismatch in {shard.name}", True),)


def _kill_when_standby_parked(config: JobConfig, attempt: AttemptProcess, seen: list) -> None:
    """Attempt 0 hangs in step 12 (after its commit of step 10): once the standby has parked,
    its rank dies (SIGKILL, a lost worker). ``seen`` gets the newest committed step then."""
    deadline = time.monotonic() + HELD_S
    while time.monotonic() < deadline and attempt.poll() is None:
        events = read_events(config.layout)
        parked = any(e.name == Mark.STANDBY_READY and e.attempt == 1 for e in events)
        committed = any(
            e.name == Mark.CHECKPOINT_COMMITTED and e.attempt == 0 and e.step == 2 * EVERY
            for e in events
        )
        if parked and committed:
            seen.append(committed_checkpoints(config.layout)[0].step)
            for pid, _ in attempt.nodes[0].rank_exits():
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.1)


@pytest.mark.timeout(HELD_S + 120)  # attempt 0 is held in a hang by design
@pytest.mark.parametrize("park", ["device", "host"])
def test_a_standby_promoted_after_it_parked_resumes_from_the_newest_commit(
    tmp_path: Path, data_url: str, clean: JobConfig, park: str
) -> None:
    """Parked on the device, the standby built its train module before it parked; parked on
    the host (the GPU host's default, forced here on a CPU: the same code path), only once
    promoted, from the model it kept host-side. Either way it resumes exactly."""
    recovery = {"max_failures": 1, "backoff_s": 0, "standby": True, "hang_timeout_s": HELD_S}
    config = job_config(
        tmp_path,
        data_url,
        STEPS,
        job_id=f"promoted-{park}",
        faults=[{"kind": "hang", "step": 12, "attempt": 0}],  # held there until the kill
        checkpoint={"preemption_budget_s": 20},
        # If the kill never comes: a hang, and a failure.
        recovery={**recovery, "standby_park": park},
    )
    newest_at_kill: list[int] = []
    with Orchestrator(config, env={"OMP_NUM_THREADS": "1"}) as job:
        for attempt in job:
            if attempt.number == 0:
                args = (config, attempt, newest_at_kill)
                threading.Thread(target=_kill_when_standby_parked, args=args, daemon=True).start()
            job.watch(attempt)
    assert job.result is not None
    outcome = job.result.outcome
    got = [(a.outcome, a.from_standby) for a in outcome.attempts]
    assert got == [(Outcome.SIGKILL, False), (Outcome.SUCCESS, True)], outcome.message
    assert newest_at_kill == [2 * EVERY]
    assert resume_marks(config) == [(1, 2 * EVERY, False)]
    events = read_events(config.layout)

    def event(name: str, attempt: int) -> Event:
        [found] = [e for e in events if e.name == name and e.attempt == attempt and e.rank == 0]
        return found

    def when(name: str, attempt: int) -> float:
        return event(name, attempt).start

    # Parked before attempt 0 failed, promoted after, and only then restored.
    assert when(Mark.STANDBY_READY, 1) < when(Mark.FAILURE, 0) < when(Mark.PROMOTED, 1)
    assert when(Mark.PROMOTED, 1) < when(Mark.RESUME, 1)
    # Where the model was while it parked: built with nothing on a device, then put there
    # before the gate (device) or after the promotion (host).
    ready, built = event(Mark.STANDBY_READY, 1), event(Span.MODEL_BUILD, 1)
    assert ready.attrs["park"] == park
    assert built.end <= ready.start and built.attrs["model_devices"] == ["cpu", "meta"]
    on_device = event(Span.TRAIN_MODULE_CREATION, 1)
    if park == "host":
        assert ready.attrs["after_promotion"] == ["train_module_creation"]  # eager: no compile
        assert when(Mark.PROMOTED, 1) <= on_device.start and on_device.end <= when(Mark.RESUME, 1)
    else:
        assert ready.attrs["after_promotion"] == []
        assert on_device.end <= ready.start
    assert _steps(config, 1) == list(range(2 * EVERY + 1, STEPS + 1))
    assert_bit_identical(clean, config, STEPS)


def test_two_ranks_checkpoint_by_the_clock_at_the_same_steps(tmp_path: Path, data_url: str) -> None:
    """``every_seconds`` far below a step's time: rank 0's clock asks after every step, the
    ranks agree one step later (the deferred consensus), and both save at every step from 2
    on (the last one as the anchor): each commit holds both ranks' files."""
    steps = 6
    config = job_config(
        tmp_path,
        data_url,
        steps,
        job_id="clock2",
        checkpoint={"every_steps": None, "every_seconds": 1e-6, "keep_latest_k": 10},
    )
    code, out = run_to_end(config, tmp_path, nproc=2)
    assert code == ExitCode.SUCCESS, out[-3000:]
    events = read_events(config.layout)
    commits = [e.step for e in events if e.name == Mark.CHECKPOINT_COMMITTED]
    assert commits == list(range(2, steps + 1))
    for rank in (0, 1):
        saves = [
            e.step
            for e in events
            if e.name == Span.CHECKPOINT_BLOCKING
            and e.rank == rank
            and e.attrs.get("phase") != "staging"
        ]
        assert saves == list(range(2, steps + 1)), (rank, saves)
    kept = committed_checkpoints(config.layout)
    assert [c.step for c in kept] == list(range(steps, 1, -1)) and kept[0].manifest.anchor
    for ckpt in kept:
        assert ckpt.manifest.world_size == 2
        assert {rank_state_name(0), rank_state_name(1)} <= set(ckpt.manifest.files)
