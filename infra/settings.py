"""Typed, validated job settings: one config file (YAML or TOML) plus ETT_* environment overrides.

Every process of a job (the Prefect flow, each torchrun rank, the publisher) reads the same
file, so the config is the contract between them. Values are checked on load: a bad value is
rejected with a message naming the field and what it accepts, before any work is started.

Precedence, lowest first: the embedded defaults, the config file, the overrides (a flow
run's or a deployment's ``overrides`` parameter, ``ett train``'s flags), then ETT_*
environment variables (``ETT_TRAIN__STEPS=50`` sets ``train.steps``). The environment is
the place a job runs in: a worker's or a work pool's ``ETT_STORAGE__ROOT`` says where that
place keeps its data, and a run's parameters cannot send the job elsewhere (a run that must
differ sets its own ``job_variables.env``). The ranks of a job load the resolved config
(``load_resolved``), so they see what the orchestrator saw.

Strict: a file or an override says what it means. ``steps: "100"`` is not 100 and
``shuffle: 1`` is not true (a quoted number is a typo waiting to happen, and silent coercion
hides it). Environment variables are strings by nature, so each is read as its field's type
first: ``ETT_TRAIN__STEPS=50`` sets ``train.steps`` to 50 and wins over the file.

Errors never echo a credential: values of secret fields and of unknown keys are left out of
messages, and user:password in URLs is masked. How the file and the environment are read, and
how a bad value is reported: infra/config_sources.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import time
from contextvars import ContextVar
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    Strict,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from infra.config_sources import (
    ConfigError,
    EnvSource,
    config_file,
    file_source,
    format_errors,
    reading,
    redact_url,
)
from infra.job_layout import JobLayout

_RESOLVED: ContextVar[bool] = ContextVar("ett_resolved_config", default=False)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


# Strict types still take a YAML/JSON list for a tuple and a string for an enum (the only
# way a file can spell them); the items themselves stay strict.
Ints = Annotated[tuple[StrictInt, ...], Strict(False)]


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
    cat_vocab_sizes: Ints = (2000, 1000, 500, 200, 100, 50, 20, 10)
    item_vocab_size: int = Field(default=5000, ge=2)
    max_history_len: int = Field(default=64, ge=1, le=65_536)
    # The global batch: M ranks take batch_size / M rows each (M must divide it), so the
    # stream is the same on any world size (trainer/data/loader.py).
    batch_size: int = Field(default=1024, ge=1, le=1_048_576)
    eval_batch_size: int = Field(default=4096, ge=1, le=1_048_576)
    shuffle: bool = True
    # Bad rows (label not 0/1, NaN features, ids out of range) are skipped and counted; a
    # file with a larger share of them fails the attempt (exit BAD_DATA): that is a broken
    # export, not noise, and training on the rest would be silently biased.
    max_bad_row_fraction: float = Field(default=0.01, ge=0, le=1)
    # Re-deal each step's rows across ranks so their summed attention work is even
    # (trainer/data/balance.py); no effect with one rank.
    balance_ranks: bool = True
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
    dense_arch: Ints = (64, 16)
    over_arch: Ints = (64, 32)
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


class EvalMode(StrEnum):
    """Where holdout evaluation runs (every ``train.eval_every`` steps and at the end)."""

    INLINE = "inline"  # in the training loop: training waits for it
    ASYNC = (
        "async"  # a side process evaluates committed checkpoints (trainer/checkpoint_evaluator.py)
    )
    OFF = "off"


class ConsensusMode(StrEnum):
    """How ranks agree on a preemption or a clock-chosen checkpoint (trainer/consensus.py)."""

    DEFERRED = "deferred"  # a non-blocking all-reduce per step, read one step later
    BLOCKING = "blocking"  # a blocking all-reduce per step: the reference it is measured against


class TrainConfig(_Frozen):
    """The training loop."""

    steps: int = Field(default=600, ge=1)
    dense_lr: float = Field(default=3e-3, gt=0, le=10)
    sparse_lr: float = Field(default=0.1, gt=0, le=10)
    eval: EvalMode = Field(default=EvalMode.ASYNC, strict=False)
    eval_every: int = Field(default=200, ge=0)
    eval_rows: int = Field(default=50_000, ge=1)
    log_every: int = Field(default=50, ge=1)
    seed: int = 0
    # torch.compile the dense interaction (trainer/compiled.py); False trains eagerly.
    # The first job under a storage root compiles cold; later jobs and restarted attempts
    # load the shared cache below instead (benchmarks/bench_startup.py measures both).
    compile: bool = True
    # Shared compile cache (trainer/compile_cache.py): loaded before compiling, saved after.
    compile_cache: bool = True
    compile_cache_url: str | None = None  # None: <storage.root>/compile-cache
    # Init sub-stages as a dependency graph on threads (False: one after another).
    parallel_init: bool = True
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    step_consensus: ConsensusMode = Field(default=ConsensusMode.DEFERRED, strict=False)

    @field_validator("eval", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare ``off`` as false: take it as the word the user wrote.
        return EvalMode.OFF if value is False else value


class CheckpointMode(StrEnum):
    """How a checkpoint blocks the loop (trainer/checkpoint/checkpointer.py)."""

    SYNC = "sync"  # the loop waits for the whole write (the baseline)
    ASYNC = "async"  # the loop waits for the staging copy, DCP writes in the background
    ASYNC_STAGED = "async_staged"  # the copy too runs in the background until the next step
    OFF = "off"


def enabled_shorthand(section: type, value: Any) -> Any:
    """A section with an ``enabled`` field may be given as true or false alone (also as
    the words, from an environment variable): ``{"enabled": value}``."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if isinstance(value, bool):
        return {"enabled": value}
    if not isinstance(value, dict | section):
        raise ValueError("must be true, false or a mapping of its fields")
    return value


