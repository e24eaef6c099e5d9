"""sampler.py: the draw is torch.multinomial's, draw for draw; the three modes (eager, the
fixed-shape step recorded as a CUDA graph, and that step compiled) give the same tokens; padding,
EOS, num_samples and top-k; ids past the tokenizer are never drawn and the sampler's log-probs are
the trainer's over the same support; bad input."""
import pytest
import torch
import torch.nn.functional as F

import sampler
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, completion_hidden, completion_logits, completion_logprobs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the CUDA graph)"))]


def peaked_model(seed, vocab_size=258, **kw):
    """A random model whose logits are far from uniform, so greedy choices are not near-ties."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, **kw)).eval()
    with torch.no_grad():
        model.wte.weight.mul_(40.0)
    return model


def compilation_unavailable():
    """Why torch.compile cannot run here (e.g. no C++ compiler for the CPU backend), or None if it
    can."""
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    # noqa: BLE001 - any failure of a trivial compile means compiling is unavailable
    except Exception as e:
        return f"torch.compile is unavailable here: {type(e).__name__}: {str(e)[:200]}"
    return None


def sampler_case(device, **kw):
    """A tiny random model (2 layers, so that layers read their own cache) over a 16-token
    vocabulary whose logits are a few units apart: temperature sampling is neither uniform nor
    deterministic and EOS (14) comes up often enough to end some rows. Four prompts of 7, 3, 1 and 5
    real tokens, left-padded with 15. kw: more GPTConfig (grouped-query attention, rotary
    positions)."""
    torch.manual_seed(15)
    model = GPT(GPTConfig(**{"vocab_size": 16, "block_size": 40, "n_layer": 2, "n_head": 2,
                             "n_embd": 32, **kw}))
    model = model.to(device).eval()
    with torch.no_grad():
        model.wte.weight.mul_(5.0)
    g = torch.Generator().manual_seed(16)
    prompt, pmask = torch.full((4, 7), 15), torch.zeros(4, 7)
    for i, n in enumerate([7, 3, 1, 5]):
        prompt[i, 7 - n:] = torch.randint(0, 14, (n,), generator=g)
        pmask[i, 7 - n:] = 1.0
    return model, prompt.to(device), pmask.to(device)


# -----------------------------------------------------------------------------
# The draw

@pytest.mark.parametrize("V", [2, 37, 1000])
def test_draw_is_torch_multinomials_draw_for_draw(V):
    """From the same generator state, draw() picks what torch.multinomial(softmax(logits / T), 1)
    picks, for 30 successive draws (the generator advanced alike), at several temperatures, with
    top-k zeros in the distribution too; and it reports log softmax(logits / T) of the drawn
    token."""
    torch.manual_seed(V)
    g1, g2 = torch.Generator().manual_seed(V), torch.Generator().manual_seed(V)
    for i in range(30):
        logits = 3 * torch.randn(64, V)
        T, top_k = [1.0, 0.7, 2.5][i % 3], [None, min(5, V)][i % 2]
        got, logp = sampler.draw(logits, T, top_k, g1, want_logp=True)
        x = logits / T
        if top_k is not None:
            x = x.masked_fill(x < torch.topk(x, top_k, dim=-1).values[:, -1:], float("-inf"))
        want = torch.multinomial(F.softmax(x, -1), 1, generator=g2).squeeze(1)
        assert torch.equal(got, want), i
        torch.testing.assert_close(logp, F.log_softmax(x, -1).gather(1, want[:, None]).squeeze(1))
        if top_k is not None:                                           # never outside the top k
            assert (x.gather(1, got[:, None]) > float("-inf")).all()


def nucleus_reference(logits, T, top_p):
    """The nucleus from its definition in float64 (Holtzman et al. 2019): per row, the likeliest
    tokens in order until their probability reaches top_p; (kept (N, V) bool, the renormalised
    distribution (N, V), rows where a token's mass above it lies within 1e-6 of top_p)."""
    p = F.softmax(logits.double() / T, -1)
    ranked, order = p.sort(-1, descending=True)
    above = ranked.cumsum(-1) - ranked                                   # the mass likelier than it
    kept = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, above < top_p)
    near = ((above - top_p).abs() < 1e-6).any(-1)
    q = torch.where(kept, p, 0.0)
    return kept, q / q.sum(-1, keepdim=True), near


