"""The in-memory tier: this rank's newest training state in host shared memory.

A copy in ``/dev/shm`` costs a memory copy, not an upload, so it can be taken every few
steps; it outlives the process that wrote it, so a crash restored in process, a promoted
standby or a relaunch on the same host loses only the steps since the last copy. It is
written from the staging copy the checkpointer makes anyway (no second device-to-host copy):
the staged local tensors (a sharded table's local shards as plain tensors: a rank restores
only its own shards) and this rank's JSON state.

**Double-buffered.** Two slots per rank (infra/memory_tier.py names them). A write goes to
the slot that does not hold the newest copy: its header is invalidated first, then the
meta and the tensors are written, then the header (sequence number, step, digest) last.
A writer killed at any moment leaves the other slot's copy whole, and its own slot either
headerless or failing its digest: a torn copy is never loaded.

**Which copy restores** is decided with the other ranks and against durable storage
(resume.py): the newest step every rank holds a valid copy of, if it is not older than the
newest durable commit. A copy of another job, model config, rank or world size is ignored
with a log line, as is one that fails its digest.

Cost: two slots of this rank's state (model, optimizer, RNG) in host memory.

**A peer copy on another host** would be one more implementation of the same three calls
(``write`` after the local copy, ``copies``, ``load``), fed from the same staged state:
see docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from infra import memory_tier as segments
from infra.job_layout import JobLayout
from infra.memory_tier import HEADER_BYTES, Header, Slot, TornHeader
from infra.settings import CheckpointMode, JobConfig

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes per write call: a copy of any size is many writes


class TornCopy(ValueError):
    """A slot whose bytes do not match its header's digest: never loaded."""


@dataclass(frozen=True)
class MemoryCopy:
    """A slot holding a copy with a valid header of this job, rank and world size."""

    path: str
    slot: Slot
    header: Header

    @property
    def step(self) -> int:
        return self.header.step


@dataclass(frozen=True)
class Written:
    """What one write of a copy did."""

    step: int
    seq: int
    bytes: int
    seconds: float
    path: str


