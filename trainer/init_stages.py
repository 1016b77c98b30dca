"""Trainer initialisation: the L2 init sub-stages of a training attempt, each a ledger span.

The stages form a small dependency graph (``STAGE_DEPS``). With ``train.parallel_init``
each stage runs on its own thread as soon as its inputs are ready (spans overlap; the ETT
report's InitBreakdown finds the critical path); otherwise they run one after another in
the original order, compile last before the first batch::

    device_init ─► process_group_init ─┬─► preproc_creation ──────► get_first_batch_data
                                       ├─► train_module_creation ─┬─► pre_train[restore]
                                       └─► init_plugins ──────────┘
               ─► pre_train[compile_cache_load] ─► pre_train[compile] (warm-up, fast batch)

* The first real batch is fetched while the model is built and restored: its data position
  comes from a peek at the checkpoint restore will pick (a small JSON file). If restore
  ends up elsewhere (the newest checkpoint is corrupt), the loader is re-positioned and the
  batch fetched again, so a resumed run is exact either way.
* Compilation is warmed up on a structurally identical copy of the dense interaction with a
  synthetic fast batch (trainer/compiled.py), after the shared compile cache has been loaded
  (trainer/compile_cache.py); it needs neither the process group nor the model, so it runs
  from the start. The ``pre_train`` span of the warm-up holds a nested ``compile`` span.
* Collectives: only train_module_creation uses the default group before restore (which
  depends on it); restore and checkpoints use their own gloo group.
"""

from __future__ import annotations

import atexit
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from infra import storage
from infra.ledger import INIT_SPANS, Ledger
from infra.settings import JobConfig
from trainer import compile_cache, compiled
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.manifest import CheckpointError
from trainer.checkpoint.restore import candidates, check_compatible, restore
from trainer.checkpoint.retention import purge_uncommitted
from trainer.checkpoint.state import app_state, apply_loaded
from trainer.data.balance import make_balancer
from trainer.data.batch import Batch
from trainer.data.loader import TrainLoader, holdout_batches
from trainer.distributed import DistEnv, build_train_module, init_process_group, select_device
from trainer.faults import FaultInjector
from trainer.stage_graph import Stage, run_stages

log = logging.getLogger(__name__)

INITIAL_POSITION = {"epoch": 0, "shard_pos": 0, "row_offset": 0}

# The graph (parallel mode). Keys are span names, or a pre_train span's "stage" attr.
STAGE_DEPS: dict[str, tuple[str, ...]] = {
    "device_init": (),
    "process_group_init": ("device_init",),
    "preproc_creation": ("process_group_init",),
    "train_module_creation": ("process_group_init",),
    "init_plugins": ("process_group_init",),
    "restore": ("train_module_creation", "init_plugins"),
    "compile_cache_load": ("device_init",),
    "compile": ("compile_cache_load",),
    "get_first_batch_data": ("preproc_creation",),
}


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


@dataclass
class Components:
    """Everything the training loop needs, built by ``initialize``."""

    env: DistEnv
    loader: TrainLoader
    batches: Iterator[Batch]
    first_batch: Batch | None
    model: torch.nn.Module
    optimizer: Any
    holdout: list[Batch]
    faults: FaultInjector
    checkpointer: Checkpointer
    start_step: int
    compile: CompileState = field(default_factory=lambda: CompileState(enabled=False))


@dataclass(frozen=True)
class Resume:
    """Where training continues: the step done, the loader position (None: start)."""

    step: int = 0
    loader: dict[str, Any] | None = None
    url: str | None = None


