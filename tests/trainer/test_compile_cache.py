"""The shared compile cache: round trip, and every unusable cache skipped with a warning;
end to end, a job given a corrupt cache still trains (and leaves a good cache behind)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.exit_codes import ExitCode
from tests.factories import ROOT, run_trainer, tiny_config, write_dataset
from trainer import compile_cache, compiled
from trainer.compile_cache import MANIFEST, CompileCache, cache_key, key_parts

# Operator-set inductor dir shared by this suite's trainer runs: only the first compiles cold.
INDUCTOR_DIR = Path(tempfile.gettempdir()) / "ett-tests-inductor"
PARTS = {"format": 1, "torch": "x", "device": "cpu:test", "model": "m", "compile": {}}


def fake_local_dir(path: Path) -> Path:
    (path / "fxgraph" / "ab").mkdir(parents=True)
    (path / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (path / "ab").mkdir()
    (path / "ab" / "kernel.main.so").write_bytes(b"\x7fELF" + b"0" * 500)
    (path / "locks").mkdir()
    (path / "locks" / "x.lock").write_text("")
    return path


def test_round_trip_restores_the_dir_and_writes_the_manifest_last(tmp_path):
    root = f"file://{tmp_path}/cache"
    saver = CompileCache(root, PARTS, str(fake_local_dir(tmp_path / "a")))
    assert saver.save().status == "saved"
    names = storage.listdir(saver.url)
    assert MANIFEST in names and len(names) == 3
    manifest = json.loads(storage.read_text(storage.join(saver.url, MANIFEST)))
    assert manifest["key"] == cache_key(PARTS) and manifest["parts"] == PARTS

    fresh = tmp_path / "b"
    fresh.mkdir()
    result = CompileCache(root, PARTS, str(fresh)).load()
    assert result.status == "hit" and result.bytes > 0
    assert (fresh / "ab" / "kernel.main.so").read_bytes().startswith(b"\x7fELF")
    assert (fresh / "fxgraph" / "ab" / "entry").exists()
    assert not (fresh / "locks" / "x.lock").exists()  # lock files are never shipped

    assert saver.save().status == "saved"  # a second save replaces, and prunes, the blobs
    assert len(storage.listdir(saver.url)) == 3


LOAD_AND_SHOW_SOURCE_KEYS = """
import json, sys
from torch._inductor.codecache import torch_key
from trainer.compile_cache import CompileCache
result = CompileCache(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]).load()
print(json.dumps([result.status, result.source_keys_reused, torch_key().hex()]))
"""


def test_a_loading_process_takes_inductors_source_hashes_from_the_manifest(tmp_path):
    """The saver writes Inductor's hashes of torch's and Triton's sources; a fresh process
    loading the cache sets them (here, a stand-in value it could never compute) instead of
    hashing both packages again. A manifest without them: the process computes its own."""
    root = f"file://{tmp_path}/cache"
    saver = CompileCache(root, PARTS, str(fake_local_dir(tmp_path / "a")))
    assert saver.save().status == "saved"
    manifest_url = storage.join(saver.url, MANIFEST)
    manifest = json.loads(storage.read_text(manifest_url))
    assert manifest["source_keys"] == compile_cache.source_keys()

    def load_in_a_fresh_process(into: str) -> list:
        (tmp_path / into).mkdir()
        args = [root, json.dumps(PARTS), str(tmp_path / into)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, "-c", LOAD_AND_SHOW_SOURCE_KEYS, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    stand_in = "ab" * 32
    manifest["source_keys"]["torch"] = stand_in
    storage.write_text(manifest_url, json.dumps(manifest))
    assert load_in_a_fresh_process("b") == ["hit", True, stand_in]

    del manifest["source_keys"]
    storage.write_text(manifest_url, json.dumps(manifest))
    status, reused, computed = load_in_a_fresh_process("c")
    assert (status, reused) == ("hit", False) and computed == compile_cache.source_keys()["torch"]


def test_missing_cache_is_a_miss(tmp_path):
    result = CompileCache(f"file://{tmp_path}/none", PARTS, str(tmp_path)).load()
    assert result.status == "miss"


@pytest.mark.parametrize("damage", ["blob", "manifest", "parts", "missing_blob"])
def test_unusable_cache_is_skipped_with_a_warning(tmp_path, caplog, damage):
    root = f"file://{tmp_path}/cache"
    saver = CompileCache(root, PARTS, str(fake_local_dir(tmp_path / "a")))
    saver.save()
    manifest_url = storage.join(saver.url, MANIFEST)
    manifest = json.loads(storage.read_text(manifest_url))
    tar = storage.local_path(storage.join(saver.url, manifest["files"]["inductor"]["name"]))
    if damage == "blob":
        with open(tar, "r+b") as fh:
            fh.seek(100)
            fh.write(b"corrupt!")
    elif damage == "manifest":
        storage.write_text(manifest_url, "{not json")
    elif damage == "parts":
        manifest["parts"] = {**PARTS, "torch": "other"}
        storage.write_text(manifest_url, json.dumps(manifest))
    else:
        Path(tar).unlink()
    fresh = tmp_path / "b"
    fresh.mkdir()
    with caplog.at_level(logging.WARNING, logger="trainer.compile_cache"):
        result = CompileCache(root, PARTS, str(fresh)).load()
    expected = {
        "blob": "corrupt",
        "manifest": "corrupt",
        "parts": "mismatch",
        "missing_blob": "error",
    }[damage]
    assert result.status == expected
    assert "skipped" in caplog.text
    assert not (fresh / "ab").exists()  # nothing of a bad cache is used


def test_key_covers_model_device_and_compile_options(tmp_path):
    config = tiny_config(tmp_path)
    other = tiny_config(tmp_path, model={"embedding_dim": 4, "dense_arch": [16, 4]})
    cpu = torch.device("cpu")
    key = cache_key(key_parts(config, cpu, compiled.compile_options()))
    assert key == cache_key(key_parts(config, cpu, compiled.compile_options()))
    assert key != cache_key(key_parts(other, cpu, compiled.compile_options()))
    assert key != cache_key(key_parts(config, cpu, {"backend": "eager"}))
    assert compile_cache.cache_root(config) == f"file://{tmp_path}/store/compile-cache"


def test_inductors_own_default_dir_is_not_taken_for_an_operator_choice(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    path, created = compile_cache.setup_local_dir()
    try:
        assert created and path != default_cache_dir()
    finally:
        compile_cache.remove_local_dir(path)


@pytest.mark.slow
def test_corrupt_cache_is_skipped_and_the_job_trains(tmp_path):
    """Steps 1-15 are full batches, step 16 the short end of a shard (40 rows), histories of
    every length; the evals use batches of 256 and 244 rows: none of it recompiles."""
    config = tiny_config(
        tmp_path,
        train={"steps": 18, "compile": True, "eval_every": 9, "eval_rows": 500},
        checkpoint={"mode": "off"},
    )
    write_dataset(config)
    parts = key_parts(config, torch.device("cpu"), compiled.compile_options())
    url = storage.join(compile_cache.cache_root(config), cache_key(parts))
    bogus = {"name": "inductor-000000000000.tar", "size": 4, "sha256": "0" * 64}
    storage.write_bytes(storage.join(url, bogus["name"]), b"junk")
    storage.write_bytes(storage.join(url, "megacache-000000000000.bin"), b"junk")
    manifest = {
        "version": 1,
        "key": cache_key(parts),
        "parts": parts,
        "files": {"inductor": bogus, "megacache": {**bogus, "name": "megacache-000000000000.bin"}},
    }
    storage.write_text(storage.join(url, MANIFEST), json.dumps(manifest))

    env = {"TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_DIR)}
    result = run_trainer(config, tmp_path, env=env, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == ExitCode.SUCCESS, out[-4000:]
    assert "compile cache" in out and "skipped (corrupt)" in out
    # Once started the rank froze what it held, and at exit nothing frozen was reported as
    # leaked (trainer/gc_policy.py).
    assert "started: what this process holds is frozen" in out
    assert "leaked" not in out

    events = read_events(config.layout)
    load = [e for e in events if e.attrs.get("stage") == "compile_cache_load"]
    assert load and load[0].attrs["cache_status"] == "corrupt"
    assert max(e.step for e in events if e.name == "train_step") == 18
    recompiles = [e for e in events if e.name == "recompile"]
    assert [e.attrs for e in recompiles if e.attrs.get("phase") == "train"] == []
    assert any(e.name == "compile" for e in events)

    # The job replaced the corrupt cache with a good one (saved in the background).
    good = CompileCache(compile_cache.cache_root(config), parts, str(tmp_path / "fresh"))
    (tmp_path / "fresh").mkdir()
    assert good.load().status == "hit"
