"""Trainer initialisation: the init sub-stages of an attempt, one method each, each a ledger span.

The stages form a small dependency graph (``STAGE_DEPS``). With ``train.parallel_init`` each
stage runs on its own thread once the stages it needs are done (spans overlap; the ETT
report's InitBreakdown finds the critical path); otherwise they run one after another::

    device_init ─► process_group_init ─┬─► preproc_creation ─┬──────► get_first_batch_data
                                       │                     └───────────────────┐
                                       ├─► model_build ─► train_module_creation ─┼─► restore
                                       └─► init_plugins ─────────────────────────┘
               ─► compile_cache_load ─► compile (warm-up on a fast batch)

``model_build`` makes the model with nothing on a device (tables on "meta", dense layers in
host memory) and its sharding plan; ``train_module_creation`` puts it on the device
(DistributedModelParallel allocates and initialises this rank's shards).

``restore`` registers what a checkpoint holds with the checkpointer (model, optimizer, RNG,
the loader's position) and loads into it, so it waits for the loader to exist; it loads the
tensors only, the loader's position is ``get_first_batch_data``'s.

**Warm standby.** A standby attempt (``ETT_STANDBY=1``, started by the orchestrator while
another attempt trains) runs every stage that does not depend on the job's progress, then
parks at the ``promotion`` gate: a blocking read on its control pipe (infra/control.py), no
CPU. ``restore`` and ``get_first_batch_data`` wait for the gate, so once promoted the
standby only loads the newest committed checkpoint and its first batch. A cold attempt's
gate is open from the start.

**Where it parks** (``recovery.standby_park``, ``ParkPolicy``). Parked on the ``device``,
it has built, sharded and warmed up its model there: on a GPU that is a second CUDA context,
a second copy of the tables in device memory and a warm-up beside training. Parked on the
``host`` (``auto`` on a CUDA device), every stage that would touch the device
(``DEVICE_STAGES``: the train module, the compile warm-up) waits for the gate too, and no
stage before it makes the device current (``bind_device``: on CUDA, the context). The model
stays host-side (``model_build``) until the promotion, which comes once the failed
attempt's processes, and so their device memory, are gone. ``host`` can be forced on a
CPU, where the same path runs (and is tested).

* The first real batch is fetched while the model is restored: its data position comes from
  a peek at the checkpoint restore will pick (a small JSON file). If restore ends up
  elsewhere (the newest checkpoint is corrupt), the loader is re-positioned and the batch
  fetched again, so a resumed run is exact either way.
* Compilation is warmed up on a structurally identical copy of the dense interaction with a
  synthetic fast batch (trainer/compiled.py), after the shared compile cache has been loaded
  (trainer/compile_cache.py); it needs neither the process group nor the model. The
  ``compile_cache_load`` and ``compile`` stages are ``pre_train`` spans (with a ``stage``
  attr), as is ``restore``; the warm-up holds a nested ``compile`` span.
* Collectives before restore: only train_module_creation uses the default group; restore
  and checkpoints use their own gloo group.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingPlan

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark, ResumeHow, Span
from infra.control import Command, Phase, RankControl
from infra.settings import EvalMode, JobConfig, StandbyPark
from trainer import compile_cache, compiled
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.delta import embedding_tables
from trainer.checkpoint.resume import Resume, peek_resume
from trainer.checkpoint.state import train_states
from trainer.data.balance import make_balancer
from trainer.data.batch import Batch
from trainer.data.loader import START_POSITION, TrainLoader
from trainer.data.sequential import holdout_batches
from trainer.distributed import (
    DistEnv,
    bind_device,
    build_host_model,
    has_cuda_context,
    init_process_group,
    plan_summary,
    select_device,
    shard_train_module,
    sharding_plan,
)
from trainer.faults import FaultInjector
from trainer.model import RankingModel
from trainer.stage_graph import Stage, run_stages

log = logging.getLogger(__name__)


class InitStage(StrEnum):
    DEVICE_INIT = "device_init"
    PROCESS_GROUP_INIT = "process_group_init"
    PREPROC_CREATION = "preproc_creation"
    MODEL_BUILD = "model_build"
    TRAIN_MODULE_CREATION = "train_module_creation"
    INIT_PLUGINS = "init_plugins"
    COMPILE_CACHE_LOAD = "compile_cache_load"
    COMPILE = "compile"
    PROMOTION = "promotion"  # the standby gate; not a span
    RESTORE = "restore"
    GET_FIRST_BATCH_DATA = "get_first_batch_data"


S = InitStage
# Parallel mode. A standby's promotion gate depends on every stage before it (see
# ``Initializer.graph``); a cold attempt's has no dependency.
STAGE_DEPS: dict[InitStage, tuple[InitStage, ...]] = {
    S.DEVICE_INIT: (),
    S.PROCESS_GROUP_INIT: (S.DEVICE_INIT,),
    S.PREPROC_CREATION: (S.PROCESS_GROUP_INIT,),
    S.MODEL_BUILD: (S.PROCESS_GROUP_INIT,),  # the plan: a collective on the default group
    S.TRAIN_MODULE_CREATION: (S.MODEL_BUILD,),
    S.INIT_PLUGINS: (S.PROCESS_GROUP_INIT,),
    S.COMPILE_CACHE_LOAD: (S.DEVICE_INIT,),
    S.COMPILE: (S.COMPILE_CACHE_LOAD,),
    S.PROMOTION: (),
    S.RESTORE: (S.PREPROC_CREATION, S.TRAIN_MODULE_CREATION, S.INIT_PLUGINS, S.PROMOTION),
    S.GET_FIRST_BATCH_DATA: (S.PREPROC_CREATION, S.PROMOTION),
}
# Stages recorded as a ``pre_train`` span with a ``stage`` attr; the gate has no span.
PRE_TRAIN_STAGES = frozenset({S.COMPILE_CACHE_LOAD, S.COMPILE, S.RESTORE})
# The stages before the gate that put something on the device: a standby parked host-side
# runs them after its promotion.
DEVICE_STAGES = (S.TRAIN_MODULE_CREATION, S.COMPILE)


@dataclass(frozen=True)
class ParkPolicy:
    """Which init stages a standby runs before its promotion gate, from the job's
    ``recovery.standby_park`` and the device (``auto``: ``host`` on CUDA, else ``device``)."""

    park: StandbyPark  # HOST or DEVICE
    standby: bool

    @classmethod
    def resolve(cls, knob: StandbyPark, device: torch.device, standby: bool) -> ParkPolicy:
        if knob == StandbyPark.AUTO:
            knob = StandbyPark.HOST if device.type == "cuda" else StandbyPark.DEVICE
        return cls(knob, standby)

    @property
    def after_promotion(self) -> tuple[InitStage, ...]:
        """Stages held back until the gate, in their order (none for a cold attempt, whose
        gate is open, nor for a standby parked on the device)."""
        return DEVICE_STAGES if self.standby and self.park == StandbyPark.HOST else ()


@dataclass
class CompileState:
    """How the compiled step was prepared (for logs, tests and the benchmark)."""

    enabled: bool
    job_id: str | None = None  # compiler settings are per thread: see compiled.configure
    cache: compile_cache.CompileCache | None = None
    load: compile_cache.CacheResult | None = None
    warmup: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    watcher: compiled.RecompileWatcher | None = None
    vec_isa_ok: bool | None = None  # inductor's C++ ISA check, settled before compiling


@dataclass
class Components:
    """Everything the training loop needs, built by ``Initializer.run``."""

    env: DistEnv
    loader: TrainLoader
    batches: Iterator[Batch]
    first_batch: Batch | None
    model: torch.nn.Module
    optimizer: Any
    holdout: list[Batch]
    faults: FaultInjector
    checkpointer: Checkpointer
    control_group: dist.ProcessGroup
    start_step: int
    promoted: bool = False  # a standby the orchestrator promoted
    compile: CompileState = field(default_factory=lambda: CompileState(enabled=False))


class Initializer:
    """The init stages of one attempt; each method fills in typed attributes."""

    device: torch.device
    backend: str
    env: DistEnv
    checkpoint_group: dist.ProcessGroup  # DCP's background thread only
    control_group: dist.ProcessGroup  # CPU agreement on the training thread
    loader: TrainLoader
    park: ParkPolicy
    host_model: RankingModel  # model_build's: nothing on a device yet
    plan: ShardingPlan  # model_build's
    held_back: tuple[InitStage, ...] = ()  # stages this attempt runs only after its gate
    model: torch.nn.Module
    optimizer: Any
    holdout: list[Batch]
    faults: FaultInjector
    checkpointer: Checkpointer
    resume: Resume
    guess: Resume | None
    batches: Iterator[Batch]
    pending: Batch | None

    def __init__(self, config: JobConfig, ledger: Ledger, control: RankControl | None) -> None:
        self.config, self.ledger, self.control = config, ledger, control
        self.standby = control is not None and control.standby
        self.compile_state = CompileState(enabled=config.train.compile)
        self.promoted = False
        # Dynamo saves the global RNG state when it starts tracing a frame and sets it back
        # when it ends: a model initialised or a checkpoint's RNG restored on another thread
        # meanwhile would be undone. The stages that draw from or set that state, and the
        # compile warm-up, take turns on this lock (imports and loading still overlap).
        self._global_rng = threading.Lock()
        self._warm_copy: torch.nn.Module | None = None
        self._key_parts: dict[str, Any] = {}

    # -- the graph ---------------------------------------------------------------------------
    def graph(self) -> list[Stage]:
        """The stages in a valid serial order, with this attempt's dependencies."""
        order = list(InitStage)
        if not self.compile_state.enabled:
            order = [s for s in order if s not in (S.COMPILE_CACHE_LOAD, S.COMPILE)]
        late = [s for s in self.park.after_promotion if s in order]
        self.held_back = tuple(late)
        if late:  # parked host-side: the device's stages come after the gate
            order = [s for s in order if s not in late]
            gate = order.index(S.PROMOTION) + 1
            order[gate:gate] = late
        gate = order.index(S.PROMOTION)
        stages = []
        for key in order:
            deps = tuple(d for d in STAGE_DEPS[key] if d in order)
            if key == S.PROMOTION and self.standby:
                deps = tuple(order[:gate])
            if key in late:
                deps += (S.PROMOTION,)
            if key == S.GET_FIRST_BATCH_DATA and not self.config.train.parallel_init:
                deps += (S.RESTORE,)  # serial: the position comes from restore, no peek
            span = None if key == S.PROMOTION else Span.PRE_TRAIN
            attrs = {"stage": str(key)} if key in PRE_TRAIN_STAGES else {}
            if key not in PRE_TRAIN_STAGES and key != S.PROMOTION:
                span = Span(str(key))
            # Before a host-side gate no thread makes the device current (its CUDA context).
            binds = not late or order.index(key) > gate
            stages.append(Stage(str(key), span, getattr(self, str(key)), deps, attrs, binds))
        return stages

    def run(self) -> Components:
        """Run the graph (on threads, or in order); returns the components."""
        with self.ledger.span(Span.DEVICE_INIT, parallel=self.config.train.parallel_init) as a:
            self.device_init(a)
        stages = [s for s in self.graph() if s.key != S.DEVICE_INIT]
        try:
            run_stages(
                stages,
                self.ledger,
                self.config.train.parallel_init,
                self.device,
                done={S.DEVICE_INIT},
            )
        except BaseException:
            if hasattr(self, "loader"):  # its prefetch thread may be reading ahead
                self.loader.close()
            raise
        bind_device(self.device)  # the training thread's (parked host-side: its first time)
        self._settle_first_batch()
        if self.compile_state.enabled:
            self._finish_compile()
        return Components(
            env=self.env,
            loader=self.loader,
            batches=self.batches,
            first_batch=self.pending,
            model=self.model,
            optimizer=self.optimizer,
            holdout=self.holdout,
            faults=self.faults,
            checkpointer=self.checkpointer,
            control_group=self.control_group,
            start_step=self.resume.step,
            promoted=self.promoted,
            compile=self.compile_state,
        )

    # -- the stages --------------------------------------------------------------------------
    def device_init(self, attrs: dict[str, Any]) -> None:
        self.device, self.backend = select_device(self.config.train.backend)
        self.park = ParkPolicy.resolve(self.config.recovery.standby_park, self.device, self.standby)
        if not self.park.after_promotion:
            bind_device(self.device)
        if self.compile_state.enabled:
            parts = compile_cache.key_parts(self.config, self.device, compiled.compile_options())
            self._key_parts = parts
            self.compile_state.job_id = f"ett-{compile_cache.cache_key(parts)}"
            compiled.configure(self.compile_state.job_id)  # for this (the training) thread
            # Built here, before any other thread runs: it forks the global RNG stream.
            self._warm_copy = compiled.interaction_like(self.config)

    def process_group_init(self, attrs: dict[str, Any]) -> None:
        self.env = init_process_group(self.device, self.backend)
        # Checkpoint collectives run on their own CPU group: DCP's background thread must
        # never interleave with the training thread's collectives (and NCCL cannot do async
        # save at all). The training thread's own CPU agreement (preemption, in-process
        # restart) has a second one.
        self.checkpoint_group = dist.new_group(backend="gloo")
        self.control_group = dist.new_group(backend="gloo")

    def preproc_creation(self, attrs: dict[str, Any]) -> None:
        cfg = self.config
        self.loader = TrainLoader(
            cfg.data,
            self.env.rank,
            self.env.world_size,
            seed=cfg.train.seed,
            balancer=make_balancer(cfg, self.env),
        )

    def model_build(self, attrs: dict[str, Any]) -> None:
        with self._global_rng:  # seeds, and draws the dense layers' initial weights
            self.host_model = build_host_model(self.config)
        self.plan = sharding_plan(self.host_model, self.env)
        # Where the model is while a standby parks: "meta" (tables) and "cpu" (dense).
        attrs["model_devices"] = sorted({p.device.type for p in self.host_model.parameters()})

    def train_module_creation(self, attrs: dict[str, Any]) -> None:
        with self._global_rng:  # draws the table shards' initial weights
            self.model, self.optimizer = shard_train_module(
                self.config, self.env, self.host_model, self.plan
            )
        attrs["device"] = str(self.device)
        if self.compile_state.enabled:
            target = compiled.dense_module(self.model)
            copy = self._warm_copy
            if copy is not None and not compiled.same_structure(copy, target):
                log.warning(
                    "the warm-up copy differs from the model's interaction: the first step "
                    "will compile"
                )
            compiled.compile_in_place(target)

    def init_plugins(self, attrs: dict[str, Any]) -> None:
        cfg, env = self.config, self.env
        # Only the loop's own evaluation reads the holdout rows; with eval async the side
        # evaluator loads them, so a trainer that never evaluates skips reading them.
        self.holdout = []
        if cfg.train.eval == EvalMode.INLINE:
            self.holdout = holdout_batches(
                cfg.data, env.rank, env.world_size, cfg.train.eval_rows, cfg.data.eval_batch_size
            )
        self.faults = FaultInjector(cfg.faults, self.ledger.attempt, env.rank)
        self.checkpointer = Checkpointer(
            cfg,
            env.rank,
            env.world_size,
            self.ledger,
            self.checkpoint_group,
            self.faults.at_checkpoint_phase,
        )

    def compile_cache_load(self, attrs: dict[str, Any]) -> None:
        state = self.compile_state
        local_dir, created = compile_cache.setup_local_dir()
        if created:
            atexit.register(compile_cache.remove_local_dir, local_dir)  # after the save thread
        if self.config.train.compile_cache:
            root = compile_cache.cache_root(self.config)
            state.cache = compile_cache.CompileCache(root, self._key_parts, local_dir)
        state.watcher = compiled.RecompileWatcher(self.ledger).install()
        if state.cache is not None:
            state.load = state.cache.load()
            attrs.update(state.load.attrs("cache"), cache_key=state.cache.key, cache_url=root)
        else:
            attrs["cache_status"] = "off"

    def compile(self, attrs: dict[str, Any]) -> None:
        state = self.compile_state
        with self.ledger.span(Span.COMPILE, what="warmup") as span:
            try:
                compiled.configure(state.job_id)  # for this thread, which compiles
                if self.device.type == "cpu":  # inductor's settings are per thread too
                    known = state.load.vec_isa_ok if state.load is not None else None
                    state.vec_isa_ok = compiled.settle_vec_isa(known)
                    span["vec_isa_reused"] = known is not None
                    if state.cache is not None:
                        state.cache.vec_isa_ok = state.vec_isa_ok
                compiled.import_compiler()  # outside the lock: the other stages go on
                with self._global_rng:  # Dynamo sets the RNG state back after tracing
                    state.warmup = compiled.warm_up(
                        self.config,
                        self.device,
                        self._warm_copy,
                        eval_graph=self.config.train.eval == EvalMode.INLINE,
                    )
                span.update(state.warmup)
            except Exception as exc:  # the job trains eagerly rather than not at all
                state.error = f"{type(exc).__name__}: {exc}"
                log.warning("compile warm-up failed, training eagerly: %s", state.error)
                span["error"] = state.error[:500]
        attrs.update(state.warmup)

    def promotion(self, attrs: dict[str, Any]) -> None:
        """A standby parks here until the orchestrator promotes it (no span: a parked
        standby's time is not the job's)."""
        if not self.standby or self.control is None:
            return
        late = [str(s) for s in self.held_back]
        where: dict[str, Any] = {"park": str(self.park.park), "after_promotion": late}
        if (context := has_cuda_context(self.device)) is not None:
            where["cuda_context"] = context  # parked host-side: False (docs/recovery.md)
        self.ledger.mark(Mark.STANDBY_READY, **where)
        if self.env.is_main:
            self.control.report(Phase.PARKED)
        log.info("standby attempt %d ready: parked until promoted", self.ledger.attempt)
        msg = self.control.wait(Command.PROMOTE)
        if msg is None:
            raise StandbyReleased(f"standby attempt {self.ledger.attempt} was never promoted")
        self.promoted = True
        # The job's state as of the promotion: written by the orchestrator right before it.
        self.ledger.mark(Mark.PROMOTED, failures=self.control.job_state().failures)
        if self.env.is_main:
            self.control.report(Phase.INIT)
            log.info("standby attempt %d promoted", self.ledger.attempt)

    def restore(self, attrs: dict[str, Any]) -> None:
        # What every checkpoint of this attempt holds, registered once: the live objects,
        # loaded in place here and by an in-process restart (trainer/restart.py).
        states = train_states(self.model, self.optimizer, self.loader, self.env.rank)
        self.checkpointer.register(
            states, plan_summary(self.plan), embedding_tables(self.host_model)
        )
        how = ResumeHow.PROMOTED if self.promoted else ResumeHow.COLD
        with self._global_rng:  # sets the checkpoint's RNG state
            self.resume = self.checkpointer.restore(how)
        attrs["resumed_from_step"] = self.resume.step

    def get_first_batch_data(self, attrs: dict[str, Any]) -> None:
        # Serial: restore already ran. Parallel: peek at the checkpoint it will pick.
        guess = getattr(self, "resume", None)
        if guess is None:
            guess = peek_resume(self.config, self.env.rank, self.env.world_size)
        if guess is not None and guess.loader is not None:
            self.loader.load_state_dict(guess.loader)
        self.guess = guess
        self.batches = iter(self.loader)
        step = guess.step if guess is not None else 0
        self.pending = next(self.batches) if step < self.config.train.steps else None

    # -- after the graph ---------------------------------------------------------------------
    def _settle_first_batch(self) -> None:
        """The peek was wrong (restore fell back to an older checkpoint, or could not peek):
        re-position the loader and fetch the first batch again."""
        guess, resume = self.guess, self.resume
        if guess is not None and (guess.step, guess.loader) == (resume.step, resume.loader):
            return
        if self.pending is not None:
            self.loader.stats["rows"] -= len(self.pending)
            self.loader.stats["batches"] -= 1
        log.info("first batch re-fetched: restore resumed at step %d", resume.step)
        self.loader.load_state_dict(resume.loader or START_POSITION)
        self.batches = iter(self.loader)
        self.pending = next(self.batches) if resume.step < self.config.train.steps else None

    def _finish_compile(self) -> None:
        """Eager fallback if the warm-up failed; recompiles now count as training's; rank 0
        saves the compile cache in the background when it lacked something compiled here."""
        state = self.compile_state
        if state.error is not None:
            compiled.uncompile(compiled.dense_module(self.model))
            return
        if state.watcher is not None:
            state.watcher.phase = "train"
        if state.vec_isa_ok is not None:  # the training thread may recompile: same settings
            compiled.settle_vec_isa(state.vec_isa_ok)
        compiled_new = state.warmup.get("aot_cache_miss", 0) + state.warmup.get("fx_cache_miss", 0)
        hit = state.load is not None and state.load.status == "hit"
        if state.cache is not None and self.env.is_main and (not hit or compiled_new):
            state.cache.save_async()


class StandbyReleased(RuntimeError):
    """The orchestrator went away (or finished the job) before promoting this standby."""
