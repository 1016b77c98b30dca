"""Every tensor of a checkpoint written by N ranks under one sharding plan comes back the
same on M ranks under another (issue 29): the tables, their fused optimizer state (exact
Adagrad's per-element sums, keyed by table as TorchRec shards them), the dense model and its
Adam state. Each case trains two steps on N gloo ranks, saves, loads on M ranks under the
plan given, saves again; the two checkpoints, read whole, must be equal tensor for tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torchrec.distributed.types import ShardingType

from infra.devstack.servers import free_port
from infra.settings import JobConfig
from tests.factories import checkpoint_tensors, tiny_config
from trainer.checkpoint.restore import load_resharded
from trainer.checkpoint.state import CheckpointStates, train_states
from trainer.data.batch import Batch


class _Position:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _batch(config: JobConfig, seed: int, rows: int = 16) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    data = config.data
    cat = torch.stack(
        [torch.randint(0, v, (rows,), generator=gen) for v in data.cat_vocab_sizes], dim=1
    )
    lengths = torch.randint(0, 4, (rows,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return Batch(
        dense=torch.randn(rows, data.num_dense, generator=gen),
        cat=cat,
        item=torch.randint(0, data.item_vocab_size, (rows,), generator=gen),
        history_values=torch.randint(0, data.item_vocab_size, (int(offsets[-1]),), generator=gen),
        history_offsets=offsets,
        labels=torch.randint(0, 2, (rows,), generator=gen).float(),
    )


def _rank(
    rank: int, world: int, port: int, config: JobConfig, kind: str, src: tuple, dst: str
) -> None:
    """One rank: build the sharded model under ``kind``; train and save to ``dst`` (no
    ``src``), or load ``src`` = (path, ranks that wrote it) as a restore does and save what
    it loaded to ``dst``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    from trainer.distributed import (
        build_host_model,
        init_process_group,
        shard_train_module,
        sharding_plan,
    )
    from trainer.train import train_step

    env = init_process_group(torch.device("cpu"), "gloo")
    try:
        host = build_host_model(config)
        plan = sharding_plan(host, env, (ShardingType(kind),))
        model, optimizer = shard_train_module(config, env, host, plan)
        states = CheckpointStates(train_states(model, optimizer, _Position(), rank))
        if not src:
            for step in range(2):
                train_step(model, optimizer, _batch(config, 100 * step + rank), env.device)
        else:
            target = states.load_target()
            load_resharded(target, src[0], rank, src[1], None)
            states.load(target)
        tensors, _ = states.read()
        dcp.save(tensors, checkpoint_id=dst)
    finally:
        dist.destroy_process_group()


def _run(world: int, config: JobConfig, kind: str, src: tuple, dst: str) -> None:
    mp.spawn(_rank, args=(world, free_port(), config, kind, src, dst), nprocs=world, join=True)


# The sharding types TorchRec's planner allows on a CPU (gloo) for these tables: table-wise
# (the trainer's) and column-wise (row-wise is GPU-only for the bag collection here).
CASES = [  # (N, plan writing it), (M, plan reading it)
    ((2, "table_wise"), (1, "table_wise")),
    ((1, "table_wise"), (2, "table_wise")),
    ((2, "column_wise"), (1, "table_wise")),
    ((1, "table_wise"), (2, "column_wise")),
]


@pytest.mark.parametrize(("written", "read"), CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_tables_optimizer_and_dense_state_reshard_exactly(tmp_path: Path, written, read) -> None:
    config = tiny_config(tmp_path)
    first, second = str(tmp_path / "written"), str(tmp_path / "reloaded")
    _run(written[0], config, written[1], (), first)
    _run(read[0], config, read[1], (first, written[0]), second)
    saved, loaded = checkpoint_tensors(f"file://{first}"), checkpoint_tensors(f"file://{second}")
    keys = {k for k in saved if not k.startswith("rng_")}
    assert keys <= loaded.keys()
    assert any(k.startswith("optim.state.sparse_arch") for k in keys), sorted(keys)[:10]
    assert any(k.startswith("optim.state.interaction") for k in keys), sorted(keys)[:10]
    assert any(float(saved[k].abs().sum()) > 0 for k in keys if k.startswith("optim.state.sparse"))
    differing = [k for k in keys if not torch.equal(saved[k], loaded[k])]
    assert differing == []