def hf_top_p(scores, top_p, min_tokens_to_keep=1):
    """transformers' TopPLogitsWarper.__call__ (generation/logits_process.py), ported."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
    sorted_indices_to_remove[..., -min_tokens_to_keep:] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices,
                                                         sorted_indices_to_remove)
    return scores.masked_fill(indices_to_remove, float("-inf"))


@pytest.mark.parametrize("V", [2, 37, 1000])
def test_top_p_keeps_the_nucleus_and_draws_from_it_renormalised(V):
    """keep_likeliest's nucleus against the float64 definition and transformers' warper (the kept
    set, row for row, away from rows within 1e-6 of the bound); draw() picks what multinomial picks
    from the renormalised nucleus, never outside it, and reports its log-prob there."""
    torch.manual_seed(V)
    g1, g2 = torch.Generator().manual_seed(V), torch.Generator().manual_seed(V)
    for i in range(30):
        logits = 3 * torch.randn(64, V)
        T, top_p = [1.0, 0.7, 2.5][i % 3], [0.5, 0.9, 0.95][i % 3 - 1]
        kept, q, near = nucleus_reference(logits, T, top_p)
        mine = sampler.keep_likeliest(logits / T, top_p=top_p) > float("-inf")
        theirs = hf_top_p(logits / T, top_p) > float("-inf")
        assert near.sum() <= 2 and torch.equal(mine[~near], kept[~near]), i
        assert torch.equal(theirs[~near], kept[~near]), i
        got, logp = sampler.draw(logits, T, None, g1, want_logp=True, top_p=top_p)
        want = torch.multinomial(q.float(), 1, generator=g2).squeeze(1)
        assert torch.equal(got[~near], want[~near]) and kept.gather(1, got[:, None]).all(), i
        torch.testing.assert_close(logp[~near], q.log().gather(1, got[:, None]).squeeze(1)[
            ~near].float(), rtol=0, atol=1e-5)


def test_top_p_by_hand_the_bound_reached_and_one_past():
    """Four equal tokens (every sum exact): top_p 0.25 keeps one, 0.5 keeps two (their mass reaches
    it exactly), a hair past 0.5 three, 1 all; 1/2, 1/4, 1/8, 1/8 at top_p 0.6: two. top-k runs
    first (as transformers' and vLLM's order): top_k 3 then top_p 0.7 of what is left."""
    flat = torch.zeros(1, 4)
    for top_p, n in ((0.25, 1), (0.5, 2), (0.5 + 1e-6, 3), (1.0, 4)):
        assert int((sampler.keep_likeliest(flat, top_p=top_p) > float("-inf")).sum()) == n, top_p
    halves = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    assert (sampler.keep_likeliest(halves, top_p=0.6) > float("-inf")).tolist() == \
        [[True, True, False, False]]
    both = sampler.keep_likeliest(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), top_k=3, top_p=0.7)
    assert (both > float("-inf")).tolist() == [[True, True, False, False]]   # 0.665 < 0.7


def test_top_p_one_is_the_full_softmax_and_a_tiny_one_is_greedy():
    tok = Tokenizer()
    model = peaked_model(6)
    p, m = tok.encode_batch(["3+4*2=", "1="])
    full = lambda **kw: sampler.generate(model, p, m, 8, tok.eos_id, tok.pad_id, temperature=1.0,
                                         generator=torch.Generator().manual_seed(3), **kw)
    assert all(torch.equal(a, b) for a, b in zip(full(), full(top_p=1.0)))
    greedy, _, _ = sampler.generate(model, p, m, 8, tok.eos_id, tok.pad_id, temperature=0)
    assert torch.equal(greedy, full(top_p=1e-6)[0])
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"top_p = {bad}; allowed: 0 < top_p <= 1"):
            full(top_p=bad)


# -----------------------------------------------------------------------------
# The modes give the eager sampler's tokens

# torch's own
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [{}, {"n_head": 4, "n_kv_head": 2, "pos": "rope",
                                         "norm": "rmsnorm", "mlp": "swiglu", "bias": False}],
                         ids=["gpt2-like", "qwen2-like"])
@pytest.mark.slow
def test_every_mode_gives_the_eager_samplers_tokens(device, config):
    """Greedy, temperature 1, 0.7 with top-k and 0.9 with top-p, each from one generator seed: the
    fixed-shape step ("graph": a CUDA graph on CUDA) and its compiled form return exactly the eager
    sampler's tokens, masks and truncation flags, and log-probs within float32 rounding (attention
    sums over every cache slot there), over prompts of different lengths (left padding) with 3
    samples each, in float32; and grouped-query attention reads the cache without copying it. On
    CUDA the host checks for the end every SYNC_EVERY tokens: the rows that end early are trimmed as
    the eager sampler trims them. A second call reuses the compiled step."""
    model, p, m = sampler_case(device, **config)
    eos, pad = 14, 15
    modes = ["eager", "graph"] + ([] if compilation_unavailable() else ["compile"])
    ended = truncated = 0
    for seed, kw in [(17, dict(temperature=0.0)), (18, dict(temperature=1.0)),
                     (19, dict(temperature=1.0)), (20, dict(temperature=0.7, top_k=5)),
                     (21, dict(temperature=0.9, top_p=0.9))]:
        runs = {}
        for mode in modes:
            g = torch.Generator(device=device).manual_seed(seed)
            runs[mode] = sampler.generate(model, p, m, 30, eos, pad, num_samples=3, generator=g,
                                          mode=mode, return_logprobs=kw["temperature"] > 0, **kw)
        eager = runs["eager"]
        for mode in modes[1:]:
            for a, b in zip(eager[:3], runs[mode][:3]):
                assert torch.equal(a, b), (mode, seed, kw)
            if len(eager) == 4:
                torch.testing.assert_close(runs[mode][3], eager[3], rtol=1e-5, atol=1e-5)
        ended, truncated = ended + int((~eager[2]).sum()), truncated + int(eager[2].sum())
    assert ended > 0 and truncated > 0                   # rows ending in EOS and rows cut off: both


@pytest.mark.parametrize("device", DEVICES)
def test_all_rows_ending_early_stop_the_graph_and_the_columns_are_trimmed(device):
    """EOS is made the likeliest token everywhere (about one chance in two at temperature 1): every
    row ends within a few tokens. On CUDA the graph mode checks the end only every SYNC_EVERY tokens
    and runs steps past it, yet returns exactly the eager sampler's tokens, trimmed after the last
    row's EOS."""
    model, p, m = sampler_case(device)

    def logits(x, **kw):
        out = GPT.logits(model, x, **kw)
        out[..., 14] = out.max(-1).values + 1.0                   # EOS (14) one unit above the rest
        return out
    model.logits = logits
    runs = []
    for mode in ("eager", "graph"):
        g = torch.Generator(device=device).manual_seed(0)
        runs.append(sampler.generate(model, p, m, 30, 14, 15, num_samples=3, generator=g,
                                     mode=mode))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    tokens, mask, truncated = runs[0]
    assert 1 < tokens.size(1) < sampler.SYNC_EVERY and not truncated.any()
    # the last column holds a real token
    assert mask[:, -1].any() and (tokens == 14).sum() == len(tokens)


