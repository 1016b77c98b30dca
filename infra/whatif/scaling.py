"""How a measured job's costs change with the number of GPUs: the projection's assumptions.

One place for every scale-out assumption of ``ett simulate`` (``ScalingLaws``), printed with
every projection by ``describe``. Only arithmetic here, so the CLI can read the defaults
without loading the simulator.

The default failure rate is anchored on Llama 3 405B pre-training: 419 unexpected
interruptions in 54 days on 16,384 H100 GPUs, i.e. 419 / (54 x 16,384) = 4.74e-4 failures per
GPU-day (one per ~2,100 GPU-days; at 16,384 GPUs one every ~3.1 h).

The restart-versus-nodes term is assumed (0.05 s per node) unless a ``RestartFit`` of measured
relaunch times gives it (``fit_restart``, ``ScalingLaws.from_fit``; docs/simulate.md says why
the default stays assumed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from infra.whatif.advisor import DAY_S

# The anchor: Llama 3 405B pre-training, 54 days on 16,384 H100s, 419 unexpected interruptions.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_FAILURES_PER_GPU_DAY = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS)
ANCHOR = (
    f"Llama 3 405B pre-training, {LLAMA3_INTERRUPTIONS} unexpected interruptions in "
    f"{LLAMA3_DAYS} days on {LLAMA3_GPUS:,} H100s: {LLAMA3_INTERRUPTIONS} / "
    f"({LLAMA3_DAYS} x {LLAMA3_GPUS:,})"
)

TABLE_GPUS = (8, 64, 512, 4096, 16_384)  # the projection table
MAX_GPUS = 16_384
ASSUMED_RENDEZVOUS_S_PER_NODE = 0.05


@dataclass(frozen=True)
class RestartFit:
    """Restart seconds against nodes, fitted: seconds = intercept_s + slope_s_per_node x nodes.

    Only the slope carries over to a projection: the intercept is the measured job's own
    restart (its model, its machine), which the projected job measures for itself.
    """

    slope_s_per_node: float
    intercept_s: float
    points: tuple[tuple[int, float], ...]
    clamped: bool  # the least-squares slope was negative: held at 0, the intercept the mean
    source: str = "given points"

    def describe(self) -> str:
        nodes = ", ".join(str(n) for n in sorted({n for n, _ in self.points}))
        clamp = " (least squares gave a negative slope: held at 0)" if self.clamped else ""
        return (
            f"fitted to {len(self.points)} measured restarts at {nodes} nodes ({self.source}): "
            f"{self.intercept_s:.3g} s + {self.slope_s_per_node:.3g} s x nodes{clamp}"
        )


def fit_restart(points: Iterable[tuple[int, float]], source: str = "given points") -> RestartFit:
    """Least squares of restart seconds on nodes over ``points`` ((nodes, seconds) pairs), the
    slope clamped at >= 0: a restart never gets cheaper with more nodes, and a negative
    slope from a few noisy points would make the projection reward scale."""
    pts = tuple((int(n), float(s)) for n, s in points)
    bad = [(n, s) for n, s in pts if n < 1 or not s >= 0 or math.isinf(s)]
    if bad:
        raise ValueError(f"restart points need nodes >= 1 and finite seconds >= 0, got {bad}")
    distinct = sorted({n for n, _ in pts})
    if len(distinct) < 2:
        raise ValueError(
            "a restart-versus-nodes fit needs restarts measured at 2 or more distinct node "
            f"counts, got node counts {distinct}"
        )
    mean_n = math.fsum(n for n, _ in pts) / len(pts)
    mean_s = math.fsum(s for _, s in pts) / len(pts)
    sxx = math.fsum((n - mean_n) ** 2 for n, _ in pts)
    sxy = math.fsum((n - mean_n) * (s - mean_s) for n, s in pts)
    slope = sxy / sxx
    if slope < 0:  # the best line with slope 0 is the mean
        return RestartFit(0.0, mean_s, pts, True, source)
    return RestartFit(slope, mean_s - slope * mean_n, pts, False, source)


def read_restart_fit(path: str | Path) -> RestartFit:
    """The fit of a relaunch benchmark's result (benchmarks/bench_relaunch_nodes.py writes
    ``fit_points``: (nodes, median restart seconds) pairs), fitted again here: one fit."""
    path = Path(path)
    try:
        points = json.loads(path.read_text())["fit_points"]
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: no fit_points list of [nodes, seconds] ({exc})") from None
    return fit_restart(((n, s) for n, s in points), source=str(path))


@dataclass(frozen=True)
class ScalingLaws:
    """How a measured job's costs change with the number of GPUs: every assumption, here.

    - Failures: each GPU fails independently at ``failures_per_gpu_day`` and any failure stops
      the synchronous job, so the job's rate grows linearly with N (MTBF = 1 / (rate x N)).
    - Blocking per checkpoint, upload (commit latency), step time, eval/other overhead: flat.
      Checkpoints are sharded (each rank saves and uploads its own shard of a fixed size, in
      parallel, to storage whose bandwidth grows with its writers) and the work per GPU is
      fixed (weak scaling).
    - Restart and first start: the measured cost plus ``rendezvous_s_per_node`` for every node
      beyond the measured ones. Linear in nodes because a c10d rendezvous admits every agent
      through one store and the process group exchanges each peer's address through it: that
      is O(nodes) work on one host. Linear is the pessimistic choice next to a log term (tree
      collectives); the default 0.05 s per node adds ~100 s per restart at 2,048 nodes. It is
      assumed: ``from_fit`` sets it from measured relaunches instead (``restart_fit`` keeps
      where it came from), and docs/simulate.md says why the default is not this machine's fit.
    - Failure kind at scale: an unexpected interruption loses the work since the last committed
      checkpoint and costs the measured job's mean restart over its unplanned failures.
    """

    failures_per_gpu_day: float = LLAMA3_FAILURES_PER_GPU_DAY
    gpus_per_node: int = 8
    rendezvous_s_per_node: float = ASSUMED_RENDEZVOUS_S_PER_NODE
    measured_nodes: int = 1
    restart_fit: RestartFit | None = field(default=None, compare=False)

    @classmethod
    def from_fit(cls, fit: RestartFit, base: ScalingLaws | None = None) -> ScalingLaws:
        """``base`` (the defaults if None) with the per-node restart term the fit's slope."""
        return replace(base or cls(), rendezvous_s_per_node=fit.slope_s_per_node, restart_fit=fit)

    def __post_init__(self) -> None:
        if not self.failures_per_gpu_day > 0:
            raise ValueError(f"failures per GPU-day must be > 0, got {self.failures_per_gpu_day}")
        if self.gpus_per_node < 1 or self.measured_nodes < 1:
            raise ValueError("GPUs per node and measured nodes must be at least 1")
        if self.rendezvous_s_per_node < 0:
            raise ValueError(
                f"rendezvous s per node must be >= 0, got {self.rendezvous_s_per_node}"
            )
        fit = self.restart_fit
        if fit is not None and fit.slope_s_per_node != self.rendezvous_s_per_node:
            raise ValueError(
                f"rendezvous s per node {self.rendezvous_s_per_node:g} is not its fit's slope "
                f"{fit.slope_s_per_node:g}: build the laws with ScalingLaws.from_fit"
            )

    def nodes(self, gpus: int) -> int:
        return math.ceil(gpus / self.gpus_per_node)

    def failures_per_day(self, gpus: int) -> float:
        return self.failures_per_gpu_day * gpus

    def mtbf_s(self, gpus: int) -> float:
        return DAY_S / self.failures_per_day(gpus)

    def rendezvous_extra_s(self, gpus: int) -> float:
        """Added to every restart and to the first start at ``gpus`` GPUs."""
        return self.rendezvous_s_per_node * max(0, self.nodes(gpus) - self.measured_nodes)

    def rendezvous_source(self) -> str:
        """Where the per-node restart term came from: fitted, given, or the assumed default."""
        if self.restart_fit is not None:
            return self.restart_fit.describe()
        if math.isclose(self.rendezvous_s_per_node, ASSUMED_RENDEZVOUS_S_PER_NODE):
            return "assumed, not measured (docs/simulate.md: the restart term)"
        return "given with --rendezvous-s-per-node"

    def describe(self) -> list[str]:
        """The assumptions as printed with every projection."""
        anchored = math.isclose(self.failures_per_gpu_day, LLAMA3_FAILURES_PER_GPU_DAY)
        source = ANCHOR if anchored else "given with --failures-per-gpu-day"
        return [
            f"failures: {self.failures_per_gpu_day:.3g} per GPU-day (one per "
            f"{1 / self.failures_per_gpu_day:,.0f} GPU-days) x N: any GPU's failure stops the "
            f"job. Rate: {source}",
            "blocking per checkpoint, upload time: flat in N (sharded checkpoints: each rank "
            "saves and uploads its own shard, in parallel)",
            "step time, eval/other overhead: flat in N (weak scaling: fixed work per GPU)",
            f"restart and first start: measured + {self.rendezvous_s_per_node:g} s x (nodes - "
            f"{self.measured_nodes}), nodes = ceil(N / {self.gpus_per_node}) (rendezvous through "
            f"one store: linear in nodes). Per-node term: {self.rendezvous_source()}",
            "failures at scale: unexpected interruptions; each loses the work since the last "
            "committed checkpoint and costs the measured mean restart of unplanned failures",
            "checkpoint interval: the advisor's at each N (Young's sqrt(2 C MTBF), raised to the "
            "upload time)",
        ]
