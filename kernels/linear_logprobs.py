"""Token log-probabilities straight from hidden states: the LM head and the log-softmax gather,
fused, so that the [N, V] logits are never stored.

    x_n = (hidden_n @ weight.T) / temp         hidden [N, C], weight [V, C] (LM head, tied or not)
    logprob_n = x_n[t_n] - logsumexp_v(x_n[v])
    dx_n[v] = grad_n (1[v == t_n] - softmax(x_n)[v]) / temp    the gradient w.r.t. the logits [N, V]
    d hidden_n = sum_v dx_n[v] weight_v,   d weight_v = sum_n dx_n[v] hidden_n

`logprobs(model(idx), targets)` still needs the logits: a float32 [N, V] tensor that the LM head
writes and autograd keeps, 2.5 GB at N = 4096 tokens and Qwen2.5's V = 151936, plus as much
again for its gradient. This file goes from the final hidden states (C = 896 floats a token for
Qwen2.5-0.5B) to the log-probs with O(N) floats of state: each row keeps its max m and
log_sum = log sum_v exp(x[v] - m) (as in logprobs.py), and backward recomputes the logits block
by block. The idea, and the blockwise recomputation in backward, are those of Cut Cross-Entropy
(Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary Language Models", arXiv:2411.09009);
the online logsumexp is Milakov & Gimelshein's (2018, arXiv:1805.02867). No entropy is computed
here: use `entropy(model(idx))` where it is needed.

Cost: the naive path computes the logits (one [N, C] x [C, V] product) once; both paths here
compute them twice (forward, and once in backward, feeding both gradient products). The two
gradient products are the same in all three. The Triton path's backward writes the gradient
w.r.t. a chunk of tokens' logits ([n, V] in the inputs' dtype, at most DLOGITS_BYTES) and leaves
d hidden = dlogits @ weight and d weight = dlogits.T @ hidden to the matrix library, as Liger-
Kernel's fused linear cross entropy does with its chunk's logits. In float16 an entry below its
range (|grad p| < 6e-8) is flushed to 0 and one below 6e-5 loses bits: the softmax tail's small
gradients are biased; bfloat16, the scripts' autocast dtype, has float32's range.

Shapes: hidden [..., C] (any strides: the RL slice `h[:, :-1]` is fine; it is flattened to
[N, C], a copy of N * C elements when no view exists), weight [V, C], targets [...] with N
integers. Output float32 [...]. hidden and weight must have the same dtype (float32, bfloat16 or
float16); products are exact in float32 and every sum is accumulated in float32.

Edge cases, the same on both paths (tests/test_kernels.py, EDGE_CASES, checks each):
  - a NaN or +inf in hidden_n makes token n's log-prob NaN (its logits row holds NaN or
    +-inf), and with it the gradients of hidden_n and of all of weight; other tokens' log-probs
    and hidden gradients are unaffected. A NaN or inf in a weight row reaches every token: all NaN.
  - V = 1: log-prob 0 and gradients 0. N = 0: an empty result; the weight's gradient is 0.
  - temperatures outside [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-3, 1e3] raise ValueError.
  - out-of-range targets: the PyTorch path raises ValueError; the Triton path returns NaN there.

Layout, as in the other kernel files: (1) reference, (2) PyTorch path, (3) Triton kernels,
(4) launchers, (5) autograd wrapper, (6) dispatch, (7) self-check:
`python -m kernels.linear_logprobs`.
"""

import torch
from torch.autograd.function import once_differentiable

from .common import (
    TRITON_INTERPRET,
    check_targets,
    check_targets_in_range,
    check_temperature,
    require_triton,
    tl,
    triton,
    use_triton,
)


# =============================================================================================
# (1) Reference: what this file replaces.
# =============================================================================================
def linear_logprobs_reference(hidden, weight, targets, temperature=1.0):
    """Naive log softmax((hidden @ weight.T) / temp)[targets]: writes the [..., V] logits, and keeps
    a float32 [..., V] log-softmax for backward."""
    logits = hidden @ weight.T  # [..., V] in the inputs' dtype
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [..., V] float32
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]


