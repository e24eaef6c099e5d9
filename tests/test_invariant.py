"""--batch_invariant (kernels/invariant.py): the tiled products and attention against float64
references; the sampler's cached decode and the trainer's whole-sequence forward equal bit for bit
over random batch compositions, model families and LoRA, and unequal when any one piece is made
batch-variant again; grpo.py --batch_invariant logs sampler_logp_diff 0.0, repeats itself and
resumes bit for bit."""
import contextlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sampler
import task
from conftest import ROOT, run_script, run_scripts
from hf.checkpoint import from_pretrained
from hf.tokenizer import Tokenizer
from kernels import HAS_TRITON, TRITON_INTERPRET, invariant
from lora import add_adapters
from model import GPT, GPTConfig, completion_logprobs, token_logprobs

GOLDEN = os.path.join(ROOT, "tests", "golden")


def test_tiled_linear_is_f_linear_and_gives_a_row_the_same_bits_in_any_batch():
    torch.manual_seed(0)
    x, w, b = torch.randn(150, 48, requires_grad=True), torch.randn(40, 48), torch.randn(40)
    y = invariant.linear(x, w, b)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t() + b.double(),
                               rtol=1e-5, atol=1e-5)
    for n in (1, 3, 64, 65, 150):                       # the first n rows, alone
        assert torch.equal(invariant.linear(x[:n], w, b), y[:n])
    assert torch.equal(torch.cat([invariant.linear(x[i:i + 1], w, b) for i in range(150)]), y)
    y.sum().backward()                                  # the gradient: F.linear's, rounding apart
    torch.testing.assert_close(x.grad, (torch.ones(150, 40) @ w), rtol=1e-5, atol=1e-5)


def reference_attention(q, k, v, mask):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.size(-1) ** 0.5
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()


@pytest.mark.parametrize("Tq,S", [(1, 1), (1, 37), (5, 5), (70, 70), (130, 130)])
def test_tiled_attention_is_attention_and_its_gradient(Tq, S):
    torch.manual_seed(Tq + S)
    q, k, v = (torch.randn(2, 3, n, 8, requires_grad=True) for n in (Tq, S, S))
    mask = torch.rand(2, 1, Tq, S) > 0.4
    mask[..., 0] = True                                 # every query reads a key
    out = invariant.attention(q, k, v, mask)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]    # float64 throughout
    ref = reference_attention(*leaves, mask)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    expected = torch.autograd.grad((ref * g.double()).sum(), leaves)
    for a, e in zip(grads, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


def test_a_query_alone_over_the_cache_is_the_same_query_in_the_whole_sequence():
    """Query t against keys 0..t (an appending cache) and against all T slots, the later ones masked
    (a static cache): bit for bit its row of the whole causal forward, across key tiles."""
    torch.manual_seed(0)
    T = 150
    q, k, v = (torch.randn(2, 2, T, 16) for _ in range(3))
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(2, 1, T, T)
    full = invariant.attention(q, k, v, causal)
    for t in (0, 1, 63, 64, 65, 127, 128, 149):
        alone = invariant.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                    causal[:, :, t:t + 1, :t + 1])
        static = invariant.attention(q[:, :, t:t + 1], k, v, causal[:, :, t:t + 1])
        assert torch.equal(alone[:, :, 0], full[:, :, t]) and torch.equal(static, alone), t


