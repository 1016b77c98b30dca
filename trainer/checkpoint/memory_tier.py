"""The in-memory tier: this rank's newest training state in host shared memory.

A copy in ``/dev/shm`` costs a memory copy, not an upload, so it can be taken every few
steps; it outlives the process that wrote it, so a crash restored in process, a promoted
standby or a relaunch on the same host loses only the steps since the last copy. It holds
this rank's local tensors (a sharded table's local shards as plain tensors: a rank restores
only its own shards) as raw bytes laid out by a JSON tree, and this rank's JSON state: a
copy is one memory copy of the state (``begin``, on the training thread, from host tensors
or the checkpointer's staging copy of GPU ones) and a digest (``finish``, off it); nothing
is pickled, and nothing but bytes is read back.

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
import dataclasses
import json
import logging
import mmap
import os
import threading
import time
import zlib
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


def _digest(body: bytes | memoryview) -> bytes:
    """The header's digest of a slot's body: its CRC-32, in the first 4 of the field's 32
    bytes. It guards against a copy torn by its writer's death or overwritten meanwhile, not
    against an adversary, and it runs beside the training steps: CRC-32 takes a fifth of
    the time of BLAKE2b on the same bytes, on the cores the steps need."""
    return zlib.crc32(body).to_bytes(4, "little").ljust(32, b"\0")


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
            raise TornCopy(f"the copy has no {sorted(missing, key=str)[:3]}")
        for key, value in target.items():
            fill(value, saved[key])


# -- the copy's layout: a JSON tree in the meta, the tensors' raw bytes after it -------------
def _encode(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree as JSON, each tensor replaced by its index in ``tensors`` (appended). Dict
    keys keep their type (an optimizer's state is keyed by int)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"t": len(tensors) - 1}
    if isinstance(tree, dict):
        return {"d": [[key, _encode(value, tensors)] for key, value in tree.items()]}
    if isinstance(tree, list | tuple):
        return {"l": [_encode(value, tensors) for value in tree]}
    if tree is None or isinstance(tree, bool | int | float | str):
        return {"v": tree}
    raise TypeError(f"an in-memory copy holds tensors and plain values, not {type(tree)}")


def _decode(node: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    if "t" in node:
        return tensors[node["t"]]
    if "d" in node:
        return {key: _decode(value, tensors) for key, value in node["d"]}
    if "l" in node:
        return [_decode(value, tensors) for value in node["l"]]
    return node["v"]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (a view where it already is one)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TornCopy(f"unknown dtype {name!r} in the copy's layout")
    return dtype


_ALIGN = 64  # each tensor's bytes start on a cache line


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``: in chunks, since one write call may write less."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _CHUNK], offset + done)


_IOV_MAX = 1024  # buffers per pwritev call (Linux's UIO_MAXIOV)
_ZEROS = memoryview(bytes(_ALIGN))  # the padding between tensors


def _split_parts(parts: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``n`` bytes of ``parts`` and the rest, splitting the part that straddles."""
    first: list[memoryview] = []
    for i, part in enumerate(parts):
        if n < len(part):
            rest = [part[n:], *parts[i + 1 :]]
            return ([*first, part[:n]] if n else first), rest
        first.append(part)
        n -= len(part)
    return first, []


def _write_parts(fd: int, parts: list[memoryview], offset: int) -> None:
    """Write ``parts`` back to back from ``offset`` in as few calls as the kernel takes: a
    copy is a hundred small tensors, and one system call each was a large share of the CPU
    a copy takes from the steps beside it. Up to ``_IOV_MAX`` buffers and ``_CHUNK`` bytes
    per ``pwritev``; what a short write left is written buffer by buffer."""
    i = 0
    while i < len(parts):
        group, size = [], 0
        while i < len(parts) and len(group) < _IOV_MAX and (not group or size < _CHUNK):
            group.append(parts[i])
            size += len(parts[i])
            i += 1
        written = os.pwritev(fd, group, offset)
        if written < size:  # a short write: the rest, one buffer at a time
            at = 0
            for part in group:
                if at + len(part) > written:
                    skip = max(written - at, 0)
                    _pwrite_all(fd, part[skip:], offset + at + skip)
                at += len(part)
        offset += size


class PendingCopy:
    """A copy whose bytes are in its slot, not yet valid (no header): ``finish`` digests
    them and writes the header that makes the slot the newest copy. Holds the tier's write
    lock until then, so no other write picks the same slot."""

    def __init__(self, tier: MemoryTier, fd: int, path: str, header: Header, began: float):
        self._tier, self._fd, self.path = tier, fd, path
        self._header, self._began = header, began

    def finish(self) -> Written:
        """Digest the slot's bytes (zero-copy, off the training thread), then the header."""
        try:
            header = self._header
            with (
                mmap.mmap(self._fd, header.total_bytes, prot=mmap.PROT_READ) as mapped,
                memoryview(mapped) as view,
                view[HEADER_BYTES:] as body,
            ):
                digest = _digest(body)
            header = dataclasses.replace(header, digest=digest, written_at=time.time())
            os.pwrite(self._fd, header.pack(), 0)  # the flip: now the newest copy
            seconds = time.perf_counter() - self._began
            return Written(header.step, header.seq, header.total_bytes, seconds, self.path)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give the slot up unfinished (it stays headerless: never loaded)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._tier._writing.release()


