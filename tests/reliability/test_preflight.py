"""Mistakes in what a config names, caught before torchrun starts: ``ett train`` exits 2 with
one line naming the field and its URL (credentials masked), starts no trainer, and leaves
nothing behind; the ``train`` flow's first task fails with the same line.

Before: a storage root under a regular file ended in exit 1 and a ``NotADirectoryError``
shown as an internal error; a data URL with no shards, a resume or warm-start URL with no
checkpoint, started torchrun and the TorchRec planner and failed seconds later (88, 84) with
planner noise on stderr; a bad MLflow URI was not noticed at all.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.exit_codes import ExitCode
from infra.preflight import PreflightError
from infra.settings import JobConfig, dump_config
from tasks.training import plan
from tests.reliability.ett_job import EttTrain
from tests.reliability.jobs import job_config

SECRET = "s3cr3t-not-real"


def refused(config: JobConfig, tmp_path: Path, *named: str) -> str:
    """``ett train`` of ``config``: exit 2 and one line on stderr naming each of ``named``,
    nothing on stdout, no trainer started, nothing left. Returns the line."""
    job = EttTrain(config, tmp_path)
    try:
        code = job.wait(timeout=120)
        out, err = job.stdout(), job.stderr()
        assert code == ExitCode.USAGE, job.tail()
        assert out == "", out
        lines = err.strip().splitlines()
        assert len(lines) == 1, err  # no traceback, no orchestrator or trainer lines
        for word in named:
            assert word in lines[0], lines[0]
        # No trainer ran: it writes its ledger first thing.
        ledger = storage.local_path(config.layout.ledger)
        assert ledger is not None and not Path(ledger).exists()
        job.assert_left_nothing()
        return lines[0]
    finally:
        job.end()


def config_for(tmp_path: Path, data_url: str, **sections: Any) -> JobConfig:
    return job_config(tmp_path, data_url, steps=3, job_id="preflight", **sections)


def test_a_storage_root_under_a_regular_file_is_named(tmp_path: Path, data_url: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    root = f"file://{afile}/runs"
    config = config_for(tmp_path, data_url, storage={"root": root})
    line = refused(config, tmp_path, "storage.root", root, f"under {afile}, a regular file")
    assert line.startswith("ett train: error: storage.root"), line


def test_a_data_url_without_shards(tmp_path: Path, data_url: str) -> None:
    empty = tmp_path / "no-shards"
    (empty / "train").mkdir(parents=True)
    (empty / "_meta.json").write_text("{}")  # a data set's marker, but no shards
    url = f"file://{empty}"
    config = config_for(tmp_path, url)
    refused(config, tmp_path, "data.url", url, f"{url}/train/*.parquet")


@pytest.mark.parametrize("field", ["resume", "warm_start"])
def test_a_checkpoint_url_that_is_no_committed_checkpoint(
    tmp_path: Path, data_url: str, field: str
) -> None:
    folder = tmp_path / "ckpt" / "step-000000010"
    folder.mkdir(parents=True)  # a checkpoint folder that was never committed
    (folder / "trainer_state.rank000.json").write_text("{}")
    url = f"file://{folder}"
    config = config_for(tmp_path, data_url, checkpoint={field: url})
    refused(config, tmp_path, f"checkpoint.{field}", url, "not a committed checkpoint")


def test_a_bad_mlflow_uri(tmp_path: Path, data_url: str) -> None:
    uri = "htp://mlflow.example:5000"  # a typo: no MLflow tracking store has that scheme
    config = config_for(tmp_path, data_url, tracking={"mlflow_uri": uri})
    refused(config, tmp_path, "tracking.mlflow_uri", uri, "'htp'")


@pytest.mark.parametrize(
    ("sections", "field", "shown"),
    [
        (
            # No S3 answers at that endpoint; the credentials in the URL must not be echoed,
            # not even where botocore quotes the bucket without the scheme.
            {
                "storage": {
                    "root": f"s3://AKIAEXAMPLE:{SECRET}@ett/runs",
                    "s3_endpoint_url": "http://127.0.0.1:9",
                    "retries": 0,
                }
            },
            "storage.root",
            "s3://***@ett/runs",
        ),
        (
            {"tracking": {"mlflow_uri": f"http://ci:{SECRET}@mlflow.example:50o0/"}},
            "tracking.mlflow_uri",
            "http://***@mlflow.example:50o0/",
        ),
    ],
    ids=["s3-storage-root", "mlflow-uri"],
)
def test_credentials_in_a_url_are_masked(
    tmp_path: Path, data_url: str, sections: dict[str, Any], field: str, shown: str
) -> None:
    job = EttTrain(config_for(tmp_path, data_url, **sections), tmp_path)
    try:
        assert job.wait(timeout=120) == ExitCode.USAGE, job.tail()
        [line] = job.stderr().strip().splitlines()
        assert field in line and shown in line, line
        assert SECRET not in job.output()
        job.assert_left_nothing()
    finally:
        job.end()


def test_the_flow_fails_before_its_first_attempt_with_the_same_line(
    tmp_path: Path, data_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``train`` flow's first task (plan-job): the same check, the same line, and no
    folder made for the ranks' config."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    config = config_for(tmp_path, data_url, storage={"root": f"file://{afile}/runs"})
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    with pytest.raises(PreflightError) as caught:
        plan.fn(str(path))
    (tmp_path / "cli").mkdir()
    cli = refused(config, tmp_path / "cli", "storage.root")
    assert cli == f"ett train: error: {caught.value}"
    assert list(private.iterdir()) == []
