"""A tiny dependency-graph runner for init sub-stages: each stage a ledger span, run one after
another or each on its own thread as soon as the stages it needs are done."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from infra.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One init sub-stage: ``fn(results, attrs)`` runs inside a ledger span ``span``."""

    key: str
    span: str
    fn: Callable[[dict[str, Any], dict[str, Any]], Any]
    deps: tuple[str, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)


def run_stages(
    stages: list[Stage],
    ledger: Ledger,
    parallel: bool,
    device: torch.device | None = None,
    results: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the stages (list order must be a valid serial order); returns key -> result.

    Parallel: each stage starts on its own thread once its deps are done. After an error no
    stage starts; the running ones are waited for (a thread still inside torch at exit can
    abort the interpreter, losing the exit code), then the first error is raised.
    """
    results = {} if results is None else results
    known = set(results) | {s.key for s in stages}
    for s in stages:
        missing = [d for d in s.deps if d not in known]
        if missing:
            raise ValueError(f"stage {s.key} depends on unknown stages {missing}")

    def run_one(stage: Stage) -> Any:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        with ledger.span(stage.span, **stage.attrs) as attrs:
            return stage.fn(results, attrs)

    if not parallel:
        for stage in stages:
            results[stage.key] = run_one(stage)
        return results

    done: queue.Queue[tuple[str, Any, BaseException | None]] = queue.Queue()
    pending = {s.key: s for s in stages}
    running: set[str] = set()

    def worker(stage: Stage) -> None:
        try:
            done.put((stage.key, run_one(stage), None))
        except BaseException as exc:  # handed to the main thread
            done.put((stage.key, None, exc))

    error: BaseException | None = None
    while (pending and error is None) or running:
        for key, stage in list(pending.items()):
            if error is None and all(d in results for d in stage.deps):
                del pending[key]
                running.add(key)
                threading.Thread(
                    target=worker, args=(stage,), name=f"init-{key}", daemon=True
                ).start()
        if not running:
            raise RuntimeError(f"init stages cannot start: {sorted(pending)}")
        while True:
            try:
                key, value, exc = done.get(timeout=0.5)  # a timeout lets signals through
                break
            except queue.Empty:
                continue
        running.discard(key)
        if exc is not None and error is None:
            error = exc
            if running:
                log.warning("init stage %s failed; waiting for %s to finish", key, sorted(running))
        elif exc is None:
            results[key] = value
    if error is not None:
        raise error
    return results
