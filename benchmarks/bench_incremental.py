"""Bytes per durable commit, full against incremental, on embedding tables large enough to
matter (issue 28: >= 5x fewer bytes at the same interval).

The real ``Checkpointer`` commits a state shaped as DistributedModelParallel's on one rank:
``--tables`` table-wise ShardedTensors of ``--rows`` rows in all, ``--dim`` fp32 columns,
each with its exact-Adagrad state (``momentum1``, same shape), plus a small dense part.
Between two commits ``--steps`` training steps each look up ``--batch`` ids per table,
drawn from a Zipf law (``--zipf-a``, the synthetic click model's 1.2) over a random
permutation of the rows; the step tells the checkpointer its KeyedJaggedTensor (what
``train_step`` does) and then changes exactly those rows of the weights and of the
optimizer state, as the fused optimizer would. The same ids, in the same order, are drawn
for both jobs: one with full checkpoints only, one with ``checkpoint.incremental``.

Saves are ``sync`` on local disk: the commit time is the whole save (DCP write, checksums,
manifest), the loop blocked for all of it. How much of that an ``async_staged`` commit
would take from the steps it overlaps is not measured here (no model runs).

    .venv/bin/python benchmarks/bench_incremental.py [--rows 10000000] [--dim 64]
        [--tables 8] [--batch 8192] [--steps 20] [--commits 9] [--full-commits 3]
        [--full-every 8]

Prints a markdown table and writes docs/results/incremental.json. Memory: the state (2 x
rows x dim x 4 bytes: 5.1 GB at 10M x 64) and DCP's write buffers; disk: a full checkpoint
per commit of the full job (each deleted once the next commits, keep_latest_k 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from benchmarks.bench_checkpoint import process_group  # noqa: E402
from benchmarks.save import save_run  # noqa: E402
from infra.accounting.ledger import Ledger  # noqa: E402
from infra.checkpoint_manifest import committed_checkpoints  # noqa: E402
from infra.job_layout import JobLayout  # noqa: E402
from infra.settings import load_config  # noqa: E402
from tests.factories import HeldState  # noqa: E402
from trainer.checkpoint.checkpointer import Checkpointer  # noqa: E402
from trainer.checkpoint.state import RankState  # noqa: E402


def sharded(t: torch.Tensor, pg: dist.ProcessGroup) -> Any:
    meta = ShardMetadata([0, 0], list(t.shape), "rank:0/cpu")
    return init_from_local_shards([Shard(t, meta)], list(t.shape), process_group=pg)


def make_state(rows: list[int], dim: int, pg: dist.ProcessGroup) -> tuple[dict, list, list]:
    """The model and optimizer parts, and each table's weight and state (local tensors)."""
    gen = torch.Generator().manual_seed(0)
    model: dict[str, Any] = {"dense.weight": torch.randn(512, 512, generator=gen)}
    optim: dict[str, Any] = {"dense.weight": {"exp_avg": torch.zeros(512, 512)}}
    weights, states = [], []
    for i, n in enumerate(rows):
        w = torch.empty(n, dim).uniform_(-0.01, 0.01, generator=gen)
        m = torch.zeros(n, dim)
        model[f"emb.t_{i}.weight"] = sharded(w, pg)
        optim[f"emb.t_{i}.weight"] = {f"t_{i}.momentum1": sharded(m, pg)}
        weights.append(w)
        states.append(m)
    return {"model": model, "optim": {"state": optim}}, weights, states


def draws(rows: list[int], batch: int, zipf_a: float, seed: int) -> Iterator[list[np.ndarray]]:
    """Each step's ids per table: Zipf ranks over a random permutation of the rows."""
    rng = np.random.default_rng(seed)
    cdfs, perms = [], []
    for n in rows:
        weights = np.arange(1, n + 1, dtype=np.float64) ** -zipf_a
        cdf = np.cumsum(weights)
        cdfs.append(cdf / cdf[-1])
        perms.append(rng.permutation(n))
    while True:
        yield [
            perm[np.minimum(np.searchsorted(cdf, rng.random(batch), side="right"), cdf.size - 1)]
            for cdf, perm in zip(cdfs, perms, strict=True)
        ]


