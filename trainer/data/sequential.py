"""A split read whole, in file order, in one process: the holdout for evaluation and publishing.

No shuffling, no position to resume and no process group: rows come shard after shard as the
files hold them, so every process that reads the first N holdout rows reads the same rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from infra import storage
from infra.settings import DataConfig
from trainer.data.batch import Batch
from trainer.data.decode import DataError
from trainer.data.rows import Rows, rebatch
from trainer.data.shards import ShardReader, check_dataset, list_shards

log = logging.getLogger(__name__)


def _rows(data: DataConfig, split: str, max_rows: int | None) -> Iterator[Rows]:
    """Good rows of a split in file order, at most ``max_rows``."""
    check_dataset(data)
    reader = ShardReader(data)
    counts = {"bad_rows": 0, "truncated_histories": 0}
    got = 0
    for url in list_shards(data, split):
        for rows in reader.read(url, None, 0, counts):
            if max_rows is not None and got + len(rows) >= max_rows:
                yield rows.slice(0, max_rows - got)
                return
            got += len(rows)
            yield rows


def stream_batches(
    data: DataConfig,
    split: str = "holdout",
    batch_size: int | None = None,
    max_rows: int | None = None,
) -> Iterator[Batch]:
    """Batches of a whole split; batches span shard boundaries, only the last may be short."""
    for rows in rebatch(_rows(data, split, max_rows), batch_size or data.eval_batch_size):
        yield rows.to_batch()


def holdout_batches(
    data: DataConfig, rank: int, world_size: int, rows: int, batch_size: int
) -> list[Batch]:
    """This rank's part of the first ``rows`` good holdout rows: rows rank::world_size, after
    trimming to a multiple of world_size, so every rank gets the same number of batches."""
    parts = [p for p in _rows(data, "holdout", rows) if len(p)]
    if not parts:
        raise DataError(f"no usable holdout rows under {storage.join(data.url, 'holdout')}")
    every = Rows.concat(parts)
    n = len(every) // world_size * world_size
    if n == 0:
        raise DataError(f"{len(every)} holdout rows cannot be split over {world_size} ranks")
    if n < rows:
        log.info(
            "data: holdout has %d usable rows of the %d asked for; using %d", len(every), rows, n
        )
    mine, _ = every.take(np.arange(rank, n, world_size))
    return [part.to_batch() for part in rebatch([mine], batch_size)]