class MemoryTierConfig(_Frozen):
    """The in-memory tier (trainer/checkpoint/memory_tier.py): each rank's newest state in
    this host's shared memory, restored in preference to durable storage when it is newer.
    Its interval fields mean what the durable tier's do, for its own copies."""

    enabled: bool = True
    every_steps: int | Literal["auto"] | None = Field(default="auto")
    every_seconds: float | None = Field(default=None, gt=0, le=7 * 86_400)
    cost_budget: float = Field(default=0.01, gt=0, le=0.5)

    @model_validator(mode="before")
    @classmethod
    def _bool(cls, value: Any) -> Any:
        # ``memory_tier: false`` (or true) is the short spelling of ``enabled``.
        return enabled_shorthand(cls, value)

    @model_validator(mode="after")
    def _has_an_interval(self) -> MemoryTierConfig:
        if isinstance(self.every_steps, int) and self.every_steps < 1:
            raise ValueError(
                f"memory_tier.every_steps must be >= 1 or 'auto', got {self.every_steps}"
            )
        if self.enabled and self.every_steps is None and self.every_seconds is None:
            raise ValueError(
                "memory_tier.every_steps and memory_tier.every_seconds are both null: no "
                "in-memory copy would ever be taken; set one of them, or memory_tier: false"
            )
        return self


