"""ppo.py: GAE against a float64 loop written here from the recursion, the clipped policy and value
losses against hand-worked cases and a float64 reference with autograd, the KL-penalised reward, the
adaptive KL controller, and the script end to end (PPO, A2C, verifier reward, resume)."""
import importlib.util
import inspect
import json
import math
import os

import pytest
import torch

from conftest import ROOT, refuses_all, run_script

spec = importlib.util.spec_from_file_location("ppo", os.path.join(ROOT, "ppo.py"))
ppo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ppo)  # importing runs nothing: the training is under __main__


def test_the_losses_and_gae_run_when_copied_with_torch_alone():
    """What a user copying them gets: the functions' source executed in a fresh namespace holding
    only torch."""
    namespace = {"torch": torch}
    for f in (ppo.gae, ppo.kl_penalised_rewards, ppo.masked_whiten, ppo.ppo_policy_loss,
              ppo.ppo_value_loss):
        exec(inspect.getsource(f), namespace)
    g = torch.Generator().manual_seed(2)
    logp, old, ref = (-torch.rand(3, 5, generator=g) for _ in range(3))
    values, old_values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] + [0.0] * 4])
    score = torch.tensor([1.0, -0.5, 0.2])
    for name, args in (("kl_penalised_rewards", (score, old, ref, mask, 0.1)),
                       ("gae", (ppo.kl_penalised_rewards(score, old, ref, mask, 0.1), old_values,
                                mask, 1.0, 0.9)), ("masked_whiten", (values, mask)),
                       ("ppo_policy_loss", (logp, old, values, 0.2)),
                       ("ppo_value_loss", (values, old_values, values.flip(1), 0.2))):
        got, want = namespace[name](*args), getattr(ppo, name)(*args)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        assert all(torch.equal(x, y) for x, y in zip(got, want)), name


# -----------------------------------------------------------------------------
# GAE

