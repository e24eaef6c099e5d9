"""grpo.py: advantages, KL estimators and the clipped loss against float64 references written here
from DeepSeekMath's equations (arXiv 2402.03300, eqs. 3-4) and Schulman's KL estimators;
hand-derived gradients; the script end to end (smoke, resume, bad input); and a short learning
run."""
import inspect
import json
import math
import os
from dataclasses import dataclass

import pytest
import torch

import grpo
import kernels
import task
from conftest import as_a_process, refuses_all, run_script
from grpo import (LossSettings, dynamic_sampling_keep, grpo_advantages, grpo_loss,
                  overlong_penalty)
from hf.checkpoint import load_checkpoint


# -----------------------------------------------------------------------------
# float64 references, straight from the equations

def ref_advantages(rewards, G, eps=1e-6, scale_by_std=True, kind="population"):
    out = []
    for g in range(len(rewards) // G):
        r = [float(x) for x in rewards[g * G:(g + 1) * G]]
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G if kind == "population" else G - 1))
        for x in r:
            if all(y == r[0] for y in r):
                out.append(0.0)
            else:
                out.append((x - mean) / (std + eps) if scale_by_std else x - mean)
    return torch.tensor(out, dtype=torch.float64)


def ref_kl(logp, ref_logp, estimator):
    log_ratio = logp - ref_logp                         # log pi_theta / pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.exp(-log_ratio) + log_ratio - 1        # pi_ref/pi_theta - log(pi_ref/pi_theta) - 1


def ref_loss(logp, old_logp, ref_logp, adv, mask, clip_eps, beta, eps_high, estimator, agg,
             max_tokens=None, ratio_level="token", loss_type="clip"):
    """DeepSeekMath eq. 3, negated, written out token by token (float64, differentiable w.r.t.
    logp); GSPO (Zheng et al. 2025, eq. 5-7): the sequence ratio s_i = exp(mean_t log ratio_it) in
    place of each token's ratio; CISPO (MiniMax 2025, eq. 4): -sg(clip(ratio)) * A * log pi per
    token."""
    B, T = logp.shape
    per_seq, total, n = [], 0.0, 0.0
    for i in range(B):
        s = 0.0
        real = [t for t in range(T) if mask[i, t] != 0]
        seq_ratio = torch.exp(sum(logp[i, t] - old_logp[i, t]
                                  for t in real) / len(real)) if real else None
        for t in real:
            ratio = torch.exp(logp[i, t] - old_logp[i, t]) if ratio_level == "token" else seq_ratio
            clipped = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high)
            if loss_type == "clip":
                obj = torch.minimum(ratio * adv[i], clipped * adv[i])
            else:
                obj = clipped.detach() * adv[i] * logp[i, t]
            term = -obj + beta * ref_kl(logp[i, t], ref_logp[i, t], estimator)
            s = s + term
            n += 1
        total = total + s
        per_seq.append(s / max(float(mask[i].sum()), 1.0))
    if agg == "seq":
        return sum(per_seq) / B
    if agg == "token":
        return total / max(n, 1.0)
    return total / (B * (max_tokens or T))


def random_batch(B=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios on both sides of the clip
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return logp, old, ref, adv, mask


# -----------------------------------------------------------------------------
# Advantages

def test_hand_worked_group_of_eight():
    r = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.3, 0.2, 0.5, 0.4])
    a = grpo_advantages(r, 8)
    # mean 0.55; population std sqrt(0.42 / 8) = 0.2291; (0.9 - 0.55) / 0.2291 = 1.5275
    expected = torch.tensor([0.35, 0.25, 0.15, 0.05, -0.25, -0.35, -0.05,
                             -0.15]) / math.sqrt(0.42 / 8)
    assert torch.allclose(a, expected, atol=1e-4)
    assert abs(a[0].item() - 1.5275) < 1e-3 and abs(a[5].item() + 1.5275) < 1e-3


@pytest.mark.parametrize("G", [2, 3, 8, 16])
def test_advantages_match_reference_on_random_rewards(G):
    rewards = torch.rand(7 * G, generator=torch.Generator().manual_seed(G))
    rewards[:G] = (rewards[:G] > 0.5).float()                # binary rewards, as the verifier gives
    for scale in (True, False):
        got = grpo_advantages(rewards, G, scale_by_std=scale).double()
        assert torch.allclose(got, ref_advantages(rewards.tolist(), G, scale_by_std=scale),
                              atol=1e-5)
        # zero mean per group
        assert torch.allclose(got.view(-1, G).sum(1), torch.zeros(7, dtype=torch.float64),
                              atol=1e-5)


