"""trpo.py: conjugate gradient and the natural-gradient step against float64 references on explicit
symmetric positive definite matrices (TRPO, Schulman et al. 2015, arXiv 1502.05477, appendix C); the
twice-differentiable KL against kernels.kl and against the softmax's Fisher matrix; the
Fisher-vector product of a tiny GPT against the exact Fisher (Jacobians enumerated over the
vocabulary) and against finite differences of the KL's gradient; the surrogate and its gradient; the
script end to end (trust region never violated, bit-exact resume, bad input)."""
import json
import math
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parameters_to_vector

import kernels
import trpo
from conftest import as_a_process, refuses_all, run_script
from hf.checkpoint import load_checkpoint
from model import GPT, GPTConfig
from trpo import (LineSearch, backtracking_line_search, conjugate_gradient, fisher_vector_product,
                  flat_grad, mean_kl, natural_gradient_step, rloo_advantages, set_flat_params,
                  surrogate)

f64 = torch.float64


def random_spd(n, seed, cond=100.0):
    """An n x n symmetric positive definite matrix with eigenvalues spread over [1, cond],
    float64."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=f64))
    eig = torch.logspace(0, math.log10(cond), n, dtype=f64)
    return Q @ torch.diag(eig) @ Q.T


class CountingProduct:
    """v -> F v for an explicit matrix F, counting the products."""

    def __init__(self, F):
        self.F, self.calls = F, 0

    def __call__(self, v):
        self.calls += 1
        return self.F @ v


# -----------------------------------------------------------------------------
# Conjugate gradient

def test_conjugate_gradient_hand_worked_two_by_two():
    # A = [[4, 1], [1, 3]], b = [1, 2]. Iteration 1: r = p = b, r.r = 5, A p = [6, 7], p.A p = 20,
    # alpha = 1/4, x = [1/4, 1/2]. Iteration 2 ends at the exact solution A^-1 b = [1/11, 7/11].
    A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=f64)
    b = torch.tensor([1.0, 2.0], dtype=f64)
    assert torch.allclose(conjugate_gradient(CountingProduct(A), b, iters=1),
                          torch.tensor([0.25, 0.5], dtype=f64))
    x = conjugate_gradient(CountingProduct(A), b, iters=2)
    assert torch.allclose(x, torch.tensor([1 / 11, 7 / 11], dtype=f64), atol=1e-14)


@pytest.mark.parametrize("n", [3, 8, 25])
def test_conjugate_gradient_solves_spd_systems_in_n_iterations(n):
    for seed in range(3):
        F = random_spd(n, seed)
        b = torch.randn(n, generator=torch.Generator().manual_seed(100 + seed), dtype=f64)
        want = torch.linalg.solve(F, b)
        fvp = CountingProduct(F)
        # exact in exact arithmetic; rounding remains
        x = conjugate_gradient(fvp, b, iters=n, residual_tol=0.0)
        # one product per iteration, no more
        assert (x - want).norm() < 1e-3 * want.norm() and fvp.calls <= n
        x = conjugate_gradient(CountingProduct(F), b, iters=4 * n, residual_tol=1e-28)
        assert torch.allclose(x, want, rtol=1e-9, atol=1e-12)


def test_conjugate_gradient_few_iterations_lower_the_quadratic_monotonically():
    """CG minimises phi(x) = 1/2 x^T F x - b^T x over a growing Krylov space: each iteration lowers
    phi, towards its minimum at F^-1 b."""
    F, b = random_spd(20, 7, cond=1e3), torch.randn(20, generator=torch.Generator().manual_seed(1),
                                                    dtype=f64)
    phi = lambda x: 0.5 * x @ F @ x - b @ x
    values = [phi(conjugate_gradient(CountingProduct(F), b, iters=k, residual_tol=0.0)).item()
              for k in range(1, 81)]
    assert all(later < earlier + 1e-12 for earlier, later in zip(values, values[1:]))
    assert values[0] > values[9] > values[-1] == pytest.approx(phi(torch.linalg.solve(F, b)).item(),
                                                               rel=1e-10)


def test_conjugate_gradient_stops_at_the_residual_tolerance():
    F = random_spd(10, 3)
    eigvals, eigvecs = torch.linalg.eigh(F)
    b = eigvecs[:, 4] * 2.0                             # an eigenvector: solved exactly in one step
    fvp = CountingProduct(F)
    x = conjugate_gradient(fvp, b, iters=10, residual_tol=1e-20)
    assert fvp.calls == 1 and torch.allclose(x, b / eigvals[4], atol=1e-12)
    fvp = CountingProduct(F)
    assert ((conjugate_gradient(fvp, torch.zeros(10, dtype=f64), iters=10) == 0).all()
            and fvp.calls == 0)


def test_damping_solves_the_damped_system():
    F = random_spd(6, 4)
    F[:, 0] = F[0, :] = 0.0                              # singular: a direction the KL does not see
    b = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=f64)
    x = conjugate_gradient(lambda v: F @ v + 0.1 * v, b, iters=6, residual_tol=0.0)
    assert torch.allclose(x, torch.linalg.solve(F + 0.1 * torch.eye(6, dtype=f64), b), atol=1e-9)
    assert x[0].item() == pytest.approx(b[0].item() / 0.1)          # curvature 0 read as `damping`


# -----------------------------------------------------------------------------
# The natural-gradient step

def reference_step(F, g, max_kl):
    """Appendix C, float64, with the exact inverse: x = F^-1 g, s = sqrt(2 delta / x^T F x) x."""
    x = torch.linalg.solve(F, g)
    s = math.sqrt(2 * max_kl / (x @ F @ x).item()) * x
    return s, (g @ s).item()


@pytest.mark.parametrize("n,max_kl", [(4, 0.01), (12, 0.05), (30, 1e-3)])
def test_natural_gradient_step_matches_the_reference(n, max_kl):
    for seed in range(3):
        F = random_spd(n, seed, cond=50.0)
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=f64)
        stats = {}
        step, expected = natural_gradient_step(g, CountingProduct(F), max_kl, cg_iters=4 * n,
                                               stats=stats, residual_tol=0.0)
        want_step, want_expected = reference_step(F, g, max_kl)
        assert torch.allclose(step, want_step, rtol=1e-8, atol=1e-12)
        assert expected == pytest.approx(want_expected, rel=1e-8)
        assert expected == pytest.approx(
            math.sqrt(2 * max_kl * (g @ torch.linalg.solve(F, g)).item()), rel=1e-8)
        # the quadratic KL is delta
        assert (0.5 * step @ F @ step).item() == pytest.approx(max_kl, rel=1e-10)
        assert stats["cg_residual"] < 1e-8


def test_a_truncated_solve_still_lands_on_the_trust_region_boundary():
    """With fewer CG iterations than dimensions x is not F^-1 g, but the step is scaled with x^T F x
    of that x: the quadratic model of the KL is still exactly delta, the gain still positive; the
    logged residual says how far."""
    F, g = random_spd(40, 5, cond=1e3), torch.randn(40, generator=torch.Generator().manual_seed(9),
                                                    dtype=f64)
    stats = {}
    step, expected = natural_gradient_step(g, CountingProduct(F), 0.02, cg_iters=3, stats=stats)
    assert (0.5 * step @ F @ step).item() == pytest.approx(0.02, rel=1e-10)
    # the exact solve gains the most
    assert expected > 0 and expected <= reference_step(F, g, 0.02)[1] + 1e-12
    x = step / math.sqrt(2 * 0.02 / stats["xFx"])
    assert stats["cg_residual"] == pytest.approx(((g - F @ x).norm() / g.norm()).item(), rel=1e-8)
    assert stats["cg_residual"] > 1e-3


def test_natural_gradient_is_invariant_to_a_linear_reparameterisation():
    """theta = M phi: the gradient in phi is M^T g and the Fisher M^T F M; the natural step in phi,
    mapped back by M, is the natural step in theta (plain gradient steps have no such property). The
    point of the natural gradient."""
    n = 6
    F, g = random_spd(n, 11), torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=f64)
    M = torch.randn(n, n, generator=torch.Generator().manual_seed(4), dtype=f64) + 3 * torch.eye(
        n, dtype=f64)
    s_theta, e_theta = natural_gradient_step(g, lambda v: F @ v, 0.01, cg_iters=4 * n,
                                             residual_tol=0.0)
    s_phi, e_phi = natural_gradient_step(M.T @ g, lambda v: M.T @ (F @ (M @ v)), 0.01,
                                         cg_iters=4 * n, residual_tol=0.0)
    assert (torch.allclose(M @ s_phi, s_theta, atol=1e-8)
            and e_phi == pytest.approx(e_theta, rel=1e-8))
    # the plain gradient step in phi, mapped back, is not along g: it depends on the coordinates
    plain = M @ (M.T @ g)
    assert (plain @ g / (plain.norm() * g.norm())).item() < 0.99


@pytest.mark.parametrize("scale", [1e-9, 1e-6, 1e-3, 1e3, 1e6])
def test_the_natural_gradient_step_does_not_depend_on_the_gradients_scale(scale):
    """s = sqrt(2 delta / x^T F x) x is invariant to g -> c g when x scales with g: conjugate
    gradient must stop on a residual relative to |g|. An absolute tolerance (r.r < 1e-10) returned
    no step at all for |g| near 1e-6."""
    F = random_spd(30, 7, cond=1e3)
    g = torch.randn(30, generator=torch.Generator().manual_seed(5), dtype=f64)
    step, expected = natural_gradient_step(g, CountingProduct(F), 0.02, cg_iters=10)
    scaled, scaled_expected = natural_gradient_step(scale * g, CountingProduct(F), 0.02,
                                                    cg_iters=10)
    assert torch.allclose(scaled, step, rtol=1e-9, atol=0) and step.norm() > 0
    assert scaled_expected == pytest.approx(scale * expected, rel=1e-9)       # g . s scales with g
    x_small = conjugate_gradient(CountingProduct(F), scale * g, iters=10)
    assert torch.allclose(x_small, scale * conjugate_gradient(CountingProduct(F), g, iters=10),
                          rtol=1e-9, atol=0)


def test_the_line_search_takes_the_first_fraction_inside_the_region_with_a_gain():
    seen = []

    def try_step(frac):             # the KL falls as the square of the fraction; the gain is linear
        seen.append(frac)
        return 0.08 * frac ** 2, 0.3 * frac - 0.05
    ls = backtracking_line_search(try_step, 0.02, 10)
    assert seen == [1.0, 0.5] and ls == LineSearch(0.5, 0.02, pytest.approx(0.1), 1, 0.08, 0)
    ls = backtracking_line_search(lambda frac: (0.0, -1.0),
                                  0.02, 3)                   # never a gain: no step, every fraction
    assert ls.frac == 0.0 and ls.halvings == 3 and ls.nan_trials == 0


def test_a_line_search_whose_every_trial_is_nan_says_so():
    ls = backtracking_line_search(lambda frac: (float("nan"), float("nan")), 0.02, 4)
    assert ls.frac == 0.0 and ls.nan_trials == 5 and math.isnan(ls.kl_full)


def test_a_zero_gradient_gives_no_step():
    F = random_spd(5, 0)
    step, expected = natural_gradient_step(torch.zeros(5, dtype=f64), CountingProduct(F), 0.01)
    assert (step == 0).all() and expected == 0.0


# -----------------------------------------------------------------------------
# The surrogate and the KL

def test_surrogate_matches_reference_and_its_gradient_is_the_policy_gradient():
    B, T = 5, 6
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g, dtype=f64) * 3
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=f64)
    adv = torch.randn(B, generator=g, dtype=f64)
    # a one-token and an empty row
    mask = (torch.arange(T)[None] < torch.tensor([6, 1, 3, 0, 4])[:, None]).to(f64)
    N = mask.sum().item()
    want = sum(math.exp(logp[i, t] - old[i, t]) * adv[i] for i in range(B)
               for t in range(T) if mask[i, t]) / N
    assert surrogate(logp, old, adv, mask).item() == pytest.approx(want.item(), rel=1e-12)
    lp = logp.clone().requires_grad_(True)
    value = surrogate(lp, lp.detach(), adv, mask)    # at theta_old: ratio 1, L = mean A over tokens
    assert value.item() == pytest.approx((adv[:, None] * mask).sum().item() / N, rel=1e-12)
    grad, = torch.autograd.grad(value, lp)
    # 1/N A_i on every completion token
    assert torch.allclose(grad, adv[:, None] * mask / N, atol=1e-15)
    assert surrogate(logp, old, adv, mask,
                     num_tokens=2 * N).item() == pytest.approx(want.item() / 2)


def reference_kl(old_logits, logits, mask, T):
    """KL(softmax(old / T) || softmax(new / T)) = sum_v p_v (log p_v - log q_v), averaged over
    masked positions."""
    total, n = 0.0, 0
    for i in range(mask.size(0)):
        for t in range(mask.size(1)):
            if mask[i, t]:
                p = torch.softmax(old_logits[i, t].double() / T, -1)
                q = torch.softmax(logits[i, t].double() / T, -1)
                total, n = total + (p * (p.log() - q.log())).sum(), n + 1
    return total / max(n, 1)


@pytest.mark.parametrize("V", [1, 7, 258])
def test_mean_kl_equals_kernels_kl_and_the_float64_reference(V):
    g = torch.Generator().manual_seed(V)
    old, new = torch.randn(3, 5, V, generator=g) * 3, torch.randn(3, 5, V, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1.0]])
    for T in (1.0, 0.7):
        got = mean_kl(old, new, mask, T)
        # what the line search measures
        fused = torch.where(mask > 0, kernels.kl(old, new, T), 0.0).sum() / mask.sum()
        assert got.item() == pytest.approx(fused.item(), rel=1e-5, abs=1e-6)
        assert got.item() == pytest.approx(reference_kl(old, new, mask, T).item(), rel=1e-5,
                                           abs=1e-6)


def test_mean_kl_masked_positions_never_leak():
    old, new = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0.0]])
    dirty_old, dirty_new = old.clone(), new.clone()
    dirty_old[mask == 0], dirty_new[mask == 0] = float("nan"), float("inf")
    clean, dirty = new.clone().requires_grad_(True), dirty_new.clone().requires_grad_(True)
    a, b = mean_kl(old, clean, mask), mean_kl(dirty_old, dirty, mask)
    assert a.item() == pytest.approx(b.item())
    ga, gb = torch.autograd.grad(a, clean)[0], torch.autograd.grad(b, dirty)[0]
    assert torch.equal(ga, gb) and (gb[mask == 0] == 0).all()


def test_the_kl_hessian_at_theta_old_is_the_softmax_fisher():
    """At logits = old, KL(p_old || softmax(z / T)) has gradient 0 and Hessian (diag(p) - p p^T) /
    T^2 in z: the Fisher information of the categorical distribution, written here from that
    formula."""
    z_old = torch.randn(1, 1, 5, dtype=f64)
    T = 0.8
    H = torch.autograd.functional.hessian(lambda z: mean_kl(z_old, z.view(1, 1, 5),
                                                            torch.ones(1, 1, dtype=f64), T),
                                          z_old.view(5).clone())
    p = torch.softmax(z_old.view(5) / T, -1)
    assert torch.allclose(H, (torch.diag(p) - torch.outer(p, p)) / T ** 2, atol=1e-12)
    z = z_old.clone().requires_grad_(True)
    assert torch.autograd.grad(mean_kl(z_old, z, torch.ones(1, 1, dtype=f64), T),
                               z)[0].abs().max() < 1e-15


# -----------------------------------------------------------------------------
# The Fisher-vector product of a model

def tiny_batch(seed=0):
    """A tiny float64 GPT and a batch scored as trpo.py scores it: prompts left-padded, completions
    right-padded."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=7, block_size=12, n_layer=1, n_head=2,
                          n_embd=8)).double().eval()
    for p in model.parameters():                         # larger weights: a policy far from uniform
        p.data.normal_(0, 0.5)
    prompt = torch.tensor([[3, 1, 2], [0, 5, 4], [6, 6, 1]])
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1.0]])
    tokens = torch.tensor([[2, 4, 0, 1], [5, 3, 0, 0], [1, 2, 6, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0.0]])
    return model, (prompt, prompt_mask, tokens, mask)


