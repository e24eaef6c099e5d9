"""
The small transformer every script shares: a nanoGPT-style decoder-only GPT, its tokenizer, a KV cache, a
scalar-head variant for reward and value models, and checkpoints. Sampling lives beside it, in sampler.py.

Design choices (each one a deliberate simplification, stated so you can change it):
- Learned absolute position embeddings, as GPT-2 and nanoGPT. Positions are counted per row from the first real
  token, so a left-padded prompt sees exactly the positions it would see alone.
- Real checkpoints: GPTConfig's switches (rotary positions, RMSNorm, SwiGLU, grouped-query attention, Qwen2's
  q/k/v biases, an untied head) are what GPT-2, Llama and Qwen2 differ in; `from_pretrained` loads a local Hugging
  Face folder into this one class, `Tokenizer.from_pretrained` its tokenizer.json (tests/test_pretrained.py checks
  both against transformers' own outputs). The model's distribution is over the tokenizer's ids only
  (GPTConfig.tokenizer_vocab): an embedding row past them is never sampled and never in a log-prob, KL or entropy.
- Padding can be on either side. `mask` (B, T) is 1 for real tokens and 0 for padding; a query never attends to a
  padding key, so a row's outputs do not depend on what else is in the batch. On a GPU, training and scoring move
  each row's real tokens to its front and run plain causal attention (flash attention, no mask); elsewhere, and with
  a KV cache, an explicit mask (a padding query attends to itself only; its output is junk and never read).
- Pre-LayerNorm blocks, GELU MLP, causal attention through F.scaled_dot_product_attention, output projection tied
  to the token embedding.
- Tokenizer: tiktoken. The default, "bytes", is built in code (one token per byte, plus <|endoftext|> and <|pad|>)
  so everything works offline; a named tiktoken encoding such as "gpt2" works where tiktoken can load it.
- Precision: the logits are float32, never rounded to bfloat16. On a GPU the scripts run the model under bfloat16
  autocast, and the LM head multiplies bfloat16 operands into float32 sums, on tensor cores like every other
  product. A bfloat16 logit near 20 moves in steps of 0.125 and may round either way depending on the batch shape
  it was computed in, so sampling-time and training-time log-probs of the same tokens would disagree with no weight
  change (verl-project/verl#6280; MiniMax 2025, arXiv 2506.13585, section 4, keep the whole head in float32 for
  it). A rounded operand is the same number whatever the batch; scoring and training reach the log-probs through
  one function (GPT.head_logprobs), so the first ratio is exactly 1 without a float32 product on the hot path.
- Large vocabularies: `head_logprobs` goes from hidden states to log-probs through kernels.linear_logprobs and
  never holds the [B, T, V] logits (above FUSED_VOCAB tokens); `kl_entropy` reads them a chunk at a time;
  `grad_checkpoint` recomputes each block's activations in backward (the scripts' --grad_checkpoint).

Shapes: B batch, T time, C channels, V vocabulary (the support), nh heads, nkv key/value heads, hs head size.
"""
import contextlib
import hashlib
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

from kernels import entropy, kl, linear_logprobs, logprobs

EOS = "<|endoftext|>"
PAD = "<|pad|>"
FUSED_VOCAB = 8192   # completion_logprobs fuses the LM head and the log-softmax above this vocabulary size


# -----------------------------------------------------------------------------
# Tokenizer

