"""model.py: tokenizer, KV-cache sampling against full recomputation, padding, EOS handling,
float32 logits under autocast, the compiled sampler against the eager one, the scalar head and checkpoints."""
import os
import random

import pytest
import torch

from model import (GPT, CheckpointError, GPTConfig, KVCache, ScalarGPT, Tokenizer, completion_logits, last_real,
                   load_checkpoint, save_checkpoint)


def peaked_model(seed, vocab_size=258, **kw):
    """A random model whose logits are far from uniform, so greedy choices are not near-ties."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, **kw)).eval()
    with torch.no_grad():
        model.wte.weight.mul_(40.0)
    return model


def random_text(rng, n):
    alphabet = "abc 0123456789+-*=#,\n\té漢字😀ΩЖ<|>"
    return "".join(rng.choice(alphabet) for _ in range(n))


# -----------------------------------------------------------------------------
# Tokenizer

def test_tokenizer_round_trip_on_arbitrary_text():
    tok = Tokenizer()
    rng = random.Random()
    for _ in range(50):
        text = random_text(rng, rng.randint(0, 80))
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) == len(text.encode("utf-8"))  # byte level: one token per byte
        assert all(0 <= i < 256 for i in ids)


def test_plain_text_never_encodes_to_a_special_token():
    tok = Tokenizer()
    ids = tok.encode("<|endoftext|><|pad|>")
    assert tok.eos_id not in ids and tok.pad_id not in ids
    assert tok.decode(ids) == "<|endoftext|><|pad|>"
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258)


def test_unknown_tokenizer_name_gives_a_clear_error():
    with pytest.raises(ValueError, match="no_such_encoding"):
        Tokenizer("no_such_encoding")


def test_encode_batch_left_pads():
    tok = Tokenizer()
    tokens, mask = tok.encode_batch(["1+2=", "10+20="])
    assert tokens.shape == mask.shape == (2, 6)
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 1] and mask[1].tolist() == [1] * 6
    assert tokens[0, :2].tolist() == [tok.pad_id] * 2
    assert tok.decode(tokens[0, 2:].tolist()) == "1+2="


# -----------------------------------------------------------------------------
# KV cache and padding

def test_kv_cache_logits_match_full_recomputation_with_mixed_prompt_lengths():
    tok = Tokenizer()
    model = peaked_model(0)
    prompts, pmask = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6=", ""][:3])
    B, Tp = prompts.shape
    cont = torch.randint(0, 256, (B, 7))
    full = torch.cat([prompts, cont], 1)
    full_mask = torch.cat([pmask, torch.ones(B, 7)], 1)
    with torch.no_grad():
        want = model(full, full_mask)                                   # (B, T, V) one pass, no cache
        cache = KVCache(model.config.n_layer, B, full.size(1), "cpu")
        got = [model(prompts, pmask, cache)]                            # prefill
        for t in range(7):                                              # then one token at a time
            got.append(model(cont[:, t:t + 1], torch.ones(B, 1), cache))
        got = torch.cat(got, 1)
    real = full_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_argmax_of_full_recomputation():
    tok = Tokenizer()
    model = peaked_model(1)
    prompts, pmask = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6="])
    tokens, mask, truncated = model.generate(prompts, pmask, 12, tok.eos_id, tok.pad_id, temperature=0)
    full = torch.cat([prompts, tokens], 1)
    full_mask = torch.cat([pmask, torch.ones_like(mask)], 1)
    with torch.no_grad():
        logits = model(full, full_mask)
    Tp = prompts.size(1)
    argmax = logits[:, Tp - 1:-1].argmax(-1)                            # (B, Tn) what each step should pick
    assert torch.equal(argmax[mask.bool()], tokens[mask.bool()])


def test_completion_logits_line_up_with_the_sampled_tokens():
    """Row t of completion_logits must be the distribution generate drew completion token t from."""
    tok = Tokenizer()
    model = peaked_model(12)
    p, m = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6="])
    tokens, mask, _ = model.generate(p, m, 9, tok.eos_id, tok.pad_id, temperature=0)
    with torch.no_grad():
        logits = completion_logits(model, p, m, tokens, mask)          # (B, Tn, V)
    assert logits.shape[:2] == tokens.shape
    assert torch.equal(logits.argmax(-1)[mask.bool()], tokens[mask.bool()])


def test_completion_does_not_depend_on_the_rest_of_the_batch():
    tok = Tokenizer()
    model = peaked_model(2)
    texts = ["3+4*2=", "1=", "9-8*7+6=", "12345678901234="]
    p, m = tok.encode_batch(texts)
    batch_tokens, batch_mask, _ = model.generate(p, m, 10, tok.eos_id, tok.pad_id, temperature=0)
    for i, text in enumerate(texts):
        p1, m1 = tok.encode_batch([text])
        alone, alone_mask, _ = model.generate(p1, m1, 10, tok.eos_id, tok.pad_id, temperature=0)
        n = int(alone_mask.sum())
        assert int(batch_mask[i].sum()) == n
        assert batch_tokens[i, :n].tolist() == alone[0, :n].tolist()
        with torch.no_grad():  # and the logits themselves: padding neither leaks in nor shifts positions
            in_batch = model(p, m)[i, m[i].bool()]
            by_itself = model(p1, m1)[0]
        torch.testing.assert_close(in_batch, by_itself, rtol=1e-5, atol=1e-4)


def test_num_samples_puts_a_prompts_samples_on_consecutive_rows():
    tok = Tokenizer()
    model = peaked_model(3)
    p, m = tok.encode_batch(["1+1=", "2*3-4="])
    tokens, mask, _ = model.generate(p, m, 6, tok.eos_id, tok.pad_id, num_samples=3, temperature=0)
    assert tokens.shape[0] == 6
    assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[0], tokens[2])  # greedy: identical samples
    assert torch.equal(tokens[3], tokens[5])


def test_eos_mask_covers_through_first_eos_and_flags_cut_off_rows():
    eos, pad = 6, 7
    torch.manual_seed(4)
    model = GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=16)).eval()  # near-uniform: EOS ~1/8 a step
    prompts = torch.randint(0, 6, (64, 3))
    g = torch.Generator().manual_seed(5)
    tokens, mask, truncated = model.generate(prompts, torch.ones(64, 3), 10, eos, pad, temperature=1.0, generator=g)
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


def test_top_k_one_equals_greedy():
    tok = Tokenizer()
    model = peaked_model(6)
    p, m = tok.encode_batch(["3+4*2=", "1="])
    greedy, _, _ = model.generate(p, m, 8, tok.eos_id, tok.pad_id, temperature=0)
    top1, _, _ = model.generate(p, m, 8, tok.eos_id, tok.pad_id, temperature=1.0, top_k=1)
    assert torch.equal(greedy, top1)


def test_sequence_longer_than_block_size_is_a_clear_error():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    with pytest.raises(ValueError, match="block_size = 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="n_head = 3"):
        GPTConfig(n_embd=32, n_head=3)


# -----------------------------------------------------------------------------
# Precision: the logits are float32 even under bfloat16 autocast

def test_logits_are_float32_even_under_bfloat16_autocast():
    """The LM head runs outside autocast, on the hidden states in float32: the logits are their float32
    projection, not its bfloat16 rounding (which moves a logit of 20 by up to 0.06). CPU autocast stands in for
    the GPU's here: the switch is the same."""
    model = peaked_model(13)
    x = torch.randint(0, 256, (3, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden(x)
        logits = model(x)
        bf16_head = model.lm_head(h)                                    # the head under autocast: what it was
    assert logits.dtype == torch.float32 and bf16_head.dtype == torch.bfloat16
    want = h.detach().double() @ model.lm_head.weight.detach().double().T   # float64, from the same hidden states
    assert (logits.detach().double() - want).abs().max() < 1e-4 * want.abs().max()
    assert (bf16_head.detach().double() - want).abs().max() > 1e-3 * want.abs().max()   # bf16 would be far off
    logits.sum().backward()                                             # and it trains: the gradient goes through
    assert model.wte.weight.grad is not None and torch.isfinite(model.wte.weight.grad).all()


def test_logits_without_autocast_are_exactly_the_plain_projection():
    """On the CPU (no autocast) the float32 head changes nothing, bit for bit: the results that were measured
    before it stay what they were."""
    model = peaked_model(14)
    tok = Tokenizer()
    p, m = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6="])
    with torch.no_grad():
        assert torch.equal(model(p, m), model.lm_head(model.hidden(p, m)))


# -----------------------------------------------------------------------------
# The compiled sampler (generate(compile=True)) against the eager one

def compilation_unavailable():
    """Why torch.compile cannot run here (e.g. no C++ compiler for the CPU backend), or None if it can."""
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as e:  # noqa: BLE001 - any failure of a trivial compile means compiling is unavailable
        return f"torch.compile is unavailable here: {type(e).__name__}: {str(e)[:200]}"
    return None


def sampler_case(device):
    """A tiny random model (2 layers, so that layers read their own cache) over a 16-token vocabulary whose
    logits are a few units apart: temperature sampling is neither uniform nor deterministic and EOS (14) comes
    up often enough to end some rows. Four prompts of 7, 3, 1 and 5 real tokens, left-padded with 15."""
    torch.manual_seed(15)
    model = GPT(GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=2, n_embd=32)).to(device).eval()
    with torch.no_grad():
        model.wte.weight.mul_(5.0)
    g = torch.Generator().manual_seed(16)
    prompt, pmask = torch.full((4, 7), 15), torch.zeros(4, 7)
    for i, n in enumerate([7, 3, 1, 5]):
        prompt[i, 7 - n:] = torch.randint(0, 14, (n,), generator=g)
        pmask[i, 7 - n:] = 1.0
    return model, prompt.to(device), pmask.to(device)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the compiled step then runs as a CUDA graph)"))])