def _check_args(hidden, weight, targets):
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise TypeError("hidden and weight must be floating-point, "
                        f"got {hidden.dtype} and {weight.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype: "
            "pass weight.to(hidden.dtype) (autograd casts its gradient back)"
        )
    if (weight.dim() != 2 or weight.shape[0] == 0 or hidden.dim() == 0
            or hidden.shape[-1] != weight.shape[1]):
        raise ValueError(f"need hidden [..., C] and weight [V, C] with V >= 1, "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    check_targets(targets, hidden.shape[:-1], hidden.device)


# =============================================================================================
# (2) PyTorch path: the vocabulary in chunks of chunk_vocab, the tokens in chunks of chunk_rows;
#     only O(N) kept for backward.
# =============================================================================================
class _LinearLogprobsTorch(torch.autograd.Function):
    """Forward keeps (hidden and weight by reference, targets, row max, row log_sum). Both
    directions work on one float32 [chunk_rows, chunk_vocab] block of logits at a time (~32 MB),
    written by torch.mm into a reused buffer; backward recomputes each block once and feeds it
    to both gradient products. Every elementwise op here is a pass over that block in memory,
    so the temperature is applied to hidden instead ([N, C], once: (hidden / temp) @ weight.T),
    where the Triton kernels scale each block of logits in registers."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_rows, chunk_vocab):
        C, V = hidden.shape[-1], weight.shape[0]
        inv_temp = 1.0 / temperature
        # [N, C] float32 hidden / temp: h_scaled @ w.T = logits / temp
        h_scaled = hidden.reshape(-1, C).float() * inv_temp
        N = h_scaled.shape[0]
        targets = targets.reshape(-1).to(torch.int64)  # [N]
        row_max = torch.full((N,), float("-inf"), device=hidden.device)  # [N] running max of x
        row_sum = torch.zeros(N, device=hidden.device)  # [N] running sum of exp(x - row_max)
        x_t = torch.zeros(N, device=hidden.device)  # [N] the target's x, filled in by its chunk
        buf = torch.empty((min(chunk_rows, N), min(chunk_vocab, V)), device=hidden.device)  # [n, v]
        for v0 in range(0, V, chunk_vocab):
            w = weight[v0 : v0 + chunk_vocab].float()  # [v, C]
            for n0 in range(0, N, chunk_rows):
                rows = slice(n0, n0 + chunk_rows)
                n = h_scaled[rows].shape[0]
                # [n, v] x = logits / temp
                x = torch.mm(h_scaled[rows], w.T, out=buf[:n, : w.shape[0]])
                # targets in this chunk
                hit = ((targets[rows] >= v0)
                       & (targets[rows] < v0 + w.shape[0])).nonzero().squeeze(1)
                x_t[n0 + hit] = x[hit, targets[n0 + hit] - v0]  # their x[t]
                # Online logsumexp (Milakov & Gimelshein 2018) across vocabulary chunks.
                m_new = torch.maximum(row_max[rows], x.amax(dim=1))  # [n]
                row_sum[rows] = (row_sum[rows] * torch.exp(row_max[rows] - m_new)
                                 + x.sub_(m_new[:, None]).exp_().sum(dim=1))
                row_max[rows] = m_new
        log_sum = row_sum.log_()  # [N]
        out = (x_t - row_max) - log_sum  # logprob = x[t] - lse, as (x[t] - m) - log_sum
        ctx.save_for_backward(hidden, weight, targets, row_max, log_sum)
        ctx.inv_temp, ctx.chunk_rows, ctx.chunk_vocab = inv_temp, chunk_rows, chunk_vocab
        return out.view(hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, targets, row_max, log_sum = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        C, V = hidden.shape[-1], weight.shape[0]
        h = hidden.reshape(-1, C).float()  # [N, C]
        h_scaled = h * ctx.inv_temp  # [N, C] hidden / temp, as in forward
        N = h.shape[0]
        g = grad_out.reshape(-1).float() * ctx.inv_temp  # [N] grad / temp
        neg_g_over_s = -g * torch.exp(-log_sum)  # [N] -(grad / temp) / s, s = exp(log_sum)
        grad_h = torch.zeros((N, C), device=h.device) if want_hidden else None  # float32 sums
        grad_w = torch.zeros((V, C), device=h.device) if want_weight else None
        buf = torch.empty((min(ctx.chunk_rows, N), min(ctx.chunk_vocab, V)), device=h.device)
        for v0 in range(0, V, ctx.chunk_vocab):
            w = weight[v0 : v0 + ctx.chunk_vocab].float()  # [v, C]
            for n0 in range(0, N, ctx.chunk_rows):
                rows = slice(n0, n0 + ctx.chunk_rows)
                n = h[rows].shape[0]
                # [n, v] x, recomputed as in forward
                x = torch.mm(h_scaled[rows], w.T, out=buf[:n, : w.shape[0]])
                # dx = (grad / temp) (onehot - p), p = exp(x - m) / s: the division by s is folded
                # into the per-row factor, one pass fewer over the block (as in logprobs.py).
                # [n, v] -(grad / temp) p
                dx = x.sub_(row_max[rows, None]).exp_().mul_(neg_g_over_s[rows, None])
                hit = ((targets[rows] >= v0)
                       & (targets[rows] < v0 + w.shape[0])).nonzero().squeeze(1)
                # + grad / temp at the targets in this chunk
                dx[hit, targets[n0 + hit] - v0] += g[n0 + hit]
                if want_hidden:
                    grad_h[rows].addmm_(dx, w)  # [n, C] += [n, v] @ [v, C]
                if want_weight:
                    grad_w[v0 : v0 + w.shape[0]].addmm_(dx.T, h[rows])  # [v, C] += [v, n] @ [n, C]
        grad_hidden = grad_h.to(hidden.dtype).view(hidden.shape) if want_hidden else None
        grad_weight = grad_w.to(weight.dtype) if want_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def linear_logprobs_torch(hidden, weight, targets, temperature=1.0, *,
                          chunk_rows=4096, chunk_vocab=2048):
    """log softmax((hidden @ weight.T) / temp)[targets] -> float32 hidden.shape[:-1], PyTorch path
    (any device). Differentiable w.r.t. hidden and weight.

    chunk_rows, chunk_vocab: tokens and vocabulary entries per block of logits (default: a
    float32 [4096, 2048] block, 32 MB)."""
    _check_args(hidden, weight, targets)
    temperature = check_temperature(temperature)
    check_targets_in_range(targets, weight.shape[0])
    return _LinearLogprobsTorch.apply(hidden, weight, targets, temperature, chunk_rows, chunk_vocab)


# =============================================================================================
# (3) Triton kernels. A program owns a block of BLOCK_N tokens (the forward walks the whole
#     vocabulary for them; the backward kernel takes one BLOCK_V block of it); a [BLOCK_N, BLOCK_V]
#     block of logits is made by tl.dot over C in BLOCK_C steps and lives only in registers.
# =============================================================================================
@triton.jit
def _logits_block(
    hidden_ptr, stride_hn, stride_hc, weight_ptr, stride_wv, stride_wc,
    rows, cols, N, V, C, inv_temperature,  # rows [BLOCK_N], cols [BLOCK_V]: int64 indices
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, UPCAST: tl.constexpr,
):
    """x = (hidden[rows] @ weight[cols].T) / temp: float32 [BLOCK_N, BLOCK_V]; -inf in the
    columns past V."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(hidden_ptr + rows[:, None] * stride_hn + cs[None, :] * stride_hc,
                    mask=(rows[:, None] < N) & (cs[None, :] < C), other=0.0)  # [BLOCK_N, BLOCK_C]
        w = tl.load(weight_ptr + cols[:, None] * stride_wv + cs[None, :] * stride_wc,
                    mask=(cols[:, None] < V) & (cs[None, :] < C), other=0.0)  # [BLOCK_V, BLOCK_C]
        if UPCAST:  # the interpreter's bfloat16 workaround (see launch_config)
            h, w = h.to(tl.float32), w.to(tl.float32)
        # float32 accumulation; "ieee": no TF32 for float32 inputs
        acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
    return tl.where(cols[None, :] < V, acc * inv_temperature, float("-inf"))


