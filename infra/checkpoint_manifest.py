"""Checkpoint layout and the manifest that commits a checkpoint: the part every layer reads.

    <job>/checkpoints/step-000000120/
        .metadata, __0_0.distcp, ...   DCP files (tensors only: loaded with weights_only)
        trainer_state.rank000.json     step, data-loader position (one file per rank)
        config.yaml                    the job config, so a publisher can rebuild the model
        _done.rank000.<nonce>.json     each rank's files and checksums, for this save only
        manifest.json                  written LAST: the checkpoint exists once this exists
    <job>/checkpoints/quarantine/step-000000120-<time>/
        a checkpoint found corrupt, moved out of the committed ones (kept for inspection)

A reader only ever looks at folders that have a manifest, so a crash at any moment before
the manifest (staging, mid-upload) leaves the previous committed checkpoint as the latest.
A committed folder is never written again. The manifest lists every file with its size and
SHA-256, checked before loading (trainer/checkpoint/manifest.py), the save's nonce (done
markers of an earlier try at the same step can never complete a later one), and whether the
checkpoint is the job's anchor. The whole protocol: docs/checkpoints.md.

Here, not in the trainer, because the orchestrator finds the anchor from these manifests
(tasks/events.py) and must not import the trainer or torch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from importlib import metadata
from typing import Any

from infra import storage
from infra.job_layout import JobLayout

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


def done_marker(rank: int, nonce: str) -> str:
    return f"_done.rank{rank:03d}.{nonce}.json"


def failed_marker(rank: int, nonce: str) -> str:
    return f"_failed.rank{rank:03d}.{nonce}.json"


def rank_state_name(rank: int) -> str:
    """A rank's JSON state (step, data-loader position) in a checkpoint folder."""
    return f"trainer_state.rank{rank:03d}.json"


def library_versions() -> dict[str, str]:
    """Versions of the libraries that wrote a checkpoint, from the installed packages (read
    without importing them: a process that only reads manifests never loads torch)."""
    versions = {}
    for name in ("torch", "torchrec"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # the publisher may run without TorchRec
            continue
    return versions


class CommitKind(StrEnum):
    """What a commit wrote (docs/checkpoints.md, incremental checkpoints)."""

    FULL = "full"  # the whole state: restores alone
    DELTA = "delta"  # the dense state and the embedding rows touched since ``previous_step``


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
    # What a restore on another world size may want to know (issue 29): how the writing
    # ranks sharded each table ({table: {sharding_type, ranks}}), and the job's data
    # position after the step (trainer/data/loader.py), the same on every rank.
    plan: dict[str, Any] = field(default_factory=dict)
    data_position: dict[str, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    versions: dict[str, str] = field(default_factory=library_versions)
    format_version: int = FORMAT_VERSION
    # The chain of incremental checkpoints: a delta restores on top of ``previous_step``,
    # down to the full snapshot at ``base_step`` (a full one's base is its own step).
    kind: CommitKind = CommitKind.FULL
    base_step: int | None = None
    previous_step: int | None = None

    @property
    def bytes(self) -> int:
        """What this commit wrote to storage."""
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            data: dict[str, Any] = json.loads(text)
            files = {name: FileEntry(**entry) for name, entry in data.pop("files").items()}
            kind = CommitKind(data.pop("kind", CommitKind.FULL))
            return cls(files=files, kind=kind, **data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorrupt(f"checkpoint manifest {source} is unreadable: {exc}") from exc


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


def committed_checkpoints(layout: JobLayout) -> list[CommittedCheckpoint]:
    """Committed checkpoints of a job, newest first; folders without a manifest are skipped
    and unreadable manifests are logged and skipped."""
    root = layout.checkpoints
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
