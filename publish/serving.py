"""The serving model: a plain pandas batch in, click probabilities out (an MLflow pyfunc).

Input columns (one row per impression)::

    dense0 .. dense{D-1}   float   dense features
    cat0 .. cat{F-1}       int     one id per categorical feature, in [0, vocab_f)
    item                   int     the candidate item, in [0, item_vocab_size)
    history                list of int, the user's past items, oldest first (may be empty)

Output: a DataFrame with one float column ``probability``.

The wrapper owns no TorchRec types at its interface: it turns the frame into the trainer's
``Batch`` and runs the same ``RankingModel`` code as training and evaluation, so serving
and the trainer's eval agree to float rounding. Weights are a plain tensor state dict
(``torch.save``), loaded with ``weights_only=True``: loading a model never unpickles code.
MLflow logs this class "from code" (publish/serving_model.py), never as a cloudpickle.
"""

from __future__ import annotations

import json
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.models import ModelSignature
from mlflow.types.schema import Array, ColSpec, DataType, Schema

from infra.settings import DataConfig, ModelConfig
from trainer.data.batch import Batch
from trainer.model import RankingModel, batch_to_kjts, cat_feature_names

WEIGHTS = "weights"  # artifact keys
MODEL_CONFIG = "model_config"
OUTPUT = "probability"
CHUNK_ROWS = 8192


def dense_columns(data: DataConfig) -> list[str]:
    return [f"dense{i}" for i in range(data.num_dense)]


def input_columns(data: DataConfig) -> list[str]:
    return [*dense_columns(data), *cat_feature_names(data), "item", "history"]


def signature(data: DataConfig) -> ModelSignature:
    cols = [ColSpec(DataType.double, name) for name in dense_columns(data)]
    cols += [ColSpec(DataType.long, name) for name in cat_feature_names(data)]
    cols += [ColSpec(DataType.long, "item"), ColSpec(Array(DataType.long), "history")]
    return ModelSignature(inputs=Schema(cols), outputs=Schema([ColSpec(DataType.float, OUTPUT)]))


def batch_to_frame(batch: Batch, data: DataConfig, as_lists: bool = False) -> pd.DataFrame:
    """A trainer Batch as the serving input (``as_lists``: JSON-friendly history lists)."""
    frame: dict[str, Any] = {}
    dense = batch.dense.numpy()
    for i, name in enumerate(dense_columns(data)):
        frame[name] = dense[:, i].astype(np.float64)
    cat = batch.cat.numpy()
    for i, name in enumerate(cat_feature_names(data)):
        frame[name] = cat[:, i].astype(np.int64)
    frame["item"] = batch.item.numpy().astype(np.int64)
    offsets = batch.history_offsets.numpy()
    history = np.split(batch.history_values.numpy().astype(np.int64), offsets[1:-1])
    frame["history"] = [h.tolist() for h in history] if as_lists else history
    return pd.DataFrame(frame)


def _ids(frame: pd.DataFrame, column: str, vocab: int) -> np.ndarray:
    ids = frame[column].to_numpy()
    if ids.dtype.kind not in "iu":
        raise ValueError(f"column {column!r} must hold integer ids, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"column {column!r} has ids outside [0, {vocab})")
    return ids.astype(np.int64)


def frame_to_batch(frame: pd.DataFrame, data: DataConfig) -> Batch:
    """The serving input as a trainer Batch; ValueError naming the column on bad input.

    A history longer than ``data.max_history_len`` keeps its most recent items, as the
    training loader does.
    """
    missing = [c for c in input_columns(data) if c not in frame.columns]
    if missing:
        raise ValueError(f"input is missing columns {missing}")
    dense = frame[dense_columns(data)].to_numpy(dtype=np.float32)
    if not np.isfinite(dense).all():
        raise ValueError("dense columns hold NaN or infinite values")
    cat = (
        np.stack(
            [
                _ids(frame, name, vocab)
                for name, vocab in zip(cat_feature_names(data), data.cat_vocab_sizes, strict=True)
            ],
            axis=1,
        )
        if len(frame)
        else np.zeros((0, len(data.cat_vocab_sizes)), np.int64)
    )
    item = _ids(frame, "item", data.item_vocab_size)
    keep = data.max_history_len
    histories = [np.asarray(h, dtype=np.int64)[-keep:] for h in frame["history"]]
    lengths = np.array([h.size for h in histories], dtype=np.int64)
    values = np.concatenate(histories) if histories else np.zeros(0, np.int64)
    if values.size and (values.min() < 0 or values.max() >= data.item_vocab_size):
        raise ValueError(f"column 'history' has ids outside [0, {data.item_vocab_size})")
    offsets = np.zeros(len(histories) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Batch(
        dense=torch.tensor(dense),  # a copy: pandas may hand out read-only arrays
        cat=torch.from_numpy(np.ascontiguousarray(cat)),
        item=torch.from_numpy(item),
        history_values=torch.from_numpy(values),
        history_offsets=torch.from_numpy(offsets),
        labels=torch.zeros(len(frame), dtype=torch.float32),
    )


def save_model_config(data: DataConfig, model: ModelConfig, path: str) -> None:
    with open(path, "w") as fh:
        raw = {"data": data.model_dump(mode="json"), "model": model.model_dump(mode="json")}
        json.dump(raw, fh)


def load_model_config(path: str) -> tuple[DataConfig, ModelConfig]:
    with open(path) as fh:
        raw = json.load(fh)
    return DataConfig(**raw["data"]), ModelConfig(**raw["model"])


def build_model(config_path: str, weights_path: str) -> tuple[RankingModel, DataConfig]:
    """The exported model, rebuilt from its artifacts (weights loaded with weights_only)."""
    data, model_config = load_model_config(config_path)
    model = RankingModel(data, model_config, device=torch.device("cpu"))
    state = torch.load(weights_path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return model, data


@torch.no_grad()
def predict_frame(model: RankingModel, data: DataConfig, frame: pd.DataFrame) -> np.ndarray:
    """Click probabilities (float32) for every row of ``frame``, in order."""
    out = []
    for start in range(0, len(frame), CHUNK_ROWS):
        batch = frame_to_batch(frame.iloc[start : start + CHUNK_ROWS], data)
        sparse, history = batch_to_kjts(batch)
        out.append(torch.sigmoid(model(batch.dense, sparse, history)).float().numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)


class RankingPyfunc(mlflow.pyfunc.PythonModel):
    """``predict(DataFrame) -> DataFrame[probability]`` around the exported RankingModel."""

    def load_context(self, context: Any) -> None:
        self.model, self.data = build_model(
            context.artifacts[MODEL_CONFIG], context.artifacts[WEIGHTS]
        )

    # No type hints on predict: MLflow would validate against them instead of the signature.
    def predict(self, context, model_input, params=None):
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        return pd.DataFrame({OUTPUT: predict_frame(self.model, self.data, frame)})
