"""``jagged_attention``: validate the inputs, pick an implementation, run it."""

from __future__ import annotations

import importlib.util

import torch

from trainer.attention.cpu import cpu_jagged_attention
from trainer.attention.reference import reference_jagged_attention

IMPLS = ("auto", "triton", "cpu", "reference")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # triton_kernel.SUPPORTED_DTYPES


def _triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


def validate_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor
) -> None:
    """Raise ValueError/TypeError with a clear message if the jagged inputs are malformed."""
    for name, t in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [total_len, heads, dim], got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k, v must have the same shape [total_len, heads, dim], got "
            f"q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}"
        )
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device or offsets.device != q.device:
        raise ValueError(
            f"q, k, v, offsets must be on one device, got {q.device}, {k.device}, "
            f"{v.device}, {offsets.device}"
        )
    if offsets.dtype != torch.int64:
        raise TypeError(f"offsets must be int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be 1-D [batch + 1], got shape {tuple(offsets.shape)}")
    # One host sync for all value checks.
    first, decreasing, last = torch.stack(
        [offsets[0], (offsets[1:] < offsets[:-1]).any().long(), offsets[-1]]
    ).tolist()
    if first != 0:
        raise ValueError(f"offsets[0] must be 0, got {first}")
    if decreasing:
        raise ValueError("offsets must be non-decreasing (sequence lengths >= 0)")
    if last != q.shape[0]:
        raise ValueError(f"offsets[-1] must equal total_len={q.shape[0]}, got {last}")


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    causal: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """Self-attention within each jagged sequence.

    q, k, v: [total_len, heads, dim] float tensors; offsets: int64 [batch + 1], sequence i
    occupies rows offsets[i]:offsets[i+1] (length 0 allowed). Softmax scale 1/sqrt(dim);
    ``causal`` hides later positions. Returns [total_len, heads, dim]; differentiable.

    impl: "auto" (triton for CUDA tensors when triton is installed and supports the dtype
    (fp32/fp16/bf16) and head dim (<= 256), else "cpu"), "triton"
    (flash-style kernels; on CPU tensors only under TRITON_INTERPRET=1), "cpu"
    (length-bucketed SDPA, no batch-wide padding) or "reference" (padded SDPA).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    validate_inputs(q, k, v, offsets)
    if impl == "auto":
        use_triton = q.is_cuda and q.dtype in _TRITON_DTYPES and q.shape[-1] <= 256
        impl = "triton" if use_triton and _triton_available() else "cpu"
    if impl == "triton":
        try:
            from trainer.attention.triton_kernel import triton_jagged_attention  # lazy: triton
        except ImportError as exc:
            raise ImportError("impl='triton' needs triton (pip install triton)") from exc
        return triton_jagged_attention(q, k, v, offsets, causal)
    if impl == "cpu":
        return cpu_jagged_attention(q, k, v, offsets, causal)
    return reference_jagged_attention(q, k, v, offsets, causal)
