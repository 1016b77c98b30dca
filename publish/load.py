"""Anchor checkpoint -> the unsharded RankingModel on CPU, whatever world size trained it
(a delta checkpoint composed over its chain: trainer/checkpoint/compose.py).

Reads the manifest, downloads and verifies every file against it (size + SHA-256) BEFORE
anything is deserialised, rebuilds the job config from the checkpoint's own config.yaml,
and loads the model's weights with DCP in a single process (``no_dist=True``): DCP reshards
the row-/table-wise shards written by N ranks into the plain tensors of one unsharded model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.api import CheckpointException

from infra import storage
from infra.checkpoint_manifest import MANIFEST, CheckpointError, CommittedCheckpoint, Manifest
from infra.config_sources import ConfigError
from infra.job_layout import JobLayout
from infra.settings import JobConfig, load_config
from infra.tracking.logged_models import anchor_key
from publish.settings import PublishError
from trainer.checkpoint.compose import load_model
from trainer.model import RankingModel
from trainer.unsharded import cpu_model

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class AnchorRef:
    """A committed checkpoint as named by its manifest (nothing downloaded yet)."""

    uri: str
    manifest: Manifest
    manifest_sha256: str

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def key(self) -> str:
        """Identity of this anchor for idempotent publishing: URI + manifest checksum
        (a checkpoint rewritten at the same URL gets a new key)."""
        return anchor_key(self.uri, self.manifest_sha256)

    @property
    def layout(self) -> JobLayout | None:
        """The job it belongs to (None for a checkpoint outside a job's folder)."""
        return JobLayout.of_checkpoint(self.uri)


@dataclass
class LoadedAnchor:
    ref: AnchorRef
    config: JobConfig
    model: RankingModel
    local_dir: str


def resolve(uri: str) -> AnchorRef:
    """Read the manifest of the checkpoint at ``uri``; PublishError when there is none."""
    uri = uri.rstrip("/")
    url = storage.join(uri, MANIFEST)
    try:
        text = storage.read_text(url)
    except FileNotFoundError:
        raise PublishError(f"{uri} is not a committed checkpoint (no {MANIFEST})") from None
    except OSError as exc:
        raise PublishError(f"cannot read the manifest of {uri}: {exc}") from exc
    try:
        manifest = Manifest.from_json(text, url)
    except CheckpointError as exc:
        raise PublishError(str(exc)) from exc
    return AnchorRef(uri, manifest, hashlib.sha256(text.encode()).hexdigest())


def check_expected(ref: AnchorRef, step: int | None, job_id: str | None, anchor: bool) -> None:
    """The caller's view (an event payload) must agree with the manifest."""
    if step is not None and step != ref.step:
        raise PublishError(f"{ref.uri} holds step {ref.step}, but step {step} was requested")
    if job_id and ref.manifest.job_id and job_id != ref.manifest.job_id:
        raise PublishError(
            f"{ref.uri} belongs to job {ref.manifest.job_id!r}, but job {job_id!r} was requested"
        )
    if anchor and not ref.manifest.anchor:
        raise PublishError(
            f"{ref.uri} is a committed checkpoint but not an anchor; publish the job's anchor "
            "or set require_anchor=False"
        )


def read_config(ref: AnchorRef) -> JobConfig:
    """The job config the checkpoint was written with, checked against the manifest's
    checksum and model hash (read alone, before the weights are downloaded)."""
    entry = ref.manifest.files.get(CONFIG_FILE)
    if entry is None:
        raise PublishError(f"checkpoint {ref.uri} has no {CONFIG_FILE}: cannot rebuild the model")
    try:
        raw = storage.read_bytes(storage.join(ref.uri, CONFIG_FILE))
    except OSError as exc:
        raise PublishError(f"cannot read {CONFIG_FILE} of {ref.uri}: {exc}") from exc
    if len(raw) != entry.size or hashlib.sha256(raw).hexdigest() != entry.sha256:
        raise PublishError(
            f"refusing to publish: checkpoint {ref.uri} is corrupt: checksum mismatch in "
            f"{CONFIG_FILE}"
        )
    with tempfile.TemporaryDirectory(prefix="ett-publish-config-") as tmp:
        path = os.path.join(tmp, CONFIG_FILE)
        with open(path, "wb") as fh:
            fh.write(raw)
        try:
            config = load_config(path)
        except ConfigError as exc:
            raise PublishError(
                f"checkpoint {ref.uri}: its {CONFIG_FILE} is unusable: {exc}"
            ) from exc
    if config.model_hash() != ref.manifest.config_hash:
        raise PublishError(
            f"checkpoint {ref.uri}: {CONFIG_FILE} describes model {config.model_hash()}, the "
            f"manifest says {ref.manifest.config_hash} (an ETT_MODEL__*/ETT_DATA__* override?)"
        )
    return config


def load(ref: AnchorRef, config: JobConfig, workdir: str) -> LoadedAnchor:
    """Download + verify every file (into ``workdir`` for object storage), then build the
    unsharded model on CPU and load its weights from the DCP shards."""
    model = cpu_model(config)
    try:
        local = load_model(CommittedCheckpoint(ref.uri, ref.manifest), model, workdir)
    except CheckpointError as exc:
        raise PublishError(f"refusing to publish: {exc}") from exc
    except storage.StorageError as exc:
        raise PublishError(f"cannot download checkpoint {ref.uri}: {exc}") from exc
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as exc:
        # DCP wraps a reader's error in CheckpointException, a BaseException.
        raise PublishError(
            f"checkpoint {ref.uri}: model weights could not be loaded: {exc}"
        ) from exc
    model.eval()
    log.info(
        "loaded %s (step %d, written by %d ranks) into one CPU process",
        ref.uri,
        ref.step,
        ref.manifest.world_size,
    )
    return LoadedAnchor(ref, config, model, local)


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as plain, contiguous CPU tensors (loadable with weights_only)."""
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}
