"""The report says what recovery did: a corrupt newest checkpoint found by the promoted
standby, its fallback to the previous one and the quarantine, named in ``ett report``, in
the ETT artifact's markdown and in the MLflow run, with the steps redone because of the
fallback counted apart.

The finding this pins: with a byte flipped in the newest committed step's shard and then a
SIGKILL, the standby fell back from 150 to 125 and both ranks logged it, but ``ett report``
said nothing; the only trace was more unsaved work than predicted.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from infra.accounting.ett import report_for_job
from infra.accounting.report import to_markdown
from infra.checkpoint_manifest import committed_checkpoints
from infra.tracking import mlflow_runs
from infra.tracking.client import client
from tests.flows.test_cli import ett
from tests.reliability.ett_job import EttTrain
from tests.reliability.jobs import job_config

pytestmark = pytest.mark.slow

STEPS = 600


def test_a_fallback_past_a_corrupt_checkpoint_is_named_everywhere_the_report_goes(
    tmp_path: Path, data_url: str
) -> None:
    config = job_config(
        tmp_path, data_url, STEPS, job_id="fallback", checkpoint={"every_steps": 25}
    )
    job = EttTrain(config, tmp_path, "--nproc", "2", "--backoff-s", "0")
    try:
        for rank in (0, 1):
            name = f"trainer-attempt001-rank{rank:03d}.jsonl"
            job.wait_until(
                f"standby rank {rank} parked", lambda n=name: job.ledger_says(n, "standby_ready")
            )
        job.wait_until(
            "a checkpoint past step 100",
            lambda: any(c.step >= 100 for c in committed_checkpoints(config.layout)),
        )
        job.kill(0, ranks_only=True, sig=signal.SIGSTOP)  # nothing commits while we look
        newest, previous = committed_checkpoints(config.layout)[:2]
        shard = Path(newest.url.removeprefix("file://"), "__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        job.kill(0, ranks_only=True)
        assert job.wait() == 0, job.tail()
        job.assert_left_nothing()
    finally:
        job.end()

    line = (
        f"attempt 1 (promoted standby) resumed from step {previous.step}, step {newest.step} "
        "quarantined: checksum mismatch in __1_0.distcp"
    )
    shown = ett("report", "fallback", "--config", str(tmp_path / "report.yaml"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "What recovery did" in shown.stdout and line in shown.stdout
    assert "of which redone after a checkpoint fallback" in shown.stdout
    report = report_for_job(config.layout)
    assert report.finished and report.num_steps == STEPS
    [resume] = [r for r in report.resumes if r.how == "promoted"]
    assert resume.skipped == ((newest.step, "checksum mismatch in __1_0.distcp", True),)
    assert (resume.step, resume.newest_step) == (previous.step, newest.step)
    assert resume.describe() == line
    assert line in to_markdown(report)  # the Prefect ETT artifact's text
    # Redone because of the fallback: the steps between the two checkpoints, at most.
    assert 0 < report.fallback_redone_s <= report.buckets["wasted_training"]

    logged = ett(
        "report", "fallback", "--log", "--config", str(tmp_path / "report.yaml"), cwd=tmp_path
    )
    assert logged.returncode == 0, logged.stderr
    ml = client(config.tracking.mlflow_uri)
    experiment = ml.get_experiment_by_name(config.tracking.experiment)
    run = mlflow_runs.find_job_run(ml, experiment.experiment_id, config.job_id)
    assert run is not None and line in run.data.tags["ett.recovery"]


@pytest.fixture(autouse=True)
def _report_config(tmp_path: Path) -> None:
    """The config ``ett report`` reads: the job's storage root and MLflow store."""
    from infra.settings import dump_config

    config = job_config(tmp_path, "file:///unused", STEPS, job_id="fallback")
    dump_config(config, tmp_path / "report.yaml")