def logits_of(model, batch):
    """model.completion_logits in float64: the hidden states through the LM head, composed here
    because the model's own head computes in float32 (model.py, Precision) and these checks need
    float64."""
    prompt, prompt_mask, tokens, mask = batch
    idx, attn = torch.cat([prompt, tokens], 1), torch.cat([prompt_mask, mask], 1)
    # (B, Tn, V)
    return model.lm_head(model.hidden(idx[:, :-1], attn[:, :-1]))[:, prompt.size(1) - 1:]


def kl_grad_at_theta_old(model, batch, T):
    """grad KLbar at theta_old with its graph, as trpo.py builds it in step 5."""
    params = list(model.parameters())
    with torch.no_grad():
        old = logits_of(model, batch)
    with sdpa_kernel(SDPBackend.MATH):
        kl_part = mean_kl(old, logits_of(model, batch), batch[3], T)
        return flat_grad(kl_part, params, create_graph=True), old


def test_fisher_vector_product_equals_the_exact_fisher_of_the_model():
    """F = 1/N sum_it sum_v p_v grad log p_v grad log p_v^T (the Fisher of pi_theta at every
    position, the expectation over the whole vocabulary), built from the Jacobian of the log-probs,
    one row per (position, token)."""
    model, batch = tiny_batch()
    T, real = 0.9, batch[3] > 0
    params = list(model.parameters())
    with sdpa_kernel(SDPBackend.MATH):
        logp = torch.log_softmax(logits_of(model, batch) / T, -1)[real]        # (N, V)
    # (N, V, D)
    J = torch.stack([torch.stack([flat_grad(logp[n, v], params, retain_graph=True)
                                  for v in range(logp.size(1))]) for n in range(logp.size(0))])
    p = logp.detach().exp()                                                     # (N, V)
    F = torch.einsum("nv,nvd,nve->de", p, J, J) / real.sum()                    # (D, D)
    kl_grad, _ = kl_grad_at_theta_old(model, batch, T)
    assert kl_grad.abs().max() < 1e-12                       # the KL is at its minimum at theta_old
    for seed in range(3):
        v = torch.randn(F.size(0), generator=torch.Generator().manual_seed(seed), dtype=f64)
        got = fisher_vector_product(kl_grad, params, v)
        assert torch.allclose(got, F @ v, rtol=1e-8, atol=1e-10)
        damped = fisher_vector_product(kl_grad, params, v, damping=0.3)
        assert torch.allclose(damped, F @ v + 0.3 * v, rtol=1e-8, atol=1e-10)
        assert (v @ got).item() >= 0                         # positive semi-definite


