"""A torch.compile cache shared across jobs and attempts (MegaCache + inductor dir + PGO).

Layout under ``<cache root>/<key>/`` (any fsspec URL, via infra.storage)::

    inductor-<sha12>.tar    snapshot of this process's TORCHINDUCTOR_CACHE_DIR: FX graphs,
                            AOTAutograd entries, the compiled C++ .so / Triton kernels and
                            the dynamo PGO profile (dynamo/code_state_*.pkl)
    megacache-<sha12>.bin   torch.compiler.save_cache_artifacts() bytes
    manifest.json           key, what the key was made of, file names + sizes + sha256;
                            written LAST: a reader only ever sees complete caches

Why both: MegaCache bytes alone, loaded into an empty dir, still rebuild the C++ .so; the dir
snapshot alone would miss artifacts kept out of the dir. The key hashes
everything that makes compiled code reusable: torch/triton/python versions, device kind (CPU
ISA or GPU name + capability), the model-shape hash (``JobConfig.model_hash()``) and the
compile options. The manifest also keeps the result of inductor's C++ vector-ISA check (a
compile and a dlopen in a fresh interpreter per ISA, seconds on a small host): a process that
loads the cache reuses it instead of probing again (trainer/compiled.py ``settle_vec_isa``);
and Inductor's hashes of torch's and Triton's source files, which a process of the same torch
build sets instead of reading and hashing both packages again (``source_keys``).
Loading happens before anything compiles; a missing, mismatched or corrupt
cache is skipped with a warning and never fails the job. Saving runs on a background thread.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from infra import storage
from infra.control import scratch_dir
from infra.settings import JobConfig

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MANIFEST = "manifest.json"
_SKIP_SUFFIXES = (".lock", ".tmp")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_kind(device: torch.device) -> str:
    """What compiled code depends on: the GPU model and capability, or the CPU's ISA."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda:{props.name}:sm{props.major}{props.minor}:cuda{torch.version.cuda}"
    return f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"


def key_parts(config: JobConfig, device: torch.device, options: dict[str, Any]) -> dict[str, Any]:
    """Everything the cache key is made of (also written to the manifest, for humans)."""
    return {
        "format": CACHE_FORMAT,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "torch_build": torch.version.git_version,  # the exact sources: see source_keys
        "triton": _version("triton") if device.type == "cuda" else None,
        "device": device_kind(device),
        "model": config.model_hash(),
        "compile": options,
    }


def source_keys() -> dict[str, str | None]:
    """Inductor's hashes of torch's and Triton's own source files, which go into every
    compile-cache key it computes. Each process computes them by reading and hashing every
    source file of both packages, about a second of a warm start's compile on a small host.
    The process that saves the cache writes them to its manifest; one that loads a cache made
    by the same torch build (``torch_build`` in the key) sets them instead (``preset``)."""
    from torch._inductor.codecache import torch_key, triton_key

    return {"torch": torch_key().hex(), "triton": triton_key()}


def preset_source_keys(saved: Any) -> bool:
    """Set Inductor's source hashes from a manifest's ``source_keys``; False when there are
    none, they are malformed, or this process computed its own already."""
    from torch._inductor.codecache import torch_key, triton_key

    try:
        torch_hash = bytes.fromhex(saved["torch"])
        triton_hash = saved["triton"]
        if triton_hash is not None and not isinstance(triton_hash, str):
            return False
        torch_key.set(torch_hash)  # prefetchable_cache: RuntimeError once computed
        triton_key.set(triton_hash)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError):
        return False
    return True


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cache_root(config: JobConfig) -> str:
    """``train.compile_cache_url``, by default ``<storage.root>/compile-cache``."""
    url = config.train.compile_cache_url
    return url if url else storage.join(config.storage.root, "compile-cache")


