"""Why a first job starts slowly, in one line: its cold compile, and what the next job takes.

The first job under a storage root finds the shared compile cache empty (trainer/
compile_cache.py): its rank 0 compiles cold, tens of seconds on a CPU, most of its Time to
Start and a large share of a short job's wall time, so a first ``make demo`` reports a low
ETT% without saying why. When the first attempt's compile missed the cache and is at least
half of Time to Start (``DOMINANT_SHARE``), ``ColdStart.describe`` says so, and what a job
starting now would take:

    next start ~= Time to Start - cold compile + warm compile

where each compile is the ``compile`` span of rank 0 plus its cache load (the
``compile_cache_load`` stage): the warm one as measured in this same job, by a later attempt
or standby that loaded the cache the first attempt saved (the fastest of them); in a job
that never loaded it, ``WARM_SHARE`` of the cold one (the README's headline run measured a
warm compile at 0.09x the cold one).
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.accounting.ledger_format import Event, Span

DOMINANT_SHARE = 0.5  # a cold compile this share of Time to Start or more is what to explain
WARM_SHARE = 0.09  # warm compile / cold compile when no warm start was measured (README)
CACHE_LOAD = "compile_cache_load"  # the pre_train stage that loads the shared cache


@dataclass(frozen=True)
class ColdStart:
    """A first attempt that compiled cold, and the warm compile that follows it."""

    time_to_start_s: float
    cold_compile_s: float
    warm_compile_s: float
    warm_measured_on: int | None  # the attempt whose warm compile was measured; None: estimate
    cache_url: str

    @property
    def next_start_s(self) -> float:
        return max(0.0, self.time_to_start_s - self.cold_compile_s + self.warm_compile_s)

    def describe(self) -> str:
        how = (
            f"its warm compile took {self.warm_compile_s:.1f} s in attempt {self.warm_measured_on}"
            if self.warm_measured_on is not None
            else f"a warm compile is ~{WARM_SHARE:.0%} of a cold one"
        )
        return (
            f"cold compile {self.cold_compile_s:.1f} s of Time to Start "
            f"{self.time_to_start_s:.1f} s; the compile cache under "
            f"{self.cache_url.removeprefix('file://')} is now "
            f"warm: the next job starts in ~{self.next_start_s:.0f} s ({how})"
        )


@dataclass
class _Compile:
    seconds: float = 0.0
    status: str | None = None  # the cache load's: hit, miss, off...
    cache_url: str | None = None


def _compiles(events: tuple[Event, ...] | list[Event]) -> dict[int, _Compile]:
    """Per attempt, rank 0's compile (span + cache load) and its cache load's status."""
    found: dict[int, _Compile] = {}
    for e in events:
        if e.rank != 0 or e.kind != "span":
            continue
        if e.name == Span.COMPILE:
            found.setdefault(e.attempt, _Compile()).seconds += e.duration
        elif e.name == Span.PRE_TRAIN and e.attrs.get("stage") == CACHE_LOAD:
            c = found.setdefault(e.attempt, _Compile())
            c.seconds += e.duration
            c.status, c.cache_url = e.attrs.get("cache_status"), e.attrs.get("cache_url")
    return {a: c for a, c in found.items() if c.status is not None}


def cold_start(
    events: tuple[Event, ...] | list[Event], time_to_start_s: float | None, cache_url: str
) -> ColdStart | None:
    """The job's cold start when a cold compile is most of its Time to Start, else None
    (``cache_url``: where the cache is, when the ledger does not say)."""
    compiles = _compiles(events)
    if not compiles or not time_to_start_s:
        return None
    first = min(compiles)
    cold = compiles[first]
    if cold.status != "miss" or cold.seconds < DOMINANT_SHARE * time_to_start_s:
        return None
    warm = [(c.seconds, a) for a, c in compiles.items() if a > first and c.status == "hit"]
    warm_s, measured_on = min(warm) if warm else (WARM_SHARE * cold.seconds, None)
    url = cold.cache_url or cache_url
    return ColdStart(time_to_start_s, cold.seconds, warm_s, measured_on, url)
