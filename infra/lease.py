"""One job id, one job: a lease on the job's folder, kept alive by a heartbeat.

Two jobs with the same ``job_id`` would share one folder: they would interleave their
ledgers, purge each other's in-flight checkpoints and resume from each other's state. So
whoever runs a job holds its lease, and a second job refuses to start (exit JOB_LOCKED)
with a message naming the job URL and the holder.

Who holds it: the orchestrator of a job (the Prefect flow, ``ett train``) for the whole
job, passing its token to every trainer rank in ``ETT_JOB_LEASE``; the ranks only check
that the lease is theirs (``trainer_lease``), so several trainer groups of one job (an
attempt and the warm standby of the next) never lock each other out. A trainer started
without that variable (plain ``torchrun -m trainer``) takes its own lease on rank 0 for the
attempt's life; its other ranks wait until rank 0 holds it, and take the attempt number rank 0
wrote in it.

How, on any store: the lease is a series of generation files
``<job>/_lease/<generation>.json``, each created exclusively (an atomic create on local
disk, a conditional PUT ``If-None-Match: *`` on S3; other stores: write, then read back the
random token), so of two jobs taking the next generation only one can win. The holder
rewrites its own generation every ``ttl_s / 3`` (only it writes that file); one that stops
renewing for ``ttl_s`` has lost the lease to whoever takes the next generation. A holder
whose process is gone on this machine (killed attempt) is taken over at once; one on
another machine after ``ttl_s`` (clocks of the machines must agree to well within it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from infra import processes, storage
from infra.job_layout import JobLayout

log = logging.getLogger(__name__)

ENV_VAR = "ETT_JOB_LEASE"
DEFAULT_TTL_S = 60.0
RANK0_WAIT_S = 600.0  # how long other ranks wait for rank 0's lease before giving up


class JobLocked(RuntimeError):
    """Another live job holds this job id; the message names the job URL and the holder."""


def _machine() -> str:
    """This machine and process namespace: pids can be checked only within one."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts)


def _run_id() -> str:
    """The torchrun launch this process belongs to ("" when not under torchrun)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run else ""


@dataclass(frozen=True)
class LeaseRecord:
    """One generation of a job's lease, as stored."""

    token: str
    generation: int
    holder: str  # for messages: host, pid, command
    machine: str
    pid: int
    run_id: str
    ttl_s: float
    renewed_at: float
    released: bool = False
    # A trainer without an orchestrator: rank 0's attempt number, which its other ranks take
    # (each rank counting its own ledger files disagrees once the world size has changed).
    attempt: int | None = None

    def live(self, now: float | None = None) -> bool:
        """Held: not released, renewed within its TTL, and its process not known dead."""
        now = time.time() if now is None else now
        if self.released or now > self.renewed_at + self.ttl_s:
            return False
        return not (self.machine == _machine() and not processes.pid_alive(self.pid))

    def describe(self) -> str:
        age = time.time() - self.renewed_at
        return (
            f"{self.holder} (token {self.token[:8]}, renewed {age:.0f} s ago, "
            f"ttl {self.ttl_s:.0f} s)"
        )


def _generation_url(layout: JobLayout, generation: int) -> str:
    return storage.join(layout.lease, f"{generation:012d}.json")


def _generations(layout: JobLayout) -> list[int]:
    return sorted(
        int(name[:-5])
        for name in storage.listdir(layout.lease)
        if name.endswith(".json") and name[:-5].isdigit()
    )


def current_lease(layout: JobLayout) -> LeaseRecord | None:
    """The newest generation of the job's lease (live or not); None if never taken."""
    for _ in range(5):
        found = _generations(layout)
        if not found:
            return None
        try:
            data = json.loads(storage.read_text(_generation_url(layout, found[-1])))
        except FileNotFoundError:
            continue  # removed while listing: list again
        except json.JSONDecodeError:
            time.sleep(0.05)  # created without hard links and still being written
            continue
        return LeaseRecord(**data)
    raise storage.StorageError(f"the lease of job {layout.url} cannot be read")


def _create_exclusive(url: str, record: LeaseRecord) -> bool:
    """Create ``url`` holding ``record`` unless it exists; True if this call created it."""
    data = json.dumps(asdict(record)).encode()
    local = storage.local_path(url)
    if local is not None:
        tmp = storage.write_synced(local, data, f"{record.token}.tmp")
        try:
            os.link(tmp, local)  # atomic, and fails if the name exists
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: an exclusive create, then the content
            try:
                fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            return True
        finally:
            os.unlink(tmp)
    fs, path = storage.split(url)

    def put() -> None:
        try:
            if url.startswith(("s3://", "s3a://")):
                fs.pipe_file(path, data, mode="create")  # If-None-Match: *
            elif not fs.exists(path):  # no conditional writes: settled by the read-back
                fs.pipe_file(path, data)
        except FileExistsError:
            pass  # someone else's, or ours from a try whose answer was lost: read back

    storage.call(f"create {url}", put)
    try:
        return json.loads(storage.read_text(url))["token"] == record.token
    except FileNotFoundError:
        raise storage.StorageError(f"could not create the job lease {url}") from None


def _write(url: str, record: LeaseRecord) -> None:
    storage.write_text(url, json.dumps(asdict(record)))


