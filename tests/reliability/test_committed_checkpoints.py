"""A committed checkpoint is never rewritten (on local disk).

Reproduced before: SIGTERM at a step that was just checkpointed (``every_steps: 5``,
SIGTERM at step 5) committed step 5 a second time, writing into the committed folder in
place; so did a preemption during init, at the step the attempt resumed from.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import committed_checkpoints
from infra.exit_codes import ExitCode
from infra.job_layout import JobLayout
from tests.reliability.jobs import Trainer, job_config, run_to_end, step_folder
from trainer.checkpoint.verify import verify_files

pytestmark = pytest.mark.slow


def _commits(job_url: str, step: int) -> list[tuple[int, int]]:
    """(attempt, rank) of every commit of ``step`` in the job's ledger."""
    return [
        (e.attempt, e.rank)
        for e in read_events(JobLayout.at(job_url))
        if e.name == "checkpoint_committed" and e.step == step
    ]


def test_sigterm_at_committed_step_does_not_rewrite_it(tmp_path: Path, data_url: str) -> None:
    """Two ranks, every_steps: 5, SIGTERM during step 4: the ranks agree to stop one step
    later (trainer/consensus.py), after step 5, which the periodic save has just committed;
    the save on SIGTERM finds it committed (both ranks agree) and writes nothing."""
    config = job_config(
        tmp_path, data_url, steps=20, faults=[{"kind": "sigterm", "step": 4, "attempt": 0}]
    )
    code, out = run_to_end(config, tmp_path, nproc=2)
    assert code == ExitCode.PREEMPTED, out[-3000:]
    assert _commits(config.layout.url, 5) == [(0, 0)]  # once, by the periodic save
    assert out.count("preempted: saving at step 5") == 2  # rank 0 and rank 1
    assert out.count("checkpoint at step 5 is committed already") == 2, out[-3000:]
    # Neither rank failed its save (torchrun may SIGTERM the second one to exit).
    assert "86" not in re.findall(r"exitcode\s*:\s*(-?\d+)", out), out[-3000:]
    folder = storage.local_path(step_folder(config.layout.url, 5))
    assert folder is not None
    markers = sorted(n for n in os.listdir(folder) if n.startswith("_done"))
    [newest] = committed_checkpoints(config.layout)
    nonce = newest.manifest.nonce
    assert newest.step == 5 and markers == [f"_done.rank00{r}.{nonce}.json" for r in (0, 1)]
    verify_files(newest.url, newest.manifest)

    code, out = run_to_end(config, tmp_path, nproc=2)  # attempt 1 resumes from exactly step 5
    assert code == ExitCode.SUCCESS, out[-3000:]
    resumes = {(e.attempt, e.step) for e in read_events(config.layout) if e.name == "resume"}
    assert resumes == {(1, 5)}


def test_preemption_during_init_does_not_rewrite_the_resumed_checkpoint(
    tmp_path: Path, data_url: str
) -> None:
    """SIGTERM while the attempt initialises: it stops at the step it resumed from, which is
    committed already, so it saves nothing and exits PREEMPTED."""
    first = job_config(tmp_path, data_url, steps=5)
    code, out = run_to_end(first, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    [anchor] = committed_checkpoints(first.layout)
    before = {
        name: os.stat(os.path.join(storage.local_path(anchor.url) or "", name)).st_mtime_ns
        for name in os.listdir(storage.local_path(anchor.url) or "")
    }

    more = job_config(tmp_path, data_url, steps=10)
    trainer = Trainer(more, tmp_path)
    started: list[int] = []

    def initialising() -> bool:
        """Attempt 1's first init stage is done: its SIGTERM handler is installed, and
        building the model and restoring still take seconds."""
        events = [e for e in read_events(more.layout) if e.attempt == 1]
        if not any(e.name == "device_init" for e in events):
            return False
        started.extend(int(e.attrs["pid"]) for e in events if e.name == "attempt_start")
        return True

    try:
        trainer.wait_until("attempt 1's init", initialising, timeout=240)
        os.kill(started[0], signal.SIGTERM)  # the trainer rank, as a preemption would
        code = trainer.wait()
    finally:
        if trainer.proc.poll() is None:
            trainer.kill()
        trainer.assert_gone()
    out = trainer.output()
    assert code == ExitCode.PREEMPTED, out[-3000:]
    events = [e for e in read_events(more.layout) if e.attempt == 1]
    assert not [e for e in events if e.name in ("train_step", "checkpoint_committed")]
    [same] = committed_checkpoints(more.layout)
    after = {
        n: os.stat(os.path.join(storage.local_path(same.url) or "", n)).st_mtime_ns for n in before
    }
    assert after == before  # not one file of the committed folder was written again
    assert same.manifest == anchor.manifest
    verify_files(same.url, same.manifest)
    assert "preempted: saving at step 5" in out and "committed already" in out, out[-3000:]
