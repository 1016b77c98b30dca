"""The preflight's rules one at a time, without a job: which MLflow URIs it takes, when it
asks for the holdout, what its messages say (tests/reliability/test_preflight.py runs them
through ``ett train`` as a user meets them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import preflight
from infra.preflight import PreflightError, _mlflow_problem, _reason
from tests.factories import tiny_config


@pytest.mark.parametrize(
    "uri",
    [
        "sqlite:///mlflow.db",
        "postgresql+psycopg2://user:pw@db:5432/mlflow",
        "mysql://db/mlflow",
        "http://127.0.0.1:5000",
        "https://mlflow.example.com",
        "file:///tmp/mlruns",
        "/tmp/mlruns",
        "mlruns",
        r"C:\mlruns",
        "databricks",
    ],
)
def test_uris_mlflow_has_a_store_for_pass(uri: str) -> None:
    assert _mlflow_problem(uri) is None


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("", "empty"),
        ("http://a b", "white space"),
        ("http:///path", "names no host"),
        ("http://host:99999", "not a URI"),
        ("sqlite:mlflow.db", "a database URI needs 'sqlite://'"),
        ("postgresql:db", "a database URI needs 'postgresql://'"),
        ("ftp://host/x", "no tracking store for the scheme 'ftp'"),
    ],
)
def test_uris_it_cannot_use_are_named(uri: str, said: str) -> None:
    problem = _mlflow_problem(uri)
    assert problem is not None and said in problem


@pytest.mark.parametrize(
    ("eval_mode", "checkpoints", "holdout_needed"),
    [
        ("inline", "async_staged", True),
        ("async", "async_staged", True),
        ("async", "off", False),
        ("off", "async_staged", False),
    ],
)
def test_the_holdout_is_asked_for_only_when_the_job_evaluates(
    tmp_path: Path, eval_mode: str, checkpoints: str, holdout_needed: bool
) -> None:
    config = tiny_config(tmp_path, train={"eval": eval_mode}, checkpoint={"mode": checkpoints})
    shards = Path(tmp_path, "data", "train")
    shards.mkdir(parents=True)
    (shards / "part-00000.parquet").write_bytes(b"")
    if holdout_needed:
        with pytest.raises(PreflightError, match=r"data\.url .*no parquet shards match .*holdout"):
            preflight._data(config)
    else:
        preflight._data(config)


def test_a_missing_data_set_says_how_to_make_one_for_parquet_only(tmp_path: Path) -> None:
    parquet = tiny_config(tmp_path)
    with pytest.raises(PreflightError, match="`ett generate` writes a synthetic data set"):
        preflight._data(parquet)
    criteo = tiny_config(tmp_path, data={"format": "criteo"})
    with pytest.raises(PreflightError) as caught:
        preflight._data(criteo)
    assert "no criteo shards" in str(caught.value) and "ett generate" not in str(caught.value)


def test_a_long_library_error_is_cut_to_its_first_240_characters() -> None:
    short = ValueError("x" * 10)
    assert _reason(short) == "ValueError: " + "x" * 10
    long = _reason(ValueError("y" * 1000))
    assert len(long) == 240 and long.endswith("...")


def test_an_unlistable_data_url_and_an_unreadable_checkpoint_are_the_fields_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from infra import data_layout, storage

    def down(*args: object, **kwargs: object) -> None:
        raise storage.StorageError("endpoint unreachable")

    config = tiny_config(tmp_path, checkpoint={"warm_start": "s3://b/j/step-000000010"})
    monkeypatch.setattr(data_layout, "list_shards", down)
    with pytest.raises(PreflightError, match=r"^data\.url .*cannot list it: StorageError"):
        preflight._data(config)
    monkeypatch.setattr(preflight, "read_manifest", down)
    with pytest.raises(PreflightError, match=r"^checkpoint\.warm_start .*cannot read it"):
        preflight._checkpoints(config)
