"""Where an attempt continues: the newest usable checkpoint loaded, or a cheap guess at it.

``restore_model`` is the real thing (tensors, checksums, fallback to an older checkpoint);
``peek_resume`` reads only the small JSON state of the checkpoint restore will most likely
pick, so the first batch can be fetched while the model is still being restored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
from infra.checkpoint_manifest import CheckpointError, rank_state_name
from infra.settings import JobConfig
from trainer.checkpoint.restore import candidates, check_compatible, restore
from trainer.checkpoint.retention import purge_uncommitted
from trainer.checkpoint.state import app_state, apply_loaded
from trainer.distributed import DistEnv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """Where training continues: the step done, the loader position (None: start)."""

    step: int = 0
    loader: dict[str, Any] | None = None
    url: str | None = None


def peek_resume(config: JobConfig, env: DistEnv) -> Resume | None:
    """The step and data position restore will most likely continue from, read from the
    checkpoint's small JSON state only (no tensors, no checksums); None if unsure."""
    try:
        for ckpt in candidates(config):
            try:
                check_compatible(ckpt, config, env.world_size)
            except CheckpointError:
                continue  # restore skips it too (or fails the attempt)
            name = rank_state_name(env.rank)
            extra = json.loads(storage.read_text(storage.join(ckpt.url, name)))
            return Resume(int(extra["step"]), extra.get("loader"), ckpt.url)
        return Resume()
    except Exception as exc:  # only a guess: restore decides
        log.info("could not peek at the resume position: %s", exc)
        return None


def restore_model(
    config: JobConfig,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: Any,
    ledger: Ledger,
    group: dist.ProcessGroup,
    in_process: bool = False,
    promoted: bool = False,
) -> Resume:
    """Load the newest usable checkpoint into model, optimizer and RNG; returns where the
    loop and the data loader continue (the loader itself is left alone). The ``resume``
    mark names the checkpoint, how this restore came about (a cold attempt, a ``promoted``
    standby, an ``in_process`` restart) and every newer checkpoint it skipped, and why."""
    if env.is_main and not in_process:
        purge_uncommitted(config.layout)
    dist.barrier(group=group)
    optimizer.init_state()  # materialise lazy optimizer state so it can be loaded in place
    state = app_state(model, optimizer, env.rank)
    restored = restore(config, state, env.rank, env.world_size, group)
    if restored is None:
        return Resume()
    if restored.warm_start:
        model.load_state_dict(state["model"])
        log.info("warm-started the model from %s", restored.checkpoint.url)
        return Resume()
    apply_loaded(model, optimizer, state, env.rank)
    step = int(restored.extra["step"])
    how = "in_process" if in_process else "promoted" if promoted else "cold"
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
    if env.is_main:
        fell_back = "".join(
            f"; step {s.step} {'quarantined' if s.quarantined else 'skipped'}: {s.reason}"
            for s in restored.skipped
        )
        log.info("resumed from %s at step %d%s", restored.checkpoint.url, step, fell_back)
    return Resume(step, restored.extra["loader"], restored.checkpoint.url)
