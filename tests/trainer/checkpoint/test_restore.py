"""Finding and loading the checkpoint an attempt resumes from (trainer/checkpoint/restore.py),
in one gloo process, on checkpoints the Checkpointer wrote: the newest committed one; past a
corrupt one (quarantined once a good one loaded), or an error naming it; incompatible ones;
``resume: none``, an explicit URL, a warm start; and a fetch from object storage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from infra import storage
from infra.accounting.ledger import Ledger
from infra.checkpoint_manifest import (
    QUARANTINE,
    CheckpointCorrupt,
    CheckpointError,
    committed_checkpoints,
)
from infra.job_layout import JobLayout, step_dir_name
from infra.settings import JobConfig, load_config
from tests.factories import HeldState
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.restore import Restored, fetch, restore
from trainer.checkpoint.state import RankState


def _config(root: str, job_id: str = "restore", **sections: Any) -> JobConfig:
    checkpoint = {"mode": "sync", "every_steps": 1, "keep_latest_k": 5}
    return load_config(
        job_id=job_id,
        storage={"root": root},
        checkpoint={**checkpoint, **sections.pop("checkpoint", {})},
        **sections,
    )


def _state(fill: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 3), fill)}, "optim": {"m": torch.full((2,), fill)}}


def _save(config: JobConfig, group: dist.ProcessGroup, tmp_path, *steps: int) -> None:
    """Commit a checkpoint at each step, its tensors filled with the step number."""
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger-{config.job_id}"))
    ckpt = Checkpointer(config, 0, 1, ledger, process_group=group)
    tensors = {key: HeldState(part) for key, part in _state(0.0).items()}
    position = HeldState({})
    ckpt.register({**tensors, "loader": RankState(position)})
    try:
        for step in steps:
            for key, part in _state(float(step)).items():
                tensors[key].value = part
            position.value = {"pos": step * 10}
            ckpt.save(step)
    finally:
        ckpt.close()
        ledger.close()
    assert ckpt.failed_steps == []


def _url(config: JobConfig, step: int) -> str:
    return storage.join(config.layout.checkpoints, step_dir_name(step))


def _corrupt(config: JobConfig, step: int) -> None:
    """Flip one byte of the step's tensor data: same size, another checksum."""
    url = storage.join(_url(config, step), "__0_0.distcp")
    data = bytearray(storage.read_bytes(url))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(url, bytes(data))


def _restore(config: JobConfig, group: dist.ProcessGroup, world_size: int = 1):
    state = _state(float("nan"))
    return restore(config, state, 0, world_size, group), state


def _steps(config: JobConfig) -> list[int]:
    return [c.step for c in committed_checkpoints(config.layout)]


def test_the_newest_committed_checkpoint_is_loaded(tmp_path, group) -> None:
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1, 2)
    got, state = _restore(config, group)
    assert isinstance(got, Restored) and not got.warm_start
    assert got.checkpoint.step == 2 and got.checkpoint.url == _url(config, 2)
    assert got.extra == {"step": 2, "loader": {"pos": 20}}
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 2.0))
    assert torch.equal(state["optim"]["m"], torch.full((2,), 2.0))


def test_a_corrupt_newest_checkpoint_falls_back_and_is_quarantined(tmp_path, group) -> None:
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1, 2, 3)
    _corrupt(config, 3)
    _corrupt(config, 2)
    got, state = _restore(config, group)
    assert got is not None and got.checkpoint.step == 1 and got.extra["step"] == 1
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 1.0))
    assert _steps(config) == [1]  # both corrupt ones moved out of the committed ones
    moved = storage.listdir(storage.join(config.layout.checkpoints, QUARANTINE))
    assert sorted(name.rsplit("-", 2)[0] for name in moved) == [step_dir_name(2), step_dir_name(3)]


def test_a_corrupt_checkpoint_that_cannot_be_quarantined_still_falls_back(tmp_path, group) -> None:
    """Quarantine is tidying: when it fails (here a file stands where its folder goes) the
    good checkpoint is still resumed from, and the corrupt one stays for the next attempt."""
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1, 2)
    _corrupt(config, 2)
    blocker = storage.local_path(storage.join(config.layout.checkpoints, QUARANTINE))
    assert blocker is not None
    with open(blocker, "w") as fh:
        fh.write("not a folder")
    got, state = _restore(config, group)
    assert got is not None and got.checkpoint.step == 1
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 1.0))
    assert _steps(config) == [2, 1]


def test_without_fallback_a_corrupt_checkpoint_is_an_error_naming_it(tmp_path, group) -> None:
    config = _config(f"file://{tmp_path}/store", checkpoint={"fallback_on_corrupt": False})
    _save(config, group, tmp_path, 1, 2)
    _corrupt(config, 2)
    with pytest.raises(CheckpointCorrupt, match=f"{step_dir_name(2)} is corrupt: checksum"):
        _restore(config, group)
    assert _steps(config) == [2, 1]  # nothing quarantined


def test_with_every_checkpoint_corrupt_nothing_is_quarantined(tmp_path, group) -> None:
    """No usable checkpoint left: the job fails loudly rather than start over from nothing,
    and the corrupt ones stay where they are for a look."""
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1, 2)
    _corrupt(config, 1)
    _corrupt(config, 2)
    with pytest.raises(CheckpointCorrupt, match="no usable checkpoint") as err:
        _restore(config, group)
    assert step_dir_name(1) in str(err.value) and step_dir_name(2) in str(err.value)
    assert _steps(config) == [2, 1]


