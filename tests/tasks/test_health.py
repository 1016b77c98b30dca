"""The per-slot health check (tasks/health.py): what marks a rank slot lost and what gives it
back, and which devices a smaller attempt's ranks see. Real subprocesses (tests/health_probe.py,
driven by files), no GPU: the CUDA mapping is a pure function."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from infra import processes
from infra.config_sources import ConfigError
from infra.preflight import PreflightError, preflight
from infra.settings import load_config
from tasks import health
from tasks.capacity import Capacity
from tasks.health import (
    ENV_DEVICES,
    HealthCheck,
    HealthMonitor,
    Verdict,
    attempt_env,
    visible_devices,
)
from tests import health_probe
from tests.factories import tiny_config

LOG = logging.getLogger("ett.test_health")


def _until(what: str, check: object, timeout_s: float = 30.0) -> None:
    """Wait for ``check()`` (a thread's doing), failing with ``what`` if it never holds."""
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- which devices a smaller attempt sees ---------------------------------------------------------
def test_a_smaller_attempt_on_cuda_sees_the_usable_slots_devices_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Local rank i computes on cuda:i, so the i-th visible device must be the i-th usable
    slot's: the slot's own number, or the slot-th entry of the user's own list."""
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    assert visible_devices((0, 2, 3), None) == "0,2,3"
    assert attempt_env({"A": "1"}, (0, 2, 3), 4, cuda=True) == {"A": "1", ENV_DEVICES: "0,2,3"}
    # The user's list picks the devices: slot 1 of "4,5,6,7" is device 5.
    assert attempt_env({ENV_DEVICES: "4,5,6,7"}, (0, 2, 3), 4, cuda=True)[ENV_DEVICES] == "4,6,7"
    monkeypatch.setenv(ENV_DEVICES, "GPU-aa, GPU-bb")  # this process's, UUIDs: inherited too
    assert attempt_env({}, (1,), 2, cuda=True) == {ENV_DEVICES: "GPU-bb"}


def test_a_full_size_or_cpu_attempt_keeps_the_jobs_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing hidden when nothing is lost, nor off CUDA; a slot the list has no device for
    is refused, naming the list."""
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    env = {"A": "1"}
    assert attempt_env(env, (0, 1), 2, cuda=True) == env
    assert attempt_env(env, (1,), 2, cuda=False) == env
    with pytest.raises(ValueError, match="rank slot 2 has no device: CUDA_VISIBLE_DEVICES=4,5"):
        attempt_env({ENV_DEVICES: "4,5"}, (0, 2), 3, cuda=True)


# -- the check ------------------------------------------------------------------------------------
def test_a_slot_that_fails_or_never_answers_is_lost_and_its_probe_killed(tmp_path: Path) -> None:
    """Exit 0: usable; another code: lost, with the check's first line; no answer within the
    timeout: lost (never taken for healthy), its probe killed; a program that cannot start:
    lost."""
    (tmp_path / "lost-1").touch()
    (tmp_path / "hang-2").touch()
    check = HealthCheck(health_probe.command(tmp_path), 5.0, None)
    hung, ok, lost = check.run([2, 0, 1])  # the others' answers are read after the wait
    assert ok == Verdict(0, True, "slot 0: ok")
    assert lost == Verdict(1, False, "exit 3: slot 1: device gone (lost-1 present)")
    assert hung == Verdict(2, False, "no answer within 5 s")
    pid = int((tmp_path / "pid-2").read_text())
    assert not processes.pid_alive(pid)
    [missing] = HealthCheck(f"{tmp_path}/no-such-check {{slot}}", 5.0, None).run([0])
    assert not missing.usable and missing.said.startswith(f"cannot run {tmp_path}/no-such-check")


def test_device_is_the_slots_entry_of_the_users_list(tmp_path: Path) -> None:
    """``{device}`` is what a GPU tool needs (nvidia-smi -i), ``{slot}`` the local rank; a
    list naming fewer devices than the job has slots is refused before anything is probed."""
    check = HealthCheck("echo {slot} {device}", 5.0, "GPU-aa,GPU-bb", slots=2)
    assert [v.said for v in check.run([0, 1])] == ["0 GPU-aa", "1 GPU-bb"]
    with pytest.raises(ValueError, match="rank slot 2 has no device"):
        HealthCheck("echo {device}", 5.0, "GPU-aa,GPU-bb", slots=3)


# -- the monitor ----------------------------------------------------------------------------------
def test_a_slot_is_lost_once_and_regained_by_the_recheck_when_its_device_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before a relaunch every slot is probed: one line for the slot lost, none for a slot
    lost already; the thread probes the lost slots again and regains one that passes."""
    capacity = Capacity(2)
    check = HealthCheck(health_probe.command(tmp_path), 5.0, None)
    monitor = HealthMonitor(check, capacity, LOG, every_s=0.1)
    (tmp_path / "lost-1").touch()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        monitor.check_all()
        monitor.check_all()
        assert capacity.usable == (0,)
        assert [r.getMessage() for r in caplog.records] == [
            "rank slot 1 lost (health check): exit 3: slot 1: device gone (lost-1 present)"
        ]
        monitor.start()
        try:
            time.sleep(0.5)  # rechecks while it is still lost: it stays lost
            assert capacity.usable == (0,)
            (tmp_path / "lost-1").unlink()
            _until("slot 1 regained by the recheck", lambda: capacity.ranks == 2)
        finally:
            monitor.close()
    assert caplog.records[-1].getMessage() == "rank slot 1 usable again: slot 1: ok"


def test_a_builtin_check_that_fails_on_every_slot_at_the_start_is_switched_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``auto``'s probe failing everywhere before anything was lost is the probe broken on
    this host (no driver access, a version mismatch): off, in one warning, no slot lost."""
    for slot in (0, 1):
        (tmp_path / f"lost-{slot}").touch()
    capacity = Capacity(2)
    check = HealthCheck(health_probe.command(tmp_path), 5.0, None)
    monitor = HealthMonitor(check, capacity, LOG, every_s=0.1, builtin=True)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        monitor.start()
        try:
            _until("the broken check switched off", lambda: not monitor.enabled)
            monitor.check_all()
        finally:
            monitor.close()
    assert capacity.ranks == 2
    [line] = [r.getMessage() for r in caplog.records]
    assert "fails on every rank slot at the job's start" in line and "not used" in line


# -- a bad check, refused before anything starts ------------------------------------------------
@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("nvidia-smi -i {gpu}", "only {slot} and {device} are substituted"),
        ('check "slot', "cannot be split: No closing quotation"),
        ("", "recovery.health_check is empty"),
    ],
)
def test_a_health_check_that_cannot_run_is_refused_in_one_line(command: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, recovery={"health_check": command})
    [line] = [line for line in str(info.value).splitlines() if "health_check" in line]
    assert problem in line


def test_a_health_check_program_not_on_this_host_fails_the_preflight(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, recovery={"health_check": "no-such-probe -i {device}"})
    with pytest.raises(PreflightError) as info:
        preflight(config)
    assert str(info.value) == (
        "recovery.health_check (no-such-probe -i {device}): no program no-such-probe here "
        "(PATH, executable)"
    )


# -- which check a job runs ----------------------------------------------------------------------
def test_auto_is_the_nvml_query_on_a_cuda_host_only_and_a_users_command_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` resolves on the host: the built-in query where GPUs, nvidia-smi and a CUDA
    backend all are, else no check (and no monitor); a user's command is run as given."""

    def config(check: str | None, backend: str = "nccl"):  # noqa: ANN202
        return tiny_config(tmp_path, recovery={"health_check": check}, train={"backend": backend})

    gpus = ["/dev/nvidia0"]
    monkeypatch.setattr(health.glob, "glob", lambda pattern: gpus)
    monkeypatch.setattr(health.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert health.resolve(config("auto")) == health.BUILTIN_CUDA
    assert health.resolve(config("auto", backend="gloo")) is None  # the ranks use no GPU
    assert health.resolve(config("probe {slot}", backend="gloo")) == "probe {slot}"
    monkeypatch.setattr(health.shutil, "which", lambda name: None)
    assert health.resolve(config("auto")) is None  # no nvidia-smi here
    monkeypatch.setattr(health.shutil, "which", lambda name: f"/usr/bin/{name}")
    gpus.clear()
    assert health.resolve(config("auto")) is None  # no GPU device node
    assert health.monitor(config("auto"), Capacity(2), {}, LOG) is None
    assert health.monitor(config(None), Capacity(2), {}, LOG) is None