def tiny(kind):
    """A policy of each family: this project's GPT, Llama's (rotary, RMSNorm, SwiGLU, grouped
    queries), the real-checkpoint goldens, and LoRA on the first."""
    torch.manual_seed(0)
    if kind in ("llama3", "qwen2", "qwen3"):
        return from_pretrained(os.path.join(GOLDEN, kind)), Tokenizer.from_pretrained(
            os.path.join(GOLDEN, kind))
    tok = Tokenizer()
    config = dict(vocab_size=tok.vocab_size, block_size=96, n_layer=2, n_head=4, n_embd=32)
    if kind == "rope":
        config.update(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False)
    model = GPT(GPTConfig(**config))
    if kind == "lora":
        model = add_adapters(model, 2, 4.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model, tok


def sampled_and_scored(model, tok, rng, temperature):
    """Sample a random batch (2 to 5 prompts x 1 to 3 samples, up to 24 tokens) with the
    sampler's own log-probs, then score it whole and as random sub-batches: (sampler's, whole's,
    parts', mask)."""
    prompts = task.sample_prompts(rng, rng.randint(2, 5))
    idx, idx_mask = tok.encode_batch(prompts, "cpu")
    n = rng.randint(1, 3)
    g = torch.Generator().manual_seed(rng.randint(0, 999))
    tokens, mask, _, logp = sampler.generate(model, idx, idx_mask, rng.randint(4, 24),
                                             tok.stop_ids, tok.pad_id, num_samples=n,
                                             temperature=temperature, generator=g,
                                             return_logprobs=True)
    prompt, prompt_mask = idx.repeat_interleave(n, 0), idx_mask.repeat_interleave(n, 0)
    with torch.no_grad():
        whole = completion_logprobs(model, prompt, prompt_mask, tokens, mask, temperature)
        order = torch.randperm(len(tokens), generator=g)
        parts = torch.zeros_like(whole)
        for rows in torch.tensor_split(order, rng.randint(1, len(tokens))):
            parts[rows] = completion_logprobs(model, prompt[rows], prompt_mask[rows],
                                              tokens[rows], mask[rows], temperature)
    return logp, whole, parts, mask


def largest_gap(model, tok, temperature, trials=4):
    rng, gap = random.Random(0), 0.0
    for _ in range(trials):
        logp, whole, parts, mask = sampled_and_scored(model, tok, rng, temperature)
        real = mask > 0
        gap = max(gap, (logp - whole).abs()[real].max().item(),
                  (parts - whole).abs()[real].max().item())
    return gap


@pytest.mark.parametrize("kind", ["gpt", "rope", "lora", "llama3", "qwen2", "qwen3"])
def test_the_sampler_and_the_trainer_agree_bit_for_bit_in_any_batch(kind):
    model, tok = tiny(kind)
    with invariant.BatchInvariant():
        assert largest_gap(model, tok, 0.7) == 0.0
    assert largest_gap(model, tok, 0.7) > 0.0           # without the mode they differ


@pytest.mark.parametrize("kind", ["gpt", "rope", "lora", "llama3", "qwen2", "qwen3"])
def test_the_mode_computes_what_plain_pytorch_computes(kind):
    """Its products and attention against PyTorch's own, forward and gradient, every parameter
    (LoRA's A and B too), within float32's rounding: the sampler and the trainer could otherwise
    agree on a wrong number."""
    model, tok = tiny(kind)
    rng = random.Random(2)
    prompts = task.sample_prompts(rng, 4)
    idx, idx_mask = tok.encode_batch(prompts, "cpu")
    tokens = torch.randint(0, 200, (4, 9), generator=torch.Generator()
                           .manual_seed(0))
    mask = (torch.arange(9)[None, :] < torch.tensor([[9], [5], [1], [7]])).float()
    out = []
    for mode in (invariant.BatchInvariant(), contextlib.nullcontext()):
        model.zero_grad()
        with mode:
            logp = completion_logprobs(model, idx, idx_mask, tokens, mask, 0.8)
            (logp * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((logp.detach(), grads))
    (logp, grads), (plain, plain_grads) = out
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    assert torch.allclose(logp, plain, rtol=1e-4, atol=1e-4), (logp - plain).abs().max()
    for name, g in grads.items():
        assert torch.allclose(g, plain_grads[name], rtol=1e-3, atol=1e-4), name


@pytest.mark.parametrize("variant", ["another order of the sum in the decode", "a split inner sum",
                                     "another key tile in the decode", "SDPA's attention"])
def test_any_one_piece_made_batch_variant_again_breaks_the_agreement(variant, monkeypatch):
    model, tok = tiny("rope")
    tiled_mm, attention = invariant.tiled_mm, invariant.attention
    if variant == "another order of the sum in the decode":      # a plain product alone may
        # give a row the tiled product's bits on some machines and thread counts (one thread
        # here): the inner sum reversed differs on any
        monkeypatch.setattr(invariant, "tiled_mm", lambda x, w: x.flip(-1) @ w.to(x.dtype).flip(0)
                            if x.reshape(-1, x.size(-1)).size(0) <= 16 else tiled_mm(x, w))
    elif variant == "a split inner sum":                 # K in two halves, summed: split-K
        def split(x, w):
            k = x.size(-1) // 2
            if x.reshape(-1, x.size(-1)).size(0) > 16:
                return tiled_mm(x, w)
            return tiled_mm(x[..., :k], w[:k]) + tiled_mm(x[..., k:], w[k:])
        monkeypatch.setattr(invariant, "tiled_mm", split)
    elif variant == "another key tile in the decode":
        def tile(q, k, *a, **kw):                        # the decode: fewer queries than keys
            monkeypatch.setattr(invariant, "ROWS", 8 if q.size(2) < k.size(2) else 64)
            return attention(q, k, *a, **kw)
        monkeypatch.setattr(invariant, "attention", tile)
    else:
        monkeypatch.setattr(invariant, "attention", F.scaled_dot_product_attention)
    with invariant.BatchInvariant():
        assert largest_gap(model, tok, 1.0, trials=6) > 0.0


@pytest.mark.slow
def test_loras_addmm_made_batch_variant_breaks_the_agreement(monkeypatch):
    """LoRA's low-rank path is one addmm (lora.py): under the mode it must be the tiled product.
    Made batch-variant in the mode alone (the inner sum reversed for small batches: a plain addmm
    may give the tiled product's bits on some machines), the LoRA model's sampler and trainer
    disagree; the plain model, with no addmm, still agrees."""
    real = invariant.BatchInvariant.__torch_function__
    tiled_mm = invariant.tiled_mm

    def variant_addmm(self, func, types, args=(), kwargs=None):
        if func in (torch.addmm, torch.Tensor.addmm) and args[1].reshape(
                -1, args[1].size(-1)).size(0) <= 16:
            bias, a, b = args[:3]
            kw = kwargs or {}
            return bias * kw.get("beta", 1) + kw.get("alpha", 1) * tiled_mm(
                a.flip(-1), b.flip(0))
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(invariant.BatchInvariant, "__torch_function__", variant_addmm)
    with invariant.BatchInvariant():
        assert largest_gap(*tiny("lora"), 1.0, trials=6) > 0.0
        assert largest_gap(*tiny("gpt"), 1.0, trials=6) == 0.0


def layout_gap(model, tok, trials=4):
    """The sampler's log-probs against the same sequences scored in other layouts: more left
    padding (1 to 70 columns), and whole sequences from slot 0, right-padded (task.completion_batch,
    as online_dpo and expert_iteration score theirs)."""
    rng, gap = random.Random(1), 0.0
    for _ in range(trials):
        prompts = task.sample_prompts(rng, rng.randint(2, 5))
        idx, idx_mask = tok.encode_batch(prompts, "cpu")
        g = torch.Generator().manual_seed(rng.randint(0, 999))
        tokens, mask, _, logp = sampler.generate(model, idx, idx_mask, rng.randint(8, 40),
                                                 tok.stop_ids, tok.pad_id, temperature=0.9,
                                                 generator=g, return_logprobs=True)
        shift = rng.choice([1, 13, 40, 70])
        with torch.no_grad():
            shifted = completion_logprobs(model, F.pad(idx, (shift, 0), value=tok.pad_id),
                                          F.pad(idx_mask, (shift, 0)), tokens, mask, 0.9)
            ids = [row[:int(m.sum())] for row, m in zip(tokens.tolist(), mask)]
            seqs, attn, targets = task.completion_batch(prompts, ids, tok)
            whole = token_logprobs(model, seqs[:, :-1], attn[:, :-1], seqs[:, 1:], 0.9)
        real = mask > 0
        gap = max(gap, (shifted - logp).abs()[real].max().item(),
                  (whole[targets > 0] - logp[real]).abs().max().item())
    return gap


@pytest.mark.parametrize("kind", ["gpt", "qwen2"])
def test_padding_before_a_sequence_changes_no_bit(kind, monkeypatch):
    """Key tiles counted from a query's first readable key: the same sequence left-padded by any
    amount or right-padded from slot 0 has the sampler's bits; tiles counted from slot 0 (the
    boundaries where the padding puts them) have not."""
    model, tok = tiny(kind)
    with invariant.BatchInvariant():
        assert layout_gap(model, tok) == 0.0
        monkeypatch.setattr(invariant, "first_key",
                            lambda m: torch.zeros_like(m[..., :1, :1], dtype=torch.long))
        assert layout_gap(model, tok) > 0.0


# -----------------------------------------------------------------------------
# The Triton path: here on a GPU, else in a child under TRITON_INTERPRET=1 (whose tl.dot is numpy's
# BLAS, not row-invariant: the kernels then sum the products in order, ROWWISE)

CUDA = torch.cuda.is_available()
TRITON_HERE = HAS_TRITON and (CUDA or TRITON_INTERPRET)
DEVICE = "cuda" if CUDA else "cpu"
no_triton_here = pytest.mark.skipif(not TRITON_HERE, reason="Triton runs here on a GPU, else in "
                                    "test_interpreted_kernels_subprocess")


@no_triton_here
def test_triton_path_products_against_float64_and_a_row_in_any_batch():
    torch.manual_seed(0)
    x, w = (torch.randn(*s, device=DEVICE, requires_grad=True) for s in ((150, 48), (48, 40)))
    y = invariant.tiled_mm_triton(x, w)
    torch.testing.assert_close(y.double(), x.double() @ w.double(), rtol=1e-5, atol=1e-5)
    perm = torch.randperm(150, device=DEVICE)
    for rows in (perm, perm[:1], perm[:65]):            # any rows, in any places of the tiles
        assert torch.equal(invariant.tiled_mm_triton(x[rows], w), y[rows])
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    torch.testing.assert_close(gx, torch.ones(150, 40, device=DEVICE) @ w.t(), rtol=1e-5,
                               atol=1e-5)
    T = 100                                             # left padding 0 to 40: first keys differ
    q, k, v = (torch.randn(3, 2, T, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    real = torch.arange(T, device=DEVICE) >= torch.tensor([0, 17, 40], device=DEVICE)[:, None]
    causal = torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril()
    mask = (causal & real[:, None, :] | torch.eye(T, dtype=torch.bool, device=DEVICE))[:, None]
    out = invariant.attention_triton(q, k, v, mask)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    queries = real[:, None, :, None]                   # a padding query (itself alone) gets 0
    ref = reference_attention(*leaves, mask) * queries
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for t in (0, 39, 40, 63, 64, 99):                   # a query alone over an appending cache
        alone = invariant.attention_triton(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                           mask[:, :, t:t + 1, :t + 1])
        r = real[:, t]                                  # the rows where query t is real
        assert torch.equal(alone[r, :, 0], out[r, :, t]), t
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    for a, e in zip(grads, torch.autograd.grad((ref * g.double()).sum(), leaves)):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)
    L, placed = 90, []                                  # one sequence across two key tiles,
    for pad in (0, 37):                                 # from slot 0 and after 37 of padding
        x = [F.pad(t.detach()[:1, :, :L], (0, 0, pad, 0)) for t in (q, k, v)]
        m = torch.ones(L + pad, L + pad, dtype=torch.bool, device=DEVICE).tril()
        m[:, :pad] = False
        placed.append(invariant.attention_triton(*x, m | torch.eye(L + pad, dtype=torch.bool,
                                                                    device=DEVICE))[:, :, pad:])
    assert torch.equal(*placed)


@no_triton_here
def test_triton_path_sampler_and_trainer_agree_bit_for_bit():
    """The mode on a small GPT through the Triton kernels: the sampler's log-probs, the whole
    forward's and those under 70 more columns of left padding, the same bits."""
    torch.manual_seed(0)
    tok = Tokenizer()
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=96, n_layer=1, n_head=2,
                          n_embd=16)).to(DEVICE)
    prompts = task.sample_prompts(random.Random(0), 3)
    with invariant.BatchInvariant(), torch.no_grad():
        idx, idx_mask = tok.encode_batch(prompts, DEVICE)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        tokens, mask, _, logp = sampler.generate(model, idx, idx_mask, 6, tok.stop_ids, tok.pad_id,
                                                 num_samples=2, temperature=0.9, generator=g,
                                                 return_logprobs=True)
        prompt, prompt_mask = idx.repeat_interleave(2, 0), idx_mask.repeat_interleave(2, 0)
        whole = completion_logprobs(model, prompt, prompt_mask, tokens, mask, 0.9)
        shifted = completion_logprobs(model, F.pad(prompt, (70, 0), value=tok.pad_id),
                                      F.pad(prompt_mask, (70, 0)), tokens, mask, 0.9)
    real = mask > 0
    assert real.sum() > 6 and torch.equal(whole[real], logp[real])
    assert torch.equal(shifted[real], logp[real])


@pytest.mark.skipif(not HAS_TRITON or CUDA or TRITON_INTERPRET,
                    reason="the Triton cases run in this process (a GPU), or Triton is missing")
@pytest.mark.slow
def test_interpreted_kernels_subprocess():
    """This file's Triton cases, and the PyTorch-path tests of attention that then take the Triton
    path, in a child under TRITON_INTERPRET=1 (small sizes)."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
           "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-n",
                          "0", "-p", "no:cacheprovider", "-k", "triton_path or a_query_alone"],
                         env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0 and "3 passed" in run.stdout, tail


def metrics(out, evaluations=True):
    """metrics.jsonl's rows, times aside (and the evaluations: a run that stops evaluates)."""
    return [{k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "tokens_per_sec")
             and (evaluations or not k.startswith("eval_"))}
            for line in open(os.path.join(out, "grpo", "metrics.jsonl"))]


