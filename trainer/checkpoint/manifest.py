"""Checkpoint verification: every file's size and SHA-256 against the manifest.

The layout, the manifest format and the list of committed checkpoints live in
infra/checkpoints.py (the orchestrator reads them too); they are re-exported here.
"""

from __future__ import annotations

import hashlib
import os

from infra import storage
from infra.checkpoints import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CommittedCheckpoint,
    FileEntry,
    Manifest,
    checkpoints_url,
    committed_checkpoints,
    library_versions,
    read_manifest,
    step_dir_name,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CommittedCheckpoint",
    "FileEntry",
    "Manifest",
    "checkpoints_url",
    "committed_checkpoints",
    "library_versions",
    "read_manifest",
    "sha256_file",
    "sha256_url",
    "step_dir_name",
    "verify_files",
]


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
