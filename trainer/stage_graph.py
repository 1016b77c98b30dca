"""A tiny dependency-graph runner for init sub-stages: each stage a ledger span, run one after
another or each on its own thread as soon as the stages it needs are done."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Span

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One init sub-stage: ``fn(attrs)`` runs inside the ledger span ``span`` (no span when
    None); ``attrs`` collects extra attributes written with the span. ``binds_device``: its
    thread makes the CUDA device current first (False: a standby parked host-side, before
    its promotion, must not create a CUDA context)."""

    key: str
    span: Span | None
    fn: Callable[[dict[str, Any]], None]
    deps: tuple[str, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    binds_device: bool = True


def run_stages(
    stages: list[Stage],
    ledger: Ledger,
    parallel: bool,
    device: torch.device | None = None,
    done: Iterable[str] = (),
) -> set[str]:
    """Run the stages (list order must be a valid serial order); ``done`` are stages that
    already ran. Returns the keys of every finished stage.

    Parallel: each stage starts on its own thread once its deps are done. After an error no
    stage starts; the running ones are waited for (a thread still inside torch at exit can
    abort the interpreter, losing the exit code), then the first error is raised.
    """
    finished = set(done)
    known = finished | {s.key for s in stages}
    for s in stages:
        missing = [d for d in s.deps if d not in known]
        if missing:
            raise ValueError(f"stage {s.key} depends on unknown stages {missing}")

    def run_one(stage: Stage) -> None:
        if device is not None and device.type == "cuda" and stage.binds_device:
            torch.cuda.set_device(device)  # the current device is per thread
        if stage.span is None:
            stage.fn(dict(stage.attrs))
            return
        with ledger.span(stage.span, **stage.attrs) as attrs:
            stage.fn(attrs)

    if not parallel:
        for stage in stages:
            run_one(stage)
            finished.add(stage.key)
        return finished

    results: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()
    pending = {s.key: s for s in stages}
    running: set[str] = set()

    def worker(stage: Stage) -> None:
        try:
            run_one(stage)
            results.put((stage.key, None))
        except BaseException as exc:  # handed to the main thread
            results.put((stage.key, exc))

    error: BaseException | None = None
    while (pending and error is None) or running:
        for key, stage in list(pending.items()):
            if error is None and all(d in finished for d in stage.deps):
                del pending[key]
                running.add(key)
                name = f"init-{key}"
                threading.Thread(target=worker, args=(stage,), name=name, daemon=True).start()
        if not running:
            raise RuntimeError(f"init stages cannot start: {sorted(pending)}")
        while True:
            try:
                key, exc = results.get(timeout=0.5)  # a timeout lets signals through
                break
            except queue.Empty:
                continue
        running.discard(key)
        if exc is not None and error is None:
            error = exc
            if running:
                log.warning("init stage %s failed; waiting for %s to finish", key, sorted(running))
        elif exc is None:
            finished.add(key)
    if error is not None:
        raise error
    return finished
