"""Restore a delta checkpoint: its full base, then every link's touched rows, in order.

A delta (delta.py) holds the whole dense state and only the embedding rows touched since
the link before it. Its full base loads as any checkpoint; each link's rows are written over
the tables in order, the newest last; then the delta's own dense state is loaded. Rows no
link touched are the base's, and the optimizer changed none of them since: the result is
bit-identical to a full checkpoint of the same step.

Every link's files are verified against its manifest before anything of it is read. A link
that is corrupt or missing is ChainBroken naming its step: restore then falls back to the
newest checkpoint below it (restore.py), which is the last good link of the same chain.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from infra.checkpoint_chain import ChainBroken, chain_of
from infra.checkpoint_manifest import (
    CheckpointCorrupt,
    CheckpointError,
    CommitKind,
    CommittedCheckpoint,
    committed_checkpoints,
)
from infra.control import scratch_dir
from infra.job_layout import JobLayout
from trainer.checkpoint.delta import ROWS_KEY, apply_rows, rows_file, without
from trainer.checkpoint.restore import fetch, read_json_state
from trainer.unsharded import load_model_weights

log = logging.getLogger(__name__)

LoadFull = Callable[[CommittedCheckpoint, dict[str, Any]], dict[str, Any]]


def chain_for(ckpt: CommittedCheckpoint) -> list[CommittedCheckpoint]:
    """The committed checkpoints that restore ``ckpt`` (its job's folder), base first."""
    layout = JobLayout.of_checkpoint(ckpt.url)
    if layout is None:
        raise CheckpointError(f"delta checkpoint {ckpt.url} is outside a job's folder")
    return chain_of(ckpt, committed_checkpoints(layout))


def read_rows(local: str, rank: int, every_rank: bool = False) -> list[dict[str, Any]]:
    """This rank's rows of a delta (``every_rank``: all ranks', for one process reading
    the whole model)."""
    names = sorted(n for n in os.listdir(local) if n.startswith("rows.rank"))
    if not every_rank:
        names = [n for n in names if n == rows_file(rank)]
    return [torch.load(os.path.join(local, n), weights_only=True) for n in names]


def load_chain(
    ckpt: CommittedCheckpoint,
    state: dict[str, Any],
    rank: int,
    process_group: dist.ProcessGroup | None,
    load_full: LoadFull,
    no_dist: bool = False,
    world_size: int | None = None,
) -> dict[str, Any]:
    """Fill ``state`` in place with the delta ``ckpt`` composed over its chain, and return
    this rank's JSON state (rank 0's when ``world_size`` is not the writer's, as for a full
    checkpoint). ChainBroken names the first unusable link."""
    chain = chain_for(ckpt)
    try:
        load_full(chain[0], state)
    except CheckpointCorrupt as exc:
        raise ChainBroken(f"{exc} (the base of {ckpt.url})", chain[0].step) from exc
    for link in chain[1:]:
        tmp = tempfile.mkdtemp(prefix="ett-restore-link-", dir=scratch_dir())
        try:
            try:
                local = fetch(link, tmp)
            except CheckpointCorrupt as exc:
                raise ChainBroken(f"{exc} (a link of {ckpt.url})", link.step) from exc
            # Every rank's rows: this job may run on another number of ranks than wrote them.
            payloads = read_rows(local, rank, every_rank=True)
            for payload in payloads:
                apply_rows(state, payload)
            if link is not chain[-1]:
                continue
            try:
                tables = {path for payload in payloads for path in payload[ROWS_KEY]}
                dense = without(state, tables)
                dcp.load(dense, checkpoint_id=local, process_group=process_group, no_dist=no_dist)
                return read_json_state(local, link, rank, world_size)
            except (OSError, RuntimeError, ValueError, KeyError, CheckpointException) as exc:
                raise CheckpointError(f"checkpoint {ckpt.url} could not be loaded: {exc}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(f"checkpoint {ckpt.url} has no links to compose")


def load_model(ckpt: CommittedCheckpoint, model: nn.Module, workdir: str) -> str:
    """Fill one unsharded model in place from a committed checkpoint, whatever world size
    wrote it, a delta composed over its chain (publishing, the side evaluator). Every file
    is verified before it is read. Returns the checkpoint's verified local folder (object
    storage: downloaded into ``workdir``)."""
    local = fetch(ckpt, workdir)
    if ckpt.manifest.kind != CommitKind.DELTA:
        load_model_weights(local, model)
        return local
    state = {"model": model.state_dict()}

    def load_full(link: CommittedCheckpoint, into: dict[str, Any]) -> dict[str, Any]:
        dcp.load(into, checkpoint_id=fetch(link, workdir), no_dist=True)
        return {}

    load_chain(ckpt, state, 0, None, load_full, no_dist=True)
    model.load_state_dict(state["model"])
    return local
