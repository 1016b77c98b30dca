"""The ``ett`` command line: one entry point for users, each subcommand a thin wrapper.

Heavy imports (torch, prefect, mlflow) happen inside the handlers so ``ett --help`` is quick.
A user's mistake (a bad flag, a missing job, an invalid config, an unreachable stack) ends in
one line on stderr that names it, and exit code 2 (``ExitCode.USAGE``); anything else that
fails ends in one line and exit code 1, its traceback shown with ``ett -v``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

from flows import PROJECT_LOGGERS
from infra.config_sources import ConfigError
from infra.exit_codes import ExitCode
from infra.library_logs import quiet_library_dumps
from infra.settings import JobConfig, dump_config, load_config

log = logging.getLogger("ett")


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what and why."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line naming the problem, not usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _config(args: argparse.Namespace) -> JobConfig:
    return load_config(getattr(args, "config", None))


# -- subcommands ------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from infra import progress
    from trainer.data.synthetic import files_to_write, generate, generate_daily

    config = _config(args)
    files = files_to_write(config.data)
    if args.daily:
        from infra.windows import DEFAULT_ROOT

        root = args.url or DEFAULT_ROOT
        with progress.counter(files * args.daily, "generate", "file") as bar:
            written = generate_daily(config.data, root, args.daily, on_file=bar.update)
        new = sum(1 for _, fresh in written if fresh)
        print(f"{len(written)} daily windows under {root} ({new} new), newest {written[-1][0]}")
        return 0
    url = args.url or config.data.url
    with progress.counter(files, "generate", "file") as bar:
        meta = generate(config.data, url, on_file=bar.update)
    print(
        f"wrote {meta['train_rows']} train + {meta['holdout_rows']} holdout rows to {url}; "
        f"Bayes-optimal holdout AUC {meta['bayes_auc']:.4f}"
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


def _job_url(args: argparse.Namespace, config: JobConfig) -> str:
    """The job's URL; UserError naming the jobs that exist when it has no ledger."""
    from infra import storage
    from infra.ledger import ledger_url

    storage.configure(config.storage)
    jobs_root = storage.join(config.storage.root, "jobs")
    job_url = args.job if "://" in args.job else storage.join(jobs_root, args.job)
    if storage.glob(storage.join(ledger_url(job_url), "*.jsonl")):
        return job_url
    known = storage.listdir(jobs_root) if "://" not in args.job else []
    hint = f"; jobs there: {', '.join(known[-10:])}" if known else ""
    raise UserError(f"no ledger for job {args.job!r} at {job_url}{hint}")


def cmd_report(args: argparse.Namespace) -> int:
    from infra import tables
    from infra.ett import report_for_job
    from infra.ett_report import plot_breakdown, sections
    from infra.mfu import mfu_for_job

    config = _config(args)
    job_url = _job_url(args, config)
    report = report_for_job(job_url)
    tables.show(sections(report, mfu_for_job(job_url, report)))
    if args.plot:
        print(f"wall-time breakdown: {plot_breakdown(report, args.plot)}")
    # --- ett report --log (MLflow owner: infra/tracking.py) ---
    if args.log:
        from mlflow.exceptions import MlflowException

        from infra import tracking
        from infra.run_metadata import redact_url

        job = config.model_copy(update={"job_id": job_url.rstrip("/").rsplit("/", 1)[-1]})
        where = redact_url(config.tracking.mlflow_uri)
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
    from infra.fleet import fleet_summary
    from infra.fleet_report import show_fleet, write_files

    config = _config(args)
    summary = fleet_summary(
        args.tracking_uri or config.tracking.mlflow_uri,
        args.experiment or config.tracking.experiment,
    )
    show_fleet(summary, sys.stdout)
    write_files(summary, args.out)
    print(f"plots and tables in {args.out}")
    return 1 if summary.regressions and args.fail_on_regression else 0


def cmd_stack(args: argparse.Namespace) -> int:
    from infra import stack
    from infra.servers import StackError

    try:
        return stack.run(args)
    except (StackError, TimeoutError) as exc:
        raise UserError(str(exc).splitlines()[0]) from exc


