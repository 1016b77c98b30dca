"""How much a user has to read of ``make demo``'s log: its lines, and its records by level.

Runs ``ett demo`` in a fresh folder (cold: no data, no compile cache), its stdout and stderr
captured together as a terminal would show them, and counts:

- ``lines``: every line of that output;
- ``level_lines``: lines by the level field the console writes (``... WARNING name: ...``);
- ``records``: the log records the demo's process made, by level, and those of them that go
  to the Prefect run's logs (``prefect.flow_runs``, ``prefect.task_runs`` and the extra
  loggers): what the Prefect UI's "Warning and above" filter leaves a user to read.

    .venv/bin/python benchmarks/demo_logs.py --out demo-logs.json [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LEVEL_FIELD = re.compile(r"\b(" + "|".join(LEVELS) + r")\b")
API_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "infra", "publish", "trainer")


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.all: collections.Counter[str] = collections.Counter()
        self.api: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.all[record.levelname] += 1
        if record.name.startswith(API_LOGGERS):
            self.api[record.levelname] += 1


def child(counts_path: str) -> int:
    """``ett demo`` in this process, a counting handler on the root logger."""
    from flows.cli import main

    counter = _Counter()
    handlers = logging.Logger.callHandlers  # every record that a logger lets through, once

    def counting(self: logging.Logger, record: logging.LogRecord) -> None:
        counter.handle(record)
        handlers(self, record)

    logging.Logger.callHandlers = counting  # type: ignore[method-assign]

    def dump() -> None:
        payload = {"all": dict(counter.all), "api": dict(counter.api)}
        Path(counts_path).write_text(json.dumps(payload, indent=1))

    atexit.register(dump)
    return main(["demo"])


def count_lines(text: str) -> dict[str, object]:
    lines = text.splitlines()
    by_level: collections.Counter[str] = collections.Counter()
    for line in lines:
        head = line[:60]  # the level field comes right after the timestamp
        found = LEVEL_FIELD.search(head)
        if found:
            by_level[found.group(1)] += 1
    warning_up = sum(by_level[x] for x in ("WARNING", "ERROR", "CRITICAL"))
    return {"lines": len(lines), "level_lines": dict(by_level), "warning_up_lines": warning_up}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the counts go (JSON)")
    parser.add_argument("--work-dir", help="the demo's folder (default: a fresh temporary one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ett-demo-logs-"))
    work.mkdir(parents=True, exist_ok=True)
    counts = work / "records.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", "-", "--child", str(counts)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=False, check=False, **_merged())
    text = proc.stdout
    (work / "demo.log").write_text(text)
    result = {
        "exit_code": proc.returncode,
        "log": str(work / "demo.log"),
        **count_lines(text),
        "records": json.loads(counts.read_text()) if counts.exists() else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return proc.returncode


def _merged() -> dict[str, object]:
    """stdout and stderr as one stream, in the order they were written."""
    return {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}


if __name__ == "__main__":
    sys.exit(main())