@triton.jit
def _grad_logits_block(x, rows, cols, targets, row_max, log_sum, g, N, V):
    """dx = g (onehot - p), p = exp((x - m) - log_sum): float32 [BLOCK_N, BLOCK_V], 0 outside
    the [N, V] range so that padding adds nothing to the gradient products (0 * NaN would)."""
    p = tl.exp((x - row_max[:, None]) - log_sum[:, None])
    dx = g[:, None] * (tl.where(cols[None, :] == targets[:, None], 1.0, 0.0) - p)
    return tl.where((rows[:, None] < N) & (cols[None, :] < V), dx, 0.0)


@triton.jit
def _linear_logprobs_fwd_kernel(
    hidden_ptr, stride_hn, stride_hc,  # hidden [N, C]
    weight_ptr, stride_wv, stride_wc,  # weight [V, C]
    targets_ptr,  # int64 [N]
    out_ptr, row_max_ptr, log_sum_ptr,  # float32 [N] each
    N, V, C, inv_temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per BLOCK_N tokens; reads its hidden rows V / BLOCK_V times and all of weight
    # once (N / BLOCK_N programs: weight is read N / BLOCK_N times in all); writes 12 bytes a token.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=0)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max of x
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)  # running sum of exp(x - m)
    x_t = tl.where((targets >= 0) & (targets < V), 0.0, float("nan"))  # x[t]: added as blocks pass
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        x = _logits_block(hidden_ptr, stride_hn, stride_hc, weight_ptr, stride_wv, stride_wc,
                          rows, cols, N, V, C, inv_temperature, BLOCK_N, BLOCK_V, BLOCK_C,
                          UPCAST)  # [BLOCK_N, BLOCK_V]
        m_new = tl.maximum(m, tl.max(x, axis=1))  # finite: every block has a column < V
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
        x_t += tl.sum(tl.where(cols[None, :] == targets[:, None], x, 0.0), axis=1)
    log_sum = tl.log(s)
    tl.store(out_ptr + rows, (x_t - m) - log_sum, mask=row_ok)  # logprob = (x[t] - m) - log_sum
    tl.store(row_max_ptr + rows, m, mask=row_ok)
    tl.store(log_sum_ptr + rows, log_sum, mask=row_ok)


