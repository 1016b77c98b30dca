"""Training throughput (examples/s) with 1 and 2 processes on this machine, side by side.

Each run trains the demo model on the same generated data under torchrun (gloo on CPU),
with checkpoints and evaluation off; throughput comes from the ledger's train_step spans
(steady state: the first 10 steps are skipped), so start-up is not mixed in.

    .venv/bin/python benchmarks/bench_throughput.py [--steps 150] [--nproc 1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.ledger import read_events  # noqa: E402
from infra.settings import load_config  # noqa: E402
from tests.factories import run_trainer  # noqa: E402


def measure(tmp: Path, data_url: str, nproc: int, steps: int) -> dict[str, float]:
    config = load_config(
        job_id=f"throughput-{nproc}",
        storage={"root": f"file://{tmp}/store"},
        data={"url": data_url},
        train={"steps": steps, "eval_every": 0, "eval_rows": 1024, "log_every": 50},
        checkpoint={"mode": "off"},
    )
    result = run_trainer(config, tmp, nproc=nproc, timeout=1800)
    if result.returncode:
        raise SystemExit(f"trainer failed with {nproc} processes:\n{result.stdout[-3000:]}")
    spans = [
        e.duration
        for e in read_events(config.job_url)
        if e.name == "train_step" and e.rank == 0 and (e.step or 0) > 10
    ]
    step_s = statistics.median(spans)
    examples = config.data.batch_size * nproc
    return {"nproc": nproc, "median_step_s": step_s, "examples_per_s": examples / step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--nproc", default="1,2")
    args = parser.parse_args()
    from trainer.data.synthetic import generate

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = load_config(data={"url": f"file://{tmp}/data"}).data
        generate(data, data.url)
        rows = [measure(tmp, data.url, int(n), args.steps) for n in args.nproc.split(",")]
    base = rows[0]["examples_per_s"]
    print("| processes | median step (s) | examples/s | vs 1 process |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['nproc']} | {row['median_step_s']:.4f} | {row['examples_per_s']:.0f} | "
            f"{row['examples_per_s'] / base:.2f}x |"
        )
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
