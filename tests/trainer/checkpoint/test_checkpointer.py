"""The Checkpointer driven directly, as the training loop drives it, in one gloo process.

What matters for every mode: the checkpoint holds the state of the step it was taken at,
even though the loop changes the weights as soon as ``save`` (sync, async) or
``wait_until_staged`` (async_staged) returns.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardMetadata,
    init_from_local_shards,
)

from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import MANIFEST, Manifest, committed_checkpoints, failed_marker
from infra.job_layout import JobLayout, step_dir_name
from infra.settings import JobConfig, load_config
from tests.factories import HeldState
from tests.reliability.cutting_proxy import RequestCutter
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.state import RankState
from trainer.checkpoint.verify import verify_files

ROWS, DIM = 64, 8


def _sharded(tensor: torch.Tensor, pg: dist.ProcessGroup) -> ShardedTensor:
    meta = ShardMetadata([0, 0], list(tensor.shape), "rank:0/cpu")
    return init_from_local_shards([Shard(tensor, meta)], list(tensor.shape), process_group=pg)


def _state(pg: dist.ProcessGroup, fill: float) -> dict[str, Any]:
    """A dense weight and a TorchRec-style sharded table, both filled with ``fill``."""
    return {
        "model": {
            "dense.weight": torch.full((ROWS, DIM), fill),
            "table.weight": _sharded(torch.full((ROWS, DIM), fill), pg),
        }
    }


def _fill(state: dict[str, Any], value: float) -> None:
    """What the next optimizer step does: change the live weights in place."""
    state["model"]["dense.weight"].fill_(value)
    state["model"]["table.weight"].local_shards()[0].tensor.fill_(value)


def _load(url: str, pg: dist.ProcessGroup) -> dict[str, Any]:
    into = _state(pg, float("nan"))
    dcp.load(into, checkpoint_id=storage.local_path(url), process_group=pg)
    return into


def _register(ckpt: Checkpointer, state: dict[str, Any]) -> HeldState:
    """Register ``state`` (read at every save) and a loader position; returns the position,
    which the test may change between saves."""
    position = HeldState({})
    tensors = {key: HeldState(part) for key, part in state.items()}
    ckpt.register({**tensors, "loader": RankState(position)})
    return position


def _config(tmp_path, mode: str) -> JobConfig:
    return load_config(
        job_id=f"direct-{mode}",
        storage={"root": f"file://{tmp_path}/store"},
        checkpoint={"mode": mode, "every_steps": 1, "keep_latest_k": 2, "memory_tier": False},
    )


@pytest.mark.parametrize("mode", ["sync", "async", "async_staged"])
def test_checkpoint_holds_the_weights_of_its_step_though_the_loop_moves_on(
    tmp_path, group: dist.ProcessGroup, mode: str
) -> None:
    config = _config(tmp_path, mode)
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, rank=0, world_size=1, ledger=ledger, process_group=group)
    state = _state(group, 0.0)
    position = _register(ckpt, state)
    try:
        for step in (1, 2, 3):
            _fill(state, float(step))
            position.value = {"shard_pos": step}
            ckpt.save(step)
            ckpt.wait_until_staged()
            _fill(state, -1.0)  # the next step overwrites the weights at once
        ckpt.wait_for_inflight()
    finally:
        ckpt.close()
        ledger.close()
    committed = committed_checkpoints(config.layout)
    assert [c.step for c in committed] == [3, 2]  # keep_latest_k=2
    loaded = _load(committed[0].url, group)
    assert torch.equal(loaded["model"]["dense.weight"], torch.full((ROWS, DIM), 3.0))
    table = loaded["model"]["table.weight"].local_shards()[0].tensor
    assert torch.equal(table, torch.full((ROWS, DIM), 3.0))
    trainer_state = storage.read_text(storage.join(committed[0].url, "trainer_state.rank000.json"))
    assert '"shard_pos": 3' in trainer_state
    events = read_events(JobLayout.at(f"file://{tmp_path}/ledger"))
    assert {e.step for e in events if e.name == "checkpoint_blocking"} == {1, 2, 3}


def test_async_staged_writes_nothing_until_the_copy_is_released(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """The writer starts only once the loop has its copy: nothing competes with the copy
    for the cores, and nothing is written before the loop may move on."""
    config = _config(tmp_path, "async_staged")
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, rank=0, world_size=1, ledger=ledger, process_group=group)
    state = _state(group, 7.0)
    _register(ckpt, state)
    step_dir = os.path.join(str(tmp_path), "store", "jobs")
    try:
        ckpt.save(1)
        inflight = ckpt._inflight
        assert inflight is not None and not inflight.thread.is_alive()
        assert not any(step_dir_name(1) in root for root, _, _ in os.walk(step_dir))
        assert ckpt.wait_until_staged()  # the loop times this wait as staging
        assert not ckpt.wait_until_staged()  # released: nothing left to wait for
        ckpt.wait_for_inflight()
    finally:
        ckpt.close()
        ledger.close()
    assert [c.step for c in committed_checkpoints(config.layout)] == [1]


def test_a_failed_staging_copy_fails_that_checkpoint_not_training(
    tmp_path, group: dist.ProcessGroup
) -> None:
    config = _config(tmp_path, "async_staged")
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, rank=0, world_size=1, ledger=ledger, process_group=group)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)
        ckpt.wait_for_inflight()
        stager = ckpt._stager
        assert stager is not None
        begin = stager.begin

        def broken_copy(state_dict: dict[str, Any]) -> Any:
            staging = begin(state_dict)
            staging.copied.result()
            failed = type(staging.copied)()
            failed.set_exception(MemoryError("staging buffer allocation failed"))
            staging.copied = failed
            return staging

        stager.begin = broken_copy  # type: ignore[method-assign]
        ckpt.save(2)
        ckpt.wait_until_staged()  # does not raise: the loop goes on
        ckpt.wait_for_inflight()
    finally:
        ckpt.close()
        ledger.close()
    assert ckpt.failed_steps == [2]
    assert [c.step for c in committed_checkpoints(config.layout)] == [1]
    marks = [
        e
        for e in read_events(JobLayout.at(f"file://{tmp_path}/ledger"))
        if e.name == "checkpoint_failed"
    ]
    assert [m.step for m in marks] == [2] and "staging buffer" in marks[0].attrs["error"]


def test_a_staged_checkpoint_whose_state_the_forward_changed_fails_and_is_never_committed(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """The staging copy runs through the next step's forward (the loop waits for it before
    backward). A forward that changes the state in place meanwhile makes the copy a state
    the job was never in: that checkpoint fails, the one before stays the latest, and the
    copies complete before the next step from then on."""
    config = _config(tmp_path, "async_staged")
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)
        ckpt.wait_for_inflight()
        ckpt.save(2)
        state["model"]["dense.weight"].add_(0.5)  # a forward that updates its own state
        ckpt.wait_until_staged()  # does not raise: the loop goes on
        ckpt.wait_for_inflight()
        assert not ckpt.copy_during_forward
    finally:
        ckpt.close()
        ledger.close()
    assert ckpt.failed_steps == [2]
    assert [c.step for c in committed_checkpoints(config.layout)] == [1]
    [(step, error)] = _failed_marks(tmp_path)
    assert step == 2 and "changed in place while the copy of step 2 was made" in error


def test_a_committed_step_is_not_written_again(tmp_path, group: dist.ProcessGroup) -> None:
    config = _config(tmp_path, "sync")
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, rank=0, world_size=1, ledger=ledger, process_group=group)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)
        [first] = committed_checkpoints(config.layout)
        folder = storage.local_path(first.url) or ""
        before = {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)}
        _fill(state, 2.0)
        ckpt.save(1, blocking=True)
    finally:
        ckpt.close()
        ledger.close()
    assert ckpt.skipped_steps == [1] and ckpt.failed_steps == []
    after = {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)}
    assert after == before
    assert committed_checkpoints(config.layout)[0].manifest == first.manifest


@pytest.mark.parametrize(("eval_mode", "kept"), [("async", [5, 4, 2]), ("inline", [5])])
def test_with_a_side_evaluator_retention_keeps_the_eval_step_checkpoints(
    tmp_path, group: dist.ProcessGroup, eval_mode: str, kept: list[int]
) -> None:
    """``train.eval: async`` evaluates committed checkpoints at eval steps later, on the
    side: each commit's retention keeps them beyond the latest k. Inline eval needs none."""
    config = load_config(
        job_id=f"eval-{eval_mode}",
        storage={"root": f"file://{tmp_path}/store"},
        checkpoint={"mode": "sync", "every_steps": 1, "keep_latest_k": 1},
        train={"eval": eval_mode, "eval_every": 2},
    )
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    _register(ckpt, _state(group, 1.0))
    try:
        for step in range(1, 6):
            ckpt.save(step)
    finally:
        ckpt.close()
        ledger.close()
    assert [c.step for c in committed_checkpoints(config.layout)] == kept


