"""Chains of incremental checkpoints: which committed checkpoints a delta needs to restore.

A delta holds only the embedding rows touched since the link before it, so restoring it
takes its full base and every link in between. Restore composes them
(trainer/checkpoint/compose.py) and retention keeps them (trainer/checkpoint/retention.py);
here, without torch, so the orchestrator and ``ett report`` can read chains too.
"""

from __future__ import annotations

from collections.abc import Iterable

from infra.checkpoint_manifest import CheckpointCorrupt, CommitKind, CommittedCheckpoint


class ChainBroken(CheckpointCorrupt):
    """A link a delta needs is missing or corrupt: the delta, and every later link of its
    chain, cannot be restored. ``link_step`` names the first unusable link."""

    def __init__(self, message: str, link_step: int) -> None:
        super().__init__(message)
        self.link_step = link_step


def chain_of(
    ckpt: CommittedCheckpoint, committed: Iterable[CommittedCheckpoint]
) -> list[CommittedCheckpoint]:
    """The checkpoints that restore ``ckpt``, its full base first and ``ckpt`` last; a full
    checkpoint is its own chain. ChainBroken when a link is not among ``committed``."""
    by_step = {c.step: c for c in committed}
    chain = [ckpt]
    while chain[-1].manifest.kind == CommitKind.DELTA:
        link = chain[-1].manifest
        previous = link.previous_step
        if previous is None or previous not in by_step:
            raise ChainBroken(
                f"checkpoint {ckpt.url} is a delta whose link at step {previous} is not "
                "committed (deleted or quarantined)",
                link_step=previous if previous is not None else ckpt.step,
            )
        chain.append(by_step[previous])
    chain.reverse()
    base = chain[0]
    if base.manifest.kind != CommitKind.FULL or (
        ckpt.manifest.kind == CommitKind.DELTA and base.step != ckpt.manifest.base_step
    ):
        raise ChainBroken(
            f"checkpoint {ckpt.url}: its chain starts at step {base.step}, its manifest "
            f"names base step {ckpt.manifest.base_step}",
            link_step=base.step,
        )
    return chain


def needed_steps(
    kept: Iterable[CommittedCheckpoint], committed: list[CommittedCheckpoint]
) -> set[int]:
    """Every step a kept checkpoint's chain needs (its base and links): retention keeps them.
    A kept delta whose chain is broken already needs nothing more."""
    needed: set[int] = set()
    for ckpt in kept:
        try:
            needed.update(c.step for c in chain_of(ckpt, committed))
        except ChainBroken:
            needed.add(ckpt.step)
    return needed
