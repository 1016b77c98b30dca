"""Mutation testing of the core modules with cosmic-ray (``make mutate``; not in ``make test``).

For each target of mutation/targets.toml: cosmic-ray lists every mutant of its modules, the
operators not kept and the mutants outside the sample are set aside, and each remaining
mutant is applied in place and the target's fast tests run against it: a failing run kills
the mutant, a passing one lets it survive. Sessions are kept in mutation/.sessions/, so an
interrupted run goes on where it stopped. Prints per module: the score (killed / run) and
every survivor with its line.

    python mutation/run.py                      # every target
    python mutation/run.py ett ledger           # some of them
    python mutation/run.py --fresh attempts     # start that target's session again
    python mutation/run.py --survivors ett      # run the survivors again (after new tests)
    python mutation/run.py --report             # only print the results so far

Mutants are applied to the working tree: the modules must have no uncommitted changes (a
killed run is put right with ``git checkout -- <module>``). ``--pause-file F`` (or
MUTATE_PAUSE_FILE): while F exists no mutant starts, for a machine shared with timed
benchmarks.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from cosmic_ray.commands import init
from cosmic_ray.mutating import mutate_and_test
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
SESSIONS = HERE / ".sessions"
NOT_SAMPLED = "not in the sample"
NOT_KEPT = "operator not kept"


@dataclass(frozen=True)
class Target:
    name: str
    modules: tuple[str, ...]
    tests: tuple[str, ...]
    sample: float

    def command(self, pytest_timeout_s: int) -> str:
        return shlex.join(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--timeout={pytest_timeout_s}",
                "-W",
                "ignore::FutureWarning",
                *self.tests,
            ]
        )


def load(path: Path = HERE / "targets.toml") -> tuple[dict, list[Target]]:
    config = tomllib.loads(path.read_text())
    targets = [
        Target(t["name"], tuple(t["modules"]), tuple(t["tests"]), float(t.get("sample", 1.0)))
        for t in config["target"]
    ]
    return config, targets


def _dirty(modules: tuple[str, ...]) -> str:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _session(target: Target) -> Path:
    return SESSIONS / f"{target.name}.sqlite"


def prepare(target: Target, config: dict) -> None:
    """A new session: every mutant, then the ones not run set aside (recorded as skipped)."""
    SESSIONS.mkdir(exist_ok=True)
    kept = re.compile(r"^core/(" + "|".join(config["operators"]) + r")$")
    with use_db(str(_session(target)), WorkDB.Mode.create) as db:
        init([ROOT / m for m in target.modules], db, {})
        items = sorted(
            db.pending_work_items,
            key=lambda w: (
                str(w.mutations[0].module_path),
                w.mutations[0].operator_name,
                w.mutations[0].occurrence,
            ),
        )
        chosen = [w for w in items if kept.match(w.mutations[0].operator_name)]
        rng = random.Random(f"{config['seed']}-{target.name}")
        sample = set(rng.sample(range(len(chosen)), round(target.sample * len(chosen))))
        chosen_ids = {w.job_id for i, w in enumerate(chosen) if i in sample}
        for w in items:
            if w.job_id in chosen_ids:
                continue
            why = NOT_SAMPLED if kept.match(w.mutations[0].operator_name) else NOT_KEPT
            db.set_result(w.job_id, WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED))


def _wait_while(pause_file: str | None) -> None:
    if pause_file and os.path.exists(pause_file):
        print(f"  paused while {pause_file} exists", flush=True)
        while os.path.exists(pause_file):
            time.sleep(15)


def execute(target: Target, config: dict, pause_file: str | None) -> None:
    """Run the pending mutants of a target, one at a time."""
    command = target.command(int(config["pytest_timeout_s"]))
    originals = {m: (ROOT / m).read_text() for m in target.modules}

    def restore(*_: object) -> None:
        for module, text in originals.items():
            (ROOT / module).write_text(text)
        raise SystemExit(130)

    old = {s: signal.signal(s, restore) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with use_db(str(_session(target)), WorkDB.Mode.open) as db:
            pending = list(db.pending_work_items)
            started = time.monotonic()
            for i, item in enumerate(pending, 1):
                _wait_while(pause_file)
                result = mutate_and_test(item.mutations, command, float(config["run_timeout_s"]))
                db.set_result(item.job_id, result)
                if i % 10 == 0 or i == len(pending):
                    rate = (time.monotonic() - started) / i
                    print(f"  {target.name}: {i}/{len(pending)} ({rate:.1f} s each)", flush=True)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for module, text in originals.items():  # cosmic-ray restores each mutant; be sure
            if (ROOT / module).read_text() != text:
                (ROOT / module).write_text(text)


def rerun_survivors(target: Target) -> int:
    """Drop the survivors' results, so they run again (after new tests)."""
    from cosmic_ray.work_db import WorkResultStorage

    with use_db(str(_session(target)), WorkDB.Mode.open) as db:
        survivors = [
            item.job_id
            for item, result in db.completed_work_items
            if result.worker_outcome == WorkerOutcome.NORMAL
            and result.test_outcome == TestOutcome.SURVIVED
        ]
        with db._session_maker.begin() as session:  # noqa: SLF001 - no public call for this
            query = session.query(WorkResultStorage)
            query.filter(WorkResultStorage.job_id.in_(survivors)).delete()
    return len(survivors)


