"""Fast start: the init stage graph runs independent stages concurrently (each its own span),
a standby parked host-side leaves the stages that touch the device for after its promotion,
and the compiled dense step never recompiles for batch sizes or jagged lengths."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from infra.accounting.ett import compute_report
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Span
from infra.accounting.ledger_read import read_events
from infra.job_layout import JobLayout
from infra.settings import StandbyPark
from tests.factories import tiny_config
from trainer import compiled
from trainer.data.batch import Batch
from trainer.distributed import has_cuda_context
from trainer.init_stages import STAGE_DEPS, Initializer, ParkPolicy
from trainer.model import RankingModel, batch_to_kjts
from trainer.stage_graph import Stage, run_stages

INDUCTOR_DIR = Path(tempfile.gettempdir()) / "ett-tests-inductor"


def sleeper(seconds: float, log: list[str]):
    def fn(attrs: dict) -> None:
        log.append(f"start {threading.current_thread().name}")
        time.sleep(seconds)
        attrs["slept"] = seconds

    return fn


def graph(log: list[str]) -> list[Stage]:
    return [
        Stage("process_group_init", Span.PROCESS_GROUP_INIT, sleeper(0.05, log)),
        Stage(
            "preproc_creation", Span.PREPROC_CREATION, sleeper(0.3, log), ("process_group_init",)
        ),
        Stage(
            "train_module_creation",
            Span.TRAIN_MODULE_CREATION,
            sleeper(0.3, log),
            ("process_group_init",),
        ),
        Stage(
            "restore",
            Span.PRE_TRAIN,
            sleeper(0.1, log),
            ("train_module_creation",),
            {"stage": "restore"},
        ),
        Stage("compile", Span.PRE_TRAIN, sleeper(0.4, log), (), {"stage": "compile"}),
        Stage(
            "get_first_batch_data",
            Span.GET_FIRST_BATCH_DATA,
            sleeper(0.1, log),
            ("preproc_creation",),
        ),
    ]


def overlap(a, b) -> bool:
    return a.start < b.end and b.start < a.end


@pytest.mark.parametrize("parallel", [True, False])
def test_stage_graph_overlaps_independent_stages(tmp_path, parallel):
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/job"))
    done = run_stages(graph([]), ledger, parallel=parallel)
    ledger.close()
    assert done == {s.key for s in graph([])}
    events = {
        e.attrs.get("stage", e.name): e for e in read_events(JobLayout.at(f"file://{tmp_path}/job"))
    }
    assert len(events) == 6
    for s in graph([]):  # every stage started after its dependencies ended
        for dep in s.deps:
            assert events[s.key].start >= events[dep].end
    if parallel:  # independent stages ran at the same time
        assert overlap(events["compile"], events["process_group_init"])
        assert overlap(events["preproc_creation"], events["train_module_creation"])
    else:  # one after another, in list order
        order = sorted(events.values(), key=lambda e: e.start)
        assert [e.attrs.get("stage", e.name) for e in order] == [s.key for s in graph([])]
        assert all(a.end <= b.start for a, b in zip(order, order[1:], strict=False))


def test_stage_error_stops_the_graph_after_running_stages_finish(tmp_path):
    def boom(attrs: dict) -> None:
        time.sleep(0.05)
        raise ValueError("loader failed")

    log: list[str] = []
    stages = [
        Stage("compile", Span.PRE_TRAIN, sleeper(0.5, log), (), {"stage": "compile"}),
        Stage("preproc_creation", Span.PREPROC_CREATION, boom),
        Stage(
            "get_first_batch_data",
            Span.GET_FIRST_BATCH_DATA,
            sleeper(0.1, log),
            ("preproc_creation",),
        ),
    ]
    with pytest.raises(ValueError, match="loader failed"):
        run_stages(stages, Ledger(JobLayout.at(f"file://{tmp_path}/job")), parallel=True)
    names = [
        e.attrs.get("stage", e.name) for e in read_events(JobLayout.at(f"file://{tmp_path}/job"))
    ]
    assert "compile" in names  # the running compile stage was waited for: its span is written
    assert log == ["start init-compile"]  # nothing started after the failure


def test_stage_spans_feed_the_init_breakdown(tmp_path):
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/job"))
    with ledger.span(Span.DEVICE_INIT):
        pass
    run_stages(graph([]), ledger, parallel=True)
    with ledger.span(Span.TRAIN_STEP, step=1):
        pass
    ledger.close()
    report = compute_report(read_events(JobLayout.at(f"file://{tmp_path}/job")))
    init = report.init[0]
    assert init.union_s < init.sum_s  # stages overlapped
    assert "pre_train" in init.critical_path
    assert report.time_to_start_s == pytest.approx(init.wall_s)
    assert set(STAGE_DEPS) >= {s.key for s in graph([])}


def random_batch(config, size: int, max_history: int, gen: torch.Generator) -> Batch:
    data = config.data
    lengths = torch.randint(0, max_history + 1, (size,), generator=gen)
    offsets = torch.zeros(size + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return Batch(
        dense=torch.randn(size, data.num_dense, generator=gen),
        cat=torch.stack(
            [torch.randint(0, v, (size,), generator=gen) for v in data.cat_vocab_sizes], dim=1
        ),
        item=torch.randint(0, data.item_vocab_size, (size,), generator=gen),
        history_values=torch.randint(0, data.item_vocab_size, (int(offsets[-1]),), generator=gen),
        history_offsets=offsets,
        labels=torch.randint(0, 2, (size,), generator=gen).float(),
    )


@pytest.mark.slow
def test_no_recompiles_across_batch_sizes_and_jagged_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_DIR))
    config = tiny_config(tmp_path, train={"compile": True})
    job = f"file://{tmp_path}/job"
    ledger = Ledger(JobLayout.at(job))
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    with torch.compiler.config.patch(unbacked_sources="", job_id=None):
        compiled.configure("ett-test")
        watcher = compiled.RecompileWatcher(ledger).install()
        try:
            torch.manual_seed(0)
            model = RankingModel(config.data, config.model)  # unsharded, on the CPU
            keys = list(model.state_dict())
            compiled.compile_in_place(compiled.dense_module(model))
            assert list(model.state_dict()) == keys  # checkpoints stay loadable eagerly
            compiled.warm_up(config, torch.device("cpu"))
            watcher.phase = "train"
            graphs = counters["stats"]["unique_graphs"]
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            # full batches, a short last batch, a single row; histories empty to long
            for size, max_history in [(64, 16), (40, 3), (1, 0), (64, 1), (7, 40), (64, 16)]:
                batch = random_batch(config, size, max_history, gen)
                sparse, history = batch_to_kjts(batch)
                logits = model(batch.dense, sparse, history)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                assert torch.isfinite(loss)
            model.eval()
            with torch.no_grad():
                for size in (256, 244, 1):
                    batch = random_batch(config, size, 16, gen)
                    model(batch.dense, *batch_to_kjts(batch))
            assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after warm-up

            # the watcher does mark a recompile, with its reason
            fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
            fn(torch.ones(2))
            fn(torch.ones(2, dtype=torch.float64))
        finally:
            watcher.uninstall()
            torch._logging.set_logs()
            torch._dynamo.reset()
    ledger.close()
    marks = [e for e in read_events(JobLayout.at(job)) if e.name == "recompile"]
    trained = [e.attrs for e in marks if e.attrs["phase"] == "train"]
    assert len(trained) == 1 and "dtype" in trained[0]["reason"], trained
    assert watcher.count == {"init": 1, "train": 1}  # init: the eval graph (grad mode off)


class _StandbyControl:
    """What the Initializer reads of a standby's control channel before it runs."""

    standby = True


