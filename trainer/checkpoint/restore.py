"""Find, verify and load the checkpoint an attempt resumes from (or warm-starts from).

Three kinds of trouble, three answers:

* verified corruption (a listed file missing, a size or checksum mismatch, an unreadable
  manifest): with ``checkpoint.fallback_on_corrupt`` the previous committed checkpoint is
  loaded and the corrupt one quarantined, so it is never tried or counted again;
* storage errors (5xx, timeouts, resets) while reading: retried by infra.storage; when
  they persist, infra.storage.StorageError ends the attempt as retryable
  (STORAGE_UNAVAILABLE). Falling back would silently throw away the newest work;
* a checkpoint that does not fit this job (another model config, or one DCP cannot load):
  CheckpointError, which no relaunch fixes (CHECKPOINT_INCOMPATIBLE).

A checkpoint written by N ranks restores on any M >= 1 ranks: DCP reshards the tables and
the fused optimizer's state (ShardedTensors, keyed by table as the model's weights) onto the
plan the planner picks for M; the dense model and its optimizer are replicated; the step
and the data position are the job's, not a rank's (trainer/data/loader.py), so every rank
reads them from rank 0's JSON state; a rank N or above takes rank ``rank % N``'s RNG.
"""

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
from infra.checkpoint_chain import ChainBroken
from infra.checkpoint_manifest import (
    CheckpointCorrupt,
    CheckpointError,
    CommitKind,
    CommittedCheckpoint,
    committed_checkpoints,
    rank_state_name,
    read_manifest,
)
from infra.control import scratch_dir
from infra.settings import CheckpointMode, JobConfig
from trainer.checkpoint.state import rng_key
from trainer.checkpoint.verify import quarantine, verify_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Skipped:
    """A newer committed checkpoint that restore could not use, and what became of it."""

    step: int
    reason: str
    quarantined: bool

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason[:300], "quarantined": self.quarantined}


@dataclass(frozen=True)
class Restored:
    checkpoint: CommittedCheckpoint
    extra: dict[str, Any]  # this rank's JSON state: step, data-loader position
    warm_start: bool = False
    skipped: tuple[Skipped, ...] = ()  # newer checkpoints found corrupt, newest first


def check_compatible(ckpt: CommittedCheckpoint, config: JobConfig, world_size: int) -> None:
    if ckpt.manifest.config_hash != config.model_hash():
        raise CheckpointError(
            f"checkpoint {ckpt.url} was made for another model config (hash "
            f"{ckpt.manifest.config_hash}, this job's is {config.model_hash()})"
        )
    if ckpt.manifest.world_size < 1:
        raise CheckpointError(
            f"checkpoint {ckpt.url} names world_size={ckpt.manifest.world_size} in its manifest"
        )


