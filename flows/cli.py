"""The ``ett`` command line: one entry point for users, each subcommand a thin wrapper.

The parser and the top level live here; the handlers are flows/commands.py's, importing what
they need when they run, so ``ett --help`` is quick. A user's mistake (a bad flag, a missing
job, an invalid config, an unreachable stack) ends in one line on stderr that names it, and
exit code 2 (``ExitCode.USAGE``); anything else that fails ends in one line and exit code 1,
its traceback shown with ``ett -v``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from flows import PROJECT_LOGGERS
from flows.commands import (
    UserError,
    cmd_advise,
    cmd_demo,
    cmd_fleet,
    cmd_generate,
    cmd_pool,
    cmd_publish,
    cmd_report,
    cmd_simulate,
    cmd_stack,
    cmd_train,
)
from infra import log_lines
from infra.config_sources import ConfigError
from infra.exit_codes import ExitCode
from infra.library_logs import quiet_libraries

log = logging.getLogger("ett")


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


def _publish_parent() -> argparse.ArgumentParser:
    from publish.__main__ import build_parser

    return build_parser()


def build_parser() -> argparse.ArgumentParser:
    from infra.devstack import stack

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
    # Each sets one config field, its destination (flows/commands.train_overrides); a flag
    # not given leaves the config's value.
    for flag, kind, field, what in (
        ("--nproc", positive_int, "launch.nproc", "processes (ranks) per node"),
        ("--nnodes", positive_int, "launch.nnodes", "nodes, each a torchrun agent"),
        ("--work-pool", str, "launch.work_pool", "Prefect work pool whose workers run the nodes"),
        ("--max-failures", int, "recovery.max_failures", "failures survived"),
        ("--backoff-s", float, "recovery.backoff_s", "wait when a failure repeats"),
        ("--hang-timeout-s", positive, "recovery.hang_timeout_s", "no step this long: hung"),
    ):
        p.add_argument(flag, type=kind, dest=field, help=f"{what} (sets {field})")
    p.add_argument(
        "--job-id",
        help="continue this unfinished job (a finished one is refused); default: a new job, "
        "train-<UTC time>-<4 hex>",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest unfinished train-<UTC time>-<4 hex> job (ett train's or the "
        "train deployment's)",
    )
    p = add(
        "pool",
        cmd_pool,
        "keep trainer agents imported and parked, so jobs start warm (ETT_LAUNCH__AGENT_POOL)",
        False,
    )
    p.add_argument("--socket", help="unix socket to listen on (default: a per-user path)")
    p.add_argument("--size", type=positive_int, default=1, help="agents kept parked")
    p.add_argument(
        "--refill-delay-s",
        type=float,
        default=10.0,
        help="after a claim, wait this long before parking the next agent (default 10)",
    )
    p = add("report", cmd_report, "print the ETT breakdown of a job")
    p.add_argument("job", help="job id (under storage.root/jobs) or the job's URL")
    p.add_argument("--plot", metavar="PNG", help="also write the wall-time breakdown picture")
    p.add_argument(
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
    p = add(
        "simulate",
        cmd_simulate,
        "validate measured jobs against the model, then project their ETT to 16,384 GPUs",
    )
    _simulate_arguments(p)
    return parser


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    from infra.whatif.scaling import ANCHOR, ScalingLaws

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
    days_help = "job length, days of training (default %(default)g)"
    p.add_argument("--days", type=float, default=30.0, help=days_help)
    # The scaling laws' own defaults, one flag per field of ScalingLaws.
    laws: list[tuple[str, type[int] | type[float], str]] = [
        ("gpus_per_node", int, "G: GPUs per node (default %(default)d)"),
        (
            "failures_per_gpu_day",
            float,
            f"per-GPU failure rate (default %(default).3g, from {ANCHOR})",
        ),
        (
            "rendezvous_s_per_node",
            float,
            "seconds added to every restart and to the first start per node beyond the "
            "measured ones (default %(default)g s)",
        ),
        ("measured_nodes", int, "nodes of the measured runs (default %(default)d)"),
    ]
    # The per-node restart term: a number, or the fit of measured relaunches; not both.
    restart_term = p.add_mutually_exclusive_group()
    for field, kind, help_text in laws:
        flag = "--" + field.replace("_", "-")
        where = restart_term if field == "rendezvous_s_per_node" else p
        where.add_argument(flag, type=kind, default=getattr(ScalingLaws, field), help=help_text)
    restart_term.add_argument(
        "--relaunch-fit",
        metavar="JSON",
        help="set the per-node restart term to the slope fitted to measured relaunches "
        "(benchmarks/bench_relaunch_nodes.py's result, e.g. docs/results/relaunch-nodes.json)",
    )
    p.add_argument(
        "--runs", type=int, default=300, help="seeded Monte Carlo runs per point (default 300)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/simulate", help="folder for simulate.{json,md,png}")


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
    if args.verbose:  # the ranks and the evaluator too (infra/log_lines.py)
        os.environ[log_lines.ENV_LEVEL] = "DEBUG"
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format=log_lines.line_format(),
    )
    for name in ("ett", *PROJECT_LOGGERS):
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    logging.captureWarnings(True)  # a library's warning is a WARNING line, or noise
    quiet_libraries()
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
