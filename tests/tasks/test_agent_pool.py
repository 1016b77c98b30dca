"""The warm agent pool: ``ett pool`` and ``ett train`` as a user runs them, real processes.

A parked agent must serve a job exactly as a fresh launcher would (the job succeeds, its
ledger says the launcher came from the pool), be refused when it imported under other
settings, count as a lost worker when killed from outside, and nothing the pool started may
outlive it: every process is found from outside by a marker in the environment it started
with (/proc/PID/environ keeps it, also after a claimed agent took the job's environment).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import processes
from infra.accounting.ledger_read import read_events
from infra.agent_protocol import ENV_POOL, code_fingerprint, import_env_mismatch
from infra.job_layout import JobLayout
from infra.settings import dump_config
from tasks.agent_pool import LAUNCHER, claim
from tests.factories import ROOT, PoolProcess, tiny_config, write_dataset
from tests.flows.test_cli import ett, user_error
from tests.procs import env_var

ETT = Path(sys.executable).with_name("ett")
MARK = "ETT_TEST_POOL_MARK"


def _marked(mark: str) -> list[int]:
    """Live processes that started with ``MARK=mark`` in their environment."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if env_var(pid, MARK) == mark and processes.pid_alive(pid):
            found.append(pid)
    return found


@pytest.fixture
def pool_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        MARK: uuid.uuid4().hex,
    }


@pytest.fixture
def pool(tmp_path: Path, pool_env: dict[str, str]) -> Iterator[PoolProcess]:
    pool = PoolProcess(tmp_path, pool_env)
    try:
        pool.wait_for("parked after")
        yield pool
    finally:
        pool.stop()


# A job that is still training when the test acts at its step 5 (each test checks that it
# was): ~4 s of steps at full speed on a quiet machine. The attempt relaunched after a kill
# trains them all again, so more steps only make the test longer.
STEPS_TO_ACT_IN = 150


def _job(tmp_path: Path, steps: int) -> Path:
    config = tiny_config(tmp_path, train={"steps": steps})
    write_dataset(config)
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    return path