class Tokenizer:
    """tiktoken encoding plus the special tokens the scripts need: eos_id (what ends a demonstration), stop_ids (every
    id that ends a completion, eos_id first), pad_id; and how a prompt is encoded (encode_prompt): after the folder's
    BOS, or through its chat template (use_chat, --chat)."""

    def __init__(self, name="bytes"):
        self.normalise, self.bos_prefix, self.template, self.chat = None, [], None, None
        self.files = None                           # a folder's tokenizer files: {name: sha256} (tokenizer_files)
        if name.startswith("hf:"):                  # a Hugging Face folder's tokenizer.json (from_pretrained)
            folder = name[3:]
            ranks, pat_str, special, self.normalise, self.bos_prefix, marked = pretrained_tokenizer_parts(folder)
            self.name, self.eos_id, self.pad_id = name, *pretrained_eos_pad(folder, special)
            try:
                self.enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(folder)), pat_str=pat_str,
                                             mergeable_ranks=ranks, special_tokens=special)
            except Exception as e:                                  # e.g. a split pattern that does not compile
                raise CheckpointError(f"{folder}: tokenizer.json cannot be read as a tokenizer ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())[:200]})") from None
            self.vocab_size = self.enc.n_vocab
            self.stop_ids = pretrained_stop_ids(folder, self.eos_id)
            for i in self.stop_ids:
                if not 0 <= i < self.vocab_size:                        # every completion would run to its limit
                    raise CheckpointError(f"{folder}: eos_token_id {i} is not an id of its tokenizer "
                                          f"(0 to {self.vocab_size - 1})")
            self.template = pretrained_chat_template(folder, special, marked)   # (source, added, special, variables)
            self.files = tokenizer_files(folder)
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
        self.stop_ids = (self.eos_id,)
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

    def encode_special(self, text):
        """Text to ids with the tokenizer's added tokens (<|im_start|>, ...) recognised as their ids."""
        if self.normalise:
            text = unicodedata.normalize(self.normalise, text)
        return self.enc.encode(text, allowed_special="all")

    def encode_prompt(self, text):
        """A prompt's ids: through the chat template as the user's message (use_chat), else the text after the BOS the
        folder's tokenizer.json puts before a text (Llama 3's <|begin_of_text|>; none for GPT-2, Qwen, "bytes")."""
        if self.chat is not None:
            return self.chat.encode([{"role": "user", "content": text}], self.encode_special, self.encode)
        return self.bos_prefix + self.encode(text)

    def use_chat(self, date=None):
        """--chat: every prompt from now on through the folder's chat template (chat.py); the end of an assistant turn
        the template writes (<|im_end|>, <|eot_id|>) becomes eos_id, appended to demonstrations, and a stop id.
        date: the day strftime_now writes (an ISO date; None: today), fixed for a run and kept in its checkpoint."""
        if self.template is None:
            raise CheckpointError(f"--chat: tokenizer {self.name.removeprefix('hf:')!r} has no chat template (a "
                                  f"Hugging Face folder's chat_template.jinja or tokenizer_config.json "
                                  f"chat_template); run without --chat")
        from chat import ChatTemplate, ChatTemplateError
        try:
            self.chat = ChatTemplate(*self.template, date=date)
            self.chat.check()                                       # a template that fails fails now, in one line
            end = self.chat.end_of_turn()
            self.encode_prompt("")
        except ChatTemplateError as e:
            self.chat = None
            raise CheckpointError(f"--chat: {self.name.removeprefix('hf:')}: {e}") from None
        if end is not None:
            self.eos_id = self.template[1][end]
            self.stop_ids = (self.eos_id, *[i for i in self.stop_ids if i != self.eos_id])
        return self

    @property
    def added_ids(self):
        """The ids of the added tokens (<|endoftext|>, <|pad|>; a folder's <|im_start|>, <tool_call>, ...)."""
        return frozenset(self.enc._special_tokens.values())

    def decode(self, ids):
        """Ids to text. An id this tokenizer does not have (an embedding row past its vocabulary, a negative id) reads
        as U+FFFD, as undecodable bytes do: decoding never raises on what a model can emit."""
        ids = list(ids)
        try:
            return self.enc.decode(ids, errors="replace")
        except (KeyError, ValueError, OverflowError, TypeError):    # tiktoken refuses an id it does not have
            known = {*self.enc._mergeable_ranks.values(), *self.enc._special_tokens.values()}
            pieces, run = [], []
            for i in ids:
                if i in known:
                    run.append(i)
                else:
                    pieces += [self.enc.decode_bytes(run), "\ufffd".encode()]
                    run = []
            return b"".join([*pieces, self.enc.decode_bytes(run)]).decode("utf-8", errors="replace")

    def encode_batch(self, texts, device="cpu"):
        """Left-padded batch of prompts (encode_prompt): tokens (B, T) int64 and mask (B, T) float32, 1 on real
        tokens."""
        ids = [self.encode_prompt(t) for t in texts]
        T = max((len(x) for x in ids), default=0)
        tokens = torch.full((len(ids), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), T)
        for i, x in enumerate(ids):
            if x:
                tokens[i, T - len(x):] = torch.tensor(x)
                mask[i, T - len(x):] = 1.0
        return tokens.to(device), mask.to(device)

    def decode_completions(self, tokens, mask):
        """(B, T) completion tokens and their mask -> B strings, the stop token that ended each dropped."""
        texts = []
        for row, m in zip(tokens.tolist(), mask.tolist()):
            ids = [t for t, keep in zip(row, m) if keep and t not in self.stop_ids]
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
    o_bias: bool = None        # the attention output projection's bias; None: as `bias` (Llama: attention_bias)
    head_dim: int = 0          # each head's width; 0: n_embd // n_head (Qwen3 sets it apart: 128 at width 1024)
    qk_norm: bool = False      # RMSNorm over each head's queries and keys before the rotation (Qwen3)
    # Llama 3.1's scaling of the rotary frequencies ("llama3"; "none": plain RoPE): wavelengths above
    # rope_original_max / rope_low_freq_factor are stretched rope_factor times, those below rope_original_max /
    # rope_high_freq_factor kept, the ones between interpolated (rope_frequencies).
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max: int = 8192
    tie_embeddings: bool = True  # the LM head is the token embedding (GPT-2, small Qwen2)
    # The ids the tokenizer has, the first tokenizer_vocab rows of the embedding (0: all vocab_size). A real
    # checkpoint's embedding may be padded past its tokenizer (Qwen2.5: 151936 rows, 151665 tokens): the model's
    # distribution is over the tokenizer's ids only, so that nothing undecodable is ever sampled and the trainer's
    # log-probs, KL and entropy are over exactly the ids the sampler draws from.
    tokenizer_vocab: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)}; it must be at least 1")
        if self.n_embd % self.n_head and not self.head_dim:
            raise ValueError(f"GPTConfig.n_embd = {self.n_embd} must be divisible by n_head = {self.n_head}")
        if self.head_dim < 0 or self.head_dim % 2:
            raise ValueError(f"GPTConfig.head_dim = {self.head_dim}; allowed: 0 (n_embd // n_head) or an even width")
        if self.rope_scaling == "llama3" and not (self.rope_factor >= 1 and 0 < self.rope_low_freq_factor
                                                  < self.rope_high_freq_factor and self.rope_original_max > 0):
            raise ValueError(f"GPTConfig's llama3 rope scaling needs factor >= 1, 0 < low_freq_factor < "
                             f"high_freq_factor and original_max > 0; got {self.rope_factor}, "
                             f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, {self.rope_original_max}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout = {self.dropout}; allowed: 0 <= dropout < 1")
        if not 0 <= self.tokenizer_vocab <= self.vocab_size:
            raise ValueError(f"GPTConfig.tokenizer_vocab = {self.tokenizer_vocab}; allowed: 0 (all) to vocab_size = "
                             f"{self.vocab_size}")
        if self.n_kv_head < 0 or self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"GPTConfig.n_kv_head = {self.n_kv_head} must divide n_head = {self.n_head}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("pos", ("learned", "rope")),
                              ("mlp", ("gelu", "swiglu")), ("gelu", ("none", "tanh")),
                              ("rope_scaling", ("none", "llama3"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} = {getattr(self, name)!r}; allowed: {', '.join(allowed)}")

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def head_size(self):
        return self.head_dim or self.n_embd // self.n_head

    @property
    def support(self):
        """How many ids the model's distribution is over: the first `support` rows of the LM head."""
        return self.tokenizer_vocab or self.vocab_size


class KVCache:
    """Keys and values of every layer for sampling, plus which cached positions are real tokens.

    Used in two ways. Appending (the model's forward with a cache, the eager sampler): each call writes
    its chunk at slot `length` and attention reads the first `length` slots, so shapes grow every step.
    Static (sampler.decode_step): every tensor is allocated up front and keeps its shape; a step writes at a
    slot given as a tensor and attends over all max_len slots, the ones not filled yet masked out by key_mask,
    so that one recorded CUDA graph (or one compiled graph) serves every step. Keys and values are kept for the
    n_kv key/value heads only (grouped-query attention reads them without copying)."""

    def __init__(self, n_layer, batch_size, max_len, device):
        self.k = [None] * n_layer        # each (B, nkv, max_len, hs), allocated at first use
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


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv, self.hs = config.n_head, config.kv_heads, config.head_size
        hs = self.hs
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv) * hs, bias=config.qkv_bias)
        o_bias = config.bias if config.o_bias is None else config.o_bias
        self.c_proj = nn.Linear(self.n_head * hs, config.n_embd, bias=o_bias)
        if config.qk_norm:                         # Qwen3: RMSNorm over each head's hs channels, before the rotation
            self.q_norm = nn.RMSNorm(hs, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(hs, eps=config.norm_eps)
        self.dropout = config.dropout

    def forward(self, x, attn_mask, cache=None, layer=0, slot=None, rope=None):
        """attn_mask (B, 1, T, S) bool, True where a query may read a key; None: causal attention over a layout with
        every row's real tokens first (GPT.hidden's packed layout), which SDPA runs as flash attention."""
        B, T, C = x.shape
        hs = self.hs
        q, k, v = self.c_attn(x).split([self.n_head * hs, self.n_kv * hs, self.n_kv * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)                  # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv, hs).transpose(1, 2) for t in (k, v))  # (B, nkv, T, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:                                               # rotary positions (Su et al. 2021)
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None and slot is not None:  # static shapes (sampler.decode_step): write at `slot`, read all
            cache.k[layer].index_copy_(2, slot, k)
            cache.v[layer].index_copy_(2, slot, v)
            k, v = cache.k[layer], cache.v[layer]  # (B, nkv, max_len, hs)
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
        dropout = self.dropout if self.training else 0.0
        g = self.n_head // self.n_kv               # grouped-query attention: query head h reads key/value head h // g
        if attn_mask is None:                      # packed: causal, no mask (flash attention)
            gqa = g > 1 and SDPA_GQA and x.is_cuda     # flash attention reads each key/value head for its g heads
            if g > 1 and not gqa:                      # elsewhere each key and value head is copied g times
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)   # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,   # (B, nh, T, hs)
                                               **({"enable_gqa": True} if gqa else {}))
        else:  # the g query heads sharing a key head attend as g*T queries of it: the cache is read once, not g times
            q = q.reshape(B, self.n_kv, g * T, hs)                         # (B, nkv, g*T, hs)
            mask = attn_mask.repeat(1, 1, g, 1) if g > 1 else attn_mask    # (B, 1, g*T, S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            y = y.reshape(B, self.n_head, T, hs)                           # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hs)
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


