"""Process group, device and the sharded train module (DistributedModelParallel + optimizers).

The trainer always runs in a process group, even alone (world size 1), so one code path
covers a laptop run and a torchrun job across nodes: gloo on CPU, NCCL on GPU. Embedding
tables are sharded by DistributedModelParallel and trained by TorchRec's fused optimizer
(applied inside the backward pass); dense parameters use a regular optimizer.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from infra.settings import JobConfig
from trainer.model import RankingModel


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def select_device(backend_choice: str) -> tuple[torch.device, str]:
    """GPU + NCCL when a GPU is present (unless gloo is forced), else CPU + gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and backend_choice != "gloo":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if backend_choice == "nccl":
        raise RuntimeError("train.backend=nccl needs a GPU, and none is visible")
    return torch.device("cpu"), "gloo"


def init_process_group(device: torch.device, backend: str, timeout_s: float = 600) -> DistEnv:
    """Join the job's process group (torchrun's env), or form a group of one when run alone."""
    if "RANK" not in os.environ:  # plain `python -m trainer`: a single-process job
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        device=device,
        backend=backend,
    )


def sharding_plan(model: torch.nn.Module, env: DistEnv) -> ShardingPlan:
    """Table-wise sharding for every table: each table lives whole on one rank, its rows
    updated by the fused optimizer there (small tables are not replicated data-parallel,
    so every table has exactly one copy and one optimizer state to checkpoint)."""
    tables = [name for name, _ in model.named_parameters() if name.endswith(".weight")]
    constraints = {
        name.rsplit(".", 2)[-2]: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value]
        )
        for name in tables
        if "embedding" in name
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(
            world_size=env.world_size,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)),
            compute_device=env.device.type,
        ),
        constraints=constraints,
    )
    return planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)


def build_train_module(
    config: JobConfig, env: DistEnv
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The sharded model and one optimizer object covering sparse (fused) and dense params.

    Seeded so every rank builds identical dense weights and a run is repeatable.
    """
    torch.manual_seed(config.train.seed)
    # Tables on "meta": DMP allocates only each rank's shards. Dense layers are built on the
    # CPU from the seed (identical on every rank) and moved to the device by DMP.
    model = RankingModel(config.data, config.model, device=torch.device("meta"))
    sparse_params = [
        *model.sparse_arch.parameters(),
        *model.history_tower.items.parameters(),
    ]
    # Exact Adagrad: on fbgemm's CPU kernels its fused backward measured ~20x faster than
    # row-wise Adagrad (8 ms vs 160+ ms per step for the demo tables); GPUs do either well.
    apply_optimizer_in_backward(torch.optim.Adagrad, sparse_params, {"lr": config.train.sparse_lr})
    plan = sharding_plan(model, env)
    dmp = DistributedModelParallel(module=model, device=env.device, plan=plan)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(
        dense, lambda params: torch.optim.Adam(params, lr=config.train.dense_lr)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])
