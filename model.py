"""
The small transformer every script shares: a nanoGPT-style decoder-only GPT, its tokenizer,
a batched KV-cache sampler, a scalar-head variant for reward and value models, and checkpoints.

Design choices (each one a deliberate simplification, stated so you can change it):
- Learned absolute position embeddings, as GPT-2 and nanoGPT. Positions are counted per row from
  the first real token, so a left-padded prompt sees exactly the positions it would see alone.
- Real checkpoints: GPTConfig's switches (rotary positions, RMSNorm, SwiGLU, grouped-query attention,
  Qwen2's q/k/v biases, an untied head) are what GPT-2, Llama and Qwen2 differ in; `from_pretrained`
  loads a local Hugging Face folder into this one class, `Tokenizer.from_pretrained` its tokenizer.json
  (tests/test_pretrained.py checks both against transformers' own outputs).
- Padding can be on either side. `mask` (B, T) is 1 for real tokens and 0 for padding; a query
  never attends to a padding key, so a row's outputs do not depend on what else is in the batch.
  (A padding query attends to itself only, which keeps softmax rows non-empty; its output is junk
  and never read.)
- Pre-LayerNorm blocks, GELU MLP, causal attention through F.scaled_dot_product_attention,
  output projection tied to the token embedding.
- Tokenizer: tiktoken. The default, "bytes", is built in code (one token per byte, plus
  <|endoftext|> and <|pad|>) so everything works offline; a named tiktoken encoding such as "gpt2"
  works where tiktoken can load it, with <|pad|> appended.
- Precision: the logits are float32, always. On a GPU the scripts run the model under bfloat16
  autocast, but the LM head (`GPT.logits`) runs outside it, on float32 hidden states. A bfloat16
  logit near 20 moves in steps of 0.125 and may round either way depending on the batch shape it
  was computed in, so sampling-time and training-time log-probs of the same tokens would disagree
  with no weight change: a PPO/GRPO ratio that is not 1 at the first update (verl-project/verl#6280;
  MiniMax 2025, arXiv 2506.13585, section 4, made the same fix). Cost, on a GPU only: B*T*V*2 bytes
  more for the logits and a float32 head matmul.
- Large vocabularies: `token_logprobs` goes from hidden states to log-probs through
  kernels.linear_logprobs and never holds the [B, T, V] logits (above FUSED_VOCAB tokens);
  `grad_checkpoint` recomputes each block's activations in backward (the scripts' --grad_checkpoint).
- Sampling: `generate` keeps a KV cache, so each new token costs one position's work, not the
  whole sequence's. With compile=True the per-token step (`GPT.decode_step`) has shapes that never
  change (a preallocated cache, the new key and value written at a slot given as a tensor,
  attention over every slot with the empty ones masked) and runs under torch.compile, as a CUDA
  graph on a GPU: one compiled graph serves every step of every call with the same number of rows
  and of cache slots (the prompt plus max_new_tokens, rounded up to a multiple of 16).

Shapes: B batch, T time, C channels, V vocabulary, nh heads, hs head size.
"""
import contextlib
import json
import math
import os
import unicodedata
from dataclasses import asdict, dataclass, fields

import tiktoken
import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

from kernels import linear_logprobs, logprobs

EOS = "<|endoftext|>"
PAD = "<|pad|>"
FUSED_VOCAB = 8192   # completion_logprobs fuses the LM head and the log-softmax above this vocabulary size


# -----------------------------------------------------------------------------
# Tokenizer

class Tokenizer:
    """tiktoken encoding plus the two special tokens the scripts need (eos_id, pad_id)."""

    def __init__(self, name="bytes"):
        self.normalise = None
        if name.startswith("hf:"):                  # a Hugging Face folder's tokenizer.json (from_pretrained)
            folder = name[3:]
            ranks, pat_str, special, self.normalise = pretrained_tokenizer_parts(folder)
            self.name, self.eos_id, self.pad_id = name, *pretrained_eos_pad(folder, special)
            self.enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(folder)), pat_str=pat_str,
                                         mergeable_ranks=ranks, special_tokens=special)
            self.vocab_size = self.enc.n_vocab
            return
        if name == "bytes":
            ranks = {bytes([i]): i for i in range(256)}  # no merges: one token per byte
            pat_str = r"[\s\S]{1,256}"  # any split works when there are no merges; this one covers all text
            special = {}
        else:
            try:
                base = tiktoken.get_encoding(name)
            except Exception as e:
                raise ValueError(f"tokenizer {name!r} could not be loaded by tiktoken ({type(e).__name__}: {e}); "
                                 f"the default 'bytes' needs no download") from None
            ranks, pat_str, special = base._mergeable_ranks, base._pat_str, dict(base._special_tokens)
        next_id = max([*ranks.values(), *special.values()]) + 1
        for tok in (EOS, PAD):
            if tok not in special:
                special[tok] = next_id
                next_id += 1
        self.name = name
        self.enc = tiktoken.Encoding(name=f"{name}+pad", pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=special)
        self.eos_id, self.pad_id = special[EOS], special[PAD]
        self.vocab_size = self.enc.n_vocab

    @classmethod
    def from_pretrained(cls, folder):
        """The byte-level BPE tokenizer.json of a Hugging Face folder (GPT-2, Llama 3, Qwen2) as a tiktoken Encoding:
        its ranks, its pre-tokenizer's split pattern and its special tokens; EOS and pad from the folder's config."""
        return cls("hf:" + os.path.abspath(folder))

    def encode(self, text):
        """Plain text to ids. Special-token strings in the text are encoded as ordinary text."""
        if self.normalise:
            text = unicodedata.normalize(self.normalise, text)
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")

    def encode_batch(self, texts, device="cpu"):
        """Left-padded batch: tokens (B, T) int64 and mask (B, T) float32, 1 on real tokens."""
        ids = [self.encode(t) for t in texts]
        T = max((len(x) for x in ids), default=0)
        tokens = torch.full((len(ids), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), T)
        for i, x in enumerate(ids):
            if x:
                tokens[i, T - len(x):] = torch.tensor(x)
                mask[i, T - len(x):] = 1.0
        return tokens.to(device), mask.to(device)

    def decode_completions(self, tokens, mask):
        """(B, T) completion tokens and their mask -> B strings, the final EOS dropped."""
        texts = []
        for row, m in zip(tokens.tolist(), mask.tolist()):
            ids = [t for t, keep in zip(row, m) if keep and t != self.eos_id]
            texts.append(self.decode(ids))
        return texts


