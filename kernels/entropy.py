"""Per-position entropy of softmax(logits / temp), fused: no [N, V] tensor.

    p = softmax(x),  x = logits / temp
    H(p) = -sum_v p_v log p_v
    d H / d logits[v] = -p_v (log p_v + H) / temp

Used for PPO's entropy bonus and for every script's logging. It is its own function (one more
read of the logits, V * itemsize bytes per row) rather than a by-product of `logprobs`: the log-
probs are needed for three models and the entropy for one, and one function per quantity keeps
each kernel short. (kl.py computes the same H(p) inside its own pass, as a step to the KL.)

Shapes, as in logprobs.py: logits [..., V] are read as N rows of V through a view [B, T, V]
(B batch, T time, V vocabulary, N = B * T; common.as_rows), slices included.

Numerics, as in kl.py: one pass (online logsumexp, Milakov & Gimelshein 2018) keeps the running
max m, s = sum exp(x - m) and u = sum exp(x - m) (x - m) <= 0, moved onto a new max m' as
u' = exp(m - m') (u + (m - m') s). Then H = log_sum - u / s (log_sum = log s) is a sum of two
terms >= 0, accurate to float32 rounding even for a nearly one-hot row at |logits| ~ 1e4 (where
the textbook lse - sum p x cancels to noise).

Edge cases, the same on both paths (tests/test_kernels.py, EDGE_CASES, checks each):
  - a NaN or +inf logit anywhere in a row: that row's entropy and its whole gradient row are
    NaN; other rows are unaffected. A NaN is never turned into a number.
  - -inf logits are allowed: probability 0, and 0 log 0 = 0.
  - a row whose logits are all -inf has no distribution: entropy and gradient NaN.
  - V = 1: entropy 0 and gradient 0.
  - temperatures outside [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-3, 1e3] raise ValueError.

Layout: (1) reference, (2) PyTorch path, (3) Triton kernels, (4) launchers, (5) autograd
wrapper, (6) dispatch, (7) self-check: `python -m kernels.entropy`.
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
    """Naive H(softmax(logits / temp)): a float32 [..., V] log-softmax, kept for backward."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [..., V] float32
    return -torch.where(logp > float("-inf"), logp.exp() * logp, 0.0).sum(-1)  # [...]