def load_resharded(
    state: dict[str, Any],
    path: str,
    rank: int,
    written_by: int,
    process_group: dist.ProcessGroup | None,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` of a local checkpoint written by ``written_by`` ranks into ``state``, on
    any number of ranks: DCP reshards the tables and their optimizer state; a rank beyond
    the writers' loads the RNG state of rank ``rank % written_by`` (the same inner dicts
    under the saved key: DCP fills them in place)."""
    mine, src = rng_key(rank), rng_key(rank % written_by)
    target = {src if key == mine else key: part for key, part in state.items()}
    dcp.load(target, checkpoint_id=path, process_group=process_group, no_dist=no_dist)


def json_rank(ckpt: CommittedCheckpoint, rank: int, world_size: int | None) -> int:
    """Whose JSON state this rank reads: its own at the same world size (None: the same),
    else rank 0's (the step and the data position are the job's, the same on every rank)."""
    return rank if world_size in (None, ckpt.manifest.world_size) else 0


def read_json_state(
    local: str, ckpt: CommittedCheckpoint, rank: int, world_size: int | None
) -> dict[str, Any]:
    """This rank's JSON state (step, data position, ...) from the checkpoint's verified
    local folder: whose, ``json_rank`` says; {} for a checkpoint written without one."""
    path = os.path.join(local, rank_state_name(json_rank(ckpt, rank, world_size)))
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return dict(json.load(fh))


def fetch(ckpt: CommittedCheckpoint, into: str) -> str:
    """A verified local folder holding the checkpoint: in place on local disk, downloaded
    (into ``into``) from object storage. Raises CheckpointCorrupt for a missing or altered
    file, infra.storage.StorageError when storage keeps failing (retries spent)."""
    local = storage.local_path(ckpt.url)
    try:
        if local is None:
            local = os.path.join(into, ckpt.url.rstrip("/").rsplit("/", 1)[-1])
            os.makedirs(local, exist_ok=True)
            for name in ckpt.manifest.files:
                try:
                    storage.get_file(storage.join(ckpt.url, name), os.path.join(local, name))
                except FileNotFoundError:
                    raise CheckpointCorrupt(
                        f"checkpoint {ckpt.url} is missing file {name}"
                    ) from None
        verify_files(ckpt.url, ckpt.manifest, local_dir=local)
    except (CheckpointError, storage.StorageError):
        raise
    except OSError as exc:  # reading local disk: not the checkpoint's fault
        raise storage.StorageError(f"reading checkpoint {ckpt.url} failed: {exc}") from exc
    return local


def load_into(
    ckpt: CommittedCheckpoint,
    state: dict[str, Any],
    rank: int,
    process_group: dist.ProcessGroup | None,
    no_dist: bool = False,
    world_size: int | None = None,
) -> dict[str, Any]:
    """Verify the checkpoint, fill ``state`` in place, and return this rank's JSON state.
    Errors: see ``fetch``; a verified checkpoint DCP cannot load is a CheckpointError
    (incompatible: its files are exactly what was committed). A delta is composed over its
    chain (compose.py): ChainBroken names a corrupt or missing link."""
    if ckpt.manifest.kind == CommitKind.DELTA:
        from trainer.checkpoint.compose import load_chain  # compose builds on this module

        def load_full(link: CommittedCheckpoint, into: dict[str, Any]) -> dict[str, Any]:
            return load_into(link, into, rank, process_group, no_dist)

        return load_chain(ckpt, state, rank, process_group, load_full, no_dist, world_size)
    tmp = tempfile.mkdtemp(prefix="ett-restore-", dir=scratch_dir())
    try:
        local = fetch(ckpt, tmp)
        try:
            written_by = ckpt.manifest.world_size
            load_resharded(state, local, rank, written_by, process_group, no_dist)
            return read_json_state(local, ckpt, rank, world_size)
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
        return committed_checkpoints(config.layout)
    return [CommittedCheckpoint(resume, read_manifest(resume))]


def restore(
    config: JobConfig,
    state: dict[str, Any],
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
) -> Restored | None:
    """Load the newest usable checkpoint into ``state``; None when there is none.

    A corrupt checkpoint raises CheckpointCorrupt naming it, or, with
    ``checkpoint.fallback_on_corrupt``, is skipped for the previous committed one and, once
    that one loaded, quarantined. An incompatible one raises CheckpointError, a storage
    outage infra.storage.StorageError (see the module docstring).
    Without any checkpoint of this job, ``checkpoint.warm_start`` loads a model only.
    """
    found = candidates(config)
    corrupt: list[tuple[CommittedCheckpoint, str]] = []
    broken: ChainBroken | None = None  # links from this step up cannot be composed
    for ckpt in found:
        if broken is not None and ckpt.step >= broken.link_step:
            corrupt.append((ckpt, str(broken)))  # said once, where the chain broke
            continue
        check_compatible(ckpt, config, world_size)
        try:
            extra = load_into(ckpt, state, rank, process_group, world_size=world_size)
        except CheckpointCorrupt as exc:
            if not config.checkpoint.fallback_on_corrupt:
                raise
            if isinstance(exc, ChainBroken):
                broken = exc
                log.warning(
                    "%s; falling back to the last good link before step %d", exc, exc.link_step
                )
            else:
                log.warning("%s; falling back to the previous committed checkpoint", exc)
            corrupt.append((ckpt, str(exc)))
            continue
        # Every rank has loaded this one, so none still reads the corrupt ones. They are
        # quarantined only now that a good one exists: with none left, the job fails
        # loudly rather than starting over from nothing on its next try.
        skipped = []
        for bad, reason in corrupt:
            moved = False
            if rank == 0 and config.checkpoint.resume == "latest":
                try:
                    quarantine(bad.url, reason)
                    moved = True
                except OSError as exc:  # tried again next time; retention spares new ones
                    log.warning("could not quarantine %s: %s", bad.url, exc)
            skipped.append(Skipped(bad.step, reason, moved))  # rank 0 moves it, and says so
        return Restored(ckpt, extra, skipped=tuple(skipped))
    if corrupt:
        reasons = "\n  ".join(reason for _, reason in corrupt)
        raise CheckpointCorrupt(f"no usable checkpoint:\n  {reasons}")
    if config.checkpoint.warm_start:
        url = config.checkpoint.warm_start
        ckpt = CommittedCheckpoint(url, read_manifest(url))
        if ckpt.manifest.config_hash != config.model_hash():
            raise CheckpointError(f"warm-start checkpoint {url} was made for another model config")
        load_into(ckpt, {"model": state["model"]}, rank, process_group)
        return Restored(ckpt, {}, warm_start=True)
    return None