def test_compiled_sampler_gives_the_eager_samplers_tokens(device):
    """Greedy, temperature 1 and temperature 0.7 with top-k, each from the same generator seed: the compiled
    sampler returns exactly the eager sampler's tokens, masks and truncation flags, over prompts of different
    lengths (left padding) with 3 samples each. Every call after the first reuses its one compiled graph (the
    static cache is emptied and refilled in place, and stale contents would change the tokens)."""
    from torch._dynamo.utils import counters
    model, p, m = sampler_case(device)
    eos, pad = 14, 15

    def both(seed, **kw):
        runs = []
        for compile in (False, True):
            g = torch.Generator(device=device).manual_seed(seed)
            runs.append(model.generate(p, m, 20, eos, pad, num_samples=3, generator=g, compile=compile, **kw))
        return runs

    try:
        eager, compiled = both(17, temperature=0.0)                     # the first compiled call compiles
    except Exception:
        reason = compilation_unavailable()
        if reason:
            pytest.skip(reason)
        raise
    graphs = counters["stats"]["unique_graphs"]
    ended = truncated = 0
    for seed, kw in [(17, dict(temperature=0.0)), (18, dict(temperature=1.0)), (19, dict(temperature=1.0)),
                     (20, dict(temperature=0.7, top_k=5))]:
        eager, compiled = both(seed, **kw)
        for a, b in zip(eager, compiled):
            assert torch.equal(a, b), (seed, kw)
        ended, truncated = ended + int((~eager[2]).sum()), truncated + int(eager[2].sum())
    assert ended > 0 and truncated > 0                                  # rows ending in EOS and rows cut off: both
    assert counters["stats"]["unique_graphs"] == graphs                 # no recompilation after the first call