# -- initialize -----------------------------------------------------------------------------
def initialize(config: JobConfig, ledger: Ledger) -> Components:
    """Run the init sub-stages (a graph on threads, or in order); returns the components."""
    parallel = config.train.parallel_init
    with ledger.span("device_init", parallel=parallel):
        device, backend = select_device(config.train.backend)
        state = CompileState(enabled=config.train.compile)
        copy, parts = None, {}
        if state.enabled:
            parts = compile_cache.key_parts(config, device, compiled.compile_options())
            state.job_id = f"ett-{compile_cache.cache_key(parts)}"
            compiled.configure(state.job_id)  # for this (the training) thread
            # Built here, before any other thread runs: it forks the global RNG stream.
            copy = compiled.interaction_like(config)

    def process_group(r: dict, attrs: dict) -> tuple[DistEnv, dist.ProcessGroup]:
        env = init_process_group(device, backend)
        # Checkpoint collectives run on their own CPU group: DCP's background thread must
        # never interleave with the training thread's collectives (and NCCL cannot do async
        # save at all).
        return env, dist.new_group(backend="gloo")

    def preproc(r: dict, attrs: dict) -> TrainLoader:
        env = r["process_group_init"][0]
        return TrainLoader(
            config.data,
            env.rank,
            env.world_size,
            seed=config.train.seed,
            balancer=make_balancer(config, env),
        )

    def train_module(r: dict, attrs: dict) -> tuple[torch.nn.Module, Any]:
        model, optimizer = build_train_module(config, r["process_group_init"][0])
        if state.enabled:
            target = compiled.dense_module(model)
            if copy is not None and not compiled.same_structure(copy, target):
                log.warning(
                    "the warm-up copy differs from the model's interaction: the "
                    "first step will compile"
                )
            compiled.compile_in_place(target)
        return model, optimizer

    def plugins(r: dict, attrs: dict) -> tuple[list[Batch], FaultInjector, Checkpointer]:
        env, ckpt_group = r["process_group_init"]
        holdout = holdout_batches(
            config.data,
            env.rank,
            env.world_size,
            config.train.eval_rows,
            config.data.eval_batch_size,
        )
        faults = FaultInjector(config.faults, ledger.attempt, env.rank)
        checkpointer = Checkpointer(
            config, env.rank, env.world_size, ledger, ckpt_group, faults.at_checkpoint_phase
        )
        return holdout, faults, checkpointer

    def restore_stage(r: dict, attrs: dict) -> Resume:
        env, ckpt_group = r["process_group_init"]
        model, optimizer = r["train_module_creation"]
        resume = restore_model(config, env, model, optimizer, ledger, ckpt_group)
        attrs["resumed_from_step"] = resume.step
        return resume

    def cache_load(r: dict, attrs: dict) -> compile_cache.CacheResult | None:
        _prepare_compile(config, ledger, state, parts)
        if state.cache is None:
            attrs["cache_status"] = "off"
            return None
        state.load = state.cache.load()
        attrs.update(state.load.attrs("cache"), cache_key=state.cache.key)
        return state.load

    def warm_up(r: dict, attrs: dict) -> None:
        with ledger.span("compile", what="warmup") as span:
            try:
                compiled.configure(state.job_id)  # for this thread, which compiles
                state.warmup = compiled.warm_up(config, device, copy)
                span.update(state.warmup)
            except Exception as exc:  # the job trains eagerly rather than not at all
                state.error = f"{type(exc).__name__}: {exc}"
                log.warning("compile warm-up failed, training eagerly: %s", state.error)
                span["error"] = state.error[:500]
        attrs.update(state.warmup)

    def first_batch(r: dict, attrs: dict) -> tuple[Resume | None, Iterator[Batch], Batch | None]:
        env = r["process_group_init"][0]
        loader: TrainLoader = r["preproc_creation"]
        # Serial: restore already ran. Parallel: peek at the checkpoint it will pick.
        guess = r["restore"] if "restore" in r else peek_resume(config, env)
        if guess is not None and guess.loader is not None:
            loader.load_state_dict(guess.loader)
        batches = iter(loader)
        step = guess.step if guess is not None else 0
        return guess, batches, next(batches) if step < config.train.steps else None

    # In serial order; "pre_train" stages carry their key as the span's "stage" attr.
    fns = {
        "process_group_init": process_group,
        "preproc_creation": preproc,
        "train_module_creation": train_module,
        "init_plugins": plugins,
        "restore": restore_stage,
        "compile_cache_load": cache_load,
        "compile": warm_up,
        "get_first_batch_data": first_batch,
    }
    keys = list(fns) if state.enabled else [k for k in fns if not k.startswith("compile")]
    stages = []
    for key in keys:
        deps = tuple(d for d in STAGE_DEPS[key] if d in keys)
        if key == "get_first_batch_data" and not parallel:
            deps += ("restore",)  # serial: the position comes from restore, no peek
        span = key if key in INIT_SPANS else "pre_train"
        attrs = {} if key in INIT_SPANS else {"stage": key}
        stages.append(Stage(key, span, fns[key], deps, attrs))
    results: dict[str, Any] = {}
    try:
        run_stages(stages, ledger, parallel, device, results)
    except BaseException:
        if "preproc_creation" in results:  # its prefetch thread may be reading ahead
            results["preproc_creation"].close()
        raise

    env, _ = results["process_group_init"]
    loader = results["preproc_creation"]
    model, optimizer = results["train_module_creation"]
    holdout, faults, checkpointer = results["init_plugins"]
    resume: Resume = results["restore"]
    guess, batches, pending = results["get_first_batch_data"]
    if guess is None or (guess.step, guess.loader) != (resume.step, resume.loader):
        # The peek was wrong (restore fell back to an older checkpoint, or could not peek):
        # re-position the loader and fetch the first batch again.
        if pending is not None:
            loader.stats["rows"] -= len(pending)
            loader.stats["batches"] -= 1
        log.info("first batch re-fetched: restore resumed at step %d", resume.step)
        loader.load_state_dict(resume.loader or INITIAL_POSITION)
        batches = iter(loader)
        pending = next(batches) if resume.step < config.train.steps else None
    if state.enabled:
        _finish_compile(state, model, env)
    return Components(
        env=env,
        loader=loader,
        batches=batches,
        first_batch=pending,
        model=model,
        optimizer=optimizer,
        holdout=holdout,
        faults=faults,
        checkpointer=checkpointer,
        start_step=resume.step,
        compile=state,
    )


