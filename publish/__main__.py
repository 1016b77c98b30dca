"""``python -m publish --uri URL``: publish one anchor checkpoint without Prefect.

Prints the result as JSON on stdout. Exit codes: 0 published (or already published),
3 refused (corrupt checkpoint, failed validation, ...: nothing registered), 2 bad arguments,
1 MLflow or storage unavailable (nothing refused: run it again later).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

from infra.exit_codes import ExitCode
from publish.settings import PublishError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m publish", description=__doc__.split("\n")[0])
    p.add_argument("--uri", required=True, help="the anchor checkpoint's URL (step-N folder)")
    p.add_argument("--step", type=int, help="expected step (checked against the manifest)")
    p.add_argument("--job-id", help="expected job id (checked against the manifest)")
    p.add_argument("--mlflow-run-id", help="the training run to link the model version to")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: ETT_TRACKING__MLFLOW_URI)")
    p.add_argument("--registered-model", help="registry name (default: the job config's)")
    p.add_argument("--holdout-rows", type=int, help="holdout rows to validate on")
    p.add_argument("--calibration-ratio", type=float, help="max mean-prediction/CTR ratio")
    p.add_argument("--champion-margin", type=float, help="AUC the new model may lose")
    p.add_argument("--min-auc", type=float, help="holdout AUC floor")
    p.add_argument(
        "--allow-non-anchor", action="store_true", help="publish any committed checkpoint"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    args = build_parser().parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # log files, not a TTY
    overrides = {
        key: value
        for key, value in {
            "tracking_uri": args.tracking_uri,
            "registered_model": args.registered_model,
            "holdout_rows": args.holdout_rows,
            "calibration_ratio": args.calibration_ratio,
            "champion_margin": args.champion_margin,
            "min_auc": args.min_auc,
        }.items()
        if value is not None
    }
    if args.allow_non_anchor:
        overrides["require_anchor"] = False
    from mlflow.exceptions import MlflowException  # heavy imports (torch, mlflow) after parsing

    from infra import progress_bars
    from publish.pipeline import STAGES, publish

    try:
        # stdout carries only the JSON result (MLflow prints run links there).
        with (
            contextlib.redirect_stdout(sys.stderr),
            progress_bars.stages([name for name, _ in STAGES], "publishing") as enter,
        ):
            result = publish(
                args.uri, args.step, args.job_id, args.mlflow_run_id, overrides, on_stage=enter
            )
    except PublishError as exc:
        print(f"publish refused: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    except (MlflowException, OSError) as exc:
        print(f"publish failed, nothing refused (try again later): {exc}", file=sys.stderr)
        return ExitCode.CRASH
    print(json.dumps(result.to_dict(), indent=2))
    return ExitCode.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
