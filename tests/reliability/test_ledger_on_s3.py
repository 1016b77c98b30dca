"""The ETT ledger on object storage, and the anchor without it (faults from outside).

- A rank SIGKILLed mid-training on S3 (moto) gives the same report as the same job on
  ``file://``: last step, died-at and wasted time. The killed process's unsent events are in
  its local spool; the next attempt on the node uploads them.
- A ledger that cannot be stored at the end (S3 cut by a proxy) fails the attempt with
  LEDGER_NOT_SAVED instead of passing for a success; its events wait in the spool and are
  uploaded once S3 is back.
- The flow finds the anchor from the committed manifests, with no ledger at all.

Real trainer under torchrun, the orchestrator's attempt loop, real sockets; nothing mocked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.accounting.ett import report_for_job
from infra.accounting.ledger import recover_orphaned_spools
from infra.accounting.ledger_format import Span
from infra.accounting.ledger_read import read_events, read_files
from infra.accounting.records import EttReport
from infra.checkpoint_manifest import MANIFEST, Manifest, committed_checkpoints
from infra.control import Progress
from infra.exit_codes import ExitCode, Outcome
from infra.job_layout import JobLayout, step_dir_name
from infra.settings import JobConfig
from tasks.events import Anchor, find_anchor
from tasks.orchestrator import JobObserver, run
from tests import procs
from tests.factories import ROOT, tiny_config, with_sections, write_dataset
from tests.procs import MARKER
from tests.tcp_proxy import TcpProxy

STEPS, EVERY = 40, 10
LAST_STEP = 37  # the rank is killed after this step: steps 31-37 are redone
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tiny_config(tmp_path_factory.mktemp("ledger-data"))
    write_dataset(config)
    return config.data.url


def _config(tmp_path: Path, data_url: str, storage_section: dict[str, Any], **sections: Any):
    return tiny_config(
        tmp_path,
        job_id="ledger-on-s3",
        storage=storage_section,
        data={"url": data_url},
        train={"steps": STEPS, "eval": "off", "eval_rows": 256, "log_every": 1},
        **sections,
    )


def _trainer_pids(marker: str) -> list[int]:
    """The processes of this job's attempts: torchrun and its ranks (by their environment)."""
    return procs.carrying(**{MARKER: marker})


