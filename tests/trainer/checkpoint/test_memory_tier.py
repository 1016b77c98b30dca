"""The in-memory tier: a copy in /dev/shm outlives the process that wrote it, a torn or
foreign copy is never loaded, and restore takes a copy only when it is the newest valid
state (newer than durable storage, this job's, this model's).

The writer killed from outside is a real process SIGKILLed at random moments while it
writes copies back to back; what the tests read back is checked value by value against
what that step's copy holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from infra import memory_tier as segments
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import CheckpointTier, Mark, ResumeHow, Span
from infra.accounting.ledger_read import read_events
from infra.job_layout import JobLayout
from infra.memory_tier import Slot, TornHeader
from infra.settings import JobConfig, load_config
from tests.factories import ROOT
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.interval import FailureHistory
from trainer.checkpoint.memory_tier import MemoryTier, TornCopy
from trainer.checkpoint.state import RankState
from trainer.consensus import Agreed

ELEMENTS = 4 << 20  # 16 MB per copy: a write long enough to be killed in the middle of

# Writes copies of steps after the newest valid one, back to back, each filled with its step
# number; prints each step once its copy is complete. argv: job url, the step whose copy
# it kills itself in the middle of (0: none).
WRITER = f"""
import os, signal, sys, torch
from infra.job_layout import JobLayout
from trainer.checkpoint.memory_tier import MemoryTier
tier = MemoryTier(JobLayout.at(sys.argv[1]), "cfg", 0, 1)
kill_at = int(sys.argv[2])
copies = tier.copies(quiet=True)
step = copies[0].step if copies else 0
while True:
    step += 1
    def midway(step=step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    tier.write(step, {{"w": torch.full(({ELEMENTS},), float(step))}}, {{"step": step}}, midway)
    print(step, flush=True)
"""


class Writer:
    """The writer above in its own process; ``complete`` is the newest step it reported.
    Every writer is killed by the end of its test (``layout``), whatever the test found."""

    started: list[Writer] = []

    def __init__(self, layout: JobLayout, kill_at: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, layout.url, str(kill_at)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        Writer.started.append(self)
        self.complete = 0

    def wait_for(self, steps: int) -> None:
        """Until ``steps`` more copies are complete."""
        assert self.proc.stdout is not None
        for _ in range(steps):
            line = self.proc.stdout.readline()
            assert line, f"the writer exited {self.proc.wait()}"
            self.complete = int(line)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        for line in self.proc.stdout.read().split():  # reported before the kill landed
            self.complete = int(line)


def _tier(layout: JobLayout, config_hash: str = "cfg", rank: int = 0) -> MemoryTier:
    return MemoryTier(layout, config_hash, rank, 1)


def _newest(tier: MemoryTier) -> tuple[int, torch.Tensor]:
    """The newest copy that loads: its step and its tensor."""
    for copy in tier.copies():
        try:
            tensors, extra = tier.load(copy)
        except TornCopy:
            continue
        assert extra == {"step": copy.step}
        return copy.step, tensors["w"]
    raise AssertionError("no copy loads")


@pytest.fixture
def layout(tmp_path: Path) -> Any:
    layout = JobLayout.for_job(f"file://{tmp_path}/store", "memtier")
    yield layout
    while Writer.started:
        writer = Writer.started.pop()
        writer.proc.kill()
        writer.proc.wait()
    segments.remove_segments(layout)


def _mid_write(tier: MemoryTier, timeout_s: float = 60.0) -> None:
    """Until a slot's header is invalid: its copy is being written right now."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in tier.paths.values():
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as fh:
                if fh.read(len(segments.MAGIC)) != segments.MAGIC:
                    return
    raise AssertionError("no slot was ever seen being written")


def test_a_writer_killed_at_random_moments_never_leaves_a_torn_copy_that_loads(layout) -> None:
    """Half the kills at a random moment (mostly while a copy is serialised and hashed),
    half as soon as a slot is seen being written (mostly while its bytes are)."""
    rng = random.Random(28)
    tier = _tier(layout)
    newest, torn = 0, 0
    for kill in range(6):
        writer = Writer(layout)
        writer.wait_for(2)
        if kill % 2:
            _mid_write(tier)
        else:
            time.sleep(rng.uniform(0.0, 0.15))
        writer.kill()
        step, tensor = _newest(tier)
        # The newest complete copy survives the kill (or a newer one, completed unreported),
        # and every value is its step's: nothing of a torn copy was loaded.
        assert step >= writer.complete > newest
        assert torch.equal(tensor, torch.full((ELEMENTS,), float(step)))
        newest = step
        torn += len(tier.copies(quiet=True)) < 2
    assert torn, "no kill landed in the middle of a copy: the test proved nothing"
    assert sorted(os.path.basename(p)[-1] for p in segments.job_segments(layout)) == ["a", "b"]


def test_a_copy_killed_half_written_is_torn_and_the_other_slot_is_loaded(layout) -> None:
    writer = Writer(layout, kill_at=3)
    assert writer.proc.wait(timeout=120) == -signal.SIGKILL
    tier = _tier(layout)
    [copy] = tier.copies()  # the slot being written has no valid header
    assert copy.step == 2
    torn = next(p for s, p in tier.paths.items() if s != copy.slot)
    with pytest.raises(TornHeader):
        segments.read_header(torn)
    assert _newest(tier)[0] == 2
    # A slot whose bytes no longer match its digest is torn too, whatever its header says.
    with open(copy.path, "r+b") as fh:
        fh.seek(copy.header.total_bytes - 100)
        fh.write(b"\x7f")
    with pytest.raises(TornCopy, match="digest"):
        tier.load(copy)


def test_a_copy_round_trips_every_dtype_shape_and_key_exactly(layout) -> None:
    """The raw layout: int and str keys, lists, plain values, 0-d, empty, bf16 and bool
    tensors, a non-contiguous view and a sharded table's local shards come back bit for bit
    (and the copy only becomes valid at ``finish``)."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "model": {"w": torch.randn(3, 5), "t": base.t(), "bf": torch.randn(7).bfloat16()},
        "optim": {"state": {0: {"step": torch.tensor(12.0), "m": torch.zeros(0, 4)}}},
        "rng": {"cpu": torch.get_rng_state(), "mask": torch.tensor([True, False, True])},
        "table": {"__sharded_local__": [torch.randn(2, 3), torch.randn(1, 3)]},
        "plain": [1, 2.5, "x", None, True],
    }
    tier = _tier(layout)
    pending = tier.begin(7, state, {"step": 7})
    assert pending is not None and tier.busy and tier.copies(quiet=True) == []
    assert tier.begin(8, state, {"step": 8}) is None  # one unfinished copy at a time
    pending.finish()
    assert not tier.busy
    [copy] = tier.copies()
    loaded, extra = tier.load(copy)
    assert extra == {"step": 7}

    def same(a: Any, b: Any) -> None:
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)  # keys and their types, in order
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, list):
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        else:
            assert a == b and type(a) is type(b)

    same(state, loaded)


def test_a_copy_larger_than_one_write_call_lands_whole_and_its_hook_fires_once_at_half(
    layout,
) -> None:
    """A tensor of several write calls (20 MB, 10 MB on each side of the hook, against 8 MB
    per call) comes back whole, and the fault hook runs once, with the first half of the
    bytes written and the last not."""
    big = torch.arange(1, 5 * (1 << 20) + 1, dtype=torch.float32)  # no zero byte-runs
    tier = _tier(layout)
    seen: list[tuple[bytes, bytes]] = []

    def midway() -> None:
        path = tier.paths[Slot.A]  # the first copy goes to slot a
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            fh.seek(size // 2 - 16384)
            before = fh.read(4096)
            fh.seek(size // 2 + 16384)
            after = fh.read(4096)
        seen.append((before, after))

    tier.write(3, {"head": torch.ones(3), "big": big, "tail": torch.ones(5)}, {"step": 3}, midway)
    [(before, after)] = seen
    assert before != bytes(4096), "the first half was not written when the hook ran"
    assert after == bytes(4096), "the second half was written before the hook ran"
    [copy] = tier.copies()
    loaded, _ = tier.load(copy)
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["tail"], torch.ones(5))


def test_a_slot_whose_size_no_longer_matches_its_header_is_torn(layout) -> None:
    tier = _tier(layout)
    tier.write(4, {"w": torch.ones(64)}, {"step": 4})
    [copy] = tier.copies()
    with open(copy.path, "ab") as fh:  # another writer grew it since the header was read
        fh.write(b"x" * 100)
    with pytest.raises(TornCopy, match="changed"):
        tier.load(copy)
    os.truncate(copy.path, copy.header.total_bytes - 10)  # or shrank it
    with pytest.raises(TornCopy, match="changed"):
        tier.load(copy)


def test_a_segment_names_its_job_until_it_is_removed(layout, tmp_path) -> None:
    """``job_url_of``: the URL of a whole copy, None for one being written (after waiting),
    FileNotFoundError once gone; ``remove_segments`` takes one rank's and leaves the other's."""
    zero, one = _tier(layout), MemoryTier(layout, "cfg", 1, 2)
    zero.write(1, {"w": torch.ones(2)}, {"step": 1})
    one.write(1, {"w": torch.ones(2)}, {"step": 1})
    [path] = [p for p in zero.paths.values() if os.path.exists(p)]
    assert segments.job_url_of(path) == layout.url
    pending = zero.begin(2, {"w": torch.ones(2)}, {"step": 2})  # the other slot, headerless
    assert pending is not None
    [writing] = [p for p in zero.paths.values() if p != path]
    assert segments.job_url_of(writing, wait_s=0.3) is None  # still headerless after the wait
    pending.finish()
    assert segments.job_url_of(writing) == layout.url
    removed = segments.remove_segments(layout, rank=0)
    assert sorted(removed) == sorted(zero.paths.values())
    assert segments.job_segments(layout) == [one.paths[Slot.A]]  # rank 1's one copy
    with pytest.raises(FileNotFoundError):
        segments.job_url_of(path)
    long = JobLayout.for_job(f"file://{tmp_path}/long", "j" * 300)
    name = os.path.basename(segments.slot_path(long, 0, Slot.A))
    assert len(name) < 255  # a file name, whatever the job id's length


def test_each_copy_is_newer_than_the_last_and_a_bad_state_leaves_the_tier_usable(
    layout,
) -> None:
    """Sequence numbers rise by one per copy, alternating slots; a state holding something
    that is neither a tensor nor a plain value is refused, and the next copy still writes."""
    tier = _tier(layout)
    seqs = []
    for step in (1, 2, 3):
        tier.write(step, {"w": torch.full((4,), float(step))}, {"step": step})
        newest = tier.copies()[0]
        seqs.append((newest.header.seq, newest.step, newest.slot))
    assert seqs == [(1, 1, Slot.A), (2, 2, Slot.B), (3, 3, Slot.A)]
    tier.keep_only(tier.copies()[1])  # slot b alone is left (after a restore of it)
    assert [(c.slot, c.step) for c in tier.copies()] == [(Slot.B, 2)]
    with pytest.raises(TypeError, match="tensors and plain values"):
        tier.begin(4, {"w": torch.ones(1), "odd": object()}, {"step": 4})
    assert not tier.busy
    tier.write(5, {"w": torch.ones(4)}, {"step": 5})
    step, w = _newest(tier)
    assert step == 5 and torch.equal(w, torch.ones(4))
    assert [c.slot for c in tier.copies()] == [Slot.A, Slot.B]  # written to the free slot


def test_a_copy_of_another_job_model_or_rank_is_ignored(layout, tmp_path, caplog) -> None:
    mine = _tier(layout)
    same_id = JobLayout.for_job(f"file://{tmp_path}/other", "memtier")  # another storage root
    for name, other in {
        "another job": _tier(same_id),
        "another model config": _tier(layout, config_hash="changed"),
        "rank 1 of 2": MemoryTier(layout, "cfg", 1, 2),
    }.items():
        written = other.write(7, {"w": torch.ones(2)}, {"step": 7})
        os.replace(written.path, mine.paths[Slot.A])  # where this rank's copy would be
        with caplog.at_level(logging.WARNING):
            assert mine.copies() == []
        assert name in caplog.text
        caplog.clear()
    assert segments.job_segments(same_id) == []


# -- restore, through the checkpointer ---------------------------------------------------------
class Part:
    """A live state part: tensors changed in place by training, loaded back by a restore."""

    def __init__(self, value: float) -> None:
        self.value = {"w": torch.full((8,), value)}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value["w"].copy_(state["w"])


class Position:
    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


def _config(tmp_path: Path, memory: dict[str, Any] | bool) -> JobConfig:
    return load_config(
        job_id="memtier",
        storage={"root": f"file://{tmp_path}/store"},
        train={"steps": 100, "eval": "off"},
        checkpoint={"mode": "async_staged", "every_steps": 5, "memory_tier": memory},
    )


def _train(
    ckpt: Checkpointer,
    part: Part,
    position: Position,
    steps: range,
    forward_changes: frozenset[int] = frozenset(),
) -> None:
    """The loop as the checkpointer sees it: a boundary, a forward (which, at the steps in
    ``forward_changes``, changes the state in place as a BatchNorm's would), the wait for
    the copy before backward, then the update that moves the state."""
    for step in steps:
        ckpt.maybe_save(step - 1, Agreed())
        if step in forward_changes:
            part.value["w"].add_(0.5)
        ckpt.wait_until_staged()
        part.value["w"].fill_(float(step))
        position.at = step
        ckpt.step_done()
        ckpt.wait_for_inflight()  # a slow step: nothing is in flight at the next boundary


def _checkpointer(
    tmp_path: Path, config: JobConfig, group: dist.ProcessGroup, attempt: int = 0
) -> tuple[Checkpointer, Part, Position]:
    ckpt = Checkpointer(config, 0, 1, Ledger(config.layout, attempt=attempt, rank=0), group)
    part, position = Part(0.0), Position()
    ckpt.register({"model": part, "loader": RankState(position)})
    return ckpt, part, position


def test_an_in_process_restore_takes_the_newest_in_memory_copy(tmp_path, group) -> None:
    config = _config(tmp_path, {"every_steps": 2})
    ckpt, part, position = _checkpointer(tmp_path, config, group)
    try:
        ckpt.start(0, FailureHistory())
        _train(ckpt, part, position, range(1, 10))  # durable at 5; in memory at 2, 4, 5, 6, 8
        resume = ckpt.restore(ResumeHow.IN_PROCESS)
        assert (resume.step, resume.tier) == (8, CheckpointTier.MEMORY)
        assert torch.equal(part.value["w"], torch.full((8,), 8.0)) and position.at == 8
        # The copy restored from is kept, the other slot (step 6) dropped.
        assert [c.step for c in ckpt.memory.copies()] == [8]
    finally:
        ckpt.close()
        ckpt.drop_memory_tier()
    events = read_events(config.layout)
    copies = [e.step for e in events if e.name == Mark.MEMORY_COPY and "error" not in e.attrs]
    assert copies == [2, 4, 5, 6, 8]
    assert {e.step for e in events if e.name == Span.MEMORY_COPY_BLOCKING} == {2, 4, 6, 8}
    [mark] = [e for e in events if e.name == Mark.RESUME]
    assert (mark.step, mark.attrs["tier"], mark.attrs["how"]) == (8, "memory", "in_process")
    assert segments.job_segments(config.layout) == []


def test_a_copy_older_than_the_newest_durable_commit_is_ignored(tmp_path, group, caplog) -> None:
    config = _config(tmp_path, {"every_steps": 2})
    ckpt, part, position = _checkpointer(tmp_path, config, group)
    try:
        ckpt.start(0, FailureHistory())
        _train(ckpt, part, position, range(1, 5))  # in memory at 2 and 4, nothing durable
        ckpt.save(7)  # durable, from another timeline: newer than every copy
        ckpt.wait_for_inflight()
        ckpt.memory.keep_only(None)  # ...whose own copy (step 7) is gone
        stale = ckpt.memory.write(3, {"model": {"w": torch.full((8,), 3.0)}}, {"step": 3})
        assert [c.step for c in ckpt.memory.copies()] == [stale.step]
        with caplog.at_level(logging.WARNING):
            resume = ckpt.restore(ResumeHow.IN_PROCESS)
        assert (resume.step, resume.tier) == (7, CheckpointTier.DURABLE)
        assert "older than the newest durable commit" in caplog.text
        assert ckpt.memory.copies() == []  # never considered again
    finally:
        ckpt.close()
        ckpt.drop_memory_tier()


def test_a_copy_whose_state_the_forward_changed_is_never_written(tmp_path, group, caplog) -> None:
    """The copy runs through the next step's forward; a forward that changes the state in
    place (here step 5's, during the copy of step 4) makes that copy a state the job was
    never in: it is not written, the restore takes the copy before it, and from then on the
    copies complete before the step goes on (so the next ones are whole again)."""
    config = _config(tmp_path, {"every_steps": 2})
    ckpt, part, position = _checkpointer(tmp_path, config, group)
    try:
        ckpt.start(0, FailureHistory())
        assert ckpt.copy_during_forward
        _train(ckpt, part, position, range(1, 5))  # a whole copy of step 2
        with caplog.at_level(logging.WARNING):
            _train(ckpt, part, position, range(5, 6), forward_changes=frozenset({5}))
        assert "changed in place while the copy of step 4 was made" in caplog.text
        assert not ckpt.copy_during_forward
        resume = ckpt.restore(ResumeHow.IN_PROCESS)
        assert (resume.step, resume.tier) == (2, CheckpointTier.MEMORY)
        assert torch.equal(part.value["w"], torch.full((8,), 2.0)) and position.at == 2
        # Now the copy of step 4 completes at the boundary: step 5's forward comes after.
        _train(ckpt, part, position, range(3, 6), forward_changes=frozenset({5}))
        resume = ckpt.restore(ResumeHow.IN_PROCESS)
        assert (resume.step, resume.tier) == (4, CheckpointTier.MEMORY)
        assert torch.equal(part.value["w"], torch.full((8,), 4.0)) and position.at == 4
    finally:
        ckpt.close()
        ckpt.drop_memory_tier()
    marks = [e for e in read_events(config.layout) if e.name == Mark.MEMORY_COPY]
    assert [(e.step, "error" in e.attrs) for e in marks] == [(2, False), (4, True), (4, False)]
    assert marks[1].attrs["error"].startswith("StateChanged: 1 tensor(s)")
    assert segments.job_segments(config.layout) == []


class WithBuffer(torch.nn.Module):
    """A model with a persistent buffer, which its forward may change (BatchNorm's kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def test_a_model_with_buffers_completes_its_copies_before_the_next_step(
    tmp_path, group, caplog
) -> None:
    config = _config(tmp_path, {"every_steps": 2})
    ckpt = Checkpointer(config, 0, 1, Ledger(config.layout, rank=0), group)
    model = WithBuffer()
    try:
        with caplog.at_level(logging.INFO):
            ckpt.register({"model": model})
        assert not ckpt.copy_during_forward
        assert "model.norm.running_mean" in caplog.text
        ckpt.start(0, FailureHistory())
        ckpt.maybe_save(2, Agreed())  # copies step 2, and waits for it here
        assert ckpt.inflight is not None and ckpt.inflight.staging is None
        model(torch.randn(3, 4))  # the next forward moves the running statistics
        ckpt.wait_for_inflight()
        [copy] = ckpt.memory.copies()
        saved, _ = ckpt.memory.load(copy)
        assert torch.equal(saved["model"]["norm.running_mean"], torch.zeros(4))
    finally:
        ckpt.close()
        ckpt.drop_memory_tier()


def test_with_the_tier_off_nothing_is_written_to_shared_memory(tmp_path, group) -> None:
    config = _config(tmp_path, False)
    ckpt, part, position = _checkpointer(tmp_path, config, group)
    try:
        ckpt.start(0, FailureHistory())
        _train(ckpt, part, position, range(1, 7))
        assert ckpt.memory is None and segments.job_segments(config.layout) == []
        assert ckpt.restore(ResumeHow.IN_PROCESS).tier == CheckpointTier.DURABLE
    finally:
        ckpt.close()


@pytest.mark.parametrize(
    ("memory", "error"),
    [
        ({"every_steps": 0}, "memory_tier.every_steps must be >= 1"),
        ({"every_steps": None}, "memory_tier.every_steps and memory_tier.every_seconds"),
        ({"cost_budget": 0.9}, "cost_budget"),
        ("sometimes", "memory_tier: Value error, must be true, false or a mapping"),
    ],
)
def test_a_bad_memory_tier_config_is_a_clear_error(tmp_path, memory, error) -> None:
    with pytest.raises(Exception, match=error):
        _config(tmp_path, memory)


def test_a_copy_is_written_whole_when_the_kernel_takes_part_of_a_gather_write(
    tmp_path, monkeypatch
):
    """A copy's tensors go to its slot in a few gather writes (``pwritev``); a write that
    stores less than it was given must be finished, or the slot holds a hole that only the
    digest would catch (and every copy would be lost). Split at every byte, the two halves
    a copy is written in (``midway`` between them) still put each byte in its place."""
    from trainer.checkpoint import memory_tier as tier_module

    parts = [memoryview(bytes([i + 1]) * (3 * i + 1)) for i in range(6)]
    whole = b"".join(parts)
    for n in range(len(whole) + 1):
        first, rest = tier_module._split_parts(parts, n)
        assert b"".join(first) == whole[:n] and b"".join(rest) == whole[n:]
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, at: real(fd, [bytes(bufs[0])[:2]], at))
    path = tmp_path / "slot"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        tier_module._write_parts(fd, parts, 5)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(5) + whole
