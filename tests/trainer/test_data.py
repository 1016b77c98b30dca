"""The data layer: synthetic generator, Criteo reader, resumable sharded loader, holdout."""

from __future__ import annotations

import json
import logging
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from infra import storage
from infra.config_sources import ConfigError
from infra.settings import DataConfig, GeneratorConfig
from trainer.data import criteo, synthetic
from trainer.data.decode import DataError
from trainer.data.loader import TrainLoader
from trainer.data.sequential import holdout_batches, stream_batches
from trainer.data.shards import check_meta
from trainer.data.synthetic import generate, roc_auc


def _config(url: str, rows: int = 1200, shards: int = 3, holdout: int = 300, **kw) -> DataConfig:
    gen = GeneratorConfig(rows=rows, holdout_rows=holdout, shards=shards, seed=kw.pop("seed", 7))
    return DataConfig(url=url, generator=gen, **{"batch_size": 64, **kw})


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of many small row groups, so the loader's windows and group shuffle matter."""
    monkeypatch.setattr(synthetic, "ROW_GROUP_ROWS", 50)


def _keys(batch) -> list[float]:
    """Each synthetic row is identified by its first dense value (continuous, so unique)."""
    return batch.dense[:, 0].tolist()


def _read_table(url: str) -> pa.Table:
    with storage.open_file(url) as fh:
        return pq.ParquetFile(fh).read()


def _same(a, b) -> bool:
    return all(
        torch.equal(getattr(a, f), getattr(b, f))
        for f in ("dense", "cat", "item", "history_values", "history_offsets", "labels")
    )


# --- synthetic generator ---------------------------------------------------------------------


def test_generate_is_deterministic_from_the_seed(tmp_path):
    metas = [
        generate(_config(f"file://{tmp_path}/{name}", seed=seed))
        for name, seed in (("a", 1), ("b", 1), ("c", 2))
    ]
    files = ["train/part-00000.parquet", "train/part-00002.parquet", "holdout/part-00000.parquet"]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
        assert (tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes()
    assert metas[0]["bayes_auc"] == metas[1]["bayes_auc"] != metas[2]["bayes_auc"]
    assert sorted(p.name for p in (tmp_path / "a" / "train").iterdir()) == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]


def test_generated_columns_ranges_and_history_skew():
    url = f"memory://{uuid.uuid4().hex}"
    data = _config(url, rows=3000, shards=2)
    meta = generate(data)
    assert json.loads(storage.read_text(f"{url}/_meta.json")) == meta
    assert (meta["train_rows"], meta["holdout_rows"]) == (3000, 300)
    assert (meta["num_dense"], meta["cat_vocab_sizes"], meta["item_vocab_size"]) == (
        13,
        list(data.cat_vocab_sizes),
        5000,
    )
    t = _read_table(f"{url}/train/part-00000.parquet")
    assert t.schema == synthetic.schema(13, len(data.cat_vocab_sizes))
    assert t.num_rows == 1500
    cat = np.array(t["cat"].to_pylist())
    assert (cat >= 0).all() and (cat < np.array(data.cat_vocab_sizes)).all()
    # Zipf: the most frequent id of the biggest vocabulary takes a large share of the rows.
    assert Counter(cat[:, 0].tolist()).most_common(1)[0][1] > 0.1 * t.num_rows
    items = np.array(t["item"].to_pylist())
    assert items.min() >= 0 and items.max() < 5000
    lengths = np.array([len(h) for h in t["history"].to_pylist()])
    assert 12 < lengths.mean() < 20  # mean_history_len=16
    assert (lengths == 0).sum() > 0  # some users have no history
    assert lengths.max() > 4 * lengths.mean()  # skewed: a long tail
    assert meta["history"]["empty_frac"] > 0
    assert set(np.unique(t["label"].to_pylist())) == {0.0, 1.0}


def test_bayes_auc_is_sane_and_history_carries_signal(tmp_path):
    meta = generate(_config(f"file://{tmp_path}", rows=2000, shards=1, holdout=40_000))
    assert 0.75 <= meta["bayes_auc"] <= 0.86
    # Without the history/item term the truth ranks clearly worse: the history matters.
    assert meta["auc_without_history_term"] < meta["bayes_auc"] - 0.04
    # Order matters too: a plain mean of the history loses part of that signal.
    assert (
        meta["auc_without_history_term"]
        < meta["auc_uniform_history_mean"]
        < meta["bayes_auc"] - 0.01
    )
    assert 0.3 < meta["bayes_logloss"] < 0.65
    assert 0.1 < meta["holdout_positive_rate"] < 0.45


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = np.round(rng.random(300), 1)  # many ties
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert roc_auc(labels, scores) == pytest.approx(pairs)
    assert roc_auc(labels, -scores) == pytest.approx(1 - pairs)


