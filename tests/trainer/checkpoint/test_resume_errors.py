"""Resuming when the checkpoint is not what the job expects, and resuming after a preemption.

Real trainer processes under torchrun, real checkpoints on local disk:

- a corrupt newest checkpoint (one byte flipped, same size) is skipped for the previous
  committed one with ``checkpoint.fallback_on_corrupt``, with a warning naming it; without,
  the attempt fails with exit code CHECKPOINT_INCOMPATIBLE and an error naming it;
- a checkpoint of another model config, or written by another number of ranks, fails the
  attempt with CHECKPOINT_INCOMPATIBLE and an error naming the hashes / world sizes;
- SIGTERM (preemption) at step N: the trainer finishes step N, saves synchronously at that
  step boundary, exits with PREEMPTED, and the next attempt resumes from step N.

Trainer startups dominate the runtime, so the preempted-then-resumed job is trained once per
module and the other tests start from copies of its finished store, and 1-rank attempts run
as plain ``python -m trainer`` (no torchrun agent process to start; the exit code is the
trainer's own).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import committed_checkpoints
from infra.exit_codes import ExitCode
from infra.job_layout import step_dir_name
from infra.settings import JobConfig, dump_config
from tests.factories import ROOT, run_trainer, tiny_config, write_dataset
from trainer.checkpoint.verify import verify_files

pytestmark = pytest.mark.slow

STEPS = 10
EVERY = 5
PREEMPT_AT = 7  # not a multiple of EVERY: the preemption checkpoint is its own
# torchrun exits 1 when a worker fails and names the worker's code in its summary.
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def make_config(root: Path, data_url: str, steps: int = STEPS, **sections: Any) -> JobConfig:
    return tiny_config(
        root,
        job_id="job",
        data={"url": data_url},
        # Eager: these tests are about checkpoints, and compiling costs each attempt seconds.
        train={"steps": steps, "eval_every": 0, "eval_rows": 256, "log_every": 5, "compile": False},
        checkpoint={
            "mode": "async_staged",
            "every_steps": EVERY,
            "keep_latest_k": 3,
            **sections.pop("checkpoint", {}),
        },
        **sections,
    )


def run_alone(config: JobConfig, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """One single-process attempt without torchrun (``python -m trainer``)."""
    path = tmp_path / f"{config.job_id}.yaml"
    dump_config(config, path)
    return subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(path)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )


def exit_code(result: subprocess.CompletedProcess[str]) -> int:
    """The trainer's own exit code (under torchrun: the failing worker's, from its summary)."""
    if result.returncode == 0:
        return 0
    found = _WORKER_EXIT.findall(result.stderr + result.stdout)
    return int(found[0]) if found else result.returncode


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def copy_store(config: JobConfig, into: Path) -> None:
    """Copy a finished job's store (checkpoints and ledgers) to ``into``/store."""
    src = storage.local_path(config.storage.root)
    assert src is not None
    shutil.copytree(src, into / "store")


@pytest.fixture(scope="module")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tiny_config(tmp_path_factory.mktemp("resume-errors-data"))
    write_dataset(config)
    return config.data.url


@dataclass
class PreemptedJob:
    config: JobConfig
    first: subprocess.CompletedProcess[str]  # attempt 0: SIGTERM at PREEMPT_AT
    committed_after_first: list[int]
    second: subprocess.CompletedProcess[str]  # attempt 1: resumes and finishes


