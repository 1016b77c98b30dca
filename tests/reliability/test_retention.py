"""Retention keeps the newest k usable checkpoints (on local disk).

Reproduced before: after a fallback past a corrupt newest checkpoint, retention ranked by
step alone, so with keep_latest_k: 1 every good checkpoint just committed was deleted in
favour of the corrupt one; a crash then left nothing to resume from.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import committed_checkpoints
from infra.exit_codes import ExitCode
from tests.reliability.jobs import job_config, run_to_end, step_folder
from trainer.checkpoint.verify import verify_files

pytestmark = pytest.mark.slow


def _flip_a_byte(folder: Path) -> None:
    target = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_corrupt_checkpoint_is_quarantined_and_not_counted_by_retention(
    tmp_path: Path, data_url: str
) -> None:
    first = job_config(tmp_path, data_url, steps=10)
    code, out = run_to_end(first, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    assert [c.step for c in committed_checkpoints(first.layout)] == [10, 5]
    _flip_a_byte(Path(storage.local_path(step_folder(first.layout.url, 10)) or ""))

    # Attempt 1: falls back to step 5, checkpoints every step keeping only 1, dies at step 9.
    config = job_config(
        tmp_path,
        data_url,
        steps=12,
        checkpoint={"every_steps": 1, "keep_latest_k": 1},
        faults=[{"kind": "sigkill", "step": 9, "attempt": 1}],
    )
    code, out = run_to_end(config, tmp_path)
    assert code == 128 + signal.SIGKILL, out[-3000:]  # the launcher: the killed rank's code
    resumes = [(e.attempt, e.step) for e in read_events(config.layout) if e.name == "resume"]
    assert resumes == [(1, 5)], resumes
    quarantine = Path(storage.local_path(config.layout.checkpoints) or "") / "quarantine"
    [moved] = list(quarantine.iterdir())
    assert moved.name.startswith("step-000000010-")
    assert "checksum mismatch" in json.loads((moved / "_quarantined.json").read_text())["reason"]
    # The corrupt one no longer counts: the one kept is the newest good one.
    [kept] = committed_checkpoints(config.layout)
    assert kept.step in (7, 8), kept.step  # 8 may still have been uploading at the kill
    verify_files(kept.url, kept.manifest)

    code, out = run_to_end(config, tmp_path)  # attempt 2 resumes from it and finishes
    assert code == ExitCode.SUCCESS, out[-3000:]
    resumes = [(e.attempt, e.step) for e in read_events(config.layout) if e.name == "resume"]
    assert resumes == [(1, 5), (2, kept.step)], resumes
    [final] = committed_checkpoints(config.layout)
    assert final.step == 12 and final.manifest.anchor