# -----------------------------------------------------------------------------
# Transformer

@dataclass
class GPTConfig:
    vocab_size: int = 258   # the "bytes" tokenizer: 256 bytes + EOS + PAD
    block_size: int = 64    # longest sequence (prompt + completion, padding excluded)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # The switches real checkpoints need (GPT.from_pretrained sets them); the defaults are nanoGPT's and GPT-2's.
    n_kv_head: int = 0         # key/value heads, grouped-query attention (Llama, Qwen2); 0: n_head
    norm: str = "layernorm"    # "layernorm" (GPT-2) or "rmsnorm" (Llama, Qwen2)
    norm_eps: float = 1e-5
    pos: str = "learned"       # "learned" absolute embeddings (GPT-2) or "rope", rotary (Llama, Qwen2)
    rope_theta: float = 10000.0
    mlp: str = "gelu"          # "gelu" (GPT-2) or "swiglu" (Llama, Qwen2)
    gelu: str = "none"         # nn.GELU's approximate: "none" (nanoGPT) or "tanh" (GPT-2's gelu_new)
    mlp_hidden: int = 0        # the MLP's width; 0: 4 * n_embd
    bias: bool = True          # biases of the attention output and the MLP (GPT-2 has them; Llama, Qwen2 not)
    qkv_bias: bool = True      # biases of the query, key and value projections (GPT-2, Qwen2)
    tie_embeddings: bool = True  # the LM head is the token embedding (GPT-2, small Qwen2 and Llama 3.2)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)}; it must be at least 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd = {self.n_embd} must be divisible by n_head = {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout = {self.dropout}; allowed: 0 <= dropout < 1")
        if self.n_kv_head < 0 or self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"GPTConfig.n_kv_head = {self.n_kv_head} must divide n_head = {self.n_head}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("pos", ("learned", "rope")),
                              ("mlp", ("gelu", "swiglu")), ("gelu", ("none", "tanh"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)!r}; allowed: {', '.join(allowed)}")

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head


class KVCache:
    """Keys and values of every layer for sampling, plus which cached positions are real tokens.

    Used in two ways. Appending (the model's forward with a cache, the eager sampler): each call writes
    its chunk at slot `length` and attention reads the first `length` slots, so shapes grow every step.
    Static (GPT.decode_step, generate(compile=True)): every tensor is allocated up front and keeps its
    shape; a step writes at a slot given as a tensor and attends over all max_len slots, the ones not
    filled yet masked out by key_mask, so one compiled graph serves every step."""

    def __init__(self, n_layer, batch_size, max_len, device):
        self.k = [None] * n_layer        # each (B, nh, max_len, hs), allocated at first use
        self.v = [None] * n_layer
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # position of the next real token
        self.length = 0                  # cached time steps, padding included
        self.max_len = max_len

    @classmethod
    def preallocated(cls, n_layer, batch_size, max_len, n_head, head_size, dtype, device):
        """A static cache: keys and values allocated now, as zeros. An empty slot must hold a finite number:
        its attention weight is exactly 0, and 0 * NaN (what torch.empty may hold) would be NaN."""
        cache = cls(n_layer, batch_size, max_len, device)
        shape = (batch_size, n_head, max_len, head_size)
        cache.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        cache.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        return cache

    def reset(self):
        """Empty the cache for another batch of the same size, in place: the same memory, so a compiled graph (a
        CUDA graph on a GPU) that reads and writes these tensors finds them where it left them."""
        for t in self.tensors():
            t.zero_()
        self.length = 0

    def tensors(self):
        """Every tensor the static decode step reads or writes in place."""
        return [*self.k, *self.v, self.key_mask, self.next_pos]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv = config.n_head, config.kv_heads
        hs = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv) * hs, bias=config.qkv_bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x, attn_mask, cache=None, layer=0, slot=None, rope=None):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split([C, self.n_kv * hs, self.n_kv * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)                  # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv, hs).transpose(1, 2) for t in (k, v))  # (B, nkv, T, hs)
        if rope is not None:                                               # rotary positions (Su et al. 2021)
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None and slot is not None:  # static shapes (GPT.decode_step): write at `slot`, read every slot
            cache.k[layer].index_copy_(2, slot, k)
            cache.v[layer].index_copy_(2, slot, v)
            k, v = cache.k[layer], cache.v[layer]  # (B, nh, max_len, hs)
        elif cache is not None:  # write this chunk's keys and values, then attend over everything cached
            if cache.k[layer] is None:
                shape = (B, self.n_kv, cache.max_len, hs)
                cache.k[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
                cache.v[layer] = torch.empty(shape, dtype=v.dtype, device=v.device)
            start = cache.length
            cache.k[layer][:, :, start:start + T] = k
            cache.v[layer][:, :, start:start + T] = v
            k = cache.k[layer][:, :, :start + T]  # (B, nkv, S, hs)
            v = cache.v[layer][:, :, :start + T]
        if self.n_kv != self.n_head:                                       # grouped-query attention: each key and
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)       # value head serves n_head / n_kv query
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)       # heads (B, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020): c_proj(silu(gate) * up), gate and up from one projection c_fc."""

    def __init__(self, config):
        super().__init__()
        hidden = config.mlp_hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.drop(self.c_proj(F.silu(gate) * up))