def run_job(args: argparse.Namespace, incremental: bool, root: str, pg: Any) -> list[dict]:
    """One job's commits: for each, its kind, bytes written and commit time."""
    rows = [args.rows // args.tables] * args.tables
    state, weights, states = make_state(rows, args.dim, pg)
    job_id = f"bench-incr-{'on' if incremental else 'off'}-{uuid.uuid4().hex[:6]}"
    config = load_config(
        job_id=job_id,
        storage={"root": root},
        checkpoint={
            "mode": "sync",
            "every_steps": args.steps,
            "keep_latest_k": 1,
            "memory_tier": False,
            "incremental": {
                "enabled": incremental,
                "full_every": args.full_every,
                "max_delta_share": args.max_delta_share,
            },
        },
    )
    ledger = Ledger(JobLayout.at(f"{root}/ledgers/{job_id}"))  # root is a URL
    ckpt = Checkpointer(config, rank=0, world_size=1, ledger=ledger, process_group=pg)
    features = {f"f{i}": (f"t_{i}", n) for i, n in enumerate(rows)}
    ckpt.register(
        {
            "model": HeldState(state["model"]),
            "optim": HeldState(state["optim"]),
            "loader": RankState(HeldState({})),
        },
        features,
    )
    out = []
    ids_of = draws(rows, args.batch, args.zipf_a, seed=1)
    seen = [np.zeros(n, dtype=bool) for n in rows]
    step = 0
    try:
        for _ in range(args.commits if incremental else args.full_commits):
            for _ in range(args.steps):
                step += 1
                drawn = next(ids_of)
                for b, x in zip(seen, drawn, strict=True):
                    b[x] = True
                ids = [torch.from_numpy(x) for x in drawn]
                kjt = KeyedJaggedTensor(
                    keys=list(features),
                    values=torch.cat(ids),
                    lengths=torch.ones(sum(x.numel() for x in ids), dtype=torch.int32),
                    stride=args.batch,
                )
                ckpt.track(kjt)
                for w, m, x in zip(weights, states, ids, strict=True):
                    w.index_add_(0, x, torch.full((x.numel(), args.dim), 1e-4))
                    m.index_add_(0, x, torch.full((x.numel(), args.dim), 1e-2))
            began = time.perf_counter()
            ckpt.save(step)
            took = time.perf_counter() - began
            [newest] = committed_checkpoints(config.layout)[:1]
            if newest.step != step:
                raise RuntimeError(f"the commit at step {step} did not happen")
            share = sum(int(b.sum()) for b in seen) / sum(rows)
            for b in seen:
                b[:] = False
            out.append(
                {
                    "step": step,
                    "kind": str(newest.manifest.kind),
                    "bytes": newest.manifest.bytes,
                    "commit_s": round(took, 4),
                    "touched_share": round(share, 4),  # of all rows, since the last commit
                }
            )
            print(f"  {job_id} step {step}: {out[-1]}", flush=True)
    finally:
        ckpt.close()
        ledger.close()
    return out


def summary_of(commits: list[dict]) -> dict[str, Any]:
    def median(key: str, kind: str | None = None) -> float | None:
        xs = [c[key] for c in commits if kind is None or c["kind"] == kind]
        return statistics.median(xs) if xs else None

    return {
        "commits": len(commits),
        "median_bytes": median("bytes"),
        "median_commit_s": median("commit_s"),
        "full": {
            "n": sum(c["kind"] == "full" for c in commits),
            "median_bytes": median("bytes", "full"),
            "median_commit_s": median("commit_s", "full"),
        },
        "delta": {
            "n": sum(c["kind"] == "delta" for c in commits),
            "median_bytes": median("bytes", "delta"),
            "median_commit_s": median("commit_s", "delta"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows over all tables")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192, help="ids per table per step")
    parser.add_argument("--steps", type=int, default=20, help="steps between two commits")
    parser.add_argument("--commits", type=int, default=9, help="of the incremental job")
    parser.add_argument(
        "--full-commits", type=int, default=3, help="of the full job (each the same size)"
    )
    parser.add_argument("--full-every", type=int, default=8)
    parser.add_argument("--max-delta-share", type=float, default=0.5)
    parser.add_argument("--zipf-a", type=float, default=1.2)
    parser.add_argument("--out", default=str(ROOT / "docs/results/incremental.json"))
    args = parser.parse_args(argv)
    started = time.time()
    rows: list[dict] = []
    summary: dict[str, Any] = {}
    with process_group() as pg, tempfile.TemporaryDirectory(prefix="bench-incr-") as tmp:
        for incremental in (False, True):
            name = "incremental" if incremental else "full"
            commits = run_job(args, incremental, f"file://{tmp}/{name}", pg)
            rows += [{"job": name, **c} for c in commits]
            summary[name] = summary_of(commits)
    full, inc = summary["full"]["median_bytes"], summary["incremental"]["median_bytes"]
    summary["bytes_ratio_full_over_incremental"] = round(full / inc, 2) if inc else None
    print("\n| job | commits | median bytes | median commit (s) | full / delta commits |")
    print("|---|---:|---:|---:|---|")
    for name in ("full", "incremental"):
        s = summary[name]
        print(
            f"| {name} | {s['commits']} | {s['median_bytes'] / 1e6:.1f} MB | "
            f"{s['median_commit_s']:.2f} | {s['full']['n']} / {s['delta']['n']} |"
        )
    print(
        "\nbytes per commit, full / incremental (medians): "
        f"{summary['bytes_ratio_full_over_incremental']}x"
    )
    save_run("bench_incremental", args, summary, rows, started, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
