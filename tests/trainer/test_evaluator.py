"""The async evaluator (``python -m trainer.checkpoint_evaluator``) against real trainer
checkpoints.

Real trainer runs under torchrun write the checkpoints; the evaluator runs as its own
process, started the way the orchestrator starts it (stdin a pipe it keeps open), and is
checked from outside: its ledger spans, final_metrics.json, log, exit code, and /proc.
References are the trainer's own in-loop evaluation of the same weights (its ``eval``
spans), which these jobs still run (``train.eval_every`` > 0).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.accounting.ledger_format import Span
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import MANIFEST, committed_checkpoints
from infra.exit_codes import ExitCode
from infra.processes import pid_alive
from infra.settings import JobConfig, dump_config
from tests.factories import ROOT, run_trainer, tiny_config, write_dataset
from trainer.checkpoint_evaluator import CheckpointEvaluator
from trainer.data.sequential import holdout_batches

STEPS, EVAL_EVERY, CKPT_EVERY = 30, 10, 5  # checkpoints at 5..30, evaluations at 10, 20, 30
EVAL_ROWS = 512
TOL = 1e-6  # the sharded in-loop model and the unsharded CPU one differ in float rounding
START_TIMEOUT_S = 180  # importing torch and TorchRec, on a shared machine


def make_config(tmp_path: Path, job_id: str, **sections: Any) -> tuple[JobConfig, Path]:
    config = tiny_config(
        tmp_path,
        job_id=job_id,
        **sections,
        train={
            "steps": STEPS,
            "eval": "inline",  # the in-loop evaluation is the reference
            "eval_every": EVAL_EVERY,
            "eval_rows": EVAL_ROWS,
            "log_every": 10,
            "compile": False,
        },
        # Every checkpoint kept: the evaluation of each one is what is checked.
        checkpoint={"mode": "async_staged", "every_steps": CKPT_EVERY, "keep_latest_k": 10},
    )
    path = tmp_path / f"{job_id}.yaml"  # where run_trainer writes it too
    dump_config(config, path)
    return config, path


class Evaluator:
    """One ``python -m trainer.checkpoint_evaluator`` process, its log in a file."""

    def __init__(self, config_path: Path, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer.checkpoint_evaluator",
                "--config",
                str(config_path),
                *args,
            ],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(config_path.parent),
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log:
            assert self.proc.poll() is None, f"evaluator exited early:\n{self.log[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in the log:\n{self.log[-3000:]}"
            time.sleep(0.2)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"evaluator still running after {timeout} s:\n{self.log[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()
        self._log.close()


@pytest.fixture
def evaluators() -> Iterator[list[Evaluator]]:
    """Evaluators a test starts; none outlives it."""
    started: list[Evaluator] = []
    yield started
    for ev in started:
        ev.stop()


def async_evals(config: JobConfig) -> list:
    return [e for e in read_events(config.layout) if e.name == Span.ASYNC_EVAL]


def in_loop_evals(config: JobConfig, rank: int = 0) -> dict[int, dict]:
    return {
        e.step: e.attrs for e in read_events(config.layout) if e.name == "eval" and e.rank == rank
    }


def assert_same_metrics(got: dict, want: dict) -> None:
    assert got["auc"] == pytest.approx(want["auc"], abs=TOL)
    assert got["logloss"] == pytest.approx(want["logloss"], abs=TOL)
    assert got["rows"] == want["rows"] == EVAL_ROWS


def processes_mentioning(text: str) -> list[int]:
    """Live, non-zombie processes whose command line contains ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and pid_alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return found


def checkpoint_dir(config: JobConfig, step: int) -> Path:
    (ckpt,) = [c for c in committed_checkpoints(config.layout) if c.step == step]
    local = storage.local_path(ckpt.url)
    assert local is not None
    return Path(local)


