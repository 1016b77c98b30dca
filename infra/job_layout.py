"""Where everything of one job lives on its storage: the one place its paths are spelled.

    <root>/jobs/<job_id>/
        job.yaml              the resolved config, as every process of the job reads it
        ledger/               the ETT ledger: one file per process (infra/accounting/ledger.py)
        checkpoints/          committed checkpoints (infra/checkpoint_manifest.py)
            step-000000120/
            quarantine/       checkpoints found corrupt, kept for inspection
        _lease/               one job id, one job (infra/lease.py)
        final_metrics.json    the last holdout evaluation and the loader's counts
    <root>/compile-cache/     shared by every job under the root (``train.compile_cache_url``)

Every process of a job builds its paths from a ``JobLayout``: the orchestrator from the
config, the ranks from the config they were handed, ``ett report`` from a job id or a URL.
A URL is parsed back into a layout in one place only (``JobLayout.at``).
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.urls import join

JOBS = "jobs"
COMPILE_CACHE = "compile-cache"


def step_dir_name(step: int) -> str:
    """A checkpoint's folder under ``checkpoints/``: ``step-000000120``."""
    return f"step-{step:09d}"


@dataclass(frozen=True)
class JobLayout:
    """The storage paths of one job: its folder ``url``, its id, and the storage ``root``
    whose shared folders (the compile cache, the other jobs) it uses."""

    url: str
    job_id: str
    root: str
    compile_cache_url: str | None = None  # None: <root>/compile-cache

    @classmethod
    def for_job(cls, root: str, job_id: str, compile_cache_url: str | None = None) -> JobLayout:
        root = root.rstrip("/")
        return cls(join(root, JOBS, job_id), job_id, root, compile_cache_url)

    @classmethod
    def at(cls, url: str) -> JobLayout:
        """The layout of the job whose folder is ``url``: ``<root>/jobs/<job id>`` names its
        root and id; any other folder is taken as a job of its own (its last part the id, its
        parent the root), so a ledger or checkpoints kept elsewhere can still be read."""
        url = url.rstrip("/")
        root, sep, job_id = url.rpartition(f"/{JOBS}/")
        if sep and job_id and "/" not in job_id:
            return cls(url, job_id, root)
        parent, _, name = url.rpartition("/")
        return cls(url, name, parent)

    @classmethod
    def of_checkpoint(cls, ckpt_url: str) -> JobLayout | None:
        """The job a checkpoint folder ``<job>/checkpoints/step-N`` belongs to; None for a
        checkpoint kept anywhere else."""
        head, sep, _ = ckpt_url.rstrip("/").rpartition("/")
        job, _, name = head.rpartition("/")
        return cls.at(job) if sep and name == "checkpoints" and job else None

    @property
    def config(self) -> str:
        return join(self.url, "job.yaml")

    @property
    def ledger(self) -> str:
        return join(self.url, "ledger")

    @property
    def checkpoints(self) -> str:
        return join(self.url, "checkpoints")

    def checkpoint(self, step: int) -> str:
        return join(self.checkpoints, step_dir_name(step))

    @property
    def lease(self) -> str:
        return join(self.url, "_lease")

    @property
    def final_metrics(self) -> str:
        return join(self.url, "final_metrics.json")

    @property
    def compile_cache(self) -> str:
        return self.compile_cache_url or join(self.root, COMPILE_CACHE)

    @property
    def jobs(self) -> str:
        """The folder of every job under the same root."""
        return join(self.root, JOBS)