def test_an_incompatible_checkpoint_is_an_error(tmp_path, group) -> None:
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1)
    other_model = _config(
        f"file://{tmp_path}/store", model={"embedding_dim": 32, "dense_arch": [64, 32]}
    )
    with pytest.raises(CheckpointError, match="another model config"):
        _restore(other_model, group)
    assert _steps(config) == [1]


def test_a_checkpoint_of_another_world_size_restores_the_jobs_position(tmp_path, group) -> None:
    """Issue 29: the step and the data position are the job's, read from rank 0's JSON state
    whatever the world size that reads them (tests/trainer/checkpoint/test_reshard.py runs
    the real thing on 2 -> 1 -> 2 ranks)."""
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1)
    restored, _ = _restore(config, group, world_size=2)
    assert restored is not None and restored.checkpoint.manifest.world_size == 1
    assert restored.extra["step"] == 1


def test_a_verified_checkpoint_that_does_not_fit_the_state_is_an_error(tmp_path, group) -> None:
    """Intact files DCP cannot load into this state (a tensor of another shape): no relaunch
    fixes that, so it is a CheckpointError naming the checkpoint, not a crash."""
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1)
    state = {"model": {"w": torch.zeros(5, 3)}, "optim": {"m": torch.zeros(2)}}
    with pytest.raises(CheckpointError, match=f"{step_dir_name(1)} could not be loaded"):
        restore(config, state, 0, 1, group)
    assert _steps(config) == [1]  # not corrupt: nothing quarantined


def test_resume_none_or_checkpoints_off_load_nothing(tmp_path, group) -> None:
    config = _config(f"file://{tmp_path}/store")
    _save(config, group, tmp_path, 1)
    for sections in ({"resume": "none"}, {"mode": "off"}):
        got, state = _restore(_config(f"file://{tmp_path}/store", checkpoint=sections), group)
        assert got is None and torch.isnan(state["model"]["w"]).all()


def test_resume_from_an_explicit_url_takes_that_checkpoint(tmp_path, group) -> None:
    source = _config(f"file://{tmp_path}/store")
    _save(source, group, tmp_path, 1, 2)
    config = _config(
        f"file://{tmp_path}/store", job_id="other", checkpoint={"resume": _url(source, 1)}
    )
    got, state = _restore(config, group)
    assert got is not None and got.checkpoint.url == _url(source, 1) and got.extra["step"] == 1
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 1.0))
    _corrupt(source, 1)  # an explicit checkpoint is never quarantined: it is not this job's
    with pytest.raises(CheckpointCorrupt, match="no usable checkpoint"):
        _restore(config, group)
    assert _steps(source) == [2, 1]


def test_warm_start_loads_the_model_only_and_only_without_checkpoints(tmp_path, group) -> None:
    source = _config(f"file://{tmp_path}/store")
    _save(source, group, tmp_path, 2)
    warm = {"warm_start": _url(source, 2)}
    config = _config(f"file://{tmp_path}/store", job_id="warm", checkpoint=warm)
    got, state = _restore(config, group)
    assert got is not None and got.warm_start and got.extra == {}
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 2.0))
    assert torch.isnan(state["optim"]["m"]).all()  # the optimizer starts fresh
    _save(config, group, tmp_path, 5)  # once the job has a checkpoint of its own, that one
    got, _ = _restore(config, group)
    assert got is not None and not got.warm_start and got.checkpoint.step == 5
    other = _config(
        f"file://{tmp_path}/store",
        job_id="w2",
        checkpoint=warm,
        model={"embedding_dim": 32, "dense_arch": [64, 32]},
    )
    with pytest.raises(CheckpointError, match="warm-start checkpoint .* another model config"):
        _restore(other, group)


def test_a_checkpoint_on_object_storage_is_fetched_and_verified(tmp_path, group) -> None:
    """memory:// stands for a store without local paths: the files are uploaded by the
    checkpointer, downloaded and checked by restore; a missing one is corruption."""
    config = _config(f"memory://restore-{tmp_path.name}", checkpoint={"fallback_on_corrupt": False})
    _save(config, group, tmp_path, 1, 2)
    got, state = _restore(config, group)
    assert got is not None and got.checkpoint.step == 2 and got.extra["loader"] == {"pos": 20}
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 2.0))
    storage.remove(storage.join(_url(config, 2), "__0_0.distcp"))
    with pytest.raises(CheckpointCorrupt, match=f"{step_dir_name(2)} is missing file __0_0"):
        _restore(config, group)


def test_a_local_disk_error_while_fetching_is_a_storage_error(tmp_path, group) -> None:
    """The download folder cannot be made (a file is in the way): the local disk's fault, not
    the checkpoint's, so a retryable StorageError naming the checkpoint, not corruption."""
    config = _config(f"memory://restore-disk-{tmp_path.name}")
    _save(config, group, tmp_path, 1)
    in_the_way = tmp_path / "downloads"
    in_the_way.write_text("a file, not a folder")
    ckpt = committed_checkpoints(config.layout)[0]
    with pytest.raises(storage.StorageError, match=f"reading checkpoint {ckpt.url} failed"):
        fetch(ckpt, str(in_the_way))
    assert _steps(config) == [1]
