"""Where a data set's files are: the layout the trainer reads and the orchestrator checks.

    {data.url}/train/*.parquet     the training shards (``format: criteo``: ``*.tsv``)
    {data.url}/holdout/*.parquet   the holdout split, read by evaluation and publishing
    {data.url}/_meta.json          schema and row counts, written last (synthetic data)

Here, not in the trainer, because the orchestrator checks that a job's data exists before it
starts torchrun (infra/preflight.py) and must not import the trainer.
"""

from __future__ import annotations

from infra import storage
from infra.settings import DataConfig

META = "_meta.json"
TRAIN, HOLDOUT = "train", "holdout"


def shard_pattern(data: DataConfig, split: str = TRAIN) -> str:
    """The glob pattern of a split's shards."""
    ext = "tsv" if data.format == "criteo" else "parquet"
    return storage.join(data.url, split, f"*.{ext}")


def list_shards(data: DataConfig, split: str = TRAIN) -> list[str]:
    """The URLs of a split's shards, sorted; empty when there are none."""
    return storage.glob(shard_pattern(data, split))
