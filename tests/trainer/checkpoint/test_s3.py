"""Checkpoints on a real S3 endpoint (moto on loopback), including a storage outage.

- A 2-rank job on ``s3://`` ends with committed checkpoints and an anchor whose manifests list
  every object with its size and SHA-256 (checked against S3), and a second attempt with more
  steps resumes from the S3 checkpoint.
- A storage outage longer than the retry budget: a TCP proxy between the trainer and S3
  resets every connection until two checkpoints in a row have failed. Each fails loudly (an
  error line and a ``checkpoint_failed`` ledger mark) while training goes on, the previous
  committed checkpoint stays the latest, and once the outage is over later checkpoints
  commit again and the job finishes in the same attempt.

Real processes, real sockets; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import MANIFEST, committed_checkpoints
from infra.exit_codes import ExitCode
from infra.job_layout import step_dir_name
from infra.settings import JobConfig, dump_config
from tests.factories import ROOT, run_trainer, tiny_config, trainer_command, write_dataset
from tests.tcp_proxy import TcpProxy
from trainer.checkpoint.verify import verify_files

pytestmark = pytest.mark.slow

EVERY = 5
FAILED_LINE = r"checkpoint at step (\d+) failed, previous one stays the latest: .+"


@pytest.fixture(scope="module")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tiny_config(tmp_path_factory.mktemp("s3-data"))
    write_dataset(config)
    return config.data.url


def s3_config(
    tmp_path: Path, data_url: str, endpoint: str, steps: int, **sections: Any
) -> JobConfig:
    """A job whose checkpoints and ledgers live in a fresh prefix of the bucket ``ett``."""
    return tiny_config(
        tmp_path,
        job_id="s3job",
        storage={
            "root": f"s3://ett/{uuid.uuid4().hex[:12]}",
            "s3_endpoint_url": endpoint,
            **sections.pop("storage", {}),
        },
        data={"url": data_url},
        # Eager: these tests are about checkpoints, and compiling costs each attempt seconds.
        train={"steps": steps, "eval_every": 0, "eval_rows": 256, "log_every": 5, "compile": False},
        checkpoint={
            "mode": "async_staged",
            "every_steps": EVERY,
            "keep_latest_k": 3,
            **sections.pop("checkpoint", {}),
        },
        **sections,
    )


def check_committed(config: JobConfig, world_size: int) -> list[int]:
    """Every committed checkpoint's manifest matches the objects on S3; returns the steps."""
    found = committed_checkpoints(config.layout)
    for ckpt in found:
        manifest = ckpt.manifest
        assert manifest.world_size == world_size
        assert manifest.config_hash == config.model_hash()
        objects = {
            name
            for name in storage.listdir(ckpt.url)
            if name != MANIFEST and not name.startswith("_done")
        }
        assert objects == set(manifest.files), (ckpt.url, objects ^ set(manifest.files))
        for rank in range(world_size):
            assert f"trainer_state.rank{rank:03d}.json" in objects
            assert any(n.startswith(f"__{rank}_") and n.endswith(".distcp") for n in objects)
        assert {".metadata", "config.yaml"} <= objects
        verify_files(ckpt.url, manifest)  # sizes and SHA-256 read back from S3
    return [c.step for c in found]


def test_two_rank_job_commits_on_s3_and_resumes(
    tmp_path: Path, data_url: str, s3_server: str
) -> None:
    config = s3_config(tmp_path, data_url, s3_server, steps=12)
    storage.configure(config.storage)
    try:
        result = run_trainer(config, tmp_path, nproc=2)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        assert check_committed(config, world_size=2) == [12, 10, 5]
        [anchor, *_] = committed_checkpoints(config.layout)
        assert anchor.manifest.anchor
        events = read_events(config.layout)
        assert not [e for e in events if e.name == "checkpoint_failed"]
        commits = [e.step for e in events if e.name == "checkpoint_committed" and e.rank == 0]
        assert commits == [5, 10, 12], commits
        assert [e.step for e in events if e.name == "anchor_committed"] == [12]

        more = s3_config(
            tmp_path, data_url, s3_server, steps=17, storage={"root": config.storage.root}
        )
        result = run_trainer(more, tmp_path, nproc=2)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        resumes = {
            (e.attempt, e.rank, e.step) for e in read_events(config.layout) if e.name == "resume"
        }
        assert resumes == {(1, 0, 12), (1, 1, 12)}, resumes
        assert check_committed(more, world_size=2) == [17, 15, 12]
        assert committed_checkpoints(more.layout)[0].manifest.anchor
    finally:
        storage.configure(None)


