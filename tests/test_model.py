"""model.py: tokenizer, KV-cache sampling against full recomputation, padding, EOS handling, float32
logits under autocast, the compiled sampler against the eager one, the scalar head and
checkpoints."""
import os
import random
import struct
import zipfile

import pytest
import torch

from hf.checkpoint import CheckpointError, from_pretrained, load_checkpoint, save_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, KVCache, ScalarGPT, completion_logits, last_real


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
        want = model(full, full_mask)                                 # (B, T, V) one pass, no cache
        cache = KVCache(model.config.n_layer, B, full.size(1), "cpu")
        got = [model(prompts, pmask, cache)]                          # prefill
        for t in range(7):                                            # then one token at a time
            got.append(model(cont[:, t:t + 1], torch.ones(B, 1), cache))
        got = torch.cat(got, 1)
    real = full_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_the_decode_step_is_the_general_forward_bit_for_bit_up_to_block_size():
    """GPT.hidden's step (mask None, one token a row: the sampler's) reads the cache's key_mask and
    next_pos where the general path builds them: the same hidden states, bit for bit, on
    left-padded prompts of mixed lengths; the longest row may reach block_size exactly, and the
    next token is refused before anything is written."""
    tok = Tokenizer()
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=12, pos="rope")).eval()
    prompts, pmask = tok.encode_batch(["3+4*2=", "1=", "9-8="])       # longest: 6 real tokens
    B, Tp = prompts.shape
    cont = torch.randint(0, 256, (B, 6))
    caches = [KVCache(model.config.n_layer, B, Tp + 7, "cpu") for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model.hidden(prompts, pmask, cache)
        for t in range(6):                                            # up to 12 = block_size
            general = model.hidden(cont[:, t:t + 1], torch.ones(B, 1), caches[0])
            fast = model.hidden(cont[:, t:t + 1], None, caches[1])
            assert torch.equal(fast, general)
        assert torch.equal(caches[0].next_pos, caches[1].next_pos)
        assert caches[0].longest == caches[1].longest == 12 == int(caches[1].next_pos.max())
        with pytest.raises(ValueError, match="a sequence of 13 real tokens exceeds block_size"):
            model.hidden(cont[:, :1], None, caches[1])
    assert caches[1].length == Tp + 6 and not caches[1].key_mask[:, Tp + 6].any()


def test_sequence_longer_than_block_size_is_a_clear_error():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    with pytest.raises(ValueError, match="block_size = 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="n_head = 3"):
        GPTConfig(n_embd=32, n_head=3)


# -----------------------------------------------------------------------------
# Precision: the logits are float32 sums, never rounded to bfloat16

def test_under_autocast_the_head_sums_bfloat16_operands_in_float32():
    """Under bfloat16 autocast the LM head rounds its operands (the hidden state and the weight) to
    bfloat16 and sums the products in float32: the logits are float32, within float32 summation of
    the exact products of the rounded operands, and are not the bfloat16 rounding of the result
    (which moves a logit of 20 by up to 0.06). The sampler's fast form (fast=True) is the same
    numbers. CPU autocast stands in for the GPU's here."""
    model = peaked_model(13)
    x = torch.randint(0, 256, (3, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden(x)
        logits, fast = model(x), model.logits(h.detach(), fast=True)
        bf16_result = model.lm_head(h)                    # the head left to autocast: bfloat16 out
    assert logits.dtype == fast.dtype == torch.float32 and bf16_result.dtype == torch.bfloat16
    hb, wb = h.detach().bfloat16().double(), model.lm_head.weight.detach().bfloat16().double()
    want = hb @ wb.T                                      # float64 products of the rounded operands
    bound = 64 * 2**-24 * (hb.abs() @ wb.abs().T)         # float32 summation over 32 channels
    assert ((logits.detach().double() - want).abs() <= bound).all()
    assert ((fast.double() - want).abs() <= bound).all()
    # bf16 would be far off
    assert (bf16_result.detach().double() - want).abs().max() > 1e-3 * want.abs().max()
    logits.sum().backward()                               # and it trains: the gradient goes through
    assert model.wte.weight.grad is not None and torch.isfinite(model.wte.weight.grad).all()


def test_logits_without_autocast_are_exactly_the_plain_projection():
    """On the CPU (no autocast) the float32 head changes nothing, bit for bit: the results that were
    measured before it stay what they were."""
    model = peaked_model(14)
    tok = Tokenizer()
    p, m = tok.encode_batch(["3+4*2=", "1=", "9-8*7+6="])
    with torch.no_grad():
        assert torch.equal(model(p, m), model.lm_head(model.hidden(p, m)))


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
    padded = torch.cat([torch.full((1, 3), 257), seq,
                        torch.full((1, 2), 257)], 1)                        # left and right padding
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


def test_a_checkpoint_with_corrupt_tensor_bytes_is_refused_by_its_crc(tmp_path):
    """Bytes overwritten inside a tensor (the zip's sizes intact, so torch.load would read wrong
    weights as if whole): the part's CRC-32 fails and the load is one error naming the file; the
    intact file loads."""
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, peaked_model(11), "bytes")
    load_checkpoint(path)
    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as archive:
        part = max(archive.infolist(), key=lambda i: i.file_size)       # the largest tensor
    head = part.header_offset                         # the local header: 30 bytes, name, extra
    name_len, extra_len = struct.unpack("<HH", data[head + 26:head + 30])
    start = head + 30 + name_len + extra_len + part.file_size // 2
    data[start:start + 8] = b"garbage!"
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=f"{part.filename} fails its CRC check") as err:
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
    # what is not a checkpoint at all is called so, not "truncated or corrupt ... delete it"
    (tmp_path / "folder").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    for path, words in ((tmp_path / "folder", "a folder without config.json"),
                        (tmp_path / "config.json", "is not a checkpoint"),
                        (tmp_path / "data.jsonl", "is not a checkpoint")):
        with pytest.raises(CheckpointError, match=words) as err:
            load_checkpoint(str(path))
        assert "delete it" not in str(err.value)


def test_vocabulary_mismatch_is_a_clear_error(tmp_path):
    path = str(tmp_path / "small_vocab.pt")
    save_checkpoint(path, GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=1, n_embd=16)), "bytes")
    with pytest.raises(CheckpointError, match="vocabulary mismatch"):
        load_checkpoint(path, tokenizer=Tokenizer())