def test_a_commit_below_newer_committed_steps_keeps_itself_and_what_may_be_in_flight(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """Committed steps newer than the one being committed are present (corrupt ones restore
    could not quarantine, or those of a job resumed from an older checkpoint of its own) when
    this process commits step 10 with ``keep_latest_k: 2``. Its retention keeps the newest
    two (40, 30), the step it just committed and the anchor, and the uncommitted folder
    above step 10 (the next save may be writing it); it deletes the older commits (6, 4) and
    the uncommitted folder below step 10 (debris of a crashed save)."""
    root = f"file://{tmp_path}/store"
    before = load_config(
        job_id="newer",
        storage={"root": root},
        checkpoint={"mode": "sync", "every_steps": 1, "keep_latest_k": 10},
    )
    ckpt, ledger = _checkpointer(tmp_path, before, group)
    _register(ckpt, _state(group, 1.0))
    try:
        ckpt.save(1, anchor=True)
        for step in (4, 6, 30, 40):
            ckpt.save(step)
    finally:
        ckpt.close()
        ledger.close()
    folders = Path(storage.local_path(before.layout.checkpoints) or "")
    for step in (8, 12):  # uncommitted: a crashed save below 10, a save in flight above it
        (folders / step_dir_name(step)).mkdir()
        (folders / step_dir_name(step) / "__0_0.distcp").write_bytes(b"partial")

    config = load_config(
        job_id="newer",
        storage={"root": root},
        checkpoint={"mode": "sync", "every_steps": 1, "keep_latest_k": 2},
    )
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    _register(ckpt, _state(group, 2.0))
    try:
        ckpt.save(10)
    finally:
        ckpt.close()
        ledger.close()
    assert [c.step for c in committed_checkpoints(config.layout)] == [40, 30, 10, 1]
    names = sorted(p.name for p in folders.iterdir() if p.name.startswith("step-"))
    assert names == [step_dir_name(s) for s in (1, 10, 12, 30, 40)]
    loaded = _load(storage.join(config.layout.checkpoints, step_dir_name(10)), group)
    assert torch.equal(loaded["model"]["dense.weight"], torch.full((ROWS, DIM), 2.0))


def test_markers_of_an_earlier_try_never_complete_a_new_commit(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """Rank 0 of a 2-rank save, with rank 1 played by a thread. Markers of an earlier try at
    the same step (a done-marker of rank 1, a failure marker) lie in the folder: the commit
    must wait for rank 1's marker of this save, and list what that one says."""
    import json
    import time

    config = _config(tmp_path, "sync")
    storage.configure(config.storage)
    url = storage.join(config.layout.checkpoints, step_dir_name(1))
    stale = {"__1_0.distcp": {"size": 1, "sha256": "stale"}}
    for name in ("_done.rank001.json", "_done.rank001.earlier-0.json"):
        storage.write_text(storage.join(url, name), json.dumps(stale))
    storage.write_text(storage.join(url, "_failed.rank001.earlier-1.json"), "{}")
    fresh = {"__1_0.distcp": {"size": 2, "sha256": "fresh"}}

    saved = threading.Event()  # rank 1 looks until rank 0's save is over, however long

    def rank1() -> None:
        folder = storage.local_path(url) or ""
        while not saved.is_set():
            # Not a marker's temp file (storage writes <name>.tmp-<pid>, then renames it).
            mine = [
                n
                for n in os.listdir(folder)
                if n.startswith("_done.rank000.") and n.endswith(".json")
            ]
            if mine:
                nonce = mine[0][len("_done.rank000.") : -len(".json")]
                time.sleep(0.3)  # rank 1 is slower: the commit must wait for it
                storage.write_text(
                    storage.join(url, f"_done.rank001.{nonce}.json"), json.dumps(fresh)
                )
                return
            time.sleep(0.01)

    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, rank=0, world_size=2, ledger=ledger)
    helper = threading.Thread(target=rank1)
    helper.start()
    try:
        _register(ckpt, _state(group, 1.0))
        ckpt.save(1)
    finally:
        saved.set()
        helper.join()
        ckpt.close()
        ledger.close()
    assert ckpt.failed_steps == []
    [committed] = committed_checkpoints(config.layout)
    assert committed.manifest.files["__1_0.distcp"].sha256 == "fresh"
    assert committed.manifest.nonce and committed.manifest.nonce != "earlier-0"


# -- the save on SIGTERM: the whole of it within the preemption budget ----------------------
class HeldAt:
    """An ``on_phase`` hook that holds one checkpoint at one phase until released: an upload
    that outlasts any budget, by the order of events rather than by a sleep."""

    def __init__(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, phase: str, step: int) -> None:
        if (phase, step) == (self.phase, self.step):
            self.reached.set()
            self.release.wait()


def _checkpointer(
    tmp_path, config: JobConfig, group: dist.ProcessGroup, on_phase: Callable | None = None
) -> tuple[Checkpointer, Ledger]:
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    hook = {"on_phase": on_phase} if on_phase is not None else {}
    return Checkpointer(config, 0, 1, ledger, process_group=group, **hook), ledger


def _failed_marks(tmp_path) -> list[tuple[int | None, str]]:
    events = read_events(JobLayout.at(f"file://{tmp_path}/ledger"))
    return [(e.step, e.attrs["error"]) for e in events if e.name == "checkpoint_failed"]


def test_saving_before_any_state_is_registered_is_a_clear_error(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """Nothing to save is a bug in the caller, not a storage failure: it raises, naming the
    fix, instead of logging a failed checkpoint; and what is registered must be readable."""
    config = _config(tmp_path, "sync")
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    try:
        with pytest.raises(RuntimeError, match=r"step 1: no state registered; call Check"):
            ckpt.save(1)
        with pytest.raises(RuntimeError, match=r"step 2: no state registered"):
            ckpt.emergency_save(2, budget_s=1)
        with pytest.raises(TypeError, match=r"'model' has no state_dict\(\): dict"):
            ckpt.register({"model": {"w": torch.ones(1)}})
        with pytest.raises(RuntimeError, match="no state registered"):
            ckpt.save(3)  # a refused registration registers nothing
    finally:
        ckpt.close()
        ledger.close()
    assert ckpt.failed_steps == [] and _failed_marks(tmp_path) == []
    assert not storage.exists(config.layout.checkpoints)


def test_emergency_save_waits_for_the_inflight_one_and_commits_its_step(
    tmp_path, group: dist.ProcessGroup
) -> None:
    ckpt, ledger = _checkpointer(tmp_path, _config(tmp_path, "async"), group)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)  # still committing on its thread
        _fill(state, 2.0)
        assert ckpt.emergency_save(2, budget_s=120)
        # Asked again at a committed step (a second SIGTERM): nothing written, still saved.
        assert ckpt.emergency_save(2, budget_s=120)
    finally:
        ckpt.close()
        ledger.close()
    assert [c.step for c in committed_checkpoints(_config(tmp_path, "async").layout)] == [2, 1]
    assert ckpt.skipped_steps == [2] and ckpt.failed_steps == []
    loaded = _load(committed_checkpoints(_config(tmp_path, "async").layout)[0].url, group)
    assert torch.equal(loaded["model"]["dense.weight"], torch.full((ROWS, DIM), 2.0))


@pytest.mark.timeout(120)
def test_emergency_save_abandons_an_inflight_upload_that_outlasts_the_budget(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """The checkpoint of step 1 is stuck in its upload: the save on SIGTERM gives up when
    the budget is spent (False: the attempt exits EMERGENCY_SAVE_FAILED), and closing the
    checkpointer does not wait for the stuck upload (it would wait forever)."""
    config = _config(tmp_path, "async")
    held = HeldAt("written", 1)
    ckpt, ledger = _checkpointer(tmp_path, config, group, held)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)
        assert held.reached.wait(60)
        assert not ckpt.emergency_save(2, budget_s=0.2)
        ckpt.close()  # returns although step 1's upload is still held
        assert held.reached.is_set() and not held.release.is_set()
        assert committed_checkpoints(config.layout) == []
        assert not storage.exists(storage.join(config.layout.checkpoints, step_dir_name(2)))
    finally:
        held.release.set()
        ledger.close()


@pytest.mark.timeout(120)
def test_emergency_save_that_outlasts_the_budget_is_not_the_latest(
    tmp_path, group: dist.ProcessGroup
) -> None:
    """The new save itself is stuck before its manifest: False once the budget is spent, a
    ``checkpoint_failed`` mark says why, and the previous checkpoint stays the latest."""
    config = _config(tmp_path, "sync")
    held = HeldAt("before_manifest", 2)
    ckpt, ledger = _checkpointer(tmp_path, config, group, held)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)
        assert not ckpt.emergency_save(2, budget_s=0.2)
        ckpt.close()  # does not wait for the abandoned save
        assert not held.release.is_set()
        assert [c.step for c in committed_checkpoints(config.layout)] == [1]
        assert _failed_marks(tmp_path) == [(2, "preemption budget exceeded")]
    finally:
        held.release.set()
        ledger.close()