@triton.jit
def _linear_logprobs_dlogits_kernel(
    hidden_ptr, stride_hn, stride_hc, weight_ptr, stride_wv, stride_wc,
    targets_ptr, row_max_ptr, log_sum_ptr, grad_out_ptr,  # [N] each
    dlogits_ptr, stride_dn,  # [n, V] d logits of a chunk of rows, in the operand dtype
    n0, N, V, C, inv_temperature,  # the chunk is tokens n0 .. N-1
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per [BLOCK_N, BLOCK_V] block of the chunk's logits: recompute x, write
    # dx = (grad / temp) (onehot - p). Token blocks run along axis 0, the faster one, so that
    # consecutive programs read the same BLOCK_V rows of weight and find them in L2: weight is read
    # from memory about once per chunk.
    rows = n0 + tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=0)
    row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(grad_out_ptr + rows, mask=row_ok, other=0.0) * inv_temperature  # grad / temp
    x = _logits_block(hidden_ptr, stride_hn, stride_hc, weight_ptr, stride_wv, stride_wc,
                      rows, cols, N, V, C, inv_temperature, BLOCK_N, BLOCK_V, BLOCK_C, UPCAST)
    # [BLOCK_N, BLOCK_V] float32
    dx = _grad_logits_block(x, rows, cols, targets, row_max, log_sum, g, N, V)
    tl.store(dlogits_ptr + (rows - n0)[:, None] * stride_dn + cols[None, :],
             dx.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < V))


