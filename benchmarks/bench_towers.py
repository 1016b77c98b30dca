"""History towers on the demo data: holdout AUC of attention vs pooling, side by side.

Both towers train the demo config (embedded defaults: 400k generated rows, batch 1024, 600
steps, evaluation every 200 steps on the 50k-row holdout) under torchrun, same data, same
seeds; only ``model.history_tower`` differs. Several seeds show whether a gap is more than
run-to-run noise. The Bayes-optimal AUC of the planted truth is the ceiling.

    .venv/bin/python benchmarks/bench_towers.py [--seeds 0,1] [--steps 600]

Prints a markdown table and writes benchmarks/results/towers.json. Target: attention's
final AUC >= pooling's (mean over seeds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.save import save_json  # noqa: E402
from infra.accounting.ledger_format import Span  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.settings import load_config  # noqa: E402
from tests.factories import run_trainer  # noqa: E402

TOWERS = ("pooling", "attention")


def train_tower(tmp: Path, data_url: str, tower: str, seed: int, steps: int) -> dict:
    """Train one tower; returns its AUC at each evaluation and its median step time."""
    config = load_config(
        job_id=f"towers-{tower}-{seed}",
        storage={"root": f"file://{tmp}/store"},
        data={"url": data_url},
        model={"history_tower": tower},
        train={"steps": steps, "seed": seed, "eval_every": 200, "log_every": 100},
        checkpoint={"mode": "off"},
    )
    t0 = time.perf_counter()
    result = run_trainer(config, tmp, timeout=3600)
    if result.returncode:
        raise SystemExit(f"{tower} (seed {seed}) failed:\n{result.stdout[-3000:]}")
    events = read_events(config.layout)
    evals = {e.step: e.attrs["auc"] for e in events if e.name == Span.EVAL}
    steps_s = [e.duration for e in events if e.name == Span.TRAIN_STEP]
    return {
        "tower": tower,
        "seed": seed,
        "auc": evals,
        "final_auc": evals[max(evals)],
        "median_step_s": statistics.median(steps_s),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1", help="training seeds (data stays the same)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--data", default=None, help="an existing demo data URL (default: generate)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "towers.json"))
    args = p.parse_args()
    from trainer.data.synthetic import generate

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-towers-") as tmp_dir:
        tmp = Path(tmp_dir)
        data_url = args.data or f"file://{tmp}/data"
        meta = generate(load_config(data={"url": data_url}).data, data_url) if not args.data else {}
        for seed in (int(s) for s in args.seeds.split(",")):
            for tower in TOWERS:  # interleaved, so load drift hits both alike
                runs.append(train_tower(tmp, data_url, tower, seed, args.steps))
                print(f"  {tower} seed {seed}: {runs[-1]['auc']}", flush=True)
    eval_steps = sorted(runs[0]["auc"])
    print("| tower | seed | " + " | ".join(f"AUC @ {s}" for s in eval_steps) + " | step (ms) |")
    print("|---|---|" + "---|" * len(eval_steps) + "---|")
    for r in runs:
        aucs = " | ".join(f"{r['auc'][s]:.4f}" for s in eval_steps)
        print(f"| {r['tower']} | {r['seed']} | {aucs} | {1e3 * r['median_step_s']:.1f} |")
    mean = {t: statistics.mean(r["final_auc"] for r in runs if r["tower"] == t) for t in TOWERS}
    bayes = meta.get("bayes_auc")
    print(
        f"\nfinal AUC, mean over seeds: attention {mean['attention']:.4f}, pooling "
        f"{mean['pooling']:.4f} (difference {mean['attention'] - mean['pooling']:+.4f})"
        + (f"; Bayes-optimal {bayes:.4f}" if bayes else "")
    )
    save_json({"runs": runs, "mean_final_auc": mean, "bayes_auc": bayes}, args.out)


if __name__ == "__main__":
    main()