class JobLease:
    """A held lease: renewed on a heartbeat thread until ``release`` (or the context
    manager's exit). ``lost`` is set when another job took it over (this holder failed to
    renew it for ``ttl_s``): the holder should stop writing to the job."""

    def __init__(self, layout: JobLayout, record: LeaseRecord) -> None:
        self.layout = layout
        self._record = record
        self._url = _generation_url(layout, record.generation)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="job-lease", daemon=True)
        self._thread.start()

    @property
    def token(self) -> str:
        """The owner token: give it to the job's trainers in ``ETT_JOB_LEASE``."""
        return self._record.token

    def env(self) -> dict[str, str]:
        return {ENV_VAR: self.token}

    def renew(self) -> bool:
        """Extend the lease by ``ttl_s``; False (and ``lost`` set) if another job took it."""
        newer = [g for g in _generations(self.layout) if g > self._record.generation]
        if newer:
            self.lost.set()
            holder = current_lease(self.layout)
            log.error(
                "lost the lease on job %s to %s",
                self.layout.url,
                holder.describe() if holder else "another job",
            )
            return False
        self._record = replace(self._record, renewed_at=time.time())
        _write(self._url, self._record)
        return True

    def _beat(self) -> None:
        interval = self._record.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                if not self.renew():
                    return
            except OSError as exc:  # storage trouble: the next beat tries again
                log.warning("could not renew the lease on job %s: %s", self.layout.url, exc)

    def release(self) -> None:
        """Stop renewing and mark the lease free (unless another job took it meanwhile)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self.lost.is_set():
            return
        try:
            if not [g for g in _generations(self.layout) if g > self._record.generation]:
                _write(self._url, replace(self._record, released=True, renewed_at=time.time()))
        except OSError as exc:  # it expires by itself
            log.warning("could not release the lease on job %s: %s", self.layout.url, exc)

    def __enter__(self) -> JobLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _locked(layout: JobLayout, holder: LeaseRecord) -> JobLocked:
    return JobLocked(
        f"job {layout.url} is in use by another job with the same job_id: held by "
        f"{holder.describe()}; wait for it to end, or choose another job_id"
    )


def acquire_job_lease(
    layout: JobLayout,
    owner: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    wait_s: float = 0.0,
    attempt: int | None = None,
) -> JobLease:
    """Take the job's lease (usable as a context manager that releases it).

    ``owner``: the token to hold it under (default: a new random one); a lease already held
    under the same token is taken over (the same owner starting again). ``wait_s``: how long
    to wait for a live holder to let go before raising JobLocked. ``attempt``: the attempt
    number a trainer's rank 0 tells its other ranks.
    """
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    token = owner or uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while True:
        current = current_lease(layout)
        if current is not None and current.live() and current.token != token:
            if time.monotonic() >= deadline:
                raise _locked(layout, current)
            time.sleep(min(1.0, ttl_s / 10))
            continue
        generation = 0 if current is None else current.generation + 1
        record = LeaseRecord(
            token=token,
            generation=generation,
            holder=f"{socket.gethostname()} pid {os.getpid()}",
            machine=_machine(),
            pid=os.getpid(),
            run_id=_run_id(),
            ttl_s=ttl_s,
            renewed_at=time.time(),
            attempt=attempt,
        )
        if _create_exclusive(_generation_url(layout, generation), record):
            for old in _generations(layout):
                if old < generation:
                    with contextlib.suppress(OSError):
                        storage.remove(_generation_url(layout, old))
            log.info("holding the lease on job %s (generation %d)", layout.url, generation)
            return JobLease(layout, record)
        # another job created this generation first: look again


def check_job_lease(layout: JobLayout, token: str) -> None:
    """Raise JobLocked unless the job's lease is held under ``token`` (the orchestrator's,
    from ``ETT_JOB_LEASE``). Read-only: any number of processes of the job may check."""
    current = current_lease(layout)
    if current is None or current.token != token or current.released:
        held = current.describe() if current is not None and current.live() else "nobody"
        raise JobLocked(
            f"job {layout.url}: {ENV_VAR} names lease {token[:8]}, but the lease is held by "
            f"{held}; the orchestrator that started this trainer no longer owns the job"
        )


def _wait_for_rank0(layout: JobLayout, run_id: str, wait_s: float) -> LeaseRecord:
    """Other ranks of a trainer without an orchestrator: wait until rank 0 holds the lease
    (rank 0 alone decides; if it is refused it exits, and torchrun stops this rank)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        current = current_lease(layout)
        if current is not None and current.run_id == run_id and current.live():
            return current
        time.sleep(0.2)
    raise JobLocked(f"job {layout.url}: rank 0 took no lease within {wait_s:.0f} s")


@contextlib.contextmanager
def trainer_lease(
    layout: JobLayout, rank: int, attempt: int = 0, ttl_s: float = DEFAULT_TTL_S
) -> Iterator[int]:
    """The trainer's side, around a whole attempt; yields the attempt number every rank
    uses. With ``ETT_JOB_LEASE`` set, check that the lease is the orchestrator's (which
    numbered the attempt: ``attempt`` as given); without, rank 0 holds its own lease for the
    attempt with its ``attempt`` in it, and the other ranks take that number."""
    token = os.environ.get(ENV_VAR)
    if token:
        check_job_lease(layout, token)
        yield attempt
    elif rank == 0:
        with acquire_job_lease(layout, ttl_s=ttl_s, attempt=attempt):
            yield attempt
    else:
        held = _wait_for_rank0(layout, _run_id(), RANK0_WAIT_S)
        yield attempt if held.attempt is None else held.attempt
