"""Resume at any world size (issue 29): a job trained on 2 ranks to step 10, resumed on 1
rank to step 20 and back on 2 ranks to step 30 reads the same rows per global batch as the
same job on 2 ranks throughout, its loss curve stays close and its holdout AUC ends within
0.002.

Why not bit-identical: the loss of a global batch is the mean of the ranks' losses, summed
in another order on 1 rank than on 2, and the sharded tables' gradients are summed over
ranks (each rank's loss is a mean over its share: M times the global mean's gradient), which
exact Adagrad's update cancels up to its epsilon and rounding. Measured on this machine
(gloo, CPU, table-wise tables, the plan the planner picks here): the largest gap of the 30
losses was 5e-7 (the ledger's rounding), and the two AUCs were equal; the test allows 1e-5
per loss and 0.002 of AUC.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ett import report_for_job
from infra.accounting.ledger_read import read_events
from infra.accounting.report import recovery_lines
from infra.checkpoint_manifest import committed_checkpoints, rank_state_name
from infra.settings import JobConfig
from tests.factories import (
    checkpoint_tensors,
    per_global_batch,
    resume_marks,
    run_trainer,
    tiny_config,
    write_dataset,
)

STEPS = 30
LOSS_TOLERANCE = 1e-5  # the ledger rounds a loss to 1e-6
AUC_TOLERANCE = 0.002


def _config(tmp_path: Path, job_id: str, data_url: str, steps: int) -> JobConfig:
    return tiny_config(
        tmp_path,
        job_id=job_id,
        data={"url": data_url},
        train={"steps": steps, "eval": "inline", "eval_every": STEPS, "log_every": 5},
        checkpoint={"mode": "sync", "every_steps": 5, "keep_latest_k": 2},
    )


def _final_auc(config: JobConfig) -> float:
    return float(json.loads(storage.read_text(config.layout.final_metrics))["auc"])


@pytest.mark.slow
def test_two_ranks_then_one_then_two_match_two_ranks_throughout(tmp_path: Path) -> None:
    data_url = f"file://{tmp_path}/data"
    write_dataset(_config(tmp_path, "data", data_url, STEPS))
    clean = _config(tmp_path / "clean", "clean", data_url, STEPS)
    result = run_trainer(clean, tmp_path, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:]

    for nproc, steps in ((2, 10), (1, 20), (2, STEPS)):
        resized = _config(tmp_path / "resized", "resized", data_url, steps)
        result = run_trainer(resized, tmp_path, nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:]
    assert [(a, s) for a, s, _ in resume_marks(resized)] == [(1, 10), (2, 20)]
    # Each resize is a ledger event and a line of the ETT report's "What recovery did".
    lines = recovery_lines(report_for_job(resized.layout))
    assert "attempt 1 resized at step 10: 2 -> 1 ranks (resharded from the checkpoint)" in lines
    assert "attempt 2 resized at step 20: 1 -> 2 ranks (resharded from the checkpoint)" in lines
    assert not recovery_lines(report_for_job(clean.layout))
    newest = committed_checkpoints(resized.layout)[0]
    assert newest.manifest.world_size == 2 and newest.step == STEPS
    # The manifest records the plan that wrote it and the job's data position.
    plan = newest.manifest.plan
    assert plan and {p["sharding_type"] for p in plan.values()} == {"table_wise"}
    assert {r for p in plan.values() for r in p["ranks"]} == {0, 1}
    rank0 = json.loads(storage.read_text(storage.join(newest.url, rank_state_name(0))))
    assert newest.manifest.data_position == rank0["loader"]
    assert newest.manifest.data_position["row_offset"] > 0

    want, got = per_global_batch(clean), per_global_batch(resized)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    assert [d for d, _ in got.values()] == [d for d, _ in want.values()]  # the same rows
    gaps = [abs(got[s][1] - want[s][1]) for s in want]
    assert max(gaps) < LOSS_TOLERANCE, gaps
    assert abs(_final_auc(resized) - _final_auc(clean)) < AUC_TOLERANCE
    # Both end with every table and its optimizer state whole, under the same names.
    left = checkpoint_tensors(committed_checkpoints(clean.layout)[0].url)
    right = checkpoint_tensors(newest.url)
    assert left.keys() == right.keys()
    assert any(k.startswith("optim.") and "embedding" in k for k in left)


def test_a_global_batch_two_ranks_cannot_share_is_refused_in_one_line(tmp_path: Path) -> None:
    """The trainer refuses, before it trains a step, a data.batch_size its ranks cannot
    share evenly: exit USAGE and one line naming both values (never another stream)."""
    from infra.exit_codes import ExitCode

    data_url = f"file://{tmp_path}/data"
    config = tiny_config(
        tmp_path, job_id="odd", data={"url": data_url, "batch_size": 65}, train={"steps": 5}
    )
    write_dataset(config)
    result = run_trainer(config, tmp_path, nproc=2)
    assert result.returncode == ExitCode.USAGE, result.stdout[-3000:]
    said = [line for line in result.stdout.splitlines() if "cannot be split" in line]
    assert said and all(
        line.endswith(
            "bad config: data.batch_size=65 (the global batch) cannot be split over "
            "world_size=2 ranks: make it a multiple of the world size"
        )
        for line in said
    ), said
    assert not [e for e in read_events(config.layout) if e.name == "train_step"]
