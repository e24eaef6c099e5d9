"""reinforce.py: the baselines, REINFORCE++'s per-token returns and global normalisation, and the
REINFORCE loss, against float64 references written here from Williams 1992 and Hu 2025
(arXiv 2501.03262); the script end to end."""
import inspect
import json
import math
import os

import pytest
import torch

import kernels
import reinforce
from conftest import refused, run_script
from hf.checkpoint import load_checkpoint
from reinforce import (baseline_advantages, reinforce_loss, reinforce_pp_advantages,
                       update_moving_average)


def test_the_loss_and_advantages_run_when_copied_with_torch_alone():
    """What a user copying them gets: the functions' source executed in a fresh namespace holding
    only torch."""
    namespace = {"torch": torch}
    for f in (kernels.kl_penalty, reinforce.batch_mean, reinforce.reinforce_pp_advantages,
              reinforce.reinforce_loss):
        exec(inspect.getsource(f), namespace)
    g = torch.Generator().manual_seed(1)
    logp, kl_t = -torch.rand(4, 5, generator=g), torch.rand(4, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 2 + [0.0] * 3, [1.0] + [0.0] * 4, [1.0] * 4 + [0.0]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    A = namespace["reinforce_pp_advantages"](rewards, kl_t, mask, 0.04)
    assert torch.equal(A, reinforce_pp_advantages(rewards, kl_t, mask, 0.04))
    got, got_stats = namespace["reinforce_loss"](logp, A, mask)
    want, want_stats = reinforce_loss(logp, A, mask)
    assert torch.equal(got, want) and torch.equal(got_stats["seq_logp"], want_stats["seq_logp"])


def test_baselines_hand_worked():
    R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    assert torch.equal(baseline_advantages(R, "none"), R)
    assert torch.allclose(baseline_advantages(R, "batch_mean"), R - 0.6)
    assert torch.allclose(baseline_advantages(R, "moving_average", 0.25), R - 0.25)
    assert torch.equal(baseline_advantages(R, "moving_average", None), R)    # no history yet: b = 0
    assert update_moving_average(None, R, 0.9) == pytest.approx(0.6)
    assert update_moving_average(0.5, R, 0.9) == pytest.approx(0.9 * 0.5 + 0.1 * 0.6)
    with pytest.raises(ValueError, match="'median'"):
        baseline_advantages(R, "median")


def ref_reinforce_pp(rewards, kl, mask, beta, eps=1e-8):
    """Hu 2025: r_t = -beta KL_t (+ outcome reward on the last token), G_t = sum_{s>=t} r_s, then (G
    - mean) / (std + eps) with mean and std over all completion tokens of the batch. Loops,
    float64."""
    B, T = mask.shape
    G = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        n = int(mask[i].sum())
        r = [-beta * float(kl[i, t]) for t in range(n)]
        if n:
            r[n - 1] += float(rewards[i])
        for t in range(n):
            G[i, t] = sum(r[t:])
    vals = [float(G[i, t]) for i in range(B) for t in range(T) if mask[i, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return (G - mean) / (std + eps) * mask


def test_reinforce_pp_matches_reference():
    B, T = 6, 7
    rewards = (torch.rand(B) > 0.5).double()
    kl = torch.randn(B, T, dtype=torch.float64) * 0.1
    lengths = torch.randint(1, T + 1, (B,))
    lengths[0] = 1                                                     # a one-token completion
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    got = reinforce_pp_advantages(rewards, kl, mask, beta=0.05)
    assert torch.allclose(got, ref_reinforce_pp(rewards, kl, mask, 0.05), atol=1e-10)
    n = mask.sum()
    assert abs((got * mask).sum().item() / n.item()) < 1e-10          # globally zero mean
    assert abs(((got ** 2) * mask).sum().item() / n.item() - 1) < 1e-6  # and unit std


def test_reinforce_pp_hand_worked():
    # beta 0: G_t is the outcome reward on every token; two rows of 2 and 1 tokens with rewards 1
    # and 0: values 1, 1, 0 -> mean 2/3, std sqrt(2/9) -> (1/3)/0.4714 = 0.7071, -(2/3)/0.4714 =
    # -1.4142
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    f64 = dict(dtype=torch.float64)
    got = reinforce_pp_advantages(torch.tensor([1.0, 0.0], **f64), torch.zeros(2, 2, **f64), mask,
                                  0.0)
    assert torch.allclose(got, torch.tensor([[0.70710678, 0.70710678], [-1.41421356, 0.0]], **f64),
                          atol=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_loss_and_gradient_match_reference(per_token):
    B, T = 5, 6
    logp = -torch.rand(B, T, dtype=torch.float64) * 3
    adv = torch.randn(B, T, dtype=torch.float64) if per_token else torch.randn(B,
                                                                               dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    A = adv if per_token else adv[:, None].expand(B, T)
    lp = logp.clone().requires_grad_(True)
    loss, _ = reinforce_loss(lp, adv, mask)
    want = -sum(A[i, t] * logp[i, t] for i in range(B) for t in range(T) if mask[i, t]) / B
    assert abs(loss.item() - want.item()) < 1e-12
    g, = torch.autograd.grad(loss, lp)
    assert torch.allclose(g, -A * mask / B, atol=1e-12)


TINY = ["--prompts_per_step", "4", "--group_size", "4", "--log_every", "1", "--eval_every", "2",
        "--eval_n", "8"]


@pytest.mark.parametrize("baseline", ["reinforce_pp", "moving_average"])
@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(tiny_sft, tmp_path, baseline):
    out = str(tmp_path)
    p = run_script("reinforce.py", TINY + ["--steps", "2", "--baseline", baseline,
                                           "--init", tiny_sft, "--out", out], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "done: 2 steps" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "reinforce", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[2]
    for key in ("reward_mean", "kl_exact", "kl_k1", "entropy", "completion_len", "grad_norm",
                "tokens_per_sec"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert all(0 <= r["sampler_logp_diff"] < 1e-4 for r in rows[1:])   # the sampler's, aligned
    p = run_script("reinforce.py", TINY + ["--steps", "3", "--baseline", baseline,
                                           "--init", tiny_sft, "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt = load_checkpoint(os.path.join(out, "reinforce.pt"))
    assert ckpt["step"] == 3
    assert (ckpt["moving_average"] is None) == (baseline == "reinforce_pp")


def test_script_rejects_bad_settings_with_a_message(tmp_path):
    p = run_script("reinforce.py", ["--ema_decay", "1.5", "--out", str(tmp_path)])
    refused(p, "--ema_decay", "1.5")
    p = run_script("reinforce.py", ["--baseline", "median", "--out", str(tmp_path)])
    assert p.returncode != 0 and "median" in p.stderr
