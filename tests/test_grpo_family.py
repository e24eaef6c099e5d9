"""grpo.py's newer family against float64 references written here from the papers' equations, token
by token: SAPO's soft gate (arXiv 2511.20347), DPPO's binary-divergence mask (arXiv 2602.04879,
eqs. 11-14) and MaxRL's advantages (arXiv 2602.02710); forward and gradient, hand-worked and random
cases, the edges (ratio exactly 1, zero advantages, one-token completions), and the refusals."""
import math

import pytest
import torch

import grpo
from conftest import run_script
from grpo import LossSettings, grpo_advantages, grpo_loss, maxrl_advantages

F64 = dict(dtype=torch.float64)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# -----------------------------------------------------------------------------
# float64 references, a token at a time

def ref_sapo_token(logp, old, A, tau_pos, tau_neg):
    """-f(r) A, f(x) = sigma(tau (x - 1)) 4 / tau, tau by the sign of A (SAPO's objective, negated;
    logp a float64 scalar tensor with grad)."""
    tau = tau_pos if A > 0 else tau_neg
    r = torch.exp(logp - old)
    return -torch.sigmoid(tau * (r - 1)) * 4 / tau * A


def ref_binary_divergence(p, q, kind):
    """Between Bernoulli(q) (pi_old on the sampled token) and Bernoulli(p) (pi_theta), in floats."""
    if kind == "tv":
        return abs(p - q)
    term = lambda a, b: 0.0 if a == 0 else (math.inf if b == 0 else a * math.log(a / b))
    return term(q, p) + term(1 - q, 1 - p)                      # KL(q || p)


def ref_dppo_token(logp, old, A, kind, delta, cap=10.0):
    """-M r A (DPPO eq. 11, negated): M = 0 where D > delta and p moved the way A pushes; past
    the cap, as the authors' code: -M sg(min(r, c)) A log pi, shifted to the value -M c A."""
    p, q = math.exp(float(logp.detach())), math.exp(float(old))
    away = (A > 0 and p > q) or (A < 0 and p < q)
    if away and ref_binary_divergence(p, q, kind) > delta:
        return 0.0 * logp
    if p / q > cap:
        return -cap * A * (1 + logp - float(logp.detach()))
    return -torch.exp(logp - old) * A


def ref_loss(logp, old, adv, mask, token_term):
    """1/B sum_i 1/|o_i| sum_t term_it (the seq aggregation), beta = 0."""
    total = 0.0
    for i in range(logp.size(0)):
        real = [t for t in range(logp.size(1)) if mask[i, t] != 0]
        s = sum((token_term(logp[i, t], float(old[i, t]), float(adv[i])) for t in real), 0.0)
        total = total + s / max(len(real), 1)
    return total / logp.size(0)


def random_batch(B=6, T=7, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, **F64) * 3
    old = logp + spread * torch.randn(B, T, generator=g, **F64)
    adv = torch.randn(B, generator=g, **F64)
    adv[0] = 0.0                                                # a zero advantage
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[1] = 0.0                                               # a fully masked row
    mask[2, 1:] = 0.0                                           # a one-token completion
    return logp, old, adv, mask


def loss_and_grad(logp, old, adv, mask, **kwargs):
    lp = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, old, old, adv, mask, LossSettings(beta=0.0, **kwargs))
    return loss, torch.autograd.grad(loss, lp)[0], stats


def ref_and_grad(logp, old, adv, mask, token_term):
    lp = logp.clone().requires_grad_(True)
    want = ref_loss(lp, old, adv, mask, token_term)
    return want, torch.autograd.grad(want, lp)[0]


# -----------------------------------------------------------------------------
# SAPO

@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 8.0)])
def test_sapo_matches_its_float64_reference(tau_pos, tau_neg):
    for seed in range(3):
        logp, old, adv, mask = random_batch(seed=seed, spread=0.5)
        loss, g, _ = loss_and_grad(logp, old, adv, mask, loss_type="sapo", tau_pos=tau_pos,
                                   tau_neg=tau_neg)
        want, g_ref = ref_and_grad(logp, old, adv, mask,
                                   lambda lp, o, A: ref_sapo_token(lp, o, A, tau_pos, tau_neg))
        assert abs(loss.item() - want.item()) < 1e-12
        assert torch.allclose(g, g_ref, atol=1e-12)
        assert (g[0] == 0).all() and (g[1] == 0).all() and (g[2, 1:] == 0).all()