# -----------------------------------------------------------------------------
# The fused log-prob path (a large vocabulary) and gradient checkpointing

def test_the_fused_path_gives_the_log_probs_and_gradients_of_the_logits_path():
    """completion_logprobs with fused=True (LM head and log-softmax in kernels.linear_logprobs)
    against the float64 log-softmax of the model's own logits, on a left-padded batch at temperature
    0.7: the values, and the gradient of every parameter through a loss that weights each token
    differently."""
    from model import completion_logprobs
    torch.manual_seed(0)
    # an odd V above FUSED_VOCAB
    model = GPT(GPTConfig(vocab_size=9001, n_layer=2, n_head=2, n_embd=32))
    prompt = torch.randint(0, 9001, (3, 5))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]],
                               dtype=torch.float)
    tokens = torch.randint(0, 9001, (3, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float)
    weights = torch.randn(3, 4)

    def grads(logp):
        model.zero_grad()
        (torch.where(mask > 0, logp, 0.0) * weights).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    logits = completion_logits(model, prompt, prompt_mask, tokens, mask).double() / 0.7
    # (B, Tn) float64
    reference = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    expected = grads(reference)
    fused = completion_logprobs(model, prompt, prompt_mask, tokens, mask, 0.7, fused=True)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused.double()[mask > 0], reference[mask > 0], rtol=0, atol=2e-5)
    for k, g in grads(fused).items():
        scale = expected[k].abs().max().item()           # float32 rounding of sums over 9001 logits
        torch.testing.assert_close(g, expected[k], rtol=1e-4, atol=2e-6 * scale,
                                   msg=lambda m: f"{k}: {m}")
    unfused = completion_logprobs(model, prompt, prompt_mask, tokens, mask, 0.7, fused=False)
    torch.testing.assert_close(unfused, fused, rtol=0, atol=2e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_log_probs_are_over_the_tokenizers_ids_when_the_embedding_is_larger(fused):
    """Every Qwen2.5: the embedding has more rows than the tokenizer has ids (tokenizer_vocab). The
    trainer's log-probs, fused or not, are the float64 log-softmax over the first tokenizer_vocab
    rows of the head written here, from the hidden states: the rows past them (made large, so that a
    softmax over all rows would differ) take no part, and get no gradient."""
    from model import completion_hidden, completion_logprobs
    torch.manual_seed(0)
    V, rows = 9001, 9001 + 71                        # above FUSED_VOCAB: the fused kernel's support
    model = GPT(GPTConfig(vocab_size=rows, tokenizer_vocab=V, n_layer=1, n_head=2, n_embd=32))
    with torch.no_grad():
        model.lm_head.weight[V:] = 2.0 * torch.randn(71, 32)    # logits far above the real ones
    prompt, prompt_mask = torch.randint(0, V, (2, 4)), torch.ones(2, 4)
    tokens, mask = torch.randint(0, V, (2, 3)), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    h = completion_hidden(model, prompt, prompt_mask, tokens, mask)[:, -3:].double()    # (B, Tn, C)
    W = model.lm_head.weight.double()
    reference = torch.log_softmax(h @ W[:V].T / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    everything = torch.log_softmax(h @ W.T / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    assert (reference - everything).abs().min() > 1.0            # the padded rows would show
    logp = completion_logprobs(model, prompt, prompt_mask, tokens, mask, 0.7, fused=fused)
    torch.testing.assert_close(logp.double()[mask > 0], reference[mask > 0], rtol=0, atol=2e-5)
    model.zero_grad()
    torch.where(mask > 0, logp, 0.0).sum().backward()
    assert (model.lm_head.weight.grad[V:].abs().max() == 0
            and model.lm_head.weight.grad[:V].abs().max() > 0)


def test_the_fused_path_is_the_default_above_fused_vocab_only(monkeypatch):
    """Below FUSED_VOCAB the scripts' log-probs come from the logits (every default run
    bit-identical); above it, from the fused kernel: which one ran is seen by making the other
    raise."""
    import model as model_module
    calls = []
    monkeypatch.setattr(model_module, "linear_logprobs", lambda *a: calls.append("fused")
                        or torch.zeros(1, 2))
    small = GPT(GPTConfig(vocab_size=258, n_layer=1, n_head=2, n_embd=16))
    large = GPT(GPTConfig(vocab_size=model_module.FUSED_VOCAB + 1, n_layer=1, n_head=2, n_embd=16))
    idx, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3)
    out = model_module.token_logprobs(small, idx, mask, idx[:, 1:])
    assert calls == [] and out.shape == (1, 2) and torch.isfinite(out).all()
    model_module.token_logprobs(large, idx, mask, idx[:, 1:])
    assert calls == ["fused"]


def test_gradient_checkpointing_gives_the_same_gradients():
    """grad_checkpoint recomputes each block in backward: the same loss and gradients (rotary
    positions, grouped heads and dropout included: the recomputation replays the dropout masks),
    within float32 rounding."""
    config = GPTConfig(vocab_size=101, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, pos="rope",
                       norm="rmsnorm", mlp="swiglu", dropout=0.1)
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


# -----------------------------------------------------------------------------
# The packed layout (training and scoring on a GPU), scoring a chunk at a time, and the support

def test_the_packed_layout_gives_the_masked_layouts_hidden_states_and_gradients(monkeypatch):
    """On a GPU, a forward without a cache moves each row's real tokens to its front and runs plain
    causal attention (flash attention, no mask). Forced here on the CPU, in float64: the same hidden
    states at every real position and the same gradients as the explicit mask, for left padding,
    right padding, both, and a hole in the middle of a row, with grouped-query attention, rotary
    positions and gradient checkpointing."""
    import model as model_module
    config = GPTConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, pos="rope",
                       norm="rmsnorm", mlp="swiglu", bias=False)
    idx = torch.randint(0, 50, (5, 12))
    mask = torch.ones(5, 12, dtype=torch.float64)
    mask[0, :3] = mask[1, -4:] = mask[2, :2] = mask[2, -3:] = mask[3, 5:7] = 0
    real = mask > 0
    runs = []
    for packed in ((), ("cpu",)):
        monkeypatch.setattr(model_module, "PACKED_ATTENTION", packed)
        torch.manual_seed(0)
        model = GPT(config).double()
        model.grad_checkpoint = True
        h = model.hidden(idx, mask)
        (h[real] * torch.linspace(-1, 1, h.size(-1), dtype=torch.float64)).sum().backward()
        runs.append((h.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (h0, g0), (h1, g1) = runs
    torch.testing.assert_close(h1[real], h0[real], rtol=0, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=1e-12, msg=k)


def test_scoring_reads_the_log_probs_training_reads_and_the_kl_and_entropy_a_chunk_at_a_time():
    """grpo.py's step 2 (completion_hidden, head_logprobs, kl_entropy): the old and reference
    log-probs are completion_logprobs', bit for bit, on both the logits path and the fused one (a
    support above FUSED_VOCAB, tokenizer_vocab below the embedding); the exact KL and the entropy,
    taken 7 positions at a time, are the float64 KL(pi || ref) and entropy of the whole [B, Tn, V]
    logits over the support, 0 on padding."""
    from model import FUSED_VOCAB, completion_hidden, completion_logprobs, kl_entropy
    for V, support in ((300, 0), (FUSED_VOCAB + 300, FUSED_VOCAB + 100)):
        torch.manual_seed(V)
        config = GPTConfig(vocab_size=V, tokenizer_vocab=support, n_layer=2, n_head=2, n_embd=32)
        policy, ref = GPT(config).eval(), GPT(config).eval()
        prompt, tokens = torch.randint(0, 100, (3, 5)), torch.randint(0, 100, (3, 6))
        prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5, [0, 1, 1, 1, 1]], dtype=torch.float)
        mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]], dtype=torch.float)
        with torch.no_grad():
            h, h_ref = completion_hidden(policy, prompt, prompt_mask, tokens, mask), \
                completion_hidden(ref, prompt, prompt_mask, tokens, mask)
            for m, hh in ((policy, h), (ref, h_ref)):
                assert torch.equal(m.head_logprobs(hh, tokens, 0.8),
                                   completion_logprobs(m, prompt, prompt_mask, tokens, mask, 0.8))
            kl_t, ent_t = kl_entropy(policy, ref, h, h_ref, mask, 0.8, chunk=7)
            lp = completion_logits(policy, prompt, prompt_mask, tokens, mask).double() / 0.8
            lq = completion_logits(ref, prompt, prompt_mask, tokens, mask).double() / 0.8
        assert lp.size(-1) == config.support
        p, logp, logq = lp.softmax(-1), lp.log_softmax(-1), lq.log_softmax(-1)
        real = mask > 0
        torch.testing.assert_close(kl_t.double()[real], (p * (logp - logq)).sum(-1)[real],
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ent_t.double()[real], -(p * logp).sum(-1)[real], rtol=1e-5,
                                   atol=1e-6)
        assert (kl_t[~real] == 0).all() and (ent_t[~real] == 0).all()


