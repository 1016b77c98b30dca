"""The warm agent pool's wire protocol, shared by its three parties.

A pool (``ett pool``, tasks/agent_pool.py) keeps trainer agents *parked*: ``python -m
trainer.launch --park`` processes that have imported torch, TorchRec, the trainer and the
compiler, and wait on a socket for a job. An orchestrator (``ett train``, the ``train``
flow) that finds ``ETT_LAUNCH__AGENT_POOL`` in its environment asks the pool for one instead of
starting a fresh interpreter; the agent then runs the launch command it is handed, exactly
as a fresh ``python -m trainer.launch`` would. The imports are the largest part of a warm
Time to Start on a small host, and a parked agent paid them before the job existed.

Messages are JSON objects, one per datagram on ``SOCK_SEQPACKET`` unix sockets (boundaries
kept, no framing), with file descriptors passed alongside (``SCM_RIGHTS``):

- agent -> pool, once imported: ``{"ready": true, "pid", "fingerprint"}``;
- orchestrator -> pool, a claim: ``{"argv", "env", "cwd", "fingerprint"}`` with two fds,
  the write ends of the agent's output pipe and of its status pipe;
- pool -> agent: the claim, fds included; pool -> orchestrator: ``{"pid"}`` or ``{"error"}``;
- agent -> status pipe, as it exits: its exit code and a newline (nothing when killed).

A parked agent only serves a job that would have imported the same things: same interpreter,
same code (``code_fingerprint``) and the same environment variables that libraries read
when imported (``import_env_mismatch``). Otherwise the claim is refused and the
orchestrator starts a fresh interpreter, as it does without a pool.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from infra.processes import REPO_ROOT

ENV_POOL = "ETT_LAUNCH__AGENT_POOL"  # the launch.agent_pool field, set in the environment
ENV_PARK_FD = "ETT_PARK_FD"  # a parked agent: its end of the socketpair with the pool
MAX_MESSAGE = 1 << 20
CLAIM_FDS = 2  # output pipe, status pipe
_CODE_PACKAGES = ("trainer", "infra")  # what a parked agent has imported from this repo
_LIBRARIES = ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "tensordict")
# Read by torch, its compiler or the native libraries when they are imported or first used:
# an agent imported under other values would not be the process the job asked for.
IMPORT_SENSITIVE = ("TORCH", "PYTORCH", "TRITON", "OMP_", "MKL_", "KMP_", "CUDA", "NCCL_", "LD_")
IMPORT_SENSITIVE_NAMES = ("PYTHONPATH", "PYTHONHASHSEED")


def send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """One message (and ``fds``) as one datagram."""
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"agent-pool message of {len(data)} bytes is over {MAX_MESSAGE}")
    socket.send_fds(sock, [data], list(fds))


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """The next message and the fds that came with it; EOFError when the peer is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
    if not data:
        for fd in fds:
            os.close(fd)
        raise EOFError("the other end of the agent-pool socket closed")
    try:
        message = json.loads(data)
    except ValueError as exc:
        for fd in fds:
            os.close(fd)
        raise EOFError(f"malformed agent-pool message: {data[:200]!r}") from exc
    return message, fds


def code_fingerprint(root: Path = REPO_ROOT) -> str:
    """What a parked agent's imports depend on: the interpreter, the library versions and
    every source file of the repo's packages it imported (path and content: size and mtime
    miss an edit that keeps both, as ``cp -p``, ``rsync -t`` or a coarse file-system clock
    do; reading the ~0.5 MB of source adds about 1 ms). Edit a file or upgrade torch after
    an agent parked, and it no longer matches."""
    h = hashlib.sha256(sys.executable.encode())
    for name in _LIBRARIES:
        try:
            h.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            continue
    for package in _CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            data = path.read_bytes()
            h.update(f"{path.relative_to(root)}:{len(data)}:".encode())
            h.update(data)
    return h.hexdigest()[:16]


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment that libraries read when imported."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(IMPORT_SENSITIVE) or k in IMPORT_SENSITIVE_NAMES
    }


def import_env_mismatch(parked: dict[str, str], job: dict[str, str]) -> str | None:
    """The first import-sensitive variable whose value differs, as a phrase naming it (not
    its values: an environment may hold secrets); None if none differs."""
    a, b = import_env(parked), import_env(job)
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            if key not in b:
                return f"{key} differs (unset in the job)"
            if key not in a:
                return f"{key} differs (unset in the pool)"
            return f"{key} differs"
    return None


def socket_path_default() -> str:
    """Where ``ett pool`` listens unless told otherwise: a per-user runtime folder."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"ett-agent-pool-{os.getuid()}.sock")
