"""Padded reference: jagged -> [B, heads, max_len, dim] -> SDPA with a boolean mask -> jagged.

This is the obviously-correct implementation the fast paths are tested against, and the
baseline the benchmark compares with. It pays for padding every sequence to the batch's
longest one (time and memory grow with B * max_len**2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def empty_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """No rows at all: an empty tensor that still belongs to the autograd graph of q, k, v."""
    return (q + k + v) * 0.0


def attention_mask(valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean SDPA mask [n, 1, L, L] (True = attend) for padded sequences.

    valid: bool [n, L], True where position j of sequence i is a real row. Query rows that
    are padding attend to every key (their output is dropped), so no row is fully masked
    and SDPA never produces NaN (which would poison the backward pass).
    """
    n, length = valid.shape
    mask = valid[:, None, :].expand(n, length, length)
    if causal:
        tri = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril_()
        mask = mask & tri
    mask = mask | ~valid[:, :, None]
    return mask[:, None]


def reference_jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of each sequence over itself; q, k, v: [total, heads, dim]. Differentiable."""
    total, heads, dim = q.shape
    lengths = offsets[1:] - offsets[:-1]
    batch = lengths.numel()
    if total == 0 or batch == 0:
        return empty_result(q, k, v)
    max_len = int(lengths.max())

    seq_id = torch.repeat_interleave(
        torch.arange(batch, device=q.device), lengths, output_size=total
    )
    pos = torch.arange(total, device=q.device) - offsets[seq_id]
    flat = seq_id * max_len + pos  # row of each jagged row in the padded [B * max_len] layout

    def pad(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(batch * max_len, heads, dim).index_copy(0, flat, x)
        return padded.view(batch, max_len, heads, dim).transpose(1, 2)

    valid = torch.zeros(batch * max_len, dtype=torch.bool, device=q.device)
    valid[flat] = True
    mask = attention_mask(valid.view(batch, max_len), causal)
    out = F.scaled_dot_product_attention(
        pad(q), pad(k), pad(v), attn_mask=mask, scale=1.0 / math.sqrt(dim)
    )
    return out.transpose(1, 2).reshape(batch * max_len, heads, dim).index_select(0, flat)
