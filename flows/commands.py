"""The handlers of the ``ett`` subcommands: each a thin wrapper around the code that does it.

Heavy imports (torch, prefect, mlflow) happen inside the handlers so ``ett --help`` is quick.
A handler returns the exit code; ``UserError`` is a mistake the user can fix, and flows/cli.py
turns it into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from infra.exit_codes import ExitCode
from infra.settings import JobConfig, load_config

if TYPE_CHECKING:
    from infra.job_layout import JobLayout


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what and why."""


def _config(args: argparse.Namespace) -> JobConfig:
    return load_config(getattr(args, "config", None))


# -- subcommands ------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from infra import progress_bars
    from trainer.data.synthetic import files_to_write, generate, generate_daily

    config = _config(args)
    files = files_to_write(config.data)
    if args.daily:
        from infra.daily_windows import DEFAULT_ROOT

        root = args.url or DEFAULT_ROOT
        with progress_bars.counter(files * args.daily, "generate", "file") as bar:
            written = generate_daily(config.data, root, args.daily, on_file=bar.update)
        new = sum(1 for _, fresh in written if fresh)
        print(f"{len(written)} daily windows under {root} ({new} new), newest {written[-1][0]}")
        return 0
    url = args.url or config.data.url
    with progress_bars.counter(files, "generate", "file") as bar:
        meta = generate(config.data, url, on_file=bar.update)
    print(
        f"wrote {meta['train_rows']} train + {meta['holdout_rows']} holdout rows to {url}; "
        f"Bayes-optimal holdout AUC {meta['bayes_auc']:.4f}"
    )
    return 0


class _Stop:
    """SIGINT and SIGTERM handler of ``ett train``. The first signal stops the job: a
    KeyboardInterrupt in the main thread, whose handlers preempt the running attempt (it
    checkpoints), release the standby and remove the job's folders. A later one would land
    inside that cleanup and leave processes and folders behind: it is ignored, and said so."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the main thread may be inside a write to stderr right now.
        if self.signum is not None:
            os.write(2, f"ett train: {name} ignored: still ending the job's processes\n".encode())
            return
        self.signum = signum
        os.write(
            2,
            f"ett train: {name}: stopping (the running attempt checkpoints and exits, the "
            "standby is released; further signals are ignored until that is done)\n".encode(),
        )
        raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process that the signal ended."""
        return 128 + (self.signum or signal.SIGINT)


# ``ett train``'s flags and the config fields they set (as overrides: ETT_* still wins).
def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields that ``ett train``'s flags set: each flag's destination is its
    field's dotted path (flows/cli.py); a flag not given sets nothing."""
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            section, field = dest.split(".", 1)
            out.setdefault(section, {})[field] = value
    if getattr(args, "job_id", None) is not None:
        out["job_id"] = args.job_id
    return out


def cmd_train(args: argparse.Namespace) -> int:
    """A job without Prefect: the same orchestrator as the ``train`` flow (attempts, standby,
    retries, hang detection); exits with the last attempt's code (0 once the job succeeded).
    What the config names is checked first (infra/preflight.py): a mistake there is exit 2
    before torchrun starts, and so is a finished job's id (tasks/job_identity.py). SIGINT
    (Ctrl-C) exits 130 and SIGTERM 143, after the running attempt's emergency checkpoint."""
    from infra.lease import JobLocked
    from infra.preflight import PreflightError
    from tasks.orchestrator import plan_job, run

    try:
        config = plan_job(
            getattr(args, "config", None),
            train_overrides(args),
            resume=bool(getattr(args, "resume", False)),
        )
    except PreflightError as exc:
        raise UserError(str(exc)) from None
    stop = _Stop()
    stop.install()
    try:
        outcome = run(config).outcome
        print(outcome.message)
    except KeyboardInterrupt:
        print("stopped: the running attempt was preempted", file=sys.stderr)
        return stop.exit_code
    except JobLocked as exc:
        print(exc, file=sys.stderr)
        return ExitCode.JOB_LOCKED
    return 0 if outcome.succeeded else outcome.attempts[-1].exit_code


def cmd_pool(args: argparse.Namespace) -> int:
    """Keep trainer agents parked until stopped (SIGTERM, Ctrl-C); orchestrators whose
    environment has ETT_LAUNCH__AGENT_POOL=<socket> claim them instead of starting cold."""
    from infra.agent_protocol import ENV_POOL, socket_path_default
    from tasks.agent_pool import AgentPool

    path = args.socket or socket_path_default()
    pool = AgentPool(path, size=args.size, refill_delay_s=args.refill_delay_s)

    def stop(signum: int, frame: object) -> None:
        pool.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"agent pool: {args.size} agent(s) on {path}; use it with {ENV_POOL}={path}")
    try:
        pool.serve()
    except RuntimeError as exc:  # another pool listens there
        raise UserError(str(exc)) from exc
    print(f"agent pool stopped after {pool.claims} claim(s)")
    return 0


