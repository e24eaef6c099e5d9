"""Exact per-position KL divergence between two categorical distributions given as logits, fused.

    p = softmax(logits_p / T),  q = softmax(logits_q / T)
    KL(p || q) = sum_v p_v (log p_v - log q_v)
    d KL / d logits_p[v] = p_v (log p_v - log q_v - KL) / T

This is the exact KL over the whole vocabulary, not the one-sample estimators (k1, k3) that
PPO/GRPO papers use to save this very computation. `logits_q` is the frozen reference (the
reference policy, or the old policy): no gradient flows to it, and passing a `logits_q` that
requires grad raises a ValueError, so that a missing `torch.no_grad()` around the reference
model cannot silently train it... or silently not train it; detach it yourself if you mean to.

Numerics. One pass over both rows keeps, for each, a running max and a running sum of
exp(x - max) (online logsumexp, as in logprobs.py), plus two weighted sums measured from the
running maxima:

    u = sum_v exp(a_v - m_p) (a_v - m_p)    (<= 0)      a = logits_p / T,  m_p = max a
    c = sum_v exp(a_v - m_p) (b_v - m_q)    (<= 0)      b = logits_q / T,  m_q = max b
    H(p)    = log s_p - u / s_p                         (entropy, both terms >= 0)
    CE(p,q) = log s_q - c / s_p                         (cross-entropy, both terms >= 0)
    KL      = CE(p, q) - H(p)

Every term is a sum of same-sign numbers, so each is accurate to float32 rounding even at
|logits| ~ 1e4, where the textbook form sum p (a - b) - lse_p + lse_q loses everything to
cancellation. When the running max grows from m to m', u and c are moved onto the new max:
u' = exp(m - m') (u + (m - m') s), and likewise c with (m_q - m_q') s_p. KL itself is still a
difference (CE - H): its absolute error is about float32 epsilon times H(p) <= log V. It is
exactly 0 for identical inputs (both sums are then the same arithmetic), and it is clamped at
0 from below (Gibbs' inequality: a negative value is rounding).

Edge cases, both paths: -inf logits are allowed (0 log 0 = 0). Where q is -inf and p is not,
KL is +inf (and its gradient is not meaningful). An all -inf row of p or q gives NaN.

Layout: (1) reference, (2) PyTorch path, (3) Triton kernels, (4) launchers, (5) autograd
wrapper, (6) dispatch.
"""

import torch
from torch.autograd.function import once_differentiable

from .common import (
    as_rows,
    check_logits,
    check_temperature,
    chunk_ranges,
    default_block,
    num_warps,
    require_triton,
    rows_per_chunk,
    take_rows,
    tl,
    triton,
    use_triton,
)


# =============================================================================================
# (1) Reference: what this file replaces.
# =============================================================================================
def kl_reference(logits_p, logits_q, temperature=1.0):
    """Naive KL(p || q): two float32 [..., V] log-softmaxes, kept for backward."""
    logp = torch.log_softmax(logits_p.float() / temperature, dim=-1)  # [..., V] float32
    logq = torch.log_softmax(logits_q.float() / temperature, dim=-1)  # [..., V] float32
    return torch.where(logp > float("-inf"), logp.exp() * (logp - logq), 0.0).sum(-1)  # [...]


def _check_pair(logits_p, logits_q):
    check_logits(logits_p, "logits_p")
    check_logits(logits_q, "logits_q")
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"logits_p {tuple(logits_p.shape)} and logits_q {tuple(logits_q.shape)} must have the same shape")
    if logits_p.device != logits_q.device:
        raise ValueError(f"logits_p is on {logits_p.device} but logits_q is on {logits_q.device}")
    if logits_q.requires_grad:
        raise ValueError(
            "logits_q requires grad, but kl() treats q as the frozen reference and gives it no "
            "gradient: compute it under torch.no_grad() or pass logits_q.detach()"
        )