def test_a_kill_right_before_the_manifest_leaves_the_step_uncommitted(
    tmp_path: Path, data_url: str, s3_server: str
) -> None:
    """SIGKILL of the trainer once every file of step 10 is on S3, right before its manifest:
    step 10 is not committed (the manifest is the commit), step 5 stays the latest, and the
    next attempt resumes from step 5 and commits step 10 again, whole."""
    fault = {"kind": "sigkill_before_manifest", "step": 10, "attempt": 0}
    config = s3_config(tmp_path, data_url, s3_server, steps=15, faults=[fault])
    storage.configure(config.storage)
    try:
        result = run_trainer(config, tmp_path)
        assert result.returncode == 128 + signal.SIGKILL, (result.stdout + result.stderr)[-3000:]
        assert [c.step for c in committed_checkpoints(config.layout)] == [5]
        step10 = storage.join(config.layout.checkpoints, step_dir_name(10))
        left = set(storage.listdir(step10))
        assert MANIFEST not in left and {".metadata", "config.yaml"} <= left, left
        assert any(name.startswith("_done.rank000.") for name in left), left

        again = s3_config(
            tmp_path, data_url, s3_server, steps=15, storage={"root": config.storage.root}
        )
        result = run_trainer(again, tmp_path)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        resumes = [e.step for e in read_events(config.layout) if e.name == "resume"]
        assert resumes == [5], resumes
        assert check_committed(again, world_size=1) == [15, 10, 5]
    finally:
        storage.configure(None)