def test_a_pretrained_folder_with_fewer_tokenizer_ids_than_embedding_rows_has_that_support(
    tmp_path):
    """Qwen2.5's layout: config.json's vocab_size above the ids of tokenizer.json. The config
    carries the tokenizer's count (tokenizer_vocab), the logits cover those ids only, and every id
    the model emits decodes."""
    import json
    import shutil
    from hf.checkpoint import pretrained_config
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "qwen2")
    padded = tmp_path / "padded"
    shutil.copytree(folder, padded)
    data = json.load(open(padded / "tokenizer.json"))      # 320 ids; keep 300 ordinary ones and EOS
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if i < 300}
    data["added_tokens"][0]["id"] = 300
    json.dump(data, open(padded / "tokenizer.json", "w"))
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(padded / name):
            c = json.load(open(padded / name))
            json.dump({**c, "eos_token_id": 300}, open(padded / name, "w"))
    config, n = pretrained_config(str(padded)), 301
    assert (config.vocab_size, config.tokenizer_vocab, config.support) == (320, n, n)
    model, tok = from_pretrained(str(padded)), Tokenizer.from_pretrained(str(padded))
    assert model(torch.tensor([[1, 2, 3]])).shape[-1] == tok.vocab_size == n
    assert isinstance(tok.decode(list(range(n - 5, config.vocab_size))), str)