def gae_reference(rewards, values, lengths, gamma, lam):
    """Float64, one row at a time, straight from the recursion; V after the last real token is 0."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L, a_next = lengths[b], 0.0
        for t in reversed(range(L)):
            v_next = values[b][t + 1] if t + 1 < L else 0.0
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            a_next = delta + gamma * lam * a_next
            adv[b][t] = a_next
            ret[b][t] = a_next + values[b][t]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def random_episode(B=7, T=11, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 1, T                                # a single-token row and a full row
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)   # junk in the padding on purpose
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    return rewards, values, mask, lengths.tolist()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 0.0), (1.0, 1.0), (0.9, 0.5),
                                       (0.99, 1.0), (0.5, 0.0)])
def test_gae_matches_float64_recursion_with_masked_tails(gamma, lam):
    rewards, values, mask, lengths = random_episode()
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)
    adv32, ret32 = ppo.gae(rewards.float(), values.float(), mask.float(), gamma, lam)
    torch.testing.assert_close(adv32.double(), ref_adv, rtol=1e-4, atol=1e-5)
    # padding never leaks in: changing rewards and values after the end changes nothing
    junk = torch.randn_like(rewards) * 100 * (1 - mask)
    adv2, ret2 = ppo.gae(rewards + junk, values + junk, mask, gamma, lam)
    torch.testing.assert_close(adv2, adv, rtol=0, atol=1e-9)
    torch.testing.assert_close(ret2, ret, rtol=0, atol=1e-9)


def test_gae_lambda_zero_is_one_step_td_and_lambda_one_is_monte_carlo():
    rewards, values, mask, lengths = random_episode(B=5, T=9)
    gamma = 0.9
    adv0, _ = ppo.gae(rewards, values, mask, gamma, 0.0)
    adv1, _ = ppo.gae(rewards, values, mask, gamma, 1.0)
    for b, L in enumerate(lengths):
        for t in range(L):
            v_next = values[b, t + 1].item() if t + 1 < L else 0.0
            assert adv0[b, t].item() == pytest.approx(rewards[b, t].item() + gamma * v_next
                                                      - values[b, t].item(), abs=1e-12)
            # discounted return to the end
            mc = sum(gamma ** k * rewards[b, t + k].item() for k in range(L - t))
            assert adv1[b, t].item() == pytest.approx(mc - values[b, t].item(), abs=1e-12)
        assert (adv0[b, L:] == 0).all() and (adv1[b, L:] == 0).all()


def test_gae_hand_worked():
    # one row, 3 real tokens + 1 padding; reward 1 at the end; gamma 1, lambda 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 0.5)
    # deltas: 0 + 0.6 - 0.5 = 0.1;  0 + 0.7 - 0.6 = 0.1;  1 + 0 - 0.7 = 0.3
    # A2 = 0.3; A1 = 0.1 + 0.5 * 0.3 = 0.25; A0 = 0.1 + 0.5 * 0.25 = 0.225
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.725, 0.85, 1.0, 0.0]], dtype=torch.float64))


def test_whitening_is_outside_gae_and_masked():
    rewards, values, mask, _ = random_episode()
    adv, _ = ppo.gae(rewards, values, mask, 1.0, 0.95)
    w = ppo.masked_whiten(adv, mask)
    real = w[mask > 0]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert real.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    assert (w[mask == 0] == 0).all()


# -----------------------------------------------------------------------------
# KL-penalised reward and the adaptive controller

def test_kl_penalised_reward_puts_the_score_on_the_last_real_token():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    ref_logp = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-2.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    score = torch.tensor([2.0, -1.0])
    r = ppo.kl_penalised_rewards(score, logp, ref_logp, mask, beta=0.1)
    # the score at t = 2, not at the padding t = 3
    expected = torch.tensor([[-0.1 * 0.5, -0.1 * -1.0, 0.0 + 2.0, 0.0],
                             [-0.1 * 1.0 - 1.0, 0.0, 0.0, 0.0]])         # a single-token completion
    torch.testing.assert_close(r, expected)


def test_adaptive_kl_controller_hand_worked():
    # Ziegler et al.: e = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon
    # clipped at +0.2
    assert ppo.adaptive_kl_beta(0.1, 3.0, 2.0, 10000,
                                64) == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000))
    assert ppo.adaptive_kl_beta(0.1, 1.8, 2.0, 10000,
                                64) == pytest.approx(0.1 * (1 - 0.1 * 64 / 10000))
    # clipped at -0.2
    assert ppo.adaptive_kl_beta(0.1, 0.0, 2.0, 100, 100) == pytest.approx(0.1 * 0.8)
    assert ppo.adaptive_kl_beta(0.1, 2.0, 2.0, 100, 100) == pytest.approx(0.1)


# -----------------------------------------------------------------------------
# Clipped policy and value losses

def policy_loss_and_grad(ratio, advantage, eps=0.2):
    old_logp = torch.tensor([math.log(0.3)], dtype=torch.float64)
    logp = (old_logp + math.log(ratio)).requires_grad_(True)
    loss, clipped = ppo.ppo_policy_loss(logp, old_logp,
                                        torch.tensor([advantage], dtype=torch.float64), eps)
    loss.sum().backward()
    return loss.item(), logp.grad.item(), clipped.item()


def test_hand_example_positive_advantage_clipped_at_1_plus_eps():
    # P 0.3 -> 0.45, ratio 1.5, A = +0.5: min(0.75, 0.6) = 0.6, gradient zero
    loss, grad, clipped = policy_loss_and_grad(1.5, 0.5)
    assert -loss == pytest.approx(0.6) and grad == 0.0 and clipped


def test_hand_example_negative_advantage_clipped_at_1_minus_eps():
    # P 0.2 -> 0.08, ratio 0.4, A = -0.8: min(-0.32, -0.64) = -0.64, the clipped
    # term is taken and the gradient is zero
    loss, grad, clipped = policy_loss_and_grad(0.4, -0.8)
    assert -loss == pytest.approx(-0.64) and grad == 0.0 and clipped


def test_clip_only_binds_in_the_direction_the_advantage_pushes():
    # inside the range: objective ratio * A, d(loss)/d(logp) = -ratio * A
    loss, grad, clipped = policy_loss_and_grad(1.1, 0.5)
    assert -loss == pytest.approx(0.55) and grad == pytest.approx(-0.55) and not clipped
    # ratio 1.5 but A < 0: the unclipped (more pessimistic) term -0.75 is taken and its gradient
    # flows
    loss, grad, clipped = policy_loss_and_grad(1.5, -0.5)
    assert -loss == pytest.approx(-0.75) and grad == pytest.approx(0.75) and not clipped
    # ratio 0.4 but A > 0: unclipped 0.2 < clipped 0.4, gradient flows
    loss, grad, clipped = policy_loss_and_grad(0.4, 0.5)
    assert -loss == pytest.approx(0.2) and grad == pytest.approx(-0.2) and not clipped


def test_a2c_setting_is_the_plain_policy_gradient():
    # eps = inf: loss -ratio * A; at ratio 1 its gradient is -A (the policy gradient), even far from
    # 1 no clipping
    loss, grad, clipped = policy_loss_and_grad(1.0, 0.7, eps=math.inf)
    assert loss == pytest.approx(-0.7) and grad == pytest.approx(-0.7) and not clipped
    loss, grad, _ = policy_loss_and_grad(3.0, 0.7, eps=math.inf)
    assert grad == pytest.approx(-2.1)


@pytest.mark.parametrize("eps", [0.1, 0.2, 0.3])
def test_policy_loss_matches_float64_reference_forward_and_gradient(eps):
    B, T = 6, 9
    old_logp = -torch.rand(B, T, dtype=torch.float64) * 3
    logp = (old_logp + torch.randn(B, T, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(B, T, dtype=torch.float64)
    loss, _ = ppo.ppo_policy_loss(logp, old_logp, adv, eps)
    g, = torch.autograd.grad(loss.sum(), logp)
    # reference, element by element from PPO eq. 7
    ref_loss, ref_grad = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T,
                                                                             dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            r = math.exp(logp[b, t].item() - old_logp[b, t].item())
            a = adv[b, t].item()
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            ref_loss[b, t] = -min(unclipped, clipped)
            # d/dlogp of -r a is -r a; clipped: constant
            ref_grad[b, t] = -r * a if unclipped <= clipped else 0.0
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, ref_grad, rtol=1e-12, atol=1e-12)


def test_value_loss_hand_worked_and_against_reference():
    old = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    v = torch.tensor([1.5, 1.5, 0.9, 1.1], dtype=torch.float64, requires_grad=True)
    R = torch.tensor([2.0, 0.0, 1.0, 5.0], dtype=torch.float64)
    loss = ppo.ppo_value_loss(v, old, R, 0.2)
    # row 0: V moved 1.0 -> 1.5 towards R = 2; clipped V = 1.2: max(0.25, 0.64) / 2 = 0.32, gradient
    # zero row 1: V moved 1.0 -> 1.5 away from R = 0; clipped V = 1.2: max(2.25, 1.44) / 2 = 1.125,
    # gradient V - R = 1.5 row 2: inside the clip range: 0.5 * 0.01 = 0.005; row 3: clipped V 1.1 =
    # V: 0.5 * 3.9^2
    torch.testing.assert_close(
        loss.detach(), torch.tensor([0.32, 1.125, 0.005, 0.5 * 3.9 ** 2], dtype=torch.float64))
    g, = torch.autograd.grad(loss.sum(), v)
    torch.testing.assert_close(g, torch.tensor([0.0, 1.5, -0.1, -3.9], dtype=torch.float64))
    # random inputs against the formula; clip = inf is the plain squared error
    v = torch.randn(50, dtype=torch.float64)
    old, R = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    ref = [0.5 * max((a - r) ** 2, (o + min(max(a - o, -0.3), 0.3) - r) ** 2)
           for a, o, r in zip(v.tolist(), old.tolist(), R.tolist())]
    torch.testing.assert_close(ppo.ppo_value_loss(v, old, R, 0.3),
                               torch.tensor(ref, dtype=torch.float64))
    torch.testing.assert_close(ppo.ppo_value_loss(v, old, R, math.inf), 0.5 * (v - R) ** 2)


# -----------------------------------------------------------------------------
# The script end to end

TINY = ["--batch_size", "8", "--minibatches", "2", "--ppo_epochs", "2", "--log_every", "1",
        "--eval_every", "2", "--eval_n", "16"]


@pytest.fixture(scope="module")
def tiny_rm(tiny_sft, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny_rm"))
    p = run_script("reward_model.py", ["--init", tiny_sft, "--out", out, "--n_train", "64",
                                       "--epochs", "1", "--batch_size", "32", "--eval_n", "32"])
    assert p.returncode == 0, p.stderr
    return os.path.join(out, "rm.pt")


@pytest.mark.slow
def test_ppo_runs_end_to_end_and_resumes(tiny_sft, tiny_rm, tmp_path):
    out = str(tmp_path)
    common = ["--init", tiny_sft, "--rm", tiny_rm, "--out", out] + TINY
    p = run_script("ppo.py", common + ["--steps", "2"], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "held-out greedy accuracy" in p.stdout and "done: 2 steps" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "ppo", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("rm_score", "gold_accuracy", "kl", "clip_frac", "approx_kl", "vf_loss",
                "explained_variance", "entropy"):
        assert math.isfinite(rows[1][key]), key
    assert 0 <= rows[1]["sampler_logp_diff"] < 1e-4     # the sampler's log-probs, aligned
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2]
    from hf.checkpoint import load_checkpoint
    _, ckpt = load_checkpoint(os.path.join(out, "ppo.pt"), kind="gpt")
    assert ckpt["step"] == 2 and "critic" in ckpt
    p = run_script("ppo.py", common + ["--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "ppo", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_the_parked_reference_and_reward_model_are_away_but_where_used(tiny_sft, tiny_rm, tmp_path,
                                                                        monkeypatch):
    """As grpo's (tests/test_plumbing.py): parked as on a GPU (after the critic is copied from
    them), pi_ref is on the device for step 2's forwards alone and the reward model for step 1's
    and the evaluations' scores; away while the sampler and the update run; metrics.jsonl is the
    unparked run's line for line (times aside)."""
    import ppo
    from conftest import parked_runs
    argv = ["--init", tiny_sft, "--rm", tiny_rm, "--steps", "2", "--device", "cpu"] + TINY
    assert parked_runs(ppo, argv, tmp_path, monkeypatch) == [2, 4]   # 2 steps; + evaluations 0, 2


