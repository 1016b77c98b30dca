"""Which job a start continues, if any: the one place a job gets its id.

A job starts new unless asked otherwise. A config without ``job_id`` (a deployment run, ``ett
train``, a flow call) gets a new id, ``<name>-<UTC yyyymmdd-HHMMSS>-<4 hex>``
(``infra.settings.new_job_id``). A job is continued only when asked: an explicit ``job_id``
of an unfinished job (its attempts carry on numbering, its report covers them all), or
``resume``, the newest unfinished job that ``<name>`` started. A finished job (its ledger
holds the trainer's ``job_end`` mark) is refused before anything is written: a second run of
it would add an empty attempt, count the time between the runs as lost, and announce its
anchor again.
"""

from __future__ import annotations

import re

from infra import storage
from infra.accounting.ledger_format import Mark
from infra.accounting.ledger_read import read_events
from infra.job_layout import JOBS, JobLayout
from infra.settings import JobConfig, new_job_id


class JobFinished(ValueError):
    """The job id names a job that finished: it is never run again."""


class NothingToResume(ValueError):
    """``resume`` was asked for, and no unfinished job of that name is there."""


def finished(layout: JobLayout) -> bool:
    """Whether the job trained to its end: the trainer marked ``job_end`` in its ledger."""
    if not storage.glob(storage.join(layout.ledger, "*")):
        return False  # a new job: nothing to read
    return any(e.name == Mark.JOB_END for e in read_events(layout))


def _started_by(config: JobConfig, name: str) -> list[str]:
    """The ids ``new_job_id(name)`` gave under the config's storage root, newest first."""
    made = re.compile(rf"{re.escape(name)}-\d{{8}}-\d{{6}}-[0-9a-f]{{4}}")
    jobs = storage.join(config.storage.root.rstrip("/"), JOBS)
    ids = {url.rstrip("/").rsplit("/", 2)[-2] for url in storage.glob(f"{jobs}/{name}-*/*")}
    # newest first: the time in the id, then the suffix (only a tie-break within a second)
    return sorted((i for i in ids if made.fullmatch(i)), reverse=True)


def resolve(
    config: JobConfig,
    name: str,
    resume: bool = False,
    when: float | None = None,
    salt: str | None = None,
) -> JobConfig:
    """The config with the id of the job this start runs: the one it names (unfinished), the
    newest unfinished one ``name`` started (``resume``), or a new one (``new_job_id(name,
    when, salt)``). Raises JobFinished or NothingToResume, each one line; reads the job's
    ledger, writes nothing. The storage must be configured (``storage.configure``)."""
    job_id = config.job_id
    if job_id is None and resume:
        for candidate in _started_by(config, name):
            if not finished(config.model_copy(update={"job_id": candidate}).layout):
                job_id = candidate
                break
        else:
            raise NothingToResume(
                f"no unfinished {name} job under {config.storage.root} to resume; "
                "leave resume out to start a new job"
            )
    if job_id is None:
        return config.model_copy(update={"job_id": new_job_id(name, when, salt)})
    resolved = config.model_copy(update={"job_id": job_id})
    if finished(resolved.layout):
        raise JobFinished(
            f"job {job_id} is finished (its ledger holds job_end): it is not run again; "
            "leave job_id out (or pass a new one) to start a new job"
        )
    return resolved