def _prepare_compile(
    config: JobConfig, ledger: Ledger, state: CompileState, parts: dict[str, Any]
) -> None:
    """Local inductor cache dir, the shared cache and recompile marks: before any compile
    (only the warm-up compiles during init, and it waits for this)."""
    local_dir, created = compile_cache.setup_local_dir()
    if created:
        atexit.register(compile_cache.remove_local_dir, local_dir)  # after the save thread
    if config.train.compile_cache:
        root = compile_cache.cache_root(config)
        state.cache = compile_cache.CompileCache(root, parts, local_dir)
    state.watcher = compiled.RecompileWatcher(ledger).install()


def _finish_compile(state: CompileState, model: torch.nn.Module, env: DistEnv) -> None:
    """After init: eager fallback if the warm-up failed, recompiles now count as training's,
    and (rank 0, when the cache missed or lacked a graph) the compile cache is saved in the
    background while the first steps run."""
    if state.error is not None:
        compiled.uncompile(compiled.dense_module(model))
        return
    if state.watcher is not None:
        state.watcher.phase = "train"
    compiled_new = state.warmup.get("aot_cache_miss", 0) + state.warmup.get("fx_cache_miss", 0)
    hit = state.load is not None and state.load.status == "hit"
    if state.cache is not None and env.is_main and (not hit or compiled_new):
        state.cache.save_async()  # the cache lacked something this process compiled


# -- restore ---------------------------------------------------------------------------------
def peek_resume(config: JobConfig, env: DistEnv) -> Resume | None:
    """The step and data position restore will most likely continue from, read from the
    checkpoint's small JSON state only (no tensors, no checksums); None if unsure."""
    try:
        for ckpt in candidates(config):
            try:
                check_compatible(ckpt, config, env.world_size)
            except CheckpointError:
                continue  # restore skips it too (or fails the attempt)
            name = f"trainer_state.rank{env.rank:03d}.json"
            extra = json.loads(storage.read_text(storage.join(ckpt.url, name)))
            return Resume(int(extra["step"]), extra.get("loader"), ckpt.url)
        return Resume()
    except Exception as exc:  # only a guess: restore decides
        log.info("could not peek at the resume position: %s", exc)
        return None


def restore_model(
    config: JobConfig,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: Any,
    ledger: Ledger,
    group: dist.ProcessGroup,
) -> Resume:
    """Load the newest usable checkpoint into model, optimizer and RNG; returns where the
    loop and the data loader continue (the loader itself is left alone)."""
    if env.is_main:
        purge_uncommitted(config.job_url)
    dist.barrier(group=group)
    optimizer.init_state()  # materialise lazy optimizer state so it can be loaded in place
    state = app_state(model, optimizer, env.rank)
    restored = restore(config, state, env.rank, env.world_size, group)
    if restored is None:
        return Resume()
    if restored.warm_start:
        model.load_state_dict(state["model"])
        log.info("warm-started the model from %s", restored.checkpoint.url)
        return Resume()
    apply_loaded(model, optimizer, state, env.rank)
    step = int(restored.extra["step"])
    ledger.mark("resume", step=step, url=restored.checkpoint.url)
    if env.is_main:
        log.info("resumed from %s at step %d", restored.checkpoint.url, step)
    return Resume(step, restored.extra["loader"], restored.checkpoint.url)


def restore_state(
    config: JobConfig,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: Any,
    loader: TrainLoader,
    ledger: Ledger,
    group: dist.ProcessGroup,
) -> int:
    """Resume from the newest usable checkpoint; returns the step to continue after."""
    resume = restore_model(config, env, model, optimizer, ledger, group)
    if resume.loader is not None:
        loader.load_state_dict(resume.loader)
    return resume.step
