"""Closed forms of training between committed checkpoints, and the long-run waste they give.

Cycles of training are: train tau (times 1 + q for eval and gaps), wait for the previous upload
when it outlasts that (not in the first cycle), block C; a checkpoint commits when its upload
ends, U after its blocking. A failure keeps only the committed progress. ``sweep`` draws
exponential failure gaps and measures the wasted fraction of wall time per interval: every
restart from a committed checkpoint starts afresh, so each gap is an independent renewal
cycle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def segment(
    y: float | np.ndarray,
    tau: float,
    c: float,
    u: float = 0.0,
    q: float = 0.0,
    phase: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training for ``y`` wall seconds from a committed state until a failure (y may be an array).

    Cycles are: train tau*(1+q), wait w = max(0, u - tau*(1+q)) for the previous upload (not in
    the first cycle), block c; checkpoint k ends blocking at k*L - w and commits u later.
    Checkpoints fall at multiples of tau of the job's progress, so a job resumed ``phase``
    past one (after a preemption's exit save) reaches its first checkpoint sooner.
    Returns (committed progress, training wall, blocking wall incl. upload waits).
    """
    a = tau * (1.0 + q)
    ahead = phase * (1.0 + q)  # the first cycle, already trained
    y = np.asarray(y) + ahead
    w = max(0.0, u - a)
    big_l = a + w + c
    # A failure the instant a save ends (a measured one, placed at the save's end) comes
    # after it: the tolerance (a microsecond) keeps rounding from moving it back one cycle.
    late = y + max(1e-9 * big_l, 1e-6)
    m = np.floor((late + w) / big_l)
    start = np.where(m >= 1, m * big_l - w, 0.0)
    r = y - start
    train = m * a + np.minimum(r, a) - ahead
    # Partial cycle: whatever of r is past its training is upload wait + blocking.
    block = m * c + np.maximum(m - 1, 0) * w + np.clip(r - a, 0.0, None)
    n = np.clip(np.minimum(m, np.floor((late + w - u) / big_l)), 0, None)
    return np.maximum(n * tau - phase, 0.0), train, block


def _wall(progress: float, k: int, tau: float, c: float, u: float, q: float) -> float:
    """Wall time for ``progress`` of training with ``k`` checkpoints on the way."""
    w = max(0.0, u - tau * (1.0 + q))
    return progress * (1.0 + q) + k * c + max(0, k - 1) * w


def time_to_finish(
    remaining: float, tau: float, c: float, u: float = 0.0, q: float = 0.0, phase: float = 0.0
) -> float:
    """Wall time to make ``remaining`` progress without a failure (no checkpoint at the end)."""
    if remaining <= 0:
        return 0.0
    k = max(0, math.ceil((remaining + phase) / tau - 1e-12) - 1)
    return _wall(remaining, k, tau, c, u, q)


def time_to_reach(
    progress: float, tau: float, c: float, u: float = 0.0, q: float = 0.0, phase: float = 0.0
) -> float:
    """Wall time from a committed state to ``progress``, the checkpoints due up to it included."""
    k = max(0, math.floor((progress + phase) / tau + 1e-9))
    return _wall(progress, k, tau, c, u, q)


def _waste(gaps: np.ndarray, tau: float, c: float, u: float, restart_s: float) -> float:
    done, _, _ = segment(np.maximum(gaps - restart_s, 0.0), tau, c, u)
    return float(1.0 - done.sum() / gaps.sum())


def sweep(
    intervals: Iterable[float],
    blocking_s: float,
    mtbf_s: float,
    upload_s: float = 0.0,
    restart_s: float = 0.0,
    n_failures: int = 100_000,
    seed: int = 0,
) -> list[tuple[float, float]]:
    """(interval, steady-state waste) per interval, all on the same failure gaps.

    The waste is 1 - sum(committed) / sum(gaps) over ``n_failures`` exponential gaps (restart
    first, then training from a committed state). The same seed gives the same gaps for every
    interval (common random numbers), so the intervals are compared on one draw.
    """
    gaps = np.random.default_rng(seed).exponential(mtbf_s, n_failures)
    return [(i, _waste(gaps, i, blocking_s, upload_s, restart_s)) for i in intervals]