def test_a_job_claims_a_parked_agent_and_nothing_outlives_the_pool(
    tmp_path: Path, pool: PoolProcess, pool_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    path = _job(tmp_path, steps=20)
    # A claim under another import-time setting is refused, naming it; the agent stays.
    other = {**pool_env, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    command = [sys.executable, *LAUNCHER, "--standalone", "-m", "trainer", "--config", "x"]
    with caplog.at_level(logging.WARNING):
        assert claim(pool.socket, command, other) is None
    assert "TORCHINDUCTOR_MAX_AUTOTUNE differs" in caplog.text
    assert pool.claimed() == []

    job = ett("train", "--config", str(path), cwd=tmp_path, env={**pool_env, ENV_POOL: pool.socket})
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    assert "attempt 0 started (1 launcher(s) from the agent pool)" in job.stderr
    assert "step 20/20" in job.stderr  # the claimed agent's ranks log to the job's output
    agents = pool.claimed()  # attempt 0's, and the standby's if one had parked by then
    assert agents and not any(processes.pid_alive(a) for a in agents)  # ended with the job
    events = read_events(JobLayout.at(f"file://{tmp_path}/store/jobs/tiny"))
    (launch,) = [e for e in events if e.name == "launcher_init" and e.attempt == 0]
    assert launch.attrs["pooled"] == 1 and launch.attrs["reached_trainer"] is True

    # A second pool on the same socket is refused in one line.
    user_error(ett("pool", "--socket", pool.socket, cwd=tmp_path, env=pool_env), "already listens")

    pool.wait_for("parked after", count=len(agents) + 1)  # refilled after the claims
    assert pool.stop() == 0
    assert f"stopped after {len(agents)} claim(s)" in pool.text()
    assert not Path(pool.socket).exists()
    assert _marked(pool_env[MARK]) == []


def _train_until_it_steps(path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``ett train`` in the background, returned once its ranks log step 5."""
    job = subprocess.Popen(
        [str(ETT), "train", "--config", str(path), "--backoff-s", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert job.stdout is not None
    for line in job.stdout:
        if "step 5/" in line:
            return job
    job.wait(timeout=60)
    raise AssertionError(f"the job ended (exit {job.returncode}) before it trained")


def _failures(tmp_path: Path) -> list[tuple[int, int]]:
    events = read_events(JobLayout.at(f"file://{tmp_path}/store/jobs/tiny"))
    return [(e.attempt, e.attrs["exit_code"]) for e in events if e.name == "failure"]


def test_a_claimed_agent_killed_from_outside_is_a_lost_worker(
    tmp_path: Path, pool: PoolProcess, pool_env: dict[str, str]
) -> None:
    path = _job(tmp_path, steps=STEPS_TO_ACT_IN)
    job = _train_until_it_steps(path, {**pool_env, ENV_POOL: pool.socket})
    try:
        os.kill(pool.claimed()[0], signal.SIGKILL)  # attempt 0's launcher
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:]
    assert _failures(tmp_path) == [(0, 128 + signal.SIGKILL)]

    # The pool itself killed: its parked agent dies with it, and its socket is taken over.
    pool.wait_for("parked after", count=len(pool.claimed()) + 1)
    pool.proc.kill()
    pool.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _marked(pool_env[MARK]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(pool_env[MARK]) == []
    again = PoolProcess(tmp_path, pool_env)
    again.wait_for("started agent")  # it listens on the socket the dead pool left behind
    assert again.stop() == 0
    assert _marked(pool_env[MARK]) == []


def test_a_claimed_agent_trains_on_when_its_pool_is_killed(
    tmp_path: Path, pool: PoolProcess, pool_env: dict[str, str]
) -> None:
    """A claimed agent is its orchestrator's: the pool's death (SIGKILL, no goodbye) ends
    only what was still parked, and the job finishes on the agent it claimed."""
    path = _job(tmp_path, steps=STEPS_TO_ACT_IN)
    job = _train_until_it_steps(path, {**pool_env, ENV_POOL: pool.socket})
    try:
        agent = pool.claimed()[0]
        pool.proc.kill()
        pool.proc.wait(timeout=30)
        assert job.poll() is None, "the job ended before its pool was killed"
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:]
    assert "succeeded on attempt 0 after 0 failure(s)" in out
    assert _failures(tmp_path) == []
    assert not processes.pid_alive(agent)  # ended with its job
    deadline = time.monotonic() + 30
    while _marked(pool_env[MARK]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(pool_env[MARK]) == []


def test_a_claim_that_cannot_be_served_falls_back_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    command = [sys.executable, *LAUNCHER, "--standalone", "-m", "trainer"]
    missing = str(tmp_path / "none.sock")
    with caplog.at_level(logging.WARNING):
        assert claim(missing, command, dict(os.environ)) is None
    assert f"agent pool {missing} unusable" in caplog.text
    caplog.clear()
    # Only the trainer's launcher can be served: anything else is not even asked for.
    assert claim(missing, [sys.executable, "-m", "tests.fake_trainer"], {}) is None
    assert caplog.text == ""


def test_what_a_parked_agent_must_share_with_its_job(tmp_path: Path) -> None:
    for package in ("trainer", "infra"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "mod.py").write_text("x = 1\n")
    before = code_fingerprint(tmp_path)
    assert code_fingerprint(tmp_path) == before
    (tmp_path / "trainer" / "mod.py").write_text("x = 22\n")
    assert code_fingerprint(tmp_path) != before

    parked = {"PATH": "/a", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/repo", "ETT_ATTEMPT": "0"}
    job = {**parked, "PATH": "/b", "ETT_ATTEMPT": "3", "ETT_CONTROL_DIR": "/tmp/c"}
    assert import_env_mismatch(parked, job) is None  # runtime-only variables may differ
    assert "OMP_NUM_THREADS differs" in str(
        import_env_mismatch(parked, {**job, "OMP_NUM_THREADS": "2"})
    )
    assert "PYTHONPATH differs" in str(import_env_mismatch(parked, {**job, "PYTHONPATH": "/x"}))
    unset = import_env_mismatch(parked, {**job, "NCCL_DEBUG": "INFO"})
    assert unset == "NCCL_DEBUG differs (unset in the pool)"
    secret = import_env_mismatch({**parked, "TORCH_X": "s3cret"}, {**job, "TORCH_X": "other"})
    assert secret == "TORCH_X differs"  # named, values never shown


def test_a_same_size_edit_with_its_mtime_kept_changes_the_fingerprint(tmp_path: Path) -> None:
    """An edit that keeps a source file's size and modification time (within the file
    system's timestamp granularity, or copied with ``cp -p``/``rsync -t``): a parked agent
    imported the old code, so the fingerprint must differ."""
    for package in ("trainer", "infra"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "mod.py").write_text("LR = 0.1\n")
    path = tmp_path / "infra" / "mod.py"
    stat = path.stat()
    before = code_fingerprint(tmp_path)
    path.write_text("LR = 0.9\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert code_fingerprint(tmp_path) != before
    path.write_text("LR = 0.1\n")  # the edit undone: the code the agent imported again
    assert code_fingerprint(tmp_path) == before


def test_agents_that_die_unclaimed_are_parked_again_with_backoff(
    tmp_path: Path, pool_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # A broken install, as the pool would meet it: every agent dies while importing.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('ETT_PARK_FD'):\n    sys.exit(3)\n"
    )
    env = {**pool_env, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
    pool = PoolProcess(tmp_path, env)
    try:
        pool.wait_for("parking the next agent in 2 s", timeout=60)
        assert "parking the next agent in 1 s" in pool.text()
        assert "parked after" not in pool.text()
        # A pool with nothing parked is busy, not broken: said at INFO, then a cold start.
        command = [sys.executable, *LAUNCHER, "--standalone", "-m", "trainer"]
        with caplog.at_level(logging.INFO, logger="tasks.agent_pool"):
            assert claim(pool.socket, command, env) is None
        [said] = [r for r in caplog.records if "no agent parked yet" in r.getMessage()]
        assert said.levelno == logging.INFO
    finally:
        assert pool.stop() == 0
    assert _marked(pool_env[MARK]) == []