def test_the_samplers_bfloat16_copy_changes_no_number_and_follows_the_model():
    """Under bfloat16 autocast the fixed-shape step reads a copy of the model whose linear layers
    hold bfloat16 weights (sampling_copy): autocast would cast the float32 ones to these very
    numbers, so the hidden states are the model's own, bit for bit; after the model's weights
    change, the next call's copy has the new ones; the model itself is untouched (float32, its own
    parameters). CPU autocast stands in for the GPU's."""
    model, p, m = sampler_case("cpu", n_head=4, n_kv_head=2, pos="rope", norm="rmsnorm",
                               mlp="swiglu", bias=False)
    before = [q.clone() for q in model.parameters()]
    for change in (False, True):
        if change:
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(0.01 * torch.randn_like(q))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            twin = sampler.sampling_copy(model, torch.bfloat16)
            assert torch.equal(twin.hidden(p, m), model.hidden(p, m))
        assert (twin.blocks[0].attn.c_attn.weight.dtype == torch.bfloat16
                and twin.wte.weight is model.wte.weight)
    assert all(q.dtype == torch.float32 for q in model.parameters()) and not all(
        torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sampler.sampling_copy(model, torch.float32) is model


def test_lora_adapters_are_merged_into_the_samplers_copy_and_draw_the_same_tokens():
    """With LoRA the fixed-shape step reads one linear layer per projection holding W + (alpha/r) B
    A (no adapter work per token): in float32 on CPU its tokens are the unmerged adapters' (the
    eager sampler), greedy and sampled from the same generator; after the adapters change the next
    call's copy has them; the model keeps its adapters; between calls the copy holds no memory
    (release_copy). Under bfloat16 autocast it holds bf16(W + (alpha/r) B A)."""
    from lora import LoRALinear, add_adapters
    model, p, m = sampler_case("cpu", n_head=4, n_kv_head=2, pos="rope", norm="rmsnorm",
                               mlp="swiglu", bias=False)
    model = add_adapters(model, 4, 8.0)
    for change in range(2):
        with torch.no_grad():
            for name, q in model.named_parameters():
                if "lora_B" in name:
                    q.copy_(0.3 * torch.randn_like(q))             # adapters that change the logits
        for temperature in (0.0, 1.0):
            got = [sampler.generate(model, p, m, 12, 14, 15, num_samples=3, temperature=temperature,
                                    mode=mode, generator=torch.Generator().manual_seed(change))[0]
                   for mode in ("eager", "graph")]
            assert torch.equal(got[0], got[1]), (change, temperature)
            copied = sampler._copies[model][2]     # between calls the copy's weights hold no memory
            assert copied and all(t.untyped_storage().size() == 0 for t, _ in copied)
        twin = sampler.sampling_copy(model, torch.float32)
        attn = twin.blocks[0].attn.c_attn
        assert (type(attn) is torch.nn.Linear
                and not any(isinstance(x, LoRALinear) for x in twin.modules()))
        lora = model.blocks[0].attn.c_attn
        assert torch.allclose(attn.weight, lora.base.weight + lora.delta_weight(), atol=0, rtol=0)
        with torch.no_grad():
            assert torch.allclose(twin.hidden(p, m), model.hidden(p, m), atol=1e-5)
    assert isinstance(model.blocks[0].attn.c_attn, LoRALinear)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        twin = sampler.sampling_copy(model, torch.bfloat16)
    lora = model.blocks[1].mlp.c_fc
    assert torch.equal(twin.blocks[1].mlp.c_fc.weight,
                       (lora.base.weight + lora.delta_weight()).bfloat16())


def test_a_shape_past_the_recompile_limit_runs_eagerly_instead_of_raising(monkeypatch):
    """With fullgraph=True, torch.compile raises on a shape past its recompile limit (8 graphs, here
    lowered to 1): the compiled step falls back to the same step run eagerly and returns the eager
    sampler's tokens. The compile backend is dynamo's "eager" one here (the limit is dynamo's; no
    C++ compiler needed)."""
    import torch._dynamo
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn,
                        **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(sampler, "_compiled", [])
    model, p, m = sampler_case("cpu")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for rows in (2, 3, 4):                                     # three shapes, one graph allowed
            g1, g2 = torch.Generator().manual_seed(rows), torch.Generator().manual_seed(rows)
            eager = sampler.generate(model, p[:rows], m[:rows], 8, 14, 15, temperature=1.0,
                                     generator=g1, mode="eager")
            compiled = sampler.generate(model, p[:rows], m[:rows], 8, 14, 15, temperature=1.0,
                                        generator=g2, mode="compile")
            assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), rows


