"""Where an attempt continues: the newest usable checkpoint loaded, or a cheap guess at it.

``restore_states`` is the real thing (tensors, checksums, fallback to an older checkpoint),
loading into the states the checkpointer saves from; ``peek_resume`` reads only the small
JSON state of the checkpoint restore will most likely pick, so the first batch can be
fetched while the model is still being restored.

Two tiers, newest valid first: this host's in-memory copies (memory_tier.py), then the
committed checkpoints on durable storage. An in-memory copy is restored only when every rank
holds a valid one of the same step and that step is not older than the newest durable
commit; every other copy (torn, stale, another job's) is ignored with one log line, and
dropped once the restore is done, so that a later restore can never go back to it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import CheckpointTier, Mark, ResumeHow
from infra.checkpoint_manifest import CheckpointError, rank_state_name
from infra.settings import JobConfig
from trainer.checkpoint.memory_tier import MemoryCopy, MemoryTier, TornCopy, fill, memory_tier_of
from trainer.checkpoint.restore import candidates, check_compatible, json_rank, restore
from trainer.checkpoint.retention import purge_uncommitted
from trainer.checkpoint.state import LOADER, MODEL, CheckpointStates

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """Where training continues: the step done, this rank's JSON state (None: start)."""

    step: int = 0
    rank_state: dict[str, Any] | None = None
    url: str | None = None  # the checkpoint, or the in-memory copy's segment
    tier: CheckpointTier = CheckpointTier.DURABLE

    @property
    def loader(self) -> dict[str, Any] | None:
        """The data position (None: the start)."""
        return None if self.rank_state is None else self.rank_state.get(LOADER)


def _rank_state(extra: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in extra.items() if key != "step"}


def peek_resume(config: JobConfig, rank: int, world_size: int) -> Resume | None:
    """The step and data position restore will most likely continue from, read from the
    checkpoint's small JSON state only (no tensors, no checksums); None if unsure."""
    try:
        found = candidates(config)
        # One rank's copies say nothing of the others' (the ranks agree on a copy only in
        # restore), and ranks that guess differently re-fetch their first batch apart,
        # which the batch balancer's exchange cannot take: with several ranks, the same
        # guess everywhere, from durable storage.
        memory = memory_tier_of(config, rank, world_size) if world_size == 1 else None
        peeked = memory.peek() if memory is not None else None
        if peeked is not None and (not found or peeked[0] >= found[0].step):
            step, extra = peeked
            return Resume(step, _rank_state(extra), tier=CheckpointTier.MEMORY)
        for ckpt in found:
            try:
                check_compatible(ckpt, config, world_size)
            except CheckpointError:
                continue  # restore skips it too (or fails the attempt)
            name = rank_state_name(json_rank(ckpt, rank, world_size))
            extra = json.loads(storage.read_text(storage.join(ckpt.url, name)))
            return Resume(int(extra["step"]), _rank_state(extra), ckpt.url)
        return Resume()
    except Exception as exc:  # only a guess: restore decides
        log.info("could not peek at the resume position: %s", exc)
        return None


def restore_states(
    config: JobConfig,
    states: CheckpointStates,
    rank: int,
    world_size: int,
    ledger: Ledger,
    group: dist.ProcessGroup | None,
    how: ResumeHow = ResumeHow.COLD,
    memory: MemoryTier | None = None,
) -> Resume:
    """Load the newest usable state into the tensor states (model, optimizer, RNG): the
    in-memory tier's copy when every rank has a valid one at least as new as the newest
    durable commit, else the newest usable committed checkpoint. Returns where the loop
    continues and this rank's JSON state (the JSON parts themselves are left alone). The
    ``resume`` mark names the copy or checkpoint, its tier, how this restore came about and
    every newer checkpoint it skipped, and why."""
    in_process = how == ResumeHow.IN_PROCESS
    if rank == 0 and not in_process:
        purge_uncommitted(config.layout)
    dist.barrier(group=group)
    target = states.load_target()
    if memory is not None:
        copied = _restore_memory(config, memory, target, group)
        memory.keep_only(copied[0] if copied else None)
        if copied is not None:
            copy, extra = copied
            states.load(target)
            url, step = copy.path, int(extra["step"])
            ledger.mark(
                Mark.RESUME,
                step=step,
                url=url,
                tier=CheckpointTier.MEMORY,
                seq=copy.header.seq,
                in_process=in_process,
                how=how,
                newest_step=step,
                skipped=[],
            )
            if rank == 0:
                log.info("resumed from the in-memory copy %s at step %d", url, step)
            return Resume(step, _rank_state(extra), url, CheckpointTier.MEMORY)
    restored = restore(config, target, rank, world_size, group)
    if restored is None:
        return Resume()
    if restored.warm_start:
        states.load(target, only=(MODEL,))
        log.info("warm-started the model from %s", restored.checkpoint.url)
        return Resume()
    states.load(target)
    step = int(restored.extra["step"])
    skipped = [s.to_json() for s in restored.skipped]
    newest = max([step] + [s.step for s in restored.skipped])
    ledger.mark(
        Mark.RESUME,
        step=step,
        url=restored.checkpoint.url,
        tier=CheckpointTier.DURABLE,
        in_process=in_process,
        how=how,
        newest_step=newest,
        skipped=skipped,
    )
    if restored.checkpoint.manifest.world_size != world_size:
        ledger.mark(
            Mark.RESIZE,
            step=step,
            url=restored.checkpoint.url,
            from_ranks=restored.checkpoint.manifest.world_size,
            to_ranks=world_size,
        )
    if rank == 0:
        fell_back = "".join(
            f"; step {s.step} {'quarantined' if s.quarantined else 'skipped'}: {s.reason}"
            for s in restored.skipped
        )
        log.info("resumed from %s at step %d%s", restored.checkpoint.url, step, fell_back)
    return Resume(step, _rank_state(restored.extra), restored.checkpoint.url)


def _gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` (just this one's without a process group)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _restore_memory(
    config: JobConfig, memory: MemoryTier, target: dict[str, Any], group: dist.ProcessGroup | None
) -> tuple[MemoryCopy, dict[str, Any]] | None:
    """Fill ``target`` from the newest step every rank holds a valid in-memory copy of, not
    older than the newest durable commit; None (nothing filled) when there is none. Every
    rank calls it: the ranks agree on the step, then on whether every copy of it loaded."""
    if config.checkpoint.resume != "latest":
        return None  # a named checkpoint, or none: the config says where to start
    found = candidates(config)
    durable = found[0].step if found else 0
    mine = []
    for copy in memory.copies():
        if copy.step < durable:
            log.warning(
                "memory tier: %s ignored: step %d is older than the newest durable commit (%d)",
                copy.path,
                copy.step,
                durable,
            )
        else:
            mine.append(copy)
    held = _gather(sorted({c.step for c in mine}), group)
    common = sorted(set.intersection(*(set(steps) for steps in held)), reverse=True)
    for step in common:
        copy = next(c for c in mine if c.step == step)
        loaded = None
        try:
            tensors, extra = memory.load(copy)
            fill(target, tensors)
            loaded = extra
        except (TornCopy, OSError, RuntimeError, ValueError, KeyError) as exc:
            log.warning("memory tier: %s ignored: %s", copy.path, exc)
        if all(_gather(loaded is not None, group)):
            assert loaded is not None
            return copy, loaded
    return None
