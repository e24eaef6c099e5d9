"""Known pitfalls of RL for language models, one test each (they bit TRL, verl, OpenRLHF and
NeMo-Aligner users; see the trackers cited beside each test): the first update's ratio is exactly 1
whatever the micro-batch composition; a sequence's log-probs do not depend on its padding or on the
rest of its batch; values at masked positions change no loss, advantage or metric."""
import types

import pytest
import torch

import dpo
import grpo
import plumbing
import ppo
import reinforce
import rloo
import sampler
import task
from hf.checkpoint import save_checkpoint
from hf.tokenizer import Tokenizer
from kernels import logprobs
from model import GPT, GPTConfig, completion_logits, masked_mean


def sampled_batch(seed=0, dropout=0.0, G=2):
    """An untrained model (eval mode, as the scripts load it) and G completions for each of 7
    prompts of different lengths, left-padded as the scripts batch them: prompt (N, Tp), prompt
    mask, tokens (N, Tn), mask."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, dropout=dropout)).eval()
    tok = Tokenizer()
    p, m = tok.encode_batch(task.eval_prompts()[:4] + ["1=", "12+3=", "9-8*7+6="])
    g = torch.Generator().manual_seed(seed)
    tokens, mask, _ = sampler.generate(model, p, m, 10, tok.eos_id, tok.pad_id, num_samples=G,
                                       temperature=1.0, generator=g)
    return model, p.repeat_interleave(G, 0), m.repeat_interleave(G, 0), tokens, mask


# -----------------------------------------------------------------------------
# The first update: ratio exactly 1 (CarperAI/trlx#107, NVIDIA/NeMo-Aligner#68,
# verl-project/verl#6280)

def test_first_update_ratio_is_exactly_one_for_any_micro_batch_composition():
    """The rollout scores the whole batch at once; the first optimisation pass (before any weight
    change, as at lr = 0) scores micro-batches in another order and size. In float32 the two must
    agree exactly: ratio 1, clip fraction 0, approx-KL 0."""
    model, p, m, tokens, mask = sampled_batch()
    N = tokens.size(0)
    with torch.no_grad():
        old = logprobs(completion_logits(model, p, m, tokens, mask), tokens)           # (N, Tn)
        shuffled = torch.randperm(N, generator=torch.Generator().manual_seed(1))
        orders = [torch.arange(N), torch.arange(N).flip(0), shuffled]
        for order in orders:
            for parts in (1, 2, 3, 5, N):
                for mb in torch.tensor_split(order, parts):
                    logp = logprobs(completion_logits(model, p[mb], m[mb], tokens[mb], mask[mb]),
                                    tokens[mb])
                    real = mask[mb] > 0
                    assert torch.equal(logp[real], old[mb][real]), (parts, mb)
                    A = torch.randn(len(mb), dtype=torch.float32)
                    _, stats = grpo.grpo_loss(logp, old[mb], old[mb], A, mask[mb])
                    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0
                    _, clip_taken = ppo.ppo_policy_loss(logp, old[mb],
                                                        A[:, None].expand_as(logp), 0.2)
                    assert not clip_taken[real].any()


def test_scripts_score_in_eval_mode_so_dropout_cannot_move_the_first_ratio(tmp_path):
    """A checkpoint with dropout > 0: loaded as the scripts load it (plumbing.Run.load), two
    scorings of the same tokens agree exactly; in train mode they would not (which is what the check
    guards against)."""
    model, p, m, tokens, mask = sampled_batch(dropout=0.3)
    path = str(tmp_path / "dropout.pt")
    save_checkpoint(path, model, "bytes")
    fake_run = types.SimpleNamespace(device="cpu", sources={}, tokenizer_name=None,
                                     tokenizer_files=None, chat_date=None,
                                     args=types.SimpleNamespace(grad_checkpoint=False))
    loaded, _ = plumbing.Run.load(fake_run, path)
    assert not loaded.training
    with torch.no_grad():
        a = logprobs(completion_logits(loaded, p, m, tokens, mask), tokens)
        b = logprobs(completion_logits(loaded, p[:5], m[:5], tokens[:5], mask[:5]), tokens[:5])
        assert torch.equal(a[:5][mask[:5] > 0], b[mask[:5] > 0])
        loaded.train()
        c = logprobs(completion_logits(loaded, p, m, tokens, mask), tokens)
        assert not torch.equal(a[mask > 0], c[mask > 0])


# -----------------------------------------------------------------------------
# Padding and batch composition (OpenRLHF/OpenRLHF#217, CarperAI/trlx#509, huggingface/trl#6819)

def test_a_sequences_logprobs_are_the_same_alone_left_padded_and_in_another_batch():
    model, p, m, tokens, mask = sampled_batch(seed=3)
    with torch.no_grad():
        in_batch = logprobs(completion_logits(model, p, m, tokens,
                                              mask), tokens)          # (N, Tn), left-padded prompts
        for i in range(tokens.size(0)):
            n, k = int(m[i].sum()), int(mask[i].sum())
            alone = logprobs(completion_logits(model, p[i:i + 1, -n:], m[i:i + 1, -n:],
                                               tokens[i:i + 1, :k], mask[i:i + 1, :k]),
                             tokens[i:i + 1, :k])[0]                             # no padding at all
            # another batch, i last
            others = [j for j in (i - 3, i + 5) if 0 <= j < tokens.size(0)] + [i]
            rows = torch.tensor(others)
            elsewhere = logprobs(completion_logits(model, p[rows], m[rows], tokens[rows],
                                                   mask[rows]), tokens[rows])[-1]
            torch.testing.assert_close(in_batch[i, :k], alone, rtol=0, atol=1e-5)
            torch.testing.assert_close(elsewhere[:k], alone, rtol=0, atol=1e-5)


# -----------------------------------------------------------------------------
# Masked positions (alibaba/ROLL#447, areal-project/AReaL#1346, open-thought/tiny-grpo#5)

JUNK = [float("nan"), float("inf"), float("-inf"), 1e30, -7.0]


def ragged(B=5, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, T, 0, 3, 4][:B])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()     # a one-token row, an empty row
    x = lambda: -torch.rand(B, T, generator=g) * 3                   # log-prob-like values
    return mask, x(), x(), x(), torch.randn(B, generator=g), torch.randn(B, T, generator=g)


def with_junk(x, mask, value):
    return torch.where(mask > 0, x, torch.full_like(x, value))


def outputs(fn, tensors, mask, junk):
    """fn applied to leaf copies of tensors whose masked positions hold `junk`: (flattened outputs,
    input grads)."""
    leaves = [with_junk(t, mask, junk).requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    values = ([o for o in out if torch.is_tensor(o)]
              + [torch.tensor(list(d.values())) for d in out if isinstance(d, dict)])
    differentiable = [o for o in out if torch.is_tensor(o) and o.requires_grad]
    grads = torch.autograd.grad(sum(o.sum() for o in differentiable), leaves,
                                allow_unused=True) if differentiable else []
    return values, [g for g in grads if g is not None]


# name -> a function of (mask, A) giving fn(lp, old, ref); each argument gets junk where mask is 0
CASES = {
    "grpo_loss seq": lambda mask, A: (
        lambda lp, old, ref: grpo.grpo_loss(lp, old, ref, A, mask,
                                            grpo.LossSettings(loss_agg="seq"))),
    "grpo_loss token": lambda mask, A: (
        lambda lp, old, ref: grpo.grpo_loss(lp, old, ref, A, mask,
                                            grpo.LossSettings(loss_agg="token"))),
    "grpo_loss dr_grpo": lambda mask, A: (
        lambda lp, old, ref: grpo.grpo_loss(lp, old, ref, A, mask,
                                            grpo.LossSettings(loss_agg="dr_grpo"))),
    "rloo_loss": lambda mask, A: (lambda lp, old, ref: rloo.rloo_loss(lp, A, mask)),
    "reinforce_loss": lambda mask, A: (lambda lp, old, ref: reinforce.reinforce_loss(lp, A, mask)),
    "reinforce_loss per token": lambda mask, A: (
        lambda lp, old, ref: reinforce.reinforce_loss(lp, old, mask)),
    "reinforce_pp_advantages": lambda mask, A: (
        lambda lp, old, ref: reinforce.reinforce_pp_advantages(A, lp, mask, 0.1)),
    "gae": lambda mask, A: (lambda lp, old, ref: ppo.gae(lp, old, mask, 1.0, 0.95)),
    "kl_penalised_rewards": lambda mask, A: (
        lambda lp, old, ref: ppo.kl_penalised_rewards(A, lp, old, mask, 0.1)),
    "masked_whiten": lambda mask, A: (lambda lp, old, ref: ppo.masked_whiten(lp, mask)),
    "ppo losses, masked mean": lambda mask, A: (lambda lp, old, ref: masked_mean(
        ppo.ppo_policy_loss(lp, old, ref, 0.2)[0] + ppo.ppo_value_loss(lp, old, ref, 0.2), mask)),
    "masked_mean": lambda mask, A: (lambda lp, old, ref: masked_mean(lp, mask)),
    "sequence_logprobs": lambda mask, A: (
        lambda lp, old, ref: (dpo.sequence_logprobs(lp, mask),
                              dpo.sequence_logprobs(lp, mask, average=True))),
}


# per-token losses without a mask: the caller's masked_mean masks them
FORWARD_ONLY = {"ppo losses, masked mean"}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("junk", JUNK)
def test_values_at_masked_positions_change_nothing(name, junk):
    """Every loss, advantage and metric is the same whatever sits at a masked position
    (NaN, inf, huge); the gradients too, and none reaches a masked position."""
    mask, lp, old, ref, A, _ = ragged()
    fn = CASES[name](mask, A)
    want, want_grads = outputs(fn, (lp, old, ref), mask, 0.0)
    got, got_grads = outputs(fn, (lp, old, ref), mask, junk)
    for w, g in zip(want, got):
        assert not torch.isnan(w).any(), (name, w)
        assert torch.equal(g, w), (name, junk, g, w)
    if name in FORWARD_ONLY:
        return
    for w, g in zip(want_grads, got_grads):
        assert torch.isfinite(g).all() and torch.equal(g, w), (name, junk)
        assert (g[mask.expand_as(g) == 0] == 0).all()        # no gradient reaches a masked position
