"""Commit protocol pieces: manifests, verification, retention (no training needed)."""

from __future__ import annotations

from typing import Any

import pytest

from infra import storage
from infra.checkpoint_chain import ChainBroken, chain_of
from infra.checkpoint_manifest import (
    MANIFEST,
    CheckpointError,
    CommitKind,
    FileEntry,
    Manifest,
    committed_checkpoints,
)
from infra.job_layout import JobLayout, step_dir_name
from trainer.checkpoint.retention import purge_old, purge_uncommitted
from trainer.checkpoint.verify import sha256_url, verify_files


def _fake_checkpoint(
    job_url: str, step: int, commit: bool = True, anchor: bool = False, previous: int | None = None
) -> str:
    """A committed folder; with ``previous``, a delta linked to that step's checkpoint."""
    url = storage.join(JobLayout.at(job_url).checkpoints, step_dir_name(step))
    data = f"weights-{step}".encode()
    storage.write_bytes(storage.join(url, "__0_0.distcp"), data)
    if commit:
        entry = FileEntry(len(data), sha256_url(storage.join(url, "__0_0.distcp")))
        files = {"__0_0.distcp": entry}
        chain: dict[str, Any] = {}
        if previous is not None:
            base = next(
                c for c in committed_checkpoints(JobLayout.at(job_url)) if c.step == previous
            )
            base_step = base.manifest.base_step if base.manifest.base_step is not None else previous
            chain = {"kind": CommitKind.DELTA, "base_step": base_step, "previous_step": previous}
        manifest = Manifest(
            step=step, world_size=1, config_hash="h", files=files, anchor=anchor, **chain
        )
        storage.write_text(storage.join(url, MANIFEST), manifest.to_json())
    return url


