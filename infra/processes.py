"""Is a process, or a process group, still there, and how to end a whole tree of them. One
answer for the stack, the training orchestrator and the checkpointer's spool cleanup.

Zombies count as gone: a finished child that nobody has reaped yet still answers signal 0,
so on Linux the groups are read from /proc; elsewhere signal 0 is the fallback.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_pythonpath(existing: str | None) -> str:
    """PYTHONPATH for a process this repo starts (launcher, parked agent, evaluator, data
    generator): the repo first, then ``existing`` without it. One rule, so a parked agent's
    environment and a claim's compare like with like (tasks/agent_pool.py)."""
    rest = [p for p in (existing or "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    return os.pathsep.join([str(REPO_ROOT), *rest])


def group_cmdlines(pgid: int) -> list[str] | None:
    """Command lines of the live (non-zombie) processes in group ``pgid``; None without /proc."""
    if not Path("/proc").is_dir():
        return None
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return out


def _answers_signal(send: Callable[[int, int], None], target: int) -> bool:
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    cmdlines = group_cmdlines(pgid)
    if cmdlines is not None:
        return bool(cmdlines)
    return _answers_signal(os.killpg, pgid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc").is_dir():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return _answers_signal(os.kill, pid)


def _proc_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, state, start time in clock ticks) of every process (Linux /proc)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            table[int(stat.parent.name)] = (int(fields[1]), fields[0], int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, a process's identity."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class TreeTracker:
    """Remembers every process ever seen below some roots, so the whole tree can be ended
    even after a parent exited and its children were reparented away (a rank's own
    children, a worker pool): call ``scan`` while the tree lives, ``end`` at the end."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # pid -> start time

    def scan(self, roots: list[int]) -> None:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for child, (parent, _, _) in table.items():
            children.setdefault(parent, []).append(child)
        todo = [r for r in roots if r in table]
        while todo:
            p = todo.pop()
            self.seen.setdefault(p, table[p][2])
            todo.extend(children.get(p, []))

    def alive(self) -> list[int]:
        """The tracked processes still running (the same processes: start times match)."""
        return [p for p, t in self.seen.items() if start_time(p) == t and pid_alive(p)]

    def end(self, sig: int = signal.SIGKILL) -> list[int]:
        left = self.alive()
        _signal_all(left, sig)
        return left


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) descendants of ``pid``, parents before children.

    Process groups are not enough for a training attempt: torchrun may start each rank in a
    session of its own, so signalling the launcher's group misses them; the parent links
    still reach them while their parent lives.
    """
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        if table.get(p, (0, "Z", 0))[1] != "Z":
            out.append(p)
        todo.extend(children.get(p, []))
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            continue


def terminate_tree(
    pid: int,
    grace_s: float,
    first_signal: int = signal.SIGTERM,
    reap: Callable[[], object] | None = None,
) -> list[int]:
    """End ``pid`` and every process below it: ``first_signal`` to all of them, then SIGKILL
    to whatever is left after ``grace_s``. The tree is snapshotted before anything is
    signalled (once a parent is gone its children are reparented and cannot be found from
    it), and again before the SIGKILL for children started meanwhile.

    ``reap`` (e.g. ``Popen.poll``) is called while waiting so an exited child of ours does
    not linger as a zombie. Returns every pid that was signalled.
    """
    tree = [pid, *descendants(pid)]
    seen = list(tree)
    _signal_all(tree, first_signal)
    deadline = time.monotonic() + grace_s
    while True:
        if reap is not None:
            reap()
        alive = [p for p in seen if pid_alive(p)]
        if not alive:
            return seen
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    late = [p for p in descendants(pid) if p not in seen] if pid_alive(pid) else []
    seen += late
    _signal_all([p for p in seen if pid_alive(p)], signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(pid_alive(p) for p in seen) and time.monotonic() < deadline:
        if reap is not None:
            reap()
        time.sleep(0.05)
    return seen


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when the thread that started it exits
    (PR_SET_PDEATHSIG, Linux; a no-op elsewhere). A rank calls it first thing, so it never
    outlives its launcher; if the parent is already gone, it exits at once. ``sig`` 0
    withdraws the request (a claimed pool agent changes owner)."""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