@pytest.fixture(scope="module")
def preempted_job(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> PreemptedJob:
    """A 1-rank job preempted (SIGTERM) at step PREEMPT_AT of attempt 0, then run again."""
    tmp = tmp_path_factory.mktemp("preempted")
    config = make_config(
        tmp, data_url, faults=[{"kind": "sigterm", "step": PREEMPT_AT, "attempt": 0}]
    )
    first = run_alone(config, tmp)
    committed = [c.step for c in committed_checkpoints(config.layout)]
    second = run_alone(config, tmp)
    return PreemptedJob(config, first, committed, second)


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> JobConfig:
    """A finished 2-rank job (its anchor checkpoint at step EVERY)."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    config = make_config(tmp, data_url, steps=EVERY)
    result = run_trainer(config, tmp, nproc=2)
    assert result.returncode == 0, output(result)[-3000:]
    return config


def test_preempted_job_saves_at_the_step_boundary_and_resumes(
    preempted_job: PreemptedJob,
) -> None:
    job = preempted_job
    assert exit_code(job.first) == ExitCode.PREEMPTED, output(job.first)[-3000:]
    # The flag is set during step N (the fault fires as step N starts) and honoured at the
    # next step boundary: step N completes, then a synchronous save at exactly step N.
    assert f"preempted: saving at step {PREEMPT_AT}" in job.first.stdout
    assert job.committed_after_first[0] == PREEMPT_AT, job.committed_after_first
    assert EVERY in job.committed_after_first  # the periodic one before it stays

    assert exit_code(job.second) == ExitCode.SUCCESS, output(job.second)[-3000:]
    events = read_events(job.config.layout)
    blocking = [
        e
        for e in events
        if e.attempt == 0 and e.name == "checkpoint_blocking" and e.step == PREEMPT_AT
    ]
    assert blocking and blocking[0].attrs.get("mode") == "sync", blocking
    resumes = [(e.attempt, e.step) for e in events if e.name == "resume"]
    assert resumes == [(1, PREEMPT_AT)], resumes
    steps_run = sorted(e.step for e in events if e.attempt == 1 and e.name == "train_step")
    assert steps_run == list(range(PREEMPT_AT + 1, STEPS + 1)), steps_run
    newest = committed_checkpoints(job.config.layout)[0]
    assert newest.step == STEPS and newest.manifest.anchor
    verify_files(newest.url, newest.manifest)


def _flip_a_byte(ckpt_dir: Path) -> str:
    """Corrupt the largest DCP data file in place (same size); returns its name."""
    target = max(ckpt_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target.name


def test_corrupt_newest_checkpoint(
    tmp_path: Path, data_url: str, preempted_job: PreemptedJob
) -> None:
    copy_store(preempted_job.config, tmp_path)
    strict = make_config(tmp_path, data_url, checkpoint={"fallback_on_corrupt": False})
    [newest, previous, *_] = committed_checkpoints(strict.layout)
    assert (newest.step, previous.step) == (STEPS, PREEMPT_AT)
    corrupt = storage.local_path(newest.url)
    assert corrupt is not None
    before = {p.name: p.stat().st_size for p in Path(corrupt).iterdir()}
    name = _flip_a_byte(Path(corrupt))
    assert {p.name: p.stat().st_size for p in Path(corrupt).iterdir()} == before

    # Without fallback: the attempt fails, naming the checkpoint and the reason.
    result = run_alone(strict, tmp_path)
    assert exit_code(result) == ExitCode.CHECKPOINT_INCOMPATIBLE, output(result)[-3000:]
    errors = [line for line in result.stdout.splitlines() if "cannot resume" in line]
    assert errors, output(result)[-3000:]
    assert step_dir_name(STEPS) in errors[0] and f"checksum mismatch in {name}" in errors[0]
    assert not any(e.name == "train_step" for e in read_events(strict.layout) if e.attempt == 2)

    # With fallback: a warning naming the corrupt one, then resume from the previous one.
    lenient = make_config(tmp_path, data_url, steps=STEPS + 2)
    result = run_alone(lenient, tmp_path)
    assert exit_code(result) == ExitCode.SUCCESS, output(result)[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "falling back" in line]
    assert warnings, result.stdout[-3000:]
    assert step_dir_name(STEPS) in warnings[0] and "checksum mismatch" in warnings[0]
    resumes = [(e.attempt, e.step) for e in read_events(lenient.layout) if e.name == "resume"]
    assert resumes[-1] == (3, PREEMPT_AT), resumes
    # The re-trained steps re-wrote step STEPS, and every committed checkpoint verifies.
    final = committed_checkpoints(lenient.layout)
    assert [c.step for c in final][:2] == [STEPS + 2, STEPS]
    for ckpt in final:
        verify_files(ckpt.url, ckpt.manifest)


def test_checkpoint_of_another_model_config(
    tmp_path: Path, data_url: str, preempted_job: PreemptedJob
) -> None:
    copy_store(preempted_job.config, tmp_path)
    config = make_config(
        tmp_path, data_url, model={"embedding_dim": 4, "dense_arch": [16, 4], "over_arch": [16, 8]}
    )
    [newest, *_] = committed_checkpoints(config.layout)
    assert newest.manifest.config_hash != config.model_hash()
    result = run_alone(config, tmp_path)
    assert exit_code(result) == ExitCode.CHECKPOINT_INCOMPATIBLE, output(result)[-3000:]
    errors = [line for line in result.stdout.splitlines() if "cannot resume" in line]
    assert errors, output(result)[-3000:]
    assert "another model config" in result.stdout
    assert newest.manifest.config_hash in result.stdout and config.model_hash() in result.stdout
    # Nothing was trained or overwritten: the job's checkpoints are as they were.
    assert [c.step for c in committed_checkpoints(config.layout)][0] == STEPS


def test_checkpoint_of_another_world_size(
    tmp_path: Path, data_url: str, two_rank_job: JobConfig
) -> None:
    copy_store(two_rank_job, tmp_path)
    config = make_config(tmp_path, data_url, steps=EVERY)
    [newest] = committed_checkpoints(config.layout)
    assert newest.manifest.world_size == 2
    result = run_alone(config, tmp_path)
    # Issue 29: a checkpoint of 2 ranks resumes on 1 (resharded), no longer refused.
    assert exit_code(result) == ExitCode.SUCCESS, output(result)[-3000:]
    assert f"{step_dir_name(EVERY)} at step {EVERY}" in result.stdout, output(result)[-3000:]
