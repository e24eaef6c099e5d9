"""Token log-probabilities, fused: log softmax(logits / temp)[target] without an [N, V] tensor.

    logprob_n = x_n[t_n] - logsumexp_v(x_n[v]),    x_n = logits_n / temp,  t_n = targets_n
    d logprob_n / d logits_n[v] = (1[v == t_n] - softmax(x_n)[v]) / temp

Every RL step needs this for every completion token, under the policy, the old policy and the
reference. The naive `log_softmax(logits).gather(...)` (below, `logprobs_reference`) writes a
float32 [N, V] log-softmax and keeps it for backward: 3.3 GB at N = 16k tokens, V = 50k, per
call. Here each row is reduced to three float32 numbers (its log-prob, its max, the log of its
shifted sum) and the softmax is recomputed in backward from the last two.

Shapes. logits [..., V] are read as N rows of V through a view [B, T, V] (B batch, T time,
V vocabulary, N = B * T, the scripts' letters; common.as_rows): B merges every leading dim,
and B and T keep their own strides, so that the RL slice `model(idx)[:, :-1]`, [B, T-1, V], is
read in place; only the V dim must have stride 1. The kernels find row n at
(n // T) * stride_b + (n % T) * stride_t. targets [...] hold N integers.

Why the logsumexp is kept as two numbers, m = max_v x[v] and log_sum = log sum_v exp(x[v] - m):
at |logits| ~ 1e4, lse = m + log_sum rounded to float32 is off by up to 5e-4, and exp(x - lse)
would inherit that as a relative error in every probability. Kept apart, (x - m) is exact for
the largest entries and log_sum is small, so exp((x - m) - log_sum) is accurate to a few float32
ulps. The same holds for the log-prob itself, (x[t] - m) - log_sum.

Edge cases, the same on both paths (tests/test_kernels.py, EDGE_CASES, checks each):
  - a NaN or +inf logit anywhere in a row: that row's log-prob and its whole gradient row are
    NaN (the softmax is undefined); other rows are unaffected. A NaN is never turned into a number.
  - -inf logits are allowed: those tokens have probability 0. A target whose own logit is -inf
    gets log-prob -inf, and its gradient, (onehot - p) / temp, stays finite. Mask such positions
    out with torch.where, not by multiplying by 0 (0 * -inf = NaN).
  - a row whose logits are all -inf has no distribution: its log-prob and gradient are NaN.
  - V = 1: log-prob 0 and gradient 0.
  - temperatures outside [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-3, 1e3] raise ValueError
    (common.py says why).
  - out-of-range targets: the PyTorch path raises ValueError; the Triton path does not check
    (that would need a device-to-host sync) and returns NaN for that position.

Layout, as in the Triton tutorials: (1) the naive reference, (2) the memory-aware PyTorch path,
(3) the Triton kernels, (4) their launchers, (5) the autograd wrapper, (6) the dispatch,
(7) a self-check: `python -m kernels.logprobs` (add TRITON_INTERPRET=1 for the Triton path on
a CPU).
"""

import torch
from torch.autograd.function import once_differentiable

from .common import (
    as_rows,
    check_logits,
    check_targets,
    check_targets_in_range,
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
    """Naive log softmax(logits / temp)[target]: writes and keeps a float32 [..., V] tensor."""
    # [..., V] float32: 4*N*V bytes, saved for backward
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]