class Attempt:
    """One trainer attempt under torchrun whose output is read line by line as it runs."""

    def __init__(self, config: JobConfig, tmp_path: Path, env: dict[str, str]) -> None:
        path = tmp_path / f"{config.job_id}.yaml"
        dump_config(config, path)
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self.proc = subprocess.Popen(
            trainer_command(path, nproc=1),
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(tmp_path),
            start_new_session=True,  # its own process group: killed as a whole if need be
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()

    def wait_for_lines(self, pattern: str, count: int, timeout_s: float) -> list[re.Match[str]]:
        """The first ``count`` matches of ``pattern`` in the output, waiting for them."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._new_line:
            while True:
                found = [m for line in self.lines if (m := regex.search(line))]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"not {count} lines matching {pattern!r}:\n{self.tail()}")
                self._new_line.wait(min(left, 0.5))

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_for_first_commit(config: JobConfig, attempt: Attempt, timeout_s: float) -> int:
    """Poll S3 (directly, not through the proxy) for the job's first committed checkpoint."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = committed_checkpoints(config.layout)
        if found:
            return found[-1].step
        if attempt.proc.poll() is not None:
            raise AssertionError(f"the trainer exited before any commit:\n{attempt.tail()}")
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint committed in {timeout_s} s:\n{attempt.tail()}")


def start_behind_proxy(
    tmp_path: Path, data_url: str, s3_server: str, steps: int, **sections: Any
) -> tuple[TcpProxy, JobConfig, Attempt]:
    """A trainer attempt that reaches S3 through a TCP proxy the test can cut. It has a small
    retry budget: botocore's, 2 tries per request (storage.retries = 1)."""
    port = urllib.parse.urlsplit(s3_server).port
    assert port is not None
    proxy = TcpProxy(("127.0.0.1", port)).start()
    config = s3_config(
        tmp_path,
        data_url,
        proxy.url,
        steps=steps,
        storage={"retries": 1},
        **sections,
    )
    env = {"AWS_ENDPOINT_URL_S3": proxy.url}
    storage.configure(None)  # this process reads S3 directly (s3_server's environment)
    return proxy, config, Attempt(config, tmp_path, env)


def test_storage_outage_fails_checkpoints_loudly_and_training_goes_on(
    tmp_path: Path, data_url: str, s3_server: str
) -> None:
    steps = 80
    proxy, config, attempt = start_behind_proxy(
        tmp_path, data_url, s3_server, steps, checkpoint={"keep_latest_k": 2}
    )
    try:
        first = wait_for_first_commit(config, attempt, timeout_s=240)
        with proxy.outage():
            started = time.monotonic()
            # The outage lasts until two checkpoints in a row have failed: each one spent its
            # whole retry budget in it, and training stepped on from one to the next.
            failures = attempt.wait_for_lines(FAILED_LINE, count=2, timeout_s=120)
            failed_steps = [int(m.group(1)) for m in failures]
            # Still down: the failed ones are not committed; the previous one is the latest.
            latest = committed_checkpoints(config.layout)[0].step
            assert first <= latest < failed_steps[0] < failed_steps[1], (latest, failed_steps)
            outage_s = time.monotonic() - started
        assert proxy.refused > 0, "the outage refused no connection"
        code = attempt.proc.wait(timeout=300)
        assert code == ExitCode.SUCCESS, attempt.tail()
    finally:
        attempt.stop()
        proxy.close()

    events = [e for e in read_events(config.layout) if e.attempt == 0 and e.rank == 0]
    failed = [e for e in events if e.name == "checkpoint_failed"]
    assert [e.step for e in failed][:2] == failed_steps, failed
    # The retry budget was spent (the one in flight when the outage began may have failed
    # at a later, unretried call of its commit).
    assert any("at most 2 tries" in e.attrs.get("error", "") for e in failed), failed
    # Training went on through the outage: every step ran once, in one attempt.
    assert sorted(e.step for e in events if e.name == "train_step") == list(range(1, steps + 1))
    # No failed checkpoint was ever committed; after the outage later ones commit again.
    for mark in failed:
        url = storage.join(config.layout.checkpoints, step_dir_name(mark.step or 0))
        assert not storage.exists(storage.join(url, MANIFEST)), url
    last_failed = max(e.step or 0 for e in failed)
    committed = [e.step or 0 for e in events if e.name == "checkpoint_committed"]
    assert [s for s in committed if s > last_failed], (committed, last_failed)
    assert [e.step for e in events if e.name == "anchor_committed"] == [steps]
    assert check_committed(config, world_size=1)[0] == steps
    print(f"outage {outage_s:.2f} s; failed checkpoints {[e.step for e in failed]}")


def test_an_outage_through_the_end_fails_the_attempt_so_it_is_retried(
    tmp_path: Path, data_url: str, s3_server: str
) -> None:
    """Training finished but the anchor could not be saved: the attempt must not pass for a
    success (nothing would publish, the model would be lost); it exits ANCHOR_NOT_SAVED, which
    the flow retries from the newest committed checkpoint."""
    steps = 30
    proxy, config, attempt = start_behind_proxy(tmp_path, data_url, s3_server, steps)
    try:
        first = wait_for_first_commit(config, attempt, timeout_s=240)
        with proxy.outage():
            code = attempt.proc.wait(timeout=300)
        assert proxy.refused > 0, "the outage refused no connection"
    finally:
        attempt.stop()
        proxy.close()
    # The launcher exits with the code of the rank that failed first, and names it.
    assert code == ExitCode.ANCHOR_NOT_SAVED, attempt.tail()
    assert "rank 0 failed first: ANCHOR_NOT_SAVED (85)" in attempt.tail(200)
    assert f"anchor checkpoint at step {steps} did not commit" in attempt.tail(200)
    latest = committed_checkpoints(config.layout)[0]
    assert first <= latest.step < steps and not latest.manifest.anchor
    final = storage.join(config.layout.checkpoints, step_dir_name(steps))
    assert not storage.exists(storage.join(final, MANIFEST))