def test_fisher_vector_product_equals_finite_differences_of_the_kl_gradient():
    """F v = lim (grad KL(theta + eps v) - grad KL(theta - eps v)) / (2 eps), pi_old fixed at
    theta_old."""
    model, batch = tiny_batch(seed=1)
    T = 1.0
    params = list(model.parameters())
    theta = parameters_to_vector(params).detach().clone()
    kl_grad, old = kl_grad_at_theta_old(model, batch, T)
    v = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(5), dtype=f64)
    got = fisher_vector_product(kl_grad, params, v)

    def grad_at(flat):
        set_flat_params(params, flat)
        return flat_grad(mean_kl(old, logits_of(model, batch), batch[3], T), params)
    eps = 1e-5
    fd = (grad_at(theta + eps * v) - grad_at(theta - eps * v)) / (2 * eps)
    set_flat_params(params, theta)
    assert torch.allclose(got, fd, rtol=1e-5, atol=1e-8)
    assert got.norm() > 1e-3                                        # not trivially zero


def test_set_flat_params_round_trips_and_keeps_tied_weights():
    model, _ = tiny_batch()
    params = list(model.parameters())
    theta = torch.randn(parameters_to_vector(params).numel(), dtype=f64)
    set_flat_params(params, theta)
    assert torch.equal(parameters_to_vector(params), theta)
    assert model.lm_head.weight is model.wte.weight                 # one parameter, written once


