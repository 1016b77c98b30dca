"""Measured offsets between hosts' clocks: what a process records of its host's offset to the
job's reference clock, and the one correction each host gets from them (rule 5 of
infra/accounting/clocks.py, which states the rule; this module holds its parts).

A node run measures, at rendezvous, how far its host's wall clock is from the orchestrator's
(``infra/clock_sync.py``) and hands the result to the processes it starts in
``ETT_CLOCK_OFFSET``; each writes it into its ledger file's ``clock`` line as
``measured_offset``. Both hold one JSON object::

    {"reference": "orch-1/3f2a...", "offset_s": -5.0012, "error_s": 0.0004}

``offset_s`` is the reference's time minus this host's at the same instant (a host whose clock
runs 5 s ahead measures -5.0): its events are moved by it. ``error_s`` bounds it: the true
offset lies within ``offset_s`` +- ``error_s`` (half the round trip of the best sample).
``reference`` is the clock domain (``host/boot``, ``clocks.domain_of``) that answered.
A malformed value is ignored with a warning: it never stops a process from training.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

ENV_OFFSET = "ETT_CLOCK_OFFSET"  # set by whoever measured, for the processes it starts
CLOCK_ATTR = "measured_offset"  # the ``clock`` line's attribute holding it


@dataclass(frozen=True)
class ClockSample:
    """One measurement of this host's clock against ``reference``'s (module docstring)."""

    reference: str
    offset_s: float
    error_s: float

    @classmethod
    def parse(cls, value: Any) -> ClockSample:
        """From the JSON object (or its text); ValueError when it is not one."""
        try:
            data = json.loads(value) if isinstance(value, str | bytes) else value
            reference, numbers = data["reference"], (data["offset_s"], data["error_s"])
            if any(isinstance(x, bool) or not isinstance(x, int | float) for x in numbers):
                raise TypeError("offset_s and error_s must be numbers")
            offset, error = float(numbers[0]), float(numbers[1])
        except (ValueError, TypeError, KeyError, OverflowError) as exc:
            raise ValueError(f"not a measured clock offset ({exc}): {value!r}") from exc
        if not isinstance(reference, str) or not reference:
            raise ValueError(f"a measured clock offset names no reference: {value!r}")
        if not (math.isfinite(offset) and math.isfinite(error) and error >= 0):
            raise ValueError(f"a measured clock offset out of range: {value!r}")
        return cls(reference, offset, error)

    def env(self) -> dict[str, str]:
        """The environment that hands this measurement to a process's ledger."""
        return {ENV_OFFSET: json.dumps(asdict(self))}


def clock_attrs(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """What a ledger's ``clock`` line says of its host's measured offset: nothing when none
    was handed in, or when the value is malformed (said, once per ledger file)."""
    text = environ.get(ENV_OFFSET)
    if not text:
        return {}
    try:
        return {CLOCK_ATTR: asdict(ClockSample.parse(text))}
    except Exception as exc:  # noqa: BLE001 - a bad value must never stop a process training
        log.warning("%s ignored, this ledger's host is not corrected: %s", ENV_OFFSET, exc)
        return {}


def from_clock_attrs(attrs: Mapping[str, Any], source: str) -> ClockSample | None:
    """The measurement a ``clock`` line carries, if any (a malformed one is said, and not
    used)."""
    value = attrs.get(CLOCK_ATTR)
    if value is None:
        return None
    try:
        return ClockSample.parse(value)
    except ValueError as exc:
        log.warning("ledger %s: %s; its host is not corrected by it", source, exc)
        return None


def chosen(measured: Iterable[tuple[str, ClockSample, float]]) -> dict[str, ClockSample]:
    """One measurement per host, from (domain, sample, rule-4 shift of its ledger file).

    A file's sample was taken against its own wall clock; rule 4 moves the file by its shift
    onto the host's newest process's, so the sample is re-expressed as ``offset_s - shift``.
    Then every sample of a host estimates the same quantity, and the one with the smallest
    error wins (the most precise; the most recent would be no truer, as rule 4 already put
    all of them on one clock; on a tie, the first file's). A sample against the host's own
    clock says nothing: skipped.
    """
    best: dict[str, ClockSample] = {}
    for domain, sample, shift in measured:
        if sample.reference == domain:
            continue
        sample = replace(sample, offset_s=sample.offset_s - shift)
        if domain not in best or sample.error_s < best[domain].error_s:
            best[domain] = sample
    return best


def host_shifts(
    measured: Mapping[str, ClockSample], bounds: Mapping[str, float]
) -> dict[str, float]:
    """How far each corrected host's events move: a measured host onto its reference's
    clock, plus whatever moves that reference in turn (a chain ends at a host without a
    measurement; a cycle, which no job should write, ends where it closes); a host with only
    a bound (``ahead``) back by it."""

    def shift(domain: str, seen: frozenset[str]) -> float:
        if domain in seen:
            return 0.0
        if (m := measured.get(domain)) is not None:
            return m.offset_s + shift(m.reference, seen | {domain})
        return -bounds.get(domain, 0.0)

    return {d: shift(d, frozenset()) for d in {*measured, *bounds}}
