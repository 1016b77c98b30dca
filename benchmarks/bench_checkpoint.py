"""What a checkpoint costs the training loop: blocking time per mode, local disk and S3.

For each state size (a few large fp32 tensors, and the same tensors as TorchRec-style
ShardedTensors in a single-process gloo group) and each target (local disk, S3 on a moto
server started here), the real ``Checkpointer`` is driven as the training loop drives it:

    register(state) once
    t0 = now; save(step); wait_until_staged()   -> blocking (the loop waits)
    wait_for_inflight()                          -> commit (upload included)

for ``sync``, ``async`` and ``async_staged``, several reps each. The physical floor is a raw
in-memory copy of the same tensors into preallocated CPU buffers. The first save of the
async modes allocates the staging buffers (later saves reuse them), so first and
steady-state (median of the later reps) are reported separately. The raw copy is timed
right before every checkpoint rep and the ratio taken rep by rep, as the load of a shared
machine drifts; its "first" includes allocating (page-faulting) the buffers.

    .venv/bin/python benchmarks/bench_checkpoint.py [--sizes 64,512,2048] [--targets local,s3]
        [--variants plain,sharded] [--reps 3] [--quick]

Targets: async_staged blocking <= 1.5x the raw copy, and <= 10% of sync-to-S3 blocking.
Prints a markdown table and writes benchmarks/results/checkpoint.json. Memory at 2 GB: the
state, one staging copy (or the raw-copy buffers, freed before the checkpoints run) and
moto's copy of the objects; everything is freed between sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.job_layout import JobLayout

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed._shard.sharded_tensor import (  # noqa: E402
    Shard,
    ShardedTensor,
    ShardMetadata,
    init_from_local_shards,
)

from benchmarks.save import save_json  # noqa: E402
from infra import storage  # noqa: E402
from infra.accounting.ledger import Ledger  # noqa: E402
from infra.accounting.ledger_format import Mark  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.checkpoint_manifest import committed_checkpoints, library_versions  # noqa: E402
from infra.devstack import servers  # noqa: E402
from infra.settings import JobConfig, load_config  # noqa: E402
from tests.factories import HeldState  # noqa: E402
from trainer.checkpoint.checkpointer import Checkpointer  # noqa: E402
from trainer.checkpoint.state import RankState  # noqa: E402

MODES = ("sync", "async", "async_staged")
TENSORS = 4  # the state: this many equal fp32 tensors of shape (rows, 1024)


@dataclass
class Row:
    variant: str  # plain | sharded
    size_mb: int
    target: str  # local | s3 | memory (the raw copy)
    mode: str  # sync | async | async_staged | raw_copy
    first_s: float
    blocking_s: list[float] = field(default_factory=list)  # steady-state reps
    commit_s: list[float] = field(default_factory=list)
    raw_s: list[float] = field(default_factory=list)  # the raw copy timed just before each rep

    @property
    def blocking(self) -> float:
        return statistics.median(self.blocking_s)

    @property
    def x_raw(self) -> float:
        """Blocking over the raw copy, rep by rep (paired: the load here drifts), median."""
        return statistics.median(b / r for b, r in zip(self.blocking_s, self.raw_s, strict=True))

    @property
    def commit(self) -> float | None:
        return statistics.median(self.commit_s) if self.commit_s else None


# -- the state ------------------------------------------------------------------------------
def make_state(size_mb: int, variant: str, pg: dist.ProcessGroup) -> dict[str, Any]:
    """``TENSORS`` fp32 tensors totalling ``size_mb`` MiB, as plain tensors or as
    ShardedTensors with one local shard each (TorchRec's table-wise sharding on one rank)."""
    rows = max(size_mb * 2**20 // (TENSORS * 1024 * 4), 1)
    tables: dict[str, Any] = {}
    for i in range(TENSORS):
        t = torch.empty(rows, 1024).uniform_(-0.1, 0.1)
        if variant == "sharded":
            meta = ShardMetadata([0, 0], [rows, 1024], "rank:0/cpu")
            t = init_from_local_shards([Shard(t, meta)], [rows, 1024], process_group=pg)
        tables[f"table_{i}.weight"] = t
    return {"model": tables}


def local_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in state["model"].values():
        if isinstance(t, ShardedTensor):
            out.extend(shard.tensor for shard in t.local_shards())
        else:
            out.append(t)
    return out


class RawCopy:
    """The floor: copy every tensor of the state into preallocated CPU buffers."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.tensors = local_tensors(state)
        t0 = time.perf_counter()
        self.buffers = [torch.empty_like(t) for t in self.tensors]
        self._copy()
        self.first_s = time.perf_counter() - t0  # allocation (page faults) included

    def _copy(self) -> None:
        for b, t in zip(self.buffers, self.tensors, strict=True):
            b.copy_(t)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self._copy()
        return time.perf_counter() - t0


# -- checkpoints ----------------------------------------------------------------------------
def job_config(root: str, endpoint: str | None, mode: str, job_id: str) -> JobConfig:
    return load_config(
        job_id=job_id,
        storage={"root": root, "s3_endpoint_url": endpoint},
        checkpoint={"mode": mode, "every_steps": 1, "keep_latest_k": 1},
    )


def bench_mode(
    state: dict[str, Any],
    mode: str,
    root: str,
    endpoint: str | None,
    pg: dist.ProcessGroup,
    reps: int,
    scratch: str,
    raw_copy: RawCopy,
) -> tuple[float, list[float], list[float], list[float]]:
    """First blocking time, then steady-state blocking, commit and paired raw-copy times."""
    job_id = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    config = job_config(root, endpoint, mode, job_id)
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{scratch}/ledgers/{job_id}"))  # never on the target
    ckpt = Checkpointer(config, rank=0, world_size=1, ledger=ledger, process_group=pg)
    position = HeldState({})
    tensors = {key: HeldState(part) for key, part in state.items()}
    ckpt.register({**tensors, "loader": RankState(position)})
    blocking, commit, raw = [], [], []
    try:
        for step in range(1, reps + 2):
            raw.append(raw_copy())
            t0 = time.perf_counter()
            position.value = {"epoch": 0, "shard_pos": step}
            ckpt.save(step)
            ckpt.wait_until_staged()  # the training thread may run the next step now
            t1 = time.perf_counter()
            ckpt.wait_for_inflight()
            t2 = time.perf_counter()
            blocking.append(t1 - t0)
            commit.append(t2 - t0)
            found = committed_checkpoints(config.layout)
            if not found or found[0].step != step:
                raise RuntimeError(f"{mode}: the checkpoint at step {step} did not commit")
    finally:
        ckpt.close()
        ledger.close()
        with contextlib.suppress(OSError):
            storage.remove(config.layout.url, recursive=True)
    failed = [
        e
        for e in read_events(JobLayout.at(f"file://{scratch}/ledgers/{job_id}"))
        if e.name == Mark.CHECKPOINT_FAILED
    ]
    if failed:
        raise RuntimeError(f"{mode}: checkpoints failed: {failed}")
    return blocking[0], blocking[1:], commit[1:], raw[1:]


# -- the run --------------------------------------------------------------------------------
@contextlib.contextmanager
def process_group() -> Iterator[dist.ProcessGroup]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(servers.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")  # the trainer's checkpoint group
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def s3_endpoint(state_dir: str) -> Iterator[str]:
    """A moto S3 server on a free loopback port with the bucket ``ett``."""
    os.environ.update(servers.LOCAL_AWS_ENV)
    service = servers.launch("s3", state_dir)
    servers.wait_ready(service)
    try:
        yield service.url
    finally:
        servers.stop([service.pid])


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch, contextlib.ExitStack() as es:
        pg = es.enter_context(process_group())
        # As in the trainer, where these are warm before the first checkpoint: the first
        # manifest would otherwise import torchrec (seconds) inside the first commit.
        library_versions()
        dist.barrier(group=pg)
        endpoint = es.enter_context(s3_endpoint(scratch)) if "s3" in args.targets else None
        roots = {"local": f"file://{scratch}/store", "s3": f"s3://ett/bench-{uuid.uuid4().hex[:8]}"}
        for size in args.sizes:
            for variant in args.variants:
                state = make_state(size, variant, pg)
                raw_copy = RawCopy(state)
                raw_row = Row(variant, size, "memory", "raw_copy", raw_copy.first_s)
                rows.append(raw_row)
                for target in args.targets:
                    for mode in MODES:
                        first, blocking, commit, raw = bench_mode(
                            state,
                            mode,
                            roots[target],
                            endpoint if target == "s3" else None,
                            pg,
                            args.reps,
                            scratch,
                            raw_copy,
                        )
                        row = Row(variant, size, target, mode, first, blocking, commit, raw)
                        rows.append(row)
                        raw_row.blocking_s += raw
                        raw_row.raw_s += raw
                        print(
                            f"  {variant} {size} MB {target} {mode}: blocking "
                            f"{row.blocking:.4f} s ({row.x_raw:.2f}x raw copy), "
                            f"commit {row.commit:.3f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                        gc.collect()
                del state, raw_copy
                gc.collect()
    return rows


# -- reporting ------------------------------------------------------------------------------
def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """The two targets for every (variant, size, target) measured."""
    by = {(r.variant, r.size_mb, r.target, r.mode): r for r in rows}
    out = []
    for r in rows:
        if r.mode != "async_staged":
            continue
        raw = by[(r.variant, r.size_mb, "memory", "raw_copy")]
        sync_s3 = by.get((r.variant, r.size_mb, "s3", "sync"))
        entry: dict[str, Any] = {
            "variant": r.variant,
            "size_mb": r.size_mb,
            "target": r.target,
            "async_staged_blocking_s": r.blocking,
            "raw_copy_s": raw.blocking,
            "x_raw_copy": r.x_raw,
            "x_raw_copy_ok": r.x_raw <= 1.5,
        }
        if sync_s3 is not None:
            entry["share_of_sync_s3"] = r.blocking / sync_s3.blocking
            entry["share_of_sync_s3_ok"] = r.blocking <= 0.10 * sync_s3.blocking
        out.append(entry)
    return out


def table(rows: list[Row]) -> str:
    by = {(r.variant, r.size_mb, r.target, r.mode): r for r in rows}
    lines = [
        "| state | target | mode | blocking first (s) | blocking steady (s) | commit (s) "
        "| × raw copy (paired) | % of sync-to-S3 |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sync_s3 = by.get((r.variant, r.size_mb, "s3", "sync"))
        share = f"{100 * r.blocking / sync_s3.blocking:.1f}%" if sync_s3 else "-"
        commit = f"{r.commit:.3f}" if r.commit is not None else "-"
        lines.append(
            f"| {r.size_mb} MB {r.variant} | {r.target} | {r.mode} | {r.first_s:.4f} "
            f"| {r.blocking:.4f} | {commit} | {r.x_raw:.2f} | {share} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="64,512,2048", help="state sizes in MiB")
    p.add_argument("--targets", default="local,s3")
    p.add_argument("--variants", default="plain,sharded")
    p.add_argument("--reps", type=int, default=3, help="steady-state reps (after the first)")
    p.add_argument("--quick", action="store_true", help="smoke run: 64 MB only")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint.json"))
    args = p.parse_args()
    args.sizes = [64] if args.quick else [int(s) for s in args.sizes.split(",")]
    args.targets = [t for t in args.targets.split(",") if t]
    args.variants = [v for v in args.variants.split(",") if v]
    if args.reps < 3:
        p.error("--reps must be at least 3 (medians)")
    logging.basicConfig(level=logging.WARNING)
    load_before = os.getloadavg()
    started = time.time()
    rows = run(args)
    summary = ratios(rows)
    md = table(rows)
    print(md)
    print()
    for s in summary:
        line = (
            f"{s['size_mb']} MB {s['variant']} {s['target']}: async_staged blocking "
            f"{s['x_raw_copy']:.2f}x raw copy (target <= 1.5x: "
            f"{'ok' if s['x_raw_copy_ok'] else 'MISSED'})"
        )
        if "share_of_sync_s3" in s:
            line += (
                f", {100 * s['share_of_sync_s3']:.1f}% of sync-to-S3 (target <= 10%: "
                f"{'ok' if s['share_of_sync_s3_ok'] else 'MISSED'})"
            )
        print(line)
    result = {
        "config": {
            **vars(args),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "wall_s": round(time.time() - started, 1),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "rows": [
            {
                **asdict(r),
                "blocking_median_s": r.blocking,
                "commit_median_s": r.commit,
                "x_raw_copy": r.x_raw,
            }
            for r in rows
        ],
        "targets": summary,
        "table": md,
    }
    save_json(result, args.out)


if __name__ == "__main__":
    main()