def rope_frequencies(config, device):
    """The rotary inverse frequencies (hs/2,) float32: theta^(-2i/hs) (Su et al. 2021), with Llama 3.1's scaling where
    config.rope_scaling is "llama3" (Meta's reference code and transformers' "llama3" rope type): a wavelength 2 pi / f
    longer than L / low_freq_factor (L = rope_original_max, the pre-training context) is stretched `factor` times, one
    shorter than L / high_freq_factor is kept, and between the two f is interpolated by s = (L / wavelength - low) /
    (high - low): (1 - s) f / factor + s f."""
    hs = config.head_size
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hs, 2, device=device).float() / hs)
    if config.rope_scaling != "llama3":
        return inv_freq
    L, low, high, factor = (config.rope_original_max, config.rope_low_freq_factor, config.rope_high_freq_factor,
                            config.rope_factor)
    wavelength = 2 * math.pi / inv_freq
    smooth = (L / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > L / low, inv_freq / factor, inv_freq)
    between = (wavelength <= L / low) & (wavelength >= L / high)
    return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


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
        if cache is None and idx.device.type in PACKED_ATTENTION:  # training and scoring on a GPU: flash attention
            order = torch.sort((~real).int(), dim=1, stable=True).indices  # (B, T) each row's real tokens first
            x, rope = self.embed(idx.gather(1, order), pos.gather(1, order))   # (B, T, C) packed
            x = self.run_blocks(x, None, None, rope)               # causal attention: no padding before a real token
            back = order.argsort(dim=1)[..., None].expand_as(x)    # (B, T, C) each position's place in the packing
            return self.ln_f(x.gather(1, back))
        q_pos = torch.arange(start, start + T, device=idx.device)[:, None]   # (T, 1) time index of each query
        k_pos = torch.arange(start + T, device=idx.device)[None, :]          # (1, S)
        attn_mask = (k_pos <= q_pos) & key_mask[:, None, :]        # (B, T, S): causal and not padding
        attn_mask = (attn_mask | (k_pos == q_pos))[:, None]        # (B, 1, T, S): padding queries see themselves
        x, rope = self.embed(idx, pos)                             # (B, T, C)
        x = self.run_blocks(x, attn_mask, cache, rope)
        if cache is not None:
            cache.length += T
        return self.ln_f(x)

    def run_blocks(self, x, attn_mask, cache, rope):
        """The transformer blocks on x (B, T, C). With grad_checkpoint (and a gradient to take), only each block's
        input is kept and its activations are recomputed in backward."""
        recompute = self.grad_checkpoint and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, attn_mask, rope=rope, use_reentrant=False)
            else:
                x = block(x, attn_mask, cache, i, rope=rope)
        return x

    def embed(self, idx, pos):
        """Token embeddings (B, T, C), plus the learned position embeddings, or with rotary positions the
        (cos, sin) of each position's angles (B, 1, T, hs) that attention applies to queries and keys."""
        x = self.wte(idx)
        if self.config.pos == "learned":
            return self.drop(x + self.wpe(pos)), None
        inv_freq = rope_frequencies(self.config, idx.device)                     # (hs/2,) float32
        angles = pos[:, None, :, None].float() * inv_freq                        # (B, 1, T, hs/2) float32
        angles = torch.cat([angles, angles], dim=-1)                             # (B, 1, T, hs)
        return self.drop(x), (angles.cos().to(x.dtype), angles.sin().to(x.dtype))

    def head_weight(self, pad=False):
        """The LM head's weight over the support (V, C) as the head's operand: in autocast's dtype where autocast is
        on (bfloat16 on a GPU), else float32. Differentiable (a cast of the weight). pad: with zero rows up to a
        multiple of 64, so that the logits' rows start 16-byte aligned (the matrix library's fast kernels need it;
        Qwen2.5's 151665 ids are odd) and logits() returns a view of the first V columns (for fast=True)."""
        w = self.lm_head.weight[:self.config.support]
        w = w.to(operand_dtype(w.device.type))
        return F.pad(w, (0, 0, 0, -w.size(0) % 64)) if pad else w

    def logits(self, x, head=None, fast=False):
        """Logits (..., V) float32 over the support (the tokenizer's ids) from final hidden states x (..., C). The
        operands are rounded to autocast's dtype where it is on (bfloat16: the head runs on tensor cores), the
        products and sums are float32, and the logits are never rounded to bfloat16 (module docstring: Precision).
        head: head_weight(), when the caller has it already (the sampler makes it once per call). fast (no
        gradient): one bfloat16 product with float32 output where torch has it (torch.mm's out_dtype, CUDA), the same
        numbers summed in another order; otherwise the rounded operands are multiplied as float32, exactly."""
        w = self.head_weight() if head is None else head
        with autocast_off(x.device.type):
            if fast and w.dtype != torch.float32 and mm_float32_out(x.device):
                out = torch.mm(x.reshape(-1, x.size(-1)).to(w.dtype), w.t(), out_dtype=torch.float32)
                out = out.view(*x.shape[:-1], w.size(0))
            else:
                out = F.linear(x.to(w.dtype).float(), w.float())
        return out[..., :self.config.support] if out.size(-1) > self.config.support else out   # head_weight(pad)

    def forward(self, idx, mask=None, cache=None, targets=None, temperature=1.0, fused=None):
        """Logits (B, T, V) float32 over the support: position t predicts token t + 1. With targets (B, Tn): instead,
        the float32 log-probs (B, Tn) of the targets at the last Tn positions (head_logprobs)."""
        h = self.hidden(idx, mask, cache)
        if targets is None:
            return self.logits(h)
        return self.head_logprobs(h, targets, temperature, fused)

    def head_logprobs(self, h, targets, temperature=1.0, fused=None):
        """log pi(targets) (B, Tn) float32 at `temperature` from final hidden states h (B, T, C), whose last Tn
        positions predict targets, over the support. fused (default: a support above FUSED_VOCAB) takes the LM head
        and the log-softmax through kernels.linear_logprobs, which never writes the logits; else the logits, then
        kernels.logprobs. Scoring (no gradient) and training reach the log-probs through this one function, so that
        on-policy they agree bit for bit and the first ratio is exactly 1."""
        Tn = targets.size(1)
        if not (self.config.support > FUSED_VOCAB if fused is None else fused):
            return logprobs(self.logits(h)[:, h.size(1) - Tn:], targets, temperature)
        w = self.head_weight()                                     # (V, C) bfloat16 under autocast, else float32
        with autocast_off(h.device.type):                          # float32 products and sums in the kernel
            return linear_logprobs(h[:, h.size(1) - Tn:].to(w.dtype), w, targets, temperature)