def setup_local_dir(path: str | None = None) -> tuple[str, bool]:
    """Point TORCHINDUCTOR_CACHE_DIR at a local folder (before anything compiles).

    An explicit ``path`` wins, then a TORCHINDUCTOR_CACHE_DIR already set by the operator;
    otherwise a fresh per-process temp folder, so what a process finds is exactly what the
    shared cache gave it (in the attempt's control folder when there is one, so that it goes
    with the attempt even if this process is killed). Returns (folder, created_here).
    """
    created = False
    if path is None:
        path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # Importing TorchRec makes inductor write its default into the environment: that
        # is not an operator's choice, and it is a machine-wide folder other jobs share.
        if path is not None and os.path.abspath(path) == _default_inductor_dir():
            path = None
    if path is None:
        path, created = tempfile.mkdtemp(prefix="ett-inductor-", dir=scratch_dir()), True
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:  # a path inductor may already have memoised (best effort: private API)
        from torch._inductor.codecache import CacheBase

        CacheBase.get_local_cache_path.cache_clear()
    except (ImportError, AttributeError):
        pass
    return path, created


def _default_inductor_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class CacheResult:
    """What a load or save did; written as span attrs."""

    status: str  # hit | miss | mismatch | corrupt | error | saved | skipped
    seconds: float = 0.0
    bytes: int = 0
    detail: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    vec_isa_ok: bool | None = None  # the C++ vector-ISA check of the process that saved it
    source_keys_reused: bool = False  # Inductor's source hashes set from the manifest

    def attrs(self, prefix: str) -> dict[str, Any]:
        out = {
            f"{prefix}_status": self.status,
            f"{prefix}_s": round(self.seconds, 4),
            f"{prefix}_bytes": self.bytes,
        }
        if self.source_keys_reused:
            out[f"{prefix}_source_keys_reused"] = True
        if self.detail:
            out[f"{prefix}_detail"] = self.detail[:300]
        return out


