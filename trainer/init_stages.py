"""Trainer initialisation: the L2 init sub-stages of a training attempt, each a ledger span.

device_init -> process_group_init -> preproc_creation -> train_module_creation ->
init_plugins -> pre_train (checkpoint restore) -> get_first_batch_data
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from infra.ledger import Ledger
from infra.settings import JobConfig
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.restore import restore
from trainer.checkpoint.retention import purge_uncommitted
from trainer.checkpoint.state import app_state, apply_loaded
from trainer.data.batch import Batch
from trainer.data.loader import TrainLoader, holdout_batches
from trainer.distributed import DistEnv, build_train_module, init_process_group, select_device
from trainer.faults import FaultInjector

log = logging.getLogger(__name__)


@dataclass
class Components:
    """Everything the training loop needs, built by ``initialize``."""

    env: DistEnv
    loader: TrainLoader
    batches: Iterator[Batch]
    first_batch: Batch | None
    model: torch.nn.Module
    optimizer: Any
    holdout: list[Batch]
    faults: FaultInjector
    checkpointer: Checkpointer
    start_step: int


def initialize(config: JobConfig, ledger: Ledger) -> Components:
    """Run the init sub-stages in order; returns the ready-to-train components."""
    with ledger.span("device_init"):
        device, backend = select_device(config.train.backend)
    with ledger.span("process_group_init"):
        env = init_process_group(device, backend)
        # Checkpoint collectives run on their own CPU group: DCP's background thread must
        # never interleave with the training thread's collectives (and NCCL cannot do async
        # save at all).
        ckpt_group = dist.new_group(backend="gloo")
    with ledger.span("preproc_creation"):
        loader = TrainLoader(config.data, env.rank, env.world_size, seed=config.train.seed)
    with ledger.span("train_module_creation"):
        model, optimizer = build_train_module(config, env)
    with ledger.span("init_plugins"):
        holdout = holdout_batches(
            config.data,
            env.rank,
            env.world_size,
            config.train.eval_rows,
            config.data.eval_batch_size,
        )
        faults = FaultInjector(config.faults, ledger.attempt, env.rank)
        checkpointer = Checkpointer(
            config, env.rank, env.world_size, ledger, ckpt_group, faults.at_checkpoint_phase
        )
    with ledger.span("pre_train") as attrs:
        start_step = restore_state(config, env, model, optimizer, loader, ledger, ckpt_group)
        attrs["resumed_from_step"] = start_step
    with ledger.span("get_first_batch_data"):
        batches = iter(loader)
        pending: Batch | None = next(batches) if start_step < config.train.steps else None
    return Components(
        env=env,
        loader=loader,
        batches=batches,
        first_batch=pending,
        model=model,
        optimizer=optimizer,
        holdout=holdout,
        faults=faults,
        checkpointer=checkpointer,
        start_step=start_step,
    )


def restore_state(
    config: JobConfig,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: Any,
    loader: TrainLoader,
    ledger: Ledger,
    group: dist.ProcessGroup,
) -> int:
    """Resume from the newest usable checkpoint; returns the step to continue after."""
    if env.is_main:
        purge_uncommitted(config.job_url)
    dist.barrier()
    optimizer.init_state()  # materialise lazy optimizer state so it can be loaded in place
    state = app_state(model, optimizer, env.rank)
    restored = restore(config, state, env.rank, env.world_size, group)
    if restored is None:
        return 0
    if restored.warm_start:
        model.load_state_dict(state["model"])
        log.info("warm-started the model from %s", restored.checkpoint.url)
        return 0
    apply_loaded(model, optimizer, state, env.rank)
    loader.load_state_dict(restored.extra["loader"])
    step = int(restored.extra["step"])
    ledger.mark("resume", step=step, url=restored.checkpoint.url)
    if env.is_main:
        log.info("resumed from %s at step %d", restored.checkpoint.url, step)
    return step
