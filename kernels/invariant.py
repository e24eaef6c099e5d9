"""Batch-invariant forward (--batch_invariant): a row's numbers the same bits whatever the batch.

A matrix product's kernel picks its blocking, and so the order of each dot product's sums, by the
shape it is given: a row multiplied alone (the sampler's decode, one new token per sequence) and the
same row among a thousand (the trainer's forward over whole sequences) round differently, so the
sampler's log-probs and the trainer's differ in their last bits (metrics: sampler_logp_diff) and
"on-policy" is never exact. The fix (Thinking Machines, "Defeating Nondeterminism in LLM Inference",
2025-09): give every product one shape. Here, on the PyTorch path:

    linear:     x (N, K) @ W.T  as  ceil(N/R) tiles of R = ROWS rows (zero rows padding the last),
                one batched product of (R, K) @ (K, out) tiles: a row's bits depend on its own
                values alone
    attention:  each query alone against tiles of R keys counted from its first readable key,
                the softmax an online recurrence (Milakov & Gimelshein 2018) over the tiles in
                order: a tile with no key a query may read leaves the running max, sum and output
                exactly as they were, so the cached decode (keys up to the cache's length) and the
                whole-sequence forward (keys up to T) give a query the same bits, and so does any
                padding before the sequence (the sampler's left-padded batch, a trainer's
                sequences from slot 0)

Norms, the embedding, rotary angles and the activations are per row already. BatchInvariant, a
TorchFunctionMode, routes F.linear, addmm, matmul and scaled_dot_product_attention here while it is
on (plumbing.Run enters it for the whole run); model.head_logprobs then takes the unfused log-prob
path and the sampler its log-probs through kernels.logprobs, the trainer's function.
"""
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROWS = 64   # the tile: every product's rows, and attention's keys, in blocks of this many


def tiled_mm(x, w):
    """x (..., K) @ w (K, M) -> (..., M), x's rows in tiles of ROWS: one (ROWS, K) @ (K, M) shape
    for every row, whatever the batch."""
    rows = x.reshape(-1, x.size(-1))                                     # (N, K)
    n = rows.size(0)
    tiles = F.pad(rows, (0, 0, 0, -n % ROWS)).view(-1, ROWS, rows.size(1))   # (N/R, R, K)
    w = w.to(tiles.dtype)
    out = torch.bmm(tiles, w.expand(tiles.size(0), *w.shape))           # (N/R, R, M)
    return out.reshape(-1, w.size(1))[:n].reshape(*x.shape[:-1], w.size(1))


def linear(x, weight, bias=None):
    """F.linear in tiles: x (..., K), weight (M, K) -> (..., M)."""
    y = tiled_mm(x, weight.t())
    return y if bias is None else y + bias.to(y.dtype)


def first_key(attn_mask):
    """Each row's first key (B, 1 or h, 1, 1) from attn_mask (B, 1 or h, Tq, S) bool: the first
    that the query reading the most keys reads (a row's real queries all start there; a padding
    query reads itself alone). The row's key tiles start there, so padding before a sequence
    moves no tile boundary."""
    widest = attn_mask.sum(-1).argmax(-1)[..., None, None]                 # (B, h, 1, 1)
    rows = attn_mask.gather(2, widest.expand(-1, -1, -1, attn_mask.size(-1)))   # (B, h, 1, S)
    return rows.int().argmax(-1)[..., None]


_shifted = [None, None]   # the last mask and its shift: every layer of a forward shares one mask


