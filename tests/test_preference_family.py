"""kto.py, simpo.py, orpo.py and online_dpo.py: each loss and its gradient against a float64
reference written here from the paper's equation, hand-worked values, edge cases (identical pairs,
one-token and very long completions, ORPO at avg log-prob 0, KTO's one-label batches and its
detached reference point), the losses copied out with torch alone, online DPO's pairing of its
samples, and each script end to end (a run, its resume, and refusals)."""
import importlib.util
import inspect
import json
import math
import os
import re

import pytest
import torch

import task
from conftest import ROOT, refused, run_script
from hf.checkpoint import load_checkpoint


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing runs nothing: training is under __main__
    return module


kto, simpo, orpo, online_dpo, dpo = (load(n) for n in ("kto", "simpo", "orpo", "online_dpo", "dpo"))
f64 = dict(dtype=torch.float64)


# -----------------------------------------------------------------------------
# float64 references, straight from the equations (element by element where the code is vectorised)

def sigmoid(u):
    return 1 / (1 + math.exp(-u)) if u >= 0 else math.exp(u) / (1 + math.exp(u))


def simpo_reference(cw, cl, beta, gamma):
    """Meng et al. 2024, eq. 6: -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) -
    gamma), inputs the per-token averages; -log sigma(u) written as log(1 + exp(-u)) in a stable
    form (not logsigmoid)."""
    u = beta * cw - beta * cl - gamma
    return torch.clamp(-u, min=0) + torch.log1p(torch.exp(-torch.abs(u)))


def log1mexp(x):
    """log(1 - e^x) for x < 0: the series log(-x) + log(1 + x/2 + x^2/6 + x^3/24) near 0, else log(1
    - e^x)."""
    if x > -1e-3:
        return torch.log(-x) + torch.log1p(x / 2 + x ** 2 / 6 + x ** 3 / 24)
    return torch.log(1 - torch.exp(x))


def orpo_reference(cw, cl, lam):
    """Hong et al. 2024, eqs. 2-6: odds(y|x) = p / (1 - p), p = exp(avg log-prob);
    L = -log p(y_w|x) - lam log sigma(log(odds(y_w|x) / odds(y_l|x)))."""
    out = []
    for a, b in zip(cw, cl):
        ratio = (a - log1mexp(a)) - (b - log1mexp(b))                       # log(odds_w / odds_l)
        out.append(-a + lam * (torch.clamp(-ratio, min=0)
                               + torch.log1p(torch.exp(-torch.abs(ratio)))))
    return torch.stack(out)


def kto_reference(policy, ref, desirable, z0, beta, lambda_d, lambda_u):
    """Ethayarajh et al. 2024, eq. 8, per example: lambda_y - v(x, y), v = lambda_D sigma(beta (r -
    z0)) (desirable) or lambda_U sigma(beta (z0 - r)) (undesirable), r = log pi/pi_ref; z0 a
    constant."""
    out = []
    for p, q, d in zip(policy, ref, desirable.tolist()):
        r = p - q
        if d:
            out.append(lambda_d - lambda_d * torch.sigmoid(beta * (r - z0)))
        else:
            out.append(lambda_u - lambda_u * torch.sigmoid(beta * (z0 - r)))
    return torch.stack(out)


def fresh_generator():
    # fresh inputs each run
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))


def avg_logps(n, gen, low=-3.0, high=-0.01):
    return low + (high - low) * torch.rand(n, generator=gen, **f64)


def grads(fn, *inputs, weights):
    """d(sum_i w_i fn(...)_i)/d input for each input, by autograd."""
    xs = [x.clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in xs]


# -----------------------------------------------------------------------------
# The losses against their references: values and gradients