def norm(config):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


def rotate(x, cos, sin):
    """Rotary position embedding of x (B, h, T, hs) by the angles of cos, sin (B, 1, T, hs), in the half-split layout
    of Llama's Hugging Face code: channel i pairs with channel i + hs/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


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
                                     nn.Linear(hidden, config.n_embd, bias=config.bias), nn.Dropout(config.dropout))

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
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        # generate(compile=True)'s caches, one per (rows, slots, dtype, device): see static_cache
        self._static_caches = {}
        self.grad_checkpoint = False  # --grad_checkpoint: recompute each block's activations in backward

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def from_pretrained(cls, folder, dtype=torch.float32):
        """A Hugging Face folder's GPT-2, Llama or Qwen2 weights in this class (the function from_pretrained)."""
        return from_pretrained(folder, dtype)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def hidden(self, idx, mask=None, cache=None):
        """Final hidden states (B, T, C). idx (B, T) token ids; mask (B, T) 1 = real token, 0 = padding.
        With a cache, idx is the next chunk (the prompt, then one token at a time) and is appended to it."""
        B, T = idx.shape
        mask = torch.ones(B, T, device=idx.device) if mask is None else mask
        real = mask > 0                                            # (B, T) bool
        start = 0 if cache is None else cache.length
        offset = 0 if cache is None else cache.next_pos[:, None]
        pos = (offset + real.long().cumsum(1) - 1).clamp(min=0)    # (B, T) position of each real token
        if pos.numel() and pos.max() >= self.config.block_size:     # (an empty batch: a rank's empty micro-batch)
            raise ValueError(f"a sequence of {int(pos.max()) + 1} real tokens exceeds block_size = "
                             f"{self.config.block_size}; shorten it or build the model with a larger block_size")
        if cache is None:
            key_mask = real                                        # (B, S) with S = T
        else:
            if start + T > cache.max_len:
                raise ValueError(f"KV cache full: {start} + {T} steps > max_len = {cache.max_len}")
            cache.key_mask[:, start:start + T] = real
            cache.next_pos += real.sum(1)
            key_mask = cache.key_mask[:, :start + T]               # (B, S) with S = start + T
        q_pos = torch.arange(start, start + T, device=idx.device)[:, None]   # (T, 1) time index of each query
        k_pos = torch.arange(start + T, device=idx.device)[None, :]          # (1, S)
        attn_mask = (k_pos <= q_pos) & key_mask[:, None, :]        # (B, T, S): causal and not padding
        attn_mask = (attn_mask | (k_pos == q_pos))[:, None]        # (B, 1, T, S): padding queries see themselves
        x, rope = self.embed(idx, pos)                             # (B, T, C)
        recompute = self.grad_checkpoint and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:   # keep only each block's input; its activations are recomputed in backward
                x = torch.utils.checkpoint.checkpoint(block, x, attn_mask, rope=rope, use_reentrant=False)
            else:
                x = block(x, attn_mask, cache, i, rope=rope)
        if cache is not None:
            cache.length += T
        return self.ln_f(x)

    def embed(self, idx, pos):
        """Token embeddings (B, T, C), plus the learned position embeddings, or with rotary positions the
        (cos, sin) of each position's angles (B, 1, T, hs) that attention applies to queries and keys."""
        x = self.wte(idx)
        if self.config.pos == "learned":
            return self.drop(x + self.wpe(pos)), None
        hs = self.config.n_embd // self.config.n_head
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, hs, 2, device=idx.device).float() / hs)
        with autocast_off(idx.device.type):
            angles = pos[:, None, :, None].float() * inv_freq                    # (B, 1, T, hs/2)
        angles = torch.cat([angles, angles], dim=-1)                             # (B, 1, T, hs)
        return self.drop(x), (angles.cos().to(x.dtype), angles.sin().to(x.dtype))

    def logits(self, x):
        """Logits (..., V) float32 from final hidden states x (..., C): the LM head runs outside autocast, on x in
        float32, so that the logits never carry bfloat16 rounding (module docstring: Precision)."""
        with autocast_off(x.device.type):
            return F.linear(x.float(), self.lm_head.weight.float())

    def forward(self, idx, mask=None, cache=None, targets=None, temperature=1.0):
        """Logits (B, T, V) float32: position t predicts token t + 1. With targets (B, Tn): instead, the float32
        log-probs (B, Tn) of the targets at the last Tn positions, from the hidden states and the LM head's weight
        through kernels.linear_logprobs, which never writes the logits (the fused path, for a large V)."""
        h = self.hidden(idx, mask, cache)
        if targets is None:
            return self.logits(h)
        with autocast_off(h.device.type):                          # float32, as self.logits
            return linear_logprobs(h[:, h.size(1) - targets.size(1):].float(), self.lm_head.weight.float(), targets,
                                   temperature)

    def decode_step(self, idx, cache, slot):
        """The sampler's per-token step with shapes that never change, for torch.compile (generate(compile=True)).

        idx (N, 1) each row's newest token (all real); cache a static KVCache (KVCache.preallocated) holding
        everything before it; slot (1,) int64, the cache slot it goes to (the same for every row). Writes its
        keys and values at `slot`, attends over all max_len slots with the empty ones masked out, and returns
        the logits (N, V) float32 of the token after it; marks the slot real and advances each row's position.
        The same computation as self(idx, ones, cache)[:, -1] on an appending cache, except that attention
        sums over max_len slots instead of the filled ones: the extra terms are exactly 0, but the sums may be
        ordered differently. The caller advances slot and checks block_size (the positions live on the device)."""
        cache.key_mask.index_fill_(1, slot, True)                  # (N, L) the new token is real in every row
        x, rope = self.embed(idx, cache.next_pos[:, None])         # (N, 1, C)
        attn_mask = cache.key_mask[:, None, None, :]               # (N, 1, 1, L) every filled slot, no later one
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, cache, i, slot, rope)
        cache.next_pos.add_(1)
        return self.logits(self.ln_f(x))[:, -1]                    # (N, V)

    def static_cache(self, batch_size, max_len, device):
        """generate(compile=True)'s cache for batch_size rows and max_len slots, emptied. It is kept on the model and
        reused by every later call with the same shape, dtype and device, so the compiled step (and on a GPU its
        CUDA graph, which reads and writes these tensors in place) is reused as it is, without re-recording. Memory
        held: 2 * n_layer * batch_size * max_len * n_embd numbers per shape in use."""
        device = torch.device(device)
        autocast = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else self.wte.weight.dtype  # what c_attn returns
        key = (batch_size, max_len, dtype, device)
        if key not in self._static_caches:
            c = self.config
            cache = KVCache.preallocated(c.n_layer, batch_size, max_len, c.kv_heads, c.n_embd // c.n_head, dtype,
                                         device)
            if device.type == "cuda":                              # CUDA graphs may write into these in place
                for t in cache.tensors():
                    torch._dynamo.mark_static_address(t)
            self._static_caches[key] = cache
        cache = self._static_caches[key]
        cache.reset()
        return cache

    @torch.no_grad()
    def generate(self, prompt, prompt_mask, max_new_tokens, eos_id, pad_id=None, num_samples=1,
                 temperature=1.0, top_k=None, generator=None, compile=None, return_logprobs=False):
        """Sample completions with a KV cache.

        prompt (B, Tp) left-padded token ids, prompt_mask (B, Tp) 1 on real tokens.
        Each prompt gets num_samples completions on consecutive rows (prompt i -> rows i*G .. i*G+G-1).
        temperature 0 means greedy. top_k keeps the k most likely tokens (None: the full softmax,
        which RL needs so that sampling matches the log-probs it trains on).
        compile=True runs each new token through decode_step under torch.compile (compiled_decode_step: a
        CUDA graph on a GPU; None, the default, reads the model's compile_sampler attribute, which the
        scripts' --compile sets) on a static cache kept on the model (static_cache); the prompt still goes
        through the eager forward. The first call of each batch size compiles (tens of seconds); the draws from
        `generator` are the same as without it, so the tokens are identical unless a compiled logit differs
        from the eager one in its last bits exactly where that decides a token (a near-tie for greedy, a draw
        on a boundary of the sampling distribution; under bfloat16 autocast, bfloat16 rounding). In train mode
        with dropout the two differ (dropout draws its own random numbers in a compiled graph); the scripts
        sample in eval mode.
        Returns tokens (B*G, Tn) with pad_id after each EOS, mask (B*G, Tn) float (1.0 on tokens
        through the first EOS, 0 after), and truncated (B*G,) bool (no EOS within max_new_tokens).
        Tn <= max_new_tokens: sampling stops once every row has ended. return_logprobs=True (temperature > 0) also
        returns the sampler's own log-probs of the sampled tokens (B*G, Tn) float32, log softmax(logits / T)
        [token] as this loop computed it (0 after EOS): the behaviour policy's, as an inference engine reports it.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}; it must be at least 1")
        if temperature < 0:
            raise ValueError(f"temperature = {temperature}; it must be >= 0 (0 = greedy)")
        pad_id = eos_id if pad_id is None else pad_id
        if compile is None:   # the model's default: the scripts' --compile sets policy.compile_sampler
            compile = getattr(self, "compile_sampler", False)
        idx = prompt.repeat_interleave(num_samples, dim=0)              # (B*G, Tp)
        idx_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
        N = idx.size(0)
        if compile:   # slots rounded up to a multiple of 16, so that prompts a little longer or shorter share a graph
            cache = self.static_cache(N, -(-(idx.size(1) + max_new_tokens) // 16) * 16, idx.device)
            step = compiled_decode_step(idx.device.type)
            slot = torch.full((1,), idx.size(1), dtype=torch.long, device=idx.device)  # the slot of token 0
            longest = int(idx_mask.sum(1).max())                        # real tokens in the longest prompt
        else:
            cache = KVCache(self.config.n_layer, N, idx.size(1) + max_new_tokens, idx.device)
        logits = self(idx, idx_mask, cache)[:, -1, :]                   # (N, V) predicts the first new token
        tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=idx.device)
        mask = torch.zeros(N, max_new_tokens, device=idx.device)
        sampled_logp = torch.zeros(N, max_new_tokens, device=idx.device)
        done = torch.zeros(N, dtype=torch.bool, device=idx.device)
        for t in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1)                                 # (N,)
            else:
                logits = logits.float() / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
                if return_logprobs:
                    step_logp = F.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)   # (N,)
                    sampled_logp[:, t] = torch.where(done, 0.0, step_logp)
            tokens[:, t] = torch.where(done, pad_id, nxt)
            mask[:, t] = (~done).float()
            done = done | (nxt == eos_id)
            if done.all() or t == max_new_tokens - 1:
                break
            if compile:
                if longest + t + 1 > self.config.block_size:            # the eager forward's check, on the host
                    raise ValueError(f"a sequence of {longest + t + 1} real tokens exceeds block_size = "
                                     f"{self.config.block_size}; shorten it or build the model with a larger "
                                     f"block_size")
                if idx.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()          # the last step's output may be overwritten
                logits = step(self, tokens[:, t:t + 1].clone(memory_format=torch.contiguous_format), cache, slot)
                slot = slot + 1
            else:
                logits = self(tokens[:, t:t + 1], torch.ones(N, 1, device=idx.device), cache)[:, -1, :]
        if return_logprobs:
            return tokens[:, :t + 1], mask[:, :t + 1], ~done, sampled_logp[:, :t + 1]
        return tokens[:, :t + 1], mask[:, :t + 1], ~done


_compiled_steps = {}  # device type -> GPT.decode_step under torch.compile, made at first use, shared by every model


def compiled_decode_step(device_type):
    """GPT.decode_step under torch.compile, one per process and device type, called as step(model, idx, cache, slot).
    One graph per shape (dynamic=False: a new batch size compiles anew), no graph breaks (fullgraph); on CUDA, mode
    "reduce-overhead" also records each graph as a CUDA graph, so a step is one launch instead of one per kernel."""
    if device_type not in _compiled_steps:
        mode = "reduce-overhead" if device_type == "cuda" else None
        compiled = torch.compile(GPT.decode_step, dynamic=False, fullgraph=True, mode=mode)
        _compiled_steps[device_type] = with_eager_fallback(compiled)
    return _compiled_steps[device_type]


def with_eager_fallback(compiled):
    """The compiled step, run eagerly (the same function, the same static cache) for a shape past torch.compile's
    recompile limit (8 graphs): with fullgraph=True the ninth distinct shape would raise instead of falling back."""
    def step(model, idx, cache, slot):
        try:
            return compiled(model, idx, cache, slot)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            return GPT.decode_step(model, idx, cache, slot)
    return step


def autocast_off(device_type):
    """A context with autocast off on `device_type`, so that what runs inside computes in the tensors' own dtype
    (nothing to switch off where this torch has no autocast for the device)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class ScalarGPT(nn.Module):
    """The same backbone with a linear head giving one number per position.
    Reward model: `score` reads it at each sequence's last real token. Value model: `forward`, every position."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.backbone = GPT(config)
        self.head = nn.Linear(config.n_embd, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy):
        """A scalar model whose backbone starts as a copy of `policy` (a GPT) and whose head starts at 0."""
        model = cls(policy.config)
        model.backbone.load_state_dict(policy.state_dict())
        return model.to(next(policy.parameters()).device)

    def forward(self, idx, mask=None):
        """(B, T) scores, float32."""
        return self.head(self.backbone.hidden(idx, mask)).squeeze(-1).float()

    def score(self, idx, mask):
        """(B,) score at the last real token of each row (padding on either side)."""
        return last_real(self(idx, mask), mask)


def last_real(values, mask):
    """values (B, T) -> (B,) the value at each row's last position where mask is 1."""
    if (mask.sum(1) == 0).any():
        raise ValueError("a row of the mask has no real token: there is nothing to read a score from")
    T = mask.size(1)
    last = T - 1 - (mask.flip(1) > 0).float().argmax(1)  # argmax finds the first 1 from the right
    return values.gather(1, last[:, None]).squeeze(1)