def test_emergency_save_with_checkpoints_off_writes_nothing(
    tmp_path, group: dist.ProcessGroup
) -> None:
    config = _config(tmp_path, "off")
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    try:
        _register(ckpt, _state(group, 1.0))
        assert ckpt.emergency_save(3, budget_s=1)
    finally:
        ckpt.close()
        ledger.close()
    assert not storage.exists(config.layout.checkpoints)


def _emergency_save_as_rank_1(
    config: JobConfig,
    group: dist.ProcessGroup,
    tmp_path: Path,
    rank_0: Callable[[], None],
    stop: threading.Event,
) -> tuple[bool, Checkpointer]:
    """Rank 1's emergency save of step 1 in a 2-rank job, with rank 0 played by a thread
    running ``rank_0`` until ``stop`` is set: what the save answered, and the checkpointer."""
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, rank=1, world_size=2, ledger=ledger)
    helper = threading.Thread(target=rank_0)
    helper.start()
    try:
        _register(ckpt, _state(group, 1.0))
        saved = ckpt.emergency_save(1, budget_s=60)
    finally:
        stop.set()
        helper.join()
        ckpt.close()
        ledger.close()
    return saved, ckpt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank0", ["commits", "fails"])
def test_emergency_save_on_another_rank_answers_what_rank_0_did(
    tmp_path, group: dist.ProcessGroup, rank0: str
) -> None:
    """Rank 1 of a 2-rank save, with rank 0 played by a thread: rank 1 cannot commit, so
    its emergency save waits for rank 0's manifest of this save (True) or rank 0's failure
    marker (False), whichever rank 0 writes once rank 1's done-marker is there."""
    import time

    config = _config(tmp_path, "sync")
    url = storage.join(config.layout.checkpoints, step_dir_name(1))
    stop = threading.Event()

    def rank_0() -> None:
        folder = storage.local_path(url) or ""
        while not stop.is_set():
            names = os.listdir(folder) if os.path.isdir(folder) else []
            done = [n for n in names if n.startswith("_done.rank001.") and n.endswith(".json")]
            if done:
                nonce = done[0][len("_done.rank001.") : -len(".json")]
                if rank0 == "fails":
                    storage.write_text(storage.join(url, failed_marker(0, nonce)), "{}")
                else:
                    manifest = Manifest(1, 2, config.model_hash(), {}, nonce=nonce)
                    storage.write_text(storage.join(url, MANIFEST), manifest.to_json())
                return
            time.sleep(0.01)

    saved, ckpt = _emergency_save_as_rank_1(config, group, tmp_path, rank_0, stop)
    assert saved == (rank0 == "commits")
    assert ckpt.failed_steps == []  # rank 1's own part of the save went through