# --- loader: order, resume, sharding ---------------------------------------------------------


class _Rows:
    """A loader's stream of row keys; ``take(rows)`` is the next ``rows`` of them (a whole
    epoch when rows is the data set's row count). Global batches may cross an epoch's end,
    so the rows past it are kept for the next call."""

    def __init__(self, loader: TrainLoader) -> None:
        self.loader, self.held = loader, []

    def take(self, rows: int) -> list[float]:
        while len(self.held) < rows:
            self.held += _keys(next(self.loader))
        keys, self.held = self.held[:rows], self.held[rows:]
        return keys


def test_each_epoch_covers_every_row_once_in_a_new_order(tmp_path, small_groups):
    data = _config(f"file://{tmp_path}", rows=1000, shards=3, batch_size=50)
    generate(data)
    loader = TrainLoader(data, rank=0, world_size=1, seed=3, window_rows=120)
    rows = _Rows(loader)
    e0, e1 = rows.take(1000), rows.take(1000)
    assert len(set(e0)) == 1000 and set(e0) == set(e1)
    assert e0 != e1  # reshuffled per epoch
    assert loader.state_dict()["epoch"] == 1
    unshuffled = TrainLoader(data.model_copy(update={"shuffle": False}), 0, 1, seed=3)
    plain = _Rows(unshuffled)
    u0, u1 = plain.take(1000), plain.take(1000)
    assert u0 == u1 != e0 and set(u0) == set(e0)
    # Rows are permuted within a shard, not just row groups / shards: almost no two rows
    # handed out one after the other are neighbours in the file.
    index = {k: i for i, k in enumerate(u0)}
    assert np.mean([index[b] == index[a] + 1 for a, b in zip(e0[:-1], e0[1:], strict=True)]) < 0.05
    first_shard = [d[0] for d in _read_table(unshuffled.shards[0])["dense"].to_pylist()]
    assert u0[:334] == first_shard  # file order without shuffle
    loader.close()
    unshuffled.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_is_exact_across_shard_and_epoch_boundaries(tmp_path, small_groups, prefetch):
    data = _config(f"file://{tmp_path}", rows=700, shards=3, batch_size=48)
    generate(data)
    ref = TrainLoader(data, 0, 1, seed=11, prefetch=prefetch, window_rows=120)
    batches, states = [], []
    for _ in range(40):  # 700 rows / 48 -> ~15 batches an epoch: 2.7 epochs
        batches.append(next(ref))
        states.append(json.loads(json.dumps(ref.state_dict())))
    assert ref.stats["rows"] == sum(len(b) for b in batches) == 40 * 48  # handed out only
    assert ref.stats["batches"] == 40
    ref.close()
    epochs = {s["epoch"] for s in states}
    assert epochs == {0, 1, 2}
    where = [(s["epoch"], s["shard_pos"]) for s in states]
    # Batches that end in another shard than the one before them began in it: they span two.
    spanning = [i for i in range(1, 40) if where[i] != where[i - 1]]
    assert len(spanning) >= 6
    epoch_end = max(i for i, s in enumerate(states) if s["epoch"] == 0)
    cuts = sorted({spanning[0], spanning[1] - 1, 5, epoch_end, epoch_end + 1, spanning[4]})
    for k in cuts:
        resumed = TrainLoader(data, 0, 1, seed=11, prefetch=2 - prefetch, window_rows=120)
        resumed.load_state_dict(states[k])
        for j in range(k + 1, min(k + 8, len(batches))):
            assert _same(next(resumed), batches[j]), f"cut after batch {k}: batch {j} differs"
        resumed.close()


def test_state_is_small_global_and_checked(tmp_path):
    data = _config(f"file://{tmp_path}", rows=300, shards=2)
    generate(data)
    loader = TrainLoader(data, 0, 1, seed=1, prefetch=0)
    next(loader)
    state = loader.state_dict()
    assert set(state) >= {"epoch", "shard_pos", "row_offset"}
    assert not set(state) & {"rank", "world_size"}  # the job's position, not a rank's
    assert all(isinstance(v, int) for v in state.values())
    TrainLoader(data, 1, 2, seed=1).load_state_dict(state)  # any world size continues it
    with pytest.raises(DataError, match="seed"):
        TrainLoader(data, 0, 1, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="row_offset"):
        loader.load_state_dict({**state, "row_offset": -1})
    # A one-rank job's position of version 1 is the same global position; a 2-rank one's is not.
    old = {k: v for k, v in state.items() if k != "version"}
    loader.load_state_dict({**old, "version": 1, "rank": 0, "world_size": 1})
    with pytest.raises(DataError, match="version 1 .world_size=2. is not a global position"):
        loader.load_state_dict({**old, "version": 1, "rank": 0, "world_size": 2})


