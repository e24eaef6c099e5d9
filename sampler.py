"""
Sampling completions from model.GPT: the rollout engine every script shares (nanochat's engine.py
and nano-vllm are the anchors), and the scoring of what was sampled. Episodes with an environment,
the policy's tokens and the environment's in turn, are episode.py's.

    tokens, mask, truncated = generate(model, prompt, prompt_mask, max_new_tokens,
                                       tok.stop_ids, tok.pad_id, num_samples=G, generator=g)

A call runs the (left-padded) prompts through the model once, filling a KV cache allocated for the
prompt plus every new token in the model's compute dtype, then makes one token per step. Three
modes, the same tokens (tests/test_sampler.py):
- "eager": the model's own forward on an appending cache: the reference, and the default off CUDA.
- "graph": a step of fixed shapes (decode_step: the new key and value written at a slot held in a
  tensor, attention over every slot, the empty ones masked), with the LM head, the draw and the
  end bookkeeping, recorded once per call as a CUDA graph and replayed: one launch a token. The
  host checks for the end every SYNC_EVERY tokens only. Off CUDA the same step runs eagerly.
- "compile": "graph" with the step's transformer under torch.compile (fullgraph), on bfloat16
  copies of the linear layers (sampling_copy); on CUDA the default from COMPILE_PARAMS up.
The draw: torch.multinomial's race, argmax_v p_v / E_v with E_v ~ Exponential(1), written out
(`draw`: the same tokens from the same generator, without multinomial's host sync), over the
tokenizer's ids only (GPT.logits: Qwen2.5's padding rows past 151665 are never drawn).

Shapes: N = B * num_samples rows, Tp prompt length, Tn new tokens, V the support, C channels.
"""
import copy
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import invariant, logprobs
from lora import LoRALinear
from model import FUSED_VOCAB, KVCache, completion_hidden, kl_entropy, operand_dtype

MODES = ("eager", "graph", "compile")
SYNC_EVERY = 16    # "graph", "compile" on CUDA: tokens between the host's checks for the end
CACHE_ROUND = 64   # "compile" on CUDA: cache slots rounded up to this (close lengths share a
CPU_ROUND = 8      # graph); elsewhere to this: each slot attended costs time (bench/README)
COMPILE_PARAMS = 50_000_000   # on CUDA the default is "compile" from this many parameters up


