"""The serving wrapper's input handling, without servers: frame <-> Batch, bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from infra.checkpoint_manifest import Manifest
from infra.settings import DataConfig, ModelConfig
from publish import serving
from publish.load import AnchorRef
from publish.settings import PublishError, make_settings
from trainer.data.batch import Batch
from trainer.model import RankingModel, batch_to_kjts

DATA = DataConfig(num_dense=3, cat_vocab_sizes=(5, 7), item_vocab_size=11, max_history_len=4)
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8,), attention_heads=1)


def _batch() -> Batch:
    return Batch(
        dense=torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.125]]),
        cat=torch.tensor([[1, 6], [4, 0]]),
        item=torch.tensor([3, 10]),
        history_values=torch.tensor([1, 2, 3]),
        history_offsets=torch.tensor([0, 0, 3]),
        labels=torch.zeros(2),
    )


def test_frame_round_trips_to_the_same_batch() -> None:
    batch = _batch()
    frame = serving.batch_to_frame(batch, DATA, as_lists=True)
    assert list(frame.columns) == serving.input_columns(DATA)
    assert frame["history"].tolist() == [[], [1, 2, 3]]
    back = serving.frame_to_batch(frame, DATA)
    for name in ("dense", "cat", "item", "history_values", "history_offsets"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name


def test_long_history_keeps_the_most_recent_items() -> None:
    frame = serving.batch_to_frame(_batch(), DATA, as_lists=True)
    frame.at[1, "history"] = [9, 8, 7, 6, 5, 4]
    back = serving.frame_to_batch(frame, DATA)
    assert back.history_values.tolist() == [7, 6, 5, 4]
    assert back.history_offsets.tolist() == [0, 0, 4]


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [("cat1", 7, "cat1.*outside"), ("item", -1, "item.*outside"), ("dense0", np.nan, "NaN")],
)
def test_bad_input_is_named(column: str, value: float, message: str) -> None:
    frame = serving.batch_to_frame(_batch(), DATA, as_lists=True)
    frame[column] = (
        frame[column].astype(type(value)) if column.startswith("dense") else frame[column]
    )
    frame.at[0, column] = value
    with pytest.raises(ValueError, match=message):
        serving.frame_to_batch(frame, DATA)


def test_missing_column_is_named() -> None:
    frame = serving.batch_to_frame(_batch(), DATA).drop(columns=["item"])
    with pytest.raises(ValueError, match="missing columns \\['item'\\]"):
        serving.frame_to_batch(frame, DATA)


def test_exported_weights_reload_with_weights_only(tmp_path) -> None:
    from publish.load import plain_state_dict

    torch.manual_seed(0)
    model = RankingModel(DATA, MODEL).eval()
    weights, config = tmp_path / "weights.pt", tmp_path / "model_config.json"
    torch.save(plain_state_dict(model), weights)
    serving.save_model_config(DATA, MODEL, str(config))
    rebuilt, data = serving.build_model(str(config), str(weights))
    batch = _batch()
    with torch.no_grad():
        want = torch.sigmoid(model(batch.dense, *batch_to_kjts(batch))).numpy()
    got = serving.predict_frame(rebuilt, data, serving.batch_to_frame(batch, DATA))
    assert np.abs(got - want).max() <= 1e-6
    assert serving.predict_frame(
        rebuilt, data, pd.DataFrame(columns=serving.input_columns(DATA))
    ).shape == (0,)


def test_anchor_key_and_job_url() -> None:
    manifest = Manifest(step=20, world_size=2, config_hash="h", files={}, anchor=True, job_id="j")
    ref = AnchorRef("s3://b/jobs/j/checkpoints/step-000000020/", manifest, "a" * 64)
    assert ref.layout.url == "s3://b/jobs/j"
    assert ref.key == AnchorRef(ref.uri.rstrip("/"), manifest, "a" * 64).key
    assert ref.key != AnchorRef(ref.uri, manifest, "b" * 64).key
    assert AnchorRef("file:///x/step-1", manifest, "a" * 64).layout is None


def test_bad_settings_are_publish_errors() -> None:
    with pytest.raises(PublishError, match="calibration_ratio"):
        make_settings({"calibration_ratio": 0.5})