def _line(module: str, line: int) -> str:
    try:
        return (ROOT / module).read_text().splitlines()[line - 1].strip()
    except (OSError, IndexError):
        return ""


def report(targets: list[Target]) -> int:
    """Print each module's score and its survivors; returns the number of survivors."""
    survivors_total = 0
    rows, lines = [], []
    for target in targets:
        if not _session(target).exists():
            continue
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        survivors = []
        with use_db(str(_session(target)), WorkDB.Mode.open) as db:
            for item, result in db.completed_work_items:
                m = item.mutations[0]
                module = str(Path(m.module_path).resolve().relative_to(ROOT))
                if result.worker_outcome == WorkerOutcome.SKIPPED:
                    counts[module][result.output or "skipped"] += 1
                elif result.worker_outcome == WorkerOutcome.NO_TEST:
                    counts[module]["no mutation"] += 1
                elif result.worker_outcome != WorkerOutcome.NORMAL:
                    counts[module]["error"] += 1
                else:
                    counts[module][TestOutcome(result.test_outcome).value] += 1
                    if result.test_outcome == TestOutcome.SURVIVED:
                        line = m.start_pos[0]
                        op = m.operator_name.replace("core/", "")
                        survivors.append((module, line, op, _line(module, line)))
        for module, c in sorted(counts.items()):
            run = c["killed"] + c["survived"] + c["incompetent"]
            score = 100.0 * (c["killed"] + c["incompetent"]) / run if run else 0.0
            rows.append(
                f"| `{module}` | {target.name} | {run} | {c['killed']} | {c['incompetent']} "
                f"| {c['survived']} | **{score:.1f}%** | {c[NOT_SAMPLED]} | {c[NOT_KEPT]} |"
            )
        survivors_total += len(survivors)
        for module, line, op, code in sorted(survivors):
            lines.append(f"- `{module}:{line}` {op}: `{code}`")
    print(
        "| module | target | run | killed | incompetent | survived | score | "
        "not sampled | operator not kept |\n|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    print(f"\nSurvivors ({survivors_total}):")
    print("\n".join(lines) or "none")
    return survivors_total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="targets (default: all)")
    parser.add_argument("--fresh", action="store_true", help="start the sessions again")
    parser.add_argument("--survivors", action="store_true", help="rerun the survivors")
    parser.add_argument("--report", action="store_true", help="only print the results")
    parser.add_argument("--pause-file", default=os.environ.get("MUTATE_PAUSE_FILE"))
    args = parser.parse_args(argv)
    config, targets = load()
    unknown = set(args.names) - {t.name for t in targets}
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {[t.name for t in targets]}")
    chosen = [t for t in targets if not args.names or t.name in args.names]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    if not args.report:
        for target in chosen:
            dirty = _dirty(target.modules)
            if dirty:
                print(f"{target.name}: uncommitted changes, not mutating:\n{dirty}")
                return 2
        for target in chosen:
            started = time.monotonic()
            if args.fresh or not _session(target).exists():
                prepare(target, config)
            elif args.survivors:
                print(f"{target.name}: {rerun_survivors(target)} survivors to run again")
            print(f"{target.name}: {' '.join(target.modules)}", flush=True)
            execute(target, config, args.pause_file)
            print(f"{target.name}: done in {time.monotonic() - started:.0f} s", flush=True)
    report(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