# =============================================================================================
# (4) Launchers.
# =============================================================================================
def launch_config(N, V, C, dtype):
    """Compile-time block sizes and warps per program for N tokens, a vocabulary of V, C channels
    and inputs of `dtype`, smaller (down to tl.dot's minimum, 16) when the problem is:
      - bfloat16 / float16 (tensor cores): 64 tokens x 128 vocabulary entries, 64 channels per
        dot step, 8 warps;
      - float32: tl.dot in full float32 ("ieee", as PyTorch's float32 matmul) runs on the CUDA
        cores with its operands in registers, so 16 x 64, 32 channels per step, 4 warps.
    Chosen among a few candidates as blocks that compile without register spills for sm_80 and
    sm_90 (bench/kernel_registers.py prints the table), not by timing: no GPU was at hand. Used by
    the launchers below, and by tests/test_kernel_compile.py and bench/kernel_registers.py.

    UPCAST is a workaround for a test-only limitation: Triton 3.9's interpreter multiplies
    bfloat16 blocks in tl.dot as their raw uint16 bit patterns, so under TRITON_INTERPRET=1
    bfloat16 operands are widened to float32 just before each tl.dot (exact: every bfloat16 is a
    float32, and the products are formed in float32 on a GPU too). Compiled kernels never upcast."""

    def fit(n, most):  # a power of two in [16, most], no larger than n needs
        return max(16, min(triton.next_power_of_2(max(n, 1)), most))

    if dtype == torch.float32:
        most_n, most_v, most_c, warps = 16, 64, 32, 4
    else:
        most_n, most_v, most_c, warps = 64, 128, 64, 8
    return {"BLOCK_N": fit(N, most_n), "BLOCK_V": fit(V, most_v), "BLOCK_C": fit(C, most_c),
            "num_warps": warps, "UPCAST": TRITON_INTERPRET and dtype == torch.bfloat16}


def _flat(hidden, C):
    return hidden.reshape(-1, C)  # [N, C]: a view when one exists, else a copy of N * C elements


def _linear_logprobs_fwd(hidden, weight, targets, inv_temp):
    C, V = hidden.shape[-1], weight.shape[0]
    h = _flat(hidden, C)
    N = h.shape[0]
    out = torch.empty(N, dtype=torch.float32, device=h.device)  # [N]
    row_max, log_sum = torch.empty_like(out), torch.empty_like(out)  # [N] each
    if N == 0:
        return out, row_max, log_sum
    config = launch_config(N, V, C, h.dtype)
    _linear_logprobs_fwd_kernel[(triton.cdiv(N, config["BLOCK_N"]),)](
        h, h.stride(0), h.stride(1), weight, weight.stride(0), weight.stride(1), targets,
        out, row_max, log_sum, N, V, C, inv_temp, **config,
    )
    return out, row_max, log_sum


DLOGITS_BYTES = 512 * 2**20  # backward: the most memory one chunk's dlogits may take