def test_offloaded_moments_of_two_parameter_groups_move_no_number(tiny_sft, tmp_path, monkeypatch):
    """--offload_optimizer as on a GPU (here on the CPU), 4 kB of parameters a chunk, on ppo's one
    AdamW over two parameter groups (the policy, the critic): the moments away while sampling and
    in backward passes, metrics.jsonl the plain run's line for line (conftest.offloaded_runs)."""
    import ppo
    from conftest import offloaded_runs
    argv = ["--init", tiny_sft, "--reward", "verifier", "--steps", "2", "--device", "cpu"] + TINY
    parks = offloaded_runs(ppo, argv, tmp_path, monkeypatch)
    assert [len(p.optimizer.param_groups) for p in parks] == [2]


def test_a2c_and_verifier_reward_settings_run(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("ppo.py", ["--init", tiny_sft, "--out", out, "--reward", "verifier", "--a2c",
                              "--steps", "2", "--adaptive_kl"] + TINY)
    assert p.returncode == 0, p.stderr
    assert "A2C" in p.stdout and "critic from sft" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "ppo", "metrics.jsonl"))]
    assert rows[1]["epochs_done"] == 1 and rows[1]["clip_frac"] == 0.0
    # the adaptive controller (Ziegler et al. 2019, section 2.2), written here: after each batch of
    # B episodes, e = clip(KL / KL_target - 1, -0.2, 0.2) and beta <- beta (1 + e B / horizon), from
    # the default beta 0.3
    B, target, horizon, beta = int(TINY[TINY.index("--batch_size") + 1]), 2.0, 640, 0.3
    for r in rows[1:]:
        beta *= 1 + min(max(r["kl"] / target - 1, -0.2), 0.2) * B / horizon
        assert r["beta"] == pytest.approx(beta, rel=1e-12)
    assert rows[-1]["beta"] != 0.3                                     # it moved


def test_ppo_rejects_bad_settings_with_a_message(tmp_path):
    missing = str(tmp_path / "missing.pt")
    *_, p = refuses_all("ppo.py", [(["--gae_lambda", "1.5"], ["--gae_lambda", "1.5"]),
                                   (["--minibatches", "9", "--batch_size", "8"],
                                    ["--minibatches", "9"]),
                                   (["--rm", missing], ["--rm", "no checkpoint at", "missing.pt"])],
                        tmp_path)
    assert "building" not in p.stdout           # refused before any work: no SFT policy built first