def _layout(args: argparse.Namespace, config: JobConfig) -> JobLayout:
    """The job ``args.job`` names (an id under the config's storage root, or a URL);
    UserError naming the jobs that exist when it has no ledger."""
    from infra import storage
    from infra.job_layout import JobLayout

    storage.configure(config.storage)
    here = JobLayout.for_job(config.storage.root, args.job, config.train.compile_cache_url)
    layout = JobLayout.at(args.job) if "://" in args.job else here
    if storage.glob(storage.join(layout.ledger, "*.jsonl")):
        return layout
    known = storage.listdir(here.jobs) if "://" not in args.job else []
    hint = f"; jobs there: {', '.join(known[-10:])}" if known else ""
    raise UserError(f"no ledger for job {args.job!r} at {layout.url}{hint}")


def _config_at(config: JobConfig, layout: JobLayout) -> JobConfig:
    """``config`` for the job ``layout`` names, so what is logged names the ledger that was
    read; UserError for a folder that is not ``<storage root>/jobs/<job id>``."""
    from infra.job_layout import JobLayout

    if JobLayout.for_job(layout.root, layout.job_id).url != layout.url:
        raise UserError(f"--log needs a job folder <storage root>/jobs/<job id>, not {layout.url}")
    storage = config.storage.model_copy(update={"root": layout.root})
    return config.model_copy(update={"job_id": layout.job_id, "storage": storage})


def cmd_report(args: argparse.Namespace) -> int:
    from infra import tables
    from infra.accounting.report import plot_breakdown, sections
    from infra.accounting.summary import JobSummary

    config = _config(args)
    layout = _layout(args, config)
    summary = JobSummary.read(layout)
    tables.show(sections(summary.report, summary.mfu))
    if (cold := summary.cold_start()) is not None:
        print(cold.describe())  # why a first job's Time to Start is long
    if args.plot:
        print(f"wall-time breakdown: {plot_breakdown(summary.report, args.plot)}")
    if args.log:
        from mlflow.exceptions import MlflowException

        from infra.tracking import mlflow_runs
        from infra.tracking.run_metadata import redact_url

        job = _config_at(config, layout)
        where = redact_url(config.tracking.mlflow_uri)
        try:
            run_id, _ = mlflow_runs.log_job(job, summary)
        except MlflowException as exc:
            print(
                f"error: could not log {job.job_id} to MLflow at {where}: {exc.message}",
                file=sys.stderr,
            )
            return 1
        print(f"logged {job.job_id} to MLflow run {run_id} ({where})")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from infra.whatif.advisor import optimal_interval

    advice = optimal_interval(
        blocking_s=args.blocking_s,
        mtbf_s=86_400.0 / args.failures_per_day,
        step_time_s=args.step_time_s,
        upload_s=args.upload_s,
    )
    print(advice.describe())
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    from infra.whatif.fleet import fleet_summary
    from infra.whatif.fleet_report import show_fleet, write_files

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
    from infra.devstack import stack
    from infra.devstack.servers import StackError

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


def cmd_simulate(args: argparse.Namespace) -> int:
    """Validate measured jobs against the model, then project them to many GPUs."""
    from infra import storage
    from infra.job_layout import JobLayout
    from infra.tables import show
    from infra.whatif.scaling import ScalingLaws, read_restart_fit
    from infra.whatif.simulate_report import run_simulate, tables, write_outputs

    config = _config(args)
    storage.configure(config.storage)
    named = [("baseline", args.baseline), ("optimized", args.optimized)]
    named += [(args.job.rstrip("/").rsplit("/", 1)[-1], args.job)] if args.job else []
    jobs = {
        label: JobLayout.at(job) if "://" in job else JobLayout.for_job(config.storage.root, job)
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
        if args.relaunch_fit:
            laws = ScalingLaws.from_fit(read_restart_fit(args.relaunch_fit), laws)
        out = run_simulate(
            jobs, laws, args.days, args.tolerance, args.runs, args.seed, args.validate
        )
        show(tables(out))
        print(f"wrote {', '.join(str(p) for p in write_outputs(out, args.out))}")
    except (ValueError, OSError) as exc:
        print(f"ett simulate: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    return 0 if out.validated or not args.validate else 1