@torch.no_grad()
def generate(model, prompt, prompt_mask, max_new_tokens, eos_id, pad_id=None, num_samples=1,
             temperature=1.0, top_k=None, generator=None, mode=None, return_logprobs=False,
             top_p=None, return_hidden=False):
    """prompt (B, Tp) left-padded ids, prompt_mask (B, Tp) 1 on real tokens; num_samples completions
    per prompt on consecutive rows. eos_id: an id, or a sequence of ids (a tokenizer's stop_ids),
    any of which ends a row. temperature 0: greedy; top_k, top_p: keep the k likeliest, then the
    nucleus of mass top_p (keep_likeliest; None: the full softmax, as RL needs). mode: "eager",
    "graph" or "compile"; None reads model.sampler_mode (--compile), else default_mode. Returns
    tokens (N, Tn), pad_id after each row's end; mask (N, Tn) 1.0 through the token that ended it;
    truncated (N,) bool; with return_logprobs the sampler's log-prob of each token (N, Tn) float32,
    of the distribution it drew from (softmax(logits / T) over what is kept), 0 after the end;
    with return_hidden also the final hidden state each token was drawn from (N, Tn, C), which
    sampler_kl compares with the trainer's. pad_id None: eos_id[0]."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}; it must be at least 1")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature}; it must be >= 0 (0 = greedy)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}; allowed: 0 < top_p <= 1")
    mode = mode or getattr(model, "sampler_mode", None) or default_mode(model, prompt.device)
    if mode not in MODES:
        raise ValueError(f"sampler mode {mode!r} is unknown; allowed: {', '.join(MODES)}")
    stops = torch.tensor(eos_id if isinstance(eos_id, (list, tuple)) else [eos_id],
                         device=prompt.device)
    pad_id = int(stops[0]) if pad_id is None else pad_id
    idx = prompt.repeat_interleave(num_samples, dim=0)                  # (N, Tp)
    idx_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
    N, Tp = idx.shape
    out = Outputs(N, max_new_tokens, pad_id, idx.device, return_hidden)
    settings = (temperature, top_k, generator, stops, pad_id, return_logprobs, top_p)
    if mode == "eager":
        eager_loop(model, idx, idx_mask, max_new_tokens, out, settings)
    else:
        try:
            static_loop(model, idx, idx_mask, max_new_tokens, out, settings,
                        compiled=mode == "compile")
        finally:
            release_copy(model)
    return out.result(return_logprobs, return_hidden)


def default_mode(model, device):
    """"eager" off CUDA; on CUDA "compile" from COMPILE_PARAMS parameters up (its tens of seconds of
    compiling, once, are paid back within a rollout), else "graph"."""
    if device.type != "cuda":
        return "eager"
    return "compile" if model.num_params() >= COMPILE_PARAMS else "graph"


class Outputs:
    """What the steps write, on the device; t, the next column, is a tensor so that a recorded step
    advances it."""

    def __init__(self, N, max_new_tokens, pad_id, device, keep_hidden=False):
        self.keep_hidden, self.hidden = keep_hidden, None     # (N, Tn, C) at the first record
        self.tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.mask = torch.zeros(N, max_new_tokens, device=device)
        self.logp = torch.zeros(N, max_new_tokens, device=device)
        self.done = torch.zeros(N, dtype=torch.bool, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)

    def result(self, return_logprobs, return_hidden=False):
        # trimmed after the last column any row sampled (steps past every row's end wrote padding)
        Tn = int(self.mask.sum(0).nonzero().max()) + 1               # column 0 is always sampled
        outs = (self.tokens[:, :Tn], self.mask[:, :Tn], ~self.done)
        outs += (self.logp[:, :Tn],) if return_logprobs else ()
        return (*outs, self.hidden[:, :Tn]) if return_hidden else outs


def keep_likeliest(logits, top_k=None, top_p=None):
    """logits (N, V), all but the k likeliest at -inf, then all but the nucleus (Holtzman et al.
    2019): the smallest set of the likeliest whose probability reaches top_p, a token dropped when
    those likelier than it already hold top_p (transformers' top-k then top-p, as vLLM's)."""
    if top_k is not None:                                               # the k largest
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ranked, order = logits.sort(-1, descending=True)                # (N, V) likeliest first
        p = F.softmax(ranked, dim=-1)
        drop = p.cumsum(-1) - p >= top_p                                # mass above it >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def draw(logits, temperature, top_k, generator, want_logp=False, top_p=None):
    """The next token (N,) from logits (N, V) float32 (and its log-prob, with want_logp):
    torch.multinomial's draw from what keep_likeliest keeps."""
    if temperature == 0:
        return logits.argmax(-1), None
    raw, logits = logits, keep_likeliest(logits / temperature, top_k, top_p)
    probs = F.softmax(logits, dim=-1)                                   # (N, V)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)   # E_v ~ Exp(1)
    nxt = (probs / race).argmax(-1)                                     # (N,) argmax_v p_v / E_v
    if not want_logp:
        return nxt, None
    if invariant.active() and top_k is None and top_p is None:         # the trainer's function
        return nxt, token_logp(raw, nxt, temperature)
    return nxt, F.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)