def completion_logits(model, prompt, prompt_mask, tokens, mask):
    """Logits (B, Tn, V) predicting each completion token under `model`, for scoring what `generate`
    sampled. prompt (B, Tp) left-padded, tokens (B, Tn) right-padded, masks 1.0 on real tokens:
    position Tp-1+t of prompt+completion predicts completion token t."""
    idx = torch.cat([prompt, tokens], dim=1)                           # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return model(idx[:, :-1], attn[:, :-1])[:, prompt.size(1) - 1:]    # (B, Tn, V)


def token_logprobs(model, idx, mask, targets, temperature=1.0, fused=None):
    """log pi(targets) (B, Tn) float32 at `temperature`, read at the last Tn positions of model(idx, mask): as
    logprobs(model(idx, mask)[:, -Tn:], targets). fused (default: a vocabulary above FUSED_VOCAB) takes the LM head
    and the log-softmax in one kernel and never holds the (B, Tn, V) logits: what lets a real checkpoint's
    V = 151936 train (README: A real model on one GPU)."""
    config = getattr(model, "module", model).config                   # through DistributedDataParallel too
    if config.vocab_size > FUSED_VOCAB if fused is None else fused:
        return model(idx, mask, targets=targets, temperature=temperature)
    return logprobs(model(idx, mask)[:, idx.size(1) - targets.size(1):], targets, temperature)


