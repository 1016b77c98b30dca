"""Process group, device and the sharded train module (DistributedModelParallel + optimizers).

The trainer always runs in a process group, even alone (world size 1), so one code path
covers a laptop run and a torchrun job across nodes: gloo on CPU; on GPU the default group
is ``cpu:gloo,cuda:nccl``, NCCL for CUDA tensors and gloo for CPU ones, because NCCL has no
CPU implementation and the trainer does gather CPU tensors (evaluation, the preemption
flag). Embedding tables are sharded by DistributedModelParallel and trained by TorchRec's
fused optimizer (applied inside the backward pass); dense parameters use a regular optimizer.

The train module is made in two parts so a warm standby can park before the second
(trainer/init_stages.py): ``build_host_model`` and ``sharding_plan`` use no device memory
(the plan's collective takes the gloo side of the default group), ``shard_train_module``
puts the model on the device.

Groups (``DistEnv``): ``cpu_group`` for CPU-tensor collectives issued by the training
thread; ``data_group``, a gloo group of its own for the data loader's rank balancing,
whose first exchange can run on an init thread while the model is being sharded on the
default group (two threads must never share a group).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from infra.settings import JobConfig
from trainer.model import RankingModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # the default group's backend string, e.g. "cpu:gloo,cuda:nccl"
    cpu_group: dist.ProcessGroup | None = None  # CPU tensors, training thread (None: WORLD)
    data_group: dist.ProcessGroup | None = None  # the loader's rank balancing (world > 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_group_backend(device: torch.device) -> str:
    """The default group's backend string for a job computing on ``device``: on a GPU,
    NCCL for CUDA tensors and gloo for CPU tensors (an NCCL-only group fails on them)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def backend_devices(backend: str) -> dict[str, str]:
    """Which backend serves which device type: "gloo" -> {cpu: gloo, cuda: gloo},
    "nccl" -> {cuda: nccl}, "cpu:gloo,cuda:nccl" -> {cpu: gloo, cuda: nccl}."""
    return dict(BackendConfig(dist.Backend(backend)).get_device_backend_map())


def has_cpu_backend(group: dist.ProcessGroup | None = None) -> bool:
    """Whether collectives on CPU tensors can run on ``group`` (None: the default group)."""
    return "cpu" in backend_devices(dist.get_backend_config(group))


def select_device(backend_choice: str) -> tuple[torch.device, str]:
    """A GPU when one is present (unless gloo is forced), else the CPU; with the backend
    string of the default group (``process_group_backend``). Chooses only: the device is
    made current by ``bind_device``, which on a GPU creates this process's CUDA context."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and backend_choice != "gloo":
        device = torch.device("cuda", local_rank)
        return device, process_group_backend(device)
    if backend_choice == "nccl":
        raise RuntimeError("train.backend=nccl needs a GPU, and none is visible")
    device = torch.device("cpu")
    return device, process_group_backend(device)


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device (a no-op off CUDA). On CUDA 12
    this creates the primary context (memory on the GPU): a standby parked host-side calls
    it only once promoted."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def has_cuda_context(device: torch.device) -> bool | None:
    """Whether this process holds its CUDA context on ``device`` (the driver's primary
    context, asked without creating one); None off CUDA or on a torch built without it."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if device.type != "cuda" or probe is None:
        return None
    return bool(probe(device.index or 0))


def init_process_group(device: torch.device, backend: str, timeout_s: float = 600) -> DistEnv:
    """Join the job's process group (torchrun's env), or form a group of one when run alone;
    then the CPU-side groups (collective calls: every rank makes them in this order)."""
    if "RANK" not in os.environ:  # plain `python -m trainer`: a single-process job
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    world_size = dist.get_world_size()
    # The default group serves CPU tensors whenever its backend string maps "cpu" (ours
    # always does); a group given another way gets a gloo group for them.
    cpu_group = None if "cpu" in backend_devices(backend) else dist.new_group(backend="gloo")
    data_group = dist.new_group(backend="gloo") if world_size > 1 else None
    if dist.get_rank() == 0:
        log.info("process group: %d rank(s) on %s, backend %s", world_size, device, backend)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        device=device,
        backend=backend,
        cpu_group=cpu_group,
        data_group=data_group,
    )


def sharding_plan(
    model: torch.nn.Module,
    env: DistEnv,
    sharding_types: tuple[ShardingType, ...] = (ShardingType.TABLE_WISE,),
) -> ShardingPlan:
    """Table-wise sharding for every table: each table lives whole on one rank, its rows
    updated by the fused optimizer there (small tables are not replicated data-parallel,
    so every table has exactly one copy and one optimizer state to checkpoint).
    ``sharding_types``: what the planner may pick instead (the resharding tests)."""
    tables = [name for name, _ in model.named_parameters() if name.endswith(".weight")]
    constraints = {
        name.rsplit(".", 2)[-2]: ParameterConstraints(
            sharding_types=[t.value for t in sharding_types]
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


def plan_summary(plan: ShardingPlan) -> dict[str, dict[str, object]]:
    """The plan as plain data, for the manifest: each table's sharding type and ranks."""
    return {
        f"{module}.{param}" if module else param: {
            "sharding_type": sharding.sharding_type,
            "ranks": list(sharding.ranks or []),
        }
        for module, params in plan.plan.items()
        for param, sharding in params.items()  # type: ignore[attr-defined]
    }


def import_functional_optimizers_unscripted() -> None:
    """Import ``torch.distributed.optim`` with TorchScript off.

    TorchRec's ``apply_optimizer_in_backward`` imports that package, whose functional
    optimizers are TorchScript-compiled at import: a few tenths of a second of every start,
    for classes that only DDP's optimizer-overlap hooks use, which this trainer does not.
    Imported with scripting off they stay plain Python classes; ``torch.jit.script`` works
    again as soon as the import returns.
    """
    if "torch.distributed.optim" in sys.modules:
        return
    from torch.jit import _state

    _state.disable()
    try:
        import torch.distributed.optim  # noqa: F401
    finally:
        _state.enable()


def build_host_model(config: JobConfig) -> RankingModel:
    """The model before sharding, nothing of it on a device: embedding tables on "meta" (no
    memory; DistributedModelParallel allocates each rank's shards), dense layers in host
    memory, built from the seed (identical on every rank, so a run is repeatable), and the
    fused sparse optimizer registered with the tables."""
    import_functional_optimizers_unscripted()
    torch.manual_seed(config.train.seed)
    model = RankingModel(config.data, config.model, device=torch.device("meta"))
    sparse_params = [
        *model.sparse_arch.parameters(),
        *model.history_tower.items.parameters(),
    ]
    # Exact Adagrad: fbgemm's CPU kernels fuse its backward, while row-wise Adagrad takes a
    # much slower path on CPU; GPUs do either well.
    apply_optimizer_in_backward(torch.optim.Adagrad, sparse_params, {"lr": config.train.sparse_lr})
    return model


def shard_train_module(
    config: JobConfig, env: DistEnv, model: RankingModel, plan: ShardingPlan
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """``model`` (from ``build_host_model``) on the device: DistributedModelParallel
    allocates and initialises this rank's table shards there and moves the dense layers;
    then one optimizer object covering sparse (fused) and dense params."""
    dmp = DistributedModelParallel(module=model, device=env.device, plan=plan)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(
        dense, lambda params: torch.optim.Adam(params, lr=config.train.dense_lr)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])
