"""Small configs and datasets for tests: seconds to generate, seconds to train."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from infra.settings import JobConfig, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, **sections: Any) -> JobConfig:
    """A job whose data, checkpoints and ledgers live under ``tmp_path``; ``sections``
    are merged over the tiny defaults (e.g. ``train={"steps": 30}``)."""
    base: dict[str, Any] = {
        "job_id": "tiny",
        "storage": {"root": f"file://{tmp_path}/store"},
        "data": {
            "url": f"file://{tmp_path}/data",
            "cat_vocab_sizes": [50, 20, 10],
            "item_vocab_size": 100,
            "max_history_len": 16,
            "batch_size": 64,
            "eval_batch_size": 256,
            "generator": {"rows": 4000, "holdout_rows": 1000, "shards": 4, "mean_history_len": 6},
        },
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 8]},
        # Eager: each test has its own storage root, so compiling would start cold in every
        # trainer process (~50 s); tests/trainer/test_startup.py and test_compile_cache.py
        # cover the compiled default.
        "train": {"steps": 20, "eval_every": 0, "eval_rows": 512, "log_every": 5, "compile": False},
        "checkpoint": {"mode": "async_staged", "every_steps": 5, "keep_latest_k": 3},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_config(**base)


def write_dataset(config: JobConfig) -> dict[str, Any]:
    from trainer.data.synthetic import generate

    return generate(config.data, config.data.url)


def trainer_command(config_path: str | Path, nproc: int = 1) -> list[str]:
    """The command line of one single-node attempt, exactly as the orchestrator builds it."""
    from tasks.attempts import LaunchSpec

    return LaunchSpec(str(config_path), nproc=nproc).commands(0, "test")[0]


def run_trainer(
    config: JobConfig,
    tmp_path: Path,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """One attempt under torchrun, as the orchestrator would launch it (no orchestrator:
    no control channel, no standby, no retries)."""
    path = tmp_path / f"{config.job_id}.yaml"
    dump_config(config, path)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        trainer_command(path, nproc=nproc),
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(tmp_path),
    )


__all__ = ["tiny_config", "write_dataset", "run_trainer", "trainer_command"]
