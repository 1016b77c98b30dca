"""Typed, validated job settings: one config file (YAML or TOML) plus ETT_* environment overrides.

Every process of a job (the Prefect flow, each torchrun rank, the publisher) reads the same
file, so the config is the contract between them. Values are checked on load: a bad value is
rejected with a message naming the field and what it accepts, before any work is started.

Precedence, highest first: explicit overrides (a flow's ``overrides`` parameter: what a
deployment run asks for), ETT_* environment variables (``ETT_TRAIN__STEPS=50`` sets
``train.steps``: what the machine or worker says), the config file, the defaults. The ranks
of a job load the resolved config (``load_resolved``), so they see what the flow saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from contextvars import ContextVar
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class ConfigError(ValueError):
    """A job config that cannot be used; the message names the field and the allowed values."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageConfig(_Frozen):
    """Where a job keeps checkpoints, ledgers and caches (any fsspec URL)."""

    root: str = "file://./runs"
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    # Credentials come from the standard AWS environment unless given here; never persisted.
    s3_access_key_id: SecretStr | None = None
    s3_secret_access_key: SecretStr | None = None
    retries: int = Field(default=4, ge=0, le=20)  # botocore's retries per S3 request


class GeneratorConfig(_Frozen):
    """The synthetic click log: sizes and the planted ground truth's knobs."""

    rows: int = Field(default=400_000, ge=100)
    holdout_rows: int = Field(default=50_000, ge=100)
    shards: int = Field(default=8, ge=1, le=10_000)
    zipf_a: float = Field(default=1.2, gt=1.0, le=5.0)
    mean_history_len: float = Field(default=16.0, gt=0, le=4096)
    latent_dim: int = Field(default=8, ge=1, le=256)
    seed: int = 1234


class DataConfig(_Frozen):
    """Training data: where it lives, its schema, and how it is batched."""

    url: str = "file://./runs/data/demo"
    format: Literal["parquet", "criteo"] = "parquet"
    num_dense: int = Field(default=13, ge=1, le=4096)
    cat_vocab_sizes: tuple[int, ...] = (2000, 1000, 500, 200, 100, 50, 20, 10)
    item_vocab_size: int = Field(default=5000, ge=2)
    max_history_len: int = Field(default=64, ge=1, le=65_536)
    batch_size: int = Field(default=1024, ge=1, le=1_048_576)
    eval_batch_size: int = Field(default=4096, ge=1, le=1_048_576)
    shuffle: bool = True
    generator: GeneratorConfig = GeneratorConfig()

    @model_validator(mode="after")
    def _vocab_sizes_positive(self) -> DataConfig:
        if not self.cat_vocab_sizes:
            raise ValueError("cat_vocab_sizes must name at least one categorical feature")
        bad = [v for v in self.cat_vocab_sizes if v < 2]
        if bad:
            raise ValueError(f"cat_vocab_sizes entries must be >= 2, got {bad}")
        return self


class ModelConfig(_Frozen):
    """The DLRM-style ranking model and its swappable user-history tower."""

    embedding_dim: int = Field(default=16, ge=1, le=4096)
    dense_arch: tuple[int, ...] = (64, 16)
    over_arch: tuple[int, ...] = (64, 32)
    history_tower: Literal["pooling", "attention"] = "attention"
    attention_heads: int = Field(default=2, ge=1, le=64)
    attention_impl: Literal["auto", "triton", "cpu", "reference"] = "auto"

    @model_validator(mode="after")
    def _dense_arch_ends_at_embedding_dim(self) -> ModelConfig:
        if not self.dense_arch or self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch must end with embedding_dim={self.embedding_dim} so dense and sparse "
                f"features can interact, got {list(self.dense_arch)}"
            )
        if self.embedding_dim % self.attention_heads:
            raise ValueError(
                f"embedding_dim={self.embedding_dim} must be divisible by "
                f"attention_heads={self.attention_heads}"
            )
        return self


class TrainConfig(_Frozen):
    """The training loop."""

    steps: int = Field(default=600, ge=1)
    dense_lr: float = Field(default=3e-3, gt=0, le=10)
    sparse_lr: float = Field(default=0.1, gt=0, le=10)
    eval_every: int = Field(default=200, ge=0)
    eval_rows: int = Field(default=50_000, ge=1)
    log_every: int = Field(default=50, ge=1)
    seed: int = 0
    # torch.compile the dense interaction (trainer/compiled.py); False trains eagerly.
    # The first job under a storage root compiles cold (the demo model: ~50 s on 2 CPU
    # cores); later jobs and restarted attempts load the shared cache below (~0.12x).
    compile: bool = True
    # Shared compile cache (trainer/compile_cache.py): loaded before compiling, saved after.
    compile_cache: bool = True
    compile_cache_url: str | None = None  # None: <storage.root>/compile-cache
    # Init sub-stages as a dependency graph on threads (False: one after another).
    parallel_init: bool = True
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class CheckpointMode(StrEnum):
    """How a checkpoint blocks the loop (trainer/checkpoint/checkpointer.py)."""

    SYNC = "sync"  # the loop waits for the whole write (the baseline)
    ASYNC = "async"  # the loop waits for the staging copy, DCP writes in the background
    ASYNC_STAGED = "async_staged"  # the copy too runs in the background until the next step
    OFF = "off"