class MemoryTier:
    """This rank's two slots for one job. ``begin`` (the copy, on the training thread) then
    ``finish`` (on the writer's thread), or ``write`` for both at once; ``copies`` and
    ``load`` from restore; ``remove`` once the job no longer needs them."""

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
        self._writing = threading.Lock()  # held from a copy's begin until its finish

    # -- writing --------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A copy begun and not yet finished: the next one must wait or be skipped."""
        return self._writing.locked()

    def begin(
        self,
        step: int,
        state: Any,
        extra: dict[str, Any],
        midway: Callable[[], None] = lambda: None,
        wait: bool = False,
    ) -> PendingCopy | None:
        """Copy ``state`` (nested dicts of tensors, a ShardedTensor as its local shards
        under ``__sharded_local__``) and ``extra`` (this rank's JSON state) of ``step`` into
        the slot that does not hold the newest copy. The bytes are written now, from the
        live tensors (the caller keeps them unchanged until this returns); the copy becomes
        valid at ``finish``. None, unless ``wait``, while another copy is unfinished.
        ``midway`` is called with half of the bytes written (a fault's hook)."""
        if not self._writing.acquire(blocking=wait):
            return None
        fd = -1
        try:
            began = time.perf_counter()
            tensors: list[torch.Tensor] = []
            tree = _encode(state, tensors)
            raws = [_raw(t) for t in tensors]
            layout, offset = [], 0
            for tensor, raw in zip(tensors, raws, strict=True):
                layout.append([str(tensor.dtype), list(tensor.shape), offset, raw.numel()])
                offset += -(-raw.numel() // _ALIGN) * _ALIGN
            meta = json.dumps(
                {"job_url": self.layout.url, "extra": extra, "tree": tree, "tensors": layout}
            ).encode()
            meta_bytes = -(-len(meta) // _ALIGN) * _ALIGN
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
                meta_bytes=meta_bytes,
                payload_bytes=offset,
                digest=bytes(32),
                config_hash=self.config_hash,
                job_key=self.key,
                written_at=0.0,
            )
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(fd, bytes(16), 0)  # invalid from here until the new header is written
            os.ftruncate(fd, header.total_bytes)
            # The meta, then each tensor's bytes and its padding, back to back, in two
            # writes split at half of the tensors' bytes, where ``midway`` is called.
            parts = [memoryview(meta.ljust(meta_bytes, b" "))]
            for raw in raws:
                parts.append(memoryview(raw.numpy()))
                if pad := -raw.numel() % _ALIGN:
                    parts.append(_ZEROS[:pad])
            half = offset // 2
            first, rest = _split_parts(parts, meta_bytes + half)
            _write_parts(fd, first, HEADER_BYTES)
            midway()
            _write_parts(fd, rest, HEADER_BYTES + meta_bytes + half)
            return PendingCopy(self, fd, path, header, began)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self._writing.release()
            raise

    def write(
        self,
        step: int,
        state: Any,
        extra: dict[str, Any],
        midway: Callable[[], None] = lambda: None,
    ) -> Written:
        """``begin`` (waiting for an unfinished copy) and ``finish`` in one call."""
        pending = self.begin(step, state, extra, midway, wait=True)
        assert pending is not None  # waited for the lock
        return pending.finish()

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
        match its digest (a writer killed mid-copy) or the slot changed meanwhile. No
        unpickling: the tensors are raw bytes laid out by the meta JSON."""
        header = copy.header
        data = bytearray(header.total_bytes)
        with open(copy.path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            read = fh.readinto(data)
        if size != header.total_bytes or read != header.total_bytes:
            raise TornCopy(f"{copy.path} changed since its header was read")
        if Header.unpack(bytes(data[:HEADER_BYTES])) != header:
            raise TornCopy(f"{copy.path} changed since its header was read")
        body = memoryview(data)[HEADER_BYTES:]
        if _digest(body) != header.digest:
            raise TornCopy(f"{copy.path} does not match its digest (torn)")
        meta = json.loads(bytes(body[: header.meta_bytes]))
        base = HEADER_BYTES + header.meta_bytes
        tensors = []
        for dtype_name, shape, at, size in meta["tensors"]:
            dtype = _dtype(dtype_name)
            if not size:
                tensors.append(torch.empty(shape, dtype=dtype))
                continue
            raw = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=base + at)
            tensors.append(raw.view(dtype).view(shape))
        return _decode(meta["tree"], tensors), meta["extra"]

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
