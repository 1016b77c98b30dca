"""The baseline's trainer: train, then rank 0 publishes the anchor inside the job.

What a team gets without a decoupled publishing flow: the model is exported, validated and
registered by the training job itself before it ends, so every rank's allocation is held
meanwhile. Lives only in the benchmarks (``bench_publish.py``, ``bench_ett.py``); it runs
as the program of each rank under torchrun, like ``python -m trainer``:

    python -m trainer.launch --standalone ... benchmarks/coupled_trainer.py --config FILE
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# Imported before training, as a trainer with inline publishing would at start-up: the
# import cost lands in the job's start, not in its shutdown.
from infra.checkpoint_manifest import committed_checkpoints  # noqa: E402
from infra.settings import load_config  # noqa: E402
from publish.pipeline import publish  # noqa: E402
from trainer.train import main as train_main  # noqa: E402


def main(argv: list[str]) -> int:
    code = train_main(argv)
    if code != 0 or int(os.environ.get("RANK", "0")) != 0:
        return code
    config = load_config(argv[argv.index("--config") + 1])
    anchor = next(c for c in committed_checkpoints(config.layout) if c.manifest.anchor)
    overrides = {"tracking_uri": config.tracking.mlflow_uri}
    result = publish(anchor.url, anchor.step, config.job_id, None, overrides)
    print(f"coupled publish: {result.registered_model} v{result.version}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
