"""The retrain flow's inputs: the newest complete data window and the champion's anchor."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.retrain_flow import champion_anchor, latest_window


def _partition(root: Path, date: str, marker: str | None) -> None:
    (root / f"dt={date}").mkdir(parents=True)
    (root / f"dt={date}" / (marker or "part-00000.parquet")).write_text("x")


def test_latest_complete_window(tmp_path: Path) -> None:
    _partition(tmp_path, "2026-11-27", "_meta.json")
    _partition(tmp_path, "2026-11-29", "_SUCCESS")
    _partition(tmp_path, "2026-11-30", None)  # still being written: skipped
    (tmp_path / "dt=latest").mkdir()  # not a date: ignored
    (tmp_path / "notes.txt").write_text("ignored")
    window = latest_window.fn(f"file://{tmp_path}")
    assert window.date == "2026-11-29"
    assert window.url == f"file://{tmp_path}/dt=2026-11-29"


def test_no_window_is_an_error(tmp_path: Path) -> None:
    _partition(tmp_path, "2026-11-30", None)
    with pytest.raises(FileNotFoundError, match="no complete dt=YYYY-MM-DD partition"):
        latest_window.fn(str(tmp_path))


@pytest.mark.slow  # MLflow creates its SQLite schema: ~10-30 s here
def test_champion_anchor(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert champion_anchor.fn(uri, "ranker") is None  # no registered model: cold start
    client = MlflowClient(uri)
    client.create_registered_model("ranker")
    v1 = client.create_model_version(
        "ranker", source="file:///m1", tags={"anchor_uri": "s3://b/jobs/a/checkpoints/step-1"}
    )
    assert champion_anchor.fn(uri, "ranker") is None  # a version, but no champion yet
    client.set_registered_model_alias("ranker", "champion", v1.version)
    assert champion_anchor.fn(uri, "ranker") == "s3://b/jobs/a/checkpoints/step-1"