def token_logp(logits, tokens, temperature):
    """log softmax(logits / temperature) at tokens (N,): logits (N, V) float32 -> (N,); under
    --batch_invariant the trainer's own function (kernels.logprobs)."""
    if invariant.active():
        return logprobs(logits[:, None], tokens[:, None], temperature)[:, 0]
    return F.log_softmax(logits / temperature, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def record(out, nxt, logp, stops, pad_id, h):
    """The drawn tokens at column out.t (pad_id, mask 0 past a row's end: any of stops), and the
    hidden state h (N, C) they were drawn from if kept; graph-safe device work."""
    if out.keep_hidden:
        if out.hidden is None:
            out.hidden = h.new_zeros(h.size(0), out.tokens.size(1), h.size(1))
        out.hidden.index_copy_(1, out.t, h[:, None])
    tokens = torch.where(out.done, pad_id, nxt)[:, None]               # (N, 1)
    out.tokens.index_copy_(1, out.t, tokens)
    out.mask.index_copy_(1, out.t, (~out.done).float()[:, None])
    if logp is not None:
        out.logp.index_copy_(1, out.t, torch.where(out.done, 0.0, logp)[:, None])
    out.done.logical_or_(torch.isin(nxt, stops))
    out.t.add_(1)
    return tokens


def check_finite(logits):               # once per call (a device sync): NaN would sample garbage
    if not torch.isfinite(logits).all():
        raise ValueError("the model's logits are not finite (NaN or inf): its weights hold NaN or "
                         "inf, or have diverged; nothing can be sampled from it")


def last_logits(model, h, head=None):
    # the logits (N, V) of each row's last position: up to FUSED_VOCAB from every position's (the
    # computation every earlier CPU result was made with), above it from the last position alone
    if invariant.active():                     # the trainer's logits: one head, tiled rows
        return model.logits(h[:, -1])
    if model.config.support > FUSED_VOCAB:
        head = model.head_weight(pad=True) if head is None else head
        return model.logits(h[:, -1], head, fast=True)
    return model.logits(h)[:, -1]


def eager_loop(model, idx, idx_mask, max_new_tokens, out, settings):
    """"eager": the model's own forward on an appending cache, the end checked every token."""
    temperature, top_k, generator, stops, pad_id, want_logp, top_p = settings
    N, Tp = idx.shape
    cache = KVCache(model.config.n_layer, N, Tp + max_new_tokens, idx.device)
    h = model.hidden(idx, idx_mask, cache)                              # (N, Tp, C)
    logits = last_logits(model, h)                                      # (N, V): the first token's
    check_finite(logits)
    for t in range(max_new_tokens):
        nxt, logp = draw(logits, temperature, top_k, generator, want_logp, top_p)
        token = record(out, nxt, logp, stops, pad_id, h[:, -1])
        if t == max_new_tokens - 1 or out.done.all():
            break
        h = model.hidden(token, None, cache)        # (N, 1, C) the step: every row real
        logits = model.logits(h)[:, -1]                                 # (N, V): model(token)


def decode_step(model, token, cache, slot):
    """The final hidden state (N, C) of one new token per row, token (N, 1), shapes that never
    change: its keys and values go to cache slot `slot` (1,), attention reads every slot (the empty
    ones masked: their terms are exactly 0, the sums ordered otherwise than model.hidden's on an
    appending cache)."""
    cache.key_mask.index_fill_(1, slot, True)                           # (N, L) the new one: real
    x, rope = model.embed(token, cache.next_pos[:, None])               # (N, 1, C)
    attn_mask = cache.key_mask[:, None, None, :]                        # (N, 1, 1, L) filled slots
    for i, block in enumerate(model.blocks):
        x = block(x, attn_mask, cache, i, slot, rope)
    cache.next_pos.add_(1)
    return model.ln_f(x)[:, -1]                                         # (N, C)


_compiled = []   # decode_step under torch.compile, made at first use, shared by every model


def compiled_decode_step():
    """decode_step under torch.compile (fullgraph; static_loop records the CUDA graph); past the
    recompile limit (where fullgraph would raise) the step runs eagerly."""
    if not _compiled:
        compiled = torch.compile(decode_step, fullgraph=True)   # a second shape: dynamic sizes

        def step(model, token, cache, slot):
            try:
                return compiled(model, token, cache, slot)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                return decode_step(model, token, cache, slot)
        _compiled.append(step)
    return _compiled[0]


_copies = weakref.WeakKeyDictionary()   # model -> the sampler's copy of it (sampling_copy)


def sampling_copy(model, dtype):
    """Under bfloat16 autocast, a copy of the model whose linear layers hold bfloat16 weights (the
    rest shared), as an inference engine keeps its own, refreshed at every call: autocast's very
    products without a cast of every matrix at every token (2 GB at Qwen2.5-0.5B). LoRA adapters
    are merged into its weights, W + (alpha / r) B A, as vLLM serves a merged model (the same
    tokens, tests/test_sampler.py). Between calls its weights hold no memory (release_copy)."""
    lora = any(isinstance(m, LoRALinear) for m in model.modules())
    if dtype == torch.float32 and not lora:
        return model
    copied = _copies.get(model)
    if copied is None or copied[0] != dtype:
        twin = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})   # same tensors
        pairs = []
        for parent in list(twin.blocks.modules()):
            for attr, child in list(parent.named_children()):
                if isinstance(child, LoRALinear):     # one linear layer holding W + (alpha/r) B A
                    base = child.base
                    merged = nn.Linear(base.in_features, base.out_features, base.bias is not None,
                                       device=base.weight.device, dtype=dtype).requires_grad_(False)
                    setattr(parent, attr, merged)
                    pairs.append((merged.weight, lambda c=child: c.base.weight + c.delta_weight()))
                    if base.bias is not None:
                        pairs.append((merged.bias, lambda b=base.bias: b))
        for module in twin.blocks.modules():
            if isinstance(module, nn.Linear) and module.weight.dtype != dtype:
                for pname, p in list(module.named_parameters(recurse=False)):
                    setattr(module, pname, nn.Parameter(p.detach().to(dtype), requires_grad=False))
                    pairs.append((getattr(module, pname), lambda p=p: p))
        copied = _copies[model] = (dtype, twin, pairs)
    device = next(model.parameters()).device.type
    with torch.no_grad(), torch.autocast(device, enabled=False):      # the merge in float32
        for mine, source in copied[2]:
            if mine.untyped_storage().size() == 0:                      # released after a call
                mine.untyped_storage().resize_(mine.numel() * mine.element_size())
            mine.copy_(source())
    return copied[1]


