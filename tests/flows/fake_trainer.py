"""A stand-in for ``python -m trainer --config FILE`` in orchestration tests: the trainer's
contract (exit codes, progress lines, ledger marks, resume, injected faults) without torch.

It reads job_id, storage.root, train.steps/log_every, checkpoint.every_steps and faults from
the config, and ETT_ATTEMPT from the environment. A "checkpoint" is a file holding the last
committed step; each attempt resumes from it; the final one also commits an anchor
manifest (what the flow looks for). Faults: crash -> exit 1, sigkill -> SIGKILL
itself, sigterm -> commit and exit 83 (preempted), hang -> stop printing and sleep. A real
SIGTERM is a preemption too (commit at the next step boundary, exit 83).
FAKE_EXIT_CODE=<n> exits at once with n (e.g. 2, a bad config) after marking attempt_start.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra import storage  # noqa: E402
from infra.checkpoints import MANIFEST, Manifest, checkpoints_url, step_dir_name  # noqa: E402
from infra.exit_codes import ExitCode
from infra.ledger import Ledger  # noqa: E402

STEP_S = float(os.environ.get("FAKE_STEP_S", "0.02"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = yaml.safe_load(Path(parser.parse_args().config).read_text())
    job_url = f"{cfg['storage']['root'].rstrip('/')}/jobs/{cfg['job_id']}"
    attempt = int(os.environ["ETT_ATTEMPT"])
    steps, log_every = cfg["train"]["steps"], cfg["train"]["log_every"]
    every = cfg["checkpoint"]["every_steps"]
    faults = {f["step"]: f["kind"] for f in cfg.get("faults") or [] if f["attempt"] == attempt}
    ledger = Ledger(job_url, attempt=attempt, rank=0, sync_every_s=0.0)
    ledger.mark("attempt_start", pid=os.getpid())
    print(f"fake trainer: attempt {attempt} of {cfg['job_id']} starting", flush=True)
    if "FAKE_EXIT_CODE" in os.environ:
        ledger.close()
        return int(os.environ["FAKE_EXIT_CODE"])
    ckpt = storage.join(job_url, "fake_ckpt.txt")
    step = int(storage.read_text(ckpt)) if storage.exists(ckpt) else 0
    with ledger.span("pre_train"):
        time.sleep(STEP_S)
    if step:
        ledger.mark("resume", step=step)
        print(f"resumed from {ckpt} at step {step}", flush=True)

    preempted: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: preempted.append(1))  # as the trainer: at a step

    def commit(at: int) -> None:
        storage.write_text(ckpt, str(at))
        ledger.mark("checkpoint_committed", step=at, url=f"{job_url}/checkpoints/step-{at}")

    while step < steps:
        step += 1
        kind = faults.get(step)
        if kind == "crash":
            print(f"injected crash at step {step}", flush=True)
            return 1
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            ledger.close()
            time.sleep(3600)
        with ledger.span("train_step", step=step):
            time.sleep(STEP_S)
        if step % log_every == 0:
            print(f"fake: step {step}/{steps} loss 0.5", flush=True)
        if kind == "sigterm" or preempted:
            print(f"preempted: saving at step {step}", flush=True)
            commit(step)
            ledger.close()
            return ExitCode.PREEMPTED
        if step % every == 0 and step < steps:
            commit(step)
    with ledger.span("shutdown", step=step):
        commit(step)
        anchor = storage.join(checkpoints_url(job_url), step_dir_name(step))
        manifest = Manifest(step=step, world_size=1, config_hash="fake", files={}, anchor=True)
        storage.write_text(storage.join(anchor, MANIFEST), manifest.to_json())  # the commit
        ledger.mark("anchor_committed", step=step, url=anchor)
    ledger.mark("job_end", step=step)
    ledger.close()
    return ExitCode.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
