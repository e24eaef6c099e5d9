"""Per-position entropy of softmax(logits / T), fused: no [N, V] tensor.

    p = softmax(x),  x = logits / T
    H(p) = -sum_v p_v log p_v
    d H / d logits[v] = -p_v (log p_v + H) / T

Used for PPO's entropy bonus and for every script's logging. It is its own function (one more
read of the logits, V * itemsize bytes per row) rather than a by-product of `logprobs`: the log-
probs are needed for three models and the entropy for one, and one function per quantity keeps
each kernel short. (kl.py computes the same H(p) inside its own pass, as a step to the KL.)

Numerics, as in kl.py: one pass keeps the running max m, s = sum exp(x - m) and
u = sum exp(x - m) (x - m) <= 0, moved onto a new max m' as u' = exp(m - m') (u + (m - m') s).
Then H = log s - u / s is a sum of two terms >= 0, accurate to float32 rounding even for a
nearly one-hot row at |logits| ~ 1e4 (where the textbook lse - sum p x cancels to noise).

Edge cases, both paths: -inf logits are allowed (0 log 0 = 0); an all -inf row gives NaN.

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
def entropy_reference(logits, temperature=1.0):
    """Naive H(softmax(logits / T)): a float32 [..., V] log-softmax, kept for backward."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [..., V] float32
    return -torch.where(logp > float("-inf"), logp.exp() * logp, 0.0).sum(-1)  # [...]


# =============================================================================================
# (2) PyTorch path: rows in chunks, only O(N) kept for backward.
# =============================================================================================
class _EntropyTorch(torch.autograd.Function):
    """Keeps (logits by reference, row max, row log-sum, H): O(N) beyond the logits. Each chunk
    of rows makes a few float32 [rows, V] temporaries (~32 MB each)."""

    @staticmethod
    def forward(ctx, logits, temperature, max_rows):
        x3 = as_rows(logits)  # [B, R, V], a view of logits
        B, R, V = x3.shape
        inv_t = 1.0 / temperature
        out = torch.empty(B * R, dtype=torch.float32, device=logits.device)  # [N] H
        row_max, log_sum = torch.empty_like(out), torch.empty_like(out)  # [N] each
        for start, stop in chunk_ranges(x3, max_rows):
            x = take_rows(x3, start, stop).float() * inv_t  # [n, V] float32
            m = x.amax(dim=-1)
            m = m.masked_fill(m == float("-inf"), 0.0)  # [n]; all -inf row: shift by 0
            logp = x.sub_(m[:, None])  # [n, V] x - m, in place
            ls = logp.exp().sum(dim=-1).log_()  # [n] log s
            logp = logp.sub_(ls[:, None])  # [n, V] log p
            p = logp.exp()
            out[start:stop] = -torch.where(p > 0, p * logp, 0.0).sum(-1)  # H = -sum p log p, 0 log 0 = 0
            row_max[start:stop], log_sum[start:stop] = m, ls
        ctx.save_for_backward(logits, row_max, log_sum, out)
        ctx.inv_t, ctx.max_rows = inv_t, max_rows
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, row_max, log_sum, entropy = ctx.saved_tensors
        x3 = as_rows(logits)
        B, R, V = x3.shape
        g = grad_out.reshape(-1).float() * ctx.inv_t  # [N] grad / T
        grad = torch.empty((B * R, V), dtype=logits.dtype, device=logits.device)  # d logits
        for start, stop in chunk_ranges(x3, ctx.max_rows):
            rows = slice(start, stop)
            logp = take_rows(x3, start, stop).float() * ctx.inv_t
            logp = logp.sub_(row_max[rows, None]).sub_(log_sum[rows, None])  # [n, V] log p
            p = logp.exp()
            d = torch.where(p > 0, p * logp.add_(entropy[rows, None]), 0.0).neg_()  # -p (log p + H)
            grad[rows] = d.mul_(g[rows, None])
        return grad.view(logits.shape), None, None


def entropy_torch(logits, temperature=1.0, *, chunk_rows=None):
    """H(softmax(logits / T)) per position -> float32 [...], PyTorch path (any device).

    chunk_rows: rows per chunk (default: one float32 [rows, V] temporary is ~32 MB)."""
    check_logits(logits)
    temperature = check_temperature(temperature)
    return _EntropyTorch.apply(logits, temperature, chunk_rows or rows_per_chunk(logits.shape[-1]))


