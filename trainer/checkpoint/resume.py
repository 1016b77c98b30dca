"""Where an attempt continues: the newest usable checkpoint loaded, or a cheap guess at it.

``restore_states`` is the real thing (tensors, checksums, fallback to an older checkpoint),
loading into the states the checkpointer saves from; ``peek_resume`` reads only the small
JSON state of the checkpoint restore will most likely pick, so the first batch can be
fetched while the model is still being restored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark, ResumeHow
from infra.checkpoint_manifest import CheckpointError, rank_state_name
from infra.settings import JobConfig
from trainer.checkpoint.restore import candidates, check_compatible, json_rank, restore
from trainer.checkpoint.retention import purge_uncommitted
from trainer.checkpoint.state import LOADER, MODEL, CheckpointStates

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """Where training continues: the step done, this rank's JSON state (None: start)."""

    step: int = 0
    rank_state: dict[str, Any] | None = None
    url: str | None = None

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
        for ckpt in candidates(config):
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
) -> Resume:
    """Load the newest usable checkpoint into the tensor states (model, optimizer, RNG);
    returns where the loop continues and this rank's JSON state (the JSON parts themselves
    are left alone). The ``resume`` mark names the checkpoint, how this restore came about
    and every newer checkpoint it skipped, and why."""
    in_process = how == ResumeHow.IN_PROCESS
    if rank == 0 and not in_process:
        purge_uncommitted(config.layout)
    dist.barrier(group=group)
    target = states.load_target()
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
