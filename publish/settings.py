"""What a publish run may accept: validation bounds and promotion policy.

Defaults come from the environment (``ETT_PUBLISH_CALIBRATION_RATIO=2``, ...) so a Prefect
worker can be tuned without new flow parameters; the CLI and the flow take overrides.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class PublishError(RuntimeError):
    """Publishing stopped; the message says which anchor and why. Nothing was registered."""


class PublishSettings(BaseSettings):
    """Validation bounds and the champion policy of one publish run."""

    model_config = SettingsConfigDict(env_prefix="ETT_PUBLISH_", frozen=True, extra="forbid")

    holdout_rows: int = Field(default=4096, ge=100)
    batch_size: int = Field(default=1024, ge=1)
    # The exported model, loaded back from MLflow, must match the trainer's eval this closely.
    parity_tolerance: float = Field(default=1e-5, gt=0)
    # Mean predicted click probability over observed CTR must lie in [1/ratio, ratio].
    calibration_ratio: float = Field(default=1.5, ge=1.0)
    # Optional floor on holdout AUC (None: no floor; calibration and NaN checks still apply).
    min_auc: float | None = Field(default=None, ge=0.0, le=1.0)
    # Promote to champion when auc >= champion_auc - champion_margin (negative: must improve).
    champion_margin: float = Field(default=0.0, ge=-1.0, le=1.0)
    # Publish only checkpoints whose manifest says anchor (False: any committed checkpoint).
    require_anchor: bool = True
    # The MLflow server to publish to; None: this worker's ETT_TRACKING__MLFLOW_URI (never the
    # checkpoint's config.yaml, which could send the worker's token to another host).
    tracking_uri: str | None = None
    # The registry name; None: the one the job's config names (tracking.registered_model).
    registered_model: str | None = None


def make_settings(overrides: dict[str, Any] | None = None) -> PublishSettings:
    """Settings from the environment with ``overrides`` on top; PublishError on a bad value."""
    try:
        return PublishSettings(**(overrides or {}))
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise PublishError("invalid publish settings: " + "; ".join(lines)) from None
