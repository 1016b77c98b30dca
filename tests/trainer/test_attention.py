"""Jagged attention: parity of the triton, cpu and reference paths, fbgemm parity, validation.

All parity checks are fp32, forward and backward (dq, dk, dv for a random upstream
gradient), max abs diff <= 1e-5, random lengths including 0 and 1, causal and not.

Triton runs on CPU tensors through its interpreter, which must be switched on
(TRITON_INTERPRET=1) before the kernels are decorated. Setting that in this process would
leak into every other test that touches triton, so the interpreted cases run in one
subprocess (this file executed as a script, see ``_interpreted_triton_results``) that saves
its outputs and gradients; the comparisons run here.

fbgemm: ``torch.ops.fbgemm.sll_jagged_flash_attention_basic(q, k, v, offsets, max_seq_len,
use_mask=False, allow_tf32=True)`` (registered by ``import fbgemm_gpu.sll``; there is no
op named ``jagged_flash_attention_basic``) takes ONE head, 2-D [total, dim] jagged inputs,
applies NO 1/sqrt(dim) scale and divides the softmax by ``max_seq_len``:
O_i = softmax(Q_i K_i^T) / max_seq_len @ V_i. Its ``use_mask=True`` multiplies the
already-normalised probabilities by an upper-triangular matrix (keeps key j >= query i,
no renormalisation), which is not causal attention, so only the non-causal case is
compared: per head, fbgemm(q_h / sqrt(dim), k_h, v_h, offsets, max_len, False, False)
* max_len against our output (and gradients through that expression) with
max_seq_len = the batch's longest sequence (fbgemm truncates longer ones).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the interpreted-triton subprocess: before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import importlib
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.attention import jagged_attention
from trainer.attention.cpu import plan_buckets

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
HEADS, DIM = 2, 16
HAS_TRITON = importlib.util.find_spec("triton") is not None

# name -> (lengths, causal, (block_m, block_n) or None for the defaults, head dim, dtype);
# 16-row blocks make the 17- and 35-long sequences span several query and key blocks;
# a head dim of 24 runs with 32-wide blocks (masked columns), unequal blocks move the
# causal bounds of the key loops off the query blocks' edges.
LENGTHS = [0, 1, 3, 17, 0, 35, 2, 1]
TRITON_CASES = {
    "noncausal_b16": (LENGTHS, False, (16, 16), DIM, torch.float32),
    "causal_b16": (LENGTHS, True, (16, 16), DIM, torch.float32),
    "causal_default_blocks": ([5, 0, 33, 1], True, None, DIM, torch.float32),
    "random_noncausal_default_blocks": (
        torch.randint(0, 48, (6,), generator=torch.Generator().manual_seed(7)).tolist() + [1, 0],
        False,
        None,
        DIM,
        torch.float32,
    ),
    "only_empty_and_one": ([0, 1, 0], False, None, DIM, torch.float32),
    "dim24_causal_b32x16": (LENGTHS, True, (32, 16), 24, torch.float32),
    "dim24_noncausal_b16x32": (LENGTHS, False, (16, 32), 24, torch.float32),
    "fp16_causal_b16": (LENGTHS, True, (16, 16), DIM, torch.float16),
}
FP16_TOL = 5e-3  # fp16 inputs and outputs (fp32 accumulation) against fp32 on the same inputs


def make_inputs(lengths: list[int], heads: int = HEADS, dim: int = DIM, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    total = int(offsets[-1])
    q, k, v, grad = (torch.randn(total, heads, dim, generator=gen) for _ in range(4))
    return q, k, v, offsets, grad


def run(fn, q, k, v, offsets, grad) -> dict[str, torch.Tensor]:
    """Output and input gradients of fn for the upstream gradient ``grad``."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v, offsets)
    (out * grad).sum().backward()
    zero = torch.zeros_like(q)
    grads = [zero if x.grad is None else x.grad for x in (q, k, v)]
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def max_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: 0.0 if a[key].numel() == 0 else (a[key] - b[key]).abs().max().item() for key in a}


