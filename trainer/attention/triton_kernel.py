"""Flash-style jagged attention in Triton: no padding, forward + backward.

Layout: q, k, v, o are contiguous [total, heads, dim]; sequence i owns rows
offsets[i]:offsets[i+1]. A *block table* lists every (sequence, block of BLOCK rows) pair;
one program handles one table entry and one head, so there is no program per padded
position. The table's length has a sync-free upper bound (cdiv(total, BLOCK) + batch);
programs past the real blocks exit at once.

- forward: one program per (sequence, head, query block); loops over the key blocks of
  the same sequence with an online softmax (running max m, running sum l) and stores the
  output and the log-sum-exp (base 2) per row and head.
- backward (flash-attention-2 style, no atomics): delta = rowsum(dO * O) in torch; one
  kernel, launched twice: once with a program per (sequence, head, key block), which
  accumulates dK, dV over the query blocks, once with one per (sequence, head, query block),
  which accumulates dQ over the key blocks. Both recompute P = exp2(S - lse) from the saved
  log-sum-exp.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU
tensors through Triton's interpreter (fp32/fp16 only: the interpreter has no bf16
arithmetic). This module imports triton at import time: import it lazily.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from trainer.attention.reference import empty_result

INTERPRETED = bool(triton.knobs.runtime.interpret)  # decided when the kernels are decorated
LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@triton.jit
def _tile(base, rows, n, offs_d, d_ok, stride_t):
    """Offsets and mask of ``rows`` (those below ``n``) of one head: a [rows, BLOCK_D] tile."""
    return base + rows[:, None] * stride_t + offs_d[None, :], (rows < n)[:, None] & d_ok[None, :]


@triton.jit
def _rows(Ptr, base, rows, n, offs_d, d_ok, stride_t):
    """Rows ``rows`` of one head (zeros past ``n``), their offsets and mask."""
    off, mask = _tile(base, rows, n, offs_d, d_ok, stride_t)
    return tl.load(Ptr + off, mask=mask, other=0.0), off, mask


@triton.jit
def _keys_seen(q_start, seq_len, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Where the keys a query block sees end: with CAUSAL, after its last row."""
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, q_start + BLOCK_M)
    return hi


@triton.jit
def _visible(rows, cols, seq_len, CAUSAL: tl.constexpr):
    """Which keys ``cols`` each query row sees: those of the sequence, and with CAUSAL only
    those at or before it."""
    keep = (cols < seq_len)[None, :]
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return keep