def shifted_mask(attn_mask, B, R):
    """Each row's key slots from its first key on, in whole tiles of R (B, 1 or h, 1, S2), and
    attn_mask (B, 1 or h, Tq, S), or one (Tq, S) for all, read at them (False past S); once per
    forward (its layers share one mask)."""
    if _shifted[0] is not attn_mask:
        Tq, S = attn_mask.shape[-2:]
        full = attn_mask.expand(B, -1, Tq, S) if attn_mask.dim() == 4 else \
            attn_mask.expand(B, 1, Tq, S)
        S2 = -(-S // R) * R                                              # whole tiles, any start
        slots = first_key(full) + torch.arange(S2, device=full.device)
        _shifted[:] = attn_mask, (slots, F.pad(full, (0, S2)).gather(3, slots.expand(
            -1, -1, Tq, -1)))
    return _shifted[1]


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """scaled_dot_product_attention's result (B, h, Tq, hs), each query alone against tiles of
    ROWS keys from its row's first key: q (B, h, Tq, hs), k, v (B, h, S, hs), attn_mask (B, 1 or
    h, Tq, S) bool, True where a query reads a key. Every product is a (1, hs) @ (hs, R) or
    (1, R) @ (R, hs) of its own (a shared query tile would waste R - 1 rows of R in the decode);
    the key tiles are copied for each query, the memory a fused kernel would not spend."""
    if dropout_p or enable_gqa or k.size(1) != q.size(1):
        raise ValueError("--batch_invariant attention: no dropout, one key head per query head")
    B, h, Tq, hs = q.shape
    S, R, n = k.size(2), ROWS, B * h * Tq
    if attn_mask is None:
        attn_mask = torch.ones(Tq, S, dtype=torch.bool, device=q.device)
        attn_mask = attn_mask.tril(S - Tq) if is_causal else attn_mask
    slots, mask = shifted_mask(attn_mask, B, R)               # (B, 1 or h, 1, S2), (.., Tq, S2)
    S2 = slots.size(-1)
    # keys and values from each row's first key on (past S: zeros, masked, never read): each
    # row's window of S2 slots (B, h, hs, S2), indexed by (B,) and (h,)
    first = slots[..., 0].expand(B, h, 1)                                # (B, h, 1)
    rows, heads = torch.arange(B, device=q.device)[:, None], torch.arange(h, device=q.device)
    kt, vt = (F.pad(t, (0, 0, 0, S2)).unfold(2, S2, 1)[rows, heads, first[..., 0]].transpose(2, 3)
              for t in (k, v))                                           # (B, h, S2, hs)
    mask = mask.expand(B, h, Tq, S2).reshape(n, 1, S2)                  # (n, 1, S2)
    qs = q.reshape(n, 1, hs)                                             # each query a row
    scale = 1 / math.sqrt(hs) if scale is None else scale
    m = torch.full((n, 1, 1), float("-inf"), device=q.device)            # running max
    total = torch.zeros_like(m)                                          # running sum of exp
    acc = torch.zeros(n, 1, hs, device=q.device)                         # running output
    for j in range(S2 // R):                                             # key tiles, in order
        kj, vj = (t[:, :, None, j * R:(j + 1) * R].expand(B, h, Tq, R, hs).reshape(n, R, hs)
                  for t in (kt, vt))
        s = torch.bmm(qs, kj.transpose(1, 2)).float() * scale           # (n, 1, R)
        s = s.masked_fill(~mask[..., j * R:(j + 1) * R], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True)).detach()
        shift = torch.where(m_new == float("-inf"), 0.0, m_new)          # no key yet: 0, not NaN
        p = torch.exp(s - shift)                                         # 0 where masked
        alpha = torch.exp(m - shift)                                     # 1 if the max held
        total = total * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p.to(vj.dtype), vj).float()
        m = m_new
    y = acc / torch.where(total > 0, total, 1.0)
    return y.view(B, h, Tq, hs).to(q.dtype)


class BatchInvariant(TorchFunctionMode):
    """While on (`with BatchInvariant():`, or enable()), the products above replace F.linear,
    addmm, matmul and SDPA (inside, the mode is off: the tiles' own products are the plain ones)."""

    depth = 0                                              # modes on now (active())

    def __enter__(self):
        BatchInvariant.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        BatchInvariant.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return attention(*args, **kwargs)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and \
                args[1].dim() == 2:
            return tiled_mm(args[0], args[1])
        if func in (torch.addmm, torch.Tensor.addmm):
            bias, a, b = args[:3]
            return bias * kwargs.get("beta", 1) + kwargs.get("alpha", 1) * tiled_mm(a, b)
        return func(*args, **kwargs)


def enable():
    """The mode on for the rest of this process (a run that asked for it)."""
    if not active():
        BatchInvariant().__enter__()


def active():
    return BatchInvariant.depth > 0