@pytest.mark.parametrize("B", [1, 7, 64])
def test_simpo_loss_and_gradient_match_the_float64_reference(B):
    gen = fresh_generator()
    for beta, gamma in ((2.0, 1.0), (2.5, 1.375), (0.5, 0.0), (10.0, 3.0)):
        cw, cl = avg_logps(B, gen), avg_logps(B, gen)
        w = torch.rand(B, generator=gen, **f64)
        got, (gw, gl) = grads(lambda a, b: simpo.simpo_loss(a, b, beta, gamma)[0], cw, cl,
                              weights=w)
        want, (ww, wl) = grads(lambda a, b: simpo_reference(a, b, beta, gamma), cw, cl, weights=w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, ww), torch.testing.assert_close(gl, wl)
        # closed form: dL/dcw = -beta sigma(-u), dL/dcl = +beta sigma(-u), u = beta (cw - cl) -
        # gamma
        u = beta * (cw - cl) - gamma
        torch.testing.assert_close(gw, -beta * w * torch.sigmoid(-u)), torch.testing.assert_close(
            gl, -gw)
        _, r_w, r_l = simpo.simpo_loss(cw, cl, beta, gamma)
        torch.testing.assert_close(r_w, beta * cw), torch.testing.assert_close(r_l, beta * cl)


@pytest.mark.parametrize("B", [1, 7, 64])
def test_orpo_loss_and_gradient_match_the_float64_reference(B):
    gen = fresh_generator()
    for lam in (0.1, 0.2, 1.0, 0.0):
        cw, cl = avg_logps(B, gen), avg_logps(B, gen, low=-8.0)
        w = torch.rand(B, generator=gen, **f64)
        got, (gw, gl) = grads(lambda a, b: orpo.orpo_loss(a, b, lam)[0], cw, cl, weights=w)
        want, (ww, wl) = grads(lambda a, b: orpo_reference(a, b, lam), cw, cl, weights=w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, ww), torch.testing.assert_close(gl, wl)
        # closed form: d log-odds / dx = 1 / (1 - e^x); dL/dcw = -1 - lam sigma(-R) / (1 - p_w), R
        # the log odds ratio
        _, lo_w, lo_l = orpo.orpo_loss(cw, cl, lam)
        R = lo_w - lo_l
        torch.testing.assert_close(gw, w * (-1 - lam * torch.sigmoid(-R) / (1 - torch.exp(cw))))
        torch.testing.assert_close(gl, w * lam * torch.sigmoid(-R) / (1 - torch.exp(cl)))
        # log(p / (1 - p))
        torch.testing.assert_close(lo_w, torch.log(torch.exp(cw) / (1 - torch.exp(cw))))


@pytest.mark.parametrize("B", [1, 7, 64])
def test_kto_loss_and_gradient_match_the_float64_reference(B):
    gen = fresh_generator()
    for beta, lambda_d, lambda_u in ((0.1, 1.0, 1.0), (0.1, 1.0, 2.35), (0.5, 1.33, 1.0),
                                     (2.0, 0.7, 3.0)):
        policy, ref = (-30 * torch.rand(B, generator=gen, **f64),
                       -30 * torch.rand(B, generator=gen, **f64))
        desirable = torch.rand(B, generator=gen) < 0.6
        z0 = torch.rand((), generator=gen, **f64) * 3
        w = torch.rand(B, generator=gen, **f64)
        args = (ref, desirable, z0, beta, lambda_d, lambda_u)
        got, (gp,) = grads(lambda p: kto.kto_loss(p, *args)[0], policy, weights=w)
        want, (wp,) = grads(lambda p: kto_reference(p, *args), policy, weights=w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gp, wp)
        # closed form: dv/dr = lambda beta sigma (1 - sigma), with the sign of the branch; the loss
        # is lambda_y - v
        r = policy - ref
        s = torch.where(desirable, torch.sigmoid(beta * (r - z0)), torch.sigmoid(beta * (z0 - r)))
        lam = torch.where(desirable, torch.tensor(lambda_d, **f64), torch.tensor(lambda_u, **f64))
        sign = torch.where(desirable, -1.0, 1.0).to(torch.float64)
        torch.testing.assert_close(gp, w * sign * lam * beta * s * (1 - s))
        assert got.mean().item() == pytest.approx(want.mean().item(), abs=1e-12)   # L_KTO: the mean
        torch.testing.assert_close(kto.kto_loss(policy, ref, desirable, z0, beta, lambda_d,
                                                lambda_u)[1], beta * (policy - ref))


