"""Checkpoint layout and the manifest that commits a checkpoint.

    <job_url>/checkpoints/step-000000120/
        .metadata, __0_0.distcp, ...   DCP files (tensors only: loaded with weights_only)
        trainer_state.rank000.json     step, data-loader position (one file per rank)
        config.yaml                    the job config, so a publisher can rebuild the model
        manifest.json                  written LAST: the checkpoint exists once this exists

A reader only ever looks at folders that have a manifest, so a crash at any moment before
the manifest (staging, mid-upload) leaves the previous committed checkpoint as the latest.
The manifest lists every file with its size and SHA-256, checked before loading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infra import storage

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and says why."""


def checkpoints_url(job_url: str) -> str:
    return storage.join(job_url, "checkpoints")


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


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
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint manifest {source} is unreadable: {exc}") from exc


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
            raise CheckpointError(f"checkpoint {ckpt_url} is missing file {name}")
        size = size_of(path)
        if size != entry.size:
            raise CheckpointError(
                f"checkpoint {ckpt_url} is corrupt: {name} has {size} bytes, manifest says "
                f"{entry.size}"
            )
        if digest_of(path) != entry.sha256:
            raise CheckpointError(f"checkpoint {ckpt_url} is corrupt: checksum mismatch in {name}")
