"""Exact per-position KL divergence between two categorical distributions given as logits, fused.

    p = softmax(logits_p / temp),  q = softmax(logits_q / temp)
    KL(p || q) = sum_v p_v (log p_v - log q_v)
    d KL / d logits_p[v] = p_v (log p_v - log q_v - KL) / temp

This is the exact KL over the whole vocabulary, not the one-sample estimators (k1, k3) that
PPO/GRPO papers use to save this very computation. `logits_q` is the frozen reference (the
reference policy, or the old policy): no gradient flows to it, and passing a `logits_q` that
requires grad raises a ValueError, so that a missing `torch.no_grad()` around the reference
model cannot silently train it... or silently not train it; detach it yourself if you mean to.

Shapes, as in logprobs.py: logits_p and logits_q [..., V] are each read as N rows of V through
a view [B, T, V] (B batch, T time, V vocabulary, N = B * T; common.as_rows), slices included.

Numerics. One pass over both rows keeps, for each, a running max and a running sum of
exp(x - max) (online logsumexp, Milakov & Gimelshein 2018, as in logprobs.py), plus two weighted
sums measured from the running maxima:

    u = sum_v exp(a_v - m_p) (a_v - m_p)    (<= 0)      a = logits_p / temp,  m_p = max a
    c = sum_v exp(a_v - m_p) (b_v - m_q)    (<= 0)      b = logits_q / temp,  m_q = max b
    s_p = sum_v exp(a_v - m_p),  s_q = sum_v exp(b_v - m_q),  log_sum_p = log s_p, ...
    H(p)    = log_sum_p - u / s_p                       (entropy, both terms >= 0)
    CE(p,q) = log_sum_q - c / s_p                       (cross-entropy, both terms >= 0)
    KL      = CE(p, q) - H(p)

Every term is a sum of same-sign numbers, so each is accurate to float32 rounding even at
|logits| ~ 1e4, where the textbook form sum p (a - b) - lse_p + lse_q loses everything to
cancellation. When the running max grows from m to m', u and c are moved onto the new max:
u' = exp(m - m') (u + (m - m') s), and likewise c with (m_q - m_q') s_p. KL itself is still a
difference (CE - H): its absolute error is about float32 epsilon times H(p) <= log V. It is
exactly 0 for identical inputs (both sums are then the same arithmetic), and it is clamped at
0 from below (Gibbs' inequality: a negative value is rounding; the clamp keeps NaN).

Edge cases, the same on both paths (tests/test_kernels.py, EDGE_CASES, checks each):
  - a NaN or +inf logit anywhere in a row of p or of q: that row's KL and its whole gradient row
    are NaN; other rows are unaffected. A NaN is never turned into a number.
  - -inf logits are allowed: probability 0, and 0 log 0 = 0.
  - where q is -inf and p is not, KL is +inf; its gradient is the formula above in IEEE
    arithmetic (NaN where q_v = 0 < p_v, -inf * sign(grad) where both are > 0, 0 where p_v = 0):
    not usable, mask such positions out with torch.where.
  - an all -inf row of p or of q has no distribution: KL and gradient NaN.
  - V = 1: KL 0 and gradient 0.
  - temperatures outside [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-3, 1e3] raise ValueError.

Layout: (1) reference, (2) PyTorch path, (3) Triton kernels, (4) launchers, (5) autograd
wrapper, (6) dispatch, (7) self-check: `python -m kernels.kl`.
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
        raise ValueError(f"logits_p {tuple(logits_p.shape)} and "
                         f"logits_q {tuple(logits_q.shape)} must have the same shape")
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
def _log_softmax_rows(x):
    """x [n, V] float32 -> log softmax in place, and its row max m and log_sum ([n] each); an
    all -inf row shifts by m = 0 (and comes out NaN: -inf - log 0)."""
    m = x.amax(dim=-1)
    m = m.masked_fill(m == float("-inf"), 0.0)  # [n]
    x = x.sub_(m[:, None])  # [n, V] x - m
    log_sum = x.exp().sum(dim=-1).log_()  # [n]
    return x.sub_(log_sum[:, None]), m, log_sum  # [n, V] log-softmax, [n], [n]


class _KLTorch(torch.autograd.Function):
    """Keeps (both logits by reference, both rows' max and log_sum, KL): O(N) beyond the logits.
    Each chunk of rows makes a few float32 [chunk_rows, V] temporaries (~32 MB each)."""

    @staticmethod
    def forward(ctx, logits_p, logits_q, temperature, chunk_rows):
        p3, q3 = as_rows(logits_p), as_rows(logits_q)  # [B, T, V] views
        B, T, V = p3.shape
        inv_temp = 1.0 / temperature
        out = torch.empty(B * T, dtype=torch.float32, device=logits_p.device)  # [N] KL
        row_max_p, log_sum_p, row_max_q, log_sum_q = torch.empty((4, B * T), dtype=torch.float32,
                                                                 device=logits_p.device)
        for start, stop in chunk_ranges(p3, chunk_rows):
            rows = slice(start, stop)
            logp, row_max_p[rows], log_sum_p[rows] = _log_softmax_rows(
                take_rows(p3, start, stop).float() * inv_temp)
            logq, row_max_q[rows], log_sum_q[rows] = _log_softmax_rows(
                take_rows(q3, start, stop).float() * inv_temp)
            p = logp.exp()  # [n, V]
            terms = logq.neg_().add_(logp).mul_(p)  # [n, V] p (log p - log q), in logq's buffer
            out[rows] = torch.where(p == 0, 0.0, terms).sum(-1)  # 0 log 0 = 0; NaN stays NaN
        out.clamp_(min=0.0)  # KL >= 0; below it is rounding (clamp keeps NaN)
        ctx.save_for_backward(logits_p, logits_q, row_max_p, log_sum_p, row_max_q, log_sum_q, out)
        ctx.inv_temp, ctx.chunk_rows = inv_temp, chunk_rows
        return out.view(logits_p.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits_p, logits_q, row_max_p, log_sum_p, row_max_q, log_sum_q, kl = ctx.saved_tensors
        p3, q3 = as_rows(logits_p), as_rows(logits_q)
        B, T, V = p3.shape
        g = grad_out.reshape(-1).float() * ctx.inv_temp  # [N] grad / temp
        grad = torch.empty((B * T, V), dtype=logits_p.dtype, device=logits_p.device)  # d logits_p
        for start, stop in chunk_ranges(p3, ctx.chunk_rows):
            rows = slice(start, stop)
            # log p = (a - m_p) - log_sum_p, the Triton backward's formula; here each step is a
            # pass over a float32 [n, V] tensor, done in place where the buffer allows.
            logp = take_rows(p3, start, stop).float() * ctx.inv_temp
            logp = logp.sub_(row_max_p[rows, None]).sub_(log_sum_p[rows, None])  # [n, V] log p
            logq = take_rows(q3, start, stop).float() * ctx.inv_temp
            logq = logq.sub_(row_max_q[rows, None]).sub_(log_sum_q[rows, None])  # [n, V] log q
            p = logp.exp()
            d = p * logp.sub_(logq).sub_(kl[rows, None])  # p (log p - log q - KL)
            # 0 where p = 0; NaN stays NaN
            grad[rows] = torch.where(p == 0, 0.0, d).mul_(g[rows, None])
        return grad.view(logits_p.shape), None, None, None


def kl_torch(logits_p, logits_q, temperature=1.0, *, chunk_rows=None):
    """KL(softmax(p/temp) || softmax(q/temp)) per position -> float32 [...], PyTorch path, any
    device.

    chunk_rows: rows per chunk (default: one float32 [chunk_rows, V] temporary is ~32 MB)."""
    _check_pair(logits_p, logits_q)
    temperature = check_temperature(temperature)
    return _KLTorch.apply(logits_p, logits_q, temperature,
                          chunk_rows or rows_per_chunk(logits_p.shape[-1]))


# =============================================================================================
# (3) Triton kernels: one program per row, one loop over both rows in BLOCK_V steps.
# =============================================================================================
@triton.jit
def _kl_fwd_kernel(
    p_ptr, p_stride_b, p_stride_t,  # logits_p viewed as [B, T, V], stride 1 along V
    q_ptr, q_stride_b, q_stride_t,  # logits_q viewed as [B, T, V]
    T, out_ptr,  # out: float32 [N] KL
    row_max_p_ptr, log_sum_p_ptr, row_max_q_ptr, log_sum_q_ptr,  # float32 [N] each
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads 2 * V * itemsize (both rows, once); writes 20. No [N, V] write.
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + (row // T) * p_stride_b + (row % T) * p_stride_t
    q_row = q_ptr + (row // T) * q_stride_b + (row % T) * q_stride_t
    cols = tl.arange(0, BLOCK_V)

    m_p = float("-inf")  # running max of a = logits_p / temp
    s_p = 0.0  # sum exp(a - m_p)
    u = 0.0  # sum exp(a - m_p) (a - m_p)
    c = 0.0  # sum exp(a - m_p) (b - m_q)
    m_q = float("-inf")  # running max of b = logits_q / temp
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
        u += tl.sum(tl.where(w == 0, 0.0, w * (a - mp_safe)), axis=0)  # 0 log 0 = 0; NaN stays NaN
        c += tl.sum(tl.where(w == 0, 0.0, w * (b - mq_safe)), axis=0)  # -inf where q = 0 < p
        s_p = s_p * alpha + tl.sum(w, axis=0)
        s_q = s_q * tl.exp(m_q - mq_safe) + tl.sum(tl.exp(b - mq_safe), axis=0)
        m_p = mp_new
        m_q = mq_new
    m_p = tl.where(m_p == float("-inf"), 0.0, m_p)  # the shifts backward must use
    m_q = tl.where(m_q == float("-inf"), 0.0, m_q)
    log_sum_p = tl.log(s_p)
    log_sum_q = tl.log(s_q)
    entropy = log_sum_p - u / s_p  # H(p)
    cross_entropy = log_sum_q - c / s_p  # CE(p, q)
    # KL >= 0; below it is rounding. PropagateNan.ALL: a GPU max would otherwise turn NaN into 0.
    kl = tl.maximum(cross_entropy - entropy, 0.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + row, kl)
    tl.store(row_max_p_ptr + row, m_p)
    tl.store(log_sum_p_ptr + row, log_sum_p)
    tl.store(row_max_q_ptr + row, m_q)
    tl.store(log_sum_q_ptr + row, log_sum_q)


@triton.jit
def _kl_bwd_kernel(
    p_ptr, p_stride_b, p_stride_t,
    q_ptr, q_stride_b, q_stride_t,
    T, kl_ptr, grad_out_ptr,  # [N] each
    row_max_p_ptr, log_sum_p_ptr, row_max_q_ptr, log_sum_q_ptr,  # [N] each
    grad_ptr,  # [N, V] contiguous, logits_p's dtype
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads 2 * V * itemsize (both rows) + 24; writes V * itemsize (d logits_p).
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + (row // T) * p_stride_b + (row % T) * p_stride_t
    q_row = q_ptr + (row // T) * q_stride_b + (row % T) * q_stride_t
    grad_row = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    m_p = tl.load(row_max_p_ptr + row)
    log_sum_p = tl.load(log_sum_p_ptr + row)
    m_q = tl.load(row_max_q_ptr + row)
    log_sum_q = tl.load(log_sum_q_ptr + row)
    kl = tl.load(kl_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature  # grad / temp
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        a = tl.load(p_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        b = tl.load(q_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        log_p = (a - m_p) - log_sum_p  # recomputed in registers, as the PyTorch path does in memory
        log_q = (b - m_q) - log_sum_q
        p = tl.exp(log_p)
        d = tl.where(p == 0, 0.0, p * (log_p - log_q - kl))  # p (log p - log q - KL); NaN stays NaN
        tl.store(grad_row + offs, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def launch_config(V, block_size=None):
    """The compile-time block along V and the warps per program for a vocabulary of V
    (block_size overrides the block): up to 2048, as two rows are live. Used by the launchers
    below, and by tests/test_kernel_compile.py and bench/kernel_registers.py."""
    block = block_size or default_block(V, max_block=2048)
    return {"BLOCK_V": block, "num_warps": num_warps(block)}


def _kl_fwd(logits_p, logits_q, inv_temp, config):
    p3, q3 = as_rows(logits_p), as_rows(logits_q)  # [B, T, V] views
    B, T, V = p3.shape
    out = torch.empty(B * T, dtype=torch.float32, device=logits_p.device)  # [N]
    # row_max_p, log_sum_p, row_max_q, log_sum_q
    stats = torch.empty((4, B * T), dtype=torch.float32, device=logits_p.device)
    if B * T == 0:
        return out, stats
    _kl_fwd_kernel[(B * T,)](
        p3, p3.stride(0), p3.stride(1), q3, q3.stride(0), q3.stride(1), T, out, *stats, V, inv_temp,
        **config,
    )
    return out, stats


def _kl_bwd(logits_p, logits_q, kl, stats, grad_out, inv_temp, config):
    p3, q3 = as_rows(logits_p), as_rows(logits_q)
    B, T, V = p3.shape
    grad = torch.empty((B * T, V), dtype=logits_p.dtype, device=logits_p.device)  # [N, V]
    if B * T == 0:
        return grad
    _kl_bwd_kernel[(B * T,)](
        p3, p3.stride(0), p3.stride(1), q3, q3.stride(0), q3.stride(1), T, kl, grad_out, *stats,
        grad, V, inv_temp, **config,
    )
    return grad


# =============================================================================================
# (5) Autograd wrapper.
# =============================================================================================
class _KLTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_p, logits_q, temperature, config):
        out, stats = _kl_fwd(logits_p, logits_q, 1.0 / temperature, config)
        ctx.save_for_backward(logits_p, logits_q, out, stats)
        ctx.inv_temp, ctx.config = 1.0 / temperature, config
        return out.view(logits_p.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits_p, logits_q, kl, stats = ctx.saved_tensors
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]; may arrive expanded (stride 0)
        grad = _kl_bwd(logits_p, logits_q, kl, stats, grad_out, ctx.inv_temp, ctx.config)
        return grad.view(logits_p.shape), None, None, None


def kl_triton(logits_p, logits_q, temperature=1.0, *, block_size=None):
    """KL(softmax(p/temp) || softmax(q/temp)) per position -> float32 [...], Triton path (CUDA,
    or any device under TRITON_INTERPRET=1).

    block_size: elements of a row per loop step (default: the row, up to 2048); two rows live."""
    _check_pair(logits_p, logits_q)
    temperature = check_temperature(temperature)
    require_triton(logits_p)
    return _KLTriton.apply(logits_p, logits_q, temperature,
                           launch_config(logits_p.shape[-1], block_size))


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def kl(logits_p, logits_q, temperature=1.0):
    """Exact KL(softmax(logits_p / temp) || softmax(logits_q / temp)) over the last dim
    -> float32 [...].

    logits_p, logits_q [..., V], same shape, any float dtypes and strides. Differentiable w.r.t.
    logits_p only: logits_q is the frozen reference and must not require grad (ValueError).
    Float32 accumulation; Triton on CUDA (or under TRITON_INTERPRET=1), PyTorch elsewhere."""
    if use_triton(logits_p):
        return kl_triton(logits_p, logits_q, temperature)
    return kl_torch(logits_p, logits_q, temperature)


# =============================================================================================
# (7) Self-check: python -m kernels.kl  (TRITON_INTERPRET=1 python -m kernels.kl on a CPU)
# =============================================================================================
if __name__ == "__main__":
    import sys

    from .common import report

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "Triton" if use_triton(torch.empty(0, device=device)) else "PyTorch"
    print(f"kl vs kl_reference, {path} path on {device}")
    ok = True
    cases = [((3, 9, 1000), torch.float32, 1.0), ((2, 6, 37), torch.bfloat16, 0.7),
             ((4, 1), torch.float16, 2.0)]
    for shape, dtype, temp in cases:
        base = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
        logits_p = base[:, :-1] if base.dim() == 3 else base  # [B, T-1, V]: a slice, read in place
        logits_q = (logits_p.detach().float()
                    + torch.randn(logits_p.shape, device=device)).to(dtype)
        grad_out = torch.randn(logits_p.shape[:-1], device=device)
        got = kl(logits_p, logits_q, temp)
        (grad_got,) = torch.autograd.grad(got, base, grad_out)
        want = kl_reference(logits_p, logits_q, temp)
        (grad_want,) = torch.autograd.grad(want, base, grad_out)
        name = f"{tuple(logits_p.shape)} {str(dtype)[6:]} temp={temp}"
        ok &= report(name + " value", got, want, rtol=1e-4, atol=1e-5)
        ok &= report(name + " grad", grad_got, grad_want,
                     rtol=1e-2 if dtype != torch.float32 else 1e-4, atol=1e-6)
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)