def release_copy(model):
    """Frees the sampler's copy of model (0.67 GB at Qwen2.5-0.5B) until its next call: its storage
    shrinks to nothing, as FSDP frees a gathered weight; the objects and compiled graphs stay."""
    copied = _copies.get(model)
    for mine, _ in copied[2] if copied else ():
        mine.untyped_storage().resize_(0)


def static_loop(model, idx, idx_mask, max_new_tokens, out, settings, compiled=False):
    """"graph" and "compile": the fixed-shape step, recorded as a CUDA graph on CUDA."""
    temperature, top_k, generator, stops, pad_id, want_logp, top_p = settings
    N, Tp = idx.shape
    device, c = idx.device, model.config
    slots = Tp + max_new_tokens
    if compiled:
        round_to = CACHE_ROUND if device.type == "cuda" else CPU_ROUND
        slots = -(-slots // round_to) * round_to
    dtype = operand_dtype(device.type, model.wte.weight.dtype)         # what projections return
    cache = KVCache.preallocated(c.n_layer, N, slots, c.kv_heads, c.head_size, dtype, device)
    head = model.head_weight(pad=True)                                  # (V, C) made once
    model = sampling_copy(model, dtype)                                 # bfloat16 under autocast
    h = model.hidden(idx, idx_mask, cache)                              # (N, Tp, C)
    logits = last_logits(model, h, head)                                # (N, V) the first token's
    check_finite(logits)
    longest = int(idx_mask.sum(1).max())                                # the longest prompt's
    token = torch.empty(N, 1, dtype=torch.long, device=device)          # the step's input
    slot = torch.full((1,), Tp, dtype=torch.long, device=device)        # the cache slot of token t
    body = compiled_decode_step() if compiled else decode_step

    def step():   # one token: everything a CUDA graph records
        h = body(model, token, cache, slot)                             # (N, C)
        logits = model.logits(h, head=head, fast=True)                  # (N, V)
        nxt, logp = draw(logits, temperature, top_k, generator, want_logp, top_p)
        token.copy_(record(out, nxt, logp, stops, pad_id, h))
        slot.add_(1)

    nxt, logp = draw(logits, temperature, top_k, generator, want_logp, top_p)   # token 0
    token.copy_(record(out, nxt, logp, stops, pad_id, h[:, -1]))
    run = step
    every = SYNC_EVERY if device.type == "cuda" else 1                  # steps between end checks
    for t in range(1, max_new_tokens):
        if (t - 1) % every == 0 and out.done.all():                     # a device sync
            break
        if longest + t > c.block_size:                                  # the eager forward's check
            raise ValueError(f"a sequence of {longest + t} real tokens exceeds block_size = "
                             f"{c.block_size}; shorten it or build the model with a larger "
                             f"block_size")
        run()
        if t == 1 and device.type == "cuda" and graph_safe(generator):  # ran once (warm-up): record
            run = cuda_graph(step, generator)


def graph_safe(generator):
    # the default generator is always graph-safe; another where torch has register_generator_state
    return generator is None or hasattr(torch.cuda.CUDAGraph, "register_generator_state")


def cuda_graph(step, generator):
    """step() (run once before) recorded as a CUDA graph; returns its replay. The generator is
    registered with the graph, so each replay draws what the eager step would draw at that point."""
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def left_pad(seqs, pad_id, device="cpu"):
    """Id lists -> left-padded tokens (B, T) and mask (B, T), as the sampler takes prompts."""
    T = max(len(s) for s in seqs)
    tokens = torch.tensor([[pad_id] * (T - len(s)) + list(s) for s in seqs], dtype=torch.long,
                          device=device)
    mask = torch.tensor([[0.0] * (T - len(s)) + [1.0] * len(s) for s in seqs], device=device)
    return tokens, mask


# -----------------------------------------------------------------------------
# Scoring what was sampled: step 2 of grpo, rloo, reinforce, agent and multiturn

class Scored:
    """What score() gives step 4 and the log: old_logp and ref_logp (B, Tn); on a logged step the
    exact KL(pi || ref) and pi's entropy over kl_mask's tokens / n_kl, sampler_gap (B, Tn) |the
    sampler's - the trainer's log-prob| on kl_mask and sampler_kl (else 0.0, 0.0, None, 0.0)."""

    def __init__(self, policy, ref, sampler_logp, kl_mask, n_kl, temperature, logged, invariant,
                 sampler_hidden):
        self.policy, self.ref, self.sampler_logp, self.kl_mask = policy, ref, sampler_logp, kl_mask
        self.n_kl, self.T, self.logged, self.invariant = n_kl, temperature, logged, invariant
        self.sampler_hidden, self.h_ref, self.ref_head = sampler_hidden, None, None
        self.old_logp = sampler_logp.clone() if invariant else torch.zeros_like(kl_mask)
        self.ref_logp = torch.zeros_like(kl_mask)
        self.kl_exact = self.entropy = self.sampler_kl = 0.0
        self.sampler_gap = torch.zeros_like(kl_mask) if logged else None

    @torch.no_grad()
    def own(self, rows, logp):
        """pi_old of `rows` (b, Tn): the policy's log-probs, detached (--batch_invariant: the
        sampler's stay). One pass of the loss (mu = 1) calls it with its own forward's."""
        if not self.invariant:
            self.old_logp[rows] = logp.detach()
        return self.old_logp[rows]

    @torch.no_grad()
    def measure(self, rows, logp, h, h_ref=None):
        """Logged: the exact KL, the entropy, sampler_kl and sampler_gap of `rows` from their
        log-probs (b, Tn) and the hidden states (b, T, C) they came from. One pass of the loss
        calls it after the backward, so that its logits never meet the graph's activations."""
        if self.logged:                                # (b, Tn) each
            mask, h = self.kl_mask[rows], h.detach()
            h_ref = self.h_ref[rows] if h_ref is None else h_ref
            kl_t, ent_t = kl_entropy(self.policy, self.ref, h, h_ref, mask, self.T,
                                     ref_head=self.ref_head)
            self.kl_exact += kl_t.sum() / self.n_kl                         # KL(pi || ref)
            self.entropy += ent_t.sum() / self.n_kl
            if self.sampler_hidden is not None:
                self.sampler_kl += sampler_kl(self.policy, self.sampler_hidden[rows], h, mask,
                                              self.T).sum() / self.n_kl
            # how far the trainer's log-probs are from those the sampler drew with (same weights)
            self.sampler_gap[rows] = torch.where(mask > 0, (self.sampler_logp[rows] -
                                                            logp.detach()).abs(), 0.0)


def sampler_kl(policy, sampler_hidden, h, mask, temperature=1.0):
    """KL(sampler || trainer) (B, Tn) over the whole support where mask is 1 (0 elsewhere): the
    next-token distributions of the sampler's final hidden states (B, Tn, C) and the trainer's
    (B, T, C; the last Tn predict the tokens), both through the policy's head (kl_entropy)."""
    return kl_entropy(policy, policy, sampler_hidden, h, mask, temperature)[0]


@torch.no_grad()
def score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, temperature, parts,
          logged, invariant=False, kl_mask=None, n_kl=1, sampler_hidden=None, policy_pass=True):
    """Scored: each model's forward once per part (a micro-batch's rows) through the loss's own
    completion_logprobs path (pi_old is the trainer's log-prob bit for bit). logged: also the exact
    KL(pi || ref) and the entropy (model.kl_entropy) over kl_mask (default mask) / n_kl. invariant
    (--batch_invariant): pi_old is sampler_logp, the same bits; the policy scores when logged.
    sampler_hidden (B, Tn, C), logged: also sampler_kl over kl_mask / n_kl. policy_pass False (one
    pass of the loss): the reference alone; the loss forward the rest (Scored.own, measure)."""
    Tn = mask.size(1)
    s = Scored(policy, ref, sampler_logp, mask if kl_mask is None else kl_mask, n_kl, temperature,
               logged, invariant, sampler_hidden)
    if logged and not policy_pass:               # for Scored.measure: the reference's head, kept
        s.ref_head = ref.head_weight(pad=True)       # a copy (F.pad): a parked ref's goes away
    for rows in parts:                                 # (b, Tp+Tn-1, C) final hidden states
        h_ref = completion_hidden(ref, prompt[rows], prompt_mask[rows], tokens[rows], mask[rows])
        s.ref_logp[rows] = ref.head_logprobs(h_ref, tokens[rows], temperature)
        if not policy_pass:
            if logged:                                 # (B, Tn, C): the completion's alone
                s.h_ref = s.h_ref if s.h_ref is not None else h_ref.new_zeros(*mask.shape,
                                                                              h_ref.size(-1))
                s.h_ref[rows] = h_ref[:, -Tn:]
        elif logged or not invariant:
            h = completion_hidden(policy, prompt[rows], prompt_mask[rows], tokens[rows],
                                  mask[rows])
            logp = policy.head_logprobs(h, tokens[rows], temperature)
            s.own(rows, logp)
            s.measure(rows, logp, h, h_ref)
    return s