@triton.jit
def _grad_terms(q, k, v, do, lse, delta, keep, qk_scale, PRECISION: tl.constexpr):
    """P and dS of one (query block, key block) pair, P recomputed from the saved
    log-sum-exp: what both backward passes accumulate."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _query_block(Q, DO, LSE, Delta, q_off, q_mask, row_off, m_ok):
    """A query block's q and dO, and its rows' log-sum-exp and delta (row_off: row * heads +
    head)."""
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    do = tl.load(DO + q_off, mask=q_mask, other=0.0)
    lse = tl.load(LSE + row_off, mask=m_ok, other=0.0)
    delta = tl.load(Delta + row_off, mask=m_ok, other=0.0)
    return q, do, lse, delta


@triton.jit
def _table_entry(Blocks):
    """The block this program owns: (its sequence, its first row within the sequence)."""
    entry = Blocks + 2 * tl.program_id(0)
    return tl.load(entry), tl.load(entry + 1)


@triton.jit
def _sequence(Offsets, seq, head_dim, BLOCK_D: tl.constexpr):
    """Where sequence ``seq`` starts, its length, and the layout of this program's head in
    it: the base offset, the row stride (heads are the grid's second axis) and the head-dim
    offsets and mask that every tile of the program shares."""
    row0 = tl.load(Offsets + seq)
    seq_len = (tl.load(Offsets + seq + 1) - row0).to(tl.int32)
    stride_t = tl.num_programs(1) * head_dim
    base = row0 * stride_t + tl.program_id(1) * head_dim
    offs_d = tl.arange(0, BLOCK_D)
    return row0, seq_len, base, stride_t, offs_d, offs_d < head_dim


@triton.jit
def _row_stats(row0, rows):
    """Offsets of ``rows``' log-sum-exp and delta, stored [total, heads] (row-major)."""
    return (row0 + rows) * tl.num_programs(1) + tl.program_id(1)


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    Offsets,
    Blocks,
    num_seqs,
    head_dim,
    qk_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, q_start = _table_entry(Blocks)
    if seq >= num_seqs:  # past the real blocks
        return
    row0, seq_len, base, stride_t, offs_d, d_ok = _sequence(Offsets, seq, head_dim, BLOCK_D)
    offs_m = q_start + tl.arange(0, BLOCK_M)
    q, q_off, q_mask = _rows(Q, base, offs_m, seq_len, offs_d, d_ok, stride_t)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key 0 is visible to every row (padding rows included), so m_i is finite after the
    # first block and exp2(m_i - m_new) never sees -inf - -inf.
    for n0 in range(0, _keys_seen(q_start, seq_len, BLOCK_M, CAUSAL), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k, kv_off, kv_mask = _rows(K, base, cols, seq_len, offs_d, d_ok, stride_t)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(_visible(offs_m, cols, seq_len, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    tl.store(Out + q_off, acc.to(Out.dtype.element_ty), mask=q_mask)
    tl.store(LSE + _row_stats(row0, offs_m), m_i + tl.log2(l_i), mask=offs_m < seq_len)


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    Delta,
    DQ,
    DK,
    DV,
    Offsets,
    Blocks,
    num_seqs,
    head_dim,
    qk_scale,
    sm_scale,
    KEY_BLOCKS: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """KEY_BLOCKS: the program owns a key block and accumulates its dK, dV over the query
    blocks that see it; else it owns a query block and accumulates its dQ over the key
    blocks it sees. Each pass writes only its own block: no atomics."""
    seq, start = _table_entry(Blocks)
    if seq >= num_seqs:  # past the real blocks
        return
    row0, seq_len, base, stride_t, offs_d, d_ok = _sequence(Offsets, seq, head_dim, BLOCK_D)
    if KEY_BLOCKS:
        cols = start + tl.arange(0, BLOCK_N)
        k, kv_off, kv_mask = _rows(K, base, cols, seq_len, offs_d, d_ok, stride_t)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        lo = 0
        if CAUSAL:
            lo = (start // BLOCK_M) * BLOCK_M  # earlier query rows cannot see these keys
        for m0 in range(lo, seq_len, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            m_ok = rows < seq_len
            q_off, q_mask = _tile(base, rows, seq_len, offs_d, d_ok, stride_t)
            row_off = _row_stats(row0, rows)
            q, do, lse, delta = _query_block(Q, DO, LSE, Delta, q_off, q_mask, row_off, m_ok)
            keep = m_ok[:, None] & _visible(rows, cols, seq_len, CAUSAL)
            p, ds = _grad_terms(q, k, v, do, lse, delta, keep, qk_scale, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)
    else:
        rows = start + tl.arange(0, BLOCK_M)
        m_ok = rows < seq_len
        q_off, q_mask = _tile(base, rows, seq_len, offs_d, d_ok, stride_t)
        row_off = _row_stats(row0, rows)
        q, do, lse, delta = _query_block(Q, DO, LSE, Delta, q_off, q_mask, row_off, m_ok)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, _keys_seen(start, seq_len, BLOCK_M, CAUSAL), BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            k, kv_off, kv_mask = _rows(K, base, cols, seq_len, offs_d, d_ok, stride_t)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            keep = m_ok[:, None] & _visible(rows, cols, seq_len, CAUSAL)
            p, ds = _grad_terms(q, k, v, do, lse, delta, keep, qk_scale, PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def block_table(offsets: torch.Tensor, total: int, block: int) -> torch.Tensor:
    """[entries, 2] int32: (sequence id, first row within the sequence) of every BLOCK-row
    block; sync-free. Entries past the real blocks have sequence id == batch (the kernels
    skip them)."""
    batch = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    blocks = (lengths + block - 1) // block
    ends = torch.cumsum(blocks, 0)
    pid = torch.arange(triton.cdiv(total, block) + batch, device=offsets.device)
    seq = torch.searchsorted(ends, pid, right=True)
    first = (ends - blocks)[seq.clamp(max=batch - 1)]
    return torch.stack((seq, (pid - first) * block), dim=1).to(torch.int32)


def _default_blocks(dim: int) -> tuple[int, int]:
    # History sequences are short (mean ~32): small query blocks waste fewer padded rows.
    return (32, 32) if dim <= 64 else (64, 32)


class _JaggedFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, causal, block_m, block_n):  # noqa: D102
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        total, heads, dim = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(total, heads, dtype=torch.float32, device=q.device)
        ctx.cfg = dict(
            num_seqs=offsets.numel() - 1,
            head_dim=dim,
            CAUSAL=causal,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        ctx.sm_scale = 1.0 / math.sqrt(dim)
        blocks_m = block_table(offsets, total, block_m)
        _fwd_kernel[(len(blocks_m), heads)](
            q,
            k,
            v,
            o,
            lse,
            offsets,
            blocks_m,
            qk_scale=ctx.sm_scale * LOG2E,
            num_warps=4,
            **ctx.cfg,
        )
        ctx.save_for_backward(q, k, v, o, lse, offsets, blocks_m)
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, o, lse, offsets, blocks_m = ctx.saved_tensors
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)  # [total, heads]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        heads = q.shape[1]
        scales = dict(qk_scale=ctx.sm_scale * LOG2E, sm_scale=ctx.sm_scale, num_warps=4)
        blocks_n = block_table(offsets, q.shape[0], ctx.cfg["BLOCK_N"])
        grads = (q, k, v, do, lse, delta, dq, dk, dv, offsets)
        _bwd_kernel[(len(blocks_n), heads)](*grads, blocks_n, KEY_BLOCKS=True, **scales, **ctx.cfg)
        _bwd_kernel[(len(blocks_m), heads)](*grads, blocks_m, KEY_BLOCKS=False, **scales, **ctx.cfg)
        return dq, dk, dv, None, None, None, None


def triton_jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    causal: bool = False,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Jagged attention with the Triton kernels; inputs already validated by ``dispatch``."""
    if not q.is_cuda and not INTERPRETED:
        raise RuntimeError(
            "impl='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is first imported (or use impl='cpu')"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"impl='triton' supports {SUPPORTED_DTYPES}, got {q.dtype}")
    if INTERPRETED and q.dtype == torch.bfloat16:
        raise TypeError("the Triton interpreter has no bf16 arithmetic: use float32 on CPU")
    total, heads, dim = q.shape
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"impl='triton' supports head dim <= {MAX_HEAD_DIM}, got {dim}")
    if total == 0 or offsets.numel() <= 1:
        return empty_result(q, k, v)
    default_m, default_n = _default_blocks(dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    return _JaggedFlashAttention.apply(q, k, v, offsets, causal, block_m, block_n)
