"""The garbage collector is off while a process starts, and after it has started walks only
what was made since; what starting made is freed at exit, not leaked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.factories import ROOT

SCRIPT = textwrap.dedent(
    """
    import gc

    from trainer import gc_policy

    class Cycle:
        def __init__(self, name):
            self.me, self.name = self, name

        def __del__(self):
            print("freed", self.name, flush=True)

    gc_policy.pause()
    print("on" if gc.isenabled() else "off", flush=True)
    Cycle("made while starting")
    gc_policy.settle()
    print("on" if gc.isenabled() else "off", flush=True)
    Cycle("made after")
    gc.collect()
    print("collected", flush=True)
    """
)


def test_start_is_not_collected_what_follows_is_and_start_is_freed_at_exit() -> None:
    """In a fresh interpreter (this one's collector is not touched): off while starting;
    on once started, when a collection frees new garbage but not start's, which it
    froze; and start's is freed at exit rather than left as a leak."""
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "off",
        "on",
        "freed made after",
        "collected",
        "freed made while starting",
    ]
