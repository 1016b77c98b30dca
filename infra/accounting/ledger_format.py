"""The ETT ledger's vocabulary and on-storage format: what a line says, how it is written and
read back, and how files and their segments are named. The writer (infra/accounting/ledger.py)
and the reader (infra/accounting/ledger_read.py) share it; nothing else spells it.

Line format (version 2)::

    {"v": 2, "kind": "mark", "name": "clock", "t": 0.5, "mono": 80.5, "attempt": 0,
     "rank": 0, "attrs": {"host": "node-1", "boot": "...", "pid": 4711}}
    {"v": 2, "kind": "span", "name": "train_step", "start": 1.0, "end": 2.0,
     "mono": [81.0, 82.0], "attempt": 0, "rank": 0, "step": 7, "attrs": {...}}
    {"v": 2, "kind": "mark", "name": "failure", "t": 3.0, "mono": 83.0, "attempt": 0,
     "rank": 0, "step": 7, "attrs": {"cause": "sigkill"}}

Times are Unix seconds (the process's wall clock, ``infra.accounting.clocks.wall``) so spans
written by different processes of one job (the orchestrator and the ranks) share a clock;
``mono`` holds the monotonic clock's reading of each, and the first line of every file
(``clock``) names the process and its host. The reader checks the two clocks against each
other and across processes before anything is computed from them (infra/accounting/clocks.py).
Version 1 lines (no ``mono``, no ``clock`` line) are still read.

Files, one per process: ``<job>/ledger/<role>-attempt<NNN>-rank<NNN>.jsonl``; on object
storage each is a folder of segments named by their byte offset, the last one ``.final``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

log = logging.getLogger(__name__)


class Span(StrEnum):
    """Span names: the closed vocabulary of timed work (docs/ett.md). A ``StrEnum``, so a
    name read back from a ledger file compares equal to its member."""

    # the job, around the trainer
    SCHEDULING = "scheduling"
    LAUNCHER_INIT = "launcher_init"
    SHUTDOWN = "shutdown"
    # trainer init sub-stages
    DEVICE_INIT = "device_init"
    PROCESS_GROUP_INIT = "process_group_init"
    PREPROC_CREATION = "preproc_creation"
    MODEL_BUILD = "model_build"  # the model with nothing on a device yet, its sharding plan
    TRAIN_MODULE_CREATION = "train_module_creation"
    INIT_PLUGINS = "init_plugins"
    PRE_TRAIN = "pre_train"
    GET_FIRST_BATCH_DATA = "get_first_batch_data"
    COMPILE = "compile"
    # the training loop
    TRAIN_STEP = "train_step"
    CHECKPOINT_BLOCKING = "checkpoint_blocking"
    MEMORY_COPY_BLOCKING = "memory_copy_blocking"  # the loop waiting for an in-memory copy
    EVAL = "eval"
    # the side evaluator (trainer/checkpoint_evaluator.py), beside the job
    ASYNC_EVAL = "async_eval"
    # work moved off the training job, in its own files
    PUBLISH_LOAD = "publish_load"
    PUBLISH_EXPORT = "publish_export"
    PUBLISH_VALIDATE = "publish_validate"
    PUBLISH_REGISTER = "publish_register"


class Mark(StrEnum):
    """Mark names: the closed vocabulary of instants."""

    ATTEMPT_START = "attempt_start"
    STANDBY_READY = "standby_ready"  # a warm standby finished its init and parked
    PROMOTED = "promoted"  # ...and was promoted: the job's time for it starts here
    STANDBY_LOST = "standby_lost"  # ...or died before it was needed (the orchestrator saw it)
    IN_PROCESS_RESTART = "in_process_restart"  # an exception in a step, recovered in place
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # the interval chosen, and why
    FAILURE = "failure"
    RESUME = "resume"  # training state loaded: from which checkpoint, and what was skipped
    RESIZE = "resize"  # ...written by another number of ranks than this attempt's: resharded
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    MEMORY_COPY = "memory_copy"  # an in-memory copy written (in the background): its size, time
    ANCHOR_COMMITTED = "anchor_committed"
    RECOMPILE = "recompile"
    MODEL_FLOPS = "model_flops"  # the device and dtype a step's ``flops`` attr ran on (MFU)
    JOB_END = "job_end"
    # Made by the reader, never written: this file's writer neither sealed it nor had its
    # spool recovered, so events after this instant (its last one) may be missing.
    LEDGER_INCOMPLETE = "ledger_incomplete"
    # The first line of every file: its process and clock (infra/accounting/clocks.py). Consumed by
    # the reader, never passed on as an event.
    CLOCK = "clock"


class ResumeHow(StrEnum):
    """How a restore of training state came about: the ``how`` of a ``resume`` mark."""

    COLD = "cold"  # a new attempt, started cold
    PROMOTED = "promoted"  # a warm standby, promoted
    IN_PROCESS = "in_process"  # a living attempt, after an in-process restart


class CheckpointTier(StrEnum):
    """Where a copy of the training state lives: a ``resume`` mark's ``tier`` (older ledgers
    have none: durable) and a ``checkpoint_interval`` mark's."""

    DURABLE = "durable"  # committed checkpoints on the job's storage
    MEMORY = "memory"  # this host's shared memory (trainer/checkpoint/memory_tier.py)