# =============================================================================================
# (3) Triton kernels: one program per row, a loop over the row in BLOCK_V steps.
# =============================================================================================
@triton.jit
def _entropy_fwd_kernel(
    logits_ptr, stride_b, stride_r, R,  # logits viewed as [B, R, V], stride 1 along V
    out_ptr, stats_ptr, N,  # out float32 [N]; stats float32 [2, N]: m, log s
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (the logits, once); writes 12. No [N, V] write.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // R) * stride_b + (row % R) * stride_r
    cols = tl.arange(0, BLOCK_V)

    m = float("-inf")  # running max of x = logits / T
    s = 0.0  # sum exp(x - m)
    u = 0.0  # sum exp(x - m) (x - m)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: shift by 0, not -inf
        w = tl.exp(x - m_safe)  # [BLOCK_V] unnormalised p
        alpha = tl.exp(m - m_safe)
        u = alpha * (u + tl.where(s > 0, (m - m_safe) * s, 0.0))  # u onto the new max
        u += tl.sum(tl.where(w > 0, x - m_safe, 0.0) * w, axis=0)  # 0 log 0 = 0
        s = s * alpha + tl.sum(w, axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(s)
    tl.store(out_ptr + row, log_s - u / s)  # H = log s - u / s
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + N + row, log_s)


@triton.jit
def _entropy_bwd_kernel(
    logits_ptr, stride_b, stride_r, R,  # logits viewed as [B, R, V]
    entropy_ptr, stats_ptr, grad_out_ptr, N,  # [N], [2, N], [N]
    grad_ptr,  # [N, V] contiguous, the logits' dtype
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (logits) + 16; writes V * itemsize (the gradient).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // R) * stride_b + (row % R) * stride_r
    grad_row = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    m = tl.load(stats_ptr + row)
    log_s = tl.load(stats_ptr + N + row)
    h = tl.load(entropy_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature  # grad / T
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        log_p = (x - m) - log_s
        p = tl.exp(log_p)
        d = tl.where(p > 0, -p * (log_p + h), 0.0)  # -p (log p + H)
        tl.store(grad_row + offs, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def _entropy_fwd(logits, inv_t, block):
    x3 = as_rows(logits)  # [B, R, V], a view of logits
    B, R, V = x3.shape
    out = torch.empty(B * R, dtype=torch.float32, device=logits.device)  # [N]
    stats = torch.empty((2, B * R), dtype=torch.float32, device=logits.device)  # [2, N]
    if B * R == 0:
        return out, stats
    _entropy_fwd_kernel[(B * R,)](
        x3, x3.stride(0), x3.stride(1), R, out, stats, B * R, V, inv_t,
        BLOCK_V=block, num_warps=num_warps(block),
    )
    return out, stats


def _entropy_bwd(logits, entropy, stats, grad_out, inv_t, block):
    x3 = as_rows(logits)
    B, R, V = x3.shape
    grad = torch.empty((B * R, V), dtype=logits.dtype, device=logits.device)  # [N, V]
    if B * R == 0:
        return grad
    _entropy_bwd_kernel[(B * R,)](
        x3, x3.stride(0), x3.stride(1), R, entropy, stats, grad_out, B * R, grad, V, inv_t,
        BLOCK_V=block, num_warps=num_warps(block),
    )
    return grad


# =============================================================================================
# (5) Autograd wrapper.
# =============================================================================================
class _EntropyTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperature, block):
        out, stats = _entropy_fwd(logits, 1.0 / temperature, block)
        ctx.save_for_backward(logits, out, stats)
        ctx.inv_t, ctx.block = 1.0 / temperature, block
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, entropy, stats = ctx.saved_tensors
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]; may arrive expanded (stride 0)
        grad = _entropy_bwd(logits, entropy, stats, grad_out, ctx.inv_t, ctx.block)
        return grad.view(logits.shape), None, None


def entropy_triton(logits, temperature=1.0, *, block_size=None):
    """H(softmax(logits / T)) per position -> float32 [...], Triton path (CUDA, or any device
    under TRITON_INTERPRET=1).

    block_size: elements of a row per loop step (default: the row, up to 4096)."""
    check_logits(logits)
    temperature = check_temperature(temperature)
    require_triton(logits)
    return _EntropyTriton.apply(logits, temperature, block_size or default_block(logits.shape[-1]))


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def entropy(logits, temperature=1.0):
    """H(softmax(logits / T)) = -sum_v p_v log p_v over the last dim -> float32 logits.shape[:-1].

    logits [..., V], any float dtype and strides; differentiable; float32 accumulation. Triton
    on CUDA (or under TRITON_INTERPRET=1), PyTorch elsewhere."""
    if use_triton(logits):
        return entropy_triton(logits, temperature)
    return entropy_torch(logits, temperature)