def test_a_shape_past_the_recompile_limit_runs_eagerly_instead_of_raising(monkeypatch):
    """With fullgraph=True, torch.compile raises on a shape past its recompile limit (8 graphs, here lowered to 1):
    the sampler's step falls back to the eager decode step and returns the eager sampler's tokens. The compile
    backend is dynamo's "eager" one here (the limit is dynamo's; no C++ compiler needed)."""
    import torch._dynamo
    import model as model_module
    compiled = torch.compile(GPT.decode_step, backend="eager", dynamic=False, fullgraph=True)
    monkeypatch.setitem(model_module._compiled_steps, "cpu", model_module.with_eager_fallback(compiled))
    model, p, m = sampler_case("cpu")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for rows in (2, 3, 4):                                          # three shapes, one graph allowed
            g1, g2 = torch.Generator().manual_seed(rows), torch.Generator().manual_seed(rows)
            eager = model.generate(p[:rows], m[:rows], 8, 14, 15, temperature=1.0, generator=g1, compile=False)
            compiled_out = model.generate(p[:rows], m[:rows], 8, 14, 15, temperature=1.0, generator=g2, compile=True)
            assert all(torch.equal(a, b) for a, b in zip(eager, compiled_out)), rows


def test_compiled_sampler_refuses_a_sequence_longer_than_block_size_as_the_eager_one_does():
    """The positions live on the device inside the compiled step, so the sampler checks block_size on the host,
    with the eager forward's message (before anything is compiled)."""
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=16)).eval()
    prompt = torch.randint(0, 14, (2, 8))
    for compile in (False, True):
        with pytest.raises(ValueError, match="a sequence of 9 real tokens exceeds block_size = 8"):
            model.generate(prompt, torch.ones(2, 8), 3, eos_id=-1, pad_id=15, temperature=0, compile=compile)


