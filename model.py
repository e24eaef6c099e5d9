"""
The transformer every script shares: a nanoGPT-style decoder (GPT), its twin with a scalar head
for reward and value models (ScalarGPT), a KV cache, and what the scripts read from a model:
completion log-probs, the exact KL and entropy, masked means. The tokenizer is in hf/tokenizer.py,
checkpoints and Hugging Face folders in hf/checkpoint.py, generation in sampler.py.

GPTConfig's switches are what GPT-2, Llama, Qwen2 and Qwen3 differ in: learned or rotary positions
(with Llama 3.1's scaling), LayerNorm or RMSNorm, a GELU or SwiGLU MLP, grouped-query attention,
q/k/v and output biases, q/k norms, a head width apart from the model's, a tied or separate LM
head. The defaults are nanoGPT's: learned positions, LayerNorm, GELU, a tied head.

- Padding on either side: mask (B, T) is 1 on real tokens; positions count from a row's first real
  token and no query reads a padding key, so a row's outputs do not depend on the batch. On a GPU,
  training and scoring move each row's real tokens first and run flash attention, no mask.
- The support: an embedding may have rows past its tokenizer (Qwen2.5: 151936 for 151665 ids);
  the distribution, its log-probs, KL and entropy are over the tokenizer's ids only.
- Precision: logits are float32, never rounded to bfloat16. Under bfloat16 autocast the LM head
  multiplies bfloat16 operands into float32 sums, and scoring and training reach log-probs through
  one function (head_logprobs): on-policy the first ratio is exactly 1 (verl-project/verl#6280;
  MiniMax 2025, arXiv 2506.13585, section 4, keep the head in float32 for it).
- Large vocabularies: above FUSED_VOCAB, log-probs go from hidden states through
  kernels.linear_logprobs, and the KL and entropy a chunk at a time: no [B, T, V] logits.

Shapes: B batch, T time, C channels, V vocabulary (support), nh/nkv heads/key-value heads, hs head.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from kernels import entropy, invariant, kl, linear_logprobs, logprobs

FUSED_VOCAB = 8192   # log-probs fuse the LM head and the log-softmax above this many ids


# -----------------------------------------------------------------------------
# Precision: what the matrix products compute in

# The devices whose training and scoring pack each row's real tokens first and run plain causal
# attention (SDPA's flash kernel, no mask; GPT.hidden). Elsewhere the explicit mask stays.
PACKED_ATTENTION = ("cuda",)
_AUTOCAST = {d for d in ("cpu", "cuda", "mps", "xpu") if torch.amp.is_autocast_available(d)}
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)   # enable_gqa
_MM_FLOAT32_OUT = {}   # device type -> whether torch.mm(bf16, bf16, out_dtype=float32) runs there


def operand_dtype(device_type, default=torch.float32):
    """The dtype autocast computes products in on this device type now (bfloat16 on a GPU in
    the scripts), else `default`."""
    if device_type in _AUTOCAST and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


def autocast_off(device_type):
    """A context with autocast off on `device_type`: inside, tensors compute in their own dtype."""
    if device_type in _AUTOCAST:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def mm_float32_out(device):
    """Whether torch.mm multiplies bfloat16 into float32 here (out_dtype: CUDA), tried once."""
    if device.type not in _MM_FLOAT32_OUT:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            out = torch.mm(a, a, out_dtype=torch.float32)
            _MM_FLOAT32_OUT[device.type] = out.dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_FLOAT32_OUT[device.type] = False
    return _MM_FLOAT32_OUT[device.type]


# -----------------------------------------------------------------------------
# The model

@dataclass
class GPTConfig:
    vocab_size: int = 258      # the "bytes" tokenizer: 256 bytes + EOS + PAD
    block_size: int = 64       # longest sequence (prompt + completion, padding excluded)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # The switches real checkpoints need (checkpoint.from_pretrained sets them)
    n_kv_head: int = 0         # key/value heads, grouped-query attention; 0: n_head
    norm: str = "layernorm"    # "layernorm" (GPT-2) or "rmsnorm" (Llama, Qwen)
    norm_eps: float = 1e-5
    pos: str = "learned"       # "learned" absolute embeddings (GPT-2) or "rope" (Llama, Qwen)
    rope_theta: float = 10000.0
    mlp: str = "gelu"          # "gelu" (GPT-2) or "swiglu" (Llama, Qwen)
    gelu: str = "none"         # nn.GELU's approximate: "none" (nanoGPT) or "tanh" (GPT-2)
    mlp_hidden: int = 0        # the MLP's width; 0: 4 * n_embd
    bias: bool = True          # biases of the attention output and the MLP (GPT-2)
    qkv_bias: bool = True      # biases of the query, key and value projections (GPT-2, Qwen2)
    o_bias: bool = None        # the attention output's bias; None: as `bias` (Llama's own)
    head_dim: int = 0          # each head's width; 0: n_embd // n_head (Qwen3 sets it apart)
    qk_norm: bool = False      # RMSNorm over each head's queries and keys before the rotation
    # Llama 3.1's scaling of the rotary frequencies ("llama3"; "none": plain RoPE): see
    # rope_frequencies
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max: int = 8192
    tie_embeddings: bool = True   # the LM head is the token embedding (GPT-2, small Qwen)
    # The tokenizer's ids: the first tokenizer_vocab rows of the embedding (0: all vocab_size),
    # the support of the distribution (module docstring)
    tokenizer_vocab: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)}; it must be at least 1")
        if self.n_embd % self.n_head and not self.head_dim:
            raise ValueError(f"GPTConfig.n_embd = {self.n_embd} must be divisible by n_head = "
                             f"{self.n_head}")
        if self.head_dim < 0 or self.head_dim % 2:
            raise ValueError(f"GPTConfig.head_dim = {self.head_dim}; allowed: 0 (n_embd // n_head) "
                             f"or an even width")
        if self.rope_scaling == "llama3" and not (
                self.rope_factor >= 1 and self.rope_original_max > 0
                and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"GPTConfig's llama3 rope scaling needs factor >= 1, 0 < "
                             f"low_freq_factor < high_freq_factor and original_max > 0; got "
                             f"{self.rope_factor}, {self.rope_low_freq_factor}, "
                             f"{self.rope_high_freq_factor}, {self.rope_original_max}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout = {self.dropout}; allowed: 0 <= dropout < 1")
        if not 0 <= self.tokenizer_vocab <= self.vocab_size:
            raise ValueError(f"GPTConfig.tokenizer_vocab = {self.tokenizer_vocab}; allowed: 0 "
                             f"(all) to vocab_size = {self.vocab_size}")
        if self.n_kv_head < 0 or self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"GPTConfig.n_kv_head = {self.n_kv_head} must divide n_head = "
                             f"{self.n_head}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("pos", ("learned", "rope")),
                              ("mlp", ("gelu", "swiglu")), ("gelu", ("none", "tanh")),
                              ("rope_scaling", ("none", "llama3"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)!r}; allowed: "
                                 f"{', '.join(allowed)}")

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def head_size(self):
        return self.head_dim or self.n_embd // self.n_head

    @property
    def support(self):
        """How many ids the distribution is over: the first `support` rows of the LM head."""
        return self.tokenizer_vocab or self.vocab_size


class KVCache:
    """Every layer's keys and values (for the nkv heads only) and which slots hold real tokens.

    Appending (the forward with a cache, the eager sampler): a call writes its chunk at slot
    `length` and attention reads the first `length` slots. Static (sampler.decode_step): allocated
    up front, a step writes at a slot held in a tensor and attends over all max_len slots, the
    empty ones masked by key_mask: one recorded CUDA graph serves every step."""

    def __init__(self, n_layer, batch_size, max_len, device):
        self.k = [None] * n_layer        # each (B, nkv, max_len, hs), allocated at first use
        self.v = [None] * n_layer
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # the next's
        self.length = 0                  # cached time steps, padding included
        self.longest = 0                 # max(next_pos) on the host: the step's block_size check
        self.max_len = max_len

    @classmethod
    def preallocated(cls, n_layer, batch_size, max_len, n_head, head_size, dtype, device):
        """A static cache of zeros: an empty slot's weight is exactly 0, and 0 * NaN (what
        torch.empty may hold) would be NaN."""
        cache = cls(n_layer, batch_size, max_len, device)
        shape = (batch_size, n_head, max_len, head_size)
        cache.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        cache.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        return cache


def rope_frequencies(config, device):
    """The rotary inverse frequencies (hs/2,) float32: theta^(-2i/hs) (Su et al. 2021). With
    Llama 3.1's "llama3" scaling (Meta's code, transformers'), L = rope_original_max: a wavelength
    2 pi / f above L / low_freq_factor is stretched `factor` times, one below L / high_freq_factor
    kept, and between them f is interpolated by s = (L / wavelength - low) / (high - low):
    (1 - s) f / factor + s f."""
    hs = config.head_size
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hs, 2, device=device).float() / hs)
    if config.rope_scaling != "llama3":
        return inv_freq
    L, low, high, factor = (config.rope_original_max, config.rope_low_freq_factor,
                            config.rope_high_freq_factor, config.rope_factor)
    wavelength = 2 * math.pi / inv_freq
    smooth = (L / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > L / low, inv_freq / factor, inv_freq)
    between = (wavelength <= L / low) & (wavelength >= L / high)
    return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rotate(x, cos, sin):
    """x (B, h, T, hs) rotated by the angles' cos, sin (B, 1, T, hs), in Llama's half-split layout
    of Hugging Face's code: channel i pairs with channel i + hs/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def norm(config):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv, self.hs = config.n_head, config.kv_heads, config.head_size
        hs = self.hs
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv) * hs,
                                bias=config.qkv_bias)
        o_bias = config.bias if config.o_bias is None else config.o_bias
        self.c_proj = nn.Linear(self.n_head * hs, config.n_embd, bias=o_bias)
        if config.qk_norm:                     # Qwen3: RMSNorm over each head's hs channels
            self.q_norm = nn.RMSNorm(hs, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(hs, eps=config.norm_eps)
        self.dropout = config.dropout

    def forward(self, x, attn_mask, cache=None, layer=0, slot=None, rope=None):
        """attn_mask (B, 1, T, S) bool, True where a query may read a key; None: causal attention
        over a layout with every row's real tokens first (GPT.hidden's packing: flash attention)."""
        B, T, C = x.shape
        hs = self.hs
        q, k, v = self.c_attn(x).split([self.n_head * hs, self.n_kv * hs, self.n_kv * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)                   # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv, hs).transpose(1, 2) for t in (k, v))   # (B, nkv, T, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:                                                # Su et al. 2021
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None and slot is not None:    # static (sampler): write at `slot`, read all
            cache.k[layer].index_copy_(2, slot, k)
            cache.v[layer].index_copy_(2, slot, v)
            k, v = cache.k[layer], cache.v[layer]                           # (B, nkv, max_len, hs)
        elif cache is not None:   # append this chunk's keys and values, attend over all cached
            if cache.k[layer] is None:
                shape = (B, self.n_kv, cache.max_len, hs)
                cache.k[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
                cache.v[layer] = torch.empty(shape, dtype=v.dtype, device=v.device)
            start = cache.length
            cache.k[layer][:, :, start:start + T] = k
            cache.v[layer][:, :, start:start + T] = v
            k = cache.k[layer][:, :, :start + T]                            # (B, nkv, S, hs)
            v = cache.v[layer][:, :, :start + T]
        dropout = self.dropout if self.training else 0.0
        g = self.n_head // self.n_kv            # query head h reads key/value head h // g
        if attn_mask is None:                   # packed: causal, no mask (flash attention)
            gqa = g > 1 and SDPA_GQA and x.is_cuda    # flash reads a key head for its g heads
            if g > 1 and not gqa:                     # elsewhere each is copied g times
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                               **({"enable_gqa": True} if gqa else {}))
        else:   # the g query heads of a key head attend as g*T queries: the cache read once
            q = q.reshape(B, self.n_kv, g * T, hs)                          # (B, nkv, g*T, hs)
            mask = attn_mask.repeat(1, 1, g, 1) if g > 1 else attn_mask     # (B, 1, g*T, S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            y = y.reshape(B, self.n_head, T, hs)                            # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hs)
        return self.c_proj(y)


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020): c_proj(silu(gate) * up), gate and up from one projection."""

    def __init__(self, config):
        super().__init__()
        hidden = config.mlp_hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.drop(self.c_proj(F.silu(gate) * up))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        hidden = config.mlp_hidden or 4 * config.n_embd
        if config.mlp == "swiglu":
            self.mlp = SwiGLU(config)
        else:
            self.mlp = nn.Sequential(nn.Linear(config.n_embd, hidden, bias=config.bias),
                                     nn.GELU(approximate=config.gelu),
                                     nn.Linear(hidden, config.n_embd, bias=config.bias),
                                     nn.Dropout(config.dropout))

    def forward(self, x, attn_mask, cache=None, layer=0, slot=None, rope=None):
        x = x + self.attn(self.ln_1(x), attn_mask, cache, layer, slot, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.pos == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections / sqrt(2 n_layer)
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.grad_checkpoint = False  # --grad_checkpoint: recompute each block's activations

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def hidden(self, idx, mask=None, cache=None):
        """Final hidden states (B, T, C) of idx (B, T), mask (B, T) 1 = real, 0 = padding. With
        a cache, idx is the next chunk, appended to it; one token a row with mask None (the
        sampler's step) reads the cache's key_mask and next_pos: no mask built, no host sync."""
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        step = cache is not None and mask is None and T == 1
        if step:
            pos, top = cache.next_pos[:, None].clone(), cache.longest + 1   # (B, 1) positions
        else:
            real = (torch.ones(B, T, device=idx.device) if mask is None else mask) > 0   # (B, T)
            offset = 0 if cache is None else cache.next_pos[:, None]
            pos = (offset + real.long().cumsum(1) - 1).clamp(min=0)         # (B, T) positions
            top = int(pos.max()) + 1 if pos.numel() else 0        # (a rank's empty micro-batch)
        if top > self.config.block_size:
            raise ValueError(f"a sequence of {top} real tokens exceeds block_size = "
                             f"{self.config.block_size}; shorten it or build the model with a "
                             f"larger block_size")
        if cache is None:
            key_mask = real                                                 # (B, S) with S = T
        else:
            if start + T > cache.max_len:
                raise ValueError(f"KV cache full: {start} + {T} steps > max_len = {cache.max_len}")
            cache.key_mask[:, start:start + T] = True if step else real
            cache.next_pos += 1 if step else real.sum(1)
            cache.longest = top if step else int(cache.next_pos.max()) if B else 0
            key_mask = cache.key_mask[:, :start + T]                        # (B, S), S = start + T
        if cache is None and idx.device.type in PACKED_ATTENTION:   # training, scoring on a GPU
            order = torch.sort((~real).int(), dim=1, stable=True).indices   # (B, T) real first
            x, rope = self.embed(idx.gather(1, order), pos.gather(1, order))   # (B, T, C) packed
            x = self.run_blocks(x, None, None, rope)          # causal: no padding before a token
            back = order.argsort(dim=1)[..., None].expand_as(x)   # each position's packed place
            return self.ln_f(x.gather(1, back))
        attn_mask = key_mask[:, None, None]                        # the step's: every real key
        if not step:
            q_pos = torch.arange(start, start + T, device=idx.device)[:, None]  # (T, 1) queries
            k_pos = torch.arange(start + T, device=idx.device)[None, :]         # (1, S)
            attn_mask = (k_pos <= q_pos) & key_mask[:, None, :]    # (B, T, S): causal, real
            attn_mask = (attn_mask | (k_pos == q_pos))[:, None]    # (B, 1, T, S): padding: itself
        x, rope = self.embed(idx, pos)                             # (B, T, C)
        x = self.run_blocks(x, attn_mask, cache, rope)
        if cache is not None:
            cache.length += T
        return self.ln_f(x)

    def run_blocks(self, x, attn_mask, cache, rope):
        """The blocks on x (B, T, C); with grad_checkpoint (and a gradient to take) only each
        block's input is kept and its activations are recomputed in backward."""
        recompute = self.grad_checkpoint and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, attn_mask, rope=rope,
                                                      use_reentrant=False)
            else:
                x = block(x, attn_mask, cache, i, rope=rope)
        return x

    def embed(self, idx, pos):
        """Token embeddings (B, T, C) plus learned position embeddings; with rotary positions,
        the (cos, sin) of each position's angles (B, 1, T, hs) that attention applies."""
        x = self.wte(idx)
        if self.config.pos == "learned":
            return self.drop(x + self.wpe(pos)), None
        inv_freq = rope_frequencies(self.config, idx.device)               # (hs/2,) float32
        angles = pos[:, None, :, None].float() * inv_freq                  # (B, 1, T, hs/2)
        angles = torch.cat([angles, angles], dim=-1)                       # (B, 1, T, hs)
        return self.drop(x), (angles.cos().to(x.dtype), angles.sin().to(x.dtype))

    def head_weight(self, pad=False):
        """The LM head's weight over the support (V, C), in autocast's dtype where it is on, else
        float32; differentiable. pad: zero rows up to a multiple of 64, so that the logits' rows
        start 16-byte aligned (fast kernels need it; Qwen2.5's 151665 is odd)."""
        w = self.lm_head.weight[:self.config.support]
        w = w.to(operand_dtype(w.device.type))
        return F.pad(w, (0, 0, 0, -w.size(0) % 64)) if pad else w

    def logits(self, x, head=None, fast=False):
        """Logits (..., V) float32 over the support from final hidden states x (..., C): operands
        in autocast's dtype, float32 sums, never rounded (module docstring: Precision). head:
        head_weight(), if made already. fast (no gradient): one bf16 product into float32 where
        torch has it (CUDA), summed in another order; else the rounded operands as float32."""
        w = self.head_weight() if head is None else head
        with autocast_off(x.device.type):
            if fast and w.dtype != torch.float32 and mm_float32_out(x.device):
                out = torch.mm(x.reshape(-1, x.size(-1)).to(w.dtype), w.t(),
                               out_dtype=torch.float32)
                out = out.view(*x.shape[:-1], w.size(0))
            else:
                out = F.linear(x.to(w.dtype).float(), w.float())
        V = self.config.support
        return out[..., :V] if out.size(-1) > V else out                   # head_weight(pad)

    def forward(self, idx, mask=None, cache=None, targets=None, temperature=1.0, fused=None,
                return_hidden=False):
        """Logits (B, T, V) float32: position t predicts token t + 1. With targets (B, Tn): the
        float32 log-probs (B, Tn) of the targets at the last Tn positions (head_logprobs), and
        return_hidden: the final hidden states (B, T, C) they came from too."""
        h = self.hidden(idx, mask, cache)
        if targets is None:
            return self.logits(h)
        logp = self.head_logprobs(h, targets, temperature, fused)
        return (logp, h) if return_hidden else logp

    def head_logprobs(self, h, targets, temperature=1.0, fused=None):
        """log pi(targets) (B, Tn) float32 at `temperature` from hidden states h (B, T, C) whose
        last Tn positions predict targets. fused (default: a support above FUSED_VOCAB): through
        kernels.linear_logprobs, no logits written; else the logits, then kernels.logprobs."""
        Tn = targets.size(1)
        fused = (self.config.support > FUSED_VOCAB and not invariant.active() if fused is None
                 else fused)                              # --batch_invariant: the sampler's path
        if not fused:
            return logprobs(self.logits(h)[:, h.size(1) - Tn:], targets, temperature)
        w = self.head_weight()                                    # (V, C) bfloat16 under autocast
        with autocast_off(h.device.type):                         # float32 sums in the kernel
            return linear_logprobs(h[:, h.size(1) - Tn:].to(w.dtype), w, targets, temperature)


class ScalarGPT(nn.Module):
    """The same backbone with a linear head giving one number per position: a reward model reads
    it at each sequence's last real token (score), a value model at every position (forward)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.backbone = GPT(config)
        self.head = nn.Linear(config.n_embd, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy):
        """A scalar model whose backbone starts as a copy of `policy` (a GPT), its head at 0."""
        model = cls(policy.config)
        model.backbone.load_state_dict(policy.state_dict())
        return model.to(next(policy.parameters()).device)

    def forward(self, idx, mask=None):
        """(B, T) scores, float32."""
        return self.head(self.backbone.hidden(idx, mask)).squeeze(-1).float()

    def score(self, idx, mask):
        """(B,) score at the last real token of each row (padding on either side)."""
        return last_real(self(idx, mask), mask)


# -----------------------------------------------------------------------------
# What the scripts read from a model

def last_real(values, mask):
    """values (B, T) -> (B,) the value at each row's last position where mask is 1."""
    if (mask.sum(1) == 0).any():
        raise ValueError("a row of the mask has no real token: there is nothing to read a score "
                         "from")
    T = mask.size(1)
    last = T - 1 - (mask.flip(1) > 0).float().argmax(1)   # the first 1 from the right
    return values.gather(1, last[:, None]).squeeze(1)


def completion_logits(model, prompt, prompt_mask, tokens, mask):
    """Logits (B, Tn, V) predicting each completion token: prompt (B, Tp) left-padded, tokens
    (B, Tn) right-padded; position Tp-1+t of prompt+completion predicts completion token t."""
    idx = torch.cat([prompt, tokens], dim=1)                               # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return model(idx[:, :-1], attn[:, :-1])[:, prompt.size(1) - 1:]        # (B, Tn, V)


def token_logprobs(model, idx, mask, targets, temperature=1.0, fused=None, return_hidden=False):
    """log pi(targets) (B, Tn) float32 read at the last Tn positions of model(idx, mask), through
    GPT.head_logprobs (also through a DistributedDataParallel wrapper: its forward); return_hidden:
    and the final hidden states (B, T, C)."""
    return model(idx, mask, targets=targets, temperature=temperature, fused=fused,
                 return_hidden=return_hidden)


def completion_logprobs(model, prompt, prompt_mask, tokens, mask, temperature=1.0, fused=None,
                        return_hidden=False):
    """log pi(token_t | prompt, tokens_<t) (B, Tn) float32: completion_logits' positions;
    return_hidden: and completion_hidden's states, the same forward's (sampler.Scored.own)."""
    idx = torch.cat([prompt, tokens], dim=1)                               # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return token_logprobs(model, idx[:, :-1], attn[:, :-1], tokens, temperature, fused,
                          return_hidden)


