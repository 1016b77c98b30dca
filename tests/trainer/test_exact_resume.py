"""A job that fails at several steps and recovers each time ends bit-identical to an
uninterrupted run with the same seed, whatever the recovery path: a relaunch after SIGKILL
(one while a checkpoint upload is in flight), a warm standby promoted after a lost worker or
a preemption, an in-process restart after an exception, and with the compiled step.

Identical final weights alone cannot tell a resume from a retrain from scratch (training is
deterministic), so every recovery must also show its ``resume`` mark at the step expected.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from infra import memory_tier
from infra.accounting.ledger_format import Mark, Span
from infra.accounting.ledger_read import read_events
from infra.exit_codes import Outcome
from infra.settings import JobConfig
from tasks.orchestrator import JobOutcome, run
from tests.factories import assert_bit_identical, resume_marks, tiny_config

EVERY = 5


def run_job(config: JobConfig, tmp_path: Path, nproc: int, standby: bool, **env: str) -> JobOutcome:
    """The job through the orchestrator's attempt loop, as the flow and `ett train` run it."""
    sections = {
        "launch": {"nproc": nproc},
        "recovery": {"max_failures": 5, "backoff_s": 0, "standby": standby},
    }
    job = config.model_copy(
        update={k: getattr(config, k).model_copy(update=v) for k, v in sections.items()}
    )
    return run(job, env={"OMP_NUM_THREADS": "1", **env}).outcome


