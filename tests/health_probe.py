"""A stand-in for a device health check (``recovery.health_check``), run as
``python tests/health_probe.py FOLDER SLOT``: slot SLOT is lost (exit 3, one line saying why)
while ``FOLDER/lost-SLOT`` exists, never answers while ``FOLDER/hang-SLOT`` exists (its pid
in ``FOLDER/pid-SLOT``), and is usable otherwise: a test loses and regains a slot the way a
failing device would, from outside the orchestrator."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

HANG_S = 120.0  # longer than any health check's timeout in the tests


def command(folder: Path) -> str:
    """The ``recovery.health_check`` that runs this probe on ``folder``."""
    return (
        f"{shlex.quote(sys.executable)} {shlex.quote(__file__)} {shlex.quote(str(folder))} {{slot}}"
    )


def main(folder: Path, slot: str) -> int:
    if (folder / f"hang-{slot}").exists():
        (folder / f"pid-{slot}").write_text(str(os.getpid()))
        time.sleep(HANG_S)
    if (folder / f"lost-{slot}").exists():
        print(f"slot {slot}: device gone (lost-{slot} present)")
        return 3
    print(f"slot {slot}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
