"""A synthetic click log with a planted ground truth, written as Parquet shards.

Layout under ``url`` (any fsspec URL)::

    train/part-00000.parquet ... train/part-{shards-1}.parquet
    holdout/part-00000.parquet
    _meta.json     schema, row counts, seed, Bayes-optimal AUC and log-loss on the holdout;
                   written last, so its presence marks a complete data set

Columns: ``label`` float32, ``dense`` fixed_size_list<float32>[num_dense], ``cat``
fixed_size_list<int64>[num_cat], ``item`` int64, ``history`` list<int64> (oldest first).
The labels are drawn from a planted click model (trainer/data/click_model.py); the meta records
how well its true logits rank the holdout, the ceiling for any model trained on the data.

Daily windows (``generate_daily``, ``ett generate --daily N``) are data sets of the same
planted world, one per day under ``<root>/dt=YYYY-MM-DD`` (infra/daily_windows.py): the ground
truth comes from the seed alone, the rows of each day from the seed and the date, so a model
warm-started from yesterday's window keeps learning the same click model.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from infra import daily_windows, storage
from infra.settings import DataConfig
from trainer.data.click_model import Planted, plant, sample, sigmoid

log = logging.getLogger(__name__)

META_VERSION = 2  # 2: interest drift and a recency-weighted history term
ROW_GROUP_ROWS = 8192  # the loader reads (and shuffles) shards a few row groups at a time
_CHUNK_ROWS = 65_536  # rows generated at once: bounds memory for big shards
_DICT = ["cat.list.element", "item", "history.list.element"]


def schema(num_dense: int, num_cat: int) -> pa.Schema:
    """The Parquet schema shared by the generator, the Criteo reader and the loader."""
    return pa.schema(
        [
            ("label", pa.float32()),
            ("dense", pa.list_(pa.float32(), num_dense)),
            ("cat", pa.list_(pa.int64(), num_cat)),
            ("item", pa.int64()),
            ("history", pa.list_(pa.int64())),
        ]
    )


def _arrow(values: np.ndarray, dtype: Any, type_: pa.DataType) -> pa.Array:
    """A numpy array as an Arrow array without a copy (pa.array() would import pandas)."""
    values = np.ascontiguousarray(values, dtype=dtype).reshape(-1)
    return pa.Array.from_buffers(type_, values.size, [None, pa.py_buffer(values)])


def to_table(
    label: np.ndarray,
    dense: np.ndarray,
    cat: np.ndarray,
    item: np.ndarray,
    history_offsets: np.ndarray,
    history_values: np.ndarray,
) -> pa.Table:
    """Numpy columns (dense [n, D], cat [n, F], history as offsets [n+1] + values) -> Table."""
    num_dense, num_cat = dense.shape[1], cat.shape[1]
    arrays = [
        _arrow(label, np.float32, pa.float32()),
        pa.FixedSizeListArray.from_arrays(_arrow(dense, np.float32, pa.float32()), num_dense),
        pa.FixedSizeListArray.from_arrays(_arrow(cat, np.int64, pa.int64()), num_cat),
        _arrow(item, np.int64, pa.int64()),
        pa.ListArray.from_arrays(
            _arrow(history_offsets, np.int32, pa.int32()),
            _arrow(history_values, np.int64, pa.int64()),
        ),
    ]
    return pa.Table.from_arrays(arrays, schema=schema(num_dense, num_cat))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ties get average ranks); NaN when only one class is present."""
    labels = np.asarray(labels) > 0.5
    scores = np.asarray(scores, dtype=np.float64)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _write_shard(
    url: str, planted: Planted, data: DataConfig, rng: np.random.Generator, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Generate and write one shard; returns (labels, logits, interaction, uniform-mean
    interaction, history lengths)."""
    sink = pa.BufferOutputStream()
    num_cat = len(data.cat_vocab_sizes)
    out: tuple[list[np.ndarray], ...] = ([], [], [], [], [])
    # Dictionary-encode the id columns only (Zipf ids compress well; random floats do not).
    with pq.ParquetWriter(sink, schema(data.num_dense, num_cat), use_dictionary=_DICT) as writer:
        for start in range(0, rows, _CHUNK_ROWS):
            cols, logit, inter, uniform = sample(planted, data, rng, min(_CHUNK_ROWS, rows - start))
            writer.write_table(to_table(**cols), row_group_size=ROW_GROUP_ROWS)
            for acc, x in zip(
                out,
                (cols["label"], logit, inter, uniform, np.diff(cols["history_offsets"])),
                strict=True,
            ):
                acc.append(x)
    storage.write_bytes(url, sink.getvalue().to_pybytes())
    labels, logits, inter, uniform, lens = (np.concatenate(acc) for acc in out)
    return labels, logits, inter, uniform, lens


def files_to_write(data: DataConfig) -> int:
    """Parquet files one data set has (train shards + the holdout): the steps of progress."""
    return data.generator.shards + 1


def generate(
    data: DataConfig,
    url: str | None = None,
    *,
    day: date | None = None,
    on_file: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write the synthetic data set for ``data`` (to ``url``, default ``data.url``); returns
    the meta also written to ``{url}/_meta.json``. Deterministic from data.generator.seed
    (and ``day``: the rows of a daily window). ``on_file`` is called after each file."""
    gen = data.generator
    stream = [day.toordinal()] if day is not None else []  # the same world, other rows
    done = on_file or (lambda: None)
    url = (url or data.url).rstrip("/")
    if gen.shards > gen.rows:
        raise ValueError(f"generator.shards={gen.shards} exceeds generator.rows={gen.rows}")
    t0 = time.perf_counter()
    planted = plant(data)
    seed = gen.seed & 0xFFFF_FFFF_FFFF_FFFF
    shard_rows = [gen.rows // gen.shards + (i < gen.rows % gen.shards) for i in range(gen.shards)]
    train_files, lengths = [], []
    for i, rows in enumerate(shard_rows):
        name = f"train/part-{i:05d}.parquet"
        t = time.perf_counter()
        rng = np.random.default_rng([seed, 1, i, *stream])
        *_, lens = _write_shard(storage.join(url, name), planted, data, rng, rows)
        done()
        lengths.append(lens)
        train_files.append(name)
        log.info(
            "synthetic: wrote %s (%d rows, %.2f s) [%d/%d]",
            storage.join(url, name),
            rows,
            time.perf_counter() - t,
            i + 1,
            gen.shards,
        )
    name = "holdout/part-00000.parquet"
    t = time.perf_counter()
    rng = np.random.default_rng([seed, 2, 0, *stream])
    labels, logits, inter, uniform, _ = _write_shard(
        storage.join(url, name), planted, data, rng, gen.holdout_rows
    )
    done()
    log.info(
        "synthetic: wrote %s (%d rows, %.2f s)",
        storage.join(url, name),
        gen.holdout_rows,
        time.perf_counter() - t,
    )
    probs = sigmoid(logits)
    all_lens = np.concatenate(lengths)
    meta: dict[str, Any] = {
        "version": META_VERSION,
        "format": "parquet",
        "generator": "trainer.data.synthetic",
        "num_dense": data.num_dense,
        "cat_vocab_sizes": list(data.cat_vocab_sizes),
        "item_vocab_size": data.item_vocab_size,
        "seed": gen.seed,
        "window": day.isoformat() if day is not None else None,
        "generator_config": gen.model_dump(mode="json"),
        "train_rows": gen.rows,
        "holdout_rows": gen.holdout_rows,
        "files": {"train": train_files, "holdout": [name]},
        "shard_rows": shard_rows,
        "bayes_auc": roc_auc(labels, probs),
        "bayes_logloss": log_loss(labels, probs),
        # The true logit with the history/item term dropped: not a bound for history-free
        # models, but shows how much of the signal the history carries.
        "auc_without_history_term": roc_auc(labels, logits - inter),
        # The true logit with the recency weights replaced by a plain mean over the history:
        # about what a mean-pooling history tower can reach at best.
        "auc_uniform_history_mean": roc_auc(labels, logits - inter + uniform),
        "holdout_positive_rate": float(labels.mean()),
        "history": {
            "mean_len": float(all_lens.mean()),
            "empty_frac": float((all_lens == 0).mean()),
            "max_len": int(all_lens.max()),
            "longer_than_max_history_len_frac": float((all_lens > data.max_history_len).mean()),
        },
        "seconds": round(time.perf_counter() - t0, 3),
    }
    storage.write_text(storage.join(url, "_meta.json"), json.dumps(meta, indent=2))
    log.info(
        "synthetic: %d train + %d holdout rows at %s in %.1f s; Bayes AUC %.4f, log-loss %.4f",
        gen.rows,
        gen.holdout_rows,
        url,
        meta["seconds"],
        meta["bayes_auc"],
        meta["bayes_logloss"],
    )
    return meta


def generate_daily(
    data: DataConfig,
    root: str,
    days: int,
    *,
    last: date | None = None,
    on_file: Callable[[], None] | None = None,
) -> list[tuple[str, bool]]:
    """Daily windows for the ``retrain`` flow: ``days`` data sets under ``root``, one per day
    up to ``last`` (default: today, UTC), each a complete ``dt=YYYY-MM-DD`` partition. A
    complete window is left as it is. Returns (url, written) per window, oldest first."""
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    last = last or datetime.now(UTC).date()
    tick = on_file or (lambda: None)
    out: list[tuple[str, bool]] = []
    for back in range(days - 1, -1, -1):
        day = last - timedelta(days=back)
        url = storage.join(root, daily_windows.partition_name(day))
        if storage.exists(storage.join(url, "_meta.json")):
            log.info("synthetic: %s is complete already: kept", url)
            for _ in range(files_to_write(data)):
                tick()
            out.append((url, False))
            continue
        generate(data, url, day=day, on_file=tick)
        out.append((url, True))
    return out