# -----------------------------------------------------------------------------
# What a sampler must get right, in every mode

MODES = ["eager", "graph"]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_generation_equals_argmax_of_full_recomputation(mode):
    tok = Tokenizer()
    model = peaked_model(1)
    prompts, pmask = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6="])
    tokens, mask, truncated = sampler.generate(model, prompts, pmask, 12, tok.eos_id, tok.pad_id,
                                               temperature=0, mode=mode)
    full = torch.cat([prompts, tokens], 1)
    full_mask = torch.cat([pmask, torch.ones_like(mask)], 1)
    with torch.no_grad():
        logits = model(full, full_mask)
    Tp = prompts.size(1)
    argmax = logits[:, Tp - 1:-1].argmax(-1)                    # (B, Tn) what each step should pick
    assert torch.equal(argmax[mask.bool()], tokens[mask.bool()])


def test_completion_logits_line_up_with_the_sampled_tokens():
    """Row t of completion_logits must be the distribution the sampler drew completion token t
    from."""
    tok = Tokenizer()
    model = peaked_model(12)
    p, m = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6="])
    tokens, mask, _ = sampler.generate(model, p, m, 9, tok.eos_id, tok.pad_id, temperature=0)
    with torch.no_grad():
        logits = completion_logits(model, p, m, tokens, mask)          # (B, Tn, V)
    assert logits.shape[:2] == tokens.shape
    assert torch.equal(logits.argmax(-1)[mask.bool()], tokens[mask.bool()])


@pytest.mark.parametrize("mode", MODES)
def test_completion_does_not_depend_on_the_rest_of_the_batch(mode):
    tok = Tokenizer()
    model = peaked_model(2)
    texts = ["3+4*2=", "1=", "9-8*7+6=", "12345678901234="]
    p, m = tok.encode_batch(texts)
    batch_tokens, batch_mask, _ = sampler.generate(model, p, m, 10, tok.eos_id, tok.pad_id,
                                                   temperature=0, mode=mode)
    for i, text in enumerate(texts):
        p1, m1 = tok.encode_batch([text])
        alone, alone_mask, _ = sampler.generate(model, p1, m1, 10, tok.eos_id, tok.pad_id,
                                                temperature=0, mode=mode)
        n = int(alone_mask.sum())
        assert int(batch_mask[i].sum()) == n
        assert batch_tokens[i, :n].tolist() == alone[0, :n].tolist()
        # and the logits themselves: padding neither leaks in nor shifts positions
        with torch.no_grad():
            in_batch = model(p, m)[i, m[i].bool()]
            by_itself = model(p1, m1)[0]
        torch.testing.assert_close(in_batch, by_itself, rtol=1e-5, atol=1e-4)