# -- manifest last, on a real S3 endpoint -------------------------------------------------
@pytest.fixture
def s3_proxy(s3_server: str) -> Iterator[RequestCutter]:
    port = urllib.parse.urlsplit(s3_server).port
    assert port is not None
    proxy = RequestCutter(("127.0.0.1", port)).start()
    try:
        yield proxy
    finally:
        proxy.close()
        storage.configure(None)


def _s3_config(s3_proxy: RequestCutter, job_id: str) -> JobConfig:
    """A job on the S3 endpoint behind ``s3_proxy``, in a fresh prefix: no retries (a cut
    request fails at once), a synchronous checkpoint every step, two kept."""
    return load_config(
        job_id=job_id,
        storage={
            "root": f"s3://ett/{uuid.uuid4().hex[:12]}",
            "s3_endpoint_url": s3_proxy.url,
            "retries": 0,
        },
        checkpoint={"mode": "sync", "every_steps": 1, "keep_latest_k": 2},
    )


def test_on_s3_a_failed_upload_leaves_its_step_uncommitted(
    tmp_path, group: dist.ProcessGroup, s3_proxy: RequestCutter
) -> None:
    """The manifest is written last, after every file is uploaded: when the upload of step
    2's DCP metadata is reset (no retries), step 2 has no manifest and step 1 stays the
    latest, whole."""
    config = _s3_config(s3_proxy, "s3-manifest-last")
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    state = _state(group, 1.0)
    _register(ckpt, state)
    try:
        ckpt.save(1)
        cut = s3_proxy.cut("PUT", rf"/{step_dir_name(2)}/\.metadata")
        ckpt.save(2)
    finally:
        ckpt.close()
        ledger.close()
    assert cut.count > 0 and ckpt.failed_steps == [2]
    [latest] = committed_checkpoints(config.layout)
    assert latest.step == 1
    verify_files(latest.url, latest.manifest)
    step2 = storage.join(config.layout.checkpoints, step_dir_name(2))
    assert not storage.exists(storage.join(step2, MANIFEST))
    assert [step for step, _ in _failed_marks(tmp_path)] == [2]