class CompileCache:
    """One process's view of one key's folder: ``load()`` before compiling, ``save_async()``
    once everything the loop runs has been compiled."""

    def __init__(self, root_url: str, parts: dict[str, Any], local_dir: str) -> None:
        self.parts = parts
        self.key = cache_key(parts)
        self.url = storage.join(root_url, self.key)
        self.local_dir = local_dir
        self._thread: threading.Thread | None = None
        self.saved: CacheResult | None = None
        # The compiling thread's settled ISA check (inductor's settings are per thread).
        self.vec_isa_ok: bool | None = None

    @property
    def job_id(self) -> str:
        """The PGO job id: every job with this key is the same workload (see
        torch.compiler.config.job_id), so they share dynamic-shape profiles."""
        return f"ett-{self.key}"

    # -- load -------------------------------------------------------------------------------
    def load(self) -> CacheResult:
        """Fill the local dir and the in-memory caches from the shared cache, if usable."""
        t0 = time.perf_counter()
        try:
            result = self._load()
        except Exception as exc:  # anything at all: a cache must never fail a job
            result = CacheResult("error", detail=f"{type(exc).__name__}: {exc}")
        result.seconds = time.perf_counter() - t0
        if result.status == "hit":
            log.info(
                "compile cache hit %s (%d bytes, %.2f s)", self.url, result.bytes, result.seconds
            )
        elif result.status == "miss":
            log.info("compile cache miss %s: compiling cold", self.url)
        else:
            log.warning("compile cache %s skipped (%s): %s", self.url, result.status, result.detail)
        return result

    def _load(self) -> CacheResult:
        manifest_url = storage.join(self.url, MANIFEST)
        try:
            manifest = json.loads(storage.read_text(manifest_url))
        except FileNotFoundError:
            return CacheResult("miss")
        except (ValueError, UnicodeDecodeError) as exc:
            return CacheResult("corrupt", detail=f"{manifest_url}: unreadable manifest: {exc}")
        if manifest.get("key") != self.key or manifest.get("parts") != self.parts:
            return CacheResult(
                "mismatch",
                detail=f"{manifest_url} was made for "
                f"{manifest.get('parts')}, this process needs {self.parts}",
            )
        files = manifest.get("files", {})
        if set(files) != {"inductor", "megacache"}:
            return CacheResult("corrupt", detail=f"{manifest_url}: files {sorted(files)}")
        with tempfile.TemporaryDirectory(prefix="ett-ccache-", dir=scratch_dir()) as tmp:
            local: dict[str, str] = {}
            for role, entry in files.items():
                path = os.path.join(tmp, os.path.basename(entry["name"]))
                storage.get_file(storage.join(self.url, entry["name"]), path)
                if os.path.getsize(path) != entry["size"] or _sha256(path) != entry["sha256"]:
                    return CacheResult(
                        "corrupt",
                        detail=f"{entry['name']}: size or checksum differs from the manifest",
                    )
                local[role] = path
            with tarfile.open(local["inductor"]) as tar:
                tar.extractall(self.local_dir, filter="data")
            with open(local["megacache"], "rb") as fh:
                blob = fh.read()
            reused = preset_source_keys(manifest.get("source_keys"))
            info = torch.compiler.load_cache_artifacts(blob) if blob else None
            size = sum(int(e["size"]) for e in files.values())
        loaded = {} if info is None else {k: len(v) for k, v in info.artifacts.items()}
        return CacheResult(
            "hit",
            bytes=size,
            info=loaded,
            vec_isa_ok=manifest.get("vec_isa_ok"),
            source_keys_reused=reused,
        )

    # -- save -------------------------------------------------------------------------------
    def save(self) -> CacheResult:
        """Upload this process's artifacts and dir snapshot; the manifest goes last."""
        t0 = time.perf_counter()
        try:
            result = self._save()
        except Exception as exc:
            result = CacheResult("error", detail=f"{type(exc).__name__}: {exc}")
        result.seconds = time.perf_counter() - t0
        if result.status == "saved":
            log.info(
                "compile cache saved to %s (%d bytes, %.2f s)",
                self.url,
                result.bytes,
                result.seconds,
            )
        else:
            log.warning(
                "compile cache not saved to %s (%s): %s", self.url, result.status, result.detail
            )
        self.saved = result
        return result

    def _save(self) -> CacheResult:
        artifacts = torch.compiler.save_cache_artifacts()
        blob = artifacts[0] if artifacts is not None else b""
        with tempfile.TemporaryDirectory(prefix="ett-ccache-", dir=scratch_dir()) as tmp:
            paths = {
                "megacache": os.path.join(tmp, "megacache.bin"),
                "inductor": os.path.join(tmp, "inductor.tar"),
            }
            with open(paths["megacache"], "wb") as fh:
                fh.write(blob)
            count = self._snapshot(paths["inductor"])
            if count == 0:
                return CacheResult("skipped", detail="the local inductor cache dir is empty")
            files: dict[str, dict[str, Any]] = {}
            for role, path in paths.items():
                digest = _sha256(path)
                ext = path.rsplit(".", 1)[1]
                name = f"{role}-{digest[:12]}.{ext}"
                storage.put_file(path, storage.join(self.url, name))
                files[role] = {"name": name, "size": os.path.getsize(path), "sha256": digest}
        manifest = {
            "version": CACHE_FORMAT,
            "key": self.key,
            "parts": self.parts,
            "created": time.time(),
            "files": files,
            "inductor_files": count,
            "vec_isa_ok": self.vec_isa_ok,
            "source_keys": source_keys(),
        }
        storage.write_text(storage.join(self.url, MANIFEST), json.dumps(manifest, indent=2))
        self._prune({f["name"] for f in files.values()})
        return CacheResult("saved", bytes=sum(f["size"] for f in files.values()))

    def _snapshot(self, tar_path: str) -> int:
        """Tar the local cache dir (lock and temp files left out); returns the file count."""
        count = 0
        with tarfile.open(tar_path, "w") as tar:
            for dirpath, dirnames, filenames in os.walk(self.local_dir):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(_SKIP_SUFFIXES) or ".tmp" in name:
                        continue
                    full = os.path.join(dirpath, name)
                    try:
                        tar.add(full, arcname=os.path.relpath(full, self.local_dir))
                        count += 1
                    except OSError:  # removed under us by a concurrent compile: skip it
                        continue
        return count

    def _prune(self, keep: set[str]) -> None:
        """Drop blobs of older saves (a concurrent writer's blobs lose to the last manifest)."""
        for name in storage.listdir(self.url):
            if (
                name != MANIFEST
                and name not in keep
                and name.split("-", 1)[0] in ("inductor", "megacache")
            ):
                try:
                    storage.remove(storage.join(self.url, name))
                except OSError as exc:
                    log.debug("could not prune %s: %s", name, exc)

    def save_async(self) -> threading.Thread:
        """Save on a background (non-daemon) thread: the interpreter waits for it at exit."""
        self._thread = threading.Thread(target=self.save, name="compile-cache-save")
        self._thread.start()
        return self._thread

    def wait(self, timeout_s: float | None = None) -> CacheResult | None:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.saved


def remove_local_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
