"""Config faults, through the ``ett`` command a user runs: strict values, no silent
coercion, no run without a checkpoint interval, and credentials never echoed or stored.

Before: ``steps: "3"`` trained 3 steps, ``every_steps: null`` trained with no checkpoint
but the last, a misspelt secret key was echoed in the error (``(got 'AKIA-...')``), and an
MLflow URI with a token was written into every checkpoint's config.yaml.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra import storage
from infra.checkpoint_manifest import committed_checkpoints
from infra.exit_codes import ExitCode
from tests.factories import ROOT
from tests.reliability.jobs import job_config, run_to_end

pytestmark = pytest.mark.slow

SECRET = "AKIA-ABCDEFGHIJ-not-real"


def ett_train(config_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``ett train --config FILE`` with the installed script."""
    path = tmp_path / "job.yaml"
    path.write_text(config_text)
    ett = Path(sys.executable).with_name("ett")
    return subprocess.run(
        [str(ett), "train", "--config", str(path)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )


def tiny_yaml(tmp_path: Path, data_url: str, **changes: dict) -> str:
    """A valid tiny job as YAML, with sections changed as the test says."""
    data = job_config(tmp_path, data_url, steps=3).public_dict()
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return yaml.safe_dump(data)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"train": {"steps": "3"}}, "train.steps"),
        ({"train": {"compile": 0}}, "train.compile"),
        (
            {"checkpoint": {"every_steps": None, "every_seconds": None}},
            "every_steps and every_seconds",
        ),
        ({"checkpoint": {"preemption_budget_s": 100_000}}, "checkpoint.preemption_budget_s"),
    ],
    ids=["quoted-number", "int-for-bool", "no-checkpoint-interval", "unbounded-budget"],
)
def test_bad_config_value_is_rejected_not_coerced(
    tmp_path: Path, data_url: str, changes: dict, named: str
) -> None:
    result = ett_train(tiny_yaml(tmp_path, data_url, **changes), tmp_path)
    assert result.returncode == ExitCode.USAGE, (result.stdout + result.stderr)[-3000:]
    assert named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "store").exists()  # nothing ran


def test_config_error_never_echoes_a_secret(tmp_path: Path, data_url: str) -> None:
    text = tiny_yaml(tmp_path, data_url, storage={"s3_secret_key": SECRET})  # misspelt
    result = ett_train(text, tmp_path)
    assert result.returncode == ExitCode.USAGE, (result.stdout + result.stderr)[-3000:]
    assert "storage.s3_secret_key" in result.stderr, result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_mlflow_credentials_never_reach_a_checkpoint(tmp_path: Path, data_url: str) -> None:
    # The job's own config names an MLflow server with credentials: neither the config file
    # the ranks read nor the checkpoint's copy of it may hold them.
    uri = f"http://ci:{SECRET}@127.0.0.1:9/"
    config = job_config(tmp_path, data_url, steps=3, tracking={"mlflow_uri": uri})
    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    [anchor] = committed_checkpoints(config.layout)
    stored = storage.read_text(storage.join(anchor.url, "config.yaml"))
    assert "mlflow_uri: http://***@127.0.0.1:9/" in stored, stored
    assert SECRET not in stored and SECRET not in out