# =============================================================================================
# (2) PyTorch path: rows in chunks, only O(N) kept for backward.
# =============================================================================================
class _LogprobsTorch(torch.autograd.Function):
    """Forward keeps (logits by reference, targets, row max, row log_sum): O(N) beyond the
    logits. All chunks share one float32 [chunk_rows, V] buffer (~32 MB), which each whole-chunk
    op (PyTorch's own, vectorised) reads or writes in place."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_rows):
        x3 = as_rows(logits)  # [B, T, V], a view of logits
        B, T, V = x3.shape
        targets = targets.reshape(-1).to(torch.int64)  # [N]
        inv_temp = 1.0 / temperature
        out = torch.empty(B * T, dtype=torch.float32, device=logits.device)  # [N] log-probs
        row_max = torch.empty_like(out)  # [N] m = max_v x[v],  x = logits / temp
        log_sum = torch.empty_like(out)  # [N] log sum_v exp(x[v] - m)
        # the one temporary
        buf = torch.empty((min(chunk_rows, B * T), V), dtype=torch.float32, device=logits.device)
        for start, stop in chunk_ranges(x3, chunk_rows):
            chunk = take_rows(x3, start, stop)  # [n, V] logits (a view), any dtype
            m = chunk.amax(dim=-1).float() * inv_temp  # [n] max of x (x / temp is monotonic in x)
            m = m.masked_fill(m == float("-inf"), 0.0)  # all -inf row: shift by 0, not by -inf
            # [n, V] float32 x - m, one pass
            z = torch.add(-m[:, None], chunk, alpha=inv_temp, out=buf[: stop - start])
            log_sum[start:stop] = z.exp_().sum(dim=-1).log_()  # [n]
            x_t = chunk.gather(1, targets[start:stop, None]).squeeze(1).float() * inv_temp  # [n]
            # logprob = x[t] - lse, as (x[t] - m) - log_sum
            out[start:stop] = (x_t - m) - log_sum[start:stop]
            row_max[start:stop] = m
        ctx.save_for_backward(logits, targets, row_max, log_sum)
        ctx.inv_temp, ctx.chunk_rows = inv_temp, chunk_rows
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, targets, row_max, log_sum = ctx.saved_tensors
        x3 = as_rows(logits)
        B, T, V = x3.shape
        g = grad_out.reshape(-1).float() * ctx.inv_temp  # [N] grad / temp
        # The softmax is written differently from the Triton backward's exp((x - m) - log_sum),
        # for speed only: here each op is a separate pass over a float32 [n, V] buffer in memory,
        # so the division by s = exp(log_sum) is folded into the per-row factor -(grad / temp) / s
        # that the rows are multiplied by anyway (one pass fewer). A Triton program holds each
        # element in a register, where the extra subtraction is free.
        neg_g_over_s = -g * torch.exp(-log_sum)  # [N] -(grad / temp) / s
        grad = torch.empty((B * T, V), dtype=logits.dtype, device=logits.device)  # d logits
        buf = torch.empty((min(ctx.chunk_rows, B * T), V), dtype=torch.float32,
                          device=logits.device)
        for start, stop in chunk_ranges(x3, ctx.chunk_rows):
            chunk = take_rows(x3, start, stop)
            # [n, V] s * softmax
            d = torch.add(-row_max[start:stop, None], chunk, alpha=ctx.inv_temp,
                          out=buf[: stop - start]).exp_()
            d.mul_(neg_g_over_s[start:stop, None])  # -(grad / temp) softmax
            # + grad / temp at the target, float32
            d[torch.arange(stop - start, device=d.device), targets[start:stop]] += g[start:stop]
            grad[start:stop] = d  # cast to the logits' dtype on the copy
        return grad.view(logits.shape), None, None, None


def logprobs_torch(logits, targets, temperature=1.0, *, chunk_rows=None):
    """log softmax(logits / temp)[targets] -> float32 logits.shape[:-1], PyTorch path (any device).

    chunk_rows: rows per chunk (default: one float32 [chunk_rows, V] temporary is ~32 MB)."""
    check_logits(logits)
    check_targets(targets, logits.shape[:-1], logits.device)
    temperature = check_temperature(temperature)
    check_targets_in_range(targets, logits.shape[-1])
    return _LogprobsTorch.apply(logits, targets, temperature,
                                chunk_rows or rows_per_chunk(logits.shape[-1]))


# =============================================================================================
# (3) Triton kernels: one program per row, a loop over the row in BLOCK_V steps.
# =============================================================================================
@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,  # logits viewed as [B, T, V], stride 1 along V
    targets_ptr,  # int64 [N], N = B * T
    out_ptr, row_max_ptr, log_sum_ptr,  # float32 [N] each
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (the logits, once) + 8 (the target) + one element
    # (the target's logit, again); writes 12 (log-prob, max, log_sum). No [N, V] write.
    row = tl.program_id(0).to(tl.int64)  # int64, so row * stride may pass 2^31
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    cols = tl.arange(0, BLOCK_V)

    # Online logsumexp (Milakov & Gimelshein, 2018, "Online normalizer calculation for softmax",
    # arXiv:1805.02867): after each block, m = max of x so far and s = sum of exp(x - m) so far;
    # a larger max rescales s. A NaN or +inf logit makes s NaN, and so the row's result.
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = (tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
             * inv_temperature)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: shift by 0
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    log_sum = tl.log(s)  # -inf for an all -inf row

    target = tl.load(targets_ptr + row)
    in_range = (target >= 0) & (target < V)  # out of range: NaN, documented (no host sync to raise)
    x_t = (tl.load(row_ptr + target, mask=in_range, other=float("nan")).to(tl.float32)
           * inv_temperature)
    tl.store(out_ptr + row, (x_t - m) - log_sum)  # logprob = x[t] - lse, as (x[t] - m) - log_sum
    tl.store(row_max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_sum)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, stride_b, stride_t, T,  # logits viewed as [B, T, V]
    targets_ptr, row_max_ptr, log_sum_ptr, grad_out_ptr,  # [N] each
    grad_ptr,  # [N, V] contiguous, the logits' dtype
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (logits) + 24; writes V * itemsize (the gradient).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    grad_row_ptr = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    m = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    target = tl.load(targets_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature  # grad / temp
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        # softmax recomputed from the saved logsumexp, per element in registers (the PyTorch
        # path folds 1 / s into a per-row factor instead, to save a pass over memory)
        p = tl.exp((x - m) - log_sum)
        d = tl.where(offs == target, 1.0, 0.0) - p  # onehot - p at float32
        tl.store(grad_row_ptr + offs, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def launch_config(V, block_size=None):
    """The compile-time block along V and the warps per program for a vocabulary of V
    (block_size overrides the block). Used by the launchers below, and by
    tests/test_kernel_compile.py and bench/kernel_registers.py to compile what they launch."""
    block = block_size or default_block(V)
    return {"BLOCK_V": block, "num_warps": num_warps(block)}


def _logprobs_fwd(logits, targets, inv_temp, config):
    x3 = as_rows(logits)  # [B, T, V], a view of logits
    B, T, V = x3.shape
    out = torch.empty(B * T, dtype=torch.float32, device=logits.device)  # [N]
    row_max, log_sum = torch.empty_like(out), torch.empty_like(out)  # [N] each
    if B * T == 0:
        return out, row_max, log_sum
    _logprobs_fwd_kernel[(B * T,)](
        x3, x3.stride(0), x3.stride(1), T, targets, out, row_max, log_sum, V, inv_temp, **config,
    )
    return out, row_max, log_sum


def _logprobs_bwd(logits, targets, row_max, log_sum, grad_out, inv_temp, config):
    x3 = as_rows(logits)
    B, T, V = x3.shape
    grad = torch.empty((B * T, V), dtype=logits.dtype, device=logits.device)  # [N, V]
    if B * T == 0:
        return grad
    _logprobs_bwd_kernel[(B * T,)](
        x3, x3.stride(0), x3.stride(1), T, targets, row_max, log_sum, grad_out, grad, V, inv_temp,
        **config,
    )
    return grad


# =============================================================================================
# (5) Autograd wrapper.
# =============================================================================================
class _LogprobsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, config):
        targets = targets.reshape(-1).to(torch.int64).contiguous()  # [N]
        out, row_max, log_sum = _logprobs_fwd(logits, targets, 1.0 / temperature, config)
        ctx.save_for_backward(logits, targets, row_max, log_sum)
        ctx.inv_temp, ctx.config = 1.0 / temperature, config
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, targets, row_max, log_sum = ctx.saved_tensors
        # .contiguous(): the grad of a .sum() arrives as an expanded (stride 0) tensor.
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]
        grad = _logprobs_bwd(logits, targets, row_max, log_sum, grad_out, ctx.inv_temp, ctx.config)
        return grad.view(logits.shape), None, None, None


def logprobs_triton(logits, targets, temperature=1.0, *, block_size=None):
    """log softmax(logits / temp)[targets] -> float32 logits.shape[:-1], Triton path (CUDA, or any
    device under TRITON_INTERPRET=1). Out-of-range targets give NaN (not checked).

    block_size: elements of a row per loop step (default: the row, up to 4096)."""
    check_logits(logits)
    check_targets(targets, logits.shape[:-1], logits.device)
    temperature = check_temperature(temperature)
    require_triton(logits)
    return _LogprobsTriton.apply(logits, targets, temperature,
                                 launch_config(logits.shape[-1], block_size))


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / temp)[targets] over the last dim -> float32 logits.shape[:-1].

    logits [..., V] (float32, bfloat16 or float16, any strides), targets [...] integer in
    [0, V). Differentiable w.r.t. logits; accumulation is float32 whatever the input dtype and
    the gradient comes back in the logits' dtype. Triton on CUDA (or under TRITON_INTERPRET=1),
    PyTorch elsewhere; neither keeps an [N, V] tensor for backward."""
    if use_triton(logits):
        return logprobs_triton(logits, targets, temperature)
    return logprobs_torch(logits, targets, temperature)


