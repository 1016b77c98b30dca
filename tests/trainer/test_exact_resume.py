"""A job killed with SIGKILL at several steps (one while a checkpoint upload is in flight)
and resumed each time ends bit-identical to an uninterrupted run with the same seed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from infra import storage
from infra.exit_codes import ExitCode
from infra.ledger import read_events
from tests.factories import run_trainer, tiny_config, write_dataset
from trainer.checkpoint.manifest import committed_checkpoints


def load_flat(ckpt_url: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, unsharded, in one process (public DCP API only)."""
    path = storage.local_path(ckpt_url)
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def run_until_done(config, tmp_path, nproc: int, max_attempts: int = 6) -> list[int]:
    codes = []
    for _ in range(max_attempts):
        result = run_trainer(config, tmp_path, nproc=nproc)
        codes.append(result.returncode)
        if result.returncode == ExitCode.SUCCESS:
            return codes
        assert "Traceback" not in result.stdout, result.stdout[-3000:]
    raise AssertionError(f"job did not finish in {max_attempts} attempts: {codes}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "faults"),
    [
        (
            1,
            [
                {"kind": "sigkill", "step": 7, "attempt": 0},
                {"kind": "sigkill_mid_upload", "step": 15, "attempt": 1},
                {"kind": "sigkill", "step": 23, "attempt": 2},
            ],
        ),
        (
            2,
            [
                {"kind": "sigkill_mid_upload", "step": 10, "attempt": 0},
                {"kind": "sigkill", "step": 18, "attempt": 1},
            ],
        ),
    ],
    ids=["1proc", "2proc"],
)
def test_killed_and_resumed_run_is_bit_identical(tmp_path, nproc: int, faults) -> None:
    sections = {
        "train": {"steps": 25, "eval_every": 0, "eval_rows": 256, "log_every": 5},
        "checkpoint": {"mode": "async_staged", "every_steps": 5, "keep_latest_k": 2},
    }
    clean = tiny_config(tmp_path, job_id="clean", **sections)
    write_dataset(clean)
    assert run_until_done(clean, tmp_path, nproc) == [0]

    killed = tiny_config(tmp_path, job_id="killed", faults=faults, **sections)
    codes = run_until_done(killed, tmp_path, nproc)
    assert len(codes) == len(faults) + 1 and all(c != 0 for c in codes[:-1]), codes

    [a, b] = [committed_checkpoints(c.job_url)[0] for c in (clean, killed)]
    assert a.step == b.step == 25 and a.manifest.anchor and b.manifest.anchor
    left, right = load_flat(a.url), load_flat(b.url)
    assert left.keys() == right.keys()
    assert any(k.startswith("optim.") for k in left), "optimizer state must be checkpointed"
    differing = [k for k in left if not torch.equal(left[k], right[k])]
    assert differing == [], f"not bit-identical: {differing[:5]}"

    # Each attempt resumed from a COMMITTED checkpoint at or before its kill (which one
    # depends on whether the last async upload had finished); a kill mid-upload of step s
    # left step s uncommitted, so the next attempt resumed from before s.
    resumes = {e.attempt: e.step for e in read_events(killed.job_url) if e.name == "resume"}
    assert resumes, "no attempt resumed from a checkpoint"
    for fault in faults:
        resumed_at = resumes.get(fault["attempt"] + 1, 0)
        assert resumed_at % 5 == 0 and resumed_at < fault["step"], (fault, resumes)
