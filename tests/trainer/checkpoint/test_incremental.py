"""Incremental durable checkpoints (trainer/checkpoint/delta.py, compose.py): the rows a step
touches, the config, the chain a job writes, a delta composed over its full base equal to a
full checkpoint of the same step, exact resume from a delta, and a corrupt link that falls
back to the last good one.

The jobs are the tiny model under torchrun: ``reference`` with full checkpoints only, the
others with ``checkpoint.incremental``; each is killed mid-upload of its anchor (step 25),
so its newest commit is the delta at step 20, and relaunched without the fault.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from infra import storage
from infra.checkpoint_manifest import QUARANTINE, CommitKind, committed_checkpoints
from infra.config_sources import ConfigError
from infra.job_layout import JobLayout, step_dir_name
from infra.settings import JobConfig, load_config
from publish import load as publish_load
from tests.factories import (
    assert_bit_identical,
    checkpoint_tensors,
    resume_marks,
    run_trainer,
    tiny_config,
)
from trainer.checkpoint.compose import chain_for, load_chain
from trainer.checkpoint.delta import (
    ROWS_KEY,
    Incremental,
    Link,
    TouchedRows,
    apply_rows,
    embedding_tables,
    leaf_at,
    leaves,
    rows_file,
)
from trainer.model import RankingModel

SECTIONS: dict[str, Any] = {
    "train": {"steps": 25, "eval": "off", "eval_rows": 256, "log_every": 5},
    "checkpoint": {"mode": "async_staged", "every_steps": 5, "keep_latest_k": 10},
}
INCREMENTAL = {"enabled": True, "full_every": 8, "max_delta_share": 1.0}
KILL_AT_ANCHOR = [{"kind": "sigkill_mid_upload", "step": 25}]


def test_touched_rows_are_the_ids_of_each_table_since_the_last_take() -> None:
    touched = TouchedRows({"a": ("t_a", 6), "b": ("t_b", 4), "c": ("t_a", 6)})
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c", "unknown"],
        values=torch.tensor([1, 3, 2, 5, 0, 9]),
        lengths=torch.tensor([1, 1, 1, 0, 1, 0, 1, 1]),  # two examples per key
    )  # a: 1, 3; b: 2; c: 5 (the same table as a); unknown: 0, 9 (no table)
    touched.track([kjt])
    got = touched.take()
    assert got["t_a"].nonzero().flatten().tolist() == [1, 3, 5]
    assert got["t_b"].nonzero().flatten().tolist() == [2]
    assert not any(b.any() for b in touched.take().values())  # taken: start anew


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"full_every": 0}, "checkpoint.incremental.full_every"),
        ({"max_delta_share": 0}, "checkpoint.incremental.max_delta_share"),
        ({"max_delta_share": 1.5}, "checkpoint.incremental.max_delta_share"),
        ("sometimes", "must be true, false or a mapping"),
    ],
)
def test_a_bad_incremental_setting_is_one_line_naming_it(value: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(checkpoint={"incremental": value})
    assert needle in str(err.value)
    assert len(str(err.value).strip().splitlines()) <= 2  # the source, then the one problem


def test_incremental_is_off_by_default_and_true_is_its_short_spelling() -> None:
    assert not load_config().checkpoint.incremental.enabled
    assert load_config(checkpoint={"incremental": "true"}).checkpoint.incremental.enabled


def _job(tmp_path: Path, job_id: str, data_url: str, incremental: bool, **extra: Any) -> JobConfig:
    sections = {**SECTIONS, "checkpoint": dict(SECTIONS["checkpoint"])}
    if incremental:
        sections["checkpoint"]["incremental"] = INCREMENTAL
    return tiny_config(tmp_path, job_id=job_id, data={"url": data_url}, **sections, **extra)


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, data_url: str
) -> Callable[[int], JobConfig]:
    """The job with full checkpoints only, uninterrupted, on ``nproc`` ranks (run once)."""
    done: dict[int, JobConfig] = {}

    def of(nproc: int) -> JobConfig:
        if nproc not in done:
            tmp = tmp_path_factory.mktemp(f"reference-{nproc}proc")
            config = _job(tmp, "reference", data_url, incremental=False)
            ran = run_trainer(config, tmp, nproc=nproc)
            assert ran.returncode == 0, ran.stderr[-3000:]
            done[nproc] = config
        return done[nproc]

    return of


def _killed_at_anchor(tmp_path: Path, job_id: str, data_url: str, nproc: int = 1) -> JobConfig:
    """An incremental job whose first attempt is killed while uploading its anchor."""
    config = _job(tmp_path, job_id, data_url, incremental=True, faults=KILL_AT_ANCHOR)
    killed = run_trainer(config, tmp_path, nproc=nproc)
    assert killed.returncode != 0
    return config


def _relaunch(config: JobConfig, tmp_path: Path, nproc: int = 1) -> Any:
    done = run_trainer(config.model_copy(update={"faults": ()}), tmp_path, nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def composed_tensors(url: str) -> dict[str, torch.Tensor]:
    """Every tensor of a committed checkpoint in one process, a delta composed over its
    chain (as publishing reads one)."""
    [ckpt] = [c for c in committed_checkpoints(_layout(url)) if c.url == url]

    def load_full(link: Any, into: dict[str, Any]) -> dict[str, Any]:
        into.update(checkpoint_tensors(link.url))
        return {}

    state: dict[str, Any] = {}
    load_chain(ckpt, state, 0, None, load_full, no_dist=True)
    return state


def _layout(url: str) -> JobLayout:
    layout = JobLayout.of_checkpoint(url)
    assert layout is not None
    return layout


def _kinds(config: JobConfig) -> dict[int, str]:
    return {c.step: c.manifest.kind for c in committed_checkpoints(config.layout)}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2proc"])
def test_full_and_three_deltas_equal_a_full_checkpoint_and_resume_exactly(
    tmp_path: Path, data_url: str, reference: Callable[[int], JobConfig], nproc: int
) -> None:
    """On 2 ranks each table lives on one of them: every rank ORs its batches' ids with
    the other's, and writes rows only of its own tables."""
    full_job = reference(nproc)
    config = _killed_at_anchor(tmp_path, "incremental", data_url, nproc)
    assert _kinds(config) == {
        5: CommitKind.FULL,
        10: CommitKind.DELTA,
        15: CommitKind.DELTA,
        20: CommitKind.DELTA,
    }
    ckpts = {c.step: c for c in committed_checkpoints(config.layout)}
    assert [c.step for c in chain_for(ckpts[20])] == [5, 10, 15, 20]
    assert ckpts[20].manifest.base_step == 5 and ckpts[20].manifest.previous_step == 15
    assert {rows_file(r) for r in range(nproc)} <= set(ckpts[20].manifest.files)
    assert ckpts[20].manifest.bytes < ckpts[5].manifest.bytes

    full = checkpoint_tensors(committed_checkpoints(full_job.layout)[1].url)  # step 20
    composed = composed_tensors(ckpts[20].url)
    assert composed.keys() == full.keys()
    assert any(".embedding_bags." in k for k in full) and any(k.startswith("optim.") for k in full)
    differing = [k for k in full if not torch.equal(full[k], composed[k])]
    assert differing == []

    # A rank the writer did not have (a resize) reads the job's step from rank 0's state.
    def rank_state(rank: int, world_size: int) -> dict[str, Any]:
        return load_chain(ckpts[20], {}, rank, None, lambda *_: {}, True, world_size)

    assert rank_state(nproc, nproc + 1)["step"] == rank_state(0, nproc)["step"] == 20

    # Publishing (and the side evaluator) read the composed state into one CPU model.
    models = [
        publish_load.load(publish_load.resolve(url), job, str(tmp_path / name)).model.state_dict()
        for url, job, name in [
            (committed_checkpoints(full_job.layout)[1].url, full_job, "full"),
            (ckpts[20].url, config, "delta"),
        ]
    ]
    assert [k for k in models[0] if not torch.equal(models[0][k], models[1][k])] == []

    _relaunch(config, tmp_path, nproc)
    assert resume_marks(config)[-1][1] == 20
    assert_bit_identical(full_job, config, 25)
    assert _kinds(config)[25] == CommitKind.FULL  # an anchor stands alone