# The devices whose training and scoring forwards pack each row's real tokens first and run plain causal attention
# (SDPA's flash kernel, no mask; GPT.hidden). Elsewhere the explicit padding mask stays, which keeps every CPU result
# made so far bit for bit.
PACKED_ATTENTION = ("cuda",)
_AUTOCAST = {d for d in ("cpu", "cuda", "mps", "xpu") if torch.amp.is_autocast_available(d)}   # read once: traceable
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)   # SDPA's enable_gqa (flash, on CUDA)
_MM_FLOAT32_OUT = {}   # device type -> whether torch.mm(bf16, bf16, out_dtype=float32) runs there


def operand_dtype(device_type, default=torch.float32):
    """The dtype autocast computes products in on this device type now (bfloat16 in the scripts on a GPU), else
    `default`."""
    if device_type in _AUTOCAST and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


def autocast_off(device_type):
    """A context with autocast off on `device_type`, so that what runs inside computes in the tensors' own dtype
    (nothing to switch off where this torch has no autocast for the device)."""
    if device_type in _AUTOCAST:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def mm_float32_out(device):
    """Whether torch.mm multiplies bfloat16 matrices into a float32 result on this device (out_dtype: CUDA, recent
    torch), tried once per device type."""
    if device.type not in _MM_FLOAT32_OUT:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            _MM_FLOAT32_OUT[device.type] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_FLOAT32_OUT[device.type] = False
    return _MM_FLOAT32_OUT[device.type]


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
    """Logits (B, Tn, V) predicting each completion token under `model`, for scoring what the sampler
    drew. prompt (B, Tp) left-padded, tokens (B, Tn) right-padded, masks 1.0 on real tokens:
    position Tp-1+t of prompt+completion predicts completion token t."""
    idx = torch.cat([prompt, tokens], dim=1)                           # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return model(idx[:, :-1], attn[:, :-1])[:, prompt.size(1) - 1:]    # (B, Tn, V)