JOB_SPANS = (Span.SCHEDULING, Span.LAUNCHER_INIT, Span.SHUTDOWN)
INIT_SPANS = (
    Span.DEVICE_INIT,
    Span.PROCESS_GROUP_INIT,
    Span.PREPROC_CREATION,
    Span.MODEL_BUILD,
    Span.TRAIN_MODULE_CREATION,
    Span.INIT_PLUGINS,
    Span.PRE_TRAIN,
    Span.GET_FIRST_BATCH_DATA,
)
LOOP_SPANS = (Span.TRAIN_STEP, Span.CHECKPOINT_BLOCKING, Span.MEMORY_COPY_BLOCKING, Span.EVAL)
PUBLISH_SPANS = tuple(span for span in Span if span.startswith("publish_"))  # publish/ writes
SPAN_NAMES = frozenset(Span)
MARK_NAMES = frozenset(Mark)


@dataclass(frozen=True)
class Event:
    """One ledger line. Spans have start < end; marks have start == end == t."""

    kind: str
    name: str
    start: float
    end: float
    attempt: int
    rank: int
    step: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    # Where it was read from: the monotonic readings of its times, its file and line.
    mono: tuple[float, float] | None = field(default=None, compare=False, repr=False)
    source: str = field(default="", compare=False, repr=False)
    seq: int = field(default=0, compare=False, repr=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


# For attrs that are not plain scalars (lists, dicts, paths...).
_ATTRS_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def _json_value(value: Any) -> str:
    """Plain scalars are formatted directly: JSONEncoder.encode builds an encoder per call,
    which dominated the cost of a step's span (the trainer records the loss with each)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else ("true" if value else "false")
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return encode_basestring_ascii(value)
    return _ATTRS_ENCODER.encode(value)


def _attrs_json(attrs: dict[str, Any]) -> str:
    fields = (f"{encode_basestring_ascii(str(k))}:{_json_value(v)}" for k, v in attrs.items())
    return "{" + ",".join(fields) + "}"


VERSION = 2


def encode_line(
    kind: str,
    name: str,
    times: str,
    attempt: int,
    rank: int,
    step: int | None,
    attrs: dict[str, Any],
) -> bytes:
    """One event line. The fixed fields are formatted directly (names come from the closed
    vocabulary, numbers are finite): on the step path this costs a third of json.dumps."""
    step_field = "" if step is None else f',"step":{int(step)}'
    attrs_field = f',"attrs":{_attrs_json(attrs)}' if attrs else ""
    return (
        f'{{"v":{VERSION},"kind":"{kind}","name":"{name}",{times},"attempt":{attempt},'
        f'"rank":{rank}{step_field}{attrs_field}}}\n'
    ).encode()


def encode_time(value: float) -> str:
    """A JSON number for a clock reading (repr keeps every digit of the float)."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"ledger times must be finite, got {value!r}")
    return repr(value)


def file_name(attempt: int, rank: int, role: str) -> str:
    return f"{role}-attempt{attempt:03d}-rank{rank:03d}.jsonl"


FILE_NAME = re.compile(r"^(?P<role>[a-z_]+)-attempt(?P<attempt>\d+)-rank(?P<rank>\d+)\.jsonl$")

# -- object storage: segments ---------------------------------------------------------------
FINAL = ".final"  # the suffix of the segment that seals a file
SEGMENT_NAME = re.compile(r"^(?P<offset>\d{12})(?P<final>\.final)?$")


def segment_name(offset: int, final: bool) -> str:
    return f"{offset:012d}{FINAL if final else ''}"


def parse_lines(text: str, source: str = "<ledger>", name: str = "") -> list[Event]:
    """Parse ledger lines, skipping (and logging) torn or malformed ones. ``name`` (the
    file's name) becomes each event's ``source``, with its line number as ``seq``."""
    events: list[Event] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            mono = rec.get("mono")
            if rec["kind"] == "span":
                start, end = float(rec["start"]), float(rec["end"])
                mono = None if mono is None else (float(mono[0]), float(mono[1]))
            else:
                start = end = float(rec["t"])
                mono = None if mono is None else (float(mono), float(mono))
            events.append(
                Event(
                    kind=rec["kind"],
                    name=rec["name"],
                    start=start,
                    end=end,
                    attempt=int(rec.get("attempt", 0)),
                    rank=int(rec.get("rank", 0)),
                    step=rec.get("step"),
                    attrs=rec.get("attrs") or {},
                    mono=mono,
                    source=name,
                    seq=lineno - 1,
                )
            )
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("skipping unreadable ledger line %s:%d (torn write?)", source, lineno)
    return events