def _digest(*parts: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(part)
    return h.digest()


def fill(target: Any, saved: Any) -> None:
    """Copy a loaded copy into the live state's tensors in place (what DCP's load does):
    a ShardedTensor's local shards from the saved list of them, a tensor from its tensor."""
    if isinstance(target, ShardedTensor):
        shards = target.local_shards()
        local = saved["__sharded_local__"]
        if len(shards) != len(local):
            raise TornCopy(f"{len(local)} local shards saved, this rank has {len(shards)}")
        for shard, tensor in zip(shards, local, strict=True):
            shard.tensor.copy_(tensor)
        return
    if isinstance(target, torch.Tensor):
        target.copy_(saved)
        return
    if isinstance(target, dict):
        missing = set(target) - set(saved)
        if missing:
            raise TornCopy(f"the copy has no {sorted(missing)[:3]}")
        for key, value in target.items():
            fill(value, saved[key])


class MemoryTier:
    """This rank's two slots for one job. ``write`` from the checkpointer's commit thread,
    ``copies`` and ``load`` from restore; ``remove`` once the job no longer needs them."""

    def __init__(
        self,
        layout: JobLayout,
        config_hash: str,
        rank: int,
        world_size: int,
        shm_dir: str = segments.SHM_DIR,
    ) -> None:
        self.layout, self.config_hash = layout, config_hash
        self.rank, self.world_size, self.shm_dir = rank, world_size, shm_dir
        self.key = segments.job_key(layout)
        self.paths = {s: segments.slot_path(layout, rank, s, shm_dir) for s in Slot}

    # -- writing --------------------------------------------------------------------------
    def write(
        self,
        step: int,
        staged: Any,
        extra: dict[str, Any],
        midway: Callable[[], None] = lambda: None,
    ) -> Written:
        """Write the copy of ``step`` (``staged``: the staged tensors, ``extra``: this
        rank's JSON state) into the slot that does not hold the newest copy. ``midway`` is
        called with half of the tensors written (a fault's hook: trainer/faults.py)."""
        began = time.perf_counter()
        meta = json.dumps({"job_url": self.layout.url, "extra": extra}).encode()
        buffer = io.BytesIO()
        torch.save(staged, buffer)
        payload = buffer.getbuffer()
        # Read from the slots each time: another process of the job (the attempt before a
        # promotion) may have written them since this one last looked.
        valid = self.copies(quiet=True)
        newest = valid[0] if valid else None
        slot = Slot.B if newest is not None and newest.slot == Slot.A else Slot.A
        path = self.paths[slot]
        header = Header(
            seq=(newest.header.seq if newest else 0) + 1,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            meta_bytes=len(meta),
            payload_bytes=len(payload),
            digest=_digest(meta, payload),
            config_hash=self.config_hash,
            job_key=self.key,
            written_at=time.time(),
        )
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, bytes(16), 0)  # invalid from here until the new header is written
            os.ftruncate(fd, header.total_bytes)
            os.pwrite(fd, meta, HEADER_BYTES)
            offset, half = HEADER_BYTES + len(meta), len(payload) // 2
            for begin, end in ((0, half), (half, len(payload))):
                if begin == half:
                    midway()
                for start in range(begin, end, _CHUNK):
                    chunk = payload[start : min(start + _CHUNK, end)]
                    offset += os.pwrite(fd, chunk, offset)
            os.pwrite(fd, header.pack(), 0)  # the flip: this slot now holds the newest copy
        finally:
            os.close(fd)
        return Written(step, header.seq, header.total_bytes, time.perf_counter() - began, path)

    # -- reading --------------------------------------------------------------------------
    def _check(self, header: Header) -> str | None:
        """Why a slot's copy is not this job's, rank's and model's; None when it is."""
        if header.job_key != self.key:
            return "it belongs to another job"
        if header.config_hash != self.config_hash:
            return f"it was made for another model config ({header.config_hash})"
        if (header.rank, header.world_size) != (self.rank, self.world_size):
            return f"it is rank {header.rank} of {header.world_size}"
        return None

    def copies(self, quiet: bool = False) -> list[MemoryCopy]:
        """The slots holding a copy with a valid header of this job, rank, world size and
        model config, newest first; each other slot that exists is one log line."""
        found = []
        for slot, path in self.paths.items():
            try:
                header = segments.read_header(path)
            except FileNotFoundError:
                continue
            except (TornHeader, OSError) as exc:
                if not quiet:
                    log.warning("memory tier: %s ignored: %s", path, exc)
                continue
            why = self._check(header)
            if why is not None:
                if not quiet:
                    log.warning("memory tier: %s ignored: %s", path, why)
                continue
            found.append(MemoryCopy(path, slot, header))
        return sorted(found, key=lambda c: c.header.seq, reverse=True)

    def load(self, copy: MemoryCopy) -> tuple[Any, dict[str, Any]]:
        """The copy's tensors and this rank's JSON state; TornCopy when its bytes do not
        match its digest (a writer killed mid-copy) or the slot changed meanwhile."""
        header = copy.header
        with open(copy.path, "rb") as fh:
            data = fh.read()
        if len(data) != header.total_bytes or Header.unpack(data[:HEADER_BYTES]) != header:
            raise TornCopy(f"{copy.path} changed since its header was read")
        body = memoryview(data)[HEADER_BYTES:]
        meta, payload = body[: header.meta_bytes], body[header.meta_bytes :]
        if _digest(meta, payload) != header.digest:
            raise TornCopy(f"{copy.path} does not match its digest (torn)")
        tensors = torch.load(io.BytesIO(payload), weights_only=True)
        return tensors, json.loads(bytes(meta))["extra"]

    def peek(self) -> tuple[int, dict[str, Any]] | None:
        """The newest copy's step and JSON state, its digest unchecked (a guess)."""
        for copy in self.copies(quiet=True):
            try:
                return copy.step, segments.read_meta(copy.path, copy.header)["extra"]
            except (OSError, ValueError, KeyError):
                continue
        return None

    def keep_only(self, kept: MemoryCopy | None) -> None:
        """After a restore: drop every other copy (a newer one belongs to the timeline the
        restore abandoned, and must never be restored later)."""
        for slot, path in self.paths.items():
            if kept is None or slot != kept.slot:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def remove(self) -> None:
        segments.remove_segments(self.layout, self.rank, self.shm_dir)


def memory_tier_of(config: JobConfig, rank: int, world_size: int) -> MemoryTier | None:
    """This rank's tier for the job, or None: turned off (``checkpoint.memory_tier``, or
    checkpoints off), or no shared memory on this host (said once)."""
    checkpoint = config.checkpoint
    if not checkpoint.memory_tier.enabled or checkpoint.mode == CheckpointMode.OFF:
        return None
    if not os.path.isdir(segments.SHM_DIR):
        log.warning("memory tier off: this host has no %s", segments.SHM_DIR)
        return None
    return MemoryTier(config.layout, config.model_hash(), rank, world_size)