def chunk_rows(N, V, dtype):
    """Tokens per backward chunk: as many as keep its [n, V] dlogits within DLOGITS_BYTES (at least
    128), all N when they fit. V = 151936 in bfloat16: 1664 rows, 483 MiB."""
    most = max(128, DLOGITS_BYTES // (V * torch.finfo(dtype).bits // 8) // 128 * 128)
    return min(max(N, 1), most)


_ADDMM_FLOAT32_OUT = {}  # device type -> can addmm add a bfloat16 product to float32 in one call


def _add_product(acc, a, b):
    """acc += a @ b, acc float32 and a, b in the operands' dtype: one matrix product that reads and
    writes acc in float32 (cuBLAS's beta = 1; torch's addmm with out_dtype, CUDA) where torch has
    it, else the product in the operands' dtype, then added."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    kind = acc.device.type
    if _ADDMM_FLOAT32_OUT.get(kind, True):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _ADDMM_FLOAT32_OUT[kind] = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _ADDMM_FLOAT32_OUT[kind] = False
    acc += (a @ b).float()


def _linear_logprobs_bwd(hidden, weight, targets, row_max, log_sum, grad_out, inv_temp,
                         want_hidden, want_weight):
    """The gradients, a chunk of tokens at a time: the Triton kernel writes the chunk's dlogits
    [n, V] (recomputing the logits once), then two matrix products (cuBLAS on a GPU) give
    d hidden = dlogits @ weight and add dlogits.T @ hidden to d weight. Returns grad_hidden [N, C]
    and grad_weight [V, C] in the inputs' dtype."""
    C, V = hidden.shape[-1], weight.shape[0]
    h = _flat(hidden, C)
    N = h.shape[0]
    grad_h = torch.empty((N, C), dtype=h.dtype, device=h.device) if want_hidden else None
    grad_w = None
    if N == 0:
        return grad_h, torch.zeros_like(weight) if want_weight else None
    n = chunk_rows(N, V, h.dtype)
    config = launch_config(n, V, C, h.dtype)
    # [n, Vp] reused by every chunk, Vp = V rounded up to a multiple of 64, the columns past V zeros
    # (never written), and weight with as many zero rows: the products are unchanged, and the matrix
    # library gets the aligned sizes its fast kernels need (an odd V, as Qwen2.5's 151665 ids, would
    # send it to slow ones)
    Vp = V + (-V % 64)
    dlogits = torch.zeros((n, Vp), dtype=h.dtype, device=h.device)
    w = weight if Vp == V else torch.nn.functional.pad(weight, (0, 0, 0, Vp - V))  # [Vp, C]
    for n0 in range(0, N, n):
        rows = slice(n0, min(n0 + n, N))
        d = dlogits[: rows.stop - n0]  # [n, Vp]
        grid = (triton.cdiv(d.shape[0], config["BLOCK_N"]), triton.cdiv(V, config["BLOCK_V"]))
        _linear_logprobs_dlogits_kernel[grid](
            h, h.stride(0), h.stride(1), weight, weight.stride(0), weight.stride(1), targets,
            row_max, log_sum, grad_out, d, d.stride(0), n0, rows.stop, V, C, inv_temp, **config,
        )  # writes d[:, :V]
        if want_hidden:
            torch.mm(d, w, out=grad_h[rows])  # [n, C] = [n, Vp] @ [Vp, C]
        if want_weight:
            if n >= N:  # one chunk: the product is the gradient, summed in float32 and rounded once
                grad_w = d.T @ h  # [Vp, C] = [Vp, n] @ [n, C]
            else:  # several: summed over chunks in float32
                grad_w = (torch.zeros((Vp, C), dtype=torch.float32, device=h.device)
                          if grad_w is None else grad_w)
                _add_product(grad_w, d.T, h[rows])
    return grad_h, grad_w[:V].to(weight.dtype) if want_weight else None


# =============================================================================================
# (5) Autograd wrapper. Backward materialises dlogits a chunk of tokens at a time and leaves the
#     two gradient products to the matrix library: each recomputed block of logits feeds both,
#     no float32 accumulator is re-read from memory, and the sums are deterministic (no atomics).
# =============================================================================================
class _LinearLogprobsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        targets = targets.reshape(-1).to(torch.int64).contiguous()  # [N]
        out, row_max, log_sum = _linear_logprobs_fwd(hidden, weight, targets, 1.0 / temperature)
        ctx.save_for_backward(hidden, weight, targets, row_max, log_sum)
        ctx.inv_temp = 1.0 / temperature
        return out.view(hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, targets, row_max, log_sum = ctx.saved_tensors
        grad_out = grad_out.reshape(-1).float().contiguous()  # [N]; may arrive expanded (stride 0)
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_h, grad_w = _linear_logprobs_bwd(hidden, weight, targets, row_max, log_sum, grad_out,
                                              ctx.inv_temp, want_hidden, want_weight)
        return grad_h.view(hidden.shape) if want_hidden else None, grad_w, None, None


def linear_logprobs_triton(hidden, weight, targets, temperature=1.0):
    """log softmax((hidden @ weight.T) / temp)[targets] -> float32 hidden.shape[:-1], Triton path
    (CUDA, or any device under TRITON_INTERPRET=1). Out-of-range targets give NaN (not checked)."""
    _check_args(hidden, weight, targets)
    temperature = check_temperature(temperature)
    require_triton(hidden)
    return _LinearLogprobsTriton.apply(hidden, weight, targets, temperature)


# =============================================================================================
# (6) Dispatch: the public function.
# =============================================================================================
def linear_logprobs(hidden, weight, targets, temperature=1.0):
    """log softmax((hidden @ weight.T) / temp)[targets] -> float32 hidden.shape[:-1], without
    storing the [..., V] logits.

    hidden [..., C] (the final hidden states, any strides), weight [V, C] (the LM head, no bias),
    same dtype; targets [...] integer in [0, V). Differentiable w.r.t. hidden and weight; float32
    accumulation. Triton on CUDA (or under TRITON_INTERPRET=1), PyTorch elsewhere."""
    if use_triton(hidden):
        return linear_logprobs_triton(hidden, weight, targets, temperature)
    return linear_logprobs_torch(hidden, weight, targets, temperature)


# =============================================================================================
# (7) Self-check: python -m kernels.linear_logprobs  (TRITON_INTERPRET=1 ... on a CPU)
# =============================================================================================
if __name__ == "__main__":
    import sys

    from .common import report

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "Triton" if use_triton(torch.empty(0, device=device)) else "PyTorch"
    print(f"linear_logprobs vs linear_logprobs_reference, {path} path on {device}")
    ok = True
    for (B, T, C, V), dtype, temp in [((2, 9, 40, 300), torch.float32, 1.0),
                                      ((3, 5, 24, 37), torch.bfloat16, 0.7)]:
        hidden = torch.randn(B, T, C, device=device).to(dtype).requires_grad_()
        weight = (torch.randn(V, C, device=device) / C**0.5).to(dtype).requires_grad_()
        h = hidden[:, :-1]  # [B, T-1, C]: the RL slice
        targets = torch.randint(0, V, h.shape[:-1], device=device)
        grad_out = torch.randn(h.shape[:-1], device=device)
        got = linear_logprobs(h, weight, targets, temp)
        grads_got = torch.autograd.grad(got, (hidden, weight), grad_out)
        # the reference in float32, so that its logits are not rounded to bfloat16
        want = linear_logprobs_reference(h.float(), weight.float(), targets, temp)
        grads_want = torch.autograd.grad(want, (hidden, weight), grad_out)
        name = f"{tuple(h.shape)} x {tuple(weight.shape)} {str(dtype)[6:]} temp={temp}"
        rtol = 1e-2 if dtype != torch.float32 else 1e-4
        ok &= report(name + " value", got, want, rtol=1e-4, atol=1e-4)
        ok &= report(name + " grad hidden", grads_got[0], grads_want[0].to(dtype),
                     rtol=rtol, atol=1e-3)
        ok &= report(name + " grad weight", grads_got[1], grads_want[1].to(dtype),
                     rtol=rtol, atol=1e-3)
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)
