"""A stand-in for ``python -m trainer.launch ... -m trainer --config FILE`` in orchestration
tests: the trainer's contract without torch (exit codes, the control channel of
infra/control.py: pid and exit files, progress, standby parking and promotion; ledger marks,
resume, injected faults).

It reads job_id, storage.root, train.steps, checkpoint.every_steps and faults from the config,
and ETT_ATTEMPT / ETT_STANDBY / ETT_CONTROL_DIR from the environment, and the job's state
(failures so far) from the control folder, as the trainer does. A "checkpoint" is a file
holding the last committed step; each attempt resumes from it; the final one also commits an
anchor manifest (what the flow looks for). Faults: crash -> exit 1,
sigkill -> SIGKILL itself, sigterm -> commit and exit 83 (preempted), hang -> stop stepping
while still printing a line every 0.1 s (output is not progress). A real SIGTERM is a
preemption too (commit at the next step boundary, exit 83).

FAKE_HANG_LIMIT_S=<s>: a hang nobody ended gives up after s seconds and exits 1 (a crash),
so a broken hang detector fails its test's assertions instead of stalling it.

FAKE_EXCEPTION_STEPS=<s,s,...>: attempt 0 raises at these steps and restarts in process, as
the trainer does: back to the last commit, counted in the progress record's ``restarts``.

FAKE_EXIT_CODE=<n> exits at once with n (e.g. 2, a bad config) after marking attempt_start.
FAKE_STANDBY_EXIT=<n> makes a standby exit with n once it has parked (a standby that dies
while it waits); FAKE_STANDBY_EXIT_ATTEMPTS=<a,a,...> limits that to these attempts.
FAKE_RANK_CHILD=<path> starts a child in a session of its own, as torchrun does with its
ranks, which only a whole-tree kill ends; its pid goes to ``<path>.<attempt>``.
FAKE_RANK_CHILD_STEP=<n> starts that child at step n instead of at the start (as a data
loader starts its workers), after the last change of phase the orchestrator sees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from infra.job_layout import JobLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra import storage  # noqa: E402
from infra.accounting.ledger import Ledger  # noqa: E402
from infra.accounting.ledger_format import Mark, Span  # noqa: E402
from infra.checkpoint_manifest import MANIFEST, Manifest  # noqa: E402
from infra.control import ENV_ATTEMPT, Command, Phase, RankControl  # noqa: E402
from infra.exit_codes import ExitCode  # noqa: E402

STEP_S = float(os.environ.get("FAKE_STEP_S", "0.02"))


def main(control: RankControl | None) -> int:
    cfg = yaml.safe_load(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
    layout = JobLayout.for_job(cfg["storage"]["root"], cfg["job_id"])
    job_url = layout.url
    attempt = int(os.environ[ENV_ATTEMPT])
    steps = cfg["train"]["steps"]
    every = cfg["checkpoint"]["every_steps"]
    every = every if isinstance(every, int) else 10
    faults = {f["step"]: f["kind"] for f in cfg.get("faults") or [] if f["attempt"] == attempt}
    if attempt == 0 and os.environ.get("FAKE_EXCEPTION_STEPS"):
        faults.update({int(s): "exception" for s in os.environ["FAKE_EXCEPTION_STEPS"].split(",")})
    ledger = Ledger(JobLayout.at(job_url), attempt=attempt, rank=0, sync_every_s=0.0)
    ledger.mark(
        Mark.ATTEMPT_START,
        pid=os.getpid(),
        standby=bool(control and control.standby),
        failures=control.job_state().failures if control else 0,  # what the orchestrator says
    )
    if control is not None:
        control.report(Phase.INIT)
    print(f"fake trainer: attempt {attempt} of {cfg['job_id']} starting", flush=True)
    child_step = int(os.environ.get("FAKE_RANK_CHILD_STEP", "0"))

    def start_child() -> None:
        child = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        Path(f"{os.environ['FAKE_RANK_CHILD']}.{attempt}").write_text(str(child.pid))

    if "FAKE_RANK_CHILD" in os.environ and not child_step:
        start_child()
    if "FAKE_EXIT_CODE" in os.environ:
        ledger.close()
        return int(os.environ["FAKE_EXIT_CODE"])
    with ledger.span(Span.PRE_TRAIN):
        time.sleep(STEP_S)
    if control is not None and control.standby:
        ledger.mark(Mark.STANDBY_READY)
        control.report(Phase.PARKED)
        dying = os.environ.get("FAKE_STANDBY_EXIT_ATTEMPTS")
        if "FAKE_STANDBY_EXIT" in os.environ and (not dying or str(attempt) in dying.split(",")):
            ledger.close()
            return int(os.environ["FAKE_STANDBY_EXIT"])
        if control.wait(Command.PROMOTE) is None:
            ledger.close()
            return ExitCode.SUCCESS
        ledger.mark(Mark.PROMOTED, failures=control.job_state().failures)
        control.report(Phase.INIT)
    ckpt = storage.join(job_url, "fake_ckpt.txt")
    step = int(storage.read_text(ckpt)) if storage.exists(ckpt) else 0
    if step:
        ledger.mark(Mark.RESUME, step=step)
        print(f"resumed from {ckpt} at step {step}", flush=True)

    preempted: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: preempted.append(1))  # as the trainer: at a step

    def commit(at: int) -> None:
        storage.write_text(ckpt, str(at))
        ledger.mark(Mark.CHECKPOINT_COMMITTED, step=at, url=f"{job_url}/checkpoints/step-{at}")

    restarts = 0
    while step < steps:
        step += 1
        kind = faults.pop(step, None)  # an in-process restart passes its step again
        if kind == "crash":
            print(f"injected crash at step {step}", flush=True)
            return ExitCode.CRASH
        if kind == "exception":
            restarts += 1
            step = int(storage.read_text(ckpt)) if storage.exists(ckpt) else 0
            print(f"injected exception: restarting in process at step {step}", flush=True)
            if control is not None:
                control.report(Phase.TRAINING, step, steps, restarts)
            continue
        if "FAKE_RANK_CHILD" in os.environ and step == child_step:
            start_child()
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        give_up = time.monotonic() + float(os.environ.get("FAKE_HANG_LIMIT_S", "3600"))
        while kind == "hang" and not preempted:
            if time.monotonic() > give_up:
                print("hang never detected: giving up", flush=True)
                return ExitCode.CRASH
            print("still here, not stepping", flush=True)
            time.sleep(0.1)
        with ledger.span(Span.TRAIN_STEP, step=step):
            time.sleep(STEP_S)
        if control is not None:
            control.report(Phase.TRAINING, step, steps, restarts)
        if kind == "sigterm" or preempted:
            print(f"preempted: saving at step {step}", flush=True)
            commit(step)
            ledger.close()
            return ExitCode.PREEMPTED
        if step % every == 0 and step < steps:
            commit(step)
    with ledger.span(Span.SHUTDOWN, step=step):
        commit(step)
        anchor = layout.checkpoint(step)
        manifest = Manifest(step=step, world_size=1, config_hash="fake", files={}, anchor=True)
        storage.write_text(storage.join(anchor, MANIFEST), manifest.to_json())  # the commit
        ledger.mark(Mark.ANCHOR_COMMITTED, step=step, url=anchor)
    ledger.mark(Mark.JOB_END, step=step)
    ledger.close()
    return ExitCode.SUCCESS


if __name__ == "__main__":
    rank_control = RankControl.from_env(0)
    if rank_control is not None:
        rank_control.start(on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    code = main(rank_control)
    if rank_control is not None:
        rank_control.record_exit(code)
    sys.exit(code)