def completion_logprobs(model, prompt, prompt_mask, tokens, mask, temperature=1.0, fused=None):
    """log pi(token_t | prompt, tokens_<t) (B, Tn) float32: token_logprobs of the completion (completion_logits'
    positions)."""
    idx = torch.cat([prompt, tokens], dim=1)                           # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return token_logprobs(model, idx[:, :-1], attn[:, :-1], tokens, temperature, fused)   # (B, Tn)


def left_pad(seqs, pad_id, device="cpu"):
    """Token-id lists -> left-padded tokens (B, T) and mask (B, T), as generate takes its prompts."""
    T = max(len(s) for s in seqs)
    tokens = torch.tensor([[pad_id] * (T - len(s)) + list(s) for s in seqs], dtype=torch.long, device=device)
    mask = torch.tensor([[0.0] * (T - len(s)) + [1.0] * len(s) for s in seqs], device=device)
    return tokens, mask


def pad_steps(rows, fill=0.0, dtype=torch.float32, device="cpu"):
    """Lists of per-step values -> (B, S) tensor padded with `fill`, and the (B, S) step mask (S >= 1)."""
    S = max(1, max(len(r) for r in rows))
    values = torch.tensor([list(r) + [fill] * (S - len(r)) for r in rows], dtype=dtype, device=device)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (S - len(r)) for r in rows], device=device)
    return values, mask