@pytest.mark.parametrize(
    ("knob", "device", "park"),
    [
        ("auto", torch.device("cuda", 1), "host"),
        ("auto", torch.device("cpu"), "device"),
        ("host", torch.device("cpu"), "host"),  # forced on a CPU: the GPU host's code path
        ("device", torch.device("cuda", 1), "device"),
    ],
    ids=["auto-cuda", "auto-cpu", "host-cpu", "device-cuda"],
)
def test_a_standby_parked_host_side_leaves_the_device_stages_for_after_its_promotion(
    tmp_path: Path, knob: str, device: torch.device, park: str
) -> None:
    """Only the graph is built (no stage runs), so a CUDA device is named without a GPU."""
    config = tiny_config(tmp_path, train={"compile": True}, recovery={"standby_park": knob})
    init = Initializer(config, ledger=None, control=_StandbyControl())  # type: ignore[arg-type]
    init.park = ParkPolicy.resolve(config.recovery.standby_park, device, standby=True)
    stages = init.graph()
    keys = [s.key for s in stages]
    by_key = {s.key: s for s in stages}
    gate = keys.index("promotion")
    for i, stage in enumerate(stages):  # a valid serial order
        assert set(stage.deps) <= set(keys[:i]), stage.key
    on_device = {"train_module_creation", "compile"}
    assert set(keys[:gate]) >= {"preproc_creation", "model_build", "compile_cache_load"}
    assert set(keys[gate + 1 :]) >= {"restore", "get_first_batch_data"}
    if park == "host":
        assert init.park.park == StandbyPark.HOST
        assert [str(s) for s in init.held_back] == ["train_module_creation", "compile"]
        assert on_device <= set(keys[gate + 1 :])
        assert all("promotion" in by_key[k].deps for k in on_device)
        assert not on_device & set(by_key["promotion"].deps)
        # No thread before the gate makes the device current (on CUDA: its context).
        assert [s.key for s in stages if not s.binds_device] == keys[: gate + 1]
    else:
        assert init.park.park == StandbyPark.DEVICE and init.held_back == ()
        assert on_device <= set(by_key["promotion"].deps)
        assert all(s.binds_device for s in stages)