def test_num_samples_puts_a_prompts_samples_on_consecutive_rows():
    tok = Tokenizer()
    model = peaked_model(3)
    p, m = tok.encode_batch(["1+1=", "2*3-4="])
    tokens, mask, _ = sampler.generate(model, p, m, 6, tok.eos_id, tok.pad_id, num_samples=3,
                                       temperature=0)
    assert tokens.shape[0] == 6
    assert (torch.equal(tokens[0], tokens[1])
            and torch.equal(tokens[0], tokens[2]))                       # greedy: identical samples
    assert torch.equal(tokens[3], tokens[5])


@pytest.mark.parametrize("mode", MODES)
def test_eos_mask_covers_through_first_eos_and_flags_cut_off_rows(mode):
    eos, pad = 6, 7
    torch.manual_seed(4)
    # near-uniform: EOS ~1/8 a step
    model = GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=16)).eval()
    prompts = torch.randint(0, 6, (64, 3))
    g = torch.Generator().manual_seed(5)
    tokens, mask, truncated = sampler.generate(model, prompts, torch.ones(64, 3), 10, eos, pad,
                                               temperature=1.0, generator=g, mode=mode)
    ended = cut = 0
    for row, m, tr in zip(tokens.tolist(), mask.tolist(), truncated.tolist()):
        if eos in row:
            first = row.index(eos)
            assert m == [1.0] * (first + 1) + [0.0] * (len(row) - first - 1)
            assert row[first + 1:] == [pad] * (len(row) - first - 1)
            assert not tr
            ended += 1
        else:
            assert m == [1.0] * len(row) and len(row) == 10
            assert tr
            cut += 1
    assert ended > 0 and cut > 0  # both cases were exercised


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_several_stop_ids_each_end_a_row_and_the_samplers_log_probs_are_0_after_it(mode):
    """Three stop ids (a chat model's: <|eot_id|>, <|eom_id|>, <|end_of_text|>): whichever comes
    first ends the row and stays as sampled, the mask runs through it, padding follows; the
    sampler's own log-probs are its log-softmax at each sampled token up to the end (recomputed
    here) and exactly 0 after it, as its docstring promises."""
    stops, pad = [5, 6, 7], 4
    torch.manual_seed(4)
    # near-uniform: a stop ~3/8 a step
    model = GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=16)).eval()
    prompts = torch.randint(0, 4, (64, 3))
    g = torch.Generator().manual_seed(5)
    tokens, mask, truncated, logp = sampler.generate(model, prompts, torch.ones(64, 3), 10, stops,
                                                     pad, temperature=1.3, generator=g, mode=mode,
                                                     return_logprobs=True)
    seen = set()
    for i, (row, m) in enumerate(zip(tokens.tolist(), mask.tolist())):
        ends = [t for t, x in enumerate(row) if x in stops]
        end = ends[0] + 1 if ends else len(row)
        seen |= {row[ends[0]]} if ends else set()
        assert m == [1.0] * end + [0.0] * (len(row) - end) and row[end:] == [pad] * (len(row) - end)
        assert bool(truncated[i]) == (not ends)
        assert (logp[i, end:] == 0).all() and (logp[i, :end] < 0).all()
        want = completion_logits(model, prompts[i:i + 1], torch.ones(1, 3), tokens[i:i + 1, :end],
                                 mask[i:i + 1, :end])[0].div(1.3).log_softmax(-1)
        torch.testing.assert_close(logp[i, :end], want.gather(1, tokens[i, :end, None]).squeeze(1),
                                   rtol=0, atol=1e-5)
    assert seen == set(stops) and truncated.any()      # every stop id ended a row, and some ran out


def test_top_k_one_equals_greedy():
    tok = Tokenizer()
    model = peaked_model(6)
    p, m = tok.encode_batch(["3+4*2=", "1="])
    greedy, _, _ = sampler.generate(model, p, m, 8, tok.eos_id, tok.pad_id, temperature=0)
    top1, _, _ = sampler.generate(model, p, m, 8, tok.eos_id, tok.pad_id, temperature=1.0, top_k=1)
    assert torch.equal(greedy, top1)


# -----------------------------------------------------------------------------
# One support for sampling and scoring: an embedding larger than the tokenizer (Qwen2.5's layout)