def token_logprobs(model, idx, mask, targets, temperature=1.0, fused=None):
    """log pi(targets) (B, Tn) float32 at `temperature`, read at the last Tn positions of model(idx, mask): as
    logprobs(model(idx, mask)[:, -Tn:], targets), through GPT.head_logprobs (fused: never holding the (B, Tn, V)
    logits, by default above FUSED_VOCAB: what lets a real checkpoint's V = 151936 train). Through
    DistributedDataParallel too: the forward is the wrapper's."""
    return model(idx, mask, targets=targets, temperature=temperature, fused=fused)


def completion_logprobs(model, prompt, prompt_mask, tokens, mask, temperature=1.0, fused=None):
    """log pi(token_t | prompt, tokens_<t) (B, Tn) float32: token_logprobs of the completion (completion_logits'
    positions)."""
    idx = torch.cat([prompt, tokens], dim=1)                           # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return token_logprobs(model, idx[:, :-1], attn[:, :-1], tokens, temperature, fused)   # (B, Tn)


def completion_hidden(model, prompt, prompt_mask, tokens, mask):
    """Final hidden states (B, Tp+Tn-1, C) of each prompt and its completion but the last token: position Tp-1+t
    predicts completion token t. model.head_logprobs(h, tokens, T) is completion_logprobs(model, ..., T), bit for bit,
    and kl_entropy reads the same h: scoring runs each model's forward once."""
    idx = torch.cat([prompt, tokens], dim=1)                           # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    return model.hidden(idx[:, :-1], attn[:, :-1])


def kl_entropy(policy, ref, h, h_ref, mask, temperature=1.0, chunk=1024):
    """The exact KL(pi || ref) over the support and the entropy of pi, (B, Tn) float32 each, at the completion
    positions where mask (B, Tn) is 1 (0 elsewhere), from both models' completion_hidden. The logits of `chunk`
    positions at a time go through kernels.kl and kernels.entropy, so that no more than chunk x V logits of either
    model exist at once: a real checkpoint's [B, T, V] logits (9.3 GiB for 8 rows of 1280 tokens) are never formed."""
    B, Tn = mask.shape
    real = mask > 0
    hp, hq = h[:, -Tn:][real], h_ref[:, -Tn:][real]                    # (n, C) the real positions only
    kl_t, ent_t = torch.zeros(B, Tn, device=mask.device), torch.zeros(B, Tn, device=mask.device)
    wp, wq = policy.head_weight(pad=True), ref.head_weight(pad=True)   # each model's head operand, made once
    kls, ents = [], []
    for i in range(0, hp.size(0), chunk):
        lp = policy.logits(hp[i:i + chunk], wp, fast=True)              # (chunk, V) float32
        lq = ref.logits(hq[i:i + chunk], wq, fast=True)
        kls.append(kl(lp, lq, temperature))
        ents.append(entropy(lp, temperature))
    if kls:
        kl_t[real], ent_t[real] = torch.cat(kls), torch.cat(ents)
    return kl_t, ent_t


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
    so a crash mid-write never leaves a half-written checkpoint under the real name. A model with LoRA adapters
    (lora.py) is saved with them and their settings ("lora"), the optimiser's state being theirs."""
    ckpt = {
        "model": model.state_dict(),
        "kind": "scalar" if isinstance(model, ScalarGPT) else "gpt",
        "config": asdict(model.config),
        "tokenizer": tokenizer_name,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "step": step,
        "args": vars(args) if hasattr(args, "__dict__") else args,
        **({"lora": model.lora} if getattr(model, "lora", None) else {}),
        **extra,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)  # atomic on POSIX and Windows