@pytest.mark.slow
def test_a_corrupt_link_falls_back_to_the_last_good_link_in_one_line(
    tmp_path: Path, data_url: str, reference: Callable[[int], JobConfig]
) -> None:
    config = _killed_at_anchor(tmp_path, "corrupt-link", data_url)
    link = storage.join(config.layout.checkpoint(15), rows_file(0))
    data = bytearray(storage.read_bytes(link))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(link, bytes(data))

    done = _relaunch(config, tmp_path)
    assert resume_marks(config)[-1][1] == 10  # the last good link before the corrupt one
    output = (done.stdout + done.stderr).splitlines()
    lines = [line for line in output if "falling back" in line]
    assert len(lines) == 1 and "last good link before step 15" in lines[0]
    assert step_dir_name(15) in lines[0]
    moved = storage.listdir(storage.join(config.layout.checkpoints, QUARANTINE))
    assert sorted(name.rsplit("-", 2)[0] for name in moved) == [
        step_dir_name(15),
        step_dir_name(20),
    ]
    assert_bit_identical(reference(1), config, 25)


def _table(rows: int, fill: float) -> ShardedTensor:
    """A one-rank table-wise shard, as DistributedModelParallel's state dict holds a table."""
    meta = ShardMetadata([0, 0], [rows, 2], "rank:0/cpu")
    local = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + fill
    return ShardedTensor._init_from_local_shards([Shard(local, meta)], rows, 2)


def _live_state() -> dict[str, Any]:
    return {
        "model": {"emb.t_a.weight": _table(6, 0.0), "dense.w": torch.zeros(3)},
        "optim": {"state": {"emb.t_a.weight": {"t_a.momentum1": _table(6, 100.0)}}},
    }


