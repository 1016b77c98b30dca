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
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

from flows import PROJECT_LOGGERS
from infra.exit_codes import ExitCode
from infra.library_logs import quiet_library_dumps
from infra.settings import ConfigError, JobConfig, dump_config, load_config

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


def cmd_train(args: argparse.Namespace) -> int:
    """One attempt under torchrun, without an orchestrator (the flow adds retries)."""
    from tasks.attempt_output import OutputLevels
    from tasks.launch import run_attempt, torchrun_command

    config = _config(args)
    levels = OutputLevels()  # torchrun's own traceback of a failed worker: only with -v

    def show(line: str) -> None:
        for level, text in levels.feed(line.rstrip("\n")):
            if log.isEnabledFor(level):
                print(text, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.yaml")
        dump_config(config, path)
        result = run_attempt(torchrun_command(path, nproc=args.nproc), on_line=show)
    for _, text in levels.flush():
        print(text)
    return result.exit_code


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

    config = _config(args)
    report = report_for_job(_job_url(args, config))
    tables.show(sections(report))
    if args.plot:
        print(f"wall-time breakdown: {plot_breakdown(report, args.plot)}")
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

    try:
        return stack.run(args)
    except (stack.StackError, TimeoutError) as exc:
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
    p = add("train", cmd_train, "run one training attempt under torchrun (no orchestrator)")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes (ranks)")
    p = add("report", cmd_report, "print the ETT breakdown of a job")
    p.add_argument("job", help="job id (under storage.root/jobs) or the job's URL")
    p.add_argument("--plot", metavar="PNG", help="also write the wall-time breakdown picture")
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