class IncrementalConfig(_Frozen):
    """Incremental durable checkpoints (trainer/checkpoint/delta.py): a commit writes only
    the embedding rows touched since the previous one (with their optimizer state) and the
    whole dense state; a full snapshot every ``full_every`` commits, or when any table's
    touched share exceeds ``max_delta_share``. Off until measured (docs/checkpoints.md)."""

    enabled: bool = False
    full_every: int = Field(default=8, ge=1, le=10_000)  # 1: every commit is full
    max_delta_share: float = Field(default=0.5, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _bool(cls, value: Any) -> Any:
        # ``incremental: true`` (or false) is the short spelling of ``enabled``.
        return enabled_shorthand(cls, value)


class CheckpointConfig(_Frozen):
    """When and how checkpoints are taken (trainer/checkpoint/)."""

    mode: CheckpointMode = Field(default=CheckpointMode.ASYNC_STAGED, strict=False)
    # "auto": chosen by the interval advisor from the measured cost of a checkpoint and the
    # job's failures (trainer/checkpoint/interval.py); an int: every N steps.
    every_steps: int | Literal["auto"] | None = Field(default="auto")
    every_seconds: float | None = Field(default=None, gt=0, le=7 * 86_400)
    keep_latest_k: int = Field(default=3, ge=1, le=10_000)
    resume: str = "latest"  # "latest", "none", or one checkpoint's URL
    warm_start: str | None = None  # a checkpoint URL whose model seeds a job with none of its own
    fallback_on_corrupt: bool = True
    # The whole save on SIGTERM (finishing the in-flight one, the new save, the commit);
    # the orchestrator waits at least this long before SIGKILL.
    preemption_budget_s: float = Field(default=60.0, ge=1, le=3600)
    # every_steps: auto spends at most this share of training time on checkpoints until
    # failures are seen (then Young's interval from the observed MTBF takes over).
    cost_budget: float = Field(default=0.01, gt=0, le=0.5)
    # Each rank's newest state in host shared memory (/dev/shm), docs/checkpoints.md.
    memory_tier: MemoryTierConfig = Field(default=MemoryTierConfig(), strict=False)
    # Commits that write only the touched embedding rows (docs/checkpoints.md).
    incremental: IncrementalConfig = Field(default=IncrementalConfig(), strict=False)

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare ``off`` as false: take it as the word the user wrote.
        return CheckpointMode.OFF if value is False else value

    @model_validator(mode="after")
    def _has_an_interval(self) -> CheckpointConfig:
        if isinstance(self.every_steps, int) and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 or 'auto', got {self.every_steps}")
        if (
            self.mode != CheckpointMode.OFF
            and self.every_steps is None
            and self.every_seconds is None
        ):
            raise ValueError(
                "every_steps and every_seconds are both null: no checkpoint would ever be "
                "taken; set one of them, or mode: off"
            )
        return self


class LaunchConfig(_Frozen):
    """How every attempt of the job is launched (tasks/attempt.py): one torchrun agent per
    node, ``nproc`` ranks each."""

    nproc: int = Field(default=1, ge=1, le=1024)  # ranks per node
    nnodes: int = Field(default=1, ge=1, le=4096)  # each a torchrun agent, c10d rendezvous
    # A warm agent pool's socket (``ett pool``): launchers are claimed from it when it can
    # serve them, else started fresh (docs/recovery.md).
    agent_pool: str | None = None
    # A Prefect work pool whose workers run the nodes: each node is a node run (the
    # ``train-node`` flow deployed to that pool) on whichever host a worker places it, and
    # the hosts share only the job's storage (docs/multi-host.md). None: the nodes are
    # this host's subprocesses.
    work_pool: str | None = None


class StandbyPark(StrEnum):
    """Where a parked warm standby keeps its model until it is promoted (docs/recovery.md,
    "Standbys on GPU hosts")."""

    AUTO = "auto"  # HOST on a CUDA device, DEVICE otherwise
    # Everything host-side (imports, loader, compile cache, the model built on "meta" and in
    # host memory); the device's context, tables and warm-up come after the promotion, once
    # the failed attempt's device memory is free.
    HOST = "host"
    DEVICE = "device"  # built, sharded and warmed up on the device before it parks


HEALTH_AUTO = "auto"  # recovery.health_check: the built-in check on a CUDA host


def health_argv(command: str, slot: int, device: str) -> list[str]:
    """``recovery.health_check``'s command line for one rank slot: split as a shell would
    (no shell runs it), ``{slot}`` and ``{device}`` substituted in every word. Raises
    ValueError, one line, for a command that cannot be split or names another placeholder."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"recovery.health_check {command!r} cannot be split: {exc}") from None
    if not words:
        raise ValueError("recovery.health_check is empty: give a command, 'auto' or null")
    try:
        return [word.format(slot=slot, device=device) for word in words]
    except (KeyError, IndexError, ValueError) as exc:
        what = f"{{{exc.args[0]}}}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(
            f"recovery.health_check {command!r}: only {{slot}} and {{device}} are substituted "
            f"(write {{{{ and }}}} for literal braces), not {what}"
        ) from None


class RecoveryConfig(_Frozen):
    """How a job survives failures: the orchestrator's retries, timeouts and warm standby
    (tasks/orchestrator.py), and the trainer's in-process restart (trainer/restart.py)."""

    # Failures (crash, lost worker, hang) survived; one more fails the job. Preemptions do
    # not count (``max_preemptions`` only stops an endless loop of them).
    max_failures: int = Field(default=3, ge=0, le=1000)
    max_preemptions: int = Field(default=20, ge=0, le=10_000)
    # The same kind of failure twice in a row waits this long before the relaunch, doubling
    # per repeat up to backoff_max_s; the first of a kind relaunches at once.
    backoff_s: float = Field(default=10.0, ge=0, le=86_400)
    backoff_max_s: float = Field(default=300.0, ge=0, le=86_400)
    # An attempt that makes no step for this long is hung: its whole process tree is ended.
    hang_timeout_s: float = Field(default=600.0, gt=0, le=7 * 86_400)
    # ...and one that has made no first step this long after it started or was promoted
    # (a cold compile and a cold data cache included).
    startup_timeout_s: float = Field(default=900.0, gt=0, le=7 * 86_400)

    # A warm standby attempt initialises while each attempt trains and parks; on a failure
    # it is promoted at once. It costs one more trainer process per rank while parked
    # (memory, no CPU): see docs/recovery.md.
    standby: bool = True
    # What the standby builds before it parks: on a GPU host ``host`` keeps a second model
    # out of device memory, at the cost of building it on the device after the promotion.
    standby_park: StandbyPark = Field(default=StandbyPark.AUTO, strict=False)
    # An exception inside a step restores the newest committed checkpoint in the same
    # process, when every rank agrees within agree_timeout_s...
    in_process_restart: bool = True
    agree_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # ...unless the previous in-process restart was less than this long ago: then the
    # attempt fails and the orchestrator takes over.
    in_process_window_s: float = Field(default=60.0, ge=0, le=86_400)

    # On a work pool: node runs kept parked on hosts of their own, one promoted into a lost
    # node's place (a standby is per host: a job on a work pool keeps spares instead)...
    spare_nodes: int = Field(default=0, ge=0, le=1024)
    # ...and a node run whose heartbeat has not changed for this long is lost (its host, its
    # pod or its process gone); node runs whose orchestrator went silent this long end.
    node_timeout_s: float = Field(default=15.0, ge=2, le=3600)

    # Capacity lost (docs/recovery.md): a rank slot on this host marked unusable, or a node
    # lost with no spare. The next attempt waits up to wait_for_capacity_s for it to return,
    # then runs on what is left, resharded from the newest commit, if that is at least
    # min_ranks ranks per node (min_nodes nodes); null: the launched size, never smaller.
    min_ranks: int | None = Field(default=None, ge=1, le=1024)
    min_nodes: int | None = Field(default=None, ge=1, le=1024)
    wait_for_capacity_s: float = Field(default=60.0, ge=0, le=86_400)
    # What marks a rank slot lost (tasks/health.py): a command run per slot, {slot} (local
    # rank) and {device} (its CUDA device) substituted, no shell; exit 0 is usable, anything
    # else or no answer within health_check_timeout_s is lost. "auto": nvidia-smi's query of
    # the slot's device on a CUDA host, none elsewhere; null: none (no slot is ever lost).
    health_check: str | None = HEALTH_AUTO
    health_check_timeout_s: float = Field(default=10.0, gt=0, le=600)

    @field_validator("health_check")
    @classmethod
    def _a_command(cls, value: str | None) -> str | None:
        if value is not None and value != HEALTH_AUTO:
            health_argv(value, 0, "0")  # raises, in one line, on what cannot run
        return value


class FaultConfig(_Frozen):
    """An injected failure, for demos, tests and benchmarks."""

    # sigkill_mid_upload / sigkill_before_manifest kill the process while the checkpoint of
    # that step is being written or is about to be committed; sigkill_mid_memory_copy while
    # its in-memory copy is half written.
    kind: Literal[
        "crash",
        "sigkill",
        "sigterm",
        "hang",
        "sigkill_mid_upload",
        "sigkill_before_manifest",
        "sigkill_mid_memory_copy",
    ]
    step: int = Field(ge=0)
    attempt: int = Field(default=0, ge=0)


class TrackingConfig(_Frozen):
    """Where metrics, artifacts and models are recorded."""

    mlflow_uri: str = "sqlite:///mlflow.db"
    experiment: str = "ett-pipeline"
    registered_model: str = "ranker"


JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def new_job_id(name: str, when: float | None = None, salt: str | None = None) -> str:
    """A new job's id, readable and unique: ``<name>-<UTC yyyymmdd-HHMMSS>-<4 hex>``, e.g.
    ``train-20261205-083412-3f9a``. ``name`` is the flow, the deployment or the command;
    ``when`` (Unix seconds, default now) and ``salt`` (hex, default random) let a Prefect
    flow run name its job the same way every time it asks (its run name, a retry)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if when is None else when))
    suffix = (salt or secrets.token_hex(2))[:4]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:96] or "job"  # "my train"
    return f"{name}-{stamp}-{suffix}"


class JobConfig(BaseSettings):
    """Everything one training job needs; configs/example.yaml documents every field."""

    model_config = SettingsConfigDict(
        env_prefix="ETT_",
        env_nested_delimiter="__",
        env_parse_none_str="null",
        frozen=True,
        extra="forbid",
        strict=True,
    )

    # None: a new job, whose id the job's start gives it (tasks/job_identity.py): a config
    # that names an id continues that job, if it is unfinished.
    job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    storage: StorageConfig = StorageConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    faults: tuple[FaultConfig, ...] = Field(default=(), strict=False)
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _minimum_fits_the_launch(self) -> JobConfig:
        recovery, launch = self.recovery, self.launch
        if recovery.min_ranks is not None and recovery.min_ranks > launch.nproc:
            raise ValueError(
                f"recovery.min_ranks {recovery.min_ranks} is more than launch.nproc "
                f"{launch.nproc}: a job never runs on more ranks than it was launched with"
            )
        if recovery.min_nodes is not None and recovery.min_nodes > launch.nnodes:
            raise ValueError(
                f"recovery.min_nodes {recovery.min_nodes} is more than launch.nnodes "
                f"{launch.nnodes}: a job never runs on more nodes than it was launched with"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment > overrides (init kwargs) > file > defaults: see the module docstring.
        # A resolved config (``load_resolved``) is final: the environment only fills what it
        # leaves out (credentials).
        if _RESOLVED.get():
            return init_settings, EnvSource(settings_cls)
        path = config_file()
        file = () if path is None else (file_source(settings_cls, path),)
        return EnvSource(settings_cls), init_settings, *file

    @property
    def layout(self) -> JobLayout:
        """Where the job keeps everything on its storage (infra/job_layout.py)."""
        if self.job_id is None:
            raise ValueError("a new job has no id yet: tasks/job_identity.resolve gives it one")
        return JobLayout.for_job(self.storage.root, self.job_id, self.train.compile_cache_url)

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
        """The config as plain data without credentials: safe to log, to store with a
        checkpoint, and to hand to subprocesses (which take credentials from their
        environment instead). S3 keys are left out; user:password in the MLflow URI is
        masked (the trainer never talks to MLflow)."""
        secrets = {"storage": {"s3_access_key_id", "s3_secret_access_key"}}
        data = self.model_dump(mode="json", exclude=secrets)
        data["tracking"]["mlflow_uri"] = redact_url(data["tracking"]["mlflow_uri"])
        return data


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> JobConfig:
    """Load a job config from a YAML/TOML file (or the embedded defaults when None).

    ``overrides`` are nested dicts merged over the file, e.g. ``train={"steps": 10}``;
    ETT_* environment variables win over both. Raises ConfigError naming each bad field.
    """
    source = str(path) if path is not None else "embedded defaults"
    try:
        with reading(Path(path) if path is not None else None):
            return JobConfig(**overrides)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, source)) from None
    except SettingsError as exc:  # an ETT_* variable that is not valid JSON where JSON is due
        raise ConfigError(
            f"invalid job config (environment): {exc}; lists and sections given in one "
            "variable are JSON, e.g. ETT_DATA__CAT_VOCAB_SIZES='[50, 20]'"
        ) from None


def load_resolved(path: str | os.PathLike[str]) -> JobConfig:
    """A config that ``dump_config`` wrote for the processes of one job (the torchrun ranks).
    It was resolved already, environment included, so its values win over ETT_* variables;
    those only fill what it leaves out: credentials, which are never written to it."""
    data = file_source(JobConfig, Path(path))()
    token = _RESOLVED.set(True)
    try:
        return JobConfig(**data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, str(path))) from None
    finally:
        _RESOLVED.reset(token)


def config_yaml(config: JobConfig) -> str:
    """A config as YAML, without credentials: what ``dump_config`` writes."""
    return yaml.safe_dump(config.public_dict(), sort_keys=False)


def dump_config(config: JobConfig, path: str | os.PathLike[str]) -> None:
    """Write a config as YAML (without credentials), e.g. to hand one to every torchrun rank."""
    Path(path).write_text(config_yaml(config))