def test_online_dpo_writes_the_dpo_loss_again_word_for_word():
    """online_dpo.py imports nothing from dpo.py; its dpo_loss is the same function, written
    again."""
    assert inspect.getsource(online_dpo.dpo_loss) == inspect.getsource(dpo.dpo_loss)
    gen = fresh_generator()
    pc, pr, rc, rr = (-30 * torch.rand(16, generator=gen, **f64) for _ in range(4))
    for a, b in zip(online_dpo.dpo_loss(pc, pr, rc, rr, 0.1), dpo.dpo_loss(pc, pr, rc, rr, 0.1)):
        assert torch.equal(a, b)


def test_float32_inputs_agree_with_float64():
    gen = fresh_generator()
    cw, cl = avg_logps(256, gen), avg_logps(256, gen, low=-6.0)
    torch.testing.assert_close(simpo.simpo_loss(cw.float(), cl.float())[0].double(),
                               simpo_reference(cw, cl, 2.0, 1.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(orpo.orpo_loss(cw.float(), cl.float())[0].double(),
                               orpo_reference(cw, cl, 0.1), rtol=1e-5, atol=1e-5)
    p, q, d = -30 * torch.rand(256, generator=gen, **f64), -30 * torch.rand(256, generator=gen,
                                                                            **f64), cw > -1.5
    torch.testing.assert_close(kto.kto_loss(p.float(), q.float(), d, torch.tensor(0.3))[0].double(),
                               kto_reference(p, q, d, 0.3, 0.1, 1.0, 1.0), rtol=1e-5, atol=1e-6)


# -----------------------------------------------------------------------------
# Hand-worked values and edge cases

def test_hand_worked_examples():
    t = lambda *xs: torch.tensor(xs, **f64)
    # SimPO: avg log-probs -0.5 and -1.0, beta 2, gamma 1: u = -1 + 2 - 1 = 0, the loss log 2
    assert simpo.simpo_loss(t(-0.5), t(-1.0), 2.0, 1.0)[0].item() == pytest.approx(math.log(2),
                                                                                   abs=1e-15)
    # ORPO: p_w = 1/2 (odds 1), p_l = 1/5 (odds 1/4): ratio log 4, L_OR = -log(4/5); NLL log 2
    loss, lo_w, lo_l = orpo.orpo_loss(t(math.log(0.5)), t(math.log(0.2)), lam=0.1)
    assert (lo_w.item() == pytest.approx(0.0, abs=1e-15)
            and lo_l.item() == pytest.approx(math.log(0.25), abs=1e-14))
    assert loss.item() == pytest.approx(math.log(2) + 0.1 * math.log(1.25), abs=1e-14)
    # KTO: the policy equals the reference and z0 = 0: v = lambda / 2 on both sides
    losses, rewards = kto.kto_loss(t(-5.0, -7.0), t(-5.0, -7.0), torch.tensor([True, False]),
                                   0.0, 0.1, 1.0, 2.0)
    torch.testing.assert_close(losses, t(0.5, 1.0)), torch.testing.assert_close(
        rewards, t(0.0, 0.0))
    # KTO: r = 10 nats, z0 = 2, beta 0.1: desirable 1 - sigma(0.8), undesirable (r = -10) 1 -
    # sigma(1.2)
    losses, _ = kto.kto_loss(t(-10.0, -30.0), t(-20.0, -20.0), torch.tensor([True, False]), t(2.0),
                             0.1)
    torch.testing.assert_close(losses, t(1 - sigmoid(0.8), 1 - sigmoid(1.2)))


def test_identical_chosen_and_rejected():
    gen = fresh_generator()
    y = avg_logps(5, gen)
    # SimPO: -log sigma(-gamma) = log(1 + e^gamma), whatever y
    for beta, gamma in ((2.0, 1.0), (2.5, 0.0)):
        torch.testing.assert_close(simpo.simpo_loss(y, y.clone(), beta, gamma)[0],
                                   torch.full_like(y, math.log1p(math.exp(gamma))))
    for lam in (0.1, 1.0):                             # ORPO: the NLL plus lam log 2
        torch.testing.assert_close(orpo.orpo_loss(y, y.clone(), lam)[0], -y + lam * math.log(2))
    a, b = y.clone().requires_grad_(), y.clone().requires_grad_()
    simpo.simpo_loss(a, b)[0].sum().backward()          # equal and opposite pushes
    torch.testing.assert_close(a.grad, -b.grad)


def test_one_token_and_very_long_completions():
    """The per-token average (SimPO, ORPO) and the sum (KTO) from sequence_logprobs over a one-token
    completion and a 2000-token one: the losses match the references, stay finite, and (KTO)
    saturate without NaN."""
    gen = fresh_generator()
    T = 2000
    logp = -torch.rand(4, T, generator=gen, **f64) * 0.5
    mask = torch.zeros(4, T, **f64)
    mask[0, 7] = 1.0                                   # one token
    mask[1] = 1.0                                      # 2000 tokens
    mask[2, :3] = 1.0
    mask[3, 100:1900] = 1.0
    for module in (simpo, orpo, kto):
        avg = module.sequence_logprobs(logp, mask, average=True)
        want = torch.stack([logp[i][mask[i] > 0].mean() for i in range(4)])
        torch.testing.assert_close(avg, want)
    avg = simpo.sequence_logprobs(logp, mask, average=True)
    torch.testing.assert_close(simpo.simpo_loss(avg[:2], avg[2:])[0],
                               simpo_reference(avg[:2], avg[2:], 2, 1))
    torch.testing.assert_close(orpo.orpo_loss(avg[:2], avg[2:])[0],
                               orpo_reference(avg[:2], avg[2:], 0.1))
    total = kto.sequence_logprobs(logp, mask)           # the 2000-token sum: about -500 nats
    policy = total.clone().requires_grad_()
    # log-ratios up to 400 nats
    ref = total.detach() + torch.tensor([0.0, 400.0, -3.0, -300.0], **f64)
    losses, _ = kto.kto_loss(policy, ref, torch.tensor([True, True, False, False]), 0.5, beta=0.5)
    losses.sum().backward()
    torch.testing.assert_close(
        losses.detach(), kto_reference(total, ref, torch.tensor([1, 1, 0, 0]), 0.5, 0.5, 1, 1))
    assert (torch.isfinite(policy.grad).all()
            and losses[1].item() == pytest.approx(1.0, abs=1e-12))                        # r = -400


def test_orpo_near_avg_logp_zero_is_finite_and_clamped():
    """As avg log p -> 0 (p -> 1) the odds are infinite: log_odds clamps avg log p to at most -1e-6
    (the documented behaviour), so the loss and its gradient stay finite; above the clamp the odds
    term has no gradient, and just below it the value is the exact float64 one. (At the clamp
    itself, x = -1e-6, either one-sided gradient is right: torch builds differ there, so it is not
    asserted.)"""
    cap = orpo.log_odds(torch.tensor([-1e-6], **f64)).item()
    assert cap == pytest.approx(-math.log(math.expm1(1e-6)), rel=1e-12)  # odds = 1 / (e^(1e-6) - 1)
    assert cap == pytest.approx(13.815510057, rel=1e-9)
    for dtype in (torch.float64, torch.float32):
        x = torch.tensor([0.0, -1e-30, -1e-12, -1e-7, -1e-6, -2e-6, -1e-4, -0.3], dtype=dtype,
                         requires_grad=True)
        rejected = torch.full_like(x, -0.2).requires_grad_()
        losses, lo_w, lo_l = orpo.orpo_loss(x, rejected, lam=0.1)
        losses.sum().backward()
        assert (torch.isfinite(losses).all() and torch.isfinite(x.grad).all()
                and torch.isfinite(rejected.grad).all())
        assert ((lo_w[:4] == lo_w[4]).all()
                and lo_w[4].item() == pytest.approx(cap, rel=1e-6))                        # clamped
        assert (x.grad[:4] == -1.0).all()                # the NLL term alone: d(-x)/dx
        assert (x.grad[5:] < -1.0).all()                 # below the clamp the odds term pushes too
        # log-odds rise as p -> 1
        assert (lo_w[5:] < lo_w[4]).all() and (torch.diff(lo_w[4:]) < 0).all()
    x, rejected = torch.tensor([-2e-6, -1e-4], **f64), torch.tensor([-0.2, -0.2], **f64)
    torch.testing.assert_close(orpo.orpo_loss(x, rejected)[0], orpo_reference(x, rejected, 0.1),
                               rtol=1e-13, atol=1e-13)
    # where 1 - exp(x) would round (float32 at x = -1e-7: 1 - exp(x) = 1.19e-7), expm1 keeps it
    x = torch.tensor([-3e-6], dtype=torch.float32)
    assert orpo.log_odds(x).item() == pytest.approx(-3e-6 - math.log(-math.expm1(-3e-6)), rel=1e-6)


def test_kto_one_label_batches():
    """All desirable: only the desirable branch acts, so lambda_U does not matter (and vice versa);
    gradients push every desirable log-prob up and every undesirable one down."""
    gen = fresh_generator()
    p, q = -30 * torch.rand(8, generator=gen, **f64), -30 * torch.rand(8, generator=gen, **f64)
    for desirable, sign in ((torch.ones(8, dtype=torch.bool), -1),
                            (torch.zeros(8, dtype=torch.bool), 1)):
        a = kto.kto_loss(p, q, desirable, 0.4, 0.1, 1.0, 1.0)[0]
        b = kto.kto_loss(p, q, desirable, 0.4, 0.1, 5.0 if sign > 0 else 1.0,
                         5.0 if sign < 0 else 1.0)[0]
        torch.testing.assert_close(a, b)                 # the other label's lambda is unused
        torch.testing.assert_close(a, kto_reference(p, q, desirable, 0.4, 0.1, 1.0, 1.0))
        x = p.clone().requires_grad_()
        kto.kto_loss(x, q, desirable, 0.4)[0].sum().backward()
        assert (torch.sign(x.grad) == sign).all()
    both = torch.arange(8) % 2 == 0                      # and a mixed batch is the two, row by row
    mixed = kto.kto_loss(p, q, both, 0.4, 0.1, 1.0, 2.0)[0]
    torch.testing.assert_close(mixed[both],
                               kto.kto_loss(p, q, torch.ones(8, dtype=torch.bool),
                                            0.4, 0.1, 1.0, 2.0)[0][both])
    torch.testing.assert_close(mixed[~both],
                               kto.kto_loss(p, q, torch.zeros(8, dtype=torch.bool),
                                            0.4, 0.1, 1.0, 2.0)[0][~both])


def test_kto_reference_point_is_detached():
    """z0 estimated the paper's way (mismatched pairs' mean log-ratio, clamped at 0) from tensors
    that carry gradient: no gradient reaches them, and the policy's gradient is the one with z0 a
    constant."""
    gen = fresh_generator()
    p, q = -30 * torch.rand(6, generator=gen, **f64), -30 * torch.rand(6, generator=gen, **f64)
    desirable = torch.tensor([True, False, True, True, False, False])
    mismatched = (-20 + torch.randn(6, generator=gen, **f64)).requires_grad_()
    ref_mismatched = torch.full((6,), -21.0, **f64)
    z0 = (mismatched - ref_mismatched).mean().clamp(min=0)
    assert z0.requires_grad and z0.item() > 0
    policy = p.clone().requires_grad_()
    kto.kto_loss(policy, q, desirable, z0, 0.5)[0].sum().backward()
    assert mismatched.grad is None                        # nothing flowed back through z0
    _, (want,) = grads(lambda x: kto_reference(x, q, desirable, z0.item(), 0.5, 1.0, 1.0), p,
                       weights=torch.ones(6))
    torch.testing.assert_close(policy.grad, want)
    # the reference point matters: a larger z0 lowers every desirable v and raises every undesirable
    # one
    lo, hi = (kto.kto_loss(p, q, desirable, z, 0.5)[0] for z in (0.0, 2.0))
    assert (hi[desirable] > lo[desirable]).all() and (hi[~desirable] < lo[~desirable]).all()


def test_the_losses_run_when_copied_with_torch_alone():
    """What a user copying a loss gets: its source (and ORPO's one helper) executed in a fresh
    namespace with only torch and torch.nn.functional as F."""
    gen = torch.Generator().manual_seed(4)
    a, b = avg_logps(6, gen), avg_logps(6, gen)
    p, q, d = (-10 * torch.rand(6, generator=gen), -10 * torch.rand(6, generator=gen),
               torch.rand(6, generator=gen) < .5)
    cases = [(simpo, ["simpo_loss"], (a, b, 2.0, 1.0)),
             (orpo, ["log_odds", "orpo_loss"], (a, b, 0.2)),
             (kto, ["kto_loss"], (p, q, d, torch.tensor(0.3), 0.1, 1.0, 2.0)),
             (online_dpo, ["dpo_loss"], (p, q, b, a, 0.1))]
    for module, names, args in cases:
        namespace = {"torch": torch, "F": torch.nn.functional}
        for name in names:
            exec(inspect.getsource(getattr(module, name)), namespace)
        got, want = namespace[names[-1]](*args), getattr(module, names[-1])(*args)
        assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_online_dpo_pairs_the_best_and_the_worst_and_skips_ties():
    """best_and_worst on a scripted batch of 4 prompts x 3 samples: the chosen is the best-scored
    sample's ids, the rejected the worst's, each as sampled, its EOS included; equal scores, or
    different scores on the same tokens, are ties. A sample that ran out of tokens (no EOS) is
    trained without one: task.pair_batch appends nothing."""
    class Tok:
        eos_id, pad_id = 0, 9

        def encode_prompt(self, text):
            return [1]
    tokens = torch.tensor([[5, 0, 9], [6, 7, 0], [8, 0, 9],          # prompt 0: scores 0, 1, 0.5
                           [5, 0, 9], [5, 0, 9], [5, 0, 9],          # prompt 1: 1, 1, 1: a tie
                           [3, 0, 9], [4, 7, 8], [3, 0, 9],    # prompt 2: 0.2, 0.9 (truncated), 0.1
                           # prompt 3: 0, 1, 0, the same tokens: a tie
                           [2, 0, 9], [2, 0, 9], [2, 0, 9]])
    mask = (tokens != 9).float()                                       # 9: padding
    scores = torch.tensor([0, 1, 0.5, 1, 1, 1, 0.2, 0.9, 0.1, 0, 1, 0])
    correct = scores > 0.5
    batch = type("Batch", (), {"tokens": tokens, "mask": mask, "correct": correct,
                               "truncated": ~(tokens == 0).any(1)})
    pairs, informative, verdict = online_dpo.best_and_worst(["a", "b", "c", "d"], batch, scores,
                                                            3, Tok())
    assert [p["prompt"] for p in pairs] == ["a", "b", "c", "d"]
    assert (pairs[0]["chosen_ids"] == [6, 7, 0]
            and pairs[0]["rejected_ids"] == [5, 0])                                # padding dropped
    assert pairs[2]["chosen_ids"] == [4, 7, 8] and pairs[2]["rejected_ids"] == [3, 0]
    seq, _, targets = task.pair_batch(pairs[2:3], Tok())              # chosen row 0, rejected row 1
    assert (seq[0].tolist() == [1, 4, 7, 8]
            and targets[0].tolist() == [1, 1, 1])                   # no EOS after the truncated one
    assert (seq[1].tolist() == [1, 3, 0, 9]
            and targets[1].tolist() == [1, 1, 0])                      # the ended one keeps its EOS
    assert informative.tolist() == [True, False, True, False]
    assert verdict.tolist() == [[True, False], [True, True], [True, False], [True, False]]


# -----------------------------------------------------------------------------
# The scripts, end to end

TINY = ["--batch_size", "8", "--log_every", "1", "--eval_every", "2", "--eval_n", "16",
        "--seed", "3"]
DATA = {"kto": ["--n_examples", "64", "--lambda_u", "1.5", "--lr", "1e-3", "--warmup", "0"],
        "simpo": ["--n_pairs", "64"], "orpo": ["--n_pairs", "64"],
        "online_dpo": ["--group_size", "4"]}


def metrics(out, script):
    return [json.loads(line) for line in open(os.path.join(out, script, "metrics.jsonl"))]


@pytest.mark.parametrize("script", ["kto", "simpo", "orpo", "online_dpo"])
@pytest.mark.slow
def test_script_runs_and_resumes(script, tiny_sft, tmp_path):
    out = str(tmp_path)
    flags = TINY + DATA[script] + ["--init", tiny_sft, "--out", out]
    p = run_script(f"{script}.py", flags + ["--steps", "2"], fresh=True)
    assert p.returncode == 0, p.stderr
    assert re.search(r"held-out greedy accuracy \d\.\d+ -> \d\.\d+", p.stdout), p.stdout
    rows = metrics(out, script)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2] and "eval_kl" in rows[2]
    assert rows[0]["eval_kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the SFT policy
    assert all(math.isfinite(r["loss"]) for r in rows[1:])
    if script == "kto":          # step 1: policy = reference, so r = 0 and z0 = 0: v = lambda_y / 2
        m = re.search(r"(\d+) desirable, (\d+) undesirable", p.stdout)
        assert int(m[1]) + int(m[2]) == 64 and int(m[1]) > 0 and int(m[2]) > 0
        s = rows[1]["desirable_share"]
        assert rows[1]["loss"] == pytest.approx((s * 1.0 + (1 - s) * 1.5) / 2, rel=1e-5)
        assert (rows[1]["kl_estimate"] == pytest.approx(0.0, abs=1e-5)
                and rows[1]["z0"] == pytest.approx(0.0, abs=1e-5))
        # the policy has left pi_ref
        assert rows[2]["desirable_reward"] != 0.0 != rows[2]["undesirable_reward"]
        assert rows[1]["samples"] == 64
    if script == "online_dpo":    # step 1: h = 0 on every informative pair, so the loss is log 2
        assert (rows[1]["informative"] > 0
                and rows[1]["loss"] == pytest.approx(math.log(2), rel=1e-4))
        assert rows[1]["label_accuracy"] == 1.0 and rows[2]["samples"] == 2 * 8 * 4
        assert rows[1]["ties"] == round(8 * (1 - rows[1]["informative"]))
        assert all(0 <= r["sampler_logp_diff"] < 1e-4 for r in rows[1:])   # scored from slot 0
    if script == "simpo":         # SimPO needs no reference: the SFT policy already ranks the pairs
        assert rows[0]["eval_reward_margin"] != 0.0
    _, ckpt = load_checkpoint(os.path.join(out, f"{script}.pt"))
    assert ckpt["step"] == 2

    p = run_script(f"{script}.py", flags + ["--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt2 = load_checkpoint(os.path.join(out, f"{script}.pt"))
    assert (ckpt2["step"] == 3
            and not torch.equal(ckpt2["model"]["wte.weight"], ckpt["model"]["wte.weight"]))
    assert [r["step"] for r in metrics(out, script)] == [0, 1, 2, 3]      # each step once


@pytest.mark.slow
def test_online_dpo_with_the_reward_model_as_judge(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("reward_model.py", ["--init", tiny_sft, "--out", out, "--n_train", "64",
                                       "--epochs", "1", "--batch_size", "16", "--eval_n", "16",
                                       "--log_every", "2", "--seed", "3"])
    assert p.returncode == 0, p.stderr
    p = run_script("online_dpo.py", TINY
                   + ["--judge", "rm", "--rm", os.path.join(out, "rm.pt"), "--init", tiny_sft,
                      "--out", out, "--steps", "1"])
    assert p.returncode == 0, p.stderr
    assert "judge rm" in p.stdout
    row = metrics(out, "online_dpo")[1]
    assert row["informative"] > 0                          # ties: only identical completions
    assert 0.0 <= row["label_accuracy"] <= 1.0


@pytest.mark.parametrize("script,bad,words",
                         [("kto", ["--lambda_u", "0"], ["--lambda_u", "0"]),
                          ("kto", ["--batch_size", "100", "--n_examples", "10"],
                           ["--batch_size 100"]), ("simpo", ["--gamma", "-1"], ["--gamma", "-1"]),
                          ("orpo", ["--lam", "nan"], ["--lam", "nan"]),
                          ("online_dpo", ["--group_size", "1"], ["--group_size", "1"]),
                          ("online_dpo", ["--judge", "human"], ["invalid choice: 'human'"])])
def test_bad_settings_are_rejected_with_a_message(script, bad, words, tmp_path):
    refused(run_script(f"{script}.py", bad + ["--out", str(tmp_path)]), *words)
