"""How a measured job's costs change with the number of GPUs: the projection's assumptions.

One place for every scale-out assumption of ``ett simulate`` (``ScalingLaws``), printed with
every projection by ``describe``. Only arithmetic here, so the CLI can read the defaults
without loading the simulator.

The default failure rate is anchored on Llama 3 405B pre-training: 419 unexpected
interruptions in 54 days on 16,384 H100 GPUs, i.e. 419 / (54 x 16,384) = 4.74e-4 failures per
GPU-day (one per ~2,100 GPU-days; at 16,384 GPUs one every ~3.1 h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
      collectives); the default 0.05 s per node adds ~100 s per restart at 2,048 nodes. Set it
      from two measured restart times at different sizes when you have them.
    - Failure kind at scale: an unexpected interruption loses the work since the last committed
      checkpoint and costs the measured job's mean restart over its unplanned failures.
    """

    failures_per_gpu_day: float = LLAMA3_FAILURES_PER_GPU_DAY
    gpus_per_node: int = 8
    rendezvous_s_per_node: float = 0.05
    measured_nodes: int = 1

    def __post_init__(self) -> None:
        if not self.failures_per_gpu_day > 0:
            raise ValueError(f"failures per GPU-day must be > 0, got {self.failures_per_gpu_day}")
        if self.gpus_per_node < 1 or self.measured_nodes < 1:
            raise ValueError("GPUs per node and measured nodes must be at least 1")
        if self.rendezvous_s_per_node < 0:
            raise ValueError(
                f"rendezvous s per node must be >= 0, got {self.rendezvous_s_per_node}"
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
            "one store: linear in nodes)",
            "failures at scale: unexpected interruptions; each loses the work since the last "
            "committed checkpoint and costs the measured mean restart of unplanned failures",
            "checkpoint interval: the advisor's at each N (Young's sqrt(2 C MTBF), raised to the "
            "upload time)",
        ]
