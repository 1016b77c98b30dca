"""How a checkpoint becomes committed: a checkpoint exists once its manifest exists.

Every checkpoint is written by DCP into a local folder (the final folder on local storage,
a spool folder for object stores), then, off the training thread, uploaded file by file
(parallel multipart for large files); each rank records its files' sizes and checksums in
a small done-marker, and rank 0 writes the manifest last, once every rank is done. A rank
whose save fails writes a failed-marker instead, so rank 0 stops waiting.

A committed checkpoint is never written again: before writing, the ranks agree (one tiny
all-reduce) whether the step's folder is committed already, and if so the save is a no-op.
Each save has a nonce shared by all ranks; done-markers and the manifest carry it, so
markers left by an earlier, failed try at the same step can never complete this one.

When a checkpoint is saved and how long the loop blocks for it is the checkpointer's
(checkpointer.py); this module is the protocol every save follows once it writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from infra import processes, storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
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
from infra.settings import EvalMode, JobConfig, config_yaml
from trainer.checkpoint.delta import Link, rows_file
from trainer.checkpoint.retention import purge_old
from trainer.checkpoint.state import LOADER
from trainer.checkpoint.verify import sha256_file

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 600.0


class CheckpointPhase(StrEnum):
    """Points of one checkpoint's life, for ``on_phase`` hooks (trainer/faults.py, tests)."""

    STAGED = "staged"  # the state is copied: the weights may change
    WRITTEN = "written"  # DCP wrote this rank's files locally
    UPLOADED = "uploaded"  # ...and they are stored
    BEFORE_MANIFEST = "before_manifest"  # rank 0, every rank done: the commit is next
    MEMORY_MIDWAY = "memory_midway"  # an in-memory copy half written (memory_tier.py)


class SaveOutcome(StrEnum):
    """What became of one save on this rank."""

    COMMITTED = "committed"  # rank 0 wrote its manifest
    DONE = "done"  # this rank's files are stored; rank 0 commits
    SKIPPED = "skipped"  # the step was committed already
    FAILED = "failed"


class AlreadyCommitted(Exception):
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


