"""The retrain flow's inputs (the newest complete data window, the champion's anchor), and
its runs that have nothing to train."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.retrain_flow import champion_anchor, latest_window, retrain_flow
from infra import storage
from infra.checkpoint_manifest import MANIFEST, Manifest
from infra.settings import dump_config
from tests.factories import tiny_config


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


def test_no_complete_window_is_none(tmp_path: Path) -> None:
    _partition(tmp_path, "2026-11-30", None)
    assert latest_window.fn(str(tmp_path)) is None
    assert latest_window.fn(str(tmp_path / "nothing-here")) is None


def _retrain(tmp_path: Path, data_root: Path):
    config = tiny_config(tmp_path, job_id="daily")
    dump_config(config, tmp_path / "job.yaml")
    state = retrain_flow(
        config=str(tmp_path / "job.yaml"), data_root=f"file://{data_root}", return_state=True
    )
    return config, state


def test_a_run_without_a_window_ends_cleanly(tmp_path: Path, prefect_server: str) -> None:
    _, state = _retrain(tmp_path, tmp_path / "daily")
    assert state.is_completed(), state
    assert "no complete dt=YYYY-MM-DD window" in state.message
    assert "ett generate --daily" in state.message
    assert state.result()["trained"] is False


def test_a_window_trained_already_is_not_trained_again(tmp_path: Path, prefect_server: str) -> None:
    _partition(tmp_path / "daily", "2026-11-29", "_meta.json")
    config = tiny_config(tmp_path, job_id="daily-2026-11-29")
    anchor = f"{config.layout.url}/checkpoints/step-000000020"
    # What the trainer commits at the end: the anchor's manifest.
    manifest = Manifest(step=20, world_size=1, config_hash="h", files={}, anchor=True)
    storage.write_text(storage.join(anchor, MANIFEST), manifest.to_json())
    _, state = _retrain(tmp_path, tmp_path / "daily")
    assert state.is_completed(), state
    assert "no new window: the newest, 2026-11-29, was trained already" in state.message
    assert anchor in state.message
    assert state.result() == {
        "trained": False,
        "message": state.message,
        "window": "2026-11-29",
        "job_id": "daily-2026-11-29",
    }


@pytest.mark.slow  # MLflow creates its SQLite schema: ~10-30 s here
def test_champion_anchor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The champion comes from the tracking URI's own registry, even when this process's
    global MLflow registry points elsewhere (publishing in process sets it)."""
    from mlflow.tracking._model_registry import utils as registry_utils

    monkeypatch.setattr(registry_utils, "_registry_uri", f"sqlite:///{tmp_path}/other.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert champion_anchor.fn(uri, "ranker") is None  # no registered model: cold start
    client = MlflowClient(uri, registry_uri=uri)  # not the process's (publishing sets it)
    client.create_registered_model("ranker")
    v1 = client.create_model_version(
        "ranker", source="file:///m1", tags={"anchor_uri": "s3://b/jobs/a/checkpoints/step-1"}
    )
    assert champion_anchor.fn(uri, "ranker") is None  # a version, but no champion yet
    client.set_registered_model_alias("ranker", "champion", v1.version)
    assert champion_anchor.fn(uri, "ranker") == "s3://b/jobs/a/checkpoints/step-1"
