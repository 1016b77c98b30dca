"""The compiled part of the training step: the model's dense interaction under torch.compile.

Only ``DenseInteraction`` (everything after the sharded embedding lookups) is compiled, in
place with ``nn.Module.compile()``: no wrapper module, so state-dict keys do not change and a
checkpoint loads into an uncompiled model. The lookups stay eager.

Batch dimension: dim 0 of the interaction's inputs is marked *unbacked*
(``torch.compiler.config.unbacked_sources``), not merely dynamic. With a backed dynamic batch
inductor still guards on size-dependent choices (on CPU: decomposing tiny matmuls adds
``25 <= B``, the C++ reduction accumulator adds ``B <= 4096``; plus the 0/1 specialisation),
so a short last batch or a large eval batch would recompile. An unbacked size takes the
general branch without a guard: one training graph and one eval graph serve every batch size.
Jagged lengths never reach the interaction (the lookups pool them), so they cannot recompile it.

Warm-up: a structurally identical copy of the interaction, built from the config (no model,
no process group needed), is compiled and run forward+backward (train mode) and, when the
trainer evaluates inline, forward under no_grad (eval mode) on a synthetic *fast batch* with
the real shapes and dtypes. Dynamo keys its cache on the code object and treats parameters
as inputs, so the real module's first calls reuse the copy's compiled graphs (verified: no
further compile). Warming a copy never touches the DDP-managed parameters, and uses a private
RNG, so concurrent init stays deterministic.

Settings: since torch 2.13 ``torch.compiler.config`` values are per thread (ContextVars), so
``configure`` runs in every thread that compiles (the warm-up) or runs the step (the loop).

Recompiles: ``RecompileWatcher`` is a logging.Handler on torch's ``recompiles`` log artifact;
each recompilation becomes a ``recompile`` ledger mark carrying its guard-failure reason.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
from infra.settings import JobConfig
from trainer.model import DenseInteraction

log = logging.getLogger(__name__)

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


def dense_module(model: nn.Module) -> nn.Module:
    """The interaction module inside a RankingModel, DistributedModelParallel or DDP."""
    inner = getattr(model, "module", model)  # DMP.module: the unwrapped model
    inner = getattr(inner, "module", inner)  # a DDP around it
    return inner.interaction


def batch_sources(cls: type[nn.Module] = DenseInteraction) -> str:
    """Dynamo source names for dim 0 of each positional input of ``cls.forward``."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # not self
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return ",".join(f"L['{name}']:0" for name in names)


def compile_options() -> dict[str, Any]:
    """What the compiled code depends on besides the model and the software (cache key)."""
    return {
        "backend": "inductor",
        "target": DenseInteraction.__qualname__,
        "unbacked": batch_sources(),
        "dtype": "float32",
        "vec_isa_ok": "settled",  # see settle_vec_isa: part of inductor's own cache keys
    }


def settle_vec_isa(known: bool | None) -> bool:
    """Fix inductor's C++ vector-ISA check before anything compiles: reuse ``known`` (what
    the process that saved the compile cache found), else run the check once here.

    The check compiles a test file and loads it in a fresh interpreter per candidate ISA;
    repeated in every process it is a large part of a warm start on a small CPU host.
    Setting the flag in every process, cold or warm, keeps inductor's cache keys (which
    include it) equal, so the warm process still hits the cold one's graphs. Inductor's
    settings are per thread: call it in the thread that compiles."""
    from torch._inductor import config as inductor_config

    if known is None:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        known = bool(pick_vec_isa())
    inductor_config.cpp.vec_isa_ok = known
    return known


def import_compiler() -> None:
    """Import Inductor (and with it AOTAutograd: some 1,600 modules), which the warm-up needs
    first; a parked agent has already."""
    import torch._inductor.compile_fx  # noqa: F401


def prime_compiler() -> None:
    """Do the compiler's once-per-process work ahead of any job: the source hashes of its
    cache keys, the C++ vector-ISA probe, and the lazy setup of Dynamo, AOTAutograd and
    Inductor, by compiling a tiny function forward and backward.

    For a parked agent (trainer/launch.py), whose forked ranks inherit it all: their compile
    warm-up then only traces the model and loads its graphs. It runs on a thread of its own
    because inductor's settings are per thread, so its one compile thread (no worker pool
    to inherit across a fork) and its unsettled ISA check stay out of the caller's; and
    with a fresh artifact record, so the tiny function never reaches a job's shared cache.
    Best effort: a failure costs only the time it would have saved."""
    from torch._dynamo import reset
    from torch._inductor import config as inductor_config
    from torch.compiler._cache import CacheArtifactManager

    def run() -> None:
        inductor_config.compile_threads = 1
        with CacheArtifactManager.with_fresh_cache():
            fn = torch.compile(lambda x: (x * 2.0).sum())
            fn(torch.ones(4, requires_grad=True)).backward()

    failed: list[BaseException] = []

    def guarded() -> None:
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - reported below, never raised
            failed.append(exc)

    thread = threading.Thread(target=guarded, name="prime-compiler", daemon=True)
    thread.start()
    thread.join()
    reset()  # the tiny function's graphs and counters: a rank starts with none
    if failed:
        log.warning("compiler not primed (the first compile will do it): %s", failed[0])


def configure(job_id: str | None) -> None:
    """Compiler settings for the CALLING THREAD: since torch 2.13 ``torch.compiler.config``
    values live in ContextVars, so each thread that compiles (the warm-up) or runs the
    compiled step (the training loop) calls this before it does."""
    torch.compiler.config.unbacked_sources = compile_options()["unbacked"]
    if job_id and not os.environ.get("TORCH_COMPILE_JOB_ID"):
        # PGO profiles persist (in the inductor cache dir) only with a job id.
        torch.compiler.config.job_id = job_id