@pytest.fixture(params=["file", "memory"])
def job_url(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/job"
    return f"memory://ckpt-tests/{tmp_path.name}/job"


def test_only_manifested_folders_are_committed(job_url: str) -> None:
    _fake_checkpoint(job_url, 10)
    _fake_checkpoint(job_url, 20)
    _fake_checkpoint(job_url, 30, commit=False)  # crashed before its manifest
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [20, 10]


def test_verify_detects_corruption_and_missing_files(job_url: str) -> None:
    url = _fake_checkpoint(job_url, 10)
    ckpt = committed_checkpoints(JobLayout.at(job_url))[0]
    verify_files(url, ckpt.manifest)  # intact: no error
    storage.write_bytes(storage.join(url, "__0_0.distcp"), b"weights-1X")  # same size, new bytes
    with pytest.raises(CheckpointError, match="checksum mismatch in __0_0.distcp"):
        verify_files(url, ckpt.manifest)
    storage.write_bytes(storage.join(url, "__0_0.distcp"), b"short")
    with pytest.raises(CheckpointError, match="has 5 bytes"):
        verify_files(url, ckpt.manifest)
    storage.remove(storage.join(url, "__0_0.distcp"))
    with pytest.raises(CheckpointError, match="missing file"):
        verify_files(url, ckpt.manifest)


def test_unreadable_manifest_is_skipped_not_fatal(job_url: str) -> None:
    _fake_checkpoint(job_url, 10)
    bad = _fake_checkpoint(job_url, 20)
    storage.write_text(storage.join(bad, MANIFEST), '{"step": 20, "files": ')
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [10]


def test_retention_keeps_the_newest_eval_steps_for_the_side_evaluator(job_url: str) -> None:
    for step in range(10, 110, 10):
        _fake_checkpoint(job_url, step)
    purge_old(JobLayout.at(job_url), keep_latest_k=2, eval_every=20)
    # 100 and 90 are the latest k; 100, 80 and 60 the newest eval steps (EVAL_BACKLOG = 3).
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [100, 90, 80, 60]
    purge_old(JobLayout.at(job_url), keep_latest_k=2)  # no side evaluator: the latest k only
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [100, 90]


def test_retention_with_an_eval_at_every_step_keeps_the_eval_backlog(job_url: str) -> None:
    """``eval_every: 1`` makes every step an eval step: the newest EVAL_BACKLOG are kept."""
    for step in (1, 2, 3, 4, 5):
        _fake_checkpoint(job_url, step)
    purge_old(JobLayout.at(job_url), keep_latest_k=1, eval_every=1)
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [5, 4, 3]


def test_retention_keeps_latest_k_anchor_and_inflight(job_url: str) -> None:
    _fake_checkpoint(job_url, 5, anchor=True)
    for step in (10, 20, 30, 40):
        _fake_checkpoint(job_url, step)
    _fake_checkpoint(job_url, 15, commit=False)  # stale debris: older than the newest commit
    _fake_checkpoint(job_url, 50, commit=False)  # newer than the newest commit: in flight
    purge_old(JobLayout.at(job_url), keep_latest_k=2)
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [40, 30, 5]
    names = storage.listdir(JobLayout.at(job_url).checkpoints)
    assert step_dir_name(50) in names and step_dir_name(15) not in names
    purge_uncommitted(JobLayout.at(job_url))  # at the start of an attempt nothing is in flight
    assert step_dir_name(50) not in storage.listdir(JobLayout.at(job_url).checkpoints)


def _steps(job_url: str) -> list[int]:
    return [c.step for c in committed_checkpoints(JobLayout.at(job_url))]


def test_retention_keeps_the_base_and_links_a_kept_delta_needs(job_url: str) -> None:
    """Chains 10 <- 20 <- 30 and 40 <- 50: keeping the latest two (50, 40) lets the first
    chain go; keeping three (50, 40, 30) keeps 30's base and link as well."""
    _fake_checkpoint(job_url, 10)
    _fake_checkpoint(job_url, 20, previous=10)
    _fake_checkpoint(job_url, 30, previous=20)
    _fake_checkpoint(job_url, 40)
    _fake_checkpoint(job_url, 50, previous=40)
    purge_old(JobLayout.at(job_url), keep_latest_k=3)
    assert _steps(job_url) == [50, 40, 30, 20, 10]
    purge_old(JobLayout.at(job_url), keep_latest_k=1)  # 50 needs 40, and nothing else
    assert _steps(job_url) == [50, 40]


def test_a_chain_names_the_first_link_it_lacks(job_url: str) -> None:
    _fake_checkpoint(job_url, 10)
    _fake_checkpoint(job_url, 20, previous=10)
    _fake_checkpoint(job_url, 30, previous=20)
    committed = committed_checkpoints(JobLayout.at(job_url))
    assert [c.step for c in chain_of(committed[0], committed)] == [10, 20, 30]
    with pytest.raises(ChainBroken, match="link at step 20 is not committed") as err:
        chain_of(committed[0], [c for c in committed if c.step != 20])
    assert err.value.link_step == 20


def test_spools_of_killed_attempts_are_removed_and_live_ones_kept(tmp_path, monkeypatch) -> None:
    import os
    import subprocess

    from trainer.checkpoint.commit import remove_stale_spools

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"ett-ckpt-job-a-r0-p{dead.pid}-x1"
    live = tmp_path / f"ett-ckpt-job-a-r0-p{os.getpid()}-x2"
    other_rank = tmp_path / f"ett-ckpt-job-a-r1-p{dead.pid}-x3"
    other_job = tmp_path / f"ett-ckpt-job-a-b-r0-p{dead.pid}-x4"
    for folder in (stale, live, other_rank, other_job):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    assert remove_stale_spools("job-a", 0) == [str(stale)]
    assert not stale.exists() and live.exists() and other_rank.exists() and other_job.exists()


def test_retention_never_deletes_the_checkpoint_just_committed(job_url: str) -> None:
    """A newer committed step (another lineage, or a corrupt one not yet found) must not
    push out the checkpoint this process has just written and verified."""
    _fake_checkpoint(job_url, 30)
    just = _fake_checkpoint(job_url, 10)
    _fake_checkpoint(job_url, 5)
    purge_old(JobLayout.at(job_url), keep_latest_k=1, keep=just)
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [30, 10]


def test_retention_spares_uncommitted_folders_newer_than_the_checkpoint_just_committed(
    job_url: str,
) -> None:
    """Debris is judged against the step this process just committed, not a newer commit of
    another lineage: the folder after it may be this process's save in flight."""
    _fake_checkpoint(job_url, 30)
    just = _fake_checkpoint(job_url, 10)
    _fake_checkpoint(job_url, 5, commit=False)  # debris, older than the one just committed
    _fake_checkpoint(job_url, 20, commit=False)  # newer: may be in flight
    deleted = purge_old(JobLayout.at(job_url), keep_latest_k=2, keep=just)
    assert deleted == [storage.join(JobLayout.at(job_url).checkpoints, step_dir_name(5))]
    assert step_dir_name(20) in storage.listdir(JobLayout.at(job_url).checkpoints)


def test_quarantine_moves_a_checkpoint_out_of_the_committed_ones(job_url: str) -> None:
    import json

    from infra.checkpoint_manifest import QUARANTINE
    from trainer.checkpoint.verify import quarantine

    _fake_checkpoint(job_url, 10)
    bad = _fake_checkpoint(job_url, 20)
    moved = quarantine(bad, "checksum mismatch in __0_0.distcp")
    assert [c.step for c in committed_checkpoints(JobLayout.at(job_url))] == [10]
    assert step_dir_name(20) not in storage.listdir(JobLayout.at(job_url).checkpoints)
    assert moved.startswith(
        storage.join(JobLayout.at(job_url).checkpoints, QUARANTINE, step_dir_name(20))
    )
    assert storage.exists(storage.join(moved, "__0_0.distcp"))
    assert storage.exists(storage.join(moved, MANIFEST))
    reason = json.loads(storage.read_text(storage.join(moved, "_quarantined.json")))["reason"]
    assert reason == "checksum mismatch in __0_0.distcp"
    purge_old(JobLayout.at(job_url), keep_latest_k=1)  # retention leaves the quarantine alone
    assert storage.exists(storage.join(moved, MANIFEST))
