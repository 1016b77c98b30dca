"""Checkpoint verification and quarantine: every file's size and SHA-256 against the manifest,
and a corrupt checkpoint moved out of the committed ones.

The manifest format and the list of committed checkpoints live in
infra/checkpoint_manifest.py (the orchestrator reads them too), the paths in
infra/job_layout.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid

from infra import storage
from infra.checkpoint_manifest import MANIFEST, QUARANTINE, CheckpointCorrupt, Manifest

log = logging.getLogger(__name__)


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
    storage.call(f"copy {src}", lambda: fs.copy(src_path, dst_path))


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
