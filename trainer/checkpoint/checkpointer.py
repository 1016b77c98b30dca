"""Save and restore training state with DCP so the loop blocks as little as possible.

Modes (``checkpoint.mode``):
  sync          dcp.save: the loop waits for the whole write (the baseline).
  async         dcp.async_save with synchronous staging: waits for the copy, not the write.
  async_staged  PyTorch's DefaultStager copies the state to CPU memory in the background
                (pinned + shared memory and non-blocking copies on GPU); the loop waits for
                it only before the next step changes the weights; then dcp.save writes the
                staged copy on a commit thread (see ``Checkpointer.save`` for why not
                dcp.async_save).

Every checkpoint is written by DCP into a local folder (the final folder on local storage,
a spool folder for object stores), then, off the training thread, uploaded file by file
(parallel multipart for large files), each rank records its files' sizes and checksums in
a small done-marker, and rank 0 writes the manifest last once every rank is done. At most
one checkpoint is in flight: a new save first waits for the previous one.

A committed checkpoint is never written again: before writing, the ranks agree (one tiny
all-reduce) whether the step's folder is committed already, and if so the save is a no-op.
Each save has a nonce shared by all ranks; done-markers and the manifest carry it, so
markers left by an earlier, failed try at the same step can never complete this one.

What is saved is registered once (``register``): named objects whose ``state_dict()``
tensors go to DCP, and named objects whose ``state_dict()`` is this rank's JSON state.
Every save reads them inside its blocking span, so building the state dicts is accounted
as checkpoint time.

On SIGTERM, ``emergency_save`` holds the whole save (finishing the in-flight one, the new
save, the commit) to ``checkpoint.preemption_budget_s``.

One module on purpose: save, commit, emergency save and restore share the nonce, the spool
and the in-flight state of one checkpoint; the manifest format, retention, staging and the
interval policy live beside it (manifest.py, retention.py, staging.py, interval.py,
restore.py, state.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions

from infra import processes, storage
from infra.accounting.ledger import Ledger
from infra.checkpoint_manifest import (
    MANIFEST,
    CheckpointError,
    FileEntry,
    Manifest,
    done_marker,
    failed_marker,
    rank_state_name,
    read_manifest,
)
from infra.control import scratch_dir
from infra.job_layout import step_dir_name
from infra.settings import CheckpointMode, EvalMode, JobConfig, config_yaml
from trainer.checkpoint.retention import purge_old
from trainer.checkpoint.staging import ShardedStateStager, Staging
from trainer.checkpoint.state import Stateful
from trainer.checkpoint.verify import sha256_file

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 600.0


@dataclass
class InFlight:
    step: int
    anchor: bool
    staging: Staging | None  # async_staged: the copy, until it is known complete
    thread: threading.Thread  # finishes and commits it; async_staged: started once copied
    error: list[BaseException]


class _AlreadyCommitted(Exception):
    """Raised inside a save whose step is committed already: nothing is written."""


def _spool_prefix(job_id: str, rank: int) -> str:
    return f"ett-ckpt-{job_id}-r{rank}-p"


def remove_stale_spools(job_id: str, rank: int) -> list[str]:
    """Delete the local spools that killed attempts of this job and rank left behind (a
    SIGKILL mid-upload leaves a whole checkpoint in the temp folder). A spool is named with
    its process id; one whose process still runs is kept."""
    prefix = _spool_prefix(job_id, rank)
    removed = []
    for entry in os.scandir(tempfile.gettempdir()):
        if not entry.name.startswith(prefix):
            continue
        pid_part = entry.name[len(prefix) :].split("-", 1)[0]
        if pid_part.isdigit() and not processes.pid_alive(int(pid_part)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    if removed:
        log.info("removed %d stale checkpoint spool(s) of killed attempts", len(removed))
    return removed


class Checkpointer:
    """One per rank. ``register`` its state once, then ``save`` reads it at every step it
    is asked to. ``save`` never raises for storage trouble: a failed checkpoint is logged,
    marked in the ledger, and the previous committed one stays the latest."""

    def __init__(
        self,
        config: JobConfig,
        rank: int,
        world_size: int,
        ledger: Ledger,
        process_group: dist.ProcessGroup | None = None,
        on_phase: Callable[[str, int], None] = lambda phase, step: None,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.ledger = ledger
        self.pg = process_group
        self.on_phase = on_phase
        self.layout = config.layout
        self.remote = storage.local_path(self.layout.checkpoints) is None
        remove_stale_spools(config.job_id, rank)
        self._spool: str | None = None  # made by the first save that needs it
        self._stager: ShardedStateStager | None = None
        self._inflight: InFlight | None = None
        self._abandoned: threading.Thread | None = None  # past the preemption budget
        self.failed_steps: list[int] = []  # checkpoints this rank saw fail
        self.skipped_steps: list[int] = []  # saves that found their step committed already
        self._token = self._shared_token()
        self._saves = 0
        self._nonce = ""  # of the latest save
        self._outcome: dict[str, str] = {}  # nonce -> committed | done | skipped | failed
        self._tensors: Mapping[str, Stateful] | None = None  # to DCP, by key
        self._rank_state: Mapping[str, Stateful] = {}  # to this rank's JSON state, by key
        # The config never changes: render its YAML once, not in every save's blocking time
        # (yaml's pure-Python emitter takes 10-30 ms, as long as staging 64 MB).
        self._config_yaml = config_yaml(config)

    @property
    def spool(self) -> str:
        """This process's local folder for checkpoints bound for an object store, made at
        the first save that needs one: a process that never saves there (a standby that is
        released, storage on local disk) leaves none in the temp folder; one killed while
        uploading leaves it in its attempt's control folder (infra.control.scratch_dir)."""
        if self._spool is None:
            prefix = f"{_spool_prefix(self.config.job_id, self.rank)}{os.getpid()}-"
            self._spool = tempfile.mkdtemp(prefix=prefix, dir=scratch_dir())
        return self._spool

    def _shared_token(self) -> str:
        """A random token, the same on every rank (rank 0's), for the saves' nonces. Sent
        once here, before any checkpoint thread uses the group."""
        token = [uuid.uuid4().hex[:12]]
        if self.world_size > 1 and self.pg is not None:
            dist.broadcast_object_list(token, src=0, group=self.pg)
        return str(token[0])

    def _refuse_if_committed(self, step: int) -> None:
        """Raise _AlreadyCommitted on every rank if the step's folder is committed on any
        rank's view (or cannot be checked): a committed folder is never written again.
        Collective on the checkpoint group, right before the save's own collectives."""
        unknown = 2  # storage would not say: this save fails on every rank
        error = ""
        try:
            state = int(storage.exists(storage.join(self.layout.checkpoint(step), MANIFEST)))
        except OSError as exc:
            state, error = unknown, str(exc)
        if self.world_size > 1 and self.pg is not None:
            flag = torch.tensor([state])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
            state = int(flag.item())
        if state == unknown:
            why = error or "another rank could not check"
            raise CheckpointError(f"cannot tell whether step {step} is committed already: {why}")
        if state:
            raise _AlreadyCommitted(step)

    # -- what is saved ----------------------------------------------------------------------
    def register(self, tensors: Mapping[str, Stateful], rank_state: Mapping[str, Stateful]) -> None:
        """What every save holds, given once: ``tensors`` are saved by DCP, each object's
        ``state_dict()`` under its key (tensors only: see state.py); ``rank_state`` goes into
        this rank's JSON state beside the step, each under its key. The objects are read at
        each save, so they must be the live ones that training changes in place."""
        for key, part in {**tensors, **rank_state}.items():
            if not callable(getattr(part, "state_dict", None)):
                raise TypeError(
                    f"checkpoint state {key!r} has no state_dict(): {type(part).__name__}"
                )
        self._tensors, self._rank_state = dict(tensors), dict(rank_state)

    def _require_registered(self, step: int) -> None:
        if self._tensors is None:
            raise RuntimeError(
                f"checkpoint at step {step}: no state registered; call "
                "Checkpointer.register(tensors=..., rank_state=...) before saving"
            )

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The registered state, read now: the tensor state for DCP, and this rank's JSON
        state."""
        assert self._tensors is not None
        tensors = {key: part.state_dict() for key, part in self._tensors.items()}
        return tensors, {key: part.state_dict() for key, part in self._rank_state.items()}

    # -- saving -----------------------------------------------------------------------------
    def _make_stager(self) -> ShardedStateStager:
        """PyTorch's native staging; pinned/shared memory and non-blocking copies need an
        accelerator (on CPU the default options raise). Staging buffers are
        cached by the stager and reused by every later checkpoint."""
        on_gpu = torch.cuda.is_available()
        options = StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=on_gpu,
            use_async_staging=self.config.checkpoint.mode == CheckpointMode.ASYNC_STAGED,
            use_non_blocking_copy=on_gpu,
        )
        return ShardedStateStager(options)

    def _local_dir(self, step: int, create: bool = True) -> str:
        if self.remote:
            path = os.path.join(self.spool, step_dir_name(step))
        else:
            path = storage.local_path(self.layout.checkpoint(step)) or ""
        if create:
            os.makedirs(path, exist_ok=True)
        return path

    def _prepare(self, step: int, extra: dict[str, Any]) -> dcp.FileSystemWriter:
        """The step's local folder with this rank's JSON state (rank 0: the config too), and
        the DCP writer into it."""
        local_dir = self._local_dir(step)
        with open(os.path.join(local_dir, rank_state_name(self.rank)), "w") as fh:
            json.dump({"step": step, **extra}, fh)
        if self.rank == 0:
            with open(os.path.join(local_dir, "config.yaml"), "w") as fh:
                fh.write(self._config_yaml)
        return dcp.FileSystemWriter(local_dir, thread_count=2)

    def _get_stager(self) -> ShardedStateStager:
        """Made at the first async save, then kept: its staging buffers are reused."""
        if self._stager is None:
            self._stager = self._make_stager()
        return self._stager

    def save(self, step: int, anchor: bool = False, blocking: bool = False) -> None:
        """Checkpoint the registered state at ``step``: its tensors for DCP and this rank's
        JSON state (step, data position). The state dicts are built inside the blocking
        span, so building them is accounted as checkpoint time. A step committed already is
        not saved again (logged, recorded in ``skipped_steps``). Raises RuntimeError when
        nothing is registered.

        Blocks only for what the mode must: the previous checkpoint if still in flight, and
        the staging copy (sync mode: the whole write). ``anchor`` and ``blocking`` force a
        synchronous save that has committed when this returns.

        ``async_staged`` starts the copy first and returns: everything else (the JSON state,
        the DCP plan and write, the upload) runs on a writer thread started once the copy is
        done (``wait_until_staged``). On a small CPU host, anything started while the copy
        runs competes with it for the cores: a thread started mid-copy took ~3 ms to get
        scheduled, a third of a 64 MB copy. That is why this path calls ``dcp.save`` on its
        own thread instead of ``dcp.async_save``, which starts its thread mid-copy.
        """
        self._require_registered(step)
        mode = CheckpointMode.SYNC if anchor or blocking else self.config.checkpoint.mode
        nonce = self._nonce = f"{self._token}-{self._saves}"
        self._saves += 1
        with self.ledger.span("checkpoint_blocking", step=step, mode=mode) as attrs:
            waited = self.wait_for_inflight()
            attrs["waited_for_previous_s"] = round(waited, 6)
            self._outcome = {}  # nothing older is waited for again
            state, extra = self._state_dicts()
            error: list[BaseException] = []
            if mode == CheckpointMode.ASYNC_STAGED:
                staging = self._get_stager().begin(state)

                def write_staged() -> None:
                    self._refuse_if_committed(step)
                    writer = self._prepare(step, extra)
                    dcp.save(staging.state_dict(), storage_writer=writer, process_group=self.pg)

                thread = self._commit_thread(step, anchor, nonce, error, write_staged)
                self._inflight = InFlight(step, anchor, staging, thread, error)
                return  # the thread starts in wait_until_staged, once the copy is done
            try:
                self._refuse_if_committed(step)
            except _AlreadyCommitted:
                self._skipped(step, nonce)
                return
            except CheckpointError as exc:
                self._failed(step, nonce, error, exc)
                return
            writer = self._prepare(step, extra)
            if mode == CheckpointMode.SYNC:
                dcp.save(state, storage_writer=writer, process_group=self.pg)
                self.on_phase("staged", step)
                self._finish(step, anchor, nonce, error)
                return
            # "async": DCP stages on this thread, then writes on its own.
            upload = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self.pg,
                async_stager=self._get_stager(),
            )
            self.on_phase("staged", step)
            thread = self._commit_thread(step, anchor, nonce, error, upload.result)
            thread.start()
            self._inflight = InFlight(step, anchor, None, thread, error)

    def _skipped(self, step: int, nonce: str) -> None:
        self.skipped_steps.append(step)
        self._outcome[nonce] = "skipped"
        log.info("checkpoint at step %d is committed already: not writing it again", step)

    def _failed(
        self, step: int, nonce: str, error: list[BaseException], exc: BaseException
    ) -> None:
        error.append(exc)
        self.failed_steps.append(step)
        self._outcome[nonce] = "failed"
        log.error("checkpoint at step %d failed, previous one stays the latest: %s", step, exc)
        self.ledger.mark("checkpoint_failed", step=step, error=str(exc)[:500])
        # Tell rank 0 not to wait for this rank (may fail too, in an outage).
        with contextlib.suppress(OSError):
            storage.write_text(
                storage.join(self.layout.checkpoint(step), failed_marker(self.rank, nonce)), "{}"
            )

    def _commit_thread(
        self,
        step: int,
        anchor: bool,
        nonce: str,
        error: list[BaseException],
        write: Callable[[], Any],
    ) -> threading.Thread:
        return threading.Thread(
            target=self._finish,
            args=(step, anchor, nonce, error, write),
            name=f"ckpt-commit-{step}",
            daemon=True,
        )

    def _release_staged(self, inflight: InFlight) -> None:
        """Once the staging copy is done, start the writer thread (a failed copy included:
        the thread reports it as a failed checkpoint)."""
        if inflight.staging is None:
            return
        wait([inflight.staging.copied])
        inflight.staging = None
        self.on_phase("staged", inflight.step)
        inflight.thread.start()

    def wait_until_staged(self) -> bool:
        """Before the weights change again (next step), the staging copy must be complete.
        Returns whether there was a copy to wait for."""
        inflight = self._inflight
        if inflight is None or inflight.staging is None:
            return False
        with self.ledger.span("checkpoint_blocking", step=inflight.step, phase="staging"):
            self._release_staged(inflight)
        return True

    @property
    def commit_running(self) -> bool:
        """A checkpoint is staging or committing in the background right now."""
        inflight = self._inflight
        return inflight is not None and (inflight.staging is not None or inflight.thread.is_alive())

    def wait_for_inflight(self, timeout_s: float | None = None) -> float:
        """Wait for the in-flight checkpoint to commit (or fail); returns seconds waited."""
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

    def emergency_save(self, step: int, budget_s: float) -> bool:
        """Preempted: save the registered state at ``step`` within ``budget_s`` for the
        WHOLE of it (waiting for the in-flight checkpoint, the new save, the commit). True
        when the step is committed (by this save, by the in-flight one, or before: a
        committed step is not saved again) or checkpoints are off; False when the save
        failed or ran out of time. Every rank returns the same answer unless a rank dies or
        storage fails mid-way. Raises RuntimeError when nothing is registered.

        What outlives a False (a thread stuck in an upload) is abandoned: it cannot
        commit anything older than the committed checkpoint, and the process exits."""
        self._require_registered(step)
        log.warning("preempted: saving at step %d within %.0f s", step, budget_s)
        if self.config.checkpoint.mode == CheckpointMode.OFF:
            return True
        deadline = time.monotonic() + budget_s
        inflight = self._inflight
        try:
            self.wait_for_inflight(timeout_s=budget_s)
        except TimeoutError:
            assert inflight is not None
            log.error(
                "emergency save at step %d: the checkpoint of step %d is still uploading "
                "after the whole %.0f s budget",
                step,
                inflight.step,
                budget_s,
            )
            self._abandoned, self._inflight = inflight.thread, None
            return False
        result: list[bool] = []
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def save_and_confirm() -> None:
            if device is not None:  # the current device is per thread
                torch.cuda.set_device(device)
            self.save(step, blocking=True)
            result.append(self._confirm(step, deadline))

        thread = threading.Thread(target=save_and_confirm, name=f"ckpt-emergency-{step}")
        thread.daemon = True
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.error("emergency save at step %d ran out of its %.0f s budget", step, budget_s)
            self.ledger.mark("checkpoint_failed", step=step, error="preemption budget exceeded")
            self._abandoned = thread
            return False
        return bool(result and result[0])

    def _confirm(self, step: int, deadline: float) -> bool:
        """After a blocking save: is ``step`` committed? Rank 0 knows (it commits); the
        other ranks wait for the manifest of this save."""
        outcome = self._outcome.get(self._nonce)
        if outcome in ("committed", "skipped"):
            return True
        if outcome != "done":  # failed
            return False
        url = self.layout.checkpoint(step)
        while time.monotonic() < deadline:
            try:
                if storage.exists(storage.join(url, MANIFEST)):
                    return read_manifest(url).nonce == self._nonce
                if storage.exists(storage.join(url, failed_marker(0, self._nonce))):
                    return False
            except (OSError, CheckpointError) as exc:
                log.warning("emergency save at step %d: cannot read its commit: %s", step, exc)
            time.sleep(0.05)
        return False

    def _finish(
        self,
        step: int,
        anchor: bool,
        nonce: str,
        error: list[BaseException],
        write: Callable[[], Any] | None = None,
    ) -> None:
        """Finish the DCP write (``write``), upload, mark this rank done, commit (rank 0).
        Runs on the commit thread, except in sync mode."""
        url = self.layout.checkpoint(step)
        local_dir = self._local_dir(step, create=False)
        try:
            if write is not None:
                write()
            self.on_phase("written", step)
            files = self._my_files(local_dir)
            entries = {name: FileEntry(os.path.getsize(p), sha256_file(p)) for name, p in files}
            if self.remote:
                for name, path in files:
                    storage.put_file(path, storage.join(url, name))
            self.on_phase("uploaded", step)
            done = {name: vars(entry) for name, entry in entries.items()}
            storage.write_text(storage.join(url, done_marker(self.rank, nonce)), json.dumps(done))
            if self.rank == 0:
                self._commit(step, url, anchor, nonce)
            self._outcome[nonce] = "committed" if self.rank == 0 else "done"
        except _AlreadyCommitted:
            self._skipped(step, nonce)
        except BaseException as exc:  # noqa: BLE001 - reported, never kills training
            self._failed(step, nonce, error, exc)
        finally:
            if self.remote:
                shutil.rmtree(local_dir, ignore_errors=True)

    def _my_files(self, local_dir: str) -> list[tuple[str, str]]:
        """The files this rank wrote: its DCP shard files and JSON state; rank 0 adds the
        DCP metadata and the config."""
        mine = []
        for name in sorted(os.listdir(local_dir)):
            owned = name.startswith(f"__{self.rank}_") or name.endswith(
                f".rank{self.rank:03d}.json"
            )
            if self.rank == 0 and name in (".metadata", "config.yaml"):
                owned = True
            if owned and not name.startswith(("_done", "_failed")):
                mine.append((name, os.path.join(local_dir, name)))
        return mine

    def _commit(self, step: int, url: str, anchor: bool, nonce: str) -> None:
        """Rank 0: once every rank's done-marker of this save is there, write the manifest
        (last)."""
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        markers = [storage.join(url, done_marker(r, nonce)) for r in range(self.world_size)]
        while not all(storage.exists(m) for m in markers):
            if storage.glob(storage.join(url, f"_failed.rank*.{nonce}.json")):
                raise CheckpointError(f"checkpoint {url}: another rank failed to write it")
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {url}: not every rank finished its upload")
            time.sleep(0.05)
        files: dict[str, FileEntry] = {}
        for marker in markers:
            files.update(
                {n: FileEntry(**e) for n, e in json.loads(storage.read_text(marker)).items()}
            )
        manifest = Manifest(
            step=step,
            world_size=self.world_size,
            config_hash=self.config.model_hash(),
            files=files,
            anchor=anchor,
            job_id=self.config.job_id,
            nonce=nonce,
        )
        self.on_phase("before_manifest", step)
        storage.write_text(storage.join(url, MANIFEST), manifest.to_json())
        size = sum(e.size for e in files.values())
        self.ledger.mark("checkpoint_committed", step=step, url=url, bytes=size, anchor=anchor)
        if anchor:
            self.ledger.mark("anchor_committed", step=step, url=url)
        try:
            train = self.config.train
            pending_eval = train.eval_every if train.eval == EvalMode.ASYNC else 0
            purge_old(
                self.layout,
                self.config.checkpoint.keep_latest_k,
                keep=url,
                eval_every=pending_eval,
            )
        except Exception as exc:  # noqa: BLE001 - committed already; the next commit retries
            log.warning("checkpoint at step %d committed; deleting old ones failed: %s", step, exc)

    def close(self) -> None:
        """Wait for the in-flight checkpoint and release the stager's resources (an
        emergency save abandoned past its budget is not waited for)."""
        try:
            if self._abandoned is None:
                self.wait_for_inflight()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._spool is not None:
                shutil.rmtree(self._spool, ignore_errors=True)
