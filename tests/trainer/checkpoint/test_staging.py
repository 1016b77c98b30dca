"""Checkpoint staging engines: the staged copy holds the state of the moment it was begun.

What the training loop relies on: once ``begin`` returned and ``copied`` is done, the live
weights may change (the next step), and ``state_dict()`` still gives the values from before.
The side-stream engine runs here on CPU tensors (its synchronous path: buffers, trees,
ShardedTensors); the CUDA tests (``-m gpu``, run by ``make gpu-check``) change the weights
on the compute stream right after ``begin``, while the host copies are still in flight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardMetadata,
    init_from_local_shards,
)
from torch.distributed.checkpoint.staging import StagingOptions

from trainer.checkpoint.staging import ShardedStateStager, SideStreamCopy, VersionGuard

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(pg: dist.ProcessGroup, device: str = "cpu", rows: int = 64) -> dict[str, Any]:
    table = torch.arange(rows * 8, dtype=torch.float32, device=device).reshape(rows, 8)
    meta = ShardMetadata([0, 0], [rows, 8], f"rank:0/{table.device}")
    return {
        "model": {
            "dense.weight": torch.randn(rows, 16, device=device),
            "table.weight": init_from_local_shards(
                [Shard(table, meta)], [rows, 8], process_group=pg
            ),
        },
        "optim": {"step": torch.tensor(3.0), "moments": [torch.ones(5, device=device)]},
        "rng": {"cpu": torch.get_rng_state()},
    }


def _change(state: dict[str, Any]) -> None:
    """The next optimizer step: every live tensor changes in place."""
    state["model"]["dense.weight"].add_(1.0)
    state["model"]["table.weight"].local_shards()[0].tensor.mul_(-1.0)
    state["optim"]["step"].add_(1.0)
    state["optim"]["moments"][0].add_(2.0)


def _plain(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    m = state["model"]
    return {
        "dense": m["dense.weight"].detach().cpu().clone(),
        "table": m["table.weight"].local_shards()[0].tensor.detach().cpu().clone(),
        "step": state["optim"]["step"].clone(),
        "moments": state["optim"]["moments"][0].cpu().clone(),
    }


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _stager(engine: str) -> ShardedStateStager:
    gpu = torch.cuda.is_available()
    options = StagingOptions(gpu, gpu, use_async_staging=True, use_non_blocking_copy=gpu)
    return ShardedStateStager(options, engine=engine)


@pytest.mark.parametrize("engine", ["side_stream", "dcp"])
def test_staged_copy_is_the_state_at_begin(group, engine: str) -> None:
    stager = _stager(engine)
    try:
        state = _state(group)
        before = _plain(state)
        staging = stager.begin(state)
        staging.copied.result()
        _change(state)  # the loop moves on as soon as the copy is done
        staged = staging.state_dict()
        _assert_equal(_plain(staged), before)
        table = staged["model"]["table.weight"]
        assert isinstance(table, ShardedTensor)  # rebuilt with the original metadata
        assert table.metadata() == state["model"]["table.weight"].metadata()
        assert staged["rng"]["cpu"].data_ptr() != state["rng"]["cpu"].data_ptr()
    finally:
        stager.close()


def test_side_stream_buffers_are_reused_until_a_shape_changes(group) -> None:
    stager = _stager("side_stream")
    try:
        state = _state(group)
        first = stager.begin(state).state_dict()
        ptr = first["model"]["dense.weight"].data_ptr()
        _change(state)
        second = stager.begin(state).state_dict()
        assert second["model"]["dense.weight"].data_ptr() == ptr
        _assert_equal(_plain(second), _plain(state))
        third = stager.begin(_state(group, rows=32)).state_dict()
        assert third["model"]["dense.weight"].shape == (32, 16)
    finally:
        stager.close()


def test_default_engine_is_dcp_without_a_gpu_and_names_are_checked() -> None:
    options = StagingOptions(False, False, use_async_staging=True, use_non_blocking_copy=False)
    if not torch.cuda.is_available():
        assert ShardedStateStager(options).engine == "dcp"
    with pytest.raises(ValueError, match="staging engine"):
        ShardedStateStager(options, engine="magic")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("snapshot", [True, False])
def test_cuda_side_stream_copy_is_the_state_at_begin(group, snapshot: bool) -> None:
    stager = _stager("side_stream")
    assert stager._copy is not None
    stager._copy.snapshot = snapshot
    try:
        for _ in range(3):  # buffers reused from the second copy on
            # 384 MB: the host copies take milliseconds, the change below is enqueued at
            # once, so it would land mid-copy if nothing ordered the two.
            state = _state(group, "cuda", rows=1 << 22)
            before = _plain(state)
            staging = stager.begin(state)
            assert staging.copied.done()  # the training thread never waited
            _change(state)
            staged = staging.state_dict()
            assert stager._copy.last_mode == ("snapshot" if snapshot else "ordered")
            assert staged["model"]["dense.weight"].is_pinned()
            _assert_equal(_plain(staged), before)
            torch.cuda.synchronize()
            assert not torch.equal(_plain(state)["dense"], before["dense"])  # it did change
    finally:
        stager.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_snapshot_only_when_the_state_fits_in_free_memory() -> None:
    copy = SideStreamCopy()
    assert copy._use_snapshot([torch.ones(1024, device="cuda")])
    free, _ = torch.cuda.mem_get_info()
    huge = torch.ones(1, device="cuda").expand(int(0.6 * free) // 4 + 1)  # no memory behind
    assert not copy._use_snapshot([huge])
    copy.close()


def test_the_version_guard_counts_exactly_the_tensors_changed_in_place() -> None:
    """What a copy made during a forward relies on: every in-place change of a tensor it
    reads is seen, a new tensor bound to the same name is not a change of the live state,
    and a tensor without a version counter makes the guard unsound."""
    weight, state = torch.zeros(4), torch.ones(2)
    tree = {"model": {"w": weight.detach(), "nested": [state]}, "step": 3}
    guard = VersionGuard(tree)
    assert guard.sound and guard.changed() == 0
    weight.add_(1.0)  # through another view of the same tensor
    assert guard.changed() == 1
    state.mul_(2.0)
    assert guard.changed() == 2
    tree["model"]["w"] = torch.full((4,), 9.0)  # rebinding changes no tensor the copy reads
    assert guard.changed() == 2
    with torch.inference_mode():
        frozen = torch.zeros(2)
    assert not VersionGuard({"t": frozen, "w": weight}).sound