def test_on_s3_a_step_whose_commit_cannot_be_checked_is_not_written(
    tmp_path, group: dist.ProcessGroup, s3_proxy: RequestCutter
) -> None:
    """Before writing, the save asks whether its step is committed already; when storage
    will not say (the request is reset, no retries), that checkpoint fails, training goes
    on, and nothing of the step is written."""
    config = _s3_config(s3_proxy, "s3-refuse-unknown")
    ckpt, ledger = _checkpointer(tmp_path, config, group)
    _register(ckpt, _state(group, 1.0))
    try:
        ckpt.save(1)
        cut = s3_proxy.cut("HEAD", re.escape(f"/{step_dir_name(2)}/{MANIFEST}"))
        ckpt.save(2)  # does not raise
        s3_proxy.clear()
    finally:
        ckpt.close()
        ledger.close()
    assert cut.count > 0 and ckpt.failed_steps == [2]
    assert [c.step for c in committed_checkpoints(config.layout)] == [1]
    [(step, error)] = _failed_marks(tmp_path)
    assert step == 2 and "cannot tell whether step 2 is committed already" in error
    step2 = storage.join(config.layout.checkpoints, step_dir_name(2))
    assert not [n for n in storage.listdir(step2) if not n.startswith("_failed.")]


@pytest.mark.timeout(120)
def test_on_s3_an_emergency_save_on_rank_1_outlasts_a_failing_look_at_its_commit(
    tmp_path, group: dist.ProcessGroup, s3_proxy: RequestCutter
) -> None:
    """Rank 1 waits for rank 0's manifest by looking at S3; a look that fails (reset, no
    retries) is logged and tried again, and the save is confirmed once the manifest is
    there. Rank 0 is played by a thread that commits only after a look has failed."""
    import time

    config = _s3_config(s3_proxy, "s3-confirm")
    url = storage.join(config.layout.checkpoints, step_dir_name(1))
    # The save's own check that step 1 is not committed goes through; the looks after fail.
    cut = s3_proxy.cut("HEAD", re.escape(f"/{step_dir_name(1)}/{MANIFEST}"), after=1)
    stop = threading.Event()

    def rank_0() -> None:
        while not stop.is_set():
            done = [n for n in storage.listdir(url) if n.startswith("_done.rank001.")]
            if done and cut.count > 0:
                s3_proxy.clear()
                nonce = done[0][len("_done.rank001.") : -len(".json")]
                manifest = Manifest(1, 2, config.model_hash(), {}, nonce=nonce)
                storage.write_text(storage.join(url, MANIFEST), manifest.to_json())
                return
            time.sleep(0.02)

    saved, ckpt = _emergency_save_as_rank_1(config, group, tmp_path, rank_0, stop)
    assert cut.count > 0 and saved
    assert ckpt.failed_steps == []