def impl_fn(impl: str, causal: bool):
    return lambda q, k, v, off: jagged_attention(q, k, v, off, causal=causal, impl=impl)


def strided(fn):
    """fn fed with non-contiguous q, k, v: slices of one packed [total, 3, heads, dim] tensor."""

    def packed(q, k, v, offsets):
        qkv = torch.stack([q, k, v], dim=1)
        return fn(qkv[:, 0], qkv[:, 1], qkv[:, 2], offsets)

    return packed


def fbgemm_fn(q, k, v, offsets):
    """Our semantics (non-causal, scale 1/sqrt(dim)) expressed through fbgemm's op."""
    import fbgemm_gpu.sll  # noqa: F401  (registers the sll ops)

    max_len = max(1, int((offsets[1:] - offsets[:-1]).max()))
    scale = 1.0 / math.sqrt(q.shape[-1])
    heads = [
        torch.ops.fbgemm.sll_jagged_flash_attention_basic(
            q[:, h] * scale, k[:, h], v[:, h], offsets, max_len, False, False
        )
        * max_len
        for h in range(q.shape[1])
    ]
    return torch.stack(heads, dim=1)


# --------------------------------------------------------------- cpu vs reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_matches_reference(causal: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(0, 40, (12,), generator=gen).tolist() + [0, 1, 1, 57]
    inputs = make_inputs(lengths, seed=seed)
    cpu = run(impl_fn("cpu", causal), *inputs)
    ref = run(impl_fn("reference", causal), *inputs)
    for key, diff in max_diffs(cpu, ref).items():
        assert diff <= TOL, (key, diff)


def test_cpu_buckets_every_equal_length_batch_without_mask() -> None:
    inputs = make_inputs([7, 7, 7])
    for causal in (False, True):
        diffs = max_diffs(
            run(impl_fn("cpu", causal), *inputs), run(impl_fn("reference", causal), *inputs)
        )
        assert max(diffs.values()) <= TOL


def test_plan_buckets_covers_each_nonempty_sequence_once() -> None:
    lengths = [0, 1, 2, 9, 30, 31, 200, 0, 250, 5]
    buckets = plan_buckets(lengths, growth=1.25, min_span=8)
    seen = sorted(s for b in buckets for s in b.seqs)
    assert seen == [i for i, n in enumerate(lengths) if n > 0]
    for b in buckets:
        assert b.max_len == max(lengths[s] for s in b.seqs)
        assert b.uniform == (len({lengths[s] for s in b.seqs}) == 1)
        shortest = min(lengths[s] for s in b.seqs)
        assert b.max_len <= max(shortest * 1.25, shortest + 7)


@pytest.mark.parametrize("impl", ["cpu", "reference", "auto"])
@pytest.mark.parametrize("lengths", [[0, 0], [], [1], [0, 1, 0]])
def test_degenerate_batches(impl: str, lengths: list[int]) -> None:
    q, k, v, offsets, grad = make_inputs(lengths)
    res = run(impl_fn(impl, True), q, k, v, offsets, grad)
    assert res["out"].shape == q.shape
    if lengths == [1] or lengths == [0, 1, 0]:
        # a length-1 sequence attends to itself only: the output is its value row
        assert (res["out"] - v).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_non_contiguous_inputs(impl: str) -> None:
    inputs = make_inputs(LENGTHS)
    diffs = max_diffs(run(strided(impl_fn(impl, True)), *inputs), run(impl_fn(impl, True), *inputs))
    assert max(diffs.values()) <= TOL


def test_package_works_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # Import the package afresh with triton unimportable; monkeypatch restores sys.modules.
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in [m for m in sys.modules if m.startswith("trainer.attention")]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("trainer.attention")
    q, k, v, offsets, _ = make_inputs([2, 3])
    fresh.jagged_attention(q, k, v, offsets, impl="auto")
    assert "trainer.attention.triton_kernel" not in sys.modules
    with pytest.raises(ImportError, match="needs triton"):
        fresh.jagged_attention(q, k, v, offsets, impl="triton")


