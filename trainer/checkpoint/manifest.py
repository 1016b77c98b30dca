"""Checkpoint layout and the manifest that commits a checkpoint.

    <job_url>/checkpoints/step-000000120/
        .metadata, __0_0.distcp, ...   DCP files (tensors only: loaded with weights_only)
        trainer_state.rank000.json     step, data-loader position (one file per rank)
        config.yaml                    the job config, so a publisher can rebuild the model
        _done.rank000.<nonce>.json     each rank's files and checksums, for this save only
        manifest.json                  written LAST: the checkpoint exists once this exists
    <job_url>/checkpoints/quarantine/step-000000120-<time>/
        a checkpoint found corrupt, moved out of the committed ones (kept for inspection)

A reader only ever looks at folders that have a manifest, so a crash at any moment before
the manifest (staging, mid-upload) leaves the previous committed checkpoint as the latest.
A committed folder is never written again. The manifest lists every file with its size and
SHA-256, checked before loading, and the save's nonce: done-markers of an earlier try at
the same step can never complete a later one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infra import storage

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and says why."""


class CheckpointCorrupt(CheckpointError):
    """Verified corruption: a file listed in the manifest is missing, has another size or
    checksum, or the manifest itself is unreadable. Only this lets restore fall back to an
    older checkpoint: a storage error proves nothing about the checkpoint."""


def checkpoints_url(job_url: str) -> str:
    return storage.join(job_url, "checkpoints")


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_url(job_url: str, step: int) -> str:
    return storage.join(checkpoints_url(job_url), step_dir_name(step))


def done_marker(rank: int, nonce: str) -> str:
    return f"_done.rank{rank:03d}.{nonce}.json"


def failed_marker(rank: int, nonce: str) -> str:
    return f"_failed.rank{rank:03d}.{nonce}.json"


def library_versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    try:
        import torchrec

        versions["torchrec"] = getattr(torchrec, "__version__", "unknown")
    except ImportError:  # the publisher may run without TorchRec's training extras
        pass
    return versions


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    config_hash: str
    files: dict[str, FileEntry]
    anchor: bool = False
    job_id: str = ""
    nonce: str = ""  # the save that wrote it (matches its done-markers)
    created: float = field(default_factory=time.time)
    versions: dict[str, str] = field(default_factory=library_versions)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            data: dict[str, Any] = json.loads(text)
            files = {name: FileEntry(**entry) for name, entry in data.pop("files").items()}
            return cls(files=files, **data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorrupt(f"checkpoint manifest {source} is unreadable: {exc}") from exc


def sha256_file(path: str, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_url(url: str, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with storage.open_file(url, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class CommittedCheckpoint:
    url: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def read_manifest(ckpt_url: str) -> Manifest:
    url = storage.join(ckpt_url, MANIFEST)
    try:
        text = storage.read_text(url)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{ckpt_url} is not a committed checkpoint (no {MANIFEST})") from exc
    return Manifest.from_json(text, url)


def committed_checkpoints(job_url: str) -> list[CommittedCheckpoint]:
    """Committed checkpoints of a job, newest first; folders without a manifest are skipped
    and unreadable manifests are logged and skipped."""
    root = checkpoints_url(job_url)
    found = []
    for name in storage.listdir(root):
        if not name.startswith("step-"):
            continue
        url = storage.join(root, name)
        if not storage.exists(storage.join(url, MANIFEST)):
            continue
        try:
            found.append(CommittedCheckpoint(url, read_manifest(url)))
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return sorted(found, key=lambda c: c.step, reverse=True)


def verify_files(ckpt_url: str, manifest: Manifest, local_dir: str | None = None) -> None:
    """Check every file's size and SHA-256 (in ``local_dir`` when already downloaded)."""
    for name, entry in sorted(manifest.files.items()):
        if local_dir is not None:
            path = os.path.join(local_dir, name)
            present, size_of, digest_of = os.path.exists(path), os.path.getsize, sha256_file
        else:
            path = storage.join(ckpt_url, name)
            present, size_of, digest_of = storage.exists(path), storage.size, sha256_url
        if not present:
            raise CheckpointCorrupt(f"checkpoint {ckpt_url} is missing file {name}")
        size = size_of(path)
        if size != entry.size:
            raise CheckpointCorrupt(
                f"checkpoint {ckpt_url} is corrupt: {name} has {size} bytes, manifest says "
                f"{entry.size}"
            )
        if digest_of(path) != entry.sha256:
            raise CheckpointCorrupt(
                f"checkpoint {ckpt_url} is corrupt: checksum mismatch in {name}"
            )


def _copy(src: str, dst: str) -> None:
    """Copy one object within a store (server-side on S3)."""
    fs, src_path = storage.split(src)
    _, dst_path = storage.split(dst)
    storage.with_retries(f"copy {src}", lambda: fs.copy(src_path, dst_path))


def quarantine(ckpt_url: str, reason: str) -> str:
    """Move a corrupt checkpoint out of the committed ones, to ``checkpoints/quarantine/``:
    it is never listed, resumed from or counted by retention again, and stays for
    inspection. The manifest goes first (copied, then removed), so an interruption leaves at
    worst an uncommitted folder, which the next attempt clears. Returns the new URL."""
    name = ckpt_url.rstrip("/").rsplit("/", 1)[-1]
    root = ckpt_url.rstrip("/").rsplit("/", 1)[0]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = storage.join(root, QUARANTINE, f"{name}-{stamp}-{uuid.uuid4().hex[:6]}")
    local, dest = storage.local_path(ckpt_url), storage.local_path(target)
    if local is not None and dest is not None:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(local, dest)  # atomic on one filesystem
    else:
        names = [n for n in storage.listdir(ckpt_url) if n != MANIFEST]
        if storage.exists(storage.join(ckpt_url, MANIFEST)):
            _copy(storage.join(ckpt_url, MANIFEST), storage.join(target, MANIFEST))
            storage.remove(storage.join(ckpt_url, MANIFEST))  # no longer committed
        for entry in names:
            _copy(storage.join(ckpt_url, entry), storage.join(target, entry))
        storage.remove(ckpt_url, recursive=True)
    storage.write_text(storage.join(target, "_quarantined.json"), json.dumps({"reason": reason}))
    log.warning("quarantined checkpoint %s as %s: %s", ckpt_url, target, reason)
    return target