SECTIONS = {
    "train": {"steps": 25, "eval": "off", "eval_rows": 256, "log_every": 5},
    "checkpoint": {
        "mode": "async_staged",
        "every_steps": EVERY,
        "keep_latest_k": 2,
        "preemption_budget_s": 20,
    },
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> Callable[[int], JobConfig]:
    """The uninterrupted job of SECTIONS on ``nproc`` ranks, run once per module and
    compared with every faulted job of that many ranks (with or without a standby: an
    unused standby changes no weight, so a promoted one must match a job that had none)."""
    done: dict[int, JobConfig] = {}

    def of(nproc: int) -> JobConfig:
        if nproc not in done:
            tmp = tmp_path_factory.mktemp(f"clean-{nproc}proc")
            config = tiny_config(tmp, job_id="clean", data={"url": data_url}, **SECTIONS)
            assert run_job(config, tmp, nproc, standby=False).succeeded
            done[nproc] = config
        return done[nproc]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2proc"])
def test_relaunched_after_sigkills_is_bit_identical(
    tmp_path, data_url: str, clean: Callable[[int], JobConfig], nproc: int
) -> None:
    """Cold relaunches (no standby): SIGKILL mid-step and mid-upload."""
    faults = [
        {"kind": "sigkill_mid_upload", "step": 10, "attempt": 0},
        {"kind": "sigkill", "step": 18, "attempt": 1},
    ]
    reference = clean(nproc)
    data = {"url": data_url}
    killed = tiny_config(tmp_path, job_id="killed", data=data, faults=faults, **SECTIONS)
    outcome = run_job(killed, tmp_path, nproc, standby=False)
    assert [a.outcome for a in outcome.attempts] == [Outcome.SIGKILL] * 2 + [Outcome.SUCCESS]
    assert_bit_identical(reference, killed, 25)
    # Each relaunch resumed from a COMMITTED checkpoint before its kill; a kill mid-upload of
    # step 10 left step 10 uncommitted, so attempt 1 resumed from step 5.
    got = resume_marks(killed)
    assert [(a, in_proc) for a, _, in_proc in got] == [(1, False), (2, False)]
    assert got[0][1] == 5 and got[1][1] in (10, 15)


@pytest.mark.slow
def test_standby_promotion_and_in_process_restart_are_bit_identical(
    tmp_path, data_url: str, clean: Callable[[int], JobConfig]
) -> None:
    """One crash recovered in process, a lost worker and a preemption each recovered by a
    promoted warm standby."""
    faults = [
        {"kind": "crash", "step": 8, "attempt": 0},
        {"kind": "sigkill", "step": 17, "attempt": 0},
        {"kind": "sigterm", "step": 21, "attempt": 1},
    ]
    data = {"url": data_url}
    faulted = tiny_config(tmp_path, job_id="faulted", data=data, faults=faults, **SECTIONS)
    outcome = run_job(faulted, tmp_path, 2, standby=True)
    got = [(a.outcome, a.from_standby) for a in outcome.attempts]
    assert got == [(Outcome.SIGKILL, False), (Outcome.PREEMPTED, True), (Outcome.SUCCESS, True)]
    assert_bit_identical(clean(2), faulted, 25)
    marks = resume_marks(faulted)
    assert marks[0] == (0, 5, True)  # the crash at step 8: step 5 was the newest commit
    assert marks[1][:2] in ((1, 10), (1, 15)) and not marks[1][2]  # promoted after step 16
    # SIGTERM landed in step 21; the ranks agree one step later (no barrier on the hot
    # path), so both stopped after step 22 and saved it.
    assert marks[2] == (2, 22, False)
    events = read_events(faulted.layout)
    assert {e.attempt for e in events if e.name == Mark.PROMOTED and e.rank == 0} == {1, 2}


@pytest.mark.slow
def test_in_memory_copies_restore_a_crash_and_a_kill_mid_copy_bit_identical(
    tmp_path, data_url: str, clean: Callable[[int], JobConfig]
) -> None:
    """The in-memory tier on, a copy every 2 steps (durable every 5): the crash is restored
    in process from the copy of step 8, not the commit of step 5; rank 0 SIGKILLed while
    its copy of step 14 is half written leaves that copy torn, and the promoted standby
    restores from the newest step both ranks hold whole (12). Nothing is left in /dev/shm."""
    faults = [
        {"kind": "crash", "step": 9, "attempt": 0},
        {"kind": "sigkill_mid_memory_copy", "step": 14, "attempt": 0},
    ]
    memory = {"memory_tier": {"every_steps": 2}}
    sections = {**SECTIONS, "checkpoint": {**SECTIONS["checkpoint"], **memory}}
    data = {"url": data_url}
    faulted = tiny_config(tmp_path, job_id="memtier", data=data, faults=faults, **sections)
    # Slow steps: a commit is over before the next copy is due (a copy never waits for one).
    outcome = run_job(faulted, tmp_path, 2, standby=True, ETT_FAULT_STEP_DELAY_S="0.1")
    got = [(a.outcome, a.from_standby) for a in outcome.attempts]
    assert got == [(Outcome.SIGKILL, False), (Outcome.SUCCESS, True)]
    assert_bit_identical(clean(2), faulted, 25)
    resumes = [e for e in read_events(faulted.layout) if e.name == Mark.RESUME and e.rank == 0]
    assert [(e.attempt, e.step, e.attrs["how"], e.attrs["tier"]) for e in resumes] == [
        (0, 8, "in_process", "memory"),
        (1, 12, "promoted", "memory"),
    ]
    # Each copy ran through the next step's forward, and the loop waited for it before
    # backward: none was made while the state changed (a copy taken across backward is).
    events = read_events(faulted.layout)
    copies = [e for e in events if e.name == Mark.MEMORY_COPY]
    assert copies and [e.attrs["error"] for e in copies if "error" in e.attrs] == []
    waits = [e for e in events if e.name == Span.MEMORY_COPY_BLOCKING]
    assert {e.attrs.get("phase") for e in waits} == {None, "staging"}
    assert memory_tier.job_segments(faulted.layout) == []


@pytest.mark.slow
def test_compiled_step_resumes_bit_identical(tmp_path, data_url: str) -> None:
    """The default compiled step: the relaunch loads the compile cache of the first attempt."""
    sections = {**SECTIONS, "train": {**SECTIONS["train"], "steps": 15, "compile": True}}
    faults = [{"kind": "sigkill", "step": 12, "attempt": 0}]
    data = {"url": data_url}
    clean = tiny_config(tmp_path, job_id="clean", data=data, **sections)
    assert run_job(clean, tmp_path, 1, standby=False).succeeded
    killed = tiny_config(tmp_path, job_id="killed", data=data, faults=faults, **sections)
    outcome = run_job(killed, tmp_path, 1, standby=False)
    assert [a.outcome for a in outcome.attempts] == [Outcome.SIGKILL, Outcome.SUCCESS]
    assert_bit_identical(clean, killed, 15)
    assert resume_marks(killed) in ([(1, 10, False)], [(1, 5, False)])


@pytest.mark.slow
def test_a_standby_parked_host_side_resumes_bit_identical_with_the_compiled_step(
    tmp_path, data_url: str
) -> None:
    """``standby_park: host``, a GPU host's default, forced on the CPU (the same code path):
    the promoted standby puts its model on the device and warms up the compiled step only
    after its promotion, and the job still ends bit-identical."""
    sections = {**SECTIONS, "train": {**SECTIONS["train"], "steps": 15, "compile": True}}
    faults = [{"kind": "sigkill", "step": 12, "attempt": 0}]
    data = {"url": data_url}
    clean = tiny_config(tmp_path, job_id="clean", data=data, **sections)
    assert run_job(clean, tmp_path, 1, standby=False).succeeded
    park = {"standby_park": "host"}
    killed = tiny_config(
        tmp_path, job_id="killed", data=data, faults=faults, recovery=park, **sections
    )
    outcome = run_job(killed, tmp_path, 1, standby=True)
    got = [(a.outcome, a.from_standby) for a in outcome.attempts]
    assert got == [(Outcome.SIGKILL, False), (Outcome.SUCCESS, True)]
    assert_bit_identical(clean, killed, 15)
    assert resume_marks(killed) in ([(1, 10, False)], [(1, 5, False)])
    events = [e for e in read_events(killed.layout) if e.attempt == 1 and e.rank == 0]
    [ready] = [e for e in events if e.name == Mark.STANDBY_READY]
    [promoted] = [e for e in events if e.name == Mark.PROMOTED]
    assert ready.attrs["park"] == "host"
    assert ready.attrs["after_promotion"] == ["train_module_creation", "compile"]
    on_device = [
        e
        for e in events
        if e.name == Span.TRAIN_MODULE_CREATION or e.attrs.get("stage") == "compile"
    ]
    assert len(on_device) == 2 and all(e.start >= promoted.start for e in on_device)