def load_checkpoint(path, device="cpu", kind=None, tokenizer=None):
    """Read a checkpoint and rebuild its model. Returns (model, ckpt).
    kind: "gpt" or "scalar" to insist on one; tokenizer: a Tokenizer the checkpoint must match. A checkpoint with LoRA
    adapters is rebuilt with them and returned merged (lora.merge: W + (alpha / r) B A), a plain model; resuming
    its run loads ckpt["model"] into the adapted policy instead."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if os.path.isdir(path) and is_pretrained_folder(path):
        raise CheckpointError(f"{path} is a Hugging Face model folder; a checkpoint a training script of this project "
                              f"wrote (a .pt file) is needed here")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder without config.json: neither one of this project's checkpoints "
                              f"(a .pt file) nor a Hugging Face model folder")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    if head != b"PK\x03\x04":                                        # torch.save writes a zip archive
        raise CheckpointError(f"{path} is not a checkpoint: torch.save's files are zip archives (a Hugging Face "
                              f"model is given as its folder, not as a file in it)")
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
    if tokenizer is not None and (tokenizer.name != ckpt["tokenizer"] or tokenizer.vocab_size != config.support):
        raise CheckpointError(f"vocabulary mismatch: checkpoint {path} was trained with tokenizer "
                              f"{ckpt['tokenizer']!r} "
                              f"(vocab_size {config.vocab_size}), but tokenizer {tokenizer.name!r} "
                              f"(vocab_size {tokenizer.vocab_size}) is in use")
    model = ScalarGPT(config) if ckpt["kind"] == "scalar" else GPT(config)
    if ckpt.get("lora"):
        from lora import add_adapters, merge
        add_adapters(model, **ckpt["lora"])
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path}: weights do not match its config ({str(e)[:300]})") from None
    if ckpt.get("lora"):
        model = merge(model)
    return model.to(device), ckpt


# -----------------------------------------------------------------------------
# Real checkpoints: a local folder in the Hugging Face layout (config.json, model.safetensors or its shards,
# tokenizer.json), as a user has it after downloading one. Nothing is fetched.

def is_pretrained_folder(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


MAX_JSON_BYTES = 256 * 2 ** 20     # the largest JSON file of a folder read (tokenizer.json: about 10 MB)
MAX_TEMPLATE_BYTES = 2 ** 20       # the longest chat template read (Llama 3.x's: 5 KB)


def read_json(path, kind=None):
    """The JSON in `path`, or one error line: unreadable, larger than MAX_JSON_BYTES, nested too deeply, or (kind)
    not of that type."""
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MB; it is not read")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{path} cannot be read ({why})") from None
    if kind is not None and not isinstance(data, kind):
        raise CheckpointError(f"{path} is not a JSON {'object' if kind is dict else kind.__name__}")
    return data


def _finite_positive(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def pretrained_config(folder):
    """GPTConfig for a folder's config.json (model_type gpt2, llama, qwen2 or qwen3); anything else is one error line.
    Where the folder's tokenizer.json has fewer ids than the embedding has rows (Qwen2.5: 151665 of 151936), the
    config's tokenizer_vocab says so: the model's distribution is over the tokenizer's ids only."""
    config = _pretrained_config(folder)
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        data = read_json(path, dict)
        model = data.get("model") if isinstance(data.get("model"), dict) else {}
        vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
        added = [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
        n = max((i + 1 for i in [*vocab.values(), *added] if isinstance(i, int)), default=0)
        if 0 < n < config.vocab_size:
            config.tokenizer_vocab = n
    return config


def _pretrained_config(folder):
    path = os.path.join(folder, "config.json")
    c = read_json(path, dict)

    def num(key, default=None, kind=int):
        """config.json's `key`: a positive integer (kind float: a positive finite number), or one error line."""
        v = c.get(key, default)
        if v is None:
            raise CheckpointError(f"{path} has no {key}")
        if not _finite_positive(v) or (kind is int and not isinstance(v, int)):
            raise CheckpointError(f"{path}: {key} = {v!r}; it must be a positive "
                                  f"{'integer' if kind is int else 'finite number'}")
        return v

    def flag(key, default):
        """config.json's `key`: true or false (a string "false" is not false), or one error line."""
        v = c.get(key, default)
        if not isinstance(v, bool):
            raise CheckpointError(f"{path}: {key} = {v!r}; it must be true or false")
        return v

    kind = c.get("model_type")
    if kind == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise CheckpointError(f"{folder}: activation_function {c['activation_function']!r} is not supported")
        config = dict(vocab_size=num("vocab_size"), block_size=num("n_positions"), n_layer=num("n_layer"),
                      n_head=num("n_head"), n_embd=num("n_embd"), norm_eps=num("layer_norm_epsilon", 1e-5, float),
                      gelu="none" if c.get("activation_function") == "gelu" else "tanh",
                      mlp_hidden=num("n_inner") if c.get("n_inner") else 0,
                      tie_embeddings=flag("tie_word_embeddings", True))
    elif kind in ("llama", "qwen2", "qwen3"):
        heads, width = num("num_attention_heads"), num("hidden_size")
        unsupported = {"hidden_act": c.get("hidden_act", "silu"), "use_sliding_window": c.get("use_sliding_window",
                                                                                                False)}
        allowed = {"hidden_act": "silu", "use_sliding_window": False}
        for key, value in unsupported.items():
            if value != allowed[key]:
                raise CheckpointError(f"{folder}: config.json {key} = {value!r} is not supported (only "
                                      f"{allowed[key]!r})")
        head_dim = num("head_dim", width // heads) if c.get("head_dim") is not None else 0
        attn_bias = True if kind == "qwen2" else flag("attention_bias", False)   # Qwen2: q, k, v biases
        config = dict(vocab_size=num("vocab_size"), block_size=num("max_position_embeddings"),
                      n_layer=num("num_hidden_layers"), n_head=heads, n_embd=width,
                      n_kv_head=num("num_key_value_heads", heads), norm="rmsnorm",
                      norm_eps=num("rms_norm_eps", kind=float), pos="rope",
                      mlp="swiglu", mlp_hidden=num("intermediate_size"), bias=flag("mlp_bias", False),
                      qkv_bias=attn_bias, o_bias=attn_bias and kind != "qwen2",   # attention_bias covers o_proj
                      head_dim=0 if head_dim == width // heads else head_dim, qk_norm=kind == "qwen3",
                      tie_embeddings=flag("tie_word_embeddings", False), **_rope_config(c, path))
    else:
        raise CheckpointError(f"{folder}: model_type {kind!r} is not supported; allowed: gpt2, llama, qwen2, qwen3")
    try:
        return GPTConfig(**config)
    except ValueError as e:                                            # e.g. heads that do not divide the width
        raise CheckpointError(f"{path}: {e}") from None


def _rope_config(c, path):
    """GPTConfig's rotary fields from config.json: rope_theta, and Llama 3.1's "llama3" scaling, from rope_scaling
    (transformers 4) or rope_parameters (transformers 5); another scaling (linear, dynamic, yarn, ...) is refused."""
    rope = c.get("rope_parameters") or {}
    rope = rope if isinstance(rope, dict) else {}
    scaling = c.get("rope_scaling") or rope
    scaling = scaling if isinstance(scaling, dict) else {"rope_type": scaling}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    if not _finite_positive(theta):
        raise CheckpointError(f"{path}: rope_theta = {theta!r}; it must be a positive finite number")
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope scaling {kind!r} is not supported (only Llama 3.1's 'llama3', or none)")
    keys = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
            "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max"}
    out = {"rope_theta": float(theta), "rope_scaling": "llama3"}
    for theirs, ours in keys.items():
        v = scaling.get(theirs)
        if not _finite_positive(v):
            raise CheckpointError(f"{path}: llama3 rope scaling {theirs} = {v!r}; it must be a positive finite "
                                  f"number")
        out[ours] = int(v) if ours == "rope_original_max" else float(v)
    return out


def _read_safetensors(folder):
    """Every tensor of the folder's model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors.torch import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.isfile(index):
        shards = read_json(index, dict).get("weight_map")
        if not isinstance(shards, dict) or not all(isinstance(f, str) and f == os.path.basename(f) and
                                                   f.endswith(".safetensors") for f in shards.values()):
            raise CheckpointError(f"{index}: no weight_map of tensor names to .safetensors files in the folder")
        files = sorted(set(shards.values()))
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


def _our_names(hf, config, folder):
    """Hugging Face tensors -> {our parameter name: tensor}, and the names of theirs it used. GPT-2's Conv1D weights
    are stored (in, out) and are transposed; Llama's q, k, v (and gate, up) projections are concatenated into our
    c_attn (and c_fc)."""
    ours, used = {}, set()

    def take(name):
        if name not in hf:
            raise CheckpointError(f"{folder}: tensor {name} is missing from its safetensors weights")
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
    else:                                                              # llama, qwen2, qwen3
        ours["wte.weight"] = take("model.embed_tokens.weight")
        for i in range(config.n_layer):
            p, q = f"model.layers.{i}.", f"blocks.{i}."
            ours[q + "ln_1.weight"] = take(p + "input_layernorm.weight")
            ours[q + "ln_2.weight"] = take(p + "post_attention_layernorm.weight")
            ours[q + "attn.c_attn.weight"] = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            if config.qkv_bias:
                ours[q + "attn.c_attn.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            ours[q + "attn.c_proj.weight"] = take(p + "self_attn.o_proj.weight")
            if config.qk_norm:
                ours[q + "attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
                ours[q + "attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
            ours[q + "mlp.c_fc.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            ours[q + "mlp.c_proj.weight"] = take(p + "mlp.down_proj.weight")
            if config.bias if config.o_bias is None else config.o_bias:
                ours[q + "attn.c_proj.bias"] = take(p + "self_attn.o_proj.bias")
            if config.bias:
                ours[q + "mlp.c_fc.bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
                ours[q + "mlp.c_proj.bias"] = take(p + "mlp.down_proj.bias")
        ours["ln_f.weight"] = take("model.norm.weight")
    if config.tie_embeddings:
        if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], ours["wte.weight"]):
            raise CheckpointError(f"{folder}: tensor lm_head.weight differs from the token embedding, but config.json "
                                  f"ties them (tie_word_embeddings)")
        used.add("lm_head.weight")
    else:
        ours["lm_head.weight"] = take("lm_head.weight")
    return ours, used


def from_pretrained(folder, dtype=torch.float32):
    """Our GPT with the weights of a Hugging Face folder (model_type gpt2, llama, qwen2 or qwen3), in eval mode, in
    `dtype` (float32 by default, as this project trains; None: the checkpoint's own). A missing, mis-shaped or unused
    tensor is one error line naming it."""
    config = pretrained_config(folder)
    hf = _read_safetensors(folder)
    ours, used = _our_names(hf, config, folder)
    unused = sorted(set(hf) - used - {"transformer." + k for k in used})
    if unused:
        raise CheckpointError(f"{folder}: tensor {unused[0]} is not used by a {config.pos}-position model "
                              f"({len(unused)} unused)")
    with torch.device("meta"):                                         # the shapes, before any memory is taken
        expected = GPT(config).state_dict()
    for name, tensor in ours.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{folder}: tensor for {name} has shape {tuple(tensor.shape)}; the config needs "
                                  f"{tuple(expected[name].shape)}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{folder}: tensor for {name} holds NaN or infinite values")
    dtype = dtype or next(iter(hf.values())).dtype
    missing = [n for n in expected if n not in ours and not (n == "lm_head.weight" and config.tie_embeddings)]
    if missing:
        raise CheckpointError(f"{folder}: no tensor for {missing[0]}")
    model = GPT(config)
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
    """(mergeable ranks, split pattern, added tokens {text: id}, normalise, BOS prefix ids, the added tokens marked
    special) of a folder's byte-level BPE tokenizer.json. The BOS prefix: the special tokens its post-processor's
    TemplateProcessing puts before a single text (Llama 3: <|begin_of_text|>)."""
    path = os.path.join(folder, "tokenizer.json")
    data = read_json(path, dict)
    model = data.get("model") or {}
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise CheckpointError(f"{path}: model type {model.get('type') if isinstance(model, dict) else model!r}, or "
                              f"no vocab; only a byte-level BPE tokenizer is read")
    added = data.get("added_tokens") or []
    ids = [*model["vocab"].values(), *(t.get("id") if isinstance(t, dict) else t for t in added)]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) for t in added):
        raise CheckpointError(f"{path}: a token id that is not a non-negative integer, or an added token without "
                              f"its content")
    if len(set(model["vocab"].values())) < len(model["vocab"]) or len({t["id"] for t in added}) < len(added):
        raise CheckpointError(f"{path}: two tokens share an id")
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    try:
        ranks = {bytes(to_byte[ch] for ch in token): i for token, i in model["vocab"].items()}
    except KeyError:
        raise CheckpointError(f"{folder}: tokenizer.json is not byte-level (a vocabulary entry outside GPT-2's "
                              f"byte alphabet)") from None
    lacking = [b for b in range(256) if bytes([b]) not in ranks]
    if lacking:                                                        # text holding that byte could not be encoded
        raise CheckpointError(f"{path}: the byte-level vocabulary lacks the token of byte {lacking[0]} "
                              f"({len(lacking)} of 256 missing)")
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else None
    if not isinstance(steps, list) or not all(isinstance(x, dict) for x in steps):
        raise CheckpointError(f"{path}: pre_tokenizer is not an object (or a Sequence of objects)")
    splits = [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    if splits:
        pattern = splits[0]
    elif any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        pattern = GPT2_SPLIT
    else:
        raise CheckpointError(f"{folder}: tokenizer.json pre-tokenizer {pre.get('type')!r} is not supported")
    normaliser = data.get("normalizer") or {}
    normaliser = normaliser.get("type") if isinstance(normaliser, dict) else normaliser
    if normaliser not in (None, "NFC"):
        raise CheckpointError(f"{folder}: tokenizer.json normalizer {normaliser!r} is not supported (none or NFC)")
    special = {t["content"]: t["id"] for t in added}
    post = data.get("post_processor") or {}
    if not isinstance(post, dict):
        raise CheckpointError(f"{path}: post_processor is not an object")
    steps = [p for p in (post.get("processors") or [post]) if isinstance(p, dict)]
    template = next((p for p in steps if p.get("type") == "TemplateProcessing"), {})
    prefix = []
    for piece in template.get("single") or []:
        if "Sequence" in piece:
            break
        token = (piece.get("SpecialToken") or {}).get("id")
        ids = ((template.get("special_tokens") or {}).get(token) or {}).get("ids")
        if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            raise CheckpointError(f"{path}: post_processor special token {token!r} has no ids")
        prefix += ids
    return ranks, pattern, special, normaliser, prefix, {t["content"] for t in added if t.get("special")}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "tokenizer.model", "generation_config.json")


def tokenizer_files(folder):
    """{name: sha256} of the folder's files that decide how text becomes ids and where a completion stops: a
    checkpoint keeps them, and loading it or exporting it checks that the folder still holds the same."""
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    out[name] = hashlib.sha256(f.read()).hexdigest()
            except OSError as e:
                raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    return out


def pretrained_stop_ids(folder, eos):
    """Every id that ends a completion, `eos` first: generation_config.json's and config.json's eos_token_id, each an
    id or a list (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>; Llama 3.x Instruct: three)."""
    ids = [eos]
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        data = read_json(path) if os.path.isfile(path) else {}
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return tuple(ids)


def pretrained_chat_template(folder, special, marked):
    """(template source, added tokens, special ones, variables) for chat.ChatTemplate, or None: the folder's
    chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of named templates: the
    "default" one); variables are the special-token strings the template may read (bos_token, eos_token, ...)."""
    path = os.path.join(folder, "tokenizer_config.json")
    config = read_json(path, dict) if os.path.isfile(path) else {}
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            if os.path.getsize(jinja) > MAX_TEMPLATE_BYTES:
                raise CheckpointError(f"{jinja} is larger than {MAX_TEMPLATE_BYTES >> 20} MB; it is not read")
            with open(jinja, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja} cannot be read ({type(e).__name__}: {e})") from None
    if isinstance(source, str) and len(source) > MAX_TEMPLATE_BYTES:
        raise CheckpointError(f"{path}: chat_template is longer than {MAX_TEMPLATE_BYTES >> 20} MB")
    if not isinstance(source, str):
        return None
    content = lambda t: t.get("content") if isinstance(t, dict) else t
    variables = {k: content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                 if isinstance(content(config.get(k)), str)}
    return source, special, marked, variables


def pretrained_eos_pad(folder, special):
    """(eos_id, pad_id): EOS from generation_config.json or config.json, else the eos_token tokenizer_config.json
    names (a folder holding a tokenizer only); the pad token from tokenizer_config.json where it names one, else EOS
    (padding is masked out everywhere here, so any id serves)."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if eos is None and os.path.isfile(path):
            data = read_json(path)
            eos = data.get("eos_token_id") if isinstance(data, dict) else None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    path = os.path.join(folder, "tokenizer_config.json")
    tokens = read_json(path, dict) if os.path.isfile(path) else {}
    content = lambda t: t.get("content") if isinstance(t, dict) else t
    if eos is None:
        eos = special.get(content(tokens.get("eos_token")))
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise CheckpointError(f"{folder}: no integer eos_token_id in generation_config.json or config.json, and no "
                              f"eos_token of tokenizer.json's in tokenizer_config.json")
    return eos, special.get(content(tokens.get("pad_token")), eos)