def test_sapo_hand_worked():
    """tau (r - 1) = ln 3 puts the gate at sigma = 3/4: f = 3/4 * 4 / tau, and the gradient's
    weight 4 sigma (1 - sigma) = 3/4, so d loss / d log pi = -A (3/4) r (one token)."""
    one = torch.ones(1, 1, **F64)
    for A, tau in ((1.0, 1.0), (-1.0, 2.0)):                    # tau_pos 1 for A > 0, tau_neg 2
        r = 1 + math.log(3) / tau
        old = torch.tensor([[-1.0]], **F64)
        logp = old + math.log(r)
        loss, g, stats = loss_and_grad(logp, old, torch.tensor([A], **F64), one, loss_type="sapo",
                                       tau_pos=1.0, tau_neg=2.0)
        assert loss.item() == pytest.approx(-A * 0.75 * 4 / tau, abs=1e-12)
        assert g.item() == pytest.approx(-A * 0.75 * r, abs=1e-12)
        assert stats["clip_frac"] == 0.0                        # the weight 3/4 is above one half


def test_sapo_at_ratio_one_is_grpo_and_fades_smoothly_where_the_clip_cuts():
    """r = 1: f'(1) = 4 sigma(0)^2 = 1, GRPO's gradient exactly; at r = 1.5 with A > 0 the clip
    (0.2) gives no gradient, SAPO a weight 4 sigma(0.5) (1 - sigma(0.5)) = 0.940 times r."""
    logp, _, adv, mask = random_batch(seed=5)
    _, g_sapo, _ = loss_and_grad(logp, logp, adv, mask, loss_type="sapo")
    _, g_clip, _ = loss_and_grad(logp, logp, adv, mask)
    assert torch.equal(g_sapo, g_clip)
    old = torch.tensor([[math.log(0.3)]], **F64)
    lp = old + math.log(1.5)
    one, A = torch.ones(1, 1, **F64), torch.tensor([1.0], **F64)
    assert loss_and_grad(lp, old, A, one)[1].item() == 0.0
    w = 4 * sigmoid(0.5) * (1 - sigmoid(0.5))
    assert loss_and_grad(lp, old, A, one, loss_type="sapo")[1].item() == pytest.approx(-w * 1.5)


def test_sapo_negative_tokens_fade_faster():
    """The asymmetry the paper asks for (tau_neg > tau_pos): at the same distance from 1, a token
    with A < 0 keeps less of its gradient than one with A > 0."""
    old = torch.full((1, 1), -1.0, **F64)
    one = torch.ones(1, 1, **F64)
    for r in (0.5, 1.8):
        lp = old + math.log(r)
        pos = loss_and_grad(lp, old, torch.tensor([1.0], **F64), one, loss_type="sapo",
                            tau_pos=1.0, tau_neg=4.0)[1].abs().item()
        neg = loss_and_grad(lp, old, torch.tensor([-1.0], **F64), one, loss_type="sapo",
                            tau_pos=1.0, tau_neg=4.0)[1].abs().item()
        assert neg < pos


# -----------------------------------------------------------------------------
# DPPO

@pytest.mark.parametrize("kind,delta", [("tv", 0.15), ("tv", 0.02), ("kl", 0.05), ("kl", 0.005)])
def test_dppo_matches_its_float64_reference(kind, delta):
    for seed in range(3):
        logp, old, adv, mask = random_batch(seed=seed, spread=0.5)
        loss, g, stats = loss_and_grad(logp, old, adv, mask, loss_type="dppo", divergence=kind,
                                       delta=delta)
        want, g_ref = ref_and_grad(logp, old, adv, mask,
                                   lambda lp, o, A: ref_dppo_token(lp, o, A, kind, delta))
        assert abs(loss.item() - want.item()) < 1e-12
        assert torch.allclose(g, g_ref, atol=1e-12)
        assert (g[0] == 0).all() and (g[1] == 0).all() and (g[2, 1:] == 0).all()
        if delta < 0.05:
            assert 0 < stats["clip_frac"] < 1                  # some masked, some kept


@pytest.mark.parametrize("cap", [1.1, 1.3])
def test_dppo_truncates_the_ratio_at_its_cap_as_the_authors_code(cap):
    for seed in range(3):
        logp, old, adv, mask = random_batch(seed=seed, spread=0.5)
        loss, g, _ = loss_and_grad(logp, old, adv, mask, loss_type="dppo", delta=0.5,
                                   ratio_cap=cap)
        want, g_ref = ref_and_grad(logp, old, adv, mask,
                                   lambda lp, o, A: ref_dppo_token(lp, o, A, "tv", 0.5, cap))
        assert abs(loss.item() - want.item()) < 1e-12
        assert torch.allclose(g, g_ref, atol=1e-12)
        assert ((torch.exp(logp - old) > cap) & (mask > 0)).any()     # the cap acted here
    # by hand: q = 0.05, p = 0.9 (r = 18), A = -1 (not masked: it moved up, A pushes down):
    # d loss / d log pi = -c A = 10, where the uncapped -r A would be 18
    at = lambda p: torch.tensor([[math.log(p)]], **F64)
    one, A = torch.ones(1, 1, **F64), torch.tensor([-1.0], **F64)
    loss, g, _ = loss_and_grad(at(0.9), at(0.05), A, one, loss_type="dppo", delta=1.0)
    assert g.item() == pytest.approx(10.0) and loss.item() == pytest.approx(10.0)
    g = loss_and_grad(at(0.9), at(0.05), A, one, loss_type="dppo", delta=1.0, ratio_cap=20.0)[1]
    assert g.item() == pytest.approx(18.0)