@pytest.mark.slow
def test_evaluates_each_eval_step_once_beside_a_one_rank_trainer(tmp_path, evaluators) -> None:
    """Started before the job, kept through a preemption of its first attempt, and done
    by itself after the anchor of the second."""
    config, path = make_config(tmp_path, "beside", faults=[{"kind": "sigterm", "step": 22}])
    write_dataset(config)
    ev = Evaluator(path, tmp_path / "evaluator.log")
    evaluators.append(ev)
    ev.wait_for("evaluating ")  # polling an empty job before the trainer starts

    preempted = run_trainer(config, tmp_path, nproc=1)
    assert preempted.returncode != 0, preempted.stdout[-3000:]
    assert 22 in [c.step for c in committed_checkpoints(config.layout)]  # the preemption save
    ev.wait_for("step 20 holdout auc=")  # evaluated while no attempt is running
    time.sleep(1.0)  # a few polls: no anchor yet, so it keeps waiting
    assert ev.proc.poll() is None, ev.log[-3000:]

    resumed = run_trainer(config, tmp_path, nproc=1)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert ev.wait() == ExitCode.SUCCESS, ev.log[-3000:]  # exits by itself after the anchor

    spans = async_evals(config)
    # Eval steps only (not the checkpoints at 5, 15, 22, 25), each once, in order; the anchor
    # last.
    assert [e.step for e in spans] == [10, 20, 30]
    assert [e.attrs["anchor"] for e in spans] == [False, False, True]
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:], strict=False))
    reference = in_loop_evals(config)
    for span in spans:
        assert_same_metrics(span.attrs, reference[span.step])
        assert span.attrs["url"].endswith(f"step-{span.step:09d}")
        assert ev.log.count(f"step {span.step} holdout auc=") == 1
    assert "(async)" in ev.log and "Traceback" not in ev.log

    # Started again on the finished job, it finds its own spans and evaluates nothing twice.
    again = Evaluator(path, tmp_path / "again.log")
    evaluators.append(again)
    assert again.wait() == ExitCode.SUCCESS, again.log[-3000:]
    assert "the anchor (step 30) was evaluated already" in again.log
    assert [e.step for e in async_evals(config)] == [10, 20, 30]


