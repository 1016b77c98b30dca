"""The in-memory checkpoint tier's segments on this host: their names, their header, and
their removal. Torch-free, so the orchestrator, which owns a job's segments and removes
them when the job ends, can use it (the trainer's side is trainer/checkpoint/memory_tier.py).

Each rank keeps two slot files in ``/dev/shm`` (tmpfs: host memory that outlives the
process that wrote it)::

    /dev/shm/ett-mem-<job id>-<job key>-r<rank>-a      slot a
    /dev/shm/ett-mem-<job id>-<job key>-r<rank>-b      slot b

``<job key>`` is a hash of the job's storage URL, so two jobs with the same id under
different storage roots never share a segment. A slot is a page of header, then the meta
JSON (this rank's data position, the job's URL, the layout of the tensors), then the
tensors' raw bytes. The header says which copy it holds (sequence number, step, rank, world
size), whose it is (job key, model-config hash) and the digest (a CRC-32) of everything
after it; it ends with a CRC of itself, so a header torn by a killed writer is never read as valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
import zlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from infra.job_layout import JobLayout

SHM_DIR = "/dev/shm"
PREFIX = "ett-mem-"
MAGIC = b"ETTMEM03"  # 03: a CRC-32 digest (02: BLAKE2b; 01 held a torch.save payload)
HEADER_BYTES = 4096  # one page: the meta and the tensors start page-aligned
# magic, seq, step, rank, world size, meta bytes, payload bytes, digest, config hash,
# job key, written at (Unix s); then the CRC-32 of all of that.
_FIELDS = struct.Struct("<8sQQIIQQ32s16s16sd")
_CRC = struct.Struct("<I")


class Slot(StrEnum):
    """The two buffers of a rank's double-buffered copy."""

    A = "a"
    B = "b"


def job_key(layout: JobLayout) -> str:
    """16 hex characters naming the job by its storage URL (its id alone can repeat)."""
    return hashlib.blake2b(layout.url.encode(), digest_size=8).hexdigest()


def segment_prefix(layout: JobLayout) -> str:
    """The name every segment of the job starts with."""
    return f"{PREFIX}{layout.job_id[:64]}-{job_key(layout)}-"


def slot_path(layout: JobLayout, rank: int, slot: Slot, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{segment_prefix(layout)}r{rank:05d}-{slot}")


def job_segments(layout: JobLayout, rank: int | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """This host's segments of the job (of one rank, if given)."""
    start = segment_prefix(layout) + ("" if rank is None else f"r{rank:05d}-")
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(os.path.join(shm_dir, n) for n in names if n.startswith(start))


def remove_segments(
    layout: JobLayout, rank: int | None = None, shm_dir: str = SHM_DIR
) -> list[str]:
    """Remove this host's segments of the job (of one rank, if given); returns their paths."""
    removed = []
    for path in job_segments(layout, rank, shm_dir):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def job_segments_all(shm_dir: str = SHM_DIR) -> list[str]:
    """Every job's segments on this host (``ett`` cleanup, the tests' leak check)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(os.path.join(shm_dir, n) for n in names if n.startswith(PREFIX))


def job_url_of(path: str, wait_s: float = 0.0) -> str | None:
    """The job URL a segment's copy names; None when it has no valid header (torn, or
    still being written after ``wait_s``). FileNotFoundError when it is gone."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            header = read_header(path)
            return str(read_meta(path, header)["job_url"])
        except FileNotFoundError:
            raise
        except (TornHeader, OSError, ValueError, KeyError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


class TornHeader(ValueError):
    """A slot whose header is not a complete, valid one (never written, or torn)."""


@dataclass(frozen=True)
class Header:
    """One slot's header: which copy it holds and whose it is."""

    seq: int
    step: int
    rank: int
    world_size: int
    meta_bytes: int
    payload_bytes: int
    digest: bytes  # BLAKE2b-256 of meta + payload
    config_hash: str
    job_key: str
    written_at: float

    def pack(self) -> bytes:
        fields = _FIELDS.pack(
            MAGIC,
            self.seq,
            self.step,
            self.rank,
            self.world_size,
            self.meta_bytes,
            self.payload_bytes,
            self.digest,
            self.config_hash.encode()[:16],
            self.job_key.encode()[:16],
            self.written_at,
        )
        return fields + _CRC.pack(zlib.crc32(fields))

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        """Raises TornHeader unless ``raw`` starts with a complete, valid header."""
        size = _FIELDS.size
        if len(raw) < size + _CRC.size or raw[:8] != MAGIC:
            raise TornHeader("no header (never written, or being written)")
        (crc,) = _CRC.unpack_from(raw, size)
        if zlib.crc32(raw[:size]) != crc:
            raise TornHeader("torn header (CRC mismatch)")
        _, seq, step, rank, world, meta, payload, digest, cfg, key, at = _FIELDS.unpack_from(raw)
        text = [raw.rstrip(b"\0").decode(errors="replace") for raw in (cfg, key)]
        return cls(seq, step, rank, world, meta, payload, digest, *text, at)

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.meta_bytes + self.payload_bytes


def read_header(path: str) -> Header:
    """The slot's header; TornHeader when it has none that is valid, FileNotFoundError when
    the slot does not exist."""
    with open(path, "rb") as fh:
        return Header.unpack(fh.read(_FIELDS.size + _CRC.size))


def read_meta(path: str, header: Header) -> dict[str, Any]:
    """The slot's meta JSON (not checked against the digest: a peek, not a restore)."""
    with open(path, "rb") as fh:
        fh.seek(HEADER_BYTES)
        return json.loads(fh.read(header.meta_bytes))
