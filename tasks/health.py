"""What marks a rank slot of this host lost, and what gives it back (docs/recovery.md,
"Capacity lost"): ``recovery.health_check``, a command run per slot.

Exit 0 is usable; any other code, no answer within ``recovery.health_check_timeout_s``, or a
program that cannot start is lost. The orchestrator runs it for every slot before each
relaunch after an attempt ended (``check_all``: the probes run side by side, so the wait is
one timeout at most), and, while some slots are lost, for those slots every
``RECHECK_EVERY_S`` on a thread of its own, so a slot that comes back is regained while the
job waits for capacity or runs smaller (and it grows back). The watch loop never waits for a
probe. Each change is one log line with the check's own first line of output.

``auto`` (the default) is ``BUILTIN_CUDA`` on a CUDA host (a GPU device node, ``nvidia-smi``
on the PATH, ``train.backend`` not gloo): one NVML query of the slot's device, which creates
no CUDA context and exits non-zero when the driver cannot reach the device (fallen off the
bus, for one). It is not a diagnostic: a device that answers NVML but faults in kernels
passes (a DCGM diag catches more, and takes longer). If it fails on every slot at the job's
start, the check itself is broken on this host: it is switched off, with one warning, rather
than let a broken probe fail a healthy job.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from infra.settings import HEALTH_AUTO, JobConfig, health_argv
from tasks.capacity import Capacity
from tasks.local_node import Log

ENV_DEVICES = "CUDA_VISIBLE_DEVICES"
BUILTIN_CUDA = "nvidia-smi -i {device} --query-gpu=name,pci.bus_id --format=csv,noheader"
RECHECK_EVERY_S = 2.0  # how often lost slots are probed again, while there are any
KILL_WAIT_S = 2.0  # a probe killed at its timeout: how long its exit is waited for


@dataclass(frozen=True)
class Verdict:
    """One slot's probe: usable or not, and what the check said (its first line)."""

    slot: int
    usable: bool
    said: str


def device_of(slot: int, inherited: str | None) -> str:
    """The CUDA device of rank slot ``slot``: the slot-th entry of an inherited
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), else the slot's own number."""
    devices = _devices(inherited)
    if devices is None:
        return str(slot)
    if slot >= len(devices):
        raise ValueError(
            f"rank slot {slot} has no device: {ENV_DEVICES}={inherited} names {len(devices)}"
        )
    return devices[slot]