def scores_at(model, tokens, attn, positions, step_mask):
    """A ScalarGPT's output at given positions: tokens, attn (B, T); positions, step_mask (B, S) -> (B, S), 0 where
    the step mask is 0 (a verifier reading its score at each step's last token)."""
    r = model(tokens, attn)                                            # (B, T) one score per position
    return torch.where(step_mask > 0, r.gather(1, positions), 0.0)    # (B, S)


def masked_mean(x, mask, count=None):
    """Mean of x over the positions where mask is 1 -> a 0-dim tensor (0 when the mask is empty).
    Selects with the mask rather than multiplying by it, so a NaN or inf at a masked position never leaks.
    count: the denominator when this batch is one part of a larger one (a micro-batch, or one process's share):
    the larger batch's number of positions where the mask is 1; the result is then this part's share of its mean."""
    return torch.where(mask > 0, x, 0.0).sum() / (mask.sum().clamp(min=1) if count is None else count)


def fingerprint(model):
    """A number that changes when any weight changes (the float64 sum of every parameter, on the CPU)."""
    return sum(p.detach().cpu().double().sum().item() for p in model.parameters())


# -----------------------------------------------------------------------------
# Checkpoints: one dict, written atomically

class CheckpointError(RuntimeError):
    pass


def save_checkpoint(path, model, tokenizer_name, optimizer=None, step=0, args=None, **extra):
    """Write {model, kind, config, tokenizer, optimizer, step, args, ...} to `path` via a temp file and a rename,
    so a crash mid-write never leaves a half-written checkpoint under the real name."""
    ckpt = {
        "model": model.state_dict(),
        "kind": "scalar" if isinstance(model, ScalarGPT) else "gpt",
        "config": asdict(model.config),
        "tokenizer": tokenizer_name,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "step": step,
        "args": vars(args) if hasattr(args, "__dict__") else args,
        **extra,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)  # atomic on POSIX and Windows