# =============================================================================================
# (2) PyTorch path: rows in chunks, only O(N) kept for backward.
# =============================================================================================
def _log_softmax_parts(x):
    """x [n, V] float32 -> (x - m) - log s, m, log s; an all -inf row shifts by m = 0."""
    m = x.amax(dim=-1)
    m = m.masked_fill(m == float("-inf"), 0.0)  # [n]
    x = x - m[:, None]
    ls = x.exp().sum(dim=-1).log_()  # [n]
    return x.sub_(ls[:, None]), m, ls  # [n, V] log-softmax, [n], [n]


class _KLTorch(torch.autograd.Function):
    """Keeps (both logits by reference, both row max and log-sum, KL): O(N) beyond the logits.
    Each chunk of rows makes a few float32 [rows, V] temporaries (~32 MB each)."""

    @staticmethod
    def forward(ctx, logits_p, logits_q, temperature, max_rows):
        p3, q3 = as_rows(logits_p), as_rows(logits_q)  # [B, R, V] views
        B, R, V = p3.shape
        inv_t = 1.0 / temperature
        out = torch.empty(B * R, dtype=torch.float32, device=logits_p.device)  # [N] KL
        stats = torch.empty((4, B * R), dtype=torch.float32, device=logits_p.device)  # m_p, ls_p, m_q, ls_q
        for start, stop in chunk_ranges(p3, max_rows):
            logp, stats[0, start:stop], stats[1, start:stop] = _log_softmax_parts(take_rows(p3, start, stop).float() * inv_t)
            logq, stats[2, start:stop], stats[3, start:stop] = _log_softmax_parts(take_rows(q3, start, stop).float() * inv_t)
            p = logp.exp()  # [n, V]
            out[start:stop] = torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)  # sum p (log p - log q), 0 log 0 = 0
        out.clamp_(min=0.0)  # KL >= 0; below it is rounding
        ctx.save_for_backward(logits_p, logits_q, stats, out)
        ctx.inv_t, ctx.max_rows = inv_t, max_rows
        return out.view(logits_p.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits_p, logits_q, stats, kl = ctx.saved_tensors
        p3, q3 = as_rows(logits_p), as_rows(logits_q)
        B, R, V = p3.shape
        g = grad_out.reshape(-1).float() * ctx.inv_t  # [N] grad / T
        grad = torch.empty((B * R, V), dtype=logits_p.dtype, device=logits_p.device)  # d logits_p
        for start, stop in chunk_ranges(p3, ctx.max_rows):
            rows = slice(start, stop)
            logp = take_rows(p3, start, stop).float() * ctx.inv_t
            logp = logp.sub_(stats[0, rows, None]).sub_(stats[1, rows, None])  # [n, V] log p
            logq = take_rows(q3, start, stop).float() * ctx.inv_t
            logq = logq.sub_(stats[2, rows, None]).sub_(stats[3, rows, None])  # [n, V] log q
            p = logp.exp()
            d = torch.where(p > 0, p * (logp.sub_(logq).sub_(kl[rows, None])), 0.0)  # p (log p - log q - KL)
            grad[rows] = d.mul_(g[rows, None])
        return grad.view(logits_p.shape), None, None, None


def kl_torch(logits_p, logits_q, temperature=1.0, *, chunk_rows=None):
    """KL(softmax(p/T) || softmax(q/T)) per position -> float32 [...], PyTorch path (any device).

    chunk_rows: rows per chunk (default: one float32 [rows, V] temporary is ~32 MB)."""
    _check_pair(logits_p, logits_q)
    temperature = check_temperature(temperature)
    return _KLTorch.apply(logits_p, logits_q, temperature, chunk_rows or rows_per_chunk(logits_p.shape[-1]))


# =============================================================================================
# (3) Triton kernels: one program per row, one loop over both rows in BLOCK_V steps.
# =============================================================================================
@triton.jit
def _kl_fwd_kernel(
    p_ptr, p_stride_b, p_stride_r,  # logits_p viewed as [B, R, V], stride 1 along V
    q_ptr, q_stride_b, q_stride_r,  # logits_q viewed as [B, R, V]
    R, out_ptr, stats_ptr, N,  # out float32 [N]; stats float32 [4, N]: m_p, log s_p, m_q, log s_q
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads 2 * V * itemsize (both rows, once); writes 20. No [N, V] write.
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + (row // R) * p_stride_b + (row % R) * p_stride_r
    q_row = q_ptr + (row // R) * q_stride_b + (row % R) * q_stride_r
    cols = tl.arange(0, BLOCK_V)

    m_p = float("-inf")  # running max of a = logits_p / T
    s_p = 0.0  # sum exp(a - m_p)
    u = 0.0  # sum exp(a - m_p) (a - m_p)
    c = 0.0  # sum exp(a - m_p) (b - m_q)
    m_q = float("-inf")  # running max of b = logits_q / T
    s_q = 0.0  # sum exp(b - m_q)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        a = tl.load(p_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        b = tl.load(q_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        # New maxima; while a row is all -inf so far we shift by 0, not -inf (-inf - -inf = NaN).
        mp_new = tl.maximum(m_p, tl.max(a, axis=0))
        mp_safe = tl.where(mp_new == float("-inf"), 0.0, mp_new)
        mq_new = tl.maximum(m_q, tl.max(b, axis=0))
        mq_safe = tl.where(mq_new == float("-inf"), 0.0, mq_new)
        w = tl.exp(a - mp_safe)  # [BLOCK_V] unnormalised p
        # Move u and c onto the new maxima (see the docstring), then add this block.
        # (while s_p == 0 nothing is summed yet, and m_p may still be -inf)
        alpha = tl.exp(m_p - mp_safe)
        u = alpha * (u + tl.where(s_p > 0, (m_p - mp_safe) * s_p, 0.0))
        c = alpha * (c + tl.where(s_p > 0, (m_q - mq_safe) * s_p, 0.0))
        u += tl.sum(tl.where(w > 0, a - mp_safe, 0.0) * w, axis=0)  # 0 log 0 = 0
        c += tl.sum(tl.where(w > 0, b - mq_safe, 0.0) * w, axis=0)  # -inf where q = 0 < p
        s_p = s_p * alpha + tl.sum(w, axis=0)
        s_q = s_q * tl.exp(m_q - mq_safe) + tl.sum(tl.exp(b - mq_safe), axis=0)
        m_p = mp_new
        m_q = mq_new
    m_p = tl.where(m_p == float("-inf"), 0.0, m_p)  # the shifts backward must use
    m_q = tl.where(m_q == float("-inf"), 0.0, m_q)
    log_sp = tl.log(s_p)
    log_sq = tl.log(s_q)
    entropy = log_sp - u / s_p  # H(p)
    cross_entropy = log_sq - c / s_p  # CE(p, q)
    tl.store(out_ptr + row, tl.maximum(cross_entropy - entropy, 0.0))  # KL >= 0; below it is rounding
    tl.store(stats_ptr + row, m_p)
    tl.store(stats_ptr + N + row, log_sp)
    tl.store(stats_ptr + 2 * N + row, m_q)
    tl.store(stats_ptr + 3 * N + row, log_sq)


@triton.jit
def _kl_bwd_kernel(
    p_ptr, p_stride_b, p_stride_r,
    q_ptr, q_stride_b, q_stride_r,
    R, kl_ptr, stats_ptr, grad_out_ptr, N,  # [N], [4, N], [N]
    grad_ptr,  # [N, V] contiguous, logits_p's dtype
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads 2 * V * itemsize (both rows) + 24; writes V * itemsize (d logits_p).
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + (row // R) * p_stride_b + (row % R) * p_stride_r
    q_row = q_ptr + (row // R) * q_stride_b + (row % R) * q_stride_r
    grad_row = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    m_p = tl.load(stats_ptr + row)
    log_sp = tl.load(stats_ptr + N + row)
    m_q = tl.load(stats_ptr + 2 * N + row)
    log_sq = tl.load(stats_ptr + 3 * N + row)
    kl = tl.load(kl_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature  # grad / T
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        a = tl.load(p_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        b = tl.load(q_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        log_p = (a - m_p) - log_sp
        log_q = (b - m_q) - log_sq
        p = tl.exp(log_p)
        d = tl.where(p > 0, p * (log_p - log_q - kl), 0.0)  # p (log p - log q - KL)
        tl.store(grad_row + offs, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def _kl_fwd(logits_p, logits_q, inv_t, block):
    p3, q3 = as_rows(logits_p), as_rows(logits_q)  # [B, R, V] views
    B, R, V = p3.shape
    out = torch.empty(B * R, dtype=torch.float32, device=logits_p.device)  # [N]
    stats = torch.empty((4, B * R), dtype=torch.float32, device=logits_p.device)  # [4, N]
    if B * R == 0:
        return out, stats
    _kl_fwd_kernel[(B * R,)](
        p3, p3.stride(0), p3.stride(1), q3, q3.stride(0), q3.stride(1), R, out, stats, B * R, V, inv_t,
        BLOCK_V=block, num_warps=num_warps(block),
    )
    return out, stats


def _kl_bwd(logits_p, logits_q, kl, stats, grad_out, inv_t, block):
    p3, q3 = as_rows(logits_p), as_rows(logits_q)
    B, R, V = p3.shape
    grad = torch.empty((B * R, V), dtype=logits_p.dtype, device=logits_p.device)  # [N, V]
    if B * R == 0:
        return grad
    _kl_bwd_kernel[(B * R,)](
        p3, p3.stride(0), p3.stride(1), q3, q3.stride(0), q3.stride(1), R, kl, stats, grad_out, B * R,
        grad, V, inv_t,
        BLOCK_V=block, num_warps=num_warps(block),
    )
    return grad


# =============================================================================================
# (5) Autograd wrapper.
# =============================================================================================
class _KLTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_p, logits_q, temperature, block):
        out, stats = _kl_fwd(logits_p, logits_q, 1.0 / temperature, block)
        ctx.save_for_backward(logits_p, logits_q, out, stats)
        ctx.inv_t, ctx.block = 1.0 / temperature, block
        return out.view(logits_p.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits_p, logits_q, kl, stats = ctx.saved_tensors
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]; may arrive expanded (stride 0)
        grad = _kl_bwd(logits_p, logits_q, kl, stats, grad_out, ctx.inv_t, ctx.block)
        return grad.view(logits_p.shape), None, None, None


def kl_triton(logits_p, logits_q, temperature=1.0, *, block_size=None):
    """KL(softmax(p/T) || softmax(q/T)) per position -> float32 [...], Triton path (CUDA, or any
    device under TRITON_INTERPRET=1).

    block_size: elements of a row per loop step (default: the row, up to 2048; two rows are live)."""
    _check_pair(logits_p, logits_q)
    temperature = check_temperature(temperature)
    require_triton(logits_p)
    block = block_size or default_block(logits_p.shape[-1], max_block=2048)
    return _KLTriton.apply(logits_p, logits_q, temperature, block)


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def kl(logits_p, logits_q, temperature=1.0):
    """Exact KL(softmax(logits_p / T) || softmax(logits_q / T)) over the last dim -> float32 [...].

    logits_p, logits_q [..., V], same shape, any float dtypes and strides. Differentiable w.r.t.
    logits_p only: logits_q is the frozen reference and must not require grad (ValueError).
    Float32 accumulation; Triton on CUDA (or under TRITON_INTERPRET=1), PyTorch elsewhere."""
    if use_triton(logits_p):
        return kl_triton(logits_p, logits_q, temperature)
    return kl_torch(logits_p, logits_q, temperature)