def _global_batches(data: DataConfig, world_size: int, n: int, start=None) -> list[list[float]]:
    """The next ``n`` global batches as a job of ``world_size`` ranks reads them: the ranks'
    shares put back together in rank order."""
    loaders = [TrainLoader(data, r, world_size, seed=5, window_rows=120) for r in range(world_size)]
    for loader in loaders:
        if start is not None:
            loader.load_state_dict(start)
    out = [[k for loader in loaders for k in _keys(next(loader))] for _ in range(n)]
    states = {json.dumps(loader.state_dict()) for loader in loaders}
    assert len(states) == 1  # every rank holds the same position
    for loader in loaders:
        loader.close()
    return out, json.loads(states.pop())


def _digest(batches: list[list[float]]) -> list[str]:
    import hashlib

    return [hashlib.sha256(np.asarray(sorted(b)).tobytes()).hexdigest()[:16] for b in batches]


def test_global_batches_are_the_same_rows_on_one_rank_and_two(tmp_path, small_groups):
    """A rank's share of global batch b depends only on b, M and its rank: the rows of every
    global batch (their digest) are the same on 1, 2 and 4 ranks, and a job resumed on
    another number of ranks consumes exactly the rows not yet consumed."""
    data = _config(f"file://{tmp_path}", rows=1000, shards=5, batch_size=64)
    generate(data)
    one, _ = _global_batches(data, 1, 40)  # 2.5 epochs
    two, _ = _global_batches(data, 2, 40)
    four, _ = _global_batches(data, 4, 40)
    assert one == two == four  # not only the same set: the same order
    assert _digest(one) == _digest(two)
    assert all(len(b) == 64 for b in one)
    epoch0 = [k for b in one for k in b][:1000]
    everything = [k for b in stream_batches(data, "train", batch_size=1000) for k in _keys(b)]
    assert sorted(epoch0) == sorted(everything)  # an epoch covers every row once
    # 2 ranks to batch 13, 1 rank to batch 27, 2 ranks again to 40: the same 40 batches.
    a, at13 = _global_batches(data, 2, 13)
    b, at27 = _global_batches(data, 1, 14, start=at13)
    c, _ = _global_batches(data, 2, 13, start=at27)
    assert _digest(a + b + c) == _digest(two)
    consumed = [k for batch in a + b + c for k in batch]
    assert len(consumed) == 40 * 64
    assert Counter(Counter(consumed).values()) == Counter(
        Counter(k for x in two for k in x).values()
    )


def test_a_global_batch_the_ranks_cannot_share_evenly_is_refused_in_one_line(tmp_path):
    data = _config(f"file://{tmp_path}", rows=300, shards=2, batch_size=100)
    generate(data)
    with pytest.raises(ConfigError) as info:
        TrainLoader(data, 0, 3, seed=0)
    assert str(info.value) == (
        "data.batch_size=100 (the global batch) cannot be split over world_size=3 ranks: "
        "make it a multiple of the world size"
    )
    assert [len(next(TrainLoader(data, r, 4, seed=0))) for r in range(4)] == [25] * 4


# --- loader: validation ----------------------------------------------------------------------