@pytest.mark.parametrize("mode", MODES)
def test_ids_past_the_tokenizer_are_never_sampled_and_the_trainer_scores_the_same_support(mode):
    """A model with 40 embedding rows of which the tokenizer has 30, whose rows 30..39 have the
    largest logits of all, sampled at temperature 20 (near-uniform): no id past 29 is ever drawn,
    and the sampler's own log-probs are the trainer's (completion_logprobs) to float32 rounding, the
    ratio 1: over all 40 rows the trainer would put most of the probability on ids the sampler never
    draws, and the ratio would be far from 1."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, tokenizer_vocab=30, block_size=64, n_layer=2, n_head=4,
                          n_kv_head=2, n_embd=32, pos="rope", norm="rmsnorm", mlp="swiglu",
                          bias=False)).eval()
    with torch.no_grad():
        # rows past the tokenizer: the largest logits
        model.lm_head.weight[30:] = 3 * model.ln_f.weight * 10
    prompt, pmask = torch.randint(0, 30, (8, 5)), torch.ones(8, 5)
    g = torch.Generator().manual_seed(1)
    tokens, mask, _, logp = sampler.generate(model, prompt, pmask, 24, eos_id=29, pad_id=29,
                                             num_samples=4, temperature=20.0, generator=g,
                                             mode=mode, return_logprobs=True)
    # all over the support, never past
    assert tokens.max() < 30 and len(set(tokens[mask > 0].tolist())) > 20
    P = prompt.repeat_interleave(4, 0), pmask.repeat_interleave(4, 0)
    with torch.no_grad():
        trainer = completion_logprobs(model, *P, tokens, mask, temperature=20.0)
        everything = F.log_softmax(
            model.lm_head(model.hidden(torch.cat([P[0], tokens], 1)[:, :-1],
                                       torch.cat([P[1], mask], 1)[:, :-1])) / 20, -1)
    real = mask > 0
    torch.testing.assert_close(trainer[real], logp[real], rtol=0, atol=2e-5)        # the ratio is 1
    over_all = everything[:, prompt.size(1) - 1:].gather(2, tokens[..., None]).squeeze(2)
    assert (over_all[real] - logp[real]).abs().mean() > 0.5           # what one support prevents
    assert model(prompt, pmask).shape[-1] == 30                       # the logits: the support only


# -----------------------------------------------------------------------------
# The sampler's whole distribution: its hidden states, and sampler_kl over the support

@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_hidden_states_kept_are_those_each_token_was_drawn_from(mode):
    """return_hidden: through the model's head and log-softmax, each kept state (N, Tn, C) gives
    the sampler's own log-prob of the token drawn from it, the first token's (the prompt's last
    position) included; the tokens and log-probs are those of a call without it."""
    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=12, n_layer=2, n_head=2, n_embd=16)).eval()
    prompts, pmask = torch.randint(0, 10, (6, 4)), torch.ones(6, 4)
    pmask[:2, :2] = 0                                                    # left padding
    draw = lambda **k: sampler.generate(model, prompts, pmask, 9, 11, 10, num_samples=2,
                                        temperature=1.4, mode=mode, return_logprobs=True,
                                        generator=torch.Generator().manual_seed(3), **k)
    tokens, mask, truncated, logp, hidden = draw(return_hidden=True)
    assert hidden.shape == (*tokens.shape, 16)
    for a, b in zip((tokens, mask, truncated, logp), draw()):
        assert torch.equal(a, b)
    with torch.no_grad():
        again = model.logits(hidden).div(1.4).log_softmax(-1).gather(2, tokens[..., None])[..., 0]
    real = mask > 0
    torch.testing.assert_close(again[real], logp[real], rtol=0, atol=1e-6)


def kl_float64(h_p, h_q, w, T):
    """sum_v p_v (log p_v - log q_v): p, q = softmax(h W^T / T) of h_p, h_q; in float64."""
    w = w.detach().double()
    lp = (h_p.double() @ w.T / T).log_softmax(-1)
    lq = (h_q.double() @ w.T / T).log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_sampler_kl_is_kl_of_the_samplers_distribution_from_the_trainers():
    """sampler_kl against float64 from its equation on random states: KL(sampler || trainer), not
    the reverse (the two differ on these), 0 where masked, exactly 0 on equal states, and on the
    trainer's positions: the last Tn of (B, T, C)."""
    torch.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=1, n_embd=8)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_()                                  # logits of size ~10
    B, Tn, T = 3, 4, 7
    mine, h = torch.randn(B, Tn, 8) * 3, torch.randn(B, T, 8) * 3
    mask = torch.ones(B, Tn)
    mask[0, 2:] = 0
    with torch.no_grad():
        got = sampler.sampler_kl(model, mine, h, mask, temperature=0.7)
        same = sampler.sampler_kl(model, h[:, -Tn:], h, mask, temperature=0.7)
    want = kl_float64(mine, h[:, -Tn:], model.lm_head.weight, 0.7) * mask
    reverse = kl_float64(h[:, -Tn:], mine, model.lm_head.weight, 0.7) * mask
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    assert (got.double() - reverse).abs().max() > 1 and (got[mask == 0] == 0).all()
    assert (same == 0).all() and (got[mask > 0] > 0).all()