# -----------------------------------------------------------------------------
# Scalar head

def test_last_real_picks_the_last_one_of_the_mask():
    values = torch.arange(12.0).view(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0], [1, 0, 0, 0]]).float()
    assert last_real(values, mask).tolist() == [3.0, 6.0, 8.0]
    with pytest.raises(ValueError, match="no real token"):
        last_real(values, torch.zeros(3, 4))


def test_scalar_score_ignores_padding_on_either_side():
    torch.manual_seed(7)
    model = ScalarGPT(GPTConfig(n_layer=2, n_head=2, n_embd=32)).eval()
    torch.nn.init.normal_(model.head.weight)
    seq = torch.randint(0, 256, (1, 6))
    alone = model.score(seq, torch.ones(1, 6))
    padded = torch.cat([torch.full((1, 3), 257), seq, torch.full((1, 2), 257)], 1)  # left and right padding
    pmask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]).float()
    torch.testing.assert_close(model.score(padded, pmask), alone, rtol=1e-5, atol=1e-6)
    # and the score is the value at the last real token, not at a later or earlier one
    per_token = model(seq, torch.ones(1, 6))
    torch.testing.assert_close(alone, per_token[:, -1])


def test_scalar_from_policy_copies_the_backbone():
    policy = peaked_model(8)
    scalar = ScalarGPT.from_policy(policy)
    x = torch.randint(0, 256, (2, 5))
    torch.testing.assert_close(scalar.backbone(x), policy(x))
    assert scalar.score(x, torch.ones(2, 5)).abs().max() == 0  # head starts at zero


# -----------------------------------------------------------------------------
# Checkpoints

def test_checkpoint_round_trip_gives_identical_outputs(tmp_path):
    model = peaked_model(9)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 5))).sum().backward()
    opt.step()
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, model, "bytes", opt, step=17, args={"lr": 1e-3})
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the temp file was renamed away
    loaded, ckpt = load_checkpoint(path, kind="gpt", tokenizer=Tokenizer())
    x = torch.randint(0, 256, (3, 7))
    assert torch.equal(loaded.eval()(x), model(x))
    assert ckpt["step"] == 17 and ckpt["args"] == {"lr": 1e-3}
    opt2 = torch.optim.AdamW(loaded.parameters())
    opt2.load_state_dict(ckpt["optimizer"])


def test_scalar_checkpoint_round_trip(tmp_path):
    torch.manual_seed(10)
    model = ScalarGPT(GPTConfig(n_layer=1, n_head=1, n_embd=16)).eval()
    torch.nn.init.normal_(model.head.weight)
    path = str(tmp_path / "rm.pt")
    save_checkpoint(path, model, "bytes")
    loaded, _ = load_checkpoint(path, kind="scalar")
    x = torch.randint(0, 256, (2, 4))
    assert torch.equal(loaded.eval()(x), model(x))
    with pytest.raises(CheckpointError, match="'gpt' model is needed"):
        load_checkpoint(path, kind="gpt")


def test_truncated_checkpoint_raises_a_clear_error(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, peaked_model(11), "bytes")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_checkpoint(path)
    assert path in str(err.value)