# =============================================================================================
# (2) PyTorch path: rows in chunks, only O(N) kept for backward.
# =============================================================================================
class _EntropyTorch(torch.autograd.Function):
    """Keeps (logits by reference, row max, row log_sum, H): O(N) beyond the logits. Each chunk
    of rows makes a few float32 [chunk_rows, V] temporaries (~32 MB each)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_rows):
        x3 = as_rows(logits)  # [B, T, V], a view of logits
        B, T, V = x3.shape
        inv_temp = 1.0 / temperature
        out = torch.empty(B * T, dtype=torch.float32, device=logits.device)  # [N] H
        row_max, log_sum = torch.empty_like(out), torch.empty_like(out)  # [N] each
        for start, stop in chunk_ranges(x3, chunk_rows):
            x = take_rows(x3, start, stop).float() * inv_temp  # [n, V] float32
            m = x.amax(dim=-1)
            m = m.masked_fill(m == float("-inf"), 0.0)  # [n]; all -inf row: shift by 0
            logp = x.sub_(m[:, None])  # [n, V] x - m, in place
            log_sum[start:stop] = logp.exp().sum(dim=-1).log_()  # [n]
            logp = logp.sub_(log_sum[start:stop, None])  # [n, V] log p
            p = logp.exp()
            # H = -sum p log p, 0 log 0 = 0; NaN stays NaN
            out[start:stop] = -torch.where(p == 0, 0.0, p * logp).sum(-1)
            row_max[start:stop] = m
        ctx.save_for_backward(logits, row_max, log_sum, out)
        ctx.inv_temp, ctx.chunk_rows = inv_temp, chunk_rows
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, row_max, log_sum, entropy = ctx.saved_tensors
        x3 = as_rows(logits)
        B, T, V = x3.shape
        g = grad_out.reshape(-1).float() * ctx.inv_temp  # [N] grad / temp
        grad = torch.empty((B * T, V), dtype=logits.dtype, device=logits.device)  # d logits
        for start, stop in chunk_ranges(x3, ctx.chunk_rows):
            rows = slice(start, stop)
            # log p = (x - m) - log_sum, the Triton backward's formula; here each step is a pass
            # over a float32 [n, V] tensor, done in place where the buffer allows.
            logp = take_rows(x3, start, stop).float() * ctx.inv_temp
            logp = logp.sub_(row_max[rows, None]).sub_(log_sum[rows, None])  # [n, V] log p
            p = logp.exp()
            # -p (log p + H); NaN stays NaN
            d = torch.where(p == 0, 0.0, p * logp.add_(entropy[rows, None])).neg_()
            grad[rows] = d.mul_(g[rows, None])
        return grad.view(logits.shape), None, None


def entropy_torch(logits, temperature=1.0, *, chunk_rows=None):
    """H(softmax(logits / temp)) per position -> float32 [...], PyTorch path (any device).

    chunk_rows: rows per chunk (default: one float32 [chunk_rows, V] temporary is ~32 MB)."""
    check_logits(logits)
    temperature = check_temperature(temperature)
    return _EntropyTorch.apply(logits, temperature, chunk_rows or rows_per_chunk(logits.shape[-1]))


# =============================================================================================
# (3) Triton kernels: one program per row, a loop over the row in BLOCK_V steps.
# =============================================================================================
@triton.jit
def _entropy_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,  # logits viewed as [B, T, V], stride 1 along V
    out_ptr, row_max_ptr, log_sum_ptr,  # float32 [N] each: H, m, log_sum
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (the logits, once); writes 12. No [N, V] write.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    cols = tl.arange(0, BLOCK_V)

    m = float("-inf")  # running max of x = logits / temp
    s = 0.0  # sum exp(x - m)
    u = 0.0  # sum exp(x - m) (x - m)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = (tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
             * inv_temperature)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: shift by 0
        w = tl.exp(x - m_safe)  # [BLOCK_V] unnormalised p
        alpha = tl.exp(m - m_safe)
        u = alpha * (u + tl.where(s > 0, (m - m_safe) * s, 0.0))  # u onto the new max
        u += tl.sum(tl.where(w == 0, 0.0, w * (x - m_safe)), axis=0)  # 0 log 0 = 0; NaN stays NaN
        s = s * alpha + tl.sum(w, axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    log_sum = tl.log(s)
    tl.store(out_ptr + row, log_sum - u / s)  # H = log_sum - u / s
    tl.store(row_max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_sum)


@triton.jit
def _entropy_bwd_kernel(
    logits_ptr, stride_b, stride_t, T,  # logits viewed as [B, T, V]
    entropy_ptr, row_max_ptr, log_sum_ptr, grad_out_ptr,  # [N] each
    grad_ptr,  # [N, V] contiguous, the logits' dtype
    V, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    # Bytes per row: reads V * itemsize (logits) + 16; writes V * itemsize (the gradient).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    grad_row = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    m = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    h = tl.load(entropy_ptr + row)
    g = tl.load(grad_out_ptr + row) * inv_temperature  # grad / temp
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        log_p = (x - m) - log_sum  # recomputed in registers, as the PyTorch path does in memory
        p = tl.exp(log_p)
        d = tl.where(p == 0, 0.0, -p * (log_p + h))  # -p (log p + H); NaN stays NaN
        tl.store(grad_row + offs, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def launch_config(V, block_size=None):
    """The compile-time block along V and the warps per program for a vocabulary of V
    (block_size overrides the block). Used by the launchers below, and by
    tests/test_kernel_compile.py and bench/kernel_registers.py."""
    block = block_size or default_block(V)
    return {"BLOCK_V": block, "num_warps": num_warps(block)}


def _entropy_fwd(logits, inv_temp, config):
    x3 = as_rows(logits)  # [B, T, V], a view of logits
    B, T, V = x3.shape
    out = torch.empty(B * T, dtype=torch.float32, device=logits.device)  # [N]
    row_max, log_sum = torch.empty_like(out), torch.empty_like(out)  # [N] each
    if B * T == 0:
        return out, row_max, log_sum
    _entropy_fwd_kernel[(B * T,)](
        x3, x3.stride(0), x3.stride(1), T, out, row_max, log_sum, V, inv_temp, **config,
    )
    return out, row_max, log_sum


def _entropy_bwd(logits, entropy, row_max, log_sum, grad_out, inv_temp, config):
    x3 = as_rows(logits)
    B, T, V = x3.shape
    grad = torch.empty((B * T, V), dtype=logits.dtype, device=logits.device)  # [N, V]
    if B * T == 0:
        return grad
    _entropy_bwd_kernel[(B * T,)](
        x3, x3.stride(0), x3.stride(1), T, entropy, row_max, log_sum, grad_out, grad, V, inv_temp,
        **config,
    )
    return grad


# =============================================================================================
# (5) Autograd wrapper.
# =============================================================================================
class _EntropyTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperature, config):
        out, row_max, log_sum = _entropy_fwd(logits, 1.0 / temperature, config)
        ctx.save_for_backward(logits, out, row_max, log_sum)
        ctx.inv_temp, ctx.config = 1.0 / temperature, config
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, entropy, row_max, log_sum = ctx.saved_tensors
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]; may arrive expanded (stride 0)
        grad = _entropy_bwd(logits, entropy, row_max, log_sum, grad_out, ctx.inv_temp, ctx.config)
        return grad.view(logits.shape), None, None


def entropy_triton(logits, temperature=1.0, *, block_size=None):
    """H(softmax(logits / temp)) per position -> float32 [...], Triton path (CUDA, or any device
    under TRITON_INTERPRET=1).

    block_size: elements of a row per loop step (default: the row, up to 4096)."""
    check_logits(logits)
    temperature = check_temperature(temperature)
    require_triton(logits)
    return _EntropyTriton.apply(logits, temperature, launch_config(logits.shape[-1], block_size))


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def entropy(logits, temperature=1.0):
    """H(softmax(logits / temp)) = -sum_v p_v log p_v over the last dim -> float32 [...].

    logits [..., V], any float dtype and strides; differentiable; float32 accumulation. Triton
    on CUDA (or under TRITON_INTERPRET=1), PyTorch elsewhere."""
    if use_triton(logits):
        return entropy_triton(logits, temperature)
    return entropy_torch(logits, temperature)


# =============================================================================================
# (7) Self-check: python -m kernels.entropy  (TRITON_INTERPRET=1 python -m kernels.entropy on a CPU)
# =============================================================================================
if __name__ == "__main__":
    import sys

    from .common import report

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "Triton" if use_triton(torch.empty(0, device=device)) else "PyTorch"
    print(f"entropy vs entropy_reference, {path} path on {device}")
    ok = True
    cases = [((3, 9, 1000), torch.float32, 1.0), ((2, 6, 37), torch.bfloat16, 0.7),
             ((4, 1), torch.float16, 2.0)]
    for shape, dtype, temp in cases:
        base = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
        logits = base[:, :-1] if base.dim() == 3 else base  # [B, T-1, V]: a slice, read in place
        grad_out = torch.randn(logits.shape[:-1], device=device)
        got = entropy(logits, temp)
        (grad_got,) = torch.autograd.grad(got, base, grad_out)
        want = entropy_reference(logits, temp)
        (grad_want,) = torch.autograd.grad(want, base, grad_out)
        name = f"{tuple(logits.shape)} {str(dtype)[6:]} temp={temp}"
        ok &= report(name + " value", got, want, rtol=1e-4, atol=1e-5)
        ok &= report(name + " grad", grad_got, grad_want,
                     rtol=1e-2 if dtype != torch.float32 else 1e-4, atol=1e-6)
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)
