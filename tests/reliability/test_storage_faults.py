"""Storage faults around checkpoints, on a real S3 endpoint (moto) behind a proxy that fails
chosen requests: restore under read errors, and the save on SIGTERM under write errors.

- A storage error while reading the newest checkpoint is retried, then ends the attempt as
  retryable (STORAGE_UNAVAILABLE); it is never taken for corruption (no fallback to an
  older checkpoint, nothing quarantined), and the next attempt resumes from the newest.
- A SIGKILL during the save on SIGTERM leaves the previous checkpoint loadable, even with
  keep_latest_k: 1, and a committed step is never uploaded again.
- A save on SIGTERM that fails, or that does not finish within preemption_budget_s, exits
  EMERGENCY_SAVE_FAILED, not PREEMPTED.
"""

from __future__ import annotations

import collections
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import committed_checkpoints
from infra.exit_codes import ExitCode
from infra.job_layout import step_dir_name
from infra.settings import JobConfig
from tests.reliability.cutting_proxy import RequestCutter
from tests.reliability.jobs import Trainer, job_config, run_to_end, s3_root
from trainer.checkpoint.verify import verify_files

pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(s3_server: str) -> Iterator[RequestCutter]:
    port = urllib.parse.urlsplit(s3_server).port
    assert port is not None
    cutter = RequestCutter(("127.0.0.1", port)).start()
    storage.configure(None)  # this process reads S3 directly (s3_server's environment)
    try:
        yield cutter
    finally:
        cutter.close()


def behind(proxy: RequestCutter) -> dict[str, str]:
    """The trainer's environment: S3 through the proxy, botocore's own retries off (so
    the job's storage.retries is the whole retry budget)."""
    return {"AWS_ENDPOINT_URL_S3": proxy.url, "AWS_MAX_ATTEMPTS": "1"}


def s3_job(tmp_path: Path, data_url: str, endpoint: str, steps: int, **sections: Any) -> JobConfig:
    storage_section = {"root": s3_root(), "s3_endpoint_url": endpoint}
    return job_config(
        tmp_path,
        data_url,
        steps,
        storage={**storage_section, **sections.pop("storage", {})},
        **sections,
    )


def at(config: JobConfig, endpoint: str, steps: int | None = None, **storage_: Any) -> JobConfig:
    """The same job reached through ``endpoint`` (with ``steps``, without faults)."""
    section = {**config.storage.model_dump(), "s3_endpoint_url": endpoint, **storage_}
    update: dict[str, Any] = {"storage": type(config.storage)(**section)}
    if steps is not None:
        update |= {"train": config.train.model_copy(update={"steps": steps}), "faults": ()}
    return config.model_copy(update=update)


def attempts(config: JobConfig) -> set[int]:
    return {e.attempt for e in read_events(config.layout)}


@pytest.fixture(scope="module")
def finished_s3_job(
    tmp_path_factory: pytest.TempPathFactory, data_url: str, s3_server: str
) -> JobConfig:
    """A 10-step job on S3 with checkpoints at steps 10 (anchor) and 5. The tests below
    only read it (an attempt that resumes at step 10 of 10 trains and saves nothing)."""
    tmp = tmp_path_factory.mktemp("s3-job")
    storage.configure(None)
    config = s3_job(tmp, data_url, s3_server, steps=10)
    code, out = run_to_end(config, tmp)
    assert code == ExitCode.SUCCESS, out[-3000:]
    assert [c.step for c in committed_checkpoints(config.layout)] == [10, 5]
    return config


@pytest.mark.parametrize(
    ("cut", "how"),
    [(r"/step-000000010/", "reset"), (r"/step-000000010/.*\.distcp$", "500")],
    ids=["every-read-reset", "data-files-500"],
)
def test_s3_read_errors_on_newest_checkpoint_are_retried_not_fallen_back(
    tmp_path: Path, finished_s3_job: JobConfig, proxy: RequestCutter, cut: str, how: str
) -> None:
    """Every read under the newest checkpoint (its manifest included) is reset, or each of
    its data files answered with a 500. Before, the first crashed the attempt (exit 1) and
    the second fell back to step 5, silently throwing away five steps of work."""
    config = finished_s3_job
    rule = proxy.cut("GET", cut, how=how)
    flaky = at(config, proxy.url, retries=2)
    before = attempts(config)
    code, out = run_to_end(flaky, tmp_path, env=behind(proxy))
    assert code == ExitCode.STORAGE_UNAVAILABLE, out[-3000:]
    assert rule.count >= 3, rule  # one read, tried three times (botocore's retries)
    [unavailable] = [line for line in out.splitlines() if "storage unavailable" in line]
    assert "/checkpoints/step-000000010" in unavailable, out[-3000:]
    [attempt] = attempts(config) - before
    events = [e for e in read_events(config.layout) if e.attempt == attempt]
    assert not [e for e in events if e.name in ("resume", "train_step")]
    # Not taken for corruption: both checkpoints are still there, nothing quarantined.
    assert [c.step for c in committed_checkpoints(config.layout)] == [10, 5]
    assert "quarantine" not in storage.listdir(storage.join(config.layout.url, "checkpoints"))

    proxy.clear()  # storage is back: the next attempt resumes from the newest
    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.SUCCESS, out[-3000:]
    [attempt] = attempts(config) - before - {attempt}
    resumes = [(e.attempt, e.step) for e in read_events(config.layout) if e.name == "resume"]
    assert (attempt, 10) in resumes, resumes


