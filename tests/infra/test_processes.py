"""infra/processes.py: live processes and groups are seen, exited ones (zombies too) are not."""

from __future__ import annotations

import os
import subprocess
import time

from infra import processes


def test_an_unreaped_child_is_gone_but_a_live_one_is_not() -> None:
    assert processes.pid_alive(os.getpid())
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while processes.pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes.pid_alive(child.pid)  # exited, not yet reaped: a zombie
    os.kill(child.pid, 0)  # which signal 0 alone would still report as there
    child.wait()


def test_a_group_is_alive_while_any_member_runs() -> None:
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert processes.group_alive(leader.pid)
        assert any("sleep 30" in cmd for cmd in processes.group_cmdlines(leader.pid) or [])
    finally:
        leader.kill()
    deadline = time.monotonic() + 10
    while processes.group_alive(leader.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes.group_alive(leader.pid)  # before wait(): the zombie does not count
    leader.wait()