def completion_hidden(model, prompt, prompt_mask, tokens, mask):
    """Final hidden states (B, Tp+Tn-1, C) of prompt and completion but its last token:
    model.head_logprobs(h, tokens, T) is completion_logprobs, bit for bit, and kl_entropy reads
    the same h: scoring runs each model's forward once."""
    idx = torch.cat([prompt, tokens], dim=1)                               # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return model.hidden(idx[:, :-1], attn[:, :-1])


def kl_entropy(policy, ref, h, h_ref, mask, temperature=1.0, chunk=1024, ref_head=None):
    """The exact KL(pi || ref) over the support and pi's entropy, (B, Tn) float32 each, where
    mask (B, Tn) is 1 (0 elsewhere), from both models' completion_hidden (or their last Tn):
    `chunk` positions' logits at a time, so the [B, T, V] logits (9.3 GiB for 8 Qwen2.5 rows of
    1280) never exist. ref_head: ref.head_weight(pad=True), made already."""
    B, Tn = mask.shape
    real = mask > 0
    hp, hq = h[:, -Tn:][real], h_ref[:, -Tn:][real]                        # (n, C) real only
    kl_t, ent_t = torch.zeros(B, Tn, device=mask.device), torch.zeros(B, Tn, device=mask.device)
    wp = policy.head_weight(pad=True)                                      # made once
    wq = ref.head_weight(pad=True) if ref_head is None else ref_head
    kls, ents = [], []
    for i in range(0, hp.size(0), chunk):
        lp = policy.logits(hp[i:i + chunk], wp, fast=True)                 # (chunk, V) float32
        lq = ref.logits(hq[i:i + chunk], wq, fast=True)
        kls.append(kl(lp, lq, temperature))
        ents.append(entropy(lp, temperature))
    if kls:
        kl_t[real], ent_t[real] = torch.cat(kls), torch.cat(ents)
    return kl_t, ent_t


def scores_at(model, tokens, attn, positions, step_mask):
    """A ScalarGPT's outputs at `positions` (B, S), 0 where step_mask (B, S) is 0: a verifier
    reading its score at each step's last token."""
    r = model(tokens, attn)                                                # (B, T)
    return torch.where(step_mask > 0, r.gather(1, positions), 0.0)         # (B, S)


def masked_mean(x, mask, count=None):
    """Mean of x where mask is 1 -> a 0-dim tensor (0 for an empty mask), selecting rather than
    multiplying (a NaN at a masked position never leaks). count: the denominator when this batch
    is part of a larger one: that one's number of positions, giving this part's share."""
    return torch.where(mask > 0, x, 0.0).sum() / (mask.sum().clamp(min=1) if count is None
                                                   else count)