def _write_rows(url: str, rows: list[dict], num_dense: int = 2, num_cat: int = 2) -> None:
    """A hand-made shard; rows are dicts of label, dense, cat, item, history (None = null)."""
    table = pa.table(
        {k: [r[k] for r in rows] for k in ("label", "dense", "cat", "item", "history")},
        schema=synthetic.schema(num_dense, num_cat),
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_bytes(url, sink.getvalue().to_pybytes())


def _tiny_config(url: str, **kw) -> DataConfig:
    base = {"num_dense": 2, "cat_vocab_sizes": (10, 5), "item_vocab_size": 20, "batch_size": 4}
    return DataConfig(url=url, shuffle=False, **{**base, **kw})


GOOD = {"label": 1.0, "dense": [0.5, -1.0], "cat": [3, 4], "item": 7, "history": [1, 2, 3]}


def test_bad_rows_are_counted_logged_and_skipped(caplog):
    url = f"memory://{uuid.uuid4().hex}"
    rows = [
        GOOD,
        {**GOOD, "label": float("nan")},
        {**GOOD, "label": 2.0},
        {**GOOD, "dense": [float("inf"), 0.0]},
        {**GOOD, "dense": [None, 1.0]},
        {**GOOD, "cat": [10, 0]},  # 10 >= vocab 10
        {**GOOD, "cat": [-1, 0]},
        {**GOOD, "item": 20},
        {**GOOD, "item": None},
        {**GOOD, "history": [1, 25]},
        {**GOOD, "label": 0.0, "history": None},  # a null history is an empty one: fine
        {**GOOD, "label": 0.0, "history": []},
    ]
    _write_rows(f"{url}/train/part-00000.parquet", rows)
    # 9 of 12 rows bad: far above the default limit, which tests/reliability covers.
    data = _tiny_config(url, max_bad_row_fraction=1.0, batch_size=3)  # the 3 good rows
    loader = TrainLoader(data, 0, 1, seed=0, prefetch=0)
    with caplog.at_level(logging.INFO, logger="trainer.data.shards"):
        batch = next(loader)
    assert loader.stats["bad_rows"] == 9
    assert batch.labels.tolist() == [1.0, 0.0, 0.0]
    assert batch.history_offsets.tolist() == [0, 3, 3, 3]
    assert loader.state_dict()["row_offset"] == 12
    text = caplog.text
    assert f"{url}/train/part-00000.parquet row 1: label not 0/1" in text
    assert "row 4: dense not finite" in text
    assert "row 5: cat id out of range" in text and "row 9: history id out of range" in text


def test_a_shard_of_only_bad_rows_raises_naming_the_file():
    url = f"memory://{uuid.uuid4().hex}"
    _write_rows(f"{url}/train/part-00000.parquet", [GOOD] * 3)
    _write_rows(f"{url}/train/part-00001.parquet", [{**GOOD, "item": 99}] * 3)
    loader = TrainLoader(_tiny_config(url), 0, 1, seed=0)
    with pytest.raises(DataError, match="part-00001.parquet: all 3 rows are malformed"):
        for _ in range(5):
            next(loader)
    loader.close()
    storage.write_bytes(f"{url}/train/part-00001.parquet", b"not parquet")
    with pytest.raises(DataError, match="part-00001.parquet: not a readable Parquet file"):
        for _ in range(5):
            next(loader)


def test_history_truncation_keeps_the_most_recent_items(caplog):
    url = f"memory://{uuid.uuid4().hex}"
    rows = [{**GOOD, "history": list(range(n))} for n in (0, 3, 4, 5, 9)]
    _write_rows(f"{url}/train/part-00000.parquet", rows)
    loader = TrainLoader(_tiny_config(url, max_history_len=4, batch_size=5), 0, 1, 0, prefetch=0)
    with caplog.at_level(logging.INFO, logger="trainer.data.shards"):
        batch, _ = next(loader), next(loader)
    assert batch.history_offsets.tolist() == [0, 0, 3, 7, 11, 15]
    assert batch.history_values[7:].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert loader.stats["truncated_histories"] == 4  # two batches, two long rows each
    # Said once, at INFO: the configured cap at work, not a problem to filter for.
    [said] = [r for r in caplog.records if "max_history_len=4" in r.getMessage()]
    assert said.levelno == logging.INFO


def test_meta_mismatch_names_the_field(tmp_path):
    data = _config(f"file://{tmp_path}", rows=200, shards=1)
    generate(data)
    assert check_meta(data)["item_vocab_size"] == 5000
    with pytest.raises(DataError, match="item_vocab_size=5000 but the config has"):
        TrainLoader(data.model_copy(update={"item_vocab_size": 4000}), 0, 1, seed=0)
    with pytest.raises(DataError, match="num_dense"):
        holdout_batches(data.model_copy(update={"num_dense": 4}), 0, 1, 100, 10)
    with pytest.raises(DataError, match="no parquet shards match"):
        TrainLoader(_config(f"file://{tmp_path}/nothing"), 0, 1, seed=0)


# --- Criteo ----------------------------------------------------------------------------------


def _criteo_line(label: str = "1", ints=None, cats=None) -> str:
    ints = ints if ints is not None else ["3", "", "-2"] + ["1"] * 10
    cats = cats if cats is not None else ["68fd1e64", ""] + ["0000000a"] * 24
    return "\t".join([label, *ints, *cats]) + "\n"


def _criteo_config(url: str, **kw) -> DataConfig:
    base = {"batch_size": 8, "shuffle": False}
    return DataConfig(url=url, format="criteo", cat_vocab_sizes=(100,) * 26, **{**base, **kw})


def test_criteo_rows_parse_and_bad_lines_are_skipped(tmp_path, caplog):
    lines = [
        _criteo_line(),
        _criteo_line(label="0"),
        _criteo_line(ints=["x"] + ["1"] * 12),  # line 3: unparsable int
        _criteo_line(cats=["zzzz"] + ["1"] * 25),  # line 4: non-hex
        "1\t2\t3\n",  # line 5: wrong column count
        _criteo_line(label="2"),  # line 6: bad label
        _criteo_line(label="0"),
    ]
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "day_0.tsv").write_text("".join(lines))
    data = _criteo_config(f"file://{tmp_path}", max_bad_row_fraction=1.0, batch_size=3)
    # 4 of 7 bad; a batch of the 3 good ones (a fourth row would be the next epoch's)
    loader = TrainLoader(data, 0, 1, seed=0, prefetch=0)
    with caplog.at_level(logging.WARNING):
        batch = next(loader)
    assert loader.stats["bad_rows"] == 4 and len(batch) == 3
    assert batch.labels.tolist() == [1.0, 0.0, 0.0]
    assert batch.dense[0, :3].tolist() == pytest.approx([np.log1p(3), 0.0, 0.0])
    assert batch.cat[0, :3].tolist() == [int("68fd1e64", 16) % 99 + 1, 0, 10 % 99 + 1]
    assert batch.item.tolist() == [0, 0, 0] and batch.history_offsets.tolist() == [0, 0, 0, 0]
    for n in (3, 4, 5, 6):
        assert f"day_0.tsv:{n}" in caplog.text
    with pytest.raises(ValueError, match="26 entries"):
        TrainLoader(
            _criteo_config(f"file://{tmp_path}").model_copy(update={"cat_vocab_sizes": (10, 10)}),
            0,
            1,
            seed=0,
        )


