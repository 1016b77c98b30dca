"""The checkpointer: what a checkpoint holds, when one is taken, and how long the loop waits.

As torchtitan's ``CheckpointManager``, it is given its state once (``register``: named
objects with ``state_dict``/``load_state_dict``, state.py) and owns its policy: the loop
tells it where it is and what the ranks agreed (``maybe_save`` at each step boundary,
``step_done`` after each step) and it decides which steps to save (schedule.py), measures
what they cost (interval.py) and restores into the same states (``restore``, resume.py).

Modes (``checkpoint.mode``) decide how long the loop blocks:
  sync          dcp.save: the loop waits for the whole write (the baseline).
  async         dcp.async_save with synchronous staging: waits for the copy, not the write.
  async_staged  the state is copied to host memory in the background (staging.py) through
                the next step's forward; the loop waits for the copy only before that
                step's backward (``wait_until_staged``, guarded: ``_release_staged``); then
                dcp.save writes the staged copy on the checkpointer's background thread
                (worker.py; see ``save`` for why not dcp.async_save).

At most one checkpoint is in flight: a new save first waits for the previous one. Every
save reads the registered state inside its blocking span, so building the state dicts is
accounted as checkpoint time.

The in-memory tier (memory_tier.py): an in-memory copy (``copy``, its own
``memory_copy_blocking`` span) is the state's bytes copied into this host's shared memory
(on a GPU: a staging copy, written there instead of to storage), and a durable save in
``async_staged`` mode writes one too, from its staging copy, before its upload. Restore
prefers it when it is newer (resume.py).

How a written checkpoint becomes committed is commit.py's; the save on SIGTERM, held to
``checkpoint.preemption_budget_s``, is emergency.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import CheckpointTier, Mark, ResumeHow, Span
from infra.checkpoint_manifest import CheckpointError
from infra.settings import CheckpointMode, JobConfig
from trainer.checkpoint import emergency
from trainer.checkpoint.commit import AlreadyCommitted, CheckpointPhase, Committer
from trainer.checkpoint.delta import Incremental
from trainer.checkpoint.interval import FailureHistory
from trainer.checkpoint.memory_tier import MemoryTier, PendingCopy, Written, memory_tier_of
from trainer.checkpoint.resume import Resume, restore_states
from trainer.checkpoint.schedule import SaveSchedule
from trainer.checkpoint.staging import (
    ShardedStateStager,
    Staging,
    StateChanged,
    VersionGuard,
    local_tensors,
)
from trainer.checkpoint.state import CheckpointStates, Stateful
from trainer.checkpoint.worker import Job, Worker
from trainer.consensus import Agreed

log = logging.getLogger(__name__)


class BackgroundCopy:
    """An in-memory copy of host tensors, made on the background thread while the loop runs
    the next step's forward. ``copied`` completes once every byte is in the slot; then
    ``release`` tells the thread whether the copy is whole (the live tensors did not change
    meanwhile): it digests the slot and writes its header, or gives the slot up."""

    def __init__(
        self,
        worker: Worker,
        begin: Callable[[], PendingCopy | None],
        record: Callable[[Callable[[], Written]], None],
        name: str,
    ) -> None:
        self.copied: Future[PendingCopy | None] = Future()
        self._verdict = threading.Event()
        self._changed: StateChanged | None = None
        self.thread = worker.job(lambda: self._run(begin, record), name)

    def _run(
        self,
        begin: Callable[[], PendingCopy | None],
        record: Callable[[Callable[[], Written]], None],
    ) -> None:
        try:
            pending = begin()
        except BaseException as exc:  # noqa: BLE001 - recorded as a failed copy
            failure = exc
            self.copied.set_exception(failure)
            record(lambda: _raise(failure))
            return
        self.copied.set_result(pending)
        if pending is None:
            return
        self._verdict.wait()
        changed = self._changed
        if changed is not None:
            pending.abandon()  # headerless: never loaded
            record(lambda: _raise(changed))
        else:
            record(pending.finish)

    def release(self, changed: StateChanged | None) -> None:
        self._changed = changed
        self._verdict.set()


def _raise(exc: BaseException) -> Written:
    raise exc


@dataclass
class InFlight:
    step: int
    anchor: bool
    # The copy of the live state, until it is known complete (async_staged, in-memory).
    staging: Staging | BackgroundCopy | None
    thread: Job  # finishes and commits it; async_staged: started once copied
    error: list[BaseException]
    tier: CheckpointTier = CheckpointTier.DURABLE  # MEMORY: an in-memory copy only
    guard: VersionGuard | None = None  # a host copy made while the loop runs on
    changed: StateChanged | None = None  # the guard found the state changed: not written


class Checkpointer:
    """One per rank. ``register`` its state once; ``save`` never raises for storage
    trouble: a failed checkpoint is logged, marked in the ledger, and the previous committed
    one stays the latest."""

    def __init__(
        self,
        config: JobConfig,
        rank: int,
        world_size: int,
        ledger: Ledger,
        process_group: dist.ProcessGroup | None = None,
        on_phase: Callable[[str, int], None] = lambda phase, step: None,
    ) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.ledger, self.pg, self.on_phase = ledger, process_group, on_phase
        self.commits = Committer(config, rank, world_size, ledger, process_group, on_phase)
        self.memory: MemoryTier | None = memory_tier_of(config, rank, world_size)
        self.states: CheckpointStates | None = None
        self.incremental: Incremental | None = None  # from ``register``, when configured
        self.schedule: SaveSchedule | None = None  # from ``start``: training has begun
        self._stager: ShardedStateStager | None = None
        self._inflight: InFlight | None = None
        self.abandoned: Job | threading.Thread | None = None  # past the preemption budget
        self._worker = Worker(f"ckpt-worker-r{rank}")  # commits and copies, one at a time
        self._step_began = 0.0  # the loop's current step, for its duration
        self._waited_in_step = 0.0  # ...less the wait for a copy inside it
        # Copies of host tensors run through the next step's forward unless the state holds
        # what a forward changes (``register``) or the guard saw it change (``_release``).
        self.copy_during_forward = True
        self._committing: CheckpointTier | None = None  # ...and what was running as it began

    @property
    def failed_steps(self) -> list[int]:
        return self.commits.failed_steps

    @property
    def skipped_steps(self) -> list[int]:
        return self.commits.skipped_steps

    # -- what is saved ----------------------------------------------------------------------
    def register(
        self,
        states: Mapping[str, Stateful],
        plan: Mapping[str, Any] | None = None,
        tables: Mapping[str, tuple[str, int]] | None = None,
    ) -> None:
        """What every save holds and every restore loads, given once: DCP saves each part's
        ``state_dict()`` tensors under its key (see state.py); parts wrapped in
        ``RankState`` go into this rank's JSON state beside the step. The objects are read
        at each save, so they must be the live ones that training changes in place.
        ``plan``: how the tables are sharded, recorded in every manifest. ``tables``
        (feature -> table name, rows: delta.embedding_tables) lets durable commits write
        only touched rows, when ``checkpoint.incremental`` is on."""
        self.states = CheckpointStates(states)
        buffers = self.states.buffers()
        if buffers:
            self.copy_during_forward = False
            log.info(
                "checkpoint copies complete before the next step: the model's state has "
                "buffers a forward may change (%s)",
                ", ".join(buffers[:3]) + (", ..." if len(buffers) > 3 else ""),
            )
        self.commits.plan = dict(plan or {})
        if self.config.checkpoint.incremental.enabled and tables:
            self.incremental = Incremental(
                self.config.checkpoint.incremental, tables, self.world_size, self.pg
            )

    def track(self, *kjts: Any) -> None:
        """The training step's KeyedJaggedTensors: their ids are the rows it updates."""
        if self.incremental is not None:
            self.incremental.track(*kjts)

    def registered(self, what: str) -> CheckpointStates:
        """The registered states; RuntimeError naming ``what`` needed them if there are none."""
        if self.states is None:
            raise RuntimeError(
                f"{what}: no state registered; call Checkpointer.register(states) first"
            )
        return self.states

    def restore(self, how: ResumeHow = ResumeHow.COLD) -> Resume:
        """Load the newest usable checkpoint into the registered states. In process, the
        loop is stopped: this rank's JSON parts (the data position) are loaded too, and the
        failure counts towards the interval. At the start of an attempt they are left to
        the caller, who fetched the first batch from a peek at them meanwhile."""
        states = self.registered("restore")
        resume = restore_states(
            self.config, states, self.rank, self.world_size, self.ledger, self.pg, how, self.memory
        )
        if self.incremental is not None:
            self.incremental.reset()  # what was touched since is unknown: next commit full
        if how == ResumeHow.IN_PROCESS and resume.url is not None:
            states.load_rank_state(resume.rank_state or {})
            if self.schedule is not None:
                self.schedule.restored(resume.step, after_failure=True)
        return resume

    # -- when to save -----------------------------------------------------------------------
    def start(self, step: int, history: FailureHistory) -> None:
        """Training begins after ``step`` (restored, or 0): the interval's clock starts now,
        with the job's failures so far (a promoted standby learns them at its promotion)."""
        self.schedule = SaveSchedule(self.config, self.ledger, self.rank, step, history)

    def _started(self) -> SaveSchedule:
        if self.schedule is None:
            raise RuntimeError("Checkpointer.start(step, history) before the loop")
        return self.schedule

    def due_by_clock(self, step: int) -> bool:
        """This rank's flag for the per-step consensus: rank 0's clock asks for a save."""
        return self._started().by_clock(step)

    def copy_due_by_clock(self, step: int) -> bool:
        """This rank's flag for an in-memory copy: rank 0's clock asks for one."""
        return self._started().memory_by_clock(step)

    def maybe_save(self, step: int, agreed: Agreed) -> None:
        """At the step boundary after ``step``, with what every rank ``agreed`` on: save
        when the schedule says so (by step count and at eval steps on every rank alike, by
        the clock once every rank agreed to rank 0's flag), and start timing the next step.
        The copy of the state runs on through the next step's forward: the loop calls
        ``wait_until_staged`` before backward (here instead, when the copy must complete
        first: see ``copy_during_forward``). Ranks that agreed to stop take no clock-chosen
        save and do not wait: the save on SIGTERM follows, at this step, and waits for
        everything within its budget."""
        schedule = self._started()
        if schedule.due(step, agreed.checkpoint and not agreed.preempt):
            began = time.perf_counter()
            self.save(step)
            schedule.saved(step, time.perf_counter() - began)
        elif not agreed.preempt and schedule.memory_due(step, agreed.memory):
            began = time.perf_counter()
            if self.copy(step):
                schedule.copied(step, time.perf_counter() - began)
        if agreed.preempt:
            return
        if not self._copy_may_overlap():
            self.wait_until_staged()
        # A commit that ends during the step still slowed it: asked before, and after.
        self._committing = self._running_tier()
        self._waited_in_step = 0.0
        self._step_began = time.perf_counter()

    def _copy_may_overlap(self) -> bool:
        inflight = self._inflight
        if inflight is None or inflight.staging is None or inflight.guard is None:
            return True  # nothing copying, or a device copy (ordered on the device)
        return self.copy_during_forward and inflight.guard.sound

    def step_done(self) -> None:
        """The step since ``maybe_save`` ran to its end: its time (less any wait for a copy
        in it, which is blocking) tells what a commit (or an in-memory copy) that
        overlapped it cost."""
        duration = time.perf_counter() - self._step_began - self._waited_in_step
        running = (self._committing, self._running_tier())  # as the step began, and now
        quiet = running == (None, None)
        schedule = self._started()
        schedule.interval.step_done(duration, CheckpointTier.DURABLE in running, quiet)
        schedule.memory.step_done(duration, CheckpointTier.MEMORY in running, quiet)

    # -- saving -----------------------------------------------------------------------------
    def _get_stager(self) -> ShardedStateStager:
        """Made at the first async save, then kept: its staging buffers are reused by every
        later checkpoint. Pinned/shared memory and non-blocking copies need an accelerator
        (on CPU the default options raise)."""
        if self._stager is None:
            on_gpu = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=on_gpu,
                use_shared_memory=on_gpu,
                use_async_staging=self.config.checkpoint.mode == CheckpointMode.ASYNC_STAGED,
                use_non_blocking_copy=on_gpu,
            )
            self._stager = ShardedStateStager(options)
        return self._stager

    def save(self, step: int, anchor: bool = False, blocking: bool = False) -> None:
        """Checkpoint the registered state at ``step``: its tensors for DCP and this rank's
        JSON state (step, data position). A step committed already is not saved again
        (logged, recorded in ``skipped_steps``). Raises RuntimeError when nothing is
        registered.

        Blocks only for what the mode must: the previous checkpoint if still in flight, and
        the staging copy (sync mode: the whole write). ``anchor`` and ``blocking`` force a
        synchronous save that has committed when this returns.

        ``async_staged`` starts the copy first and returns: everything else (the JSON state,
        the DCP plan and write, the upload) runs on the background thread once the copy is
        done (``wait_until_staged``). On a small CPU host, anything started while the copy
        runs competes with it for the cores: a thread started mid-copy took ~3 ms to get
        scheduled, a third of a 64 MB copy. That is why this path calls ``dcp.save`` on that
        thread instead of ``dcp.async_save``, which starts its thread mid-copy.
        """
        states = self.registered(f"checkpoint at step {step}")
        mode = CheckpointMode.SYNC if anchor or blocking else self.config.checkpoint.mode
        commits = self.commits
        with self.ledger.span(Span.CHECKPOINT_BLOCKING, step=step, mode=mode) as attrs:
            waited = self.wait_for_inflight()
            attrs["waited_for_previous_s"] = round(waited, 6)
            previous_ok = commits.previous_stored()
            nonce = commits.begin()
            state, extra = states.read()
            rows = None
            if self.incremental is not None:
                plan = self.incremental.plan(step, state, previous_ok, anchor)
                state, rows = plan.dense, plan.rows
                commits.chain(nonce, plan.link)
                attrs["kind"] = plan.link.kind
            error: list[BaseException] = []
            if mode == CheckpointMode.ASYNC_STAGED:
                guard = None if torch.cuda.is_available() else VersionGuard(local_tensors(state))
                staging = self._get_stager().begin(state)

                def write_staged() -> None:
                    if inflight.changed is not None:
                        raise inflight.changed
                    if rows is None:  # a delta's staged state lacks the tables
                        # the in-memory tier first
                        self._write_copy(step, staging, {"step": step, **extra})
                    commits.refuse_if_committed(step)
                    writer = commits.prepare(step, extra, rows)
                    dcp.save(staging.state_dict(), storage_writer=writer, process_group=self.pg)

                thread = self._commit_thread(step, anchor, nonce, error, write_staged)
                inflight = InFlight(step, anchor, staging, thread, error, guard=guard)
                self._inflight = inflight
                return  # the thread starts in wait_until_staged, once the copy is done
            try:
                commits.refuse_if_committed(step)
            except AlreadyCommitted:
                commits.skipped(step, nonce)
                return
            except CheckpointError as exc:
                commits.failed(step, nonce, error, exc)
                return
            writer = commits.prepare(step, extra, rows)
            if mode == CheckpointMode.SYNC:
                dcp.save(state, storage_writer=writer, process_group=self.pg)
                self.on_phase(CheckpointPhase.STAGED, step)
                commits.finish(step, anchor, nonce, error)
                return
            # "async": DCP stages on this thread, then writes on its own.
            upload = dcp.async_save(
                state, storage_writer=writer, process_group=self.pg, async_stager=self._get_stager()
            )
            self.on_phase(CheckpointPhase.STAGED, step)
            thread = self._commit_thread(step, anchor, nonce, error, upload.result)
            thread.start()
            self._inflight = InFlight(step, anchor, None, thread, error)

    def copy(self, step: int) -> bool:
        """An in-memory copy of the registered state at ``step``. Skipped (False) while a
        checkpoint or the previous copy is still in flight: the next step boundary asks
        again.

        With the state in host memory the background thread copies its bytes straight into
        the slot (one memory copy, no staging buffer, no serialization) while the loop runs
        the next step's forward, then digests them and writes the header once the loop
        found them whole (``wait_until_staged``). With the state on a GPU the copy is
        staged as a checkpoint is (on the side stream) and the thread writes the slot."""
        states = self.registered(f"in-memory copy at step {step}")
        memory = self.memory
        if memory is None:
            return False
        inflight = self._inflight
        if inflight is not None:
            if inflight.staging is not None or inflight.thread.is_alive():
                return False
            self.wait_for_inflight()
        if memory.busy:
            return False
        with self.ledger.span(Span.MEMORY_COPY_BLOCKING, step=step):
            state, extra = states.read()
            extra = {"step": step, **extra}
            if torch.cuda.is_available():
                staging = self._get_stager().begin(state)
                thread = self._worker.job(
                    lambda: self._write_copy(step, staging, extra), f"ckpt-memory-{step}"
                )
                self._inflight = InFlight(step, False, staging, thread, [], CheckpointTier.MEMORY)
                return True  # its thread starts once the copy is done
            tensors = local_tensors(state)
            guard = VersionGuard(tensors)  # read before the thread may begin the copy
            background = BackgroundCopy(
                self._worker,
                lambda: memory.begin(
                    step,
                    tensors,
                    extra,
                    midway=lambda: self.on_phase(CheckpointPhase.MEMORY_MIDWAY, step),
                    wait=True,
                ),
                lambda write: self._record_copy(step, write),
                name=f"ckpt-memory-{step}",
            )
            self._inflight = InFlight(
                step, False, background, background.thread, [], CheckpointTier.MEMORY, guard
            )
            background.thread.start()
        return True

    def _write_copy(self, step: int, staging: Staging, extra: dict[str, Any]) -> None:
        """Write the staged state to the in-memory tier (``extra`` holds the step)."""
        memory = self.memory
        if memory is None:
            return
        self._record_copy(
            step,
            lambda: memory.write(
                step,
                staging.staged(),
                extra,
                midway=lambda: self.on_phase(CheckpointPhase.MEMORY_MIDWAY, step),
            ),
        )

    def _record_copy(self, step: int, write: Callable[[], Written]) -> None:
        """Its ``memory_copy`` mark; a failure is logged and marked, never raised (a lost
        copy costs only redone steps: the durable tier and training go on)."""
        try:
            written = write()
        except Exception as exc:  # noqa: BLE001
            log.warning("in-memory copy at step %d failed: %s", step, exc)
            self.ledger.mark(Mark.MEMORY_COPY, step=step, error=f"{type(exc).__name__}: {exc}")
            return
        self.ledger.mark(
            Mark.MEMORY_COPY,
            step=step,
            seq=written.seq,
            bytes=written.bytes,
            write_s=round(written.seconds, 6),
        )

    def _commit_thread(
        self,
        step: int,
        anchor: bool,
        nonce: str,
        error: list[BaseException],
        write: Callable[[], Any],
    ) -> Job:
        return self._worker.job(
            lambda: self.commits.finish(step, anchor, nonce, error, write), f"ckpt-commit-{step}"
        )

    def save_anchor(self, step: int) -> bool:
        """The job's final checkpoint, synchronous: committed (on this rank's view) when
        this returns True. Nothing to save (checkpoints off, no step trained since this
        attempt's start) is True too."""
        started = self._started()
        if started.off or step <= started.start_step:
            return True
        self.save(step, anchor=True)
        return step not in self.failed_steps

    def emergency_save(self, step: int, budget_s: float | None = None) -> bool:
        """Preempted: save at ``step`` within ``budget_s`` (default: the config's
        ``preemption_budget_s``) for the whole of it; True when the step is committed
        (emergency.py)."""
        budget = self.config.checkpoint.preemption_budget_s if budget_s is None else budget_s
        return emergency.save_within(self, step, budget)

    # -- the checkpoint in flight -----------------------------------------------------------
    def _release_staged(self, inflight: InFlight) -> None:
        """Once the staging copy is done, let the writer go on (a failed copy included: the
        thread reports it as a failed checkpoint). A host copy whose tensors changed while
        it was made is not a state the job was ever in: its writer fails it, and the next
        copies complete before the loop goes on."""
        staging = inflight.staging
        if staging is None:
            return
        wait([staging.copied])
        inflight.staging = None
        changed = inflight.guard.changed() if inflight.guard is not None else 0
        if changed:
            inflight.changed = StateChanged(
                f"{changed} tensor(s) of the state changed in place while the copy of step "
                f"{inflight.step} was made (during the next step's forward): not written"
            )
            if self.copy_during_forward:
                self.copy_during_forward = False
                log.warning("%s; copies now complete before the next step", inflight.changed)
        if isinstance(staging, BackgroundCopy):
            staging.release(inflight.changed)
            return
        if inflight.tier == CheckpointTier.DURABLE:
            self.on_phase(CheckpointPhase.STAGED, inflight.step)
        inflight.thread.start()

    def wait_until_staged(self) -> CheckpointTier | None:
        """Before the weights change again (the loop calls it before backward), the copy of
        the state must be complete; the wait counts in the copy's blocking time. Returns
        the tier of the copy waited for, None when there was none."""
        inflight = self._inflight
        if inflight is None or inflight.staging is None:
            return None
        memory = inflight.tier == CheckpointTier.MEMORY
        span = Span.MEMORY_COPY_BLOCKING if memory else Span.CHECKPOINT_BLOCKING
        began = time.perf_counter()
        with self.ledger.span(span, step=inflight.step, phase="staging"):
            self._release_staged(inflight)
        waited = time.perf_counter() - began
        self._waited_in_step += waited
        if self.schedule is not None:
            schedule = self.schedule
            (schedule.memory if memory else schedule.interval).staged(waited)
        return inflight.tier

    def _running_tier(self) -> CheckpointTier | None:
        """The tier of the copy staging or being written in the background, if any."""
        inflight = self._inflight
        if inflight is None or (inflight.staging is None and not inflight.thread.is_alive()):
            return None
        return inflight.tier

    @property
    def commit_running(self) -> bool:
        """A checkpoint (or an in-memory copy) is staging or committing in the background."""
        return self._running_tier() is not None

    @property
    def inflight(self) -> InFlight | None:
        """The checkpoint staging or committing now, if any."""
        return self._inflight

    def wait_for_inflight(self, timeout_s: float | None = None) -> float:
        """Wait for the in-flight checkpoint to commit (or fail); returns seconds waited.
        TimeoutError when it is still uploading after ``timeout_s``."""
        inflight = self._inflight
        if inflight is None:
            return 0.0
        start = time.perf_counter()
        self._release_staged(inflight)
        inflight.thread.join(timeout_s)
        if inflight.thread.is_alive():
            raise TimeoutError(f"checkpoint at step {inflight.step} still uploading")
        self._inflight = None
        return time.perf_counter() - start

    def abandon(self, thread: Job | threading.Thread) -> None:
        """A save past the preemption budget: never waited for again (the process exits)."""
        self.abandoned, self._inflight = thread, None

    def close(self) -> None:
        """Wait for the in-flight checkpoint and release the stager's resources and the
        background thread (a save abandoned past the preemption budget is not waited for)."""
        try:
            if self.abandoned is None:
                self.wait_for_inflight()
        finally:
            self._worker.close()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self.commits.close()

    def drop_memory_tier(self) -> None:
        """Remove this rank's in-memory copies: the job needs them no more (it ended), or
        nobody would (no orchestrator to relaunch it, nor to remove them)."""
        if self.memory is not None:
            self.memory.remove()
