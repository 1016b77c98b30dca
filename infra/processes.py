"""Is a process, or a process group, still there? One answer for the stack, the training
orchestrator and the checkpointer's spool cleanup.

Zombies count as gone: a finished child that nobody has reaped yet still answers signal 0,
so on Linux the groups are read from /proc; elsewhere signal 0 is the fallback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