def test_criteo_resume_is_exact_and_all_bad_file_raises(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "train").mkdir()
    for s in range(2):
        text = "".join(
            _criteo_line(
                str(rng.integers(2)),
                [str(rng.integers(100)) for _ in range(13)],
                [f"{rng.integers(2**32):08x}" for _ in range(26)],
            )
            for _ in range(50)
        )
        (tmp_path / "train" / f"day_{s}.tsv").write_text(text)
    data = _criteo_config(f"file://{tmp_path}").model_copy(update={"shuffle": True})
    ref = TrainLoader(data, 0, 1, seed=4, window_rows=16)
    batches, states = zip(*[(next(ref), ref.state_dict()) for _ in range(20)], strict=True)
    ref.close()
    for k in (3, 6, 13):  # mid-shard, end of a shard, next epoch
        resumed = TrainLoader(data, 0, 1, seed=4, window_rows=16)
        resumed.load_state_dict(states[k])
        assert all(_same(next(resumed), batches[j]) for j in range(k + 1, k + 5))
        resumed.close()
    (tmp_path / "train" / "day_2.tsv").write_text("garbage\n" * 5)
    loader = TrainLoader(data, 0, 1, seed=4)
    with pytest.raises(DataError, match="day_2.tsv: all 5 rows are malformed"):
        for _ in range(50):
            next(loader)
    loader.close()


def test_criteo_reader_on_its_own(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text(_criteo_line() + "bad\n" + _criteo_line(label="0"))
    parsed = list(criteo.read(f"file://{path}", _criteo_config("file://unused")))
    assert [p.bad for p in parsed] == [1]
    assert parsed[0].index.tolist() == [0, 2] and parsed[0].label.tolist() == [1.0, 0.0]


# --- holdout / streaming ---------------------------------------------------------------------


def test_holdout_batches_equal_counts_disjoint_rows(tmp_path):
    data = _config(f"file://{tmp_path}", rows=200, shards=1, holdout=333)
    generate(data)
    per_rank = [holdout_batches(data, r, 2, rows=301, batch_size=40) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 4  # 150 rows each -> 40, 40, 40, 30
    keys = [[k for b in batches for k in _keys(b)] for batches in per_rank]
    assert len(keys[0]) == len(keys[1]) == 150
    assert not set(keys[0]) & set(keys[1])
    first = _keys(next(stream_batches(data, "holdout", batch_size=300)))
    assert keys[0] == first[0:300:2] and keys[1] == first[1:300:2]


def test_stream_batches_reads_everything_without_a_process_group():
    url = f"memory://{uuid.uuid4().hex}"
    data = _config(url, rows=500, shards=3, holdout=120)
    generate(data)
    sizes = [len(b) for b in stream_batches(data, "train", batch_size=128)]
    assert sizes == [128, 128, 128, 116]  # spans shard boundaries
    assert sum(len(b) for b in stream_batches(data, max_rows=50)) == 50
    assert not torch.distributed.is_initialized()
