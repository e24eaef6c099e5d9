"""Token log-probabilities, fused: log softmax(logits / T)[target] without an [N, V] tensor.

    logprob_i = x_i[t_i] - logsumexp_v(x_i[v]),    x_i = logits_i / T,  t_i = targets_i
    d logprob_i / d logits_i[v] = (1[v == t_i] - softmax(x_i)[v]) / T

Every RL step needs this for every completion token, under the policy, the old policy and the
reference. The naive `log_softmax(logits).gather(...)` (below, `logprobs_reference`) writes a
float32 [N, V] log-softmax and keeps it for backward: 3.3 GB at N = 16k tokens, V = 50k, per
call. Here each row is reduced to three float32 numbers (its log-prob, its max, the log of its
shifted sum) and the softmax is recomputed in backward from the last two.

Why the logsumexp is kept as two numbers: at |logits| ~ 1e4, lse = m + log(s) rounded to
float32 is off by up to 5e-4, and exp(x - lse) would inherit that as a relative error in every
probability. Kept apart, (x - m) is exact for the largest entries and log(s) is small, so
exp((x - m) - log(s)) is accurate to a few float32 ulps. The same holds for the log-prob itself.

Edge cases, both paths:
  - -inf logits are allowed: those tokens have probability 0; a target whose own logit is -inf
    gets log-prob -inf (its gradient, onehot - softmax, stays finite; mask such positions out
    with torch.where, not by multiplying by 0, which gives NaN).
  - a row whose logits are all -inf has no distribution: its log-prob and gradient are NaN.
  - +inf and NaN logits are not supported (NaN out).
  - out-of-range targets: the PyTorch path raises ValueError; the Triton path does not check
    (that would need a device-to-host sync) and returns NaN for that position, so the loss is NaN.

Layout, as in the Triton tutorials: (1) the naive reference, (2) the memory-aware PyTorch path,
(3) the Triton kernels, (4) their launchers, (5) the autograd wrapper, (6) the dispatch.
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
def logprobs_reference(logits, targets, temperature=1.0):
    """Naive log softmax(logits / T)[target]: writes and keeps a float32 [..., V] tensor."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [..., V] float32: 4*N*V bytes, saved for backward
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]


def _check_targets(logits, targets):
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must be logits.shape[:-1] = {tuple(logits.shape[:-1])}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if targets.device != logits.device:
        raise ValueError(f"targets are on {targets.device} but logits are on {logits.device}")


