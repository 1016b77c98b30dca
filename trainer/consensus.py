"""What every rank must decide alike, agreed without a barrier on the training loop's hot path.

Decisions that depend on things one rank alone sees: a preemption (the SIGTERM may reach some
ranks only) and a checkpoint or in-memory copy chosen by the clock (``every_steps: auto`` or
``every_seconds``: each rank's clock and measurements differ). A rank that checkpoints
alone, or stops alone, blocks the others in a collective. So each step every rank posts a
non-blocking all-reduce (MAX) of its flags on a CPU group and reads the result posted one
step earlier, which has long arrived: the host never waits for the slowest rank here, and
all ranks act on the same step, one step after the flag was raised. Only rank 0's clock asks
for checkpoints and copies.

``train.step_consensus: blocking`` waits for each step's all-reduce instead (ranks act on the
same step the flag was raised): the reference that ``benchmarks/bench_throughput.py
--variants default,blocking_consensus`` measures the deferred exchange against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on at this step boundary."""

    preempt: bool = False
    checkpoint: bool = False
    memory: bool = False  # an in-memory copy (trainer/checkpoint/memory_tier.py)


class StepConsensus:
    """One per attempt and training thread; ``exchange`` once per step, on every rank."""

    def __init__(
        self, world_size: int, group: dist.ProcessGroup | None, blocking: bool = False
    ) -> None:
        self.world_size, self.group, self.blocking = world_size, group, blocking
        self._flags: torch.Tensor | None = None
        self._work: Any = None

    def exchange(self, preempt: bool, checkpoint: bool, memory: bool = False) -> Agreed:
        """Post this rank's flags; return what every rank posted at the previous step."""
        if self.world_size == 1:
            return Agreed(preempt, checkpoint, memory)
        posted = [int(preempt), int(checkpoint), int(memory)]
        if self.blocking:
            flags = torch.tensor(posted, dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            return Agreed(bool(flags[0]), bool(flags[1]), bool(flags[2]))
        agreed = Agreed()
        if self._work is not None:
            self._work.wait()
            assert self._flags is not None
            agreed = Agreed(bool(self._flags[0]), bool(self._flags[1]), bool(self._flags[2]))
            self._work = None
        if agreed.preempt:  # every rank stops here: nothing more to post
            return agreed
        self._flags = torch.tensor(posted, dtype=torch.int32)
        self._work = dist.all_reduce(
            self._flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return agreed
