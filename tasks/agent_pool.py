"""A warm pool of parked trainer agents, and how an attempt claims one.

A job's Time to Start begins with a fresh interpreter importing torch, TorchRec, the trainer
and the compiler: seconds of single-threaded work on a small host, before any rank exists,
that no restructuring inside the job can overlap (a rank gets those modules only by
importing them or by being forked from a process that did). ``ett pool`` does that work
before the job exists: it keeps ``size`` agents parked (``python -m trainer.launch --park``,
imported and blocked on a socket, no CPU) and hands one to each orchestrator that asks.

**Ownership.** A parked agent is the pool's: it dies with the pool (PR_SET_PDEATHSIG) and
is released when the pool stops. A claimed agent is the claiming orchestrator's, exactly
like a launcher it started: its ranks watch that orchestrator's control pipes, the
orchestrator ends its tree, and it keeps running if the pool stops.

**Claiming** (``claim``, used by tasks/attempt.py when ``ETT_LAUNCH__AGENT_POOL`` names the pool's
socket): the orchestrator sends the launch command, its environment and working folder, and
the write ends of two pipes (output, exit status); it gets back a ``PooledLauncher`` that
stands in for the ``subprocess.Popen`` it would otherwise hold. A pool that is missing, busy
(no agent parked), or whose agents imported other code or under other import-time settings
(infra/agent_protocol.py) refuses, and the orchestrator starts a fresh interpreter as usual.

**Refilling** waits ``refill_delay_s`` after a claim, so the next agent's imports do not
compete for the cores with the start of the job that was just handed one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from infra import agent_protocol, processes
from infra.agent_protocol import ENV_PARK_FD

log = logging.getLogger(__name__)

PARK_COMMAND = ("-m", "trainer.launch", "--park")
LAUNCHER = ("-m", "trainer.launch")  # the only command a parked agent can become
CLAIM_TIMEOUT_S = 5.0
KILLED = 128 + signal.SIGKILL  # a launcher that exited without writing its status


# -- the orchestrator's side ---------------------------------------------------------------------
class PooledLauncher:
    """A claimed agent, as the attempt sees it: what it uses of ``subprocess.Popen``.

    The agent is not our child, so its exit code comes from the status pipe it writes as it
    exits; one that vanished without writing it was killed (``KILLED``)."""

    def __init__(self, pid: int, stdout: IO[str], status_fd: int) -> None:
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self._status_fd = status_fd
        self._status = b""

    def _read_status(self) -> int | None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._status += os.read(self._status_fd, 64)
        line = self._status.split(b"\n", 1)[0]
        return int(line) if self._status.endswith(b"\n") and line.strip() else None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self._read_status()
        if code is None and processes.pid_alive(self.pid):
            return None
        if code is None:
            code = self._read_status()  # written just before it exited
        self.returncode = KILLED if code is None else code
        with contextlib.suppress(OSError):
            os.close(self._status_fd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pooled agent {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code


def claim(
    socket_path: str, command: list[str], env: dict[str, str], log_to: Any = log
) -> PooledLauncher | None:
    """Ask the pool at ``socket_path`` to run ``command``; None (and one log line saying
    why) when it cannot, so the caller starts a fresh interpreter instead."""
    if tuple(command[1:3]) != LAUNCHER or command[0] != sys.executable:
        return None
    out_r, out_w = os.pipe()
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    keep = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(CLAIM_TIMEOUT_S)
            sock.connect(socket_path)
            request = {
                "argv": command[3:],
                "env": env,
                "cwd": os.getcwd(),
                "fingerprint": agent_protocol.code_fingerprint(),
            }
            agent_protocol.send(sock, request, (out_w, status_w))
            reply, _ = agent_protocol.receive(sock)
        if "pid" not in reply:  # busy (refilling) is normal; anything else is worth a warning
            level = logging.INFO if reply.get("busy") else logging.WARNING
            why = reply.get("error")
            log_to.log(level, "agent pool %s: %s; starting a fresh launcher", socket_path, why)
            return None
        keep = True
        return PooledLauncher(int(reply["pid"]), os.fdopen(out_r, "r"), status_r)
    except (OSError, EOFError, ValueError) as exc:
        log_to.warning("agent pool %s unusable (%s); starting a fresh launcher", socket_path, exc)
        return None
    finally:
        os.close(out_w)
        os.close(status_w)
        if not keep:
            os.close(out_r)
            os.close(status_r)


# -- the pool's side -----------------------------------------------------------------------------
@dataclass
class Parked:
    """One agent the pool started: its process, our end of its socket, what it imported
    (its environment is the pool's own, ``AgentPool.env``)."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    fingerprint: str | None = None  # set when it reports ready
    started: float = field(default_factory=time.monotonic)

    @property
    def ready(self) -> bool:
        return self.fingerprint is not None


class AgentPool:
    """``size`` parked agents behind a unix socket; ``serve`` runs until ``stop`` is set."""

    def __init__(
        self, socket_path: str, size: int = 1, refill_delay_s: float = 10.0, env: Any = None
    ) -> None:
        if size < 1:
            raise ValueError(f"an agent pool needs size >= 1, got {size}")
        self.socket_path, self.size, self.refill_delay_s = socket_path, size, refill_delay_s
        env = dict(env or os.environ)
        self.env = {**env, "PYTHONPATH": processes.repo_pythonpath(env.get("PYTHONPATH"))}
        self.parked: list[Parked] = []
        self.claimed: list[subprocess.Popen[bytes]] = []  # ours to reap, theirs to end
        self.claims = 0
        self.last_claim = float("-inf")
        self.spawn_after = float("-inf")  # backing off after agents that died unclaimed
        self._deaths = 0
        self.stop = threading.Event()
        self.ready = threading.Event()  # the socket listens
        self._listener: socket.socket | None = None

    # -- agents ------------------------------------------------------------------------------
    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self.env, ENV_PARK_FD: str(theirs.fileno())}
        proc = subprocess.Popen(
            [sys.executable, *PARK_COMMAND],
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.parked.append(Parked(proc, ours))
        log.info("agent pool: started agent %d", proc.pid)

    def _on_agent_message(self, agent: Parked) -> None:
        try:
            message, _ = agent_protocol.receive(agent.sock)
        except (EOFError, OSError):
            self._died(agent, "exited before it was claimed")
            return
        if message.get("ready"):
            self._deaths = 0
            agent.fingerprint = str(message.get("fingerprint"))
            log.info(
                "agent pool: agent %d parked after %.1f s",
                agent.proc.pid,
                time.monotonic() - agent.started,
            )

    def _drop(self, agent: Parked, why: str) -> None:
        log.warning("agent pool: agent %d %s", agent.proc.pid, why)
        self.parked.remove(agent)
        agent.sock.close()
        processes.terminate_tree(agent.proc.pid, 2.0, signal.SIGKILL, reap=agent.proc.poll)

    def _refill(self) -> None:
        now = time.monotonic()
        due = now - self.last_claim >= self.refill_delay_s and now >= self.spawn_after
        while due and len(self.parked) < self.size:
            self._spawn()

    def _reap(self) -> None:
        self.claimed = [p for p in self.claimed if p.poll() is None]
        for agent in [a for a in self.parked if a.proc.poll() is not None]:
            self._died(agent, f"exited with {agent.proc.returncode} while parked")

    def _died(self, agent: Parked, why: str) -> None:
        """An agent that died unclaimed (an import failed?): the next one waits 1, 2, 4 ...
        60 s, so a broken install is not restarted in a loop. Its output says why."""
        self._drop(agent, why)
        self._deaths += 1
        wait = min(60.0, 2.0 ** (self._deaths - 1))
        self.spawn_after = time.monotonic() + wait
        log.warning("agent pool: parking the next agent in %.0f s", wait)

    # -- claims ------------------------------------------------------------------------------
    def _on_claim(self, conn: socket.socket) -> None:
        with conn:
            try:
                request, fds = agent_protocol.receive(conn, agent_protocol.CLAIM_FDS)
            except (EOFError, OSError) as exc:
                log.warning("agent pool: a bad claim: %s", exc)
                return
            try:
                reply = self._hand_over(request, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            with contextlib.suppress(OSError):
                agent_protocol.send(conn, reply)

    def _hand_over(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != agent_protocol.CLAIM_FDS:
            return {"error": f"a claim needs {agent_protocol.CLAIM_FDS} pipes, got {len(fds)}"}
        ready = [a for a in self.parked if a.ready]
        if not ready:
            return {"error": "no agent parked yet", "busy": True}
        agent = ready[0]
        if agent.fingerprint != request.get("fingerprint"):
            self._drop(agent, "imported other code than the claim runs: replaced")
            self.last_claim = float("-inf")  # park a fresh one now
            return {"error": "the parked agent imported other code (changed since it parked)"}
        mismatch = agent_protocol.import_env_mismatch(self.env, request.get("env", {}))
        if mismatch:
            return {"error": f"the parked agent was imported under other settings: {mismatch}"}
        try:
            agent_protocol.send(agent.sock, request, tuple(fds))
        except OSError as exc:
            self._drop(agent, f"could not take the claim ({exc})")
            return {"error": "the parked agent could not take the claim"}
        self.parked.remove(agent)
        agent.sock.close()
        self.claimed.append(agent.proc)
        self.claims += 1
        self.last_claim = time.monotonic()
        log.info("agent pool: agent %d claimed", agent.proc.pid)
        return {"pid": agent.proc.pid}

    # -- the loop ----------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        if os.path.exists(self.socket_path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                try:
                    probe.connect(self.socket_path)
                except OSError:
                    os.unlink(self.socket_path)  # left behind by a pool that died
                else:
                    raise RuntimeError(f"an agent pool already listens on {self.socket_path}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old_umask = os.umask(0o077)  # only this user may claim (the socket runs its code)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(16)
        return listener

    def serve(self) -> None:
        """Keep ``size`` agents parked and hand them out until ``stop`` is set."""
        self._listener = self._listen()
        self.ready.set()
        try:
            while not self.stop.is_set():
                self._reap()
                self._refill()
                waiting = [self._listener, *(a.sock for a in self.parked)]
                readable, _, _ = select.select(waiting, [], [], 0.2)
                for sock in readable:
                    if sock is self._listener:
                        conn, _ = self._listener.accept()
                        self._on_claim(conn)
                    else:
                        agent = next((a for a in self.parked if a.sock is sock), None)
                        if agent is not None:
                            self._on_agent_message(agent)
        finally:
            self.close()

    def close(self) -> None:
        """Release the parked agents (they exit on end-of-file; killed after 2 s) and stop
        listening. Claimed agents are their orchestrators' and are left alone."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        for agent in list(self.parked):
            agent.sock.close()
        deadline = time.monotonic() + 2.0
        while any(a.proc.poll() is None for a in self.parked) and time.monotonic() < deadline:
            time.sleep(0.05)
        for agent in self.parked:
            processes.terminate_tree(agent.proc.pid, 0.0, signal.SIGKILL, reap=agent.proc.poll)
        self.parked = []
