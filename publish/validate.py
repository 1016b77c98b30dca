"""Validation of an exported model before anything is registered.

On the first ``holdout_rows`` rows of the job's holdout split (the same rows every time, so
a champion is re-scored on exactly the rows its challenger saw):

- parity: the exported pyfunc, loaded back from MLflow, against the trainer-side evaluation
  (``trainer.holdout_metrics.predict`` on the loaded RankingModel): max |diff| <= tolerance;
- sanity: no NaN/inf prediction, both classes present, mean predicted CTR within
  ``calibration_ratio`` of the observed CTR, optional AUC floor;
- quality: holdout AUC and log-loss (recorded; compared with the champion at registration).

The numbers are logged as ``publish/*`` (``Validation.metrics``, rounded as shown) on the
exported model with the dataset ``holdout[:rows]``: the trainer's own ``eval/auc`` is on
``train.eval_rows`` rows of the same split, so the two differ by sampling noise.

This is the project's own gate rather than ``mlflow.models.evaluate`` +
``validate_evaluation_results``; docs/publishing.md says why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.data.meta_dataset import MetaDataset

from infra.settings import JobConfig
from infra.tracking import metrics as names
from infra.tracking.run_metadata import holdout_dataset
from publish import serving
from publish.settings import PublishError, PublishSettings
from trainer.data.batch import Batch
from trainer.data.sequential import holdout_batches
from trainer.holdout_metrics import auc_and_logloss, predict

_NAMES = {"rows": "holdout_rows", "auc": "holdout_auc", "logloss": "holdout_logloss"}
_COUNTS = ("rows", "nonfinite_predictions")


@dataclass
class Holdout:
    batches: list[Batch]
    frame: pd.DataFrame  # the same rows as serving input
    labels: torch.Tensor
    data_url: str

    @property
    def rows(self) -> int:
        return int(self.labels.numel())

    def dataset(self) -> MetaDataset:
        """These rows as an MLflow dataset (``holdout[:rows]``)."""
        return holdout_dataset(self.data_url, self.rows)


@dataclass(frozen=True)
class Validation:
    rows: int
    auc: float
    logloss: float
    mean_prediction: float
    observed_ctr: float
    parity_max_abs_diff: float
    nonfinite_predictions: int

    def metrics(self) -> dict[str, float]:
        """The numbers as logged and shown: ``publish/holdout_auc`` (five significant
        digits), ``publish/parity_max_abs_diff`` (three), ``publish/holdout_rows``..."""
        out = {}
        for k, v in asdict(self).items():
            if k in _COUNTS:
                value = float(v)
            elif k == "parity_max_abs_diff" and math.isfinite(v):
                value = float(f"{v:.3g}")
            else:
                value = names.score(v)
            out[f"{names.PUBLISH}{_NAMES.get(k, k)}"] = value
        return out


def load_holdout(config: JobConfig, settings: PublishSettings) -> Holdout:
    """The first ``holdout_rows`` holdout rows, as trainer batches and as a serving frame."""
    try:
        batches = holdout_batches(config.data, 0, 1, settings.holdout_rows, settings.batch_size)
    except (OSError, ValueError) as exc:
        raise PublishError(f"cannot read the holdout split of {config.data.url}: {exc}") from exc
    if not batches:
        raise PublishError(f"the holdout split of {config.data.url} is empty")
    frame = pd.concat([serving.batch_to_frame(b, config.data) for b in batches], ignore_index=True)
    return Holdout(batches, frame, torch.cat([b.labels for b in batches]), config.data.url)


def auc_and_logloss_of(probs: np.ndarray, labels: torch.Tensor) -> tuple[float, float]:
    """AUC and log-loss of predicted probabilities (a champion re-scored on the gate's rows)."""
    quality = auc_and_logloss(torch.tensor(probs, dtype=torch.float32), labels)
    return quality["auc"], quality["logloss"]


def pyfunc_predictions(model_uri: str, frame: pd.DataFrame) -> np.ndarray:
    """Predictions of a registered/logged pyfunc (loaded from MLflow) for ``frame``."""
    model = mlflow.pyfunc.load_model(model_uri)
    out = model.predict(frame)
    column = out[serving.OUTPUT] if isinstance(out, pd.DataFrame) else out
    return np.asarray(column, dtype=np.float32).reshape(-1)


def evaluate(model: torch.nn.Module, holdout: Holdout, exported_uri: str) -> Validation:
    """Score the trainer-side model and the exported pyfunc on the same holdout rows."""
    trainer_probs = predict(model, holdout.batches, torch.device("cpu")).numpy()
    served = pyfunc_predictions(exported_uri, holdout.frame)
    if served.shape != trainer_probs.shape:
        raise PublishError(
            f"the exported model returned {served.shape[0]} predictions for {holdout.rows} rows"
        )
    finite = np.isfinite(trainer_probs) & np.isfinite(served)
    nonfinite = int((~finite).sum())
    labels = holdout.labels
    if nonfinite or labels.min() == labels.max():
        auc = logloss = float("nan")
    else:
        quality = auc_and_logloss(torch.from_numpy(trainer_probs), labels)
        auc, logloss = quality["auc"], quality["logloss"]
    diff = np.abs(served.astype(np.float64) - trainer_probs.astype(np.float64))
    return Validation(
        rows=holdout.rows,
        auc=auc,
        logloss=logloss,
        mean_prediction=float(np.mean(trainer_probs)) if finite.all() else float("nan"),
        observed_ctr=float(labels.double().mean()),
        parity_max_abs_diff=float(diff.max()) if finite.all() else float("nan"),
        nonfinite_predictions=nonfinite,
    )


def failures(v: Validation, settings: PublishSettings) -> list[str]:
    """Every check that failed, in words (empty: the model may be registered)."""
    out = []
    if v.nonfinite_predictions:
        out.append(
            f"{v.nonfinite_predictions} of {v.rows} holdout predictions are NaN or infinite "
            "(NaN/inf weights in the checkpoint?)"
        )
        return out  # nothing below is meaningful
    if v.parity_max_abs_diff > settings.parity_tolerance:
        out.append(
            f"exported model disagrees with the trainer's eval: max |diff| "
            f"{v.parity_max_abs_diff:.3g} > {settings.parity_tolerance:.3g}"
        )
    if v.observed_ctr in (0.0, 1.0):
        out.append(f"holdout has a single class (observed CTR {v.observed_ctr}): cannot validate")
        return out
    ratio = v.mean_prediction / v.observed_ctr
    bound = settings.calibration_ratio
    if not 1.0 / bound <= ratio <= bound:
        out.append(
            f"miscalibrated: mean predicted CTR {v.mean_prediction:.4f} vs observed "
            f"{v.observed_ctr:.4f} (ratio {ratio:.3f}, allowed [{1 / bound:.3f}, {bound:.3f}])"
        )
    if settings.min_auc is not None and not (v.auc >= settings.min_auc):
        out.append(f"holdout AUC {v.auc:.4f} is below the floor {settings.min_auc:.4f}")
    if math.isnan(v.auc):
        out.append("holdout AUC is undefined")
    return out