def test_auto_uses_cpu_path_for_cpu_tensors() -> None:
    inputs = make_inputs(LENGTHS)
    auto = jagged_attention(*inputs[:4], impl="auto")
    assert torch.equal(auto, jagged_attention(*inputs[:4], impl="cpu"))


# --------------------------------------------------------------- fbgemm parity


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_matches_fbgemm_jagged_flash_attention_basic(impl: str) -> None:
    pytest.importorskip("fbgemm_gpu")
    inputs = make_inputs(LENGTHS)
    ours = run(impl_fn(impl, False), *inputs)
    theirs = run(fbgemm_fn, *inputs)
    for key, diff in max_diffs(ours, theirs).items():
        assert diff <= TOL, (key, diff)


# --------------------------------------------------------------- triton (interpreted)


def triton_inputs(name: str):
    """(causal, blocks, dtype, inputs); fp16 inputs are fp32 values rounded to fp16."""
    lengths, causal, blocks, dim, dtype = TRITON_CASES[name]
    q, k, v, offsets, grad = make_inputs(lengths, dim=dim, seed=len(name))
    q, k, v, grad = (x.to(dtype) for x in (q, k, v, grad))
    return causal, blocks, dtype, (q, k, v, offsets, grad)


def _interpreted_triton_results(path: str) -> None:
    """Subprocess body (TRITON_INTERPRET=1): run every case with triton, save the tensors."""
    from trainer.attention import triton_kernel

    assert triton_kernel.INTERPRETED, "TRITON_INTERPRET=1 was not set before triton loaded"
    results = {}
    for name in TRITON_CASES:
        causal, blocks, _, inputs = triton_inputs(name)
        if blocks is None:  # public entry point, default block sizes, non-contiguous q, k, v
            fn = strided(impl_fn("triton", causal))
        else:
            fn = lambda q, k, v, off, c=causal, b=blocks: triton_kernel.triton_jagged_attention(  # noqa: E731
                q, k, v, off, c, block_m=b[0], block_n=b[1]
            )
        results[name] = run(fn, *inputs)
    torch.save(results, path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("other", ["reference", "cpu"])
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_interpreted_matches(triton_results, case: str, other: str) -> None:
    causal, _, dtype, inputs = triton_inputs(case)
    ours = triton_results[case]
    assert all(t.dtype == dtype for t in ours.values())
    fp32 = [x.float() if x.is_floating_point() else x for x in inputs]
    diffs = max_diffs({k: t.float() for k, t in ours.items()}, run(impl_fn(other, causal), *fp32))
    tol = TOL if dtype == torch.float32 else FP16_TOL
    for key, diff in diffs.items():
        assert diff <= tol, (key, diff)


def test_triton_interpreted_matches_fbgemm(triton_results) -> None:
    pytest.importorskip("fbgemm_gpu")
    _, _, _, inputs = triton_inputs("noncausal_b16")
    for key, diff in max_diffs(triton_results["noncausal_b16"], run(fbgemm_fn, *inputs)).items():
        assert diff <= TOL, (key, diff)


def test_triton_on_cpu_tensors_without_interpreter_is_a_clear_error() -> None:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from trainer.attention import triton_kernel

    if triton_kernel.INTERPRETED:
        pytest.skip("this process runs triton interpreted")
    q, k, v, offsets, _ = make_inputs([3, 2])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        jagged_attention(q, k, v, offsets, impl="triton")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Front end to cubin for sm_90 (H100/H200), bf16, causal: no GPU needed, ptxas ships
    with triton. Guards the compiled path, which the interpreter does not exercise."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainer.attention import triton_kernel

    if triton_kernel.INTERPRETED:
        pytest.skip("this process runs triton interpreted")
    types = {
        "Offsets": "*i64",
        "Blocks": "*i32",
        "LSE": "*fp32",
        "Delta": "*fp32",
        "qk_scale": "fp32",
        "sm_scale": "fp32",
        "num_seqs": "i32",
        "head_dim": "i32",
    }
    constexprs = {"CAUSAL": True, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": 32, "PRECISION": "tf32"}
    for kernel, pass_constexprs in (
        (triton_kernel._fwd_kernel, {}),
        (triton_kernel._bwd_kernel, {"KEY_BLOCKS": True}),  # dK, dV
        (triton_kernel._bwd_kernel, {"KEY_BLOCKS": False}),  # dQ
    ):
        kernel_constexprs = constexprs | pass_constexprs
        signature = {
            name: "constexpr" if name in kernel_constexprs else types.get(name, "*bf16")
            for name in kernel.arg_names
        }
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs=kernel_constexprs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4},
            )
        except RuntimeError as exc:  # a triton build without the NVIDIA toolchain
            if "ptxas" in str(exc) or "backend" in str(exc):
                pytest.skip(f"no CUDA toolchain in this triton: {exc}")
            raise
        assert compiled.asm.get("cubin"), kernel.fn.__name__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_on_cuda_matches_reference(dtype: torch.dtype, causal: bool) -> None:
    from trainer.attention import triton_kernel

    if triton_kernel.INTERPRETED:
        pytest.skip("this process runs triton interpreted")
    lengths = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    q, k, v, offsets, grad = (x.cuda() for x in make_inputs([0, 1, *lengths], heads=4, dim=64))
    q, k, v, grad = (x.to(dtype) for x in (q, k, v, grad))
    tri = run(impl_fn("triton", causal), q, k, v, offsets, grad)
    ref = run(impl_fn("reference", causal), q, k, v, offsets, grad)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for key, diff in max_diffs(tri, ref).items():
        assert diff <= tol, (key, diff)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_on_cuda_matches_bucketed_path(dtype: torch.dtype, causal: bool) -> None:
    """The bucketed path is device-agnostic torch: on the GPU too it must agree."""
    from trainer.attention import triton_kernel

    if triton_kernel.INTERPRETED:
        pytest.skip("this process runs triton interpreted")
    lengths = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    q, k, v, offsets, grad = (x.cuda() for x in make_inputs([1, 0, *lengths], heads=2, dim=32))
    q, k, v, grad = (x.to(dtype) for x in (q, k, v, grad))
    tri = run(impl_fn("triton", causal), q, k, v, offsets, grad)
    bucketed = run(impl_fn("cpu", causal), q, k, v, offsets, grad)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for key, diff in max_diffs(tri, bucketed).items():
        assert diff <= tol, (key, diff)