class Committer:
    """One per rank: the nonces, the local folders and the outcome of every save."""

    def __init__(
        self,
        config: JobConfig,
        rank: int,
        world_size: int,
        ledger: Ledger,
        process_group: dist.ProcessGroup | None,
        on_phase: Callable[[str, int], None],
    ) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.ledger, self.pg, self.on_phase = ledger, process_group, on_phase
        self.layout = config.layout
        self.remote = storage.local_path(self.layout.checkpoints) is None
        remove_stale_spools(config.job_id, rank)
        self._spool: str | None = None  # made by the first save that needs it
        self.failed_steps: list[int] = []  # checkpoints this rank saw fail
        self.skipped_steps: list[int] = []  # saves that found their step committed already
        self._token = self._shared_token()
        self._saves = 0
        self.nonce = ""  # of the latest save
        self._outcome: dict[str, SaveOutcome] = {}  # by nonce, since the latest save began
        self._links: dict[str, Link] = {}  # incremental commits: the latest save's link
        # The config never changes: render its YAML once, not in every save's blocking time
        # (yaml's pure-Python emitter takes 10-30 ms, as long as staging 64 MB).
        self._config_yaml = config_yaml(config)
        self.plan: dict[str, Any] = {}  # the tables' sharding, for the manifest (register)
        self._positions: dict[int, dict[str, int]] = {}  # rank 0: step -> data position

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

    def begin(self) -> str:
        """A new save: its nonce (the same on every rank: they save in the same order)."""
        self.nonce = f"{self._token}-{self._saves}"
        self._saves += 1
        self._outcome = {}  # nothing older is waited for again
        self._links = {}
        return self.nonce

    def previous_stored(self) -> bool:
        """The latest save stored this rank's part (rank 0: committed it), or found its
        step committed: a delta may link to it."""
        stored = (SaveOutcome.COMMITTED, SaveOutcome.DONE, SaveOutcome.SKIPPED)
        return self._outcome.get(self.nonce) in stored

    def chain(self, nonce: str, link: Link) -> None:
        """The save ``nonce`` is this link of an incremental chain (its manifest says so)."""
        self._links[nonce] = link

    def refuse_if_committed(self, step: int) -> None:
        """Raise AlreadyCommitted on every rank if the step's folder is committed on any
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
            raise AlreadyCommitted(step)

    def _local_dir(self, step: int, create: bool = True) -> str:
        if self.remote:
            path = os.path.join(self.spool, step_dir_name(step))
        else:
            path = storage.local_path(self.layout.checkpoint(step)) or ""
        if create:
            os.makedirs(path, exist_ok=True)
        return path

    def prepare(
        self, step: int, extra: dict[str, Any], rows: dict[str, Any] | None = None
    ) -> dcp.FileSystemWriter:
        """The step's local folder with this rank's JSON state (rank 0: the config too; a
        delta: this rank's touched rows), and the DCP writer into it."""
        local_dir = self._local_dir(step)
        with open(os.path.join(local_dir, rank_state_name(self.rank)), "w") as fh:
            json.dump({"step": step, **extra}, fh)
        if rows is not None:
            torch.save(rows, os.path.join(local_dir, rows_file(self.rank)))
        if self.rank == 0:
            with open(os.path.join(local_dir, "config.yaml"), "w") as fh:
                fh.write(self._config_yaml)
            self._positions[step] = dict(extra.get(LOADER) or {})
        return dcp.FileSystemWriter(local_dir, thread_count=2)

    def skipped(self, step: int, nonce: str) -> None:
        self.skipped_steps.append(step)
        self._outcome[nonce] = SaveOutcome.SKIPPED
        log.info("checkpoint at step %d is committed already: not writing it again", step)

    def failed(self, step: int, nonce: str, error: list[BaseException], exc: BaseException) -> None:
        error.append(exc)
        self.failed_steps.append(step)
        self._outcome[nonce] = SaveOutcome.FAILED
        log.error("checkpoint at step %d failed, previous one stays the latest: %s", step, exc)
        self.ledger.mark(Mark.CHECKPOINT_FAILED, step=step, error=str(exc)[:500])
        # Tell rank 0 not to wait for this rank (may fail too, in an outage).
        with contextlib.suppress(OSError):
            storage.write_text(
                storage.join(self.layout.checkpoint(step), failed_marker(self.rank, nonce)), "{}"
            )

    def finish(
        self,
        step: int,
        anchor: bool,
        nonce: str,
        error: list[BaseException],
        write: Callable[[], Any] | None = None,
    ) -> None:
        """Finish the DCP write (``write``), upload, mark this rank done, commit (rank 0).
        Runs on the checkpointer's background thread, except in sync mode. Never raises: a
        failed checkpoint is logged and marked, and the previous committed one stays the
        latest."""
        url = self.layout.checkpoint(step)
        local_dir = self._local_dir(step, create=False)
        try:
            if write is not None:
                write()
            self.on_phase(CheckpointPhase.WRITTEN, step)
            files = self._my_files(local_dir)
            entries = {name: FileEntry(os.path.getsize(p), sha256_file(p)) for name, p in files}
            if self.remote:
                for name, path in files:
                    storage.put_file(path, storage.join(url, name))
            self.on_phase(CheckpointPhase.UPLOADED, step)
            done = {name: vars(entry) for name, entry in entries.items()}
            storage.write_text(storage.join(url, done_marker(self.rank, nonce)), json.dumps(done))
            if self.rank == 0:
                self._commit(step, url, anchor, nonce)
            self._outcome[nonce] = SaveOutcome.COMMITTED if self.rank == 0 else SaveOutcome.DONE
        except AlreadyCommitted:
            self.skipped(step, nonce)
        except BaseException as exc:  # noqa: BLE001 - reported, never kills training
            self.failed(step, nonce, error, exc)
        finally:
            if self.remote:
                shutil.rmtree(local_dir, ignore_errors=True)

    def _my_files(self, local_dir: str) -> list[tuple[str, str]]:
        """The files this rank wrote: its DCP shard files and JSON state; rank 0 adds the
        DCP metadata and the config."""
        mine = []
        for name in sorted(os.listdir(local_dir)):
            owned = name.startswith(f"__{self.rank}_") or name.endswith(
                (f".rank{self.rank:03d}.json", f".rank{self.rank:03d}.pt")
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
        for older in [s for s in list(self._positions) if s < step]:  # saves that never committed
            self._positions.pop(older, None)
        for marker in markers:
            files.update(
                {n: FileEntry(**e) for n, e in json.loads(storage.read_text(marker)).items()}
            )
        link = self._links.get(nonce)
        manifest = Manifest(
            step=step,
            world_size=self.world_size,
            config_hash=self.config.model_hash(),
            files=files,
            anchor=anchor,
            job_id=self.config.job_id,
            nonce=nonce,
            plan=self.plan,
            data_position=self._positions.pop(step, {}),
            **(
                {}
                if link is None
                else {
                    "kind": link.kind,
                    "base_step": link.base_step,
                    "previous_step": link.previous_step,
                }
            ),
        )
        self.on_phase(CheckpointPhase.BEFORE_MANIFEST, step)
        storage.write_text(storage.join(url, MANIFEST), manifest.to_json())
        self.ledger.mark(
            Mark.CHECKPOINT_COMMITTED,
            step=step,
            url=url,
            bytes=manifest.bytes,
            anchor=anchor,
            kind=manifest.kind,
        )
        if anchor:
            self.ledger.mark(Mark.ANCHOR_COMMITTED, step=step, url=url)
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

    def confirm(self, step: int, deadline: float) -> bool:
        """After a blocking save: is ``step`` committed? Rank 0 knows (it commits); the
        other ranks wait for the manifest of this save, or for rank 0's failed-marker."""
        outcome = self._outcome.get(self.nonce)
        if outcome in (SaveOutcome.COMMITTED, SaveOutcome.SKIPPED):
            return True
        if outcome != SaveOutcome.DONE:  # failed
            return False
        url = self.layout.checkpoint(step)
        while time.monotonic() < deadline:
            try:
                if storage.exists(storage.join(url, MANIFEST)):
                    return read_manifest(url).nonce == self.nonce
                if storage.exists(storage.join(url, failed_marker(0, self.nonce))):
                    return False
            except (OSError, CheckpointError) as exc:
                log.warning("emergency save at step %d: cannot read its commit: %s", step, exc)
            time.sleep(0.05)
        return False

    def close(self) -> None:
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