def _plan_kinds(incremental: Incremental, plans: list[tuple[int, bool, bool]]) -> list[str]:
    state = _live_state()
    kinds = []
    for step, ok, anchor in plans:
        kinds.append(incremental.plan(step, state, ok, anchor).link.kind)
    return kinds


def test_a_commit_is_full_first_every_k_past_the_share_for_the_anchor_and_after_a_failure(
    group,
) -> None:
    config = load_config(checkpoint={"incremental": {"full_every": 3, "max_delta_share": 0.5}})
    inc = Incremental(config.checkpoint.incremental, {"a": ("t_a", 6)}, 1, group)
    ids = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    full, delta = CommitKind.FULL, CommitKind.DELTA
    inc.track(ids)
    assert _plan_kinds(inc, [(1, True, False), (2, True, False), (3, True, False)]) == [
        full,
        delta,
        delta,
    ]
    assert _plan_kinds(inc, [(4, True, False)]) == [full]  # the 3rd commit since the full one
    assert _plan_kinds(inc, [(5, False, False)]) == [full]  # the save before it failed
    assert _plan_kinds(inc, [(6, True, True)]) == [full]  # an anchor stands alone
    inc.track(
        KeyedJaggedTensor(keys=["a"], values=torch.tensor([0, 1, 2, 3]), lengths=torch.tensor([4]))
    )
    assert _plan_kinds(inc, [(7, True, False)]) == [full]  # 4 of 6 rows > half the table
    inc.reset()  # restored: what was touched since is unknown
    assert _plan_kinds(inc, [(8, True, False)]) == [full]


def test_a_delta_holds_the_touched_rows_of_weights_and_optimizer_state_and_composes_back(
    group,
) -> None:
    config = load_config(checkpoint={"incremental": INCREMENTAL})
    inc = Incremental(config.checkpoint.incremental, {"a": ("t_a", 6)}, 1, group)
    live = _live_state()
    base = inc.plan(1, live, True, False)
    assert base.link.kind == CommitKind.FULL and base.rows is None
    snapshot = {
        path: leaf.local_shards()[0].tensor.clone()
        if isinstance(leaf, ShardedTensor)
        else leaf.clone()
        for path, leaf in leaves(live)
    }
    inc.track(KeyedJaggedTensor(keys=["a"], values=torch.tensor([4, 1]), lengths=torch.tensor([2])))
    for _, leaf in leaves(live):  # the fused optimizer changes the looked-up rows only
        target = leaf.local_shards()[0].tensor if isinstance(leaf, ShardedTensor) else leaf
        if isinstance(leaf, ShardedTensor):
            target[[1, 4]] += 0.5
        else:
            target += 1
    plan = inc.plan(2, live, True, False)
    assert plan.link == Link(CommitKind.DELTA, base_step=1, previous_step=1)
    assert "model.emb.t_a.weight" not in dict(leaves(plan.dense))
    assert "model.dense.w" in dict(leaves(plan.dense))
    assert plan.rows is not None
    assert sorted(plan.rows[ROWS_KEY]) == [
        "model.emb.t_a.weight",
        "optim.state.emb.t_a.weight.t_a.momentum1",
    ]
    restored = _live_state()  # the base's state, as the full checkpoint restores it
    for path, leaf in leaves(restored):
        target = leaf.local_shards()[0].tensor if isinstance(leaf, ShardedTensor) else leaf
        target.copy_(snapshot[path])
    apply_rows(restored, plan.rows)
    for path, leaf in leaves(restored):
        if isinstance(leaf, ShardedTensor):
            want = leaf_at(live, path).local_shards()[0].tensor
            assert torch.equal(leaf.local_shards()[0].tensor, want), path


def test_the_tables_are_read_from_the_model_and_rows_compose_into_plain_tensors() -> None:
    """One process reading every rank's rows (publishing) writes them at each shard's
    offsets into the unsharded model; a part it does not load (the optimizer) is passed
    over."""
    config = tiny_config(Path("/nonexistent"))
    model = RankingModel(config.data, config.model)
    tables = embedding_tables(model)
    assert tables["cat0"] == ("t_cat0", 50) and tables["item"] == ("t_item", 100)
    state = {"model": {"emb.t.weight": torch.zeros(6, 4)}}
    payload = {
        ROWS_KEY: {
            "model.emb.t.weight": {  # two row-wise shards: rows 0-2 and 3-5, all columns
                "0,0": {"ids": torch.tensor([1]), "rows": torch.ones(1, 4)},
                "3,0": {"ids": torch.tensor([0, 2]), "rows": torch.full((2, 4), 2.0)},
            },
            "optim.state.emb.t.weight.t.momentum1": {"0,0": {"ids": torch.tensor([0])}},
        }
    }
    apply_rows(state, payload)
    got = state["model"]["emb.t.weight"][:, 0].tolist()
    assert got == [0.0, 1.0, 0.0, 2.0, 0.0, 2.0]