# =============================================================================================
# (7) Self-check: python -m kernels.logprobs  (on a CPU: TRITON_INTERPRET=1 python -m ...)
# =============================================================================================
if __name__ == "__main__":
    import sys

    from .common import report

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "Triton" if use_triton(torch.empty(0, device=device)) else "PyTorch"
    print(f"logprobs vs logprobs_reference, {path} path on {device}")
    ok = True
    cases = [((3, 9, 1000), torch.float32, 1.0), ((2, 6, 37), torch.bfloat16, 0.7),
             ((4, 1), torch.float16, 2.0)]
    for shape, dtype, temp in cases:
        base = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
        logits = base[:, :-1] if base.dim() == 3 else base  # [B, T-1, V]: a slice, read in place
        targets = torch.randint(0, shape[-1], logits.shape[:-1], device=device)
        grad_out = torch.randn(logits.shape[:-1], device=device)
        got = logprobs(logits, targets, temp)
        (grad_got,) = torch.autograd.grad(got, base, grad_out)
        want = logprobs_reference(logits, targets, temp)
        (grad_want,) = torch.autograd.grad(want, base, grad_out)
        name = f"{tuple(logits.shape)} {str(dtype)[6:]} temp={temp}"
        ok &= report(name + " value", got, want, rtol=1e-5, atol=1e-5)
        ok &= report(name + " grad", grad_got, grad_want,
                     rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-6)
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)