def test_equal_rewards_give_zero_never_nan():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    a = grpo_advantages(r, 3)
    assert torch.isfinite(a).all()
    assert (a[:9] == 0).all()                               # three groups without signal: exactly 0
    assert a[10] > 0 and a[9] < 0 and a[11] < 0             # the mixed group is untouched
    # a group of one: no relative advantage
    assert (grpo_advantages(torch.tensor([0.3, 0.1, 0.7]), 1) == 0).all()


def test_sample_std_hand_worked_and_against_reference():
    # rewards 1, 0, 0, 0: mean 0.25, squared deviations sum to 0.75; population std sqrt(0.75 / 4) =
    # 0.4330, sample std sqrt(0.75 / 3) = 0.5; so the correct sample gets 0.75 / 0.4330 = 1.7321 or
    # 0.75 / 0.5 = 1.5
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert grpo_advantages(r, 4, eps=0.0)[0].item() == pytest.approx(math.sqrt(3), rel=1e-6)
    assert grpo_advantages(r, 4, eps=0.0, std="sample")[0].item() == pytest.approx(1.5, rel=1e-6)
    rewards = torch.rand(6 * 5, generator=torch.Generator().manual_seed(0))
    got = grpo_advantages(rewards, 5, std="sample").double()
    assert torch.allclose(got, ref_advantages(rewards.tolist(), 5, kind="sample"), atol=1e-5)
    ratio = grpo_advantages(rewards, 5, eps=0.0, std="sample") / grpo_advantages(rewards, 5,
                                                                                 eps=0.0)
    # sqrt((G-1)/G)
    assert torch.allclose(ratio, torch.full_like(ratio, math.sqrt(4 / 5)), atol=1e-5)
    assert (grpo_advantages(torch.ones(6), 3, std="sample") == 0).all()
    with pytest.raises(ValueError, match="'biased'"):
        grpo_advantages(r, 4, std="biased")


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="group_size = 3"):
        grpo_advantages(torch.rand(8), 3)
    with pytest.raises(ValueError, match="group_size = 0"):
        grpo_advantages(torch.rand(8), 0)


# -----------------------------------------------------------------------------
# The loss