# -----------------------------------------------------------------------------
# Reward and advantages (rloo.py's)

def test_leave_one_out_hand_worked():
    a = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]), 2)
    # k = 2: the other sample's reward
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]))
    a = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)        # baselines 1/3, 2/3, 2/3, 1/3
    assert torch.allclose(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    with pytest.raises(ValueError, match="k = 1"):
        rloo_advantages(torch.rand(4), 1)


# -----------------------------------------------------------------------------
# The script, end to end

TINY = ["--prompts_per_step", "4", "--group_size", "4", "--cg_iters", "3", "--log_every", "1",
        "--eval_every", "2", "--eval_n", "8"]


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "trpo", "metrics.jsonl"))]


@pytest.mark.slow
def test_script_runs_end_to_end_within_the_trust_region_and_resumes_bit_exactly(tiny_sft, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    # compared bit for bit: one thread, one order of every sum, whatever the load
    one = {"OMP_NUM_THREADS": "1"}
    p = run_script("trpo.py", TINY + ["--steps", "3", "--init", tiny_sft, "--out", straight],
                   env=one, fresh=True)
    assert p.returncode == 0, p.stderr
    assert "held-out greedy accuracy" in p.stdout and "done: 3 steps" in p.stdout
    rows = read_metrics(straight)
    assert ([r["step"] for r in rows] == [0, 1, 2, 3] and "eval_accuracy" in rows[0]
            and "eval_accuracy" in rows[3])
    for r in rows[1:]:
        for key in ("reward_mean", "kl_step", "kl_full_step", "backtracks", "improvement",
                    "expected_improvement", "cg_residual", "t_cg", "t_linesearch", "t_rest",
                    "kl_exact", "entropy", "tokens_per_sec"):
            assert key in r and math.isfinite(r[key]), key
        assert r["kl_step"] <= 0.02 and r["violations"] == 0 and 0 <= r["backtracks"] <= 10
        if r["accepted"]:
            assert r["improvement"] > 0 and r["kl_step"] > 0
        else:
            assert r["improvement"] == 0 and r["kl_step"] == 0
        assert r["samples"] == 16 * r["step"]
        assert 0 <= r["sampler_logp_diff"] < 1e-4           # the sampler's log-probs, aligned
    assert any(r["accepted"] for r in rows[1:])

    p = run_script("trpo.py", TINY + ["--steps", "2", "--init", tiny_sft, "--out", split], env=one)
    assert p.returncode == 0, p.stderr
    p = run_script("trpo.py", TINY + ["--steps", "3", "--init", tiny_sft, "--out", split,
                                      "--resume"], env=one)
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    a, b = (load_checkpoint(os.path.join(straight, "trpo.pt"))[1],
            load_checkpoint(os.path.join(split, "trpo.pt"))[1])
    assert a["step"] == b["step"] == 3 and a["violations"] == b["violations"] == 0
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # resume is bit-exact
    assert [r["step"] for r in read_metrics(split)] == [0, 1, 2, 3]
    assert read_metrics(split)[3]["kl_step"] == rows[3]["kl_step"]


def test_script_rejects_bad_settings_with_a_message(tmp_path):
    refuses_all("trpo.py", [(["--group_size", "1"], ["--group_size", "1"]),
                            (["--max_kl", "0"], ["--max_kl", "0"]),
                            (["--damping", "-1"], ["--damping", "-1"]),
                            (["--init", str(tmp_path / "missing.pt")], ["no checkpoint at"])],
                tmp_path)


def test_a_step_that_is_not_finite_is_refused_and_the_weights_stay_theta_old(tiny_sft, tmp_path,
                                                                               monkeypatch, capsys):
    """natural_gradient_step made to return an infinite step (what --damping 0 can give): the update
    must be no step at all, the weights exactly the starting ones; writing theta_old + 0 * s would
    have written NaN (0 * inf)."""
    out = str(tmp_path)

    def inf_step(g, fvp, max_kl, cg_iters=10, stats=None, residual_tol=1e-10):
        stats.update(cg_residual=0.0, xFx=1.0)
        return torch.full_like(g, float("inf")), 1.0
    monkeypatch.setattr(trpo, "natural_gradient_step", inf_step)
    with as_a_process():
        trpo.main(trpo.parse_args(TINY + ["--steps", "1", "--init", tiny_sft, "--out", out]))
    p = capsys.readouterr()
    assert "no step, the step was not finite" in p.out
    after, start = (load_checkpoint(os.path.join(out, "trpo.pt"))[1]["model"],
                    load_checkpoint(tiny_sft)[1]["model"])
    assert all(torch.equal(after[k], start[k]) for k in start)
    row = read_metrics(out)[1]
    assert row["finite_step"] == 0.0 and row["accepted"] == 0.0