def load_checkpoint(path, device="cpu", kind=None, tokenizer=None):
    """Read a checkpoint and rebuild its model. Returns (model, ckpt).
    kind: "gpt" or "scalar" to insist on one; tokenizer: a Tokenizer the checkpoint must match."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read, it is truncated or corrupt "
                              f"({type(e).__name__}: {str(e)[:200]}); delete it and re-run the script that wrote "
                              f"it") from None
    keys = ("model", "kind", "config", "tokenizer", "step")
    missing = [key for key in keys if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not one of this project's checkpoints: it lacks {missing}")
    if kind is not None and ckpt["kind"] != kind:
        raise CheckpointError(f"checkpoint {path} holds a {ckpt['kind']!r} model; a {kind!r} model is needed here")
    known = {f.name for f in fields(GPTConfig)}
    if set(ckpt["config"]) - known:
        raise CheckpointError(f"checkpoint {path} has unknown config fields {sorted(set(ckpt['config']) - known)}")
    config = GPTConfig(**ckpt["config"])
    if tokenizer is not None and (tokenizer.name != ckpt["tokenizer"] or tokenizer.vocab_size != config.vocab_size):
        raise CheckpointError(f"vocabulary mismatch: checkpoint {path} was trained with tokenizer "
                              f"{ckpt['tokenizer']!r} "
                              f"(vocab_size {config.vocab_size}), but tokenizer {tokenizer.name!r} "
                              f"(vocab_size {tokenizer.vocab_size}) is in use")
    model = ScalarGPT(config) if ckpt["kind"] == "scalar" else GPT(config)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path}: weights do not match its config ({str(e)[:300]})") from None
    return model.to(device), ckpt


# -----------------------------------------------------------------------------
# Real checkpoints: a local folder in the Hugging Face layout (config.json, model.safetensors or its shards,
# tokenizer.json), as a user has it after downloading one. Nothing is fetched.

def is_pretrained_folder(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def pretrained_config(folder):
    """GPTConfig for a folder's config.json (model_type gpt2, llama or qwen2); anything else is one error line."""
    c = _read_json(os.path.join(folder, "config.json"))
    kind = c.get("model_type")
    if kind == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise CheckpointError(f"{folder}: activation_function {c['activation_function']!r} is not supported")
        return GPTConfig(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"], norm_eps=c.get("layer_norm_epsilon", 1e-5),
                         gelu="none" if c.get("activation_function") == "gelu" else "tanh",
                         mlp_hidden=c.get("n_inner") or 0, tie_embeddings=c.get("tie_word_embeddings", True))
    if kind in ("llama", "qwen2"):
        rope = c.get("rope_parameters") or {}                          # transformers 5 writes rope_parameters
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        unsupported = {"rope_scaling": scaling, "hidden_act": c.get("hidden_act", "silu"),
                       "use_sliding_window": c.get("use_sliding_window", False),
                       "head_dim": c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])}
        allowed = {"rope_scaling": None, "hidden_act": "silu", "use_sliding_window": False,
                   "head_dim": c["hidden_size"] // c["num_attention_heads"]}
        for key, value in unsupported.items():
            if value != allowed[key]:
                raise CheckpointError(f"{folder}: config.json {key} = {value!r} is not supported (only "
                                      f"{allowed[key]!r})")
        attn_bias = True if kind == "qwen2" else c.get("attention_bias", False)
        return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
                         n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"], n_embd=c["hidden_size"],
                         n_kv_head=c.get("num_key_value_heads") or c["num_attention_heads"], norm="rmsnorm",
                         norm_eps=c["rms_norm_eps"], pos="rope",
                         rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                         mlp="swiglu", mlp_hidden=c["intermediate_size"], bias=c.get("mlp_bias", False),
                         qkv_bias=attn_bias, tie_embeddings=c.get("tie_word_embeddings", False))
    raise CheckpointError(f"{folder}: model_type {kind!r} is not supported; allowed: gpt2, llama, qwen2")