class CheckpointConfig(_Frozen):
    """When and how checkpoints are taken (see DESIGN.md, checkpoint protocol)."""

    mode: CheckpointMode = CheckpointMode.ASYNC_STAGED
    every_steps: int | None = Field(default=100, ge=1)
    every_seconds: float | None = Field(default=None, gt=0)
    keep_latest_k: int = Field(default=3, ge=1)
    resume: str = "latest"  # "latest", "none", or one checkpoint's URL
    warm_start: str | None = None  # a checkpoint URL whose model seeds a job with none of its own
    fallback_on_corrupt: bool = True
    preemption_budget_s: float = Field(default=60.0, gt=0)


class FaultConfig(_Frozen):
    """An injected failure, for demos, tests and benchmarks."""

    # sigkill_mid_upload / sigkill_before_manifest kill the process while the checkpoint of
    # that step is being written or is about to be committed.
    kind: Literal[
        "crash", "sigkill", "sigterm", "hang", "sigkill_mid_upload", "sigkill_before_manifest"
    ]
    step: int = Field(ge=0)
    attempt: int = Field(default=0, ge=0)


class TrackingConfig(_Frozen):
    """Where metrics, artifacts and models are recorded."""

    mlflow_uri: str = "sqlite:///mlflow.db"
    experiment: str = "ett-pipeline"
    registered_model: str = "ranker"


def _load_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = path.suffix[1:].upper()
        raise ConfigError(f"config file {path} is not valid {kind}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top, got {type(data)}")
    return data


_file_values: ContextVar[dict[str, Any] | None] = ContextVar("_file_values", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The config file's values, as a settings source ranked below the environment."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ hands over the whole mapping

    def __call__(self) -> dict[str, Any]:
        return _file_values.get() or {}


class JobConfig(BaseSettings):
    """Everything one training job needs; see configs/demo.yaml for a documented example."""

    model_config = SettingsConfigDict(
        env_prefix="ETT_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    job_id: str = Field(default="demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    storage: StorageConfig = StorageConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    faults: tuple[FaultConfig, ...] = ()
    tracking: TrackingConfig = TrackingConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Overrides (init kwargs) > environment > file: operators override a checked-in
        # config per machine without editing it, and a run's parameters override both.
        return init_settings, env_settings, _FileSource(settings_cls)

    @property
    def job_url(self) -> str:
        """The job's folder on storage: checkpoints, ledgers and reports live below it."""
        return f"{self.storage.root.rstrip('/')}/jobs/{self.job_id}"

    def model_hash(self) -> str:
        """Hash of everything that shapes the model's state: a checkpoint or compile cache
        made under another hash cannot be loaded into this model."""
        shape = {
            "model": self.model.model_dump(mode="json"),
            "num_dense": self.data.num_dense,
            "cat_vocab_sizes": list(self.data.cat_vocab_sizes),
            "item_vocab_size": self.data.item_vocab_size,
        }
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def public_dict(self) -> dict[str, Any]:
        """The config as plain data without credentials: safe to log, and to hand to
        subprocesses (which take credentials from their environment instead)."""
        secrets = {"storage": {"s3_access_key_id", "s3_secret_access_key"}}
        return self.model_dump(mode="json", exclude=secrets)


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid job config ({source}):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {field}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> JobConfig:
    """Load a job config from a YAML/TOML file (or the embedded defaults when None).

    ``overrides`` are nested dicts merged over the rest, e.g. ``train={"steps": 10}``; they
    win over ETT_* environment variables, which win over the file. Raises ConfigError
    naming each bad field.
    """
    data: dict[str, Any] = _load_file(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "embedded defaults"
    token = _file_values.set(data)
    try:
        return JobConfig(**overrides)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    finally:
        _file_values.reset(token)


def load_resolved(path: str | os.PathLike[str]) -> JobConfig:
    """A config that ``dump_config`` wrote for the processes of one job (the torchrun ranks).
    It was resolved already, environment included, so its values win over ETT_* variables;
    those only fill what it leaves out: credentials, which are never written to it."""
    try:
        return JobConfig(**_load_file(Path(path)))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, str(path))) from None


def dump_config(config: JobConfig, path: str | os.PathLike[str]) -> None:
    """Write a config as YAML (without credentials), e.g. to hand one to every torchrun rank."""
    Path(path).write_text(yaml.safe_dump(config.public_dict(), sort_keys=False))
