"""Where a benchmark's numbers go: one JSON file per benchmark under benchmarks/results/, which
run_all.py and the docs read. One writer, so every result file is written the same way."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def save_json(result: Mapping[str, Any], out: str | Path) -> Path:
    """Write ``result`` to ``out`` as indented JSON (its folder created; values JSON does not
    know, such as paths, as their str), and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    return out


def run_record(started: float) -> dict[str, Any]:
    """What every result records beside its numbers: the machine, and how long the run took
    (``started``: its ``time.time()`` at the start)."""
    return {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "minutes": round((time.time() - started) / 60, 1),
    }


def save_run(
    benchmark: str,
    args: Any,
    summary: Mapping[str, Any],
    rows: list[dict[str, Any]],
    started: float,
    out: str | Path,
) -> Path:
    """A side-by-side benchmark's result, as each of them writes it: its name, its arguments
    (an argparse namespace), the summary, every row, and the run record."""
    result = {"benchmark": benchmark, "args": vars(args), "summary": summary, "rows": rows}
    return save_json({**result, **run_record(started)}, out)
