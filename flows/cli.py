"""The ``ett`` command line: one entry point for users, each subcommand a thin wrapper.

Heavy imports (torch, prefect, mlflow) happen inside the handlers so ``ett --help`` is quick.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
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


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_train(args: argparse.Namespace) -> int:
    """A job without Prefect: the same attempts, standby, retries and hang detection as the
    ``train`` flow; exits with the last attempt's code (0 once the job succeeded)."""
    from infra import storage
    from infra.lease import JobLocked
    from infra.ledger import next_attempt
    from tasks.attempts import LaunchSpec, RetryPolicy
    from tasks.job import run_job, timeouts_for

    config = _config(args)
    storage.configure(config.storage)
    policy = RetryPolicy(max_failures=args.max_failures, backoff_s=args.backoff_s)
    # Stopped from outside (SIGTERM, Ctrl-C): the attempt is preempted (it checkpoints) and
    # the standby released before this process goes.
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.yaml")
        dump_config(config, path)
        spec = LaunchSpec(path, nproc=args.nproc, nnodes=args.nnodes)
        try:
            outcome = run_job(
                config,
                spec,
                policy,
                timeouts_for(config, args.hang_timeout_s),
                next_attempt(config.job_url),
            )
        except KeyboardInterrupt:
            print("stopped: the running attempt was preempted", file=sys.stderr)
            return 128 + signal.SIGTERM
        except JobLocked as exc:
            print(exc, file=sys.stderr)
            return ExitCode.JOB_LOCKED
    print(outcome.message)
    return 0 if outcome.succeeded else outcome.attempts[-1].exit_code


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
    # --- ett report --log (MLflow owner: infra/tracking.py) ---
    if args.log:
        from mlflow.exceptions import MlflowException

        from infra import tracking

        job = config.model_copy(update={"job_id": job_url.rstrip("/").rsplit("/", 1)[-1]})
        where = tracking.redact_url(config.tracking.mlflow_uri)
        try:
            run_id, _ = tracking.log_job(job, job_url=job_url)
        except MlflowException as exc:
            print(
                f"error: could not log {job.job_id} to MLflow at {where}: {exc.message}",
                file=sys.stderr,
            )
            return 1
        print(f"logged {job.job_id} to MLflow run {run_id} ({where})")
    # --- end ett report --log ---
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


# -- ett simulate (infra/projection.py, infra/simulate_report.py) ------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    """Validate measured jobs against the model, then project them to many GPUs."""
    from infra import storage
    from infra.scaling import ScalingLaws
    from infra.simulate_report import format_text, run_simulate, write_outputs

    config = _config(args)
    storage.configure(config.storage)
    named = [("baseline", args.baseline), ("optimized", args.optimized)]
    named += [(args.job.rstrip("/").rsplit("/", 1)[-1], args.job)] if args.job else []
    jobs = {
        label: job if "://" in job else storage.join(config.storage.root, "jobs", job)
        for label, job in named
        if job
    }
    try:
        if not jobs:
            raise ValueError("give a job: JOB, --baseline JOB and/or --optimized JOB")
        laws = ScalingLaws(
            failures_per_gpu_day=args.failures_per_gpu_day,
            gpus_per_node=args.gpus_per_node,
            rendezvous_s_per_node=args.rendezvous_s_per_node,
            measured_nodes=args.measured_nodes,
        )
        out = run_simulate(
            jobs, laws, args.days, args.tolerance, args.runs, args.seed, args.validate
        )
        print(format_text(out), end="")
        print(f"wrote {', '.join(str(p) for p in write_outputs(out, args.out))}")
    except (ValueError, OSError) as exc:
        print(f"ett simulate: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    return 0 if out.validated or not args.validate else 1


# -- end of ett simulate ----------------------------------------------------------------------


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
    p = add("train", cmd_train, "run a training job under torchrun, with retries (no Prefect)")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks) per node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes, each a torchrun agent here")
    p.add_argument("--max-failures", type=int, default=3, help="failures survived")
    p.add_argument("--backoff-s", type=float, default=10.0, help="wait when a failure repeats")
    p.add_argument("--hang-timeout-s", type=float, default=600.0, help="no step for this long")
    p = add("report", cmd_report, "print the ETT breakdown of a job")
    p.add_argument("job", help="job id (under storage.root) or the job's URL")
    p.add_argument(  # --- ett report --log ---
        "--log",
        action="store_true",
        help="also log the job (run, attempts, report, curves) to MLflow (tracking.mlflow_uri)",
    )
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
    # -- ett simulate ------------------------------------------------------------------------
    from infra.scaling import ANCHOR, ScalingLaws

    p = add(
        "simulate",
        cmd_simulate,
        "validate measured jobs against the model, then project their ETT to 16,384 GPUs",
    )
    p.add_argument("job", nargs="?", help="a measured job: id (under storage.root) or URL")
    p.add_argument("--baseline", metavar="JOB", help="the baseline run (id or URL)")
    p.add_argument("--optimized", metavar="JOB", help="the optimized run (id or URL)")
    p.add_argument(
        "--validate",
        action="store_true",
        help="only replay each job on its own failures beside what was measured; "
        "exit 1 when one misses --tolerance",
    )
    p.add_argument("--tolerance", type=float, default=3.0, help="ETT points (default 3)")
    p.add_argument(
        "--days",
        type=float,
        default=30.0,
        help="job length, days of training (default %(default)g)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=ScalingLaws.gpus_per_node,
        help="G: GPUs per node (default %(default)d)",
    )
    p.add_argument(
        "--failures-per-gpu-day",
        type=float,
        default=ScalingLaws.failures_per_gpu_day,
        help=f"per-GPU failure rate (default %(default).3g, from {ANCHOR})",
    )
    p.add_argument(
        "--rendezvous-s-per-node",
        type=float,
        default=ScalingLaws.rendezvous_s_per_node,
        help="seconds added to every restart and to the first start per node beyond the "
        "measured ones (default %(default)g s)",
    )
    p.add_argument(
        "--measured-nodes",
        type=int,
        default=ScalingLaws.measured_nodes,
        help="nodes of the measured runs (default %(default)d)",
    )
    p.add_argument(
        "--runs", type=int, default=300, help="seeded Monte Carlo runs per point (default 300)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/simulate", help="folder for simulate.{json,md,png}")
    # -- end of ett simulate -----------------------------------------------------------------
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