@pytest.mark.parametrize("agg", ["seq", "token", "dr_grpo"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_and_gradient_match_reference(agg, estimator):
    logp, old, ref, adv, mask = random_batch()
    for eps_high in (None, 0.28):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = grpo_loss(lp, old, ref, adv, mask, LossSettings(
            clip_eps=0.2, beta=0.04, eps_high=eps_high, kl_estimator=estimator, loss_agg=agg,
            max_tokens=9))
        lp_ref = logp.clone().requires_grad_(True)
        want = ref_loss(lp_ref, old, ref, adv, mask, 0.2, 0.04, eps_high or 0.2, estimator, agg,
                        max_tokens=9)
        assert abs(loss.item() - want.item()) < 1e-10
        g, = torch.autograd.grad(loss, lp)
        g_ref, = torch.autograd.grad(want, lp_ref)
        assert torch.allclose(g, g_ref, atol=1e-10)
        assert 0.0 <= metrics["clip_frac"] <= 1.0


@pytest.mark.parametrize("agg", ["seq", "token", "dr_grpo"])
@pytest.mark.parametrize("ratio_level,loss_type", [("sequence", "clip"), ("token", "cispo")])
def test_gspo_and_cispo_match_their_float64_reference(agg, ratio_level, loss_type):
    for seed in range(3):
        logp, old, ref, adv, mask = random_batch(seed=seed)
        mask[1] = 0.0                                               # a fully masked row
        mask[2, 1:] = 0.0                                           # a one-token completion
        kwargs = dict(clip_eps=0.1, beta=0.04, eps_high=0.3, kl_estimator="k3", loss_agg=agg,
                      max_tokens=9)
        lp = logp.clone().requires_grad_(True)
        loss, _ = grpo_loss(lp, old, ref, adv, mask, LossSettings(ratio_level=ratio_level,
                                                              loss_type=loss_type, **kwargs))
        lp2 = logp.clone().requires_grad_(True)
        want = ref_loss(lp2, old, ref, adv, mask, 0.1, 0.04, 0.3, "k3", agg, 9, ratio_level,
                        loss_type)
        assert abs(loss.item() - want.item()) < 1e-12
        g, = torch.autograd.grad(loss, lp)
        g_ref, = torch.autograd.grad(want, lp2)
        assert torch.allclose(g, g_ref, atol=1e-12) and (g[1] == 0).all() and (g[2, 1:] == 0).all()


def test_gspo_one_ratio_per_completion_hand_worked():
    # one completion of 2 tokens with log ratios 0.2 and -0.1: s = exp(0.05); A = 1; clip 0.2 does
    # not bind
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -1.9]], dtype=torch.float64)
    one, ones = torch.ones(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    seq = LossSettings(beta=0.0, ratio_level="sequence")
    loss, stats = grpo_loss(logp, old, logp.detach(), one, ones, seq)
    assert loss.item() == pytest.approx(-math.exp(0.05))            # -s * A on each token, averaged
    g, = torch.autograd.grad(loss, logp)
    # d s / d logp_t = s / |o|
    assert torch.allclose(g, torch.full((1, 2), -math.exp(0.05) / 2, dtype=torch.float64))
    # s = e^1.05: clipped
    far = grpo_loss(logp, old - 1.0, logp.detach(), one, ones, seq)
    assert far[1]["clip_frac"] == 1.0 and torch.autograd.grad(far[0], logp)[0].abs().sum() == 0
    with pytest.raises(ValueError, match="'cispo'"):
        LossSettings(ratio_level="sequence", loss_type="cispo")


def test_cispo_keeps_the_gradient_the_clip_drops():
    # a token whose ratio 1.5 is past 1 + eps_high with A > 0: PPO's clip gives it no gradient;
    # CISPO gives it -clip(ratio) * A = -1.2 * A (with one token and the seq mean), a truncated
    # weight but a gradient
    logp = torch.tensor([[math.log(0.45)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.30)]], dtype=torch.float64)
    A, m = torch.tensor([0.5], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    clip_loss, clip_stats = grpo_loss(logp, old, logp.detach(), A, m, LossSettings(beta=0.0))
    cispo_loss, cispo_stats = grpo_loss(logp, old, logp.detach(), A, m,
                                        LossSettings(beta=0.0, loss_type="cispo"))
    assert torch.autograd.grad(clip_loss, logp)[0].item() == 0.0 and clip_stats["clip_frac"] == 1.0
    assert torch.autograd.grad(cispo_loss, logp)[0].item() == pytest.approx(-1.2 * 0.5)
    assert cispo_stats["clip_frac"] == 1.0                          # the weight was truncated
    assert cispo_loss.item() == pytest.approx(-1.2 * 0.5 * math.log(0.45))


def test_overlong_penalty_hand_worked():
    # DAPO eq. 13 with L_max = 20, L_cache = 4: no penalty up to 16, a linear ramp to -1 at 20, -1
    # beyond
    got = overlong_penalty(torch.tensor([1, 16, 17, 18, 20, 21, 99]), max_len=20, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


def test_overlong_penalty_never_hides_a_nan():
    got = overlong_penalty(torch.tensor([float("nan"), 17.0]), max_len=20, buffer=4)
    assert math.isnan(got[0]) and got[1] == -0.25


def ref_keep(correct, G):
    """DAPO eq. 11 by counting: a group is kept when 0 < #correct < G."""
    keep = []
    for g in range(len(correct) // G):
        n = sum(int(c) for c in correct[g * G:(g + 1) * G])
        keep += [0 < n < G] * G
    return keep


def test_dynamic_sampling_keeps_exactly_the_groups_with_0_lt_correct_lt_G():
    correct = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0])   # groups of 3: all right, mixed, all wrong
    assert dynamic_sampling_keep(correct, 3).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    g = torch.Generator().manual_seed(0)
    for G in (2, 3, 8):
        # varied groups
        correct = torch.rand(20 * G, generator=g) < torch.rand(20, generator=g).repeat_interleave(G)
        assert dynamic_sampling_keep(correct, G).tolist() == ref_keep(correct.tolist(), G)
        assert dynamic_sampling_keep(correct.float(), G).tolist() == ref_keep(correct.tolist(), G)


def test_a_format_bonus_never_makes_an_all_wrong_group_informative():
    """With --format_weight 0.5, an all-wrong group whose completions differ only in format has a
    reward spread (0 and 0.5) but no correct answer: eq. 11 drops it. A filter on the rewards would
    keep it."""
    prompt = "3+4*2="
    completions = ["3+4=7,7*2=14#14", "14", "3+4=7,7*2=14#14", "x"]     # all wrong; two well formed
    rewards = torch.tensor([task.reward(prompt, c, 0.5) for c in completions])
    correct = torch.tensor([task.reward(prompt, c) == 1.0 for c in completions])
    assert rewards.tolist() == [0.5, 0.0, 0.5, 0.0] and not correct.any()
    assert not dynamic_sampling_keep(correct, 4).any()


def test_at_mu_1_the_ratio_variants_give_grpos_gradient_and_the_other_options_do_not():
    """The claim the docstring makes, measured: with the ratio exactly 1 (old = logp.detach()),
    GSPO's sequence ratio, CISPO's clipped weight, SAPO's gate slope and DPPO's mask are 1, so the
    gradient is GRPO's; the sample std, the token and Dr. GRPO aggregations change it."""
    logp, _, ref, adv, mask = random_batch(seed=3)

    def grad(**kwargs):
        lp = logp.clone().requires_grad_(True)
        A = kwargs.pop("advantages", adv)
        loss, _ = grpo_loss(lp, lp.detach(), ref, A, mask, LossSettings(max_tokens=9, **kwargs))
        return torch.autograd.grad(loss, lp)[0]

    base = grad()
    assert torch.allclose(grad(ratio_level="sequence"), base, atol=1e-12)
    assert torch.allclose(grad(loss_type="cispo"), base, atol=1e-12)
    assert torch.allclose(grad(loss_type="sapo"), base, atol=1e-12)
    assert torch.allclose(grad(loss_type="dppo"), base, atol=1e-12)
    for other in (dict(loss_agg="token"), dict(loss_agg="dr_grpo"),
                  dict(advantages=adv * math.sqrt(4 / 5))):
        assert not torch.allclose(grad(**other), base, atol=1e-6), other


def test_the_loss_runs_when_copied_with_torch_and_kl_penalty_alone():
    """What a user copying grpo_loss gets: its source and its helpers', plus kernels.kl_penalty's,
    executed in a fresh namespace that holds only torch. It must run and agree with the imported
    function."""
    namespace = {"torch": torch, "dataclass": dataclass}
    for f in (kernels.kl_penalty, grpo.LossSettings, grpo.gspo_ratio, grpo.clip_terms,
              grpo.cispo_terms, grpo.sapo_terms, grpo.dppo_terms, grpo.aggregate, grpo.grpo_loss,
              grpo.grpo_advantages, grpo.maxrl_advantages):
        exec(inspect.getsource(f), namespace)
    logp, old, ref, adv, mask = random_batch(seed=4)
    for kwargs in (dict(), dict(ratio_level="sequence"), dict(loss_type="cispo", loss_agg="token"),
                   dict(loss_type="sapo"), dict(loss_type="dppo", divergence="kl", delta=0.01)):
        got, got_stats = namespace["grpo_loss"](logp, old, ref, adv, mask,
                                                namespace["LossSettings"](**kwargs))
        want, want_stats = grpo_loss(logp, old, ref, adv, mask, LossSettings(**kwargs))
        assert (torch.equal(got, want)
                and all(torch.equal(got_stats[k], want_stats[k]) for k in want_stats))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    assert torch.equal(namespace["grpo_advantages"](rewards, 3), grpo_advantages(rewards, 3))
    assert torch.equal(namespace["maxrl_advantages"](rewards, 3), grpo.maxrl_advantages(rewards, 3))


def test_gradient_is_the_hand_derived_one_inside_and_outside_the_clip():
    """beta = 0, one completion of 4 tokens, A = +1 or -1. d loss / d logp_t = -A * ratio_t / |o|
    where the unclipped term is taken, 0 where the clip binds (A > 0 and ratio > 1 + eps; A < 0 and
    ratio < 1 - eps)."""
    # inside, inside, above, below the clip
    ratios = torch.tensor([[1.0, 1.1, 1.5, 0.5]], dtype=torch.float64)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    for A, zero in ((1.0, [False, False, True, False]), (-1.0, [False, False, False, True])):
        lp = (old + ratios.log()).requires_grad_(True)
        loss, metrics = grpo_loss(lp, old, old, torch.tensor([A], dtype=torch.float64), mask,
                                  LossSettings(clip_eps=0.2, beta=0.0))
        g, = torch.autograd.grad(loss, lp)
        want = torch.tensor([[0.0 if z else -A * r / 4 for z, r in zip(zero, ratios[0].tolist())]],
                            dtype=torch.float64)
        assert torch.allclose(g, want, atol=1e-12), (A, g, want)
        assert metrics["clip_frac"] == 0.25
    # the KL part alone (A = 0): d/dlogp [e^(ref - logp) - (ref - logp) - 1] = 1 - e^(ref - logp),
    # over |o| tokens
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    zero, ones = torch.zeros(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    loss, _ = grpo_loss(lp, lp.detach(), ref, zero, ones, LossSettings(beta=0.1))
    g, = torch.autograd.grad(loss, lp)
    assert torch.allclose(g, 0.1 * (1 - torch.exp(ref - lp.detach())) / 2, atol=1e-12)


def test_on_policy_pass_is_policy_gradient():
    """mu = 1 as in R1: old_logp = logp.detach(), the ratio is 1, the loss is -mean A (beta = 0),
    and its gradient is -A_i / (B |o_i|) on every token: the REINFORCE gradient with the group
    baseline."""
    logp, _, ref, adv, mask = random_batch()
    lp = logp.clone().requires_grad_(True)
    loss, metrics = grpo_loss(lp, lp.detach(), ref, adv, mask, LossSettings(beta=0.0))
    has_tokens = (mask.sum(1) > 0).double()
    assert abs(loss.item() + (adv * has_tokens).mean().item()) < 1e-12
    g, = torch.autograd.grad(loss, lp)
    B = mask.size(0)
    assert torch.allclose(g, -adv[:, None] * mask / (B * mask.sum(1, keepdim=True)), atol=1e-12)
    assert metrics["clip_frac"] == 0.0 and abs(metrics["approx_kl"]) < 1e-12


def test_edge_cases_one_token_and_fully_masked_rows():
    logp, old, ref, adv, _ = random_batch(B=3, T=4)
    mask = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    lp = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, old, ref, adv, mask)
    want = ref_loss(logp, old, ref, adv, mask, 0.2, 0.04, 0.2, "k3", "seq")
    assert torch.isfinite(loss) and abs(loss.item() - want.item()) < 1e-12
    g, = torch.autograd.grad(loss, lp)
    assert ((g[1] == 0).all() and (g[0, 1:] == 0).all()
            and (g[0, 0] != 0))                                      # masked tokens get no gradient
    extreme = torch.full((2, 3), -30.0, dtype=torch.float64)         # tiny probabilities, ratio 1
    loss, _ = grpo_loss(extreme, extreme, extreme + 5, torch.ones(2, dtype=torch.float64),
                        torch.ones_like(extreme))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="'mean'"):
        grpo_loss(logp, old, ref, adv, mask, LossSettings(loss_agg="mean"))


