"""Find, verify and load the checkpoint an attempt resumes from (or warm-starts from)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from infra import storage
from infra.settings import CheckpointMode, JobConfig
from trainer.checkpoint.manifest import (
    CheckpointError,
    CommittedCheckpoint,
    committed_checkpoints,
    read_manifest,
    verify_files,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    checkpoint: CommittedCheckpoint
    extra: dict[str, Any]  # this rank's JSON state: step, data-loader position
    warm_start: bool = False


def check_compatible(ckpt: CommittedCheckpoint, config: JobConfig, world_size: int) -> None:
    if ckpt.manifest.config_hash != config.model_hash():
        raise CheckpointError(
            f"checkpoint {ckpt.url} was made for another model config (hash "
            f"{ckpt.manifest.config_hash}, this job's is {config.model_hash()})"
        )
    if ckpt.manifest.world_size != world_size:
        raise CheckpointError(
            f"checkpoint {ckpt.url} was written by {ckpt.manifest.world_size} ranks, this job "
            f"has {world_size}: the data position cannot be resharded; resume with "
            f"{ckpt.manifest.world_size} ranks or warm-start from it (checkpoint.warm_start)"
        )


def fetch(ckpt: CommittedCheckpoint, into: str) -> str:
    """A verified local folder holding the checkpoint: in place on local disk, downloaded
    (into ``into``) from object storage."""
    local = storage.local_path(ckpt.url)
    if local is None:
        local = os.path.join(into, ckpt.url.rstrip("/").rsplit("/", 1)[-1])
        os.makedirs(local, exist_ok=True)
        for name in ckpt.manifest.files:
            storage.get_file(storage.join(ckpt.url, name), os.path.join(local, name))
    verify_files(ckpt.url, ckpt.manifest, local_dir=local)
    return local


def load_into(
    ckpt: CommittedCheckpoint,
    state: dict[str, Any],
    rank: int,
    process_group: dist.ProcessGroup | None,
    no_dist: bool = False,
) -> dict[str, Any]:
    """Verify the checkpoint, fill ``state`` in place, and return this rank's JSON state."""
    tmp = tempfile.mkdtemp(prefix="ett-restore-")
    try:
        local = fetch(ckpt, tmp)
        dcp.load(state, checkpoint_id=local, process_group=process_group, no_dist=no_dist)
        extra_path = os.path.join(local, f"trainer_state.rank{rank:03d}.json")
        if not os.path.exists(extra_path):
            return {}
        with open(extra_path) as fh:
            return json.load(fh)
    except CheckpointError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, CheckpointException) as exc:
        # DCP reports read failures as CheckpointException, a BaseException subclass.
        raise CheckpointError(f"checkpoint {ckpt.url} could not be loaded: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def candidates(config: JobConfig) -> list[CommittedCheckpoint]:
    """What ``checkpoint.resume`` points at: "latest" = this job's committed checkpoints
    (newest first), "none" = nothing, anything else = one checkpoint URL."""
    resume = config.checkpoint.resume
    if resume == "none" or config.checkpoint.mode == CheckpointMode.OFF:
        return []
    if resume == "latest":
        return committed_checkpoints(config.job_url)
    return [CommittedCheckpoint(resume, read_manifest(resume))]


def restore(
    config: JobConfig,
    state: dict[str, Any],
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
) -> Restored | None:
    """Load the newest usable checkpoint into ``state``; None when there is none.

    A corrupt or incompatible checkpoint raises CheckpointError naming it, or, with
    ``checkpoint.fallback_on_corrupt``, is skipped for the previous committed one.
    Without any checkpoint of this job, ``checkpoint.warm_start`` loads a model only.
    """
    found = candidates(config)
    reasons = []
    for ckpt in found:
        try:
            check_compatible(ckpt, config, world_size)
            extra = load_into(ckpt, state, rank, process_group)
            return Restored(ckpt, extra)
        except CheckpointError as exc:
            if not config.checkpoint.fallback_on_corrupt:
                raise
            log.warning("%s; falling back to the previous committed checkpoint", exc)
            reasons.append(str(exc))
    if reasons:
        raise CheckpointError("no usable checkpoint:\n  " + "\n  ".join(reasons))
    if config.checkpoint.warm_start:
        url = config.checkpoint.warm_start
        ckpt = CommittedCheckpoint(url, read_manifest(url))
        if ckpt.manifest.config_hash != config.model_hash():
            raise CheckpointError(f"warm-start checkpoint {url} was made for another model config")
        load_into(ckpt, {"model": state["model"]}, rank, process_group)
        return Restored(ckpt, {}, warm_start=True)
    return None
