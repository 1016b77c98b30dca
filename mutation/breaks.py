"""The break table of docs/testing.md, rerun: each break is a small, deliberate bug in the core
(one or two lines); the fast tests that cover it are run against it and the failing ones are
listed. A break that no test catches is a hole in the suite.

    python mutation/breaks.py            # every break; prints the table (markdown)
    python mutation/breaks.py B3 B6      # some of them

Each break edits the working tree in place and puts the file back afterwards (also when
interrupted); it refuses to start when a file it edits has uncommitted changes, and fails
loudly when its text is no longer in the code (the code moved: update the break).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]


@dataclass(frozen=True)
class Break:
    key: str
    what: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (text in the code, what it becomes)
    tests: tuple[str, ...]


ETT_TESTS = (
    "tests/infra",
    "tests/tasks/test_attempts.py",
    "tests/trainer/test_startup.py",
)
ATTEMPT_TESTS = ("tests/tasks/test_attempts.py",)
POOL_TESTS = ("tests/tasks/test_agent_pool.py",)
CHECKPOINT_TESTS = (
    "tests/trainer/checkpoint/test_checkpointer.py",
    "tests/trainer/checkpoint/test_manifest.py",
    "tests/trainer/checkpoint",
)
RECOVERY_TESTS = ("tests/reliability/test_recovery_paths.py",)
MEMORY_TIER_TESTS = ("tests/trainer/checkpoint/test_memory_tier.py",)
INCREMENTAL_TESTS = (
    "tests/trainer/checkpoint/test_manifest.py",
    "tests/trainer/checkpoint/test_incremental.py",
)
GATE_TESTS = ("tests/publish/test_gate.py",)
CLOCK_TESTS = ("tests/infra/test_clocks.py", "tests/reliability/test_ledger_times.py")
FLEET_TESTS = ("tests/tasks/test_node_fleet.py",)
HEALTH_TESTS = ("tests/tasks/test_health.py",)
CAPACITY_DECISION_TESTS = (  # the orchestrator's decisions alone, not the jobs of that module
    "tests/reliability/test_capacity.py::test_too_few_slots_left_fail_the_job_in_one_line_after_the_wait",
    "tests/reliability/test_capacity.py::test_a_slot_back_within_the_wait_relaunches_at_full_size",
    "tests/reliability/test_capacity.py::test_the_health_check_before_a_relaunch_leaves_the_usable_slots",
)
NODE_CAPACITY_TESTS = ("tests/reliability/test_node_capacity.py",)
PARK_TESTS = (
    "tests/trainer/test_startup.py",
    "tests/reliability/test_recovery_paths.py::"
    "test_a_standby_promoted_after_it_parked_resumes_from_the_newest_commit",
)

BREAKS = (
    Break(
        "B1",
        "a re-done step's first execution counts as effective instead of its last",
        "infra/accounting/ett.py",
        (
            (
                "        last_exec[e.step if e.step is not None else id(e)] = e\n",
                "        last_exec.setdefault(e.step if e.step is not None else id(e), e)\n",
            ),
        ),
        ETT_TESTS,
    ),
    Break(
        "B2",
        "publish spans counted in the job's wall time",
        "infra/accounting/ett.py",
        (
            (
                "OFF_JOB_SPANS = frozenset((*PUBLISH_SPANS, Span.ASYNC_EVAL))",
                "OFF_JOB_SPANS = frozenset((Span.ASYNC_EVAL,))",
            ),
        ),
        ETT_TESTS,
    ),
    Break(
        "B3",
        "any output line resets the hang timer",
        "tasks/attempt.py",
        (
            (
                '            if text:\n                self.log.info("%s%s", self.prefix, text)\n',
                "            if text:\n                self.last_line = time.monotonic()\n"
                '                self.log.info("%s%s", self.prefix, text)\n',
            ),
            (
                "        stepping = last is not None and last.phase == Phase.TRAINING\n",
                "        last_change = max([last_change] + "
                '[getattr(p, "last_line", 0.0) for p in attempt.pumps])\n'
                "        stepping = last is not None and last.phase == Phase.TRAINING\n",
            ),
        ),
        ATTEMPT_TESTS,
    ),
    Break(
        "B4",
        "the hang kill signals the launcher (agent) only, not its process tree",
        "tasks/attempt.py",
        (
            (
                "            attempt.end(timeouts.grace_s, preempt=True)\n",
                "            [os.kill(n.pids()[0], signal.SIGTERM) for n in attempt.nodes]\n",
            ),
        ),
        ATTEMPT_TESTS,
    ),
    Break(
        "B4b",
        "ending an attempt signals each launcher only (the rank and tree sweeps stay)",
        "tasks/local_node.py",
        (
            (
                "        signalled = processes.terminate_tree"
                "(self.proc.pid, grace_s, first, reap=self.proc.poll)\n",
                "        self.proc.send_signal(first)\n        signalled: list[int] = []\n",
            ),
        ),
        ATTEMPT_TESTS,
    ),
    Break(
        "B5",
        "hang detection switched off",
        "tasks/attempt.py",
        (
            (
                "        if (stepping and now - last_change > timeouts.hang_s) or (\n",
                "        if (False and stepping and now - last_change > timeouts.hang_s) or (\n",
            ),
        ),
        ATTEMPT_TESTS,
    ),
    Break(
        "B6",
        "manifest written before the upload",
        "trainer/checkpoint/commit.py",
        (
            (
                "            if self.remote:\n"
                "                for name, path in files:\n"
                "                    storage.put_file(path, storage.join(url, name))\n"
                "            self.on_phase(CheckpointPhase.UPLOADED, step)\n",
                "",
            ),
            (
                "                self._commit(step, url, anchor, nonce)\n",
                "                self._commit(step, url, anchor, nonce)\n"
                "            if self.remote:\n"
                "                for name, path in files:\n"
                "                    storage.put_file(path, storage.join(url, name))\n",
            ),
        ),
        CHECKPOINT_TESTS,
    ),
    Break(
        "B7",
        "the pool hands a parked agent to a job imported under other settings",
        "tasks/agent_pool.py",
        (
            (
                "        mismatch = agent_protocol.import_env_mismatch("
                'self.env, request.get("env", {}))\n',
                "        mismatch = None\n",
            ),
        ),
        POOL_TESTS,
    ),
    Break(
        "B8",
        "a claimed agent still dies with its pool",
        "trainer/launch.py",
        (("    die_with_parent(0)  # the pool no longer decides when this process ends\n", ""),),
        POOL_TESTS,
    ),
    Break(
        "B9",
        "the ranks read the agreed flags swapped: a clock checkpoint stops the job as preempted",
        "trainer/consensus.py",
        (
            (
                "            agreed = Agreed(bool(self._flags[0]), bool(self._flags[1]), "
                "bool(self._flags[2]))\n",
                "            agreed = Agreed(bool(self._flags[1]), bool(self._flags[0]), "
                "bool(self._flags[2]))\n",
            ),
        ),
        RECOVERY_TESTS,
    ),
    Break(
        "B10",
        "a standby restores before it is promoted (the commit it resumes from may be old)",
        "trainer/init_stages.py",
        (
            (
                "    S.RESTORE: (S.PREPROC_CREATION, S.TRAIN_MODULE_CREATION, S.INIT_PLUGINS, "
                "S.PROMOTION),\n",
                "    S.RESTORE: (S.PREPROC_CREATION, S.TRAIN_MODULE_CREATION, S.INIT_PLUGINS),\n",
            ),
        ),
        RECOVERY_TESTS,
    ),
    Break(
        "B11",
        "after a restore fallback the first batch is fetched again from the peeked position",
        "trainer/init_stages.py",
        (("        self.loader.load_state_dict(resume.loader or START_POSITION)\n", ""),),
        RECOVERY_TESTS,
    ),
    Break(
        "B12",
        "an in-process restart leaves the data loader where the failed step left it",
        "trainer/checkpoint/checkpointer.py",
        (("            states.load_rank_state(resume.rank_state or {})\n", ""),),
        (*RECOVERY_TESTS, "tests/trainer/test_run_options.py"),
    ),
    Break(
        "B13",
        "a ledger spool whose recovery upload failed is deleted all the same",
        "infra/accounting/ledger.py",
        (
            (
                "                completed.append(url)\n"
                "            else:\n"
                "                done = False\n",
                "                completed.append(url)\n",
            ),
        ),
        ("tests/infra/test_ledger.py",),
    ),
    Break(
        "B14",
        "a commit's retention is not told which checkpoint was just committed",
        "trainer/checkpoint/commit.py",
        (("                keep=url,\n", ""),),
        CHECKPOINT_TESTS,
    ),
    Break(
        "B15",
        "the publish gate adds the champion margin instead of subtracting it",
        "publish/registry.py",
        (("    return auc >= champ.auc - margin\n", "    return auc >= champ.auc + margin\n"),),
        GATE_TESTS,
    ),
    Break(
        "B16",
        "the publish gate promotes only a strictly better candidate (an equal one stays)",
        "publish/registry.py",
        (("    return auc >= champ.auc - margin\n", "    return auc > champ.auc - margin\n"),),
        GATE_TESTS,
    ),
    Break(
        "B17",
        "a champion that could not be re-scored is replaced by any candidate",
        "publish/registry.py",
        (
            (
                "        return False  # cannot show the new model is not worse\n",
                "        return True  # cannot show the new model is not worse\n",
            ),
        ),
        GATE_TESTS,
    ),
    Break(
        "B20",
        "a process's times are taken from its wall clock (the monotonic readings ignored)",
        "infra/accounting/clocks.py",
        (("            t = m + offset\n", "            t = w\n"),),
        CLOCK_TESTS,
    ),
    Break(
        "B21",
        "a line may hold a time later than the lines written after it",
        "infra/accounting/clocks.py",
        (
            (
                "            hi = statistics.median(later) + tol if later else math.inf\n",
                "            hi = math.inf\n",
            ),
        ),
        CLOCK_TESTS,
    ),
    Break(
        "B22",
        "the processes of one host keep their own offsets (not aligned to its newest one)",
        "infra/accounting/clocks.py",
        (
            (
                "            by_domain[src.clock.domain].append(src)\n",
                "            by_domain[src.clock.source].append(src)\n",
            ),
        ),
        CLOCK_TESTS,
    ),
    Break(
        "B23",
        "a resume does not record the newer checkpoints it skipped",
        "trainer/checkpoint/resume.py",
        (
            (
                "    skipped = [s.to_json() for s in restored.skipped]\n",
                "    skipped: list[dict[str, Any]] = []\n",
            ),
        ),
        RECOVERY_TESTS,
    ),
    Break(
        "B24",
        "every redone step after a fallback is counted as redone because of it",
        "infra/accounting/ett.py",
        (("            if r.step < e.step <= newest:\n", "            if r.step < e.step:\n"),),
        ("tests/infra/test_ett.py",),
    ),
    Break(
        "B25",
        "a standby known only by its standby_lost mark is taken for an attempt",
        "infra/accounting/standby.py",
        (("    standby = set(ready) | set(lost)\n", "    standby = set(ready)\n"),),
        ("tests/infra/test_ett.py",),
    ),
    Break(
        "B26",
        "standbys that keep dying are replaced for ever",
        "tasks/orchestrator.py",
        (
            (
                "        return self.config.recovery.standby and self._standby_losses < "
                "MAX_STANDBY_LOSSES\n",
                "        return self.config.recovery.standby\n",
            ),
        ),
        ATTEMPT_TESTS,
    ),
    Break(
        "B27",
        "a standby that died is not forgotten: no replacement, and the dead one is promoted",
        "tasks/orchestrator.py",
        (
            (
                "            return\n"
                "        self._standby = None\n"
                "        seen = standby.progress()\n",
                "            return\n        seen = standby.progress()\n",
            ),
        ),
        ATTEMPT_TESTS,
    ),
    Break(
        "B18",
        "a parked agent's code fingerprint covers each file's path and size, not its content",
        "infra/agent_protocol.py",
        (("            h.update(data)\n", ""),),
        (
            "tests/tasks/test_agent_pool.py::test_what_a_parked_agent_must_share_with_its_job",
            "tests/tasks/test_agent_pool.py::"
            "test_a_same_size_edit_with_its_mtime_kept_changes_the_fingerprint",
        ),
    ),
    Break(
        "B28",
        "a node run whose heartbeat went silent is never found lost",
        "tasks/remote_node.py",
        (
            (
                "        if run.lost is None and run.beat is not None and now - run.beat_seen",
                "        if False and run.beat is not None and now - run.beat_seen",
            ),
        ),
        FLEET_TESTS,
    ),
    Break(
        "B29",
        "an attempt launches on the spares first, keeping the nodes that ran it parked",
        "tasks/remote_node.py",
        (
            (
                "    return run.spare, run.status is not None and run.status.warm is False\n",
                "    return not run.spare, run.status is not None and run.status.warm is False\n",
            ),
        ),
        FLEET_TESTS,
    ),
    Break(
        "B30",
        "a node run never finds its orchestrator gone (it outlives the job)",
        "tasks/node_runner.py",
        (
            (
                "return now - self._orchestrator_seen > self.config.recovery.node_timeout_s",
                "return False",
            ),
        ),
        FLEET_TESTS,
    ),
    Break(
        "B31",
        "a lost node run is forgotten but not cancelled (its flow run keeps its host)",
        "tasks/remote_node.py",
        (
            (
                "run.key, host, run.lost)\n                self.runs.cancel(run.run_id)\n",
                "run.key, host, run.lost)\n",
            ),
        ),
        FLEET_TESTS,
    ),
    Break(
        "B32",
        "the spare used up by a node loss is replaced at once, competing with the relaunch",
        "tasks/remote_node.py",
        (
            (
                "                self._spares_after = self._launched\n",
                "                pass\n",
            ),
        ),
        FLEET_TESTS,
    ),
    Break(
        "B40",
        "a standby parked host-side builds its model on the device before it parks",
        "trainer/init_stages.py",
        (
            (
                "DEVICE_STAGES = (S.TRAIN_MODULE_CREATION, S.COMPILE)",
                "DEVICE_STAGES = (S.COMPILE,)",
            ),
        ),
        PARK_TESTS,
    ),
    Break(
        "B41",
        "a standby parked host-side makes the device current (its CUDA context) before it parks",
        "trainer/init_stages.py",
        (
            (
                "            binds = not late or order.index(key) > gate\n",
                "            binds = True\n",
            ),
        ),
        PARK_TESTS,
    ),
    Break(
        "B45",
        "a finished job's id runs again (an empty attempt, idle time lost, its anchor re-sent)",
        "tasks/job_identity.py",
        (("    if finished(resolved.layout):\n", "    if False:\n"),),
        ("tests/tasks/test_job_identity.py",),
    ),
    Break(
        "B46",
        "a start without a job id continues the newest job instead of starting a new one",
        "tasks/job_identity.py",
        (("    if job_id is None and resume:\n", "    if job_id is None:\n"),),
        ("tests/tasks/test_job_identity.py",),
    ),
    Break(
        "B47",
        "the ETT headline's section sorts ahead of the training curves in MLflow's metrics tab",
        "infra/tracking/metrics.py",
        (('WALL_TIME = "wall_time/"\n', 'WALL_TIME = "ett/"\n'),),
        ("tests/infra/test_tracking.py",),
    ),
    Break(
        "B48",
        "the run's eval points of earlier steps are linked to an anchor's LoggedModel too",
        "infra/tracking/logged_models.py",
        (("        if m.step == step\n", "        if m.step <= step\n"),),
        ("tests/infra/test_tracking.py",),
    ),
    Break(
        "B49",
        "an anchor rewritten at the same URL reuses the old checkpoint's LoggedModel",
        "infra/tracking/logged_models.py",
        (
            (
                "        found += [m for m in page if m.params.get(KEY_PARAM) == ckpt.key]\n",
                "        found += list(page)\n",
            ),
        ),
        ("tests/infra/test_tracking.py",),
    ),
    Break(
        "B50",
        "the anchor event leaves its train flow run out (the publish run links back to none)",
        "tasks/events.py",
        (
            (
                '"mlflow_run_id": mlflow_run_id,\n        "train_flow_run_id": train_flow_run_id,',
                '"mlflow_run_id": mlflow_run_id,\n        "train_flow_run_id": None,',
            ),
        ),
        ("tests/tasks/test_artifacts.py",),
    ),
    Break(
        "B51",
        "the publish gate table shows a kept candidate as promoted to champion",
        "tasks/artifacts.py",
        (
            (
                '    return "promoted to champion" if gate["promoted"] else "kept as candidate"\n',
                '    return "promoted to champion"\n',
            ),
        ),
        ("tests/tasks/test_artifacts.py",),
    ),
    Break(
        "B53",
        "a rank's line reaches the Prefect run at INFO whatever its level",
        "tasks/local_node.py",
        (
            (
                '                self.log.log(level, "%s%s", self.prefix, message)\n',
                '                self.log.info("%s%s", self.prefix, message)\n',
            ),
        ),
        ("tests/infra/test_log_lines.py",),
    ),
    Break(
        "B54",
        "library noise is shown by every rank and attempt, not once per job",
        "infra/library_logs.py",
        (("        if not self.first_of_job or rule in self.seen:\n", "        if False:\n"),),
        ("tests/infra/test_log_lines.py", "tests/infra/test_library_logs.py"),
    ),
    Break(
        "B55",
        "a job whose first attempt loaded a warm compile cache is said to have compiled cold",
        "infra/accounting/cold_start.py",
        (('    if cold.status != "miss" or', '    if cold.status == "off" or'),),
        ("tests/infra/test_cold_start.py",),
    ),
    Break(
        "B56",
        "an in-memory copy is loaded without checking its digest: a torn copy is restored",
        "trainer/checkpoint/memory_tier.py",
        (
            (
                "        if _digest(body) != header.digest:\n",
                "        if False:\n",
            ),
        ),
        MEMORY_TIER_TESTS,
    ),
    Break(
        "B57",
        "an in-memory copy older than the newest durable commit is restored (work thrown away)",
        "trainer/checkpoint/resume.py",
        (("        if copy.step < durable:\n", "        if copy.step < 0:\n"),),
        MEMORY_TIER_TESTS,
    ),
    Break(
        "B58",
        "every in-memory copy overwrites the same slot: a kill mid-copy leaves no whole copy",
        "trainer/checkpoint/memory_tier.py",
        (
            (
                "            slot = Slot.B if newest is not None and newest.slot == Slot.A "
                "else Slot.A\n",
                "            slot = Slot.A\n",
            ),
        ),
        MEMORY_TIER_TESTS,
    ),
    Break(
        "B59",
        "the orchestrator leaves an ended job's in-memory copies in /dev/shm",
        "tasks/orchestrator.py",
        (("            memory_tier.remove_segments(self.layout)\n", "            pass\n"),),
        (
            "tests/reliability/test_cleanup.py::test_a_job_out_of_retries_leaves_nothing",
            "tests/reliability/test_cleanup.py::test_a_rank_killed_mid_upload_to_s3_leaves_no_spool",
        ),
    ),
    Break(
        "B61",
        "every rank takes the first share of each global batch (rows read twice, others never)",
        "trainer/data/loader.py",
        (("        lo = self.rank * self.rank_batch\n", "        lo = 0\n"),),
        ("tests/trainer/test_data.py",),
    ),
    Break(
        "B62",
        "a rank beyond the checkpoint's writers asks for an RNG state of its own (none saved)",
        "trainer/checkpoint/restore.py",
        (
            (
                "    mine, src = rng_key(rank), rng_key(rank % written_by)\n",
                "    mine, src = rng_key(rank), rng_key(rank)\n",
            ),
        ),
        ("tests/trainer/checkpoint/test_reshard_state.py",),
    ),
    Break(
        "B66",
        "retention deletes the base and links a kept delta needs (chains broken)",
        "trainer/checkpoint/retention.py",
        (("    needed = needed_steps(kept, committed)\n", "    needed: set[int] = set()\n"),),
        INCREMENTAL_TESTS,
    ),
    Break(
        "B67",
        "composing a delta writes none of its rows: the tables stay at the base",
        "trainer/checkpoint/delta.py",
        (
            (
                "                    target.index_copy_(0, ids, rows)\n",
                "                    pass\n",
            ),
        ),
        INCREMENTAL_TESTS,
    ),
    Break(
        "B68",
        "a delta links to a save that did not commit on every rank",
        "trainer/checkpoint/delta.py",
        (("        elif not previous_ok:\n", "        elif False:\n"),),
        INCREMENTAL_TESTS,
    ),
    Break(
        "B69",
        "after a restore the next commit is a delta of rows tracked since another state",
        "trainer/checkpoint/delta.py",
        (("        self.previous = None\n", "        pass\n"),),
        INCREMENTAL_TESTS,
    ),
    Break(
        "B71",
        "a health check that never answers takes its slot for usable",
        "tasks/health.py",
        (('Verdict(slot, False, f"no answer within', 'Verdict(slot, True, f"no answer within'),),
        HEALTH_TESTS,
    ),
    Break(
        "B72",
        "recovery.min_ranks ignored: a lost slot fails the job instead of shrinking it",
        "tasks/orchestrator.py",
        (
            (
                "        minimum = self.config.recovery.min_ranks or launched\n",
                "        minimum = launched\n",
            ),
        ),
        CAPACITY_DECISION_TESTS,
    ),
    Break(
        "B73",
        "lost slots are never probed again: a device that returns is never regained",
        "tasks/health.py",
        (("            self.recheck_lost()\n", "            pass\n"),),
        HEALTH_TESTS,
    ),
    Break(
        "B74",
        "a trainer's ranks without an orchestrator number the attempt each by its own files",
        "infra/lease.py",
        (
            (
                "        yield attempt if held.attempt is None else held.attempt\n",
                "        yield attempt\n",
            ),
        ),
        ("tests/reliability/test_job_lease.py",),
    ),
    Break(
        "B75",
        "a job left with exactly min_nodes nodes (or min_ranks ranks) fails instead of going on",
        "tasks/orchestrator.py",
        (("        if left >= minimum:\n", "        if left > minimum:\n"),),
        NODE_CAPACITY_TESTS,
    ),
    Break(
        "B76",
        "the grow-back kills the smaller attempt instead of preempting it (no commit to grow from)",
        "tasks/remote_node.py",
        (
            (
                "        self.fleet.order(self.run, Order(0, OrderKind.END, preempt=True, "
                "grace_s=grace_s))\n",
                "        self.fleet.order(self.run, Order(0, OrderKind.END, preempt=False, "
                "grace_s=grace_s))\n",
            ),
        ),
        NODE_CAPACITY_TESTS,
    ),
    Break(
        "B77",
        "a relaunch counts parked spares as nodes: more nodes than the job was launched with",
        "tasks/orchestrator.py",
        (
            (
                "            lambda: min(fleet.parked(), launched), launched, minimum, "
                '"nodes", "min_nodes"\n',
                '            lambda: fleet.parked(), launched, minimum, "nodes", "min_nodes"\n',
            ),
        ),
        NODE_CAPACITY_TESTS,
    ),
    Break(
        "B78",
        "a node run launches the config's node count, not its order's (a shrunk launch waits)",
        "tasks/node_runner.py",
        (
            (
                "        return dataclasses.replace(self.spec, nnodes=launch.nnodes)\n",
                "        return self.spec\n",
            ),
        ),
        NODE_CAPACITY_TESTS,
    ),
    Break(
        "B79",
        "a copy whose tensors changed in place while it was made is written (a torn state)",
        "trainer/checkpoint/checkpointer.py",
        (
            (
                "        changed = inflight.guard.changed() if inflight.guard is not None else 0\n",
                "        changed = 0\n",
            ),
        ),
        (*MEMORY_TIER_TESTS, "tests/trainer/checkpoint/test_checkpointer.py"),
    ),
    Break(
        "B80",
        "a model with buffers (BatchNorm) copies its state while the forward changes them",
        "trainer/checkpoint/checkpointer.py",
        (("        if buffers:\n", "        if False:\n"),),
        MEMORY_TIER_TESTS,
    ),
    Break(
        "B81",
        "the step no longer waits for the copy before backward (copies span the update)",
        "trainer/train.py",
        (("        before_update()\n", "        pass\n"),),
        ("tests/trainer/test_train_step.py",),
    ),
    Break(
        "B82",
        "priming the compiler records the tiny function's artifacts (a job saves them)",
        "trainer/compiled.py",
        (
            (
                "        with CacheArtifactManager.with_fresh_cache():\n",
                "        with contextlib.nullcontext():\n",
            ),
            ("import inspect\n", "import contextlib\nimport inspect\n"),
        ),
        ("tests/trainer/test_startup.py",),
    ),
    Break(
        "B83",
        "a short gather write of a copy is not finished (the slot keeps a hole)",
        "trainer/checkpoint/memory_tier.py",
        (("        if written < size:  # a short write", "        if False:  # a short write"),),
        ("tests/trainer/checkpoint/test_memory_tier.py",),
    ),
    Break(
        "B84",
        "a single node also skips the rendezvous's fixed retry back-off",
        "trainer/launch.py",
        (("        if not isinstance(seconds, tuple):\n", "        if False:\n"),),
        ("tests/trainer/test_launch.py",),
    ),
    Break(
        "B85",
        "start's frozen objects are not thawed at exit (Triton reports them as leaked)",
        "trainer/gc_policy.py",
        (("        atexit.register(gc.unfreeze)\n", ""),),
        ("tests/trainer/test_gc_policy.py",),
    ),
    Break(
        "B86",
        "a started rank does not freeze: every later full collection walks torch's objects",
        "trainer/gc_policy.py",
        (("    gc.freeze()\n", ""),),
        ("tests/trainer/test_gc_policy.py",),
    ),
    Break(
        "B87",
        "the collector stays off once the rank has started (cyclic garbage is never freed)",
        "trainer/gc_policy.py",
        (("    gc.enable()\n", ""),),
        ("tests/trainer/test_gc_policy.py",),
    ),
)


def apply(brk: Break) -> str:
    """Edit the file; returns its original text."""
    path = ROOT / brk.path
    original = path.read_text()
    text = original
    for old, new in brk.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{brk.key}: its text is not in {brk.path} once; update the break")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def run(brk: Break) -> tuple[list[str], str, float]:
    """The failing tests (node ids), pytest's summary line and the seconds it took."""
    original = apply(brk)
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [*PYTEST, *brk.tests], cwd=ROOT, capture_output=True, text=True, check=False
        )
    finally:
        (ROOT / brk.path).write_text(original)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, flags=re.M)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    return failed, summary, time.monotonic() - started


def main(argv: list[str]) -> int:
    chosen = [b for b in BREAKS if not argv or b.key in argv]
    paths = sorted({b.path for b in chosen})
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True, text=True
    ).stdout
    if dirty.strip():
        print(f"uncommitted changes in files a break edits:\n{dirty}", file=sys.stderr)
        return 2
    print("| break | file | fast tests run | failing tests |\n|---|---|---|---|")
    holes = 0
    for brk in chosen:
        failed, summary, seconds = run(brk)
        holes += not failed
        names = "<br>".join(f"`{f.split('/')[-1]}`" for f in failed) or "**none: a hole**"
        tests = ", ".join(f"`{t}`" for t in brk.tests)
        print(f"| {brk.key}: {brk.what} | `{brk.path}` | {tests} | {names} |", flush=True)
        print(f"<!-- {brk.key}: {summary} ({seconds:.0f} s) -->", flush=True)
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