def cmd_publish(args: argparse.Namespace) -> int:
    from publish.__main__ import main as publish_main

    return publish_main(args.argv)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on embedded defaults: data, training flow with one injected failure,
    recovery, anchor, publishing as its own flow run, the ETT table."""
    from flows.demo import DemoError, run_demo

    try:
        return run_demo(steps=args.steps, nproc=args.nproc, config=args.config)
    except DemoError as exc:
        raise UserError(str(exc)) from exc


# -- the parser -------------------------------------------------------------------------------
def _publish_parent() -> argparse.ArgumentParser:
    from publish.__main__ import build_parser

    return build_parser()


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
    from infra import stack

    parser = _Parser(prog="ett", description="Effective Training Time pipeline")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs, tracebacks")
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    positive_int, positive = _positive(int), _positive(float)

    def add(
        name: str,
        handler: Callable[[argparse.Namespace], int],
        help_text: str,
        config: bool = True,
        **kwargs: Any,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, **kwargs)
        if config:
            p.add_argument("--config", help="job config (YAML/TOML); embedded defaults if omitted")
        p.set_defaults(handler=handler)
        return p

    p = add("generate", cmd_generate, "write the synthetic click log (Parquet shards)")
    p.add_argument("--url", help="where (default: data.url; with --daily: ./runs/data/daily)")
    p.add_argument(
        "--daily",
        type=positive_int,
        metavar="N",
        help="N daily windows dt=YYYY-MM-DD up to today, as the retrain flow reads them",
    )
    p = add("train", cmd_train, "run a training job under torchrun, with retries (no Prefect)")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes (ranks) per node")
    p.add_argument("--nnodes", type=positive_int, default=1, help="nodes, each a torchrun agent")
    p.add_argument("--max-failures", type=int, default=3, help="failures survived")
    p.add_argument("--backoff-s", type=float, default=10.0, help="wait when a failure repeats")
    p.add_argument("--hang-timeout-s", type=positive, default=600.0, help="no step this long")
    p = add("report", cmd_report, "print the ETT breakdown of a job")
    p.add_argument("job", help="job id (under storage.root/jobs) or the job's URL")
    p.add_argument("--plot", metavar="PNG", help="also write the wall-time breakdown picture")
    p.add_argument(  # --- ett report --log ---
        "--log",
        action="store_true",
        help="also log the job (run, attempts, report, curves) to MLflow (tracking.mlflow_uri)",
    )
    p = add("advise", cmd_advise, "the checkpoint interval that minimises lost time", False)
    p.add_argument("--blocking-s", type=positive, required=True, help="blocking per checkpoint")
    p.add_argument("--failures-per-day", type=positive, required=True)
    p.add_argument("--step-time-s", type=positive, help="to express the interval in steps")
    p.add_argument("--upload-s", type=positive, help="async upload time (interval must exceed it)")
    p = add("demo", cmd_demo, "run the main job on embedded defaults (make demo)")
    p.add_argument("--steps", type=positive_int, help="training steps (default: the config's)")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes (ranks)")
    p = add("fleet", cmd_fleet, "ETT trend and regressions over all jobs of an experiment")
    p.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment)")
    p.add_argument("--tracking-uri", help="MLflow URI (default: tracking.mlflow_uri)")
    p.add_argument("--out", default="runs/fleet", help="folder for the PNG plots and tables")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 on a regression")
    p = add("stack", cmd_stack, "local Prefect + MLflow + S3 servers: up|down|status|env", False)
    stack.add_arguments(p)
    add(
        "publish",
        cmd_publish,
        "publish an anchor checkpoint as a registered model version",
        False,
        parents=[_publish_parent()],
        conflict_handler="resolve",
    )
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


def _one_line(exc: BaseException) -> str:
    """The message on one line (a ConfigError lists one bad field per line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return re.sub(r":; ", ": ", "; ".join(lines)) or type(exc).__name__


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    # Our own loggers at INFO, libraries' (httpx, botocore, ...) only from WARNING on.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    for name in ("ett", *PROJECT_LOGGERS):
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    quiet_library_dumps()
    if args.subcommand == "publish":
        args.argv = argv[argv.index("publish") + 1 :]  # publish parses its own flags
    prog = f"ett {args.subcommand}"
    try:
        return int(args.handler(args))
    except (ConfigError, UserError, FileNotFoundError, ValueError) as exc:
        log.debug("user error", exc_info=True)
        return _fail(prog, _one_line(exc), ExitCode.USAGE)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 128 + 2)
    except BrokenPipeError:  # `ett report JOB | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return ExitCode.SUCCESS
    except Exception as exc:  # noqa: BLE001 - one line for the user, the rest with -v
        log.debug("failure", exc_info=True)
        hint = "" if args.verbose else " (ett -v ... shows the traceback)"
        return _fail(prog, f"{type(exc).__name__}: {_one_line(exc)}{hint}", ExitCode.CRASH)


if __name__ == "__main__":
    sys.exit(main())
