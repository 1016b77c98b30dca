"""Config loading: files, environment overrides, and errors that name the field."""

from __future__ import annotations

import pytest

from infra.settings import ConfigError, dump_config, load_config, load_resolved


def test_defaults_are_valid_and_hash_is_stable() -> None:
    a, b = load_config(), load_config()
    assert a.train.steps > 0
    assert a.model_hash() == b.model_hash()
    assert a.job_url.endswith("/jobs/demo")


def test_yaml_file_and_env_override(tmp_path, monkeypatch) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("job_id: j1\ntrain:\n  steps: 7\n  seed: 3\n")
    monkeypatch.setenv("ETT_TRAIN__STEPS", "9")
    config = load_config(path)
    assert (config.job_id, config.train.steps, config.train.seed) == ("j1", 9, 3)


def test_overrides_win_over_env_which_wins_over_the_file(tmp_path, monkeypatch) -> None:
    """A run's parameters (overrides) > ETT_* (the worker's environment) > the file; the
    ranks load the resolved config as it is, whatever their environment says."""
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  steps: 7\n  log_every: 3\n  seed: 3\n")
    monkeypatch.setenv("ETT_TRAIN__STEPS", "9")
    monkeypatch.setenv("ETT_TRAIN__LOG_EVERY", "4")
    config = load_config(path, train={"steps": 11})
    assert (config.train.steps, config.train.log_every, config.train.seed) == (11, 4, 3)
    dump_config(config, tmp_path / "resolved.yaml")
    assert load_resolved(tmp_path / "resolved.yaml").train.steps == 11


def test_toml_file(tmp_path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('job_id = "t"\n[checkpoint]\nmode = "sync"\n')
    assert load_config(path).checkpoint.mode == "sync"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("train:\n  steps: 0\n", "train.steps"),
        ("checkpoint:\n  mode: fast\n", "checkpoint.mode"),
        ("model:\n  embedding_dim: 16\n  dense_arch: [64, 8]\n", "model"),
        ("data:\n  cat_vocab_sizes: [10, 1]\n", "data"),
        ("train:\n  stepz: 3\n", "train.stepz"),
        ("job_id: 'has space'\n", "job_id"),
    ],
)
def test_bad_values_name_the_field(tmp_path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert field in str(err.value)


def test_missing_and_malformed_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_dump_round_trips_without_credentials(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ETT_STORAGE__S3_SECRET_ACCESS_KEY", "super-secret")
    monkeypatch.setenv("ETT_STORAGE__S3_ACCESS_KEY_ID", "AKIDEXAMPLE")
    config = load_config(train={"steps": 11})
    assert config.storage.s3_secret_access_key is not None
    path = tmp_path / "out.yaml"
    dump_config(config, path)
    text = path.read_text()
    assert "super-secret" not in text and "AKIDEXAMPLE" not in text
    monkeypatch.delenv("ETT_STORAGE__S3_SECRET_ACCESS_KEY")
    monkeypatch.delenv("ETT_STORAGE__S3_ACCESS_KEY_ID")
    again = load_config(path)
    assert again.train.steps == 11 and again.model_hash() == config.model_hash()


def test_documented_example_config_loads_and_matches_defaults() -> None:
    """configs/example.yaml documents every section; it must stay valid and in step with
    the embedded defaults (apart from its own job_id)."""
    from pathlib import Path

    example = load_config(Path(__file__).resolve().parents[2] / "configs" / "example.yaml")
    defaults = load_config()
    assert example.job_id == "example"
    assert example.model_hash() == defaults.model_hash()
    assert example.train == defaults.train
    assert example.checkpoint == defaults.checkpoint