# --------------------------------------------------------------- validation


def _bad(**overrides):
    q, k, v, offsets, _ = make_inputs([2, 3])
    args = {"q": q, "k": k, "v": v, "offsets": offsets, **overrides}
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"k": torch.randn(5, 2, 8)}, ValueError, "same shape"),
        ({"q": torch.randn(5, 32)}, ValueError, r"\[total_len, heads, dim\]"),
        ({"v": torch.randn(5, 2, 16, dtype=torch.float64)}, TypeError, "float dtype"),
        ({"offsets": torch.tensor([0, 2, 5], dtype=torch.int32)}, TypeError, "int64"),
        ({"offsets": torch.tensor([[0, 2, 5]])}, ValueError, "1-D"),
        ({"offsets": torch.tensor([0, 4, 3, 5])}, ValueError, "non-decreasing"),
        ({"offsets": torch.tensor([1, 2, 5])}, ValueError, r"offsets\[0\]"),
        ({"offsets": torch.tensor([0, 2, 4])}, ValueError, "total_len=5"),
        ({"offsets": [0, 2, 5]}, TypeError, "torch.Tensor"),
    ],
)
def test_invalid_inputs_raise_clear_errors(overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        jagged_attention(**_bad(**overrides))


def test_unknown_impl_is_rejected() -> None:
    with pytest.raises(ValueError, match="impl must be one of"):
        jagged_attention(**_bad(), impl="flash")


if __name__ == "__main__":
    _interpreted_triton_results(sys.argv[1])