@pytest.mark.parametrize("sigterm_at", [5, 7], ids=["at-committed-step", "at-new-step"])
def test_sigkill_during_emergency_save_keeps_previous_checkpoint(
    tmp_path: Path, data_url: str, s3_server: str, proxy: RequestCutter, sigterm_at: int
) -> None:
    """keep_latest_k: 1. SIGTERM at step 5 (just checkpointed) or 7; the save on SIGTERM is
    held at its commit (its manifest upload fails and is retried) and the whole attempt is
    SIGKILLed there. Step 5 stays committed and loadable either way."""
    config = s3_job(
        tmp_path,
        data_url,
        proxy.url,
        steps=20,
        storage={"retries": 4},
        checkpoint={"keep_latest_k": 1},
        faults=[{"kind": "sigterm", "step": sigterm_at, "attempt": 0}],
    )
    held = proxy.cut("PUT", r"/checkpoints/step-\d+/manifest\.json$", after=1)
    trainer = Trainer(config, tmp_path, env=behind(proxy))
    try:
        trainer.wait_until(
            "a held commit or the end", lambda: held.count > 0 or trainer.proc.poll() is not None
        )
        if trainer.proc.poll() is None:
            trainer.kill()
        code = trainer.wait()
    finally:
        if trainer.proc.poll() is None:
            trainer.kill()
        trainer.assert_gone()
    # Every object of the committed step 5 was uploaded once: it was never written again.
    puts = collections.Counter(
        path for method, path in proxy.requests if method == "PUT" and step_dir_name(5) in path
    )
    assert puts and max(puts.values()) == 1, puts
    if sigterm_at == 5:  # committed already: nothing to save, a clean exit
        assert code == ExitCode.PREEMPTED, trainer.tail()
    direct = at(config, s3_server)
    [kept] = committed_checkpoints(direct.layout)
    assert kept.step == 5
    verify_files(kept.url, kept.manifest)
    code, out = run_to_end(at(config, s3_server, steps=5), tmp_path)  # resume, no training
    assert code == ExitCode.SUCCESS, out[-3000:]
    # (By step: a SIGKILLed attempt's ledger on S3 may be lost, and its number reused.)
    resumes = [e.step for e in read_events(direct.layout) if e.name == "resume"]
    assert resumes == [5], resumes


@pytest.mark.parametrize(
    ("retries", "budget_s"),
    [(1, 60.0), (6, 2.0)],
    ids=["upload-fails", "upload-outlasts-budget"],
)
def test_emergency_save_that_fails_or_outlasts_its_budget_exits_emergency_save_failed(
    tmp_path: Path,
    data_url: str,
    s3_server: str,
    proxy: RequestCutter,
    retries: int,
    budget_s: float,
) -> None:
    """SIGTERM at step 7; every upload of step 7 is reset. With 2 tries the save fails
    within the budget; with 7 tries 1-32 s apart it would take over a minute, but the whole
    save is held to the 2 s budget."""
    config = s3_job(
        tmp_path,
        data_url,
        proxy.url,
        steps=20,
        storage={"retries": retries},
        checkpoint={"preemption_budget_s": budget_s},
        faults=[{"kind": "sigterm", "step": 7, "attempt": 0}],
    )
    cut = proxy.cut("PUT", rf"/{step_dir_name(7)}/")
    code, out = run_to_end(config, tmp_path, env=behind(proxy))
    assert code == ExitCode.EMERGENCY_SAVE_FAILED, out[-3000:]
    assert cut.count > 0
    if budget_s < 60:
        assert f"ran out of its {budget_s:.0f} s budget" in out, out[-3000:]
    direct = at(config, s3_server)
    [newest, *_] = committed_checkpoints(direct.layout)
    assert newest.step == 5
    verify_files(newest.url, newest.manifest)