def _rank_pid(marker: str) -> int:
    """The one rank of the attempt: forked from the launcher, so the child of another."""
    pids = _trainer_pids(marker)
    ranks = [pid for pid in pids if _parent(pid) in pids]
    assert len(ranks) == 1, ranks
    return ranks[0]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _run_job(
    config: JobConfig,
    tmp_path: Path,
    on_progress: Callable[[Progress], None],
    max_failures: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """The orchestrator's attempt loop over the real trainer (no standby: this is about the
    ledger); ``on_progress`` sees every attempt's progress. Every process of the job is
    gone when it returns."""
    marker = str(tmp_path)
    job = with_sections(
        config, recovery={"max_failures": max_failures, "backoff_s": 0, "standby": False}
    )
    try:
        outcome = run(
            job, Progressed(on_progress), env={**ENV, **(env or {}), MARKER: marker}
        ).outcome
    finally:
        assert _trainer_pids(marker) == [], "a trainer process outlived its job"
    return list(outcome.attempts)


class Progressed(JobObserver):
    """Hands every progress record to ``on_progress``."""

    def __init__(self, on_progress: Callable[[Progress], None]) -> None:
        self.on_progress = on_progress

    def progress(self, progress: Progress) -> None:
        self.on_progress(progress)


def _kill_after(config: JobConfig, tmp_path: Path, seen: dict[str, float], errors: list[str]):
    """attempt 0's progress callback: after step LAST_STEP (the rank then hangs at the next
    step, so it makes no more), wait until the step-30 checkpoint is committed (so both
    runs resume from it) and SIGKILL the rank from outside."""
    marker = str(tmp_path)

    def on_step(progress: Progress) -> None:
        if progress.step != LAST_STEP or "line" in seen:
            return
        seen["line"] = time.time()
        try:
            deadline = time.monotonic() + 120
            while not any(c.step == 30 for c in committed_checkpoints(config.layout)):
                assert time.monotonic() < deadline, "step 30 never committed"
                time.sleep(0.05)
            pid = _rank_pid(marker)
            seen["kill"] = time.time()
            os.kill(pid, signal.SIGKILL)
        except Exception as exc:  # noqa: BLE001 - the watcher swallows callback errors
            errors.append(repr(exc))

    return on_step


def _killed_job(tmp_path: Path, data_url: str, storage_section: dict[str, Any]) -> tuple:
    config = _config(
        tmp_path,
        data_url,
        storage_section,
        checkpoint={"mode": "async_staged", "every_steps": EVERY, "keep_latest_k": 3},
        faults=[{"kind": "hang", "step": LAST_STEP + 1, "attempt": 0}],
    )
    seen: dict[str, float] = {}
    errors: list[str] = []
    attempts = _run_job(config, tmp_path, _kill_after(config, tmp_path, seen, errors))
    assert not errors, errors
    assert [a.outcome for a in attempts] == [Outcome.SIGKILL, Outcome.SUCCESS], attempts
    return config, report_for_job(config.layout), (seen["line"], seen["kill"])


def _blocking_in_redone_steps(layout: JobLayout) -> float:
    """Rank 0's checkpoint waits inside the steps attempt 0 ran past step 30 (a copy's wait
    before backward is nested in its step): the partition counts them as blocking, not as
    wasted training."""
    events = [e for e in read_events(layout) if e.rank == 0]
    redone = [
        e for e in events if e.name == Span.TRAIN_STEP and e.attempt == 0 and (e.step or 0) > 30
    ]
    waits = [e for e in events if e.name in (Span.CHECKPOINT_BLOCKING, Span.MEMORY_COPY_BLOCKING)]
    return sum(max(0.0, min(s.end, w.end) - max(s.start, w.start)) for s in redone for w in waits)


def _from_first_step(r: EttReport) -> float:
    """Attempt 0's death, in seconds after its first step began."""
    return r.failures[0].died_at - (r.time_to_start_s or 0.0)


@pytest.mark.slow
def test_a_rank_killed_on_s3_is_reported_as_on_local_disk(
    tmp_path: Path, data_url: str, s3_server: str
) -> None:
    storage.configure(None)  # this process reads S3 through s3_server's environment
    local, local_report, local_seen = _killed_job(
        tmp_path / "file", data_url, {"root": f"file://{tmp_path}/file/store"}
    )
    s3_root = {"root": f"s3://ett/{uuid.uuid4().hex[:12]}", "s3_endpoint_url": s3_server}
    s3, s3_report, s3_seen = _killed_job(tmp_path / "s3", data_url, s3_root)

    for config, r, seen in ((local, local_report, local_seen), (s3, s3_report, s3_seen)):
        (f,) = r.failures
        assert (f.attempt, f.cause, f.last_step) == (0, "sigkill", LAST_STEP)
        # Its last event: step 37's end, or the commit of step 30 while it hung after it.
        died = r.start_time + f.died_at
        assert seen[0] - 2.0 <= died <= seen[1], (died, seen)
        assert r.num_step_executions - r.num_steps == LAST_STEP - 30  # steps 31-37 redone
        nested = _blocking_in_redone_steps(config.layout)
        assert r.buckets["wasted_training"] == pytest.approx(r.observed_unsaved_s - nested)
        assert r.buckets["unknown"] == 0 and r.finished
    # The same job, two runs on a shared machine: same steps, times within a tolerance.
    assert s3_report.failures[0].last_step == local_report.failures[0].last_step
    assert _from_first_step(s3_report) == pytest.approx(
        _from_first_step(local_report), rel=0.5, abs=2.0
    )
    assert s3_report.observed_unsaved_s == pytest.approx(
        local_report.observed_unsaved_s, rel=0.5, abs=0.5
    )
    # The killed attempt's file was completed from its spool by the next attempt.
    (killed,) = [f for f in read_files(s3.layout) if f.name == "trainer-attempt000-rank000.jsonl"]
    assert not killed.incomplete
    assert recover_orphaned_spools(s3.layout) == []  # nothing left behind
    for name, r in (("file", local_report), ("s3", s3_report)):
        f = r.failures[0]
        print(
            f"{name}: last step {f.last_step}, died at {f.died_at:.2f} s "
            f"({_from_first_step(r):.2f} s after step 1), wasted {r.observed_unsaved_s:.3f} s"
        )


@pytest.mark.slow
def test_a_ledger_that_cannot_be_stored_fails_the_attempt(
    tmp_path: Path, data_url: str, s3_server: str
) -> None:
    """S3 is cut (a TCP proxy resets every connection) after step 10 and stays down. With
    checkpoints off, training needs no storage and finishes; only the ledger cannot be
    stored at the end: the attempt exits LEDGER_NOT_SAVED (a retried failure), not 0.
    Nothing is lost: once S3 is back, the spool it left is uploaded."""
    storage.configure(None)
    port = urllib.parse.urlsplit(s3_server).port
    assert port is not None
    proxy = TcpProxy(("127.0.0.1", port)).start()
    try:
        config = _config(
            tmp_path,
            data_url,
            {
                "root": f"s3://ett/{uuid.uuid4().hex[:12]}",
                "s3_endpoint_url": proxy.url,
                "retries": 1,
            },
            checkpoint={"mode": "off"},
        )

        def cut(progress: Progress) -> None:
            if progress.step >= 10 and not proxy.is_down:  # progress is sampled: >=, once
                proxy.go_down()

        env = {"AWS_ENDPOINT_URL_S3": proxy.url, "AWS_MAX_ATTEMPTS": "1"}
        (report,) = _run_job(config, tmp_path, cut, max_failures=0, env=env)
        assert proxy.refused > 0, "the outage refused no connection"
    finally:
        proxy.close()
    assert (report.outcome, report.exit_code) == (Outcome.CRASH, ExitCode.LEDGER_NOT_SAVED)

    # The orchestrator, on the same node and still reaching S3 directly, recovered the dead
    # trainer's spool as soon as the attempt ended: every event is stored, nothing is left.
    events = [e for e in read_events(config.layout) if e.attempt == 0 and e.rank == 0]
    steps = [e.step for e in events if e.name == "train_step"]
    assert steps == list(range(1, STEPS + 1)) and any(e.name == "job_end" for e in events)
    assert recover_orphaned_spools(config.layout) == []


def test_the_anchor_comes_from_the_committed_manifests_not_the_ledger(tmp_path: Path) -> None:
    """No ledger at all: the newest committed checkpoint marked ``anchor`` is the anchor; a
    newer plain one or a folder with no manifest is not. Reading it imports no trainer."""
    job = f"file://{tmp_path}/jobs/a"

    def commit(step: int, anchor: bool, manifest: bool = True) -> str:
        url = storage.join(JobLayout.at(job).checkpoints, step_dir_name(step))
        storage.write_bytes(storage.join(url, "__0_0.distcp"), b"w")
        if manifest:
            m = Manifest(step=step, world_size=1, config_hash="h", files={}, anchor=anchor)
            storage.write_text(storage.join(url, MANIFEST), m.to_json())
        return url

    assert find_anchor(JobLayout.at(job)) is None
    commit(10, anchor=True)
    anchor_url = commit(20, anchor=True)
    commit(30, anchor=False)  # a continuation's periodic checkpoint
    commit(40, anchor=True, manifest=False)  # never committed
    found = find_anchor(JobLayout.at(job))
    assert isinstance(found, Anchor) and (found.uri, found.step) == (anchor_url, 20)
    assert not storage.exists(storage.join(job, "ledger"))
    code = (
        "import sys, tasks.events\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trainer', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