@pytest.fixture(scope="module")
def two_rank_store(tmp_path_factory) -> Path:
    """A finished 2-rank job (data and store), trained once; tests work on copies."""
    root = tmp_path_factory.mktemp("two-ranks")
    config, _ = make_config(root, "two-ranks")
    write_dataset(config)
    result = run_trainer(config, root, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def copy_job(store: Path, tmp_path: Path) -> tuple[JobConfig, Path]:
    for name in ("data", "store"):
        shutil.copytree(store / name, tmp_path / name)
    return make_config(tmp_path, "two-ranks")


@pytest.mark.slow
def test_two_rank_checkpoints_load_into_one_cpu_model_and_bad_ones_are_skipped(
    two_rank_store, tmp_path, evaluators
) -> None:
    config, path = copy_job(two_rank_store, tmp_path)
    metrics_path = Path(
        str(storage.local_path(storage.join(config.layout.url, "final_metrics.json")))
    )
    metrics_path.unlink()  # written by the trainer: the evaluator must write its own

    # Step 10: one byte flipped (same size): fails verification. Step 20: a shard file gone,
    # as when retention deletes a checkpoint after it was listed.
    shard = sorted(checkpoint_dir(config, 10).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    sorted(checkpoint_dir(config, 20).glob("*.distcp"))[0].unlink()

    ev = Evaluator(path, tmp_path / "evaluator.log")
    evaluators.append(ev)
    assert ev.wait() == ExitCode.SUCCESS, ev.log[-3000:]

    skipped = [line for line in ev.log.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 2, ev.log[-3000:]
    assert "step-000000010 (step 10)" in skipped[0] and "checksum mismatch" in skipped[0]
    assert "step-000000020 (step 20)" in skipped[1] and "missing file" in skipped[1]
    assert "Traceback" not in ev.log

    (span,) = async_evals(config)
    assert (span.step, span.attrs["anchor"]) == (30, True)
    # Both ranks' in-loop evaluation (sharded tables, predictions gathered) agree with one
    # CPU process that loaded the shards of both ranks.
    for rank in (0, 1):
        assert_same_metrics(span.attrs, in_loop_evals(config, rank)[30])
    final = json.loads(metrics_path.read_text())
    assert set(final) == {"step", "auc", "logloss", "rows"}
    assert final["step"] == 30
    assert_same_metrics(final, span.attrs)


@pytest.mark.slow
def test_checkpoint_deleted_after_listing_is_skipped_and_the_next_one_evaluated(
    two_rank_store, tmp_path, caplog
) -> None:
    """The evaluator's per-checkpoint step, in process: retention deletes a listed
    checkpoint (manifest first, then the folder) before it is read; the next one loads
    whole into the same model."""
    config, _ = copy_job(two_rank_store, tmp_path)
    listed = {c.step: c for c in committed_checkpoints(config.layout)}
    work = tmp_path / "work"
    work.mkdir()
    holdout = holdout_batches(config.data, 0, 1, EVAL_ROWS, config.data.eval_batch_size)
    evaluator = CheckpointEvaluator(config, holdout, str(work))
    reference = in_loop_evals(config)

    first = evaluator.evaluate(listed[10])
    assert first is not None
    assert_same_metrics({**first.metrics, "rows": first.rows}, reference[10])

    gone = checkpoint_dir(config, 20)
    (gone / MANIFEST).unlink()
    shutil.rmtree(gone)
    with caplog.at_level("WARNING", logger="trainer.checkpoint_evaluator"):
        assert evaluator.evaluate(listed[20]) is None
    (line,) = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert f"{listed[20].url} (step 20)" in line and "missing file" in line

    last = evaluator.evaluate(listed[30])
    assert last is not None
    assert_same_metrics({**last.metrics, "rows": last.rows}, reference[30])
    assert os.listdir(work) == []  # no per-checkpoint folder left behind


@pytest.mark.parametrize("how", ["stdin closed", "SIGTERM"])
def test_stops_at_once_while_waiting_and_leaves_nothing_behind(tmp_path, evaluators, how) -> None:
    config, path = make_config(tmp_path, "waiting")
    write_dataset(config)  # no checkpoints: it waits for the first one
    ev = Evaluator(path, tmp_path / "evaluator.log")
    evaluators.append(ev)
    ev.wait_for("evaluating ")
    time.sleep(1.0)  # a few polls of an empty job
    assert ev.proc.poll() is None, ev.log[-3000:]

    if how == "SIGTERM":
        ev.proc.send_signal(signal.SIGTERM)
    else:
        assert ev.proc.stdin is not None
        ev.proc.stdin.close()
    assert ev.wait(timeout=30) == ExitCode.SUCCESS, ev.log[-3000:]
    assert f"evaluator stopping: {how}" in ev.log
    assert processes_mentioning(str(path)) == []
    assert async_evals(config) == []


def test_dies_with_the_process_that_started_it(tmp_path) -> None:
    """The orchestrator is SIGKILLed: the pipe it held closes, and the evaluator goes."""
    config, path = make_config(tmp_path, "orphan")
    write_dataset(config)
    log_path = tmp_path / "evaluator.log"
    parent_code = (
        "import subprocess, sys, time\n"
        f"log = open({str(log_path)!r}, 'wb')\n"
        "p = subprocess.Popen([sys.executable, '-m', 'trainer.checkpoint_evaluator', '--config', "
        f"{str(path)!r}], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, env=env, text=True
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + START_TIMEOUT_S
        while "evaluating " not in log_path.read_text(errors="replace"):
            assert pid_alive(child), log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the evaluator never started"
            time.sleep(0.2)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(child), "the evaluator outlived the process that started it"
        assert "evaluator stopping: stdin closed" in log_path.read_text(errors="replace")
    finally:
        parent.kill()
        parent.wait()
        if child and pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_bad_config_is_a_usage_error_in_one_line(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  eval_every: -3\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "trainer.checkpoint_evaluator", "--config", str(path)],
        stdin=subprocess.PIPE,
        capture_output=True,
        text=True,
        env=env,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode == ExitCode.USAGE
    lines = [line for line in result.stderr.splitlines() if "eval_every" in line]
    assert len(lines) == 1, result.stderr
