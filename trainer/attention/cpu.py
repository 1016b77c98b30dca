"""Fast CPU path: bucket sequences by length, pad only within a bucket, SDPA per bucket.

Padding the whole batch to its longest sequence costs B * max_len**2 per head; with
Zipf-like history lengths (mean ~32, max 512) almost all of that is padding. Here the
sequences are sorted by length and cut into buckets whose lengths lie within a small
factor of each other; each bucket is padded to its own maximum and goes through one
batched ``scaled_dot_product_attention`` call on a contiguous [n, heads, L, dim] block
(a bucket whose sequences all share one length needs no mask and uses ``is_causal``).

Moving rows between the jagged layout and the bucketed one is a pure gather in both
directions, forward and backward (``_Gather``): scatter-style kernels (index_add,
index_copy) are several times slower on CPU. Padding slots read some real row of their
own sequence instead of zeros: as keys and values they are masked out, as queries their
output is dropped, so their content never reaches the result or the gradients.

The code is device-agnostic torch; ``dispatch`` uses it for CPU tensors (and as the
fallback on CUDA when triton is missing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from trainer.attention.reference import attention_mask, empty_result

# A sequence joins the open bucket while its length is within GROWTH x the bucket's
# shortest length, or within MIN_SPAN rows of it (short sequences are cheap to pad but
# every bucket costs a few fixed-overhead kernel calls, forward and backward).
GROWTH = 1.25
MIN_SPAN = 8


@dataclass(frozen=True)
class Bucket:
    seqs: tuple[int, ...]  # sequence indices, ascending by length
    max_len: int
    uniform: bool  # every sequence has length max_len -> no mask needed


def plan_buckets(
    lengths: Sequence[int], growth: float = GROWTH, min_span: int = MIN_SPAN
) -> list[Bucket]:
    """Group the non-empty sequences into buckets of similar length (greedy, sorted)."""
    order = sorted((n, i) for i, n in enumerate(lengths) if n > 0)
    buckets: list[Bucket] = []
    seqs: list[int] = []
    lo = hi = 0
    for n, i in order:
        if seqs and n > lo * growth and n - lo >= min_span:
            buckets.append(Bucket(tuple(seqs), hi, uniform=lo == hi))
            seqs = []
        if not seqs:
            lo = n
        seqs.append(i)
        hi = n
    if seqs:
        buckets.append(Bucket(tuple(seqs), hi, uniform=lo == hi))
    return buckets


class _Gather(torch.autograd.Function):
    """out = x[index] whose adjoint is also a gather: grad_x = [grad; 0][adjoint].

    Valid when every row of x that matters is read exactly once, at slot adjoint[row];
    adjoint == len(out) selects the appended zero row (slots nobody reads back).
    """

    @staticmethod
    def forward(ctx, x, index, adjoint):  # noqa: D102
        ctx.save_for_backward(adjoint)
        return x.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        (adjoint,) = ctx.saved_tensors
        grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return grad.index_select(0, adjoint), None, None


def _slot_maps(
    buckets: list[Bucket], lengths: torch.Tensor, starts: torch.Tensor, heads: int, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index maps between jagged (row, head) pairs and bucketed [n, heads, L] slots.

    Returns (source, source_or_pad, slot): slot s reads jagged pair source[s];
    source_or_pad[s] is the same with total * heads for padding slots; jagged pair j lives
    in slot slot[j]. Pairs are flattened as row * heads + head.
    """
    dev = lengths.device
    seqs = torch.tensor([s for b in buckets for s in b.seqs], device=dev)
    padded = torch.tensor([b.max_len for b in buckets for _ in b.seqs], device=dev)
    sizes = padded * heads  # slots per sequence
    n_slots = int(sizes.sum())
    owner = torch.repeat_interleave(torch.arange(len(seqs), device=dev), sizes, output_size=n_slots)
    within = torch.arange(n_slots, device=dev) - (torch.cumsum(sizes, 0) - sizes)[owner]
    head, pos = within // padded[owner], within % padded[owner]
    seq_len = lengths[seqs][owner]
    valid = pos < seq_len
    row = starts[seqs][owner] + torch.minimum(pos, seq_len - 1)
    source = row * heads + head
    source_or_pad = torch.where(valid, source, total * heads)
    slot = torch.empty(total * heads, dtype=torch.long, device=dev)
    slot[source[valid]] = torch.arange(n_slots, device=dev)[valid]
    return source, source_or_pad, slot


def cpu_jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    causal: bool = False,
    *,
    growth: float = GROWTH,
    min_span: int = MIN_SPAN,
) -> torch.Tensor:
    """Length-bucketed jagged attention; q, k, v: [total, heads, dim]. Differentiable."""
    total, heads, dim = q.shape
    lengths = offsets[1:] - offsets[:-1]
    length_list = lengths.tolist()
    buckets = plan_buckets(length_list, growth, min_span)
    if total == 0 or not buckets:
        return empty_result(q, k, v)
    source, source_or_pad, slot = _slot_maps(buckets, lengths, offsets[:-1], heads, total)

    def to_buckets(x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x.reshape(total * heads, dim), source, slot)

    pq, pk, pv = to_buckets(q), to_buckets(k), to_buckets(v)
    scale = 1.0 / math.sqrt(dim)
    sizes = [len(b.seqs) * heads * b.max_len for b in buckets]
    # split (not slicing): its backward is one cat, not a zero-filled full-size grad per bucket
    outs = []
    for b, qb, kb, vb in zip(
        buckets, pq.split(sizes), pk.split(sizes), pv.split(sizes), strict=True
    ):
        n, length = len(b.seqs), b.max_len
        qb, kb, vb = (x.view(n, heads, length, dim) for x in (qb, kb, vb))
        if b.uniform:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale)
        else:
            ln = torch.tensor([length_list[s] for s in b.seqs], device=q.device)
            valid = torch.arange(length, device=q.device) < ln[:, None]
            mask = attention_mask(valid, causal)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        outs.append(ob.reshape(-1, dim))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return _Gather.apply(out, slot, source_or_pad).view(total, heads, dim)