def test_score_logs_the_samplers_kl_from_its_hidden_states():
    """sampler.score on a logged step: sampler_kl is the mean over kl_mask's tokens of
    sampler_kl (n_kl the count), about 0 for the sampler's own states (float32 sums in another
    order) and the float64 figure for planted ones; not logged: 0.0."""
    torch.manual_seed(6)
    model = GPT(GPTConfig(vocab_size=12, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)                           # logits of size ~2
    prompt, pmask = torch.randint(0, 10, (4, 3)), torch.ones(4, 3)
    tokens, mask, _, logp, hidden = sampler.generate(
        model, prompt, pmask, 6, 11, 10, temperature=1.0, return_logprobs=True,
        return_hidden=True, generator=torch.Generator().manual_seed(7))
    n = mask.sum()
    run = lambda states, logged=True: sampler.score(model, model, prompt, pmask, tokens, mask, logp,
                                                    1.0, [torch.arange(4)], logged, n_kl=n,
                                                    sampler_hidden=states).sampler_kl
    assert 0 <= float(run(hidden)) < 1e-7
    planted = hidden + torch.randn_like(hidden)
    with torch.no_grad():
        h = completion_hidden(model, prompt, pmask, tokens, mask)
    want = (kl_float64(planted, h[:, -tokens.size(1):], model.lm_head.weight, 1.0) * mask).sum() / n
    assert float(run(planted)) == pytest.approx(float(want), rel=1e-4) and float(want) > 0.05
    assert run(planted, logged=False) == 0.0


def test_decoding_never_raises_on_an_id_the_model_can_emit():
    """Tokenizer.decode of ids the tokenizer does not have (past its vocabulary, negative) gives
    U+FFFD for each."""
    tok = Tokenizer()
    assert tok.decode([72, 105, 1000, 33, -1]) == "Hi\ufffd!\ufffd"
    assert tok.decode_completions(torch.tensor([[72, 300, 256]]), torch.ones(1, 3)) == ["H\ufffd"]


# -----------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("mode", MODES)
def test_a_sequence_longer_than_block_size_is_refused_as_the_eager_forward_refuses_it(mode):
    """The positions live on the device inside the fixed-shape step, so the sampler checks
    block_size on the host, with the eager forward's message."""
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=16)).eval()
    prompt = torch.randint(0, 14, (2, 8))
    with pytest.raises(ValueError, match="a sequence of 9 real tokens exceeds block_size = 8"):
        sampler.generate(model, prompt, torch.ones(2, 8), 3, eos_id=-1, pad_id=15, temperature=0,
                         mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_nan_weights_are_one_clear_error_not_garbage_tokens(mode):
    model, p, m = sampler_case("cpu")
    with torch.no_grad():
        model.blocks[0].mlp[0].weight[0, 0] = float("nan")
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="not finite"):
            sampler.generate(model, p, m, 5, 14, 15, temperature=temperature, mode=mode)


def test_bad_arguments_are_refused():
    model, p, m = sampler_case("cpu")
    for kw, words in [(dict(max_new_tokens=0), "max_new_tokens = 0"),
                      (dict(temperature=-1.0), "temperature = -1"),
                      (dict(mode="fast"), "sampler mode 'fast'")]:
        with pytest.raises(ValueError, match=words):
            sampler.generate(model, p, m, **{"max_new_tokens": 4, "eos_id": 14, **kw})


# -----------------------------------------------------------------------------
# score: step 2 of the on-policy scripts