def test_missing_and_foreign_checkpoints_raise_clear_errors(tmp_path):
    missing = str(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="no checkpoint at .*nope.pt"):
        load_checkpoint(missing)
    foreign = str(tmp_path / "foreign.pt")
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match="lacks"):
        load_checkpoint(foreign)


def test_vocabulary_mismatch_is_a_clear_error(tmp_path):
    path = str(tmp_path / "small_vocab.pt")
    save_checkpoint(path, GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=1, n_embd=16)), "bytes")
    with pytest.raises(CheckpointError, match="vocabulary mismatch"):
        load_checkpoint(path, tokenizer=Tokenizer())


# -----------------------------------------------------------------------------
# The fused log-prob path (a large vocabulary) and gradient checkpointing

def test_the_fused_path_gives_the_log_probs_and_gradients_of_the_logits_path():
    """completion_logprobs with fused=True (LM head and log-softmax in kernels.linear_logprobs) against the float64
    log-softmax of the model's own logits, on a left-padded batch at temperature 0.7: the values, and the gradient
    of every parameter through a loss that weights each token differently."""
    from model import completion_logprobs
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=9001, n_layer=2, n_head=2, n_embd=32))   # an odd V above FUSED_VOCAB
    prompt = torch.randint(0, 9001, (3, 5))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.float)
    tokens = torch.randint(0, 9001, (3, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float)
    weights = torch.randn(3, 4)

    def grads(logp):
        model.zero_grad()
        (torch.where(mask > 0, logp, 0.0) * weights).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    logits = completion_logits(model, prompt, prompt_mask, tokens, mask).double() / 0.7
    reference = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]        # (B, Tn) float64
    expected = grads(reference)
    fused = completion_logprobs(model, prompt, prompt_mask, tokens, mask, 0.7, fused=True)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused.double()[mask > 0], reference[mask > 0], rtol=0, atol=2e-5)
    for k, g in grads(fused).items():
        scale = expected[k].abs().max().item()                  # float32 rounding of sums over 9001 logits
        torch.testing.assert_close(g, expected[k], rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{k}: {m}")
    unfused = completion_logprobs(model, prompt, prompt_mask, tokens, mask, 0.7, fused=False)
    torch.testing.assert_close(unfused, fused, rtol=0, atol=2e-5)


def test_the_fused_path_is_the_default_above_fused_vocab_only(monkeypatch):
    """Below FUSED_VOCAB the scripts' log-probs come from the logits (every default run bit-identical); above it,
    from the fused kernel: which one ran is seen by making the other raise."""
    import model as model_module
    calls = []
    monkeypatch.setattr(model_module, "linear_logprobs", lambda *a: calls.append("fused") or torch.zeros(1, 2))
    small = GPT(GPTConfig(vocab_size=258, n_layer=1, n_head=2, n_embd=16))
    large = GPT(GPTConfig(vocab_size=model_module.FUSED_VOCAB + 1, n_layer=1, n_head=2, n_embd=16))
    idx, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3)
    out = model_module.token_logprobs(small, idx, mask, idx[:, 1:])
    assert calls == [] and out.shape == (1, 2) and torch.isfinite(out).all()
    model_module.token_logprobs(large, idx, mask, idx[:, 1:])
    assert calls == ["fused"]


def test_gradient_checkpointing_gives_the_same_gradients():
    """grad_checkpoint recomputes each block in backward: the same loss and gradients (rotary positions, grouped
    heads and dropout included: the recomputation replays the dropout masks), within float32 rounding."""
    config = GPTConfig(vocab_size=101, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, pos="rope", norm="rmsnorm",
                       mlp="swiglu", dropout=0.1)
    idx = torch.randint(0, 101, (2, 9))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.float)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(config).train()
        model.grad_checkpoint = checkpointing
        torch.manual_seed(1)                                   # the same dropout masks in both runs
        loss = (model(idx, mask).log_softmax(-1)[..., 0] * mask).sum()
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (loss0, g0), (loss1, g1) = results
    torch.testing.assert_close(loss1, loss0)
    assert any(g.abs().max() > 0 for g in g0.values())
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7, msg=k)