def interaction_like(config: JobConfig) -> DenseInteraction:
    """A module structurally identical to ``RankingModel(...).interaction`` (same shapes).

    Built under fork_rng so the global RNG stream, which seeds the real model, is untouched
    (call it before other threads use that stream: fork_rng saves and restores it).
    """
    num_vectors = len(config.data.cat_vocab_sizes) + 2  # categorical + item + history
    with torch.random.fork_rng(devices=[]):
        return DenseInteraction(config.data.num_dense, num_vectors, config.model)


def same_structure(a: nn.Module, b: nn.Module) -> bool:
    shapes = lambda m: [(k, tuple(v.shape), v.dtype) for k, v in m.state_dict().items()]
    return shapes(a) == shapes(b)


@dataclass(frozen=True)
class FastBatch:
    """Synthetic interaction inputs with the real batch's shapes and dtypes."""

    dense: torch.Tensor  # [B, num_dense] float32, no grad (a data tensor)
    sparse: torch.Tensor  # [B, F, D] float32, requires grad (pooled embeddings do)
    labels: torch.Tensor  # [B] float32 in {0, 1}


def fast_batch(
    config: JobConfig, batch_size: int, device: torch.device, train: bool, seed: int = 0
) -> FastBatch:
    gen = torch.Generator().manual_seed(seed)  # private: never the global stream
    num_vectors = len(config.data.cat_vocab_sizes) + 2
    dim = config.model.embedding_dim
    dense = torch.randn(batch_size, config.data.num_dense, generator=gen)
    sparse = torch.randn(batch_size, num_vectors, dim, generator=gen)
    labels = torch.randint(0, 2, (batch_size,), generator=gen).float()
    sparse = sparse.to(device).requires_grad_(train)
    return FastBatch(dense.to(device), sparse, labels.to(device))


def compile_in_place(module: nn.Module) -> nn.Module:
    """``module.compile()``: same object, same state-dict keys, compiled ``__call__``."""
    module.compile()
    return module


def uncompile(module: nn.Module) -> None:
    module._compiled_call_impl = None  # back to eager (compile failed)


def warm_up(
    config: JobConfig, device: torch.device, copy: nn.Module | None = None, eval_graph: bool = True
) -> dict:
    """Compile the training graph (forward + backward) and, with ``eval_graph``, the eval
    graph on a copy. A trainer that never evaluates (eval async or off: the side evaluator
    has its own model) leaves the eval graph out of its start.

    Returns timings and compile-cache hit/miss counts; raises what the compiler raises (the
    caller falls back to eager).
    """
    from torch._dynamo.utils import counters

    before = _cache_counts(counters)
    copy = interaction_like(config) if copy is None else copy
    copy = compile_in_place(copy.to(device).train())
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with torch.enable_grad():
        # A rank's share of the global batch: the shape its steps will have.
        world = max(int(os.environ.get("WORLD_SIZE", "1")), 1)
        b = fast_batch(config, max(config.data.batch_size // world, 1), device, train=True)
        logits = copy(b.dense, b.sparse)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
        loss.backward()  # AOTAutograd compiles the backward lazily: force it now
    timings["train_graph_s"] = time.perf_counter() - t0
    if eval_graph:
        t0 = time.perf_counter()
        copy.eval()
        with torch.no_grad():
            b = fast_batch(config, config.data.eval_batch_size, device, train=False, seed=1)
            copy(b.dense, b.sparse)
        timings["eval_graph_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after = _cache_counts(counters)
    timings.update({k: after[k] - before[k] for k in after})
    return timings


def _cache_counts(counters: Any) -> dict[str, int]:
    """Compile-cache hits and misses so far (AOTAutograd and inductor FX-graph caches)."""
    aot, ind = counters["aot_autograd"], counters["inductor"]
    return {
        "aot_cache_hit": aot["autograd_cache_hit"],
        "aot_cache_miss": aot["autograd_cache_miss"],
        "fx_cache_hit": ind["fxgraph_cache_hit"],
        "fx_cache_miss": ind["fxgraph_cache_miss"],
    }


class RecompileWatcher(logging.Handler):
    """Turns torch's ``recompiles`` log records into ``recompile`` ledger marks.

    ``phase`` tags each mark ("init" while warming up, "train" after) so tests and reports
    can tell the expected eval-graph compile of the warm-up from a recompile mid-training.
    """

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(level=logging.DEBUG)
        self.ledger = ledger
        self.phase = "init"
        self.count: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            lines = [line.strip() for line in text.splitlines()]
            reasons = [line[2:] for line in lines if line.startswith("- ")]
            where = lines[0].removeprefix("Recompiling function ") if lines else ""
            self.count[self.phase] = self.count.get(self.phase, 0) + 1
            self.ledger.mark(
                Mark.RECOMPILE,
                phase=self.phase,
                function=where[:200],
                reason="; ".join(reasons)[:1000],
            )
        except Exception:  # a log handler must never raise into the compiler
            self.handleError(record)

    def install(self) -> RecompileWatcher:
        if "TORCH_LOGS" not in os.environ:
            torch._logging.set_logs(recompiles=True)
        elif "recompiles" not in os.environ["TORCH_LOGS"]:
            log.warning("TORCH_LOGS is set without 'recompiles': recompiles are not marked")
        logging.getLogger(RECOMPILES_LOGGER).addHandler(self)
        return self

    def uninstall(self) -> None:
        logging.getLogger(RECOMPILES_LOGGER).removeHandler(self)