def _read_safetensors(folder):
    """Every tensor of the folder's model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors.torch import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    files = (sorted(set(_read_json(index)["weight_map"].values())) if os.path.isfile(index)
             else ["model.safetensors"])
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{folder}: {name} is missing (only safetensors weights are read)")
        try:
            tensors.update(load_file(path))
        except Exception as e:
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {str(e)[:200]})") from None
    return tensors


def _our_names(hf, config):
    """Hugging Face tensors -> {our parameter name: tensor}, and the names of theirs it used. GPT-2's Conv1D weights
    are stored (in, out) and are transposed; Llama's q, k, v (and gate, up) projections are concatenated into our
    c_attn (and c_fc)."""
    ours, used = {}, set()

    def take(name):
        if name not in hf:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        used.add(name)
        return hf[name]

    if config.pos == "learned":                                        # gpt2; keys with or without "transformer."
        hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
        ours["wte.weight"], ours["wpe.weight"] = take("wte.weight"), take("wpe.weight")
        for i in range(config.n_layer):
            p, q = f"h.{i}.", f"blocks.{i}."
            for theirs, mine, conv in (("ln_1", "ln_1", False), ("ln_2", "ln_2", False), ("attn.c_attn", "attn.c_attn",
                                       True), ("attn.c_proj", "attn.c_proj", True), ("mlp.c_fc", "mlp.0", True),
                                       ("mlp.c_proj", "mlp.2", True)):
                weight = take(p + theirs + ".weight")
                ours[q + mine + ".weight"] = weight.t() if conv else weight
                ours[q + mine + ".bias"] = take(p + theirs + ".bias")
            used.update(k for k in hf if k.startswith(p) and k.endswith(("attn.bias", "attn.masked_bias")))  # buffers
        ours["ln_f.weight"], ours["ln_f.bias"] = take("ln_f.weight"), take("ln_f.bias")
    else:                                                              # llama, qwen2
        ours["wte.weight"] = take("model.embed_tokens.weight")
        for i in range(config.n_layer):
            p, q = f"model.layers.{i}.", f"blocks.{i}."
            ours[q + "ln_1.weight"] = take(p + "input_layernorm.weight")
            ours[q + "ln_2.weight"] = take(p + "post_attention_layernorm.weight")
            ours[q + "attn.c_attn.weight"] = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            if config.qkv_bias:
                ours[q + "attn.c_attn.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            ours[q + "attn.c_proj.weight"] = take(p + "self_attn.o_proj.weight")
            ours[q + "mlp.c_fc.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            ours[q + "mlp.c_proj.weight"] = take(p + "mlp.down_proj.weight")
            if config.bias:
                ours[q + "attn.c_proj.bias"] = take(p + "self_attn.o_proj.bias")
                ours[q + "mlp.c_fc.bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
                ours[q + "mlp.c_proj.bias"] = take(p + "mlp.down_proj.bias")
        ours["ln_f.weight"] = take("model.norm.weight")
    if config.tie_embeddings:
        if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], ours["wte.weight"]):
            raise CheckpointError("tensor lm_head.weight differs from the token embedding, but the config ties them")
        used.add("lm_head.weight")
    else:
        ours["lm_head.weight"] = take("lm_head.weight")
    return ours, used


def from_pretrained(folder, dtype=torch.float32):
    """Our GPT with the weights of a Hugging Face folder (model_type gpt2, llama or qwen2), in eval mode, in `dtype`
    (float32 by default, as this project trains; None: the checkpoint's own). A missing, mis-shaped or unused tensor
    is one error line naming it."""
    config = pretrained_config(folder)
    hf = _read_safetensors(folder)
    ours, used = _our_names(hf, config)
    unused = sorted(set(hf) - used - {"transformer." + k for k in used})
    if unused:
        raise CheckpointError(f"{folder}: tensor {unused[0]} is not used by a {config.pos}-position model "
                              f"({len(unused)} unused)")
    model = GPT(config)
    expected = model.state_dict()
    for name, tensor in ours.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{folder}: tensor for {name} has shape {tuple(tensor.shape)}; the config needs "
                                  f"{tuple(expected[name].shape)}")
    dtype = dtype or next(iter(hf.values())).dtype
    missing = [n for n in expected if n not in ours and not (n == "lm_head.weight" and config.tie_embeddings)]
    if missing:
        raise CheckpointError(f"{folder}: no tensor for {missing[0]}")
    model.load_state_dict({**ours, **({"lm_head.weight": ours["wte.weight"]} if config.tie_embeddings else {})})
    return model.to(dtype).eval()


def bytes_to_unicode():
    """GPT-2's byte-level BPE alphabet (Radford et al. 2019): byte b -> the printable character standing for it in
    tokenizer.json. The printable bytes stand for themselves; the others map to 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def pretrained_tokenizer_parts(folder):
    """(mergeable ranks, split pattern, special tokens, normalise) of a folder's byte-level BPE tokenizer.json."""
    data = _read_json(os.path.join(folder, "tokenizer.json"))
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(f"{folder}: tokenizer.json model type {model.get('type')!r}; only byte-level BPE")
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    try:
        ranks = {bytes(to_byte[ch] for ch in token): i for token, i in model["vocab"].items()}
    except KeyError:
        raise CheckpointError(f"{folder}: tokenizer.json is not byte-level (a vocabulary entry outside GPT-2's "
                              f"byte alphabet)") from None
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    splits = [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    if splits:
        pattern = splits[0]
    elif any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        pattern = GPT2_SPLIT
    else:
        raise CheckpointError(f"{folder}: tokenizer.json pre-tokenizer {pre.get('type')!r} is not supported")
    normaliser = (data.get("normalizer") or {}).get("type")
    if normaliser not in (None, "NFC"):
        raise CheckpointError(f"{folder}: tokenizer.json normalizer {normaliser!r} is not supported (none or NFC)")
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    return ranks, pattern, special, normaliser


def pretrained_eos_pad(folder, special):
    """(eos_id, pad_id): EOS from config.json (or generation_config.json), the pad token from tokenizer_config.json
    where it names one, else EOS (padding is masked out everywhere here, so any id serves)."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if eos is None and os.path.isfile(path):
            eos = _read_json(path).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if not isinstance(eos, int):
        raise CheckpointError(f"{folder}: no eos_token_id in config.json or generation_config.json")
    pad = eos
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        token = _read_json(path).get("pad_token")
        token = token.get("content") if isinstance(token, dict) else token
        pad = special.get(token, eos)
    return eos, pad
