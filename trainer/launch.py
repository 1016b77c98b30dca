"""``python -m trainer.launch [torchrun flags] -m trainer --config FILE``: torchrun for the trainer.

The flags are torchrun's own (``torch.distributed.run``: the elastic agent, c10d rendezvous,
``--nnodes``/``--rdzv-*`` for several nodes). Four things differ from plain ``torchrun``,
each for time to start or time to recover:

- **Ranks are forked from the agent.** The agent imports torch, TorchRec and the trainer
  once, then forks each local rank (``--start-method fork``): a rank starts with everything
  imported instead of paying the imports again after the agent's own. Where forking is not
  safe (CUDA already initialised in the agent) the ranks are started as fresh interpreters,
  as torchrun does.
- **A failed rank takes the others down at once.** torchrun asks the surviving ranks to stop
  with SIGTERM, which the trainer treats as a preemption: it would try to checkpoint with a
  dead peer and block until the shutdown timeout. Here the survivors of a failure get
  SIGKILL; the next attempt resumes from the newest committed checkpoint either way. A
  SIGTERM sent to the agent itself (a real preemption) is still passed on as SIGTERM, with
  ``--shutdown-timeout`` to save.
- **A single node joins its rendezvous at once**, without the random 0-0.3 s sleep torchrun
  takes before a first join to spread many nodes' joins.
- **The exit code is the first failed rank's** (infra/exit_codes.py; a signal ``s`` becomes
  ``128 + s``), so the orchestrator and ``ett train`` classify an attempt from the code alone
  instead of parsing torchrun's summary.

``python -m trainer.launch --park`` is the same launcher started ahead of its job by a warm
agent pool (tasks/agent_pool.py, protocol in infra/agent_protocol.py): it imports everything a
launch and its forked ranks need, the compiler included, says it is ready, and blocks on its
socket (no CPU) until an orchestrator's claim hands it a command line, an environment, a
working folder and its output and status pipes. From then on it is that launch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from infra import agent_protocol, log_lines
from infra.exit_codes import ExitCode, name_of
from infra.processes import die_with_parent
from trainer import gc_policy

log = logging.getLogger("trainer.launch")

START_FORK = "fork"


def _exit_code(code: int | None) -> int:
    if code is None:
        return ExitCode.CRASH
    return 128 - code if code < 0 else code  # -9 -> 137


def worker_main(*argv: str) -> None:
    """A forked rank's entry point (``python -m trainer`` is the other). A crash is one
    line here and exit code 1: an exception let out of here would make torch.multiprocessing
    write it to a ``pytorch-errorfile-*.pickle`` in the temp folder that nothing removes."""
    from trainer.train import main

    try:
        code = main(list(argv))
    except Exception as exc:  # noqa: BLE001 - said here, the code tells the orchestrator
        log.error("rank crashed: %s: %s", type(exc).__name__, exc)
        log.debug("the crash", exc_info=True)
        code = ExitCode.CRASH
    if code:
        sys.exit(int(code))  # the agent reads the process's exit code


# Exit codes of the local ranks, recorded by the agent when it shuts them down.
_RANK_EXIT_CODES: dict[int, int | None] = {}


def _use_fail_fast_agent() -> None:
    """Survivors of a failed rank get SIGKILL, not SIGTERM (see the module docstring)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    class FailFastAgent(LocalElasticAgent):
        def _stop_workers(self, worker_group: Any) -> None:
            exited = _worker_exit_codes(self._pcontext).values()
            if ExitCode.PREEMPTED in exited:  # preempted ranks: the others are saving too
                self._shutdown(timeout=self._shutdown_timeout)
            else:
                self._shutdown(death_sig=signal.SIGKILL, timeout=5)

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            super()._shutdown(death_sig, timeout)
            _RANK_EXIT_CODES.update(_worker_exit_codes(self._pcontext))

    api.LocalElasticAgent = FailFastAgent  # type: ignore[misc]  # the agent launch_agent builds


def _no_join_jitter() -> None:
    """A single node joins its rendezvous at once. torchrun's c10d rendezvous sleeps a random
    0-0.3 s before a node's first join, to spread many nodes' joins over time: with one
    node there is nobody to spread, and the sleep is on the path of every fresh launch's
    Time to Start. Only that random delay (a range) is dropped; its fixed retry back-off
    (a number) stays."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = dynamic_rendezvous._delay

    def fixed_only(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            delay(seconds)

    dynamic_rendezvous._delay = fixed_only


def _worker_exit_codes(pcontext: Any) -> dict[int, int | None]:
    """Exit codes of the agent's local ranks after a shutdown (fork or exec children)."""
    if pcontext is None:
        return {}
    procs = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if procs is not None:
        return {i: p.exitcode for i, p in enumerate(procs)}
    handlers = getattr(pcontext, "subprocess_handlers", {}) or {}
    return {i: h.proc.returncode for i, h in handlers.items()}


def _can_fork() -> bool:
    """Forked ranks cannot use CUDA if the agent initialised it (an import might have)."""
    import torch

    return not torch.cuda.is_initialized()