def test_a_loss_that_is_not_finite_names_the_constants_of_its_loss_type():
    for flags, words in (([], "lower --lr (now 0.0003)"),
                         (["--loss_type", "sapo"], "--tau_pos 1 and --tau_neg 1.05"),
                         (["--loss_type", "dppo", "--ratio_cap", "20"], "--ratio_cap 20")):
        hint = grpo.loss_settings(grpo.parse_args(["--init", "x.pt", *flags]))[1]
        assert hint.startswith("lower --lr (now 0.0003)") and words in hint, hint


def test_dppo_hand_worked_tv():
    """q = 0.5: p = 0.7 is 0.2 away (> 0.15): masked for A > 0 (it moved up, the way A pushes),
    kept for A < 0 (d loss / d log pi = -A r = 1.4); p = 0.6 (0.1 away) is kept for A > 0."""
    old, one = torch.tensor([[math.log(0.5)]], **F64), torch.ones(1, 1, **F64)
    at = lambda p: torch.tensor([[math.log(p)]], **F64)
    A = lambda a: torch.tensor([a], **F64)
    loss, g, stats = loss_and_grad(at(0.7), old, A(1.0), one, loss_type="dppo")
    assert g.item() == 0.0 and loss.item() == 0.0 and stats["clip_frac"] == 1.0
    assert loss_and_grad(at(0.7), old, A(-1.0), one, loss_type="dppo")[1].item() == \
        pytest.approx(1.4)
    assert loss_and_grad(at(0.6), old, A(1.0), one, loss_type="dppo")[1].item() == \
        pytest.approx(-1.2)
    # moved down beyond the bound with A < 0: masked; with A > 0: kept
    assert loss_and_grad(at(0.3), old, A(-1.0), one, loss_type="dppo")[1].item() == 0.0
    assert loss_and_grad(at(0.3), old, A(1.0), one, loss_type="dppo")[1].item() == \
        pytest.approx(-0.6)


def test_dppo_kl_is_kl_of_old_to_new_hand_worked():
    """q = 0.5, p = 0.7: KL(q || p) = 0.5 ln(25/21) = 0.08717, KL(p || q) = 0.08228. A bound of
    0.085 lies between them: the paper's direction masks the token (A > 0), the other would not."""
    assert 0.5 * math.log(25 / 21) == pytest.approx(0.08717, abs=1e-5)
    old, one = torch.tensor([[math.log(0.5)]], **F64), torch.ones(1, 1, **F64)
    lp, A = torch.tensor([[math.log(0.7)]], **F64), torch.tensor([1.0], **F64)
    g = loss_and_grad(lp, old, A, one, loss_type="dppo", divergence="kl", delta=0.085)[1]
    assert g.item() == 0.0
    g = loss_and_grad(lp, old, A, one, loss_type="dppo", divergence="kl", delta=0.088)[1]
    assert g.item() == pytest.approx(-1.4)


def test_dppo_kl_at_the_edges_of_the_simplex_is_finite_or_infinite_never_nan():
    """p = q = 1 (padding, or a certain token): D = 0; q < 1 = p: D = inf (masked if A > 0)."""
    zero = torch.zeros(1, 2, **F64)
    lp = torch.tensor([[0.0, 0.0]], **F64)
    old = torch.tensor([[0.0, math.log(0.9)]], **F64)
    terms, masked = grpo.dppo_terms(lp, old, torch.exp(lp - old), torch.ones(1, 1, **F64), "kl")
    assert torch.isfinite(terms).all() and masked.tolist() == [[False, True]]
    _, masked = grpo.dppo_terms(lp, old, torch.exp(lp - old), zero[:, :1], "kl")
    assert not masked.any()                                     # A = 0: nothing pushes


def test_dppo_at_ratio_one_is_grpo():
    logp, _, adv, mask = random_batch(seed=6)
    for kind in ("tv", "kl"):
        _, g, stats = loss_and_grad(logp, logp, adv, mask, loss_type="dppo", divergence=kind)
        assert torch.equal(g, loss_and_grad(logp, logp, adv, mask)[1])
        assert stats["clip_frac"] == 0.0


# -----------------------------------------------------------------------------
# MaxRL

