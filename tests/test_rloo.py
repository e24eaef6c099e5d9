"""rloo.py: the leave-one-out advantages and the REINFORCE loss against float64 references written
here from Ahmadian et al. 2024 (arXiv 2402.14740), hand-worked examples, gradients, and the script
end to end."""
import inspect
import json
import math
import os

import pytest
import torch

import rloo
from conftest import refused, run_script
from hf.checkpoint import load_checkpoint
from rloo import rloo_advantages, rloo_loss


def test_the_loss_and_advantages_run_when_copied_with_torch_alone():
    """What a user copying them gets: the functions' source executed in a fresh namespace holding
    only torch."""
    namespace = {"torch": torch}
    for f in (rloo.rloo_advantages, rloo.rloo_loss):
        exec(inspect.getsource(f), namespace)
    g = torch.Generator().manual_seed(1)
    rewards, logp = torch.rand(8, generator=g), -torch.rand(8, 5, generator=g)
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (8, 1), generator=g)).float()
    A = namespace["rloo_advantages"](rewards, 4)
    assert torch.equal(A, rloo_advantages(rewards, 4))
    got, got_stats = namespace["rloo_loss"](logp, A, mask)
    want, want_stats = rloo_loss(logp, A, mask)
    assert torch.equal(got, want) and torch.equal(got_stats["seq_logp"], want_stats["seq_logp"])


def ref_advantages(rewards, k):
    """A_i = R_i - 1/(k-1) sum_{j != i} R_j, with explicit loops, float64."""
    out = []
    for g in range(len(rewards) // k):
        R = [float(x) for x in rewards[g * k:(g + 1) * k]]
        for i in range(k):
            out.append(R[i] - sum(R[j] for j in range(k) if j != i) / (k - 1))
    return torch.tensor(out, dtype=torch.float64)


def test_hand_worked_example():
    # k = 4, rewards 1 0 0 1: sample 0's baseline is (0 + 0 + 1) / 3 = 1/3, so A_0 = 2/3; sample 1's
    # is 2/3, A_1 = -2/3
    a = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]), 4)
    assert torch.allclose(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]), atol=1e-6)
    # k = 2: each sample's baseline is the other's reward
    assert torch.allclose(rloo_advantages(torch.tensor([0.9, 0.2]), 2), torch.tensor([0.7, -0.7]),
                          atol=1e-6)


@pytest.mark.parametrize("k", [2, 3, 8])
def test_advantages_match_reference_and_the_closed_form(k):
    rewards = torch.randn(5 * k, dtype=torch.float64)
    got = rloo_advantages(rewards, k)
    assert torch.allclose(got, ref_advantages(rewards.tolist(), k), atol=1e-12)
    R = rewards.view(-1, k)
    # k/(k-1) (R_i - mean)
    assert torch.allclose(got.view(-1, k), k / (k - 1) * (R - R.mean(1, keepdim=True)), atol=1e-12)


def test_k_below_two_and_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="k = 1"):
        rloo_advantages(torch.rand(4), 1)
    with pytest.raises(ValueError, match="k = 3"):
        rloo_advantages(torch.rand(8), 3)


def test_loss_and_gradient_match_reference():
    B, T = 6, 5
    logp = -torch.rand(B, T, dtype=torch.float64) * 3
    adv = torch.randn(B, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    lp = logp.clone().requires_grad_(True)
    loss, _ = rloo_loss(lp, adv, mask)
    want = -sum(adv[i] * sum(logp[i, t] for t in range(T) if mask[i, t]) for i in range(B)) / B
    assert abs(loss.item() - want.item()) < 1e-12
    g, = torch.autograd.grad(loss, lp)
    # d/d logp_it = -A_i / B on completion tokens
    assert torch.allclose(g, -adv[:, None] * mask / B, atol=1e-12)


TINY = ["--prompts_per_step", "4", "--group_size", "4", "--log_every", "1", "--eval_every", "2",
        "--eval_n", "8"]


@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("rloo.py", TINY + ["--steps", "2", "--init", tiny_sft, "--out", out], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "done: 2 steps" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "rloo", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[2]
    for key in ("reward_mean", "reward_std", "kl_exact", "kl_k1", "entropy", "completion_len",
                "zero_var_groups", "grad_norm", "tokens_per_sec"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert all(0 <= r["sampler_logp_diff"] < 1e-4 for r in rows[1:])   # the sampler's, aligned
    p = run_script("rloo.py", TINY + ["--steps", "3", "--init", tiny_sft, "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt = load_checkpoint(os.path.join(out, "rloo.pt"))
    assert ckpt["step"] == 3


def test_script_rejects_bad_settings_with_a_message(tmp_path):
    p = run_script("rloo.py", ["--group_size", "1", "--out", str(tmp_path)])
    refused(p, "--group_size", "1")