def test_score_is_the_float64_reference_over_any_micro_batches_and_kl_mask():
    """pi_old, pi_ref, the exact KL(pi || ref) and pi's entropy summed over kl_mask / n_kl, and the
    gap to the sampler's log-probs, against float64 recomputed here from each model's logits
    (softmax at the temperature over the whole support): one part or three give the same; a
    kl_mask that leaves tokens out (the environment's) counts only the rest; --batch_invariant
    takes pi_old from the sampler and scores the policy on logged steps alone."""
    policy, ref = peaked_model(1), peaked_model(2)
    g = torch.Generator().manual_seed(0)
    B, Tp, Tn, T = 5, 4, 6, 0.7
    prompt = torch.randint(3, 200, (B, Tp), generator=g)
    prompt_mask = torch.ones(B, Tp)
    prompt_mask[0, :2] = prompt_mask[3, :1] = 0                               # left padding
    tokens = torch.randint(3, 200, (B, Tn), generator=g)
    mask = torch.ones(B, Tn)
    mask[1, 4:] = mask[2, 2:] = 0                                             # right padding
    kl_mask = mask.clone()
    kl_mask[0, 1:3] = kl_mask[4, 0] = 0                                       # the environment's
    with torch.no_grad():
        lp, lq = (F.log_softmax(completion_logits(m, prompt, prompt_mask, tokens, mask).double()
                                / T, -1) for m in (policy, ref))              # (B, Tn, V)
    p = lp.exp()
    want_old, want_ref = (x.gather(-1, tokens[..., None])[..., 0] for x in (lp, lq))
    n_kl = 13.0
    want_kl = ((p * (lp - lq)).sum(-1) * kl_mask).sum() / n_kl
    want_ent = (-(p * lp).sum(-1) * kl_mask).sum() / n_kl
    sampler_logp = (want_old + 0.01 * torch.rand(B, Tn, generator=g, dtype=torch.float64)).float()
    whole = None
    for parts in ([slice(0, B)], [slice(0, 2), slice(2, 3), slice(3, B)]):
        s = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, T, parts,
                          logged=True, kl_mask=kl_mask, n_kl=n_kl)
        real = mask > 0
        assert torch.allclose(s.old_logp[real].double(), want_old[real], atol=1e-5)
        assert torch.allclose(s.ref_logp[real].double(), want_ref[real], atol=1e-5)
        assert abs(float(s.kl_exact) - want_kl.item()) < 1e-5 < want_kl.item()
        assert abs(float(s.entropy) - want_ent.item()) < 1e-5 < want_ent.item()
        gap = torch.where(kl_mask > 0, (sampler_logp.double() - want_old).abs(), 0.0)
        assert torch.allclose(s.sampler_gap.double(), gap, atol=1e-5)
        whole = whole or s
    quiet = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, T,
                          [slice(0, B)], logged=False)
    assert quiet.kl_exact == quiet.entropy == 0.0 and quiet.sampler_gap is None
    assert torch.equal(quiet.old_logp, whole.old_logp)          # the same forward, logged or not
    invariant = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, T,
                              [slice(0, B)], logged=False, invariant=True)
    assert torch.equal(invariant.old_logp, sampler_logp) and invariant.sampler_gap is None
    logged = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, T,
                           [slice(0, B)], logged=True, invariant=True)
    assert torch.equal(logged.old_logp, sampler_logp)                      # the sampler's bits
    assert torch.equal(logged.sampler_gap,
                       torch.where(mask > 0, (sampler_logp - whole.old_logp).abs(), 0.0))


def test_one_pass_of_the_loss_gives_score_what_the_policy_pass_would():
    """policy_pass=False (mu = 1): the reference alone in score, then Scored.own on each part with
    the loss's own forward (with gradient, completion_logprobs(return_hidden=True)) gives pi_old,
    the KL, the entropy, the gap and sampler_kl equal bit for bit to the policy pass's, logged or
    not, --batch_invariant or not; the reference may be parked (its weights gone) meanwhile: a
    support of 256 rows, whose head weight is the parameter itself (no padding, no cast)."""
    from plumbing.parking import Parked
    policy, ref = peaked_model(1, 256), peaked_model(2, 256)
    g = torch.Generator().manual_seed(1)
    B, Tp, Tn, T = 5, 4, 6, 0.7
    prompt, tokens = (torch.randint(3, 200, (B, n), generator=g) for n in (Tp, Tn))
    prompt_mask, mask = torch.ones(B, Tp), torch.ones(B, Tn)
    prompt_mask[0, :2] = mask[1, 4:] = mask[2, 2:] = 0
    kl_mask = mask.clone()
    kl_mask[4, 0] = 0
    sampler_logp = -torch.rand(B, Tn, generator=g)
    hidden = torch.randn(B, Tn, policy.config.n_embd, generator=g)   # the sampler's states
    parts = [slice(0, 2), slice(2, B)]
    parked = Parked(ref)
    fields = ("old_logp", "ref_logp", "kl_exact", "entropy", "sampler_gap", "sampler_kl")
    for logged, inv in ((True, False), (False, False), (True, True), (False, True)):
        with parked:
            want = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, T,
                                 parts, logged, inv, kl_mask, 7.0, hidden)
            got = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, T,
                                parts, logged, inv, kl_mask, 7.0, hidden, policy_pass=False)
        assert all(p.untyped_storage().size() == 0 for p in ref.parameters())   # parked again
        for rows in parts:
            logp, h = completion_logprobs(policy, prompt[rows], prompt_mask[rows], tokens[rows],
                                          mask[rows], T, return_hidden=True)
            assert logp.requires_grad
            old = got.own(rows, logp)
            got.measure(rows, logp, h)
            assert not old.requires_grad and torch.equal(old, want.old_logp[rows])
        for f in fields:
            a, b = getattr(want, f), getattr(got, f)
            assert (a is None and b is None) or torch.equal(torch.as_tensor(a),
                                                            torch.as_tensor(b)), (f, logged, inv)
        assert (float(got.kl_exact) > 0 and float(got.sampler_kl) > 0) == logged