def visible_devices(slots: Sequence[int], inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an attempt on ``slots`` (the usable ones, in order):
    local rank i, which computes on ``cuda:i``, gets the i-th usable slot's device."""
    return ",".join(device_of(slot, inherited) for slot in slots)


def attempt_env(
    env: dict[str, str], slots: Sequence[int], launched: int, cuda: bool
) -> dict[str, str]:
    """The variables of an attempt on ``slots`` of the ``launched`` ones, ``env`` being the
    job's: on a CUDA host, an attempt on fewer slots sees only their devices (the lost
    one's hidden); at full size, or off CUDA, ``env`` as it is."""
    if not cuda or list(slots) == list(range(launched)):
        return env
    inherited = inherited_devices(env)
    return {**env, ENV_DEVICES: visible_devices(slots, inherited)}


def inherited_devices(env: dict[str, str]) -> str | None:
    """The job's own ``CUDA_VISIBLE_DEVICES``: in the ranks' variables, else this process's."""
    return env.get(ENV_DEVICES, os.environ.get(ENV_DEVICES))


def _devices(inherited: str | None) -> list[str] | None:
    if inherited is None or not inherited.strip():
        return None
    return [d.strip() for d in inherited.split(",") if d.strip()]


def cuda_host(config: JobConfig) -> bool:
    """Whether this host's ranks compute on CUDA devices: a GPU device node is present and
    the trainer is not told to use gloo (trainer/distributed.py ``select_device``)."""
    return config.train.backend != "gloo" and bool(glob.glob("/dev/nvidia[0-9]*"))


def resolve(config: JobConfig) -> str | None:
    """The check command this job runs (None: no check): ``auto`` resolved on this host."""
    command = config.recovery.health_check
    if command != HEALTH_AUTO:
        return command
    return BUILTIN_CUDA if cuda_host(config) and shutil.which("nvidia-smi") else None


class HealthCheck:
    """``command`` run for a set of slots, side by side, each within ``timeout_s``."""

    def __init__(
        self, command: str, timeout_s: float, inherited: str | None, slots: int = 1
    ) -> None:
        self.command, self.timeout_s, self.inherited = command, timeout_s, inherited
        for slot in range(slots):  # a bad command, a slot with no device: here, not mid-job
            self.argv(slot)

    def argv(self, slot: int) -> list[str]:
        return health_argv(self.command, slot, device_of(slot, self.inherited))

    def run(self, slots: Sequence[int]) -> list[Verdict]:
        """Every slot's verdict; at most ``timeout_s`` (and a kill) however the probes end."""
        started: dict[int, subprocess.Popen[str] | str] = {}
        for slot in slots:
            argv = self.argv(slot)
            try:
                started[slot] = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    start_new_session=True,  # its children are killed with it at the timeout
                )
            except OSError as exc:  # not found, not executable: nothing says the slot works
                started[slot] = f"cannot run {argv[0]}: {exc.strerror or exc}"
        deadline = time.monotonic() + self.timeout_s
        return [self._verdict(slot, proc, deadline) for slot, proc in started.items()]

    def _verdict(self, slot: int, proc: subprocess.Popen[str] | str, deadline: float) -> Verdict:
        if isinstance(proc, str):
            return Verdict(slot, False, proc)
        left = deadline - time.monotonic()
        if proc.poll() is not None:  # done while another slot's probe was waited for
            left = max(left, KILL_WAIT_S)  # its output is all that is left to read
        try:
            out, _ = proc.communicate(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            _kill(proc)
            return Verdict(slot, False, f"no answer within {self.timeout_s:g} s")
        said = next((line.strip() for line in out.splitlines() if line.strip()), "")
        if proc.returncode == 0:
            return Verdict(slot, True, said)
        code = f"exit {proc.returncode}"
        return Verdict(slot, False, f"{code}: {said}" if said else code)


def _kill(proc: subprocess.Popen[str]) -> None:
    """A probe past its timeout, and whatever it started: killed, reaped."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in a wedged driver: let be
        proc.communicate(timeout=KILL_WAIT_S)


class HealthMonitor:
    """Applies a ``HealthCheck``'s verdicts to ``capacity``: one log line per slot lost or
    regained. ``start``: a thread that probes the lost slots every ``every_s`` (and first,
    for ``auto``, every slot, to switch a check that fails everywhere off)."""

    def __init__(
        self,
        check: HealthCheck,
        capacity: Capacity,
        log: Log,
        every_s: float = RECHECK_EVERY_S,
        builtin: bool = False,
    ) -> None:
        self.check, self.capacity, self.log = check, capacity, log
        self.every_s, self.builtin = every_s, builtin
        self.enabled = True
        self._lock = threading.Lock()  # one probe round at a time: verdicts apply in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_all(self) -> None:
        """Probe every slot now (before a relaunch): a failing one is lost, a lost one that
        passes is regained."""
        self._round(range(self.capacity.launched))

    def recheck_lost(self) -> None:
        """Probe the lost slots only: those that pass are regained."""
        self._round(self.capacity.lost, regain_only=True)

    def _round(self, slots: Sequence[int], regain_only: bool = False) -> None:
        with self._lock:
            if not self.enabled or not slots:
                return
            for v in self.check.run(slots):
                if v.usable and v.slot in self.capacity.lost:
                    self.capacity.regain(v.slot)
                    self.log.warning("rank slot %d usable again: %s", v.slot, v.said or "exit 0")
                elif not v.usable and not regain_only and v.slot not in self.capacity.lost:
                    self.capacity.lose(v.slot)
                    self.log.warning("rank slot %d lost (health check): %s", v.slot, v.said)

    def start(self) -> HealthMonitor:
        self._thread = threading.Thread(target=self._run, name="ett-health", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        if self.builtin:
            self._validate()
        while not self._stop.wait(self.every_s):
            self.recheck_lost()

    def _validate(self) -> None:
        """The built-in check, before anything was lost: if no slot passes, the probe is
        what is broken here (no driver access in this container, a version mismatch)."""
        with self._lock:
            verdicts = self.check.run(range(self.capacity.launched))
            if verdicts and not any(v.usable for v in verdicts):
                self.enabled = False
                self.log.warning(
                    "health check %r fails on every rank slot at the job's start (%s): "
                    "not used, no slot will be marked lost",
                    self.check.command,
                    verdicts[0].said,
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.check.timeout_s + KILL_WAIT_S + 1.0)


def monitor(
    config: JobConfig, capacity: Capacity, env: dict[str, str], log: Log
) -> HealthMonitor | None:
    """This job's health monitor, started; None when it has no check. ``env``: the ranks'
    own variables (a ``CUDA_VISIBLE_DEVICES`` there or in this process picks the devices)."""
    command = resolve(config)
    if command is None:
        return None
    inherited = inherited_devices(env)
    timeout_s = config.recovery.health_check_timeout_s
    check = HealthCheck(command, timeout_s, inherited, capacity.launched)
    builtin = config.recovery.health_check == HEALTH_AUTO
    log.info("health check of the %d rank slots: %s", capacity.launched, command)
    return HealthMonitor(check, capacity, log, builtin=builtin).start()