def run(argv: Sequence[str]) -> int:
    """Parse torchrun's flags, start the agent with forked ranks, return the exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    argv = list(argv)
    if not any(a.startswith(("--start-method", "--start_method")) for a in argv):
        argv.insert(0, f"--start-method={START_FORK}")
    args = torchrun.get_args_parser().parse_args(argv)
    if args.standalone:  # as torch.distributed.run does: a private c10d store on a free port
        import uuid

        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
            "c10d",
            "localhost:0",
            str(uuid.uuid4()),
        )
    if args.master_port is None:
        args.master_port = 29500
    if args.log_dir is None:
        # torchrun's default is a torchelastic_* temp folder that nothing ever removes, for
        # per-rank error files nothing here reads: a rank's exit code tells the orchestrator
        # what happened, its traceback is in its output.
        args.log_dir = os.devnull
    # Only the trainer itself can be forked from here (it is what this process imported).
    trainer = bool(args.module) and args.training_script == "trainer"
    fork = args.start_method == START_FORK and trainer and _can_fork()
    if not fork:
        args.start_method = "spawn"
    config, cmd, cmd_args = torchrun.config_from_args(args)
    if fork:
        import trainer.train  # noqa: F401 - imported once here, inherited by every forked rank

        entry: Any = worker_main
        entry_args = list(args.training_script_args)
    else:
        entry, entry_args = cmd, cmd_args
    _use_fail_fast_agent()
    if config.max_nodes == 1:
        _no_join_jitter()
    gc_policy.settle()  # imported: what the forked ranks share
    try:
        elastic_launch(config=config, entrypoint=entry)(*entry_args)
        return ExitCode.SUCCESS
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = _exit_code(failure.exitcode)
        log.warning("rank %d failed first: %s", rank, name_of(code))
        return code
    except SignalException as exc:  # the agent was told to stop: its ranks' codes decide
        codes = [c for c in _RANK_EXIT_CODES.values() if c]
        log.warning("launcher stopped by %s; rank exit codes %s", exc.sigval, codes)
        return _exit_code(codes[0]) if codes else 128 + int(exc.sigval)


def _preimport() -> None:
    """What every launch of the trainer imports: torchrun's agent, the trainer (which its
    forked ranks inherit) and the compiler the ranks' warm-up loads, primed (its hashes,
    ISA probe and lazy setup done once here, not in each job's warm-up). CUDA is not
    touched, so the ranks can still be forked."""
    import torch.distributed.launcher.api  # noqa: F401
    import torch.distributed.run  # noqa: F401

    import trainer.train  # noqa: F401
    from trainer.compiled import import_compiler, prime_compiler
    from trainer.distributed import import_functional_optimizers_unscripted

    import_functional_optimizers_unscripted()
    import_compiler()  # the ranks' compile warm-up needs it
    prime_compiler()


def park(fd: int) -> int:
    """A parked agent's life: import, report ready, wait for a claim, then run it.

    Until claimed it dies with its pool (PR_SET_PDEATHSIG); once claimed it belongs to the
    orchestrator that claimed it, whose control pipes its ranks watch, so it outlives a pool
    that stops. A pool that closes the socket instead releases it (exit 0)."""
    die_with_parent()
    sock = socket.socket(fileno=fd)
    # Taken before the imports: a file edited while they run (seconds) then differs from
    # what the claim compares, and this agent is refused rather than running stale code.
    fingerprint = agent_protocol.code_fingerprint()
    gc_policy.pause()
    _preimport()
    try:
        agent_protocol.send(sock, {"ready": True, "pid": os.getpid(), "fingerprint": fingerprint})
        claim, fds = agent_protocol.receive(sock, agent_protocol.CLAIM_FDS)
    except (EOFError, OSError):  # the pool stopped (or released this agent) first
        return ExitCode.SUCCESS
    sock.close()
    if len(fds) != agent_protocol.CLAIM_FDS:
        return ExitCode.USAGE
    out_fd, status_fd = fds
    die_with_parent(0)  # the pool no longer decides when this process ends
    sys.stdout.flush()
    sys.stderr.flush()
    for target in (1, 2):
        os.dup2(out_fd, target)
    os.close(out_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.setsid()  # its own session, as the orchestrator starts a fresh launcher
    os.chdir(claim["cwd"])
    os.environ.clear()
    os.environ.update(claim["env"])
    code: int = ExitCode.CRASH
    try:
        code = main(claim["argv"])
    except SystemExit as exc:  # torchrun's parser on a bad flag, --help
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        with contextlib.suppress(OSError):  # the orchestrator may be gone
            os.write(status_fd, f"{int(code)}\n".encode())
    return code


def main(argv: Sequence[str] | None = None) -> int:
    gc_policy.pause()  # until the imports are done (trainer/gc_policy.py)
    logging.basicConfig(level=logging.WARNING, format=log_lines.line_format("launcher"))
    # The agent's own report of a failed rank is a traceback of torch.distributed internals
    # that says nothing about the job: one line above names the rank and its exit code.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    if sys.argv[1:] == ["--park"]:
        sys.exit(park(int(os.environ[agent_protocol.ENV_PARK_FD])))
    sys.exit(main())