# =============================================================================================
# (2) PyTorch path: rows in chunks, only O(N) kept for backward.
# =============================================================================================
class _LogprobsTorch(torch.autograd.Function):
    """Forward keeps (logits by reference, targets, row max, row log-sum): O(N) beyond the
    logits. All chunks share one float32 [rows, V] buffer (~32 MB), which each whole-chunk op
    (PyTorch's own, vectorised) reads or writes in place."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, max_rows):
        x3 = as_rows(logits)  # [B, R, V], a view of logits
        B, R, V = x3.shape
        targets = targets.reshape(-1).to(torch.int64)  # [N]
        inv_t = 1.0 / temperature
        out = torch.empty(B * R, dtype=torch.float32, device=logits.device)  # [N]
        row_max = torch.empty_like(out)  # [N] m = max_v x[v],  x = logits / T
        log_sum = torch.empty_like(out)  # [N] log s, s = sum_v exp(x[v] - m)
        buf = torch.empty((min(max_rows, B * R), V), dtype=torch.float32, device=logits.device)  # the one temporary
        for start, stop in chunk_ranges(x3, max_rows):
            chunk = take_rows(x3, start, stop)  # [n, V] logits (a view), any dtype
            m = chunk.amax(dim=-1).float() * inv_t  # [n] max of x (x / T is monotonic in x)
            m = m.masked_fill(m == float("-inf"), 0.0)  # all -inf row: shift by 0, not by -inf
            z = torch.add(-m[:, None], chunk, alpha=inv_t, out=buf[: stop - start])  # [n, V] float32 x - m, one pass
            ls = z.exp_().sum(dim=-1).log_()  # [n] log s
            x_t = chunk.gather(1, targets[start:stop, None]).squeeze(1).float() * inv_t  # [n] x[t]
            out[start:stop] = (x_t - m) - ls  # logprob = x[t] - lse, as (x[t] - m) - log s
            row_max[start:stop] = m
            log_sum[start:stop] = ls
        ctx.save_for_backward(logits, targets, row_max, log_sum)
        ctx.inv_t, ctx.max_rows = inv_t, max_rows
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, targets, row_max, log_sum = ctx.saved_tensors
        x3 = as_rows(logits)
        B, R, V = x3.shape
        g = grad_out.reshape(-1).float() * ctx.inv_t  # [N] grad / T
        neg_g_over_s = -g * torch.exp(-log_sum)  # [N] -(grad / T) / s
        grad = torch.empty((B * R, V), dtype=logits.dtype, device=logits.device)  # d logits
        buf = torch.empty((min(ctx.max_rows, B * R), V), dtype=torch.float32, device=logits.device)
        for start, stop in chunk_ranges(x3, ctx.max_rows):
            chunk = take_rows(x3, start, stop)
            d = torch.add(-row_max[start:stop, None], chunk, alpha=ctx.inv_t, out=buf[: stop - start]).exp_()  # [n, V] s * softmax
            d.mul_(neg_g_over_s[start:stop, None])  # -(grad / T) softmax
            d[torch.arange(stop - start, device=d.device), targets[start:stop]] += g[start:stop]  # + grad / T at the target, float32
            grad[start:stop] = d  # cast to the logits' dtype on the copy
        return grad.view(logits.shape), None, None, None


def logprobs_torch(logits, targets, temperature=1.0, *, chunk_rows=None):
    """log softmax(logits / T)[targets] -> float32 logits.shape[:-1], PyTorch path (any device).

    chunk_rows: rows per chunk (default: one float32 [rows, V] temporary is ~32 MB)."""
    check_logits(logits)
    _check_targets(logits, targets)
    temperature = check_temperature(temperature)
    V = logits.shape[-1]
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"target {lo if lo < 0 else hi} is out of range: targets must lie in [0, {V})")
    return _LogprobsTorch.apply(logits, targets, temperature, chunk_rows or rows_per_chunk(V))


# =============================================================================================
# (3) Triton kernels: one program per row, a loop over the row in BLOCK_V steps.
# =============================================================================================
@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, stride_b, stride_r, R,  # logits viewed as [B, R, V], stride 1 along V
    targets_ptr,  # int64 [N], N = B * R
    out_ptr, row_max_ptr, log_sum_ptr,  # float32 [N] each
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (the logits, once) + 8 (the target) + one element
    # (the target's logit, again); writes 12 (log-prob, max, log-sum). No [N, V] write.
    row = tl.program_id(0).to(tl.int64)  # int64, so row * stride may pass 2^31
    row_ptr = logits_ptr + (row // R) * stride_b + (row % R) * stride_r
    cols = tl.arange(0, BLOCK_V)

    # Online logsumexp (Milakov & Gimelshein, 2018, arXiv:1805.02867): after each block,
    # m = max of x so far and s = sum of exp(x - m) so far; a larger max rescales s.
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: shift by 0, not -inf
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(s)  # -inf for an all -inf row

    target = tl.load(targets_ptr + row)
    in_range = (target >= 0) & (target < V)  # out of range: NaN, documented (no host sync to raise)
    x_t = tl.load(row_ptr + target, mask=in_range, other=float("nan")).to(tl.float32) * inv_temperature
    tl.store(out_ptr + row, (x_t - m) - log_s)  # logprob = x[t] - lse, as (x[t] - m) - log s
    tl.store(row_max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_s)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, stride_b, stride_r, R,  # logits viewed as [B, R, V]
    targets_ptr, row_max_ptr, log_sum_ptr, grad_out_ptr,  # [N] each
    grad_ptr,  # [N, V] contiguous, the logits' dtype
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (logits) + 24; writes V * itemsize (the gradient).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // R) * stride_b + (row % R) * stride_r
    grad_row_ptr = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    m = tl.load(row_max_ptr + row)
    log_s = tl.load(log_sum_ptr + row)
    target = tl.load(targets_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature  # grad / T
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        p = tl.exp((x - m) - log_s)  # softmax, recomputed from the saved logsumexp
        d = tl.where(offs == target, 1.0, 0.0) - p  # onehot - p at float32
        tl.store(grad_row_ptr + offs, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def _logprobs_fwd(logits, targets, inv_t, block):
    x3 = as_rows(logits)  # [B, R, V], a view of logits
    B, R, V = x3.shape
    out = torch.empty(B * R, dtype=torch.float32, device=logits.device)  # [N]
    row_max, log_sum = torch.empty_like(out), torch.empty_like(out)  # [N] each
    if B * R == 0:
        return out, row_max, log_sum
    _logprobs_fwd_kernel[(B * R,)](
        x3, x3.stride(0), x3.stride(1), R, targets, out, row_max, log_sum, V, inv_t,
        BLOCK_V=block, num_warps=num_warps(block),
    )
    return out, row_max, log_sum


def _logprobs_bwd(logits, targets, row_max, log_sum, grad_out, inv_t, block):
    x3 = as_rows(logits)
    B, R, V = x3.shape
    grad = torch.empty((B * R, V), dtype=logits.dtype, device=logits.device)  # [N, V]
    if B * R == 0:
        return grad
    _logprobs_bwd_kernel[(B * R,)](
        x3, x3.stride(0), x3.stride(1), R, targets, row_max, log_sum, grad_out, grad, V, inv_t,
        BLOCK_V=block, num_warps=num_warps(block),
    )
    return grad


# =============================================================================================
# (5) Autograd wrapper.
# =============================================================================================
class _LogprobsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, block):
        targets = targets.reshape(-1).to(torch.int64).contiguous()  # [N]
        out, row_max, log_sum = _logprobs_fwd(logits, targets, 1.0 / temperature, block)
        ctx.save_for_backward(logits, targets, row_max, log_sum)
        ctx.inv_t, ctx.block = 1.0 / temperature, block
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, targets, row_max, log_sum = ctx.saved_tensors
        # .contiguous(): the grad of a .sum() arrives as an expanded (stride 0) tensor.
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]
        grad = _logprobs_bwd(logits, targets, row_max, log_sum, grad_out, ctx.inv_t, ctx.block)
        return grad.view(logits.shape), None, None, None


def logprobs_triton(logits, targets, temperature=1.0, *, block_size=None):
    """log softmax(logits / T)[targets] -> float32 logits.shape[:-1], Triton path (CUDA, or any
    device under TRITON_INTERPRET=1). Out-of-range targets give NaN (not checked).

    block_size: elements of a row per loop step (default: the row, up to 4096)."""
    check_logits(logits)
    _check_targets(logits, targets)
    temperature = check_temperature(temperature)
    require_triton(logits)
    return _LogprobsTriton.apply(logits, targets, temperature, block_size or default_block(logits.shape[-1]))


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / T)[targets] over the last dim -> float32 logits.shape[:-1].

    logits [..., V] (float32, bfloat16 or float16, any strides), targets [...] integer in
    [0, V). Differentiable w.r.t. logits; accumulation is float32 whatever the input dtype and
    the gradient comes back in the logits' dtype. Triton on CUDA (or under TRITON_INTERPRET=1),
    PyTorch elsewhere; neither keeps an [N, V] tensor for backward."""
    if use_triton(logits):
        return logprobs_triton(logits, targets, temperature)
    return logprobs_torch(logits, targets, temperature)