def ref_maxrl(rewards, G, eps=1e-6):
    out = []
    for k in range(len(rewards) // G):
        r = [float(x) for x in rewards[k * G:(k + 1) * G]]
        p = sum(r) / G
        out += [0.0 if all(x == r[0] for x in r) else (x - p) / (p + eps) for x in r]
    return torch.tensor(out, **F64)


def test_maxrl_hand_worked():
    """One success in four: p = 1/4, A = 3 and -1 (GRPO: 1.732 and -0.577); two: A = 1 and -1."""
    a = maxrl_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4)
    assert torch.allclose(a, torch.tensor([3.0, -1, -1, -1, 1, 1, -1, -1]), atol=1e-4)
    assert grpo_advantages(torch.tensor([1.0, 0, 0, 0]), 4)[0].item() == pytest.approx(
        math.sqrt(3), abs=1e-4)


@pytest.mark.parametrize("G", [2, 4, 8])
def test_maxrl_matches_its_reference_and_its_estimator(G):
    """Random 0/1 and graded rewards against the reference; and the estimator the paper derives:
    1/G sum_i A_i x_i = 1/K sum_{correct} x_i - 1/G sum_i x_i for any per-sample vectors x_i (the
    score functions), K the group's successes."""
    gen = torch.Generator().manual_seed(G)
    rewards = (torch.rand(9 * G, generator=gen) < 0.4).double()
    rewards[-G:] = torch.rand(G, generator=gen, **F64)          # a graded group
    got = maxrl_advantages(rewards, G)
    assert torch.allclose(got, ref_maxrl(rewards.tolist(), G), atol=1e-12)
    x = torch.randn(9 * G, 3, generator=gen, **F64)
    for k in range(8):                                          # the 0/1 groups
        r, a, xs = (t[k * G:(k + 1) * G] for t in (rewards, got, x))
        if 0 < r.sum() < G:
            want = xs[r == 1].sum(0) / r.sum() - xs.sum(0) / G
            assert torch.allclose((a[:, None] * xs).sum(0) / G, want, atol=1e-5)


def test_maxrl_edges():
    """All wrong, all right, all equal graded: A = 0 exactly; G = 1: 0; negative rewards: refused
    (the mean is no pass rate)."""
    a = maxrl_advantages(torch.tensor([0.0, 0, 0, 1, 1, 1, 0.5, 0.5, 0.5]), 3)
    assert torch.equal(a, torch.zeros(9))
    assert (maxrl_advantages(torch.tensor([1.0, 0.0]), 1) == 0).all()
    with pytest.raises(ValueError, match="rewards must be >= 0"):
        maxrl_advantages(torch.tensor([1.0, -0.5]), 2)
    with pytest.raises(ValueError, match="cannot be split"):
        maxrl_advantages(torch.tensor([1.0, 0.0, 1.0]), 2)


# -----------------------------------------------------------------------------
# The flags: refused in one line before anything loads

@pytest.mark.parametrize("flags,message", [
    (["--tau_pos", "2"], "--tau_pos is SAPO's; it needs --loss_type sapo"),
    (["--loss_type", "dppo", "--tau_neg", "2"], "--tau_neg is SAPO's"),
    (["--delta", "0.1"], "--delta is DPPO's; it needs --loss_type dppo"),
    (["--loss_type", "sapo", "--divergence", "kl"], "--divergence is DPPO's"),
    (["--loss_type", "dppo", "--ratio_level", "sequence"], "--loss_type dppo weighs each token"),
    (["--maxrl", "--no_std_scaling"], "--maxrl divides by the group's mean reward"),
    (["--maxrl", "--overlong_buffer", "4"], "--maxrl divides by the group's mean reward"),
    (["--loss_type", "sapo", "--tau_neg", "0"], "--tau_neg"),
    # float32 cannot keep SAPO's gate finite past these (1e-300 gave -inf at step 2)
    (["--loss_type", "sapo", "--tau_pos", "1e-300"],
     "--tau_pos: 1e-300 is not allowed (allowed: a number >= 0.001 and <= 1000)"),
    (["--loss_type", "sapo", "--tau_neg", "1e39"], "--tau_neg: 1e39 is not allowed"),
    (["--loss_type", "sapo", "--ratio_level", "sequence"],
     "--loss_type sapo weighs each token"),
    (["--maxrl", "--format_weight", "0.1"], "with --format_weight 0.1 the mean is not a pass"),
    (["--ratio_cap", "5"], "--ratio_cap is DPPO's; it needs --loss_type dppo"),
    (["--loss_type", "dppo", "--ratio_cap", "0.5"], "--ratio_cap"),
])
def test_bad_flags_are_refused_before_anything_loads(flags, message, tmp_path):
    p = run_script("grpo.py", ["--out", str(tmp_path / "o"), "--init", str(tmp_path / "none.pt"),
                               *flags])
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()
