"""Config loading: files, environment overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from infra.config_sources import ConfigError
from infra.settings import JobConfig, StandbyPark, dump_config, load_config, load_resolved

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "example.yaml"


def test_defaults_are_valid_and_hash_is_stable() -> None:
    a, b = load_config(), load_config()
    assert a.train.steps > 0
    assert a.model_hash() == b.model_hash()
    assert a.job_id is None  # a new job: its start gives it an id (tasks/job_identity.py)
    assert a.model_copy(update={"job_id": "j1"}).layout.url.endswith("/jobs/j1")


def test_yaml_file_and_env_override(tmp_path, monkeypatch) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("job_id: j1\ntrain:\n  steps: 7\n  seed: 3\n")
    monkeypatch.setenv("ETT_TRAIN__STEPS", "9")
    config = load_config(path)
    assert (config.job_id, config.train.steps, config.train.seed) == ("j1", 9, 3)


def test_the_precedence_chain_defaults_file_overrides_environment(tmp_path, monkeypatch) -> None:
    """embedded defaults < the file < overrides (a run's parameters) < ETT_* (the place the
    job runs in), one field per step of the chain; the ranks load the resolved config as it
    is, whatever their own environment says."""
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  seed: 3\n  steps: 7\n  log_every: 3\nrecovery:\n  max_failures: 5\n")
    monkeypatch.setenv("ETT_TRAIN__LOG_EVERY", "4")
    monkeypatch.setenv("ETT_RECOVERY__MAX_FAILURES", "6")
    config = load_config(path, train={"steps": 11, "log_every": 12}, recovery={"max_failures": 8})
    default = JobConfig.model_fields["train"].default
    assert config.train.eval_every == default.eval_every  # nobody says: the default
    assert config.train.seed == 3  # the file over the default
    assert config.train.steps == 11  # the overrides over the file
    assert config.train.log_every == 4  # the environment over the overrides
    assert config.recovery.max_failures == 6  # ...in every section
    dump_config(config, tmp_path / "resolved.yaml")
    monkeypatch.setenv("ETT_TRAIN__LOG_EVERY", "99")
    monkeypatch.setenv("ETT_TRAIN__STEPS", "99")
    resolved = load_resolved(tmp_path / "resolved.yaml")
    assert (resolved.train.steps, resolved.train.log_every) == (11, 4)


def test_launch_and_recovery_sections_hold_the_jobs_knobs_once() -> None:
    """What an orchestrator needs is config, with one default each: the watch timeouts, the
    retry policy and the launch shape (tasks/orchestrator.py reads nothing else)."""
    config = load_config(launch={"nproc": 2}, recovery={"hang_timeout_s": 30})
    assert (config.launch.nproc, config.launch.nnodes, config.launch.agent_pool) == (2, 1, None)
    rec = config.recovery
    assert (rec.max_failures, rec.backoff_s, rec.hang_timeout_s) == (3, 10.0, 30.0)
    assert rec.startup_timeout_s == 900.0
    with pytest.raises(ConfigError, match="launch.nproc"):
        load_config(launch={"nproc": 0})


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
    """configs/example.yaml must stay valid and in step with the embedded defaults (apart
    from its own job_id)."""
    example = load_config(EXAMPLE)
    defaults = load_config()
    assert example.job_id == "example"
    assert example.model_hash() == defaults.model_hash()
    assert example.model_dump(exclude={"job_id"}) == defaults.model_dump(exclude={"job_id"})


def _missing(model: type[BaseModel], written: Any, path: str) -> list[str]:
    """Fields of ``model`` (recursively) that the example does not spell out."""
    missing = []
    for name, field in model.model_fields.items():
        where = f"{path}{name}"
        if not isinstance(written, dict) or name not in written:
            missing.append(where)
            continue
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            missing += _missing(sub, written[name], f"{where}.")
    return missing


def test_example_config_documents_every_field() -> None:
    """Every field of every settings model appears in configs/example.yaml; list-valued
    sections (faults) name each of their fields in the comment next to them."""
    from infra.settings import FaultConfig

    written = yaml.safe_load(EXAMPLE.read_text())
    assert _missing(JobConfig, written, "") == []
    faults_lines = [line for line in EXAMPLE.read_text().splitlines() if "kind:" in line]
    for name in FaultConfig.model_fields:
        assert any(f"{name}:" in line for line in faults_lines), name


@pytest.mark.parametrize(
    ("text", "field", "got"),
    [
        ("train:\n  steps: '100'\n", "train.steps", "'100'"),
        ("train:\n  steps: true\n", "train.steps", "True"),
        ("data:\n  shuffle: 1\n", "data.shuffle", "1"),
        ("data:\n  batch_size: 64.0\n", "data.batch_size", "64.0"),
        ("data:\n  cat_vocab_sizes: ['50', 20]\n", "data.cat_vocab_sizes.0", "'50'"),
        ("faults: [{kind: sigterm, step: '5'}]\n", "faults.0.step", "'5'"),
    ],
)
def test_no_silent_coercion_in_files(tmp_path, text: str, field: str, got: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{field}: " in str(err.value) and f"(got {got})" in str(err.value)


def test_no_silent_coercion_in_overrides() -> None:
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(train={"steps": "100"})
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(train={"compile": 1})


def test_environment_values_are_read_as_their_field_type(monkeypatch) -> None:
    """Environment variables are strings: each is parsed as its field's type, then checked."""
    monkeypatch.setenv("ETT_TRAIN__STEPS", "50")
    monkeypatch.setenv("ETT_DATA__SHUFFLE", "false")
    monkeypatch.setenv("ETT_CHECKPOINT__PREEMPTION_BUDGET_S", "30")
    monkeypatch.setenv("ETT_CHECKPOINT__EVERY_SECONDS", "null")
    monkeypatch.setenv("ETT_CHECKPOINT__MODE", "sync")
    monkeypatch.setenv("ETT_JOB_ID", "123")  # a string field keeps its digits as text
    config = load_config()
    assert config.train.steps == 50 and config.data.shuffle is False
    assert config.checkpoint.preemption_budget_s == 30.0 and config.checkpoint.mode == "sync"
    assert config.checkpoint.every_seconds is None and config.job_id == "123"
    monkeypatch.setenv("ETT_TRAIN__STEPS", "fifty")
    with pytest.raises(ConfigError, match=r"train.steps: .*\(got 'fifty'\)"):
        load_config()