def test_a_cold_attempt_holds_nothing_back_whatever_the_park(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, recovery={"standby_park": "host"})
    policy = ParkPolicy.resolve(config.recovery.standby_park, torch.device("cuda", 0), False)
    assert policy.after_promotion == ()
    init = Initializer(config, ledger=None, control=None)  # type: ignore[arg-type]
    init.park = policy
    stages = init.graph()
    keys = [s.key for s in stages]
    assert keys.index("train_module_creation") < keys.index("promotion")
    assert all(s.binds_device for s in stages)


def test_a_cuda_context_is_asked_of_the_driver_only_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a GPU standby's ``standby_ready`` mark says (``cuda_context``); a CPU build of
    torch has no probe, so one is put in its place."""
    asked: list[int] = []

    def probe(index: int) -> bool:
        asked.append(index)
        return False

    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", probe, raising=False)
    assert has_cuda_context(torch.device("cpu")) is None and asked == []
    assert has_cuda_context(torch.device("cuda", 1)) is False and asked == [1]


def test_priming_the_compiler_does_its_once_per_process_work_and_leaves_nothing_else(
    monkeypatch,
):
    """A parked agent primes the compiler once for every rank it forks. What the ranks must
    inherit: the cache keys' source hashes and the vector-ISA probe, done. What they must
    not: the tiny function's artifacts (a job would save them into its shared cache), its
    graphs, or its thread's settings (one compile thread, an unsettled ISA check)."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch.compiler._cache import CacheArtifactManager

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_DIR))
    threads, isa_ok = inductor_config.compile_threads, inductor_config.cpp.vec_isa_ok
    codecache.torch_key.clear()  # recomputed on demand: clearing only forgets
    valid_vec_isa_list.cache_clear()
    torch._dynamo.reset()
    with CacheArtifactManager.with_fresh_cache():
        compiled.prime_compiler()
        assert torch.compiler.save_cache_artifacts() is None  # nothing recorded
    assert valid_vec_isa_list.cache_info().currsize == 1  # probed
    with pytest.raises(RuntimeError, match="already set"):
        codecache.torch_key.set(b"")  # hashed
    assert (inductor_config.compile_threads, inductor_config.cpp.vec_isa_ok) == (threads, isa_ok)
    assert torch._dynamo.convert_frame.FRAME_COUNTER == 0  # no frame of it left
