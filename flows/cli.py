"""The ``ett`` command line: one entry point for users, each subcommand a thin wrapper.

Heavy imports (torch, prefect, mlflow) happen inside the handlers so ``ett --help`` is quick.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from infra.exit_codes import ExitCode
from infra.settings import ConfigError, JobConfig, dump_config, load_config


def _config(args: argparse.Namespace) -> JobConfig:
    return load_config(getattr(args, "config", None))


def cmd_generate(args: argparse.Namespace) -> int:
    from trainer.data.synthetic import generate

    config = _config(args)
    meta = generate(config.data, args.url or config.data.url)
    print(
        f"wrote {meta['train_rows']} train + {meta['holdout_rows']} holdout rows to "
        f"{args.url or config.data.url}; Bayes-optimal holdout AUC {meta['bayes_auc']:.4f}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """One attempt under torchrun, without an orchestrator (the flow adds retries)."""
    from tasks.launch import run_attempt, torchrun_command

    config = _config(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.yaml")
        dump_config(config, path)
        result = run_attempt(torchrun_command(path, nproc=args.nproc))
    return result.exit_code


def cmd_report(args: argparse.Namespace) -> int:
    from infra import storage
    from infra.ett import report_for_job
    from infra.ett_report import format_table
    from infra.mfu import mfu_for_job

    config = _config(args)
    storage.configure(config.storage)
    job_url = args.job if "://" in args.job else storage.join(config.storage.root, "jobs", args.job)
    report = report_for_job(job_url)
    print(format_table(report, mfu_for_job(job_url, report)))
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from infra.advisor import optimal_interval

    advice = optimal_interval(
        blocking_s=args.blocking_s,
        mtbf_s=86_400.0 / args.failures_per_day,
        step_time_s=args.step_time_s,
        upload_s=args.upload_s,
    )
    print(advice.describe())
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    from infra.fleet import fleet_summary, format_fleet

    config = _config(args)
    summary = fleet_summary(
        args.tracking_uri or config.tracking.mlflow_uri,
        args.experiment or config.tracking.experiment,
        args.out,
    )
    print(format_fleet(summary))
    print(f"plots and tables in {args.out}")
    return 1 if summary.regressions and args.fail_on_regression else 0


def cmd_stack(args: argparse.Namespace) -> int:
    from infra.stack import main as stack_main

    return stack_main(args.stack_args)


def cmd_publish(args: argparse.Namespace) -> int:
    from publish.__main__ import main as publish_main

    return publish_main(args.publish_args)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on embedded defaults: data, training flow with one injected failure,
    recovery, anchor, publishing as its own flow run, the ETT table."""
    from flows.demo import run_demo

    return run_demo(steps=args.steps, nproc=args.nproc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ett", description="Effective Training Time pipeline")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, handler, help_text: str, config: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if config:
            p.add_argument("--config", help="job config (YAML/TOML); embedded defaults if omitted")
        p.set_defaults(handler=handler)
        return p

    p = add("generate", cmd_generate, "write the synthetic click log (Parquet shards)")
    p.add_argument("--url", help="where to write it (default: data.url of the config)")
    p = add("train", cmd_train, "run one training attempt under torchrun (no orchestrator)")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this machine")
    p = add("report", cmd_report, "print the ETT breakdown of a job")
    p.add_argument("job", help="job id (under storage.root) or the job's URL")
    p = add("advise", cmd_advise, "the checkpoint interval that minimises lost time", config=False)
    p.add_argument("--blocking-s", type=float, required=True, help="blocking time per checkpoint")
    p.add_argument("--failures-per-day", type=float, required=True)
    p.add_argument("--step-time-s", type=float, help="to express the interval in steps")
    p.add_argument("--upload-s", type=float, help="async upload time (interval must exceed it)")
    p = add("demo", cmd_demo, "run the main job on embedded defaults (make demo)", config=False)
    p.add_argument("--steps", type=int, help="training steps (default: the config's)")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks)")
    p = add("fleet", cmd_fleet, "ETT trend and regressions over all jobs of an experiment")
    p.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment)")
    p.add_argument("--tracking-uri", help="MLflow URI (default: tracking.mlflow_uri)")
    p.add_argument("--out", default="runs/fleet", help="folder for the PNG plots and tables")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 on a regression")
    p = add("stack", cmd_stack, "local Prefect + MLflow + S3 servers: up|down|status|env", False)
    p.add_argument("stack_args", nargs=argparse.REMAINDER, help="e.g. up, down, status, env")
    p = add("publish", cmd_publish, "publish an anchor checkpoint (see --help)", config=False)
    p.add_argument("publish_args", nargs=argparse.REMAINDER, help="e.g. --uri URL")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return ExitCode.USAGE


if __name__ == "__main__":
    sys.exit(main())