def test_no_checkpoint_interval_is_rejected_unless_checkpoints_are_off(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("checkpoint:\n  every_steps: null\n  every_seconds: null\n")
    with pytest.raises(ConfigError, match="every_steps and every_seconds are both null"):
        load_config(path)
    path.write_text("checkpoint:\n  every_steps: null\n  mode: off\n")  # YAML's bare off
    assert load_config(path).checkpoint.mode == "off"


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("checkpoint", "preemption_budget_s", 0.0),
        ("checkpoint", "preemption_budget_s", 86_400.0),
        ("checkpoint", "every_seconds", 0.0),
        ("checkpoint", "every_seconds", 30 * 86_400.0),
        ("storage", "retries", 100),
        ("data", "max_bad_row_fraction", 1.5),
    ],
)
def test_budgets_and_timeouts_are_bounded(section: str, field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{section}.{field}"):
        load_config(**{section: {field: value}})


SECRET = "AKIA-TOPSECRET-123"


@pytest.mark.parametrize(
    "text",
    [
        f"storage:\n  s3_secret_key: {SECRET}\n",  # misspelt field: unknown key
        f"storage:\n  s3_access_key_id: [{SECRET}]\n",
        f"storage:\n  s3_secret_access_key: {{value: {SECRET}}}\n",
        f"storage:\n  root: 7\n  s3_secret_access_key: {SECRET}\n  retries: x\n",
        f"tracking:\n  mlflow_uri: http://me:{SECRET}@host\n  experiment: 5\n",
        f"data:\n  url: s3://me:{SECRET}@bucket/x\n  batch_size: '1'\n",
        f"storage:\n  s3_secret_access_key: '{SECRET}\n",  # invalid YAML on the secret's line
    ],
)
def test_config_errors_never_echo_a_secret(tmp_path, text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert SECRET not in str(err.value), str(err.value)


def test_mlflow_credentials_are_redacted_in_the_dumped_config(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ETT_TRACKING__MLFLOW_URI", f"https://me:{SECRET}@mlflow.example:443/x")
    config = load_config()
    assert SECRET in config.tracking.mlflow_uri  # the process itself still has it
    public = config.public_dict()["tracking"]["mlflow_uri"]
    assert public == "https://***@mlflow.example:443/x"
    path = tmp_path / "out.yaml"
    dump_config(config, path)
    assert SECRET not in path.read_text()


def test_an_environment_list_that_is_not_json_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setenv("ETT_DATA__CAT_VOCAB_SIZES", "50,20")
    with pytest.raises(ConfigError, match=r"environment.*ETT_DATA__CAT_VOCAB_SIZES='\[50, 20\]'"):
        load_config()
    monkeypatch.setenv("ETT_DATA__CAT_VOCAB_SIZES", "[50, 20]")
    assert load_config().data.cat_vocab_sizes == (50, 20)


def test_standby_park_is_auto_host_or_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config().recovery.standby_park == StandbyPark.AUTO
    with pytest.raises(
        ConfigError,
        match=r"recovery.standby_park: Input should be 'auto', 'host' or 'device' \(got 'gpu'\)",
    ):
        load_config(recovery={"standby_park": "gpu"})
    monkeypatch.setenv("ETT_RECOVERY__STANDBY_PARK", "host")
    assert load_config().recovery.standby_park == StandbyPark.HOST