# -----------------------------------------------------------------------------
# The script, end to end

TINY = ["--prompts_per_step", "4", "--group_size", "4", "--log_every", "1", "--eval_every", "2",
        "--eval_n", "8"]


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "grpo", "metrics.jsonl"))]


@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("grpo.py", TINY + ["--steps", "2", "--init", tiny_sft, "--out", out], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "held-out greedy accuracy" in p.stdout and "done: 2 steps" in p.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert ("eval_accuracy" in rows[0] and "eval_accuracy" in rows[2]
            and "eval_accuracy" not in rows[1])
    for key in ("reward_mean", "reward_std", "kl_exact", "kl_k3", "entropy", "completion_len",
                "zero_var_groups", "grad_norm", "clip_frac", "approx_kl", "tokens_per_sec"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert rows[1]["kl_exact"] >= 0 and 0 <= rows[1]["reward_mean"] <= 1
    # the sampler's log-probs against the trainer's, same weights: float32 rounding apart
    assert all(0 <= r["sampler_logp_diff"] < 1e-4 for r in rows[1:])
    _, ckpt = load_checkpoint(os.path.join(out, "grpo.pt"), kind="gpt")
    assert ckpt["step"] == 2

    p = run_script("grpo.py", TINY + ["--steps", "3", "--init", tiny_sft, "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt2 = load_checkpoint(os.path.join(out, "grpo.pt"))
    assert ckpt2["step"] == 3
    # it trained on
    assert not torch.equal(ckpt2["model"]["wte.weight"], ckpt["model"]["wte.weight"])
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]


def test_one_pass_of_the_loss_logs_what_the_policys_own_pass_logs(tiny_sft, tmp_path):
    """At --mu 1 the logged KL, entropy and sampler gap come from the loss forward, measured after
    its backward (Scored.measure); at --mu 2 from a policy pass before any update. Step 1 scores
    the same weights and samples, so its logged figures are the same bits, the entropy not 0."""
    rows = {}
    for mu in (1, 2):
        out = str(tmp_path / f"mu{mu}")
        p = run_script("grpo.py", TINY + ["--steps", "1", "--mu", str(mu), "--eval_every", "100",
                                          "--init", tiny_sft, "--out", out],
                       env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr
        rows[mu] = read_metrics(out)[1]
    assert rows[1]["entropy"] > 0
    for key in ("kl_exact", "entropy", "sampler_logp_diff", "sampler_kl", "reward_mean"):
        assert rows[1][key] == rows[2][key], key


def test_script_runs_gspo_cispo_and_dapo_options(tiny_sft, tmp_path):
    common = ["--prompts_per_step", "4", "--group_size", "4", "--log_every", "1",
              "--eval_every", "100", "--eval_n", "8", "--steps", "2", "--mu", "2",
              "--init", tiny_sft]
    p = run_script("grpo.py", common + ["--out", str(tmp_path / "a"), "--loss_type", "cispo",
                                        "--loss_agg", "token", "--dynamic_sampling",
                                        "--max_sample_rounds", "3", "--overlong_buffer", "4"])
    assert p.returncode == 0, p.stderr
    rows = read_metrics(str(tmp_path / "a"))[1:]
    for r in rows:
        assert r["groups_kept"] <= 4 and 4 <= r["groups_sampled"] <= 12 and r["samples"] % 16 == 0
        # the batch is full, or the rounds ran out
        assert r["groups_kept"] == 4 or r["groups_sampled"] == 12
        assert 0 <= r["sampler_logp_diff"] < 1e-4       # each kept row's own log-probs, aligned
    p = run_script("grpo.py", common + ["--out", str(tmp_path / "b"), "--ratio_level", "sequence",
                                        "--std", "sample", "--clip_eps", "3e-4",
                                        "--eps_high", "4e-4"])
    assert p.returncode == 0, p.stderr
    assert ("sequence ratio" in p.stdout
            and math.isfinite(read_metrics(str(tmp_path / "b"))[-1]["clip_frac"]))


def test_dynamic_sampling_with_fewer_kept_rows_than_micro_batches(tiny_sft, tmp_path):
    """One round of dynamic sampling keeps one group of 2 rows at step 1, split into 4
    micro-batches: two of them are empty, and still run (under torchrun every rank must run the same
    number of forward/backward passes). The completions are tests/ddp_worker.py's fixed ones (a
    function of the prompt and the sample's index), so which groups are mixed does not depend on the
    policy or the torch build: seed 0's first four prompts hold one such group."""
    out = str(tmp_path)
    p = run_script(os.path.join("tests", "ddp_worker.py"), [
        "grpo", "--dynamic_sampling", "--max_sample_rounds", "1", "--grad_accum", "4",
        "--prompts_per_step", "4", "--group_size", "2", "--steps", "2", "--log_every", "1",
        "--eval_every", "100", "--eval_n", "8", "--seed", "0", "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr[-2000:]
    assert read_metrics(out)[1]["groups_kept"] == 1                  # 2 rows for 4 micro-batches


def test_script_rejects_bad_settings_with_a_message(tmp_path):
    refuses_all("grpo.py", [(["--group_size", "1"], ["--group_size", "1"]),
                            (["--temperature", "0"], ["--temperature", "0"]),
                            (["--overlong_buffer", "30"],
                             ["--overlong_buffer 30", "--max_new_tokens 24"]),
                            (["--init", str(tmp_path / "missing.pt")], ["no checkpoint at"])],
                tmp_path)


@pytest.mark.slow
def test_grpo_raises_the_training_reward(tiny_sft, tmp_path):
    """30 steps from the tiny SFT policy with a fixed seed raise the mean training reward of the
    last 8 steps over that of the first 8 by more than 0.2 (seeds 0, 1, 2 gave +0.38, +0.44, +0.41).
    The tiny policy's arithmetic is too weak for the correctness reward alone to move in 30 steps,
    so the run samples at temperature 2, where many completions are malformed, and the verifier adds
    its format reward (--format_weight 1): a signal the loop must climb through the sampler, the
    temperature-matched log-probs, the advantages and the loss's sign."""
    out = str(tmp_path)
    p = run_script("grpo.py", ["--steps", "30", "--prompts_per_step", "16", "--group_size", "8",
                               "--lr", "5e-4", "--temperature", "2.0", "--format_weight", "1.0",
                               "--log_every", "1", "--eval_every", "1000", "--eval_n", "16",
                               "--seed", "0", "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    rewards = [r["reward_mean"] for r in read_metrics(out) if "reward_mean" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.2, (first, last, rewards)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_reference_scores_as_its_float32_self_under_autocast(device):
    """loading.bf16_linears (grpo.py's reference on a GPU): under bfloat16 autocast the hidden
    states and log-probs are its float32 self's, bit for bit (autocast multiplies in bfloat16
    anyway); casting the embedding too would change them (the control)."""
    import copy
    import warnings

    from model import GPT, GPTConfig, completion_hidden
    from plumbing.loading import bf16_linears
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       mlp_hidden=64, norm="rmsnorm", pos="rope", mlp="swiglu", bias=False,
                       qkv_bias=True)
    model = GPT(config).to(device).requires_grad_(False)
    for p in model.parameters():                       # biases and norms away from 0 and 1
        p.add_(0.1 * torch.randn_like(p))
    half = bf16_linears(copy.deepcopy(model))
    linears = [m for m in half.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(p.dtype == torch.bfloat16 for m in linears for p in m.parameters())
    assert half.wte.weight.dtype == torch.float32
    prompt, tokens = torch.randint(0, 96, (3, 5)), torch.randint(0, 96, (3, 7))
    prompt_mask, mask = torch.ones(3, 5), torch.ones(3, 7)
    prompt_mask[0, :2] = 0
    mask[1, 4:] = 0
    prompt, tokens, prompt_mask, mask = (x.to(device) for x in (prompt, tokens, prompt_mask, mask))

    def score(m):
        with torch.autocast(device, dtype=torch.bfloat16):
            h = completion_hidden(m, prompt, prompt_mask, tokens, mask)
            return h, m.head_logprobs(h, tokens)
    (h, logp), (h_half, logp_half) = score(model), score(half)
    assert torch.equal(h, h_half) and torch.equal(logp, logp_half)
    half.wte.to(torch.bfloat16)                        # the control: not what autocast computes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                # rms_norm: bfloat16 input, float32 weight
        assert not torch.equal(score(half)[0].float(), h)


def test_the_gradients_hold_no_memory_while_the_next_batch_is_sampled(tiny_sft, tmp_path,
                                                                      monkeypatch):
    """grpo.py frees the gradients after AdamW's step (set to None), not before the next backward:
    no rollout after the first sees one (2 GB at Qwen2.5-0.5B, results/gpu.md); every step still
    moves the weights."""
    seen, weights, real = [], [], grpo.rollout

    def rollout(run, policy, tok, args):
        seen.append(sum(p.grad is not None for p in policy.parameters()))
        weights.append([p.detach().clone() for p in policy.parameters()])
        return real(run, policy, tok, args)
    monkeypatch.setattr(grpo, "rollout", rollout)
    with as_a_process():
        grpo.main(grpo.parse_args(TINY + ["--steps", "3", "--init", tiny_sft,
                                          "--out", str(tmp_path), "--device", "cpu"]))
    assert seen == [0, 0, 0]
    assert all(any(not torch.equal(a, b) for a, b in zip(weights[i], weights[i + 1]))
               for i in range(2))