@pytest.mark.slow
def test_grpo_batch_invariant_is_exactly_on_policy_repeats_itself_and_resumes(tiny_sft, tmp_path):
    """sampler_logp_diff 0.0 and the first pass's ratio exactly 1 (approx_kl and clip_frac 0) at
    every step, with micro-batches and a temperature; 2 steps and a resume to 3 (another process:
    new buffers, other addresses), the 3 steps' metrics bit for bit."""
    flags = ["--batch_invariant", "--prompts_per_step", "6", "--group_size", "4", "--grad_accum",
             "2", "--temperature", "0.7", "--log_every", "1", "--eval_every", "100", "--eval_n",
             "4", "--init", tiny_sft]
    env = {"OMP_NUM_THREADS": "1"}
    p = run_script("grpo.py", flags + ["--steps", "3", "--out", str(tmp_path / "a")], env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = metrics(str(tmp_path / "a"))
    assert all(r["sampler_logp_diff"] == 0.0 and r["approx_kl"] == 0.0 and r["clip_frac"] == 0.0
               and r["sampler_kl"] == 0.0 for r in rows[1:]) and len(rows) == 4
    assert all(r["grad_norm"] > 0 for r in rows[1:])               # every step moved the policy
    split = str(tmp_path / "split")
    for steps, more in (("2", []), ("3", ["--resume"])):
        p = run_script("grpo.py", flags + ["--steps", steps, "--out", split, *more], env=env)
        assert p.returncode == 0, p.stderr[-2000:]
    assert metrics(split, evaluations=False) == metrics(str(tmp_path / "a"), evaluations=False)


ON_POLICY = {                   # every other script that trains on its own samples: 2 small steps
    "rloo.py": ["--prompts_per_step", "4", "--group_size", "4"],
    "reinforce.py": ["--prompts_per_step", "4", "--group_size", "4", "--grad_accum", "2"],
    "trpo.py": ["--prompts_per_step", "4", "--group_size", "4"],
    "ppo.py": ["--reward", "verifier", "--batch_size", "8", "--minibatches", "2",
               "--ppo_epochs", "2"],
    "agent.py": ["--prompts_per_step", "4", "--group_size", "4", "--temperature", "0.8"],
    "async_grpo.py": ["--prompts_per_step", "4", "--group_size", "4", "--actors", "2",
                      "--max_lag", "0"],
    "online_dpo.py": ["--batch_size", "4", "--group_size", "4", "--judge", "verifier",
                      "--temperature", "0.8"],
    "expert_iteration.py": ["--prompts_per_round", "4", "--samples_per_prompt", "4",
                            "--batch_size", "8"],
    "distill.py": ["--prompts_per_step", "4", "--group_size", "2", "--grad_accum", "2"],
    "self_distill.py": ["--prompts_per_step", "4", "--group_size", "2"],
}


@pytest.mark.slow
def test_every_on_policy_script_is_exactly_on_policy_with_batch_invariant(tiny_sft, tmp_path):
    """sampler_logp_diff 0.0 on every step of each script (agent's episodes with the calculator's
    replies; async_grpo's actors in other processes; online_dpo's and expert_iteration's samples
    scored from slot 0), their runs at once; sampler_kl 0.0 too, over the whole support (not
    async_grpo's: its actors send no hidden states)."""
    tool = os.path.join(ROOT, "tests", "fixtures", "tiny_tool_sft.pt")
    calls = [(script, flags + ["--batch_invariant", "--rounds" if "expert" in script else
                               "--steps", "2", "--log_every", "1", "--eval_every", "100",
                               "--eval_n", "4", "--out", str(tmp_path / script),
                               "--init", tool if script == "agent.py" else tiny_sft]
              + (["--teacher", tiny_sft] if script == "distill.py" else []))
             for script, flags in ON_POLICY.items()]
    for (script, _), p in zip(calls, run_scripts(calls, env={"OMP_NUM_THREADS": "1"})):
        assert p.returncode == 0, (script, p.stderr[-2000:])
        name = script[:-3]
        rows = [json.loads(line) for line in open(tmp_path / script / name / "metrics.jsonl")]
        assert len(rows) == 3 and all(r["sampler_logp_diff"] == 0.0 for r in rows[1:]), script
        assert script == "async_grpo.py" or all(r["sampler_kl"] == 0.0 for r in rows[1:]), script


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "reinforce.py", "agent.py"])
@pytest.mark.slow
def test_pi_old_from_the_sampler_is_the_recomputed_one(script, tiny_sft, tmp_path):
    """Steps 1 and 2 unlogged (--log_every 3: pi_old is the sampler's, the policy's forward skipped)
    reach step 3 with the metrics of a run that recomputed pi_old on every step (--log_every 1)."""
    init = (os.path.join(ROOT, "tests", "fixtures", "tiny_tool_sft.pt") if script == "agent.py"
            else tiny_sft)
    flags = ON_POLICY.get(script, ["--prompts_per_step", "4", "--group_size", "4"]) + [
        "--batch_invariant", "--steps", "3", "--eval_every", "100", "--eval_n", "4", "--init", init]
    calls = [(script, flags + ["--log_every", every, "--out", str(tmp_path / every)])
             for every in ("1", "3")]
    done = run_scripts(calls, env={"OMP_NUM_THREADS": "1"})
    assert all(p.returncode == 0 for p in done), done[0].stderr[-2000:] + done[1].stderr[-2000:]
    last = [json.loads(open(tmp_path / every / script[:-3] / "metrics.jsonl").readlines()[-1])
            for every in ("1", "3")]
    drop = ("elapsed_s", "tokens_per_sec", "completions_per_sec")
    assert [{k: v for k, v in r.items() if k not in drop} for r in last][0] == \
        [{k: v for k, v in r.items() if k not in drop} for r in last][1]
    assert last[0]["step"] == 3 and last[0]["sampler_logp_diff"] == 0.0


def test_batch_invariant_where_it_cannot_serve_is_one_line(tiny_sft, tmp_path):
    for argv, words in ((["dpo.py"], "--batch_invariant: dpo.py trains on no samples"),
                        (["grpo.py", "--fsdp"], "--batch_invariant with --fsdp")):
        out = str(tmp_path / "out")
        p = run_script(argv[0], argv[1:] + ["--batch_invariant", "--init", tiny_sft, "--out", out])
        assert p.returncode != 0 and words in p.stderr and p.stderr.count("\n") == 1, p.stderr
        assert not os.path.exists(out)
