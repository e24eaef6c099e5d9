"""async_grpo.py: importance_weights and the weighted GRPO loss against float64 references written
from their equations, the sampler's own log-probs against the trainer's, and the processes: a run of
one actor and one learner end to end with resume, the staleness bound, a killed actor, Ctrl-C."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import async_grpo
import sampler
from conftest import ROOT
from model import GPT, GPTConfig, completion_logits

# -----------------------------------------------------------------------------
# importance_weights


def weights_reference(logp, behaviour, mask, mode, cap):
    """The equation, element by element in float64: rho = exp(logp - mu); 1, min(rho, C) or 1[1/C <=
    rho <= C]."""
    out = torch.zeros(logp.shape, dtype=torch.float64)
    for i in range(logp.size(0)):
        for t in range(logp.size(1)):
            if mask[i, t] == 0:
                continue
            rho = torch.exp(logp[i, t].double() - behaviour[i, t].double())
            if torch.isnan(rho):
                out[i, t] = float("nan")
            elif mode == "none":
                out[i, t] = 1.0
            elif mode == "truncate":
                out[i, t] = min(rho.item(), cap)
            else:
                out[i, t] = 1.0 if 1 / cap <= rho.item() <= cap else 0.0
    return out


@pytest.mark.parametrize("mode", ["none", "truncate", "mask"])
@pytest.mark.parametrize("cap", [1.5, 2.0, 10.0])
def test_importance_weights_match_the_equation(mode, cap):
    g = torch.Generator().manual_seed(3)
    logp = -3 * torch.rand(6, 9, generator=g, dtype=torch.float64)
    # rho from about e^-2 to e^2
    behaviour = logp + torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.3).double()
    mask[0] = 0                                                             # a fully masked row
    w = async_grpo.importance_weights(logp, behaviour, mask, mode, cap)
    torch.testing.assert_close(w, weights_reference(logp, behaviour, mask, mode, cap), rtol=1e-12,
                               atol=0)
    if mode != "none":                                                      # the data reach the cut
        assert (w[mask > 0] < torch.exp(logp - behaviour)[mask > 0] - 1e-9).any()


def test_importance_weights_are_detached_keep_nan_and_never_leak_it_from_masked_positions():
    logp = torch.tensor([[-1.0, float("nan"), -2.0], [-1.0, -1.0, float("nan")]],
                        requires_grad=True)
    behaviour = torch.tensor([[-1.2, -1.0, -2.0], [-1.0, float("nan"), -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    for mode in ("none", "truncate", "mask"):
        w = async_grpo.importance_weights(logp, behaviour, mask, mode)
        assert not w.requires_grad
        assert torch.isnan(w[0, 1])                                   # a NaN log-prob: a NaN weight
        assert torch.isfinite(w[1]).all() and (w[1, 1:] == 0).all()   # masked NaNs never leak
    with pytest.raises(ValueError, match="'clip' is unknown"):
        async_grpo.importance_weights(logp, behaviour, mask, "clip")


def test_the_weighted_loss_matches_the_equation_value_and_gradient():
    """L = 1/G sum_i 1/|o_i| sum_t w_it [ -A_i + beta k3_it ] in value at rho' = 1, and its gradient
    1/G sum_i 1/|o_i| sum_t w_it [ -A_i + beta (1 - exp(ref - logp)) ] d logp_it, in float64."""
    g = torch.Generator().manual_seed(5)
    B, T, beta = 6, 7, 0.3
    logp = (-2 * torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    A = torch.randn(B, generator=g, dtype=torch.float64)
    w = 2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[4, 1:] = 0                                                         # a one-token completion
    loss, _ = async_grpo.async_grpo_loss(logp, ref, A, w, mask, beta)
    loss.backward()
    k3 = torch.exp(ref - logp.detach()) - (ref - logp.detach()) - 1
    lengths = mask.sum(1, keepdim=True)
    value = ((w * (-A[:, None] + beta * k3) * mask).sum(1) / lengths[:, 0]).sum() / B
    grad = w * (-A[:, None] + beta * (1 - torch.exp(ref - logp.detach()))) * mask / lengths / B
    torch.testing.assert_close(loss.detach(), value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, grad, rtol=1e-12, atol=1e-12)


def test_the_samplers_log_probs_are_the_trainers():
    """generate(return_logprobs=True) reports log softmax(logits / T)[token] as it sampled: the
    log-probs a learner recomputes from the same weights (the gap at lag 0 is numerics alone), at T
    = 0.7, and 0 after EOS."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt, prompt_mask = torch.randint(0, 50,
                                        (2, 4)), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).float()
    gen = torch.Generator().manual_seed(0)
    tokens, mask, _, logp = sampler.generate(model, prompt, prompt_mask, 12, eos_id=7,
                                             num_samples=3, temperature=0.7, generator=gen,
                                             return_logprobs=True)
    again, _, _ = sampler.generate(model, prompt, prompt_mask, 12, eos_id=7, num_samples=3,
                                   temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, tokens)                                      # the draws are unchanged
    logits = completion_logits(model, prompt.repeat_interleave(3, 0),
                               prompt_mask.repeat_interleave(3, 0), tokens, mask).double()
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(logp.double()[mask > 0], expected[mask > 0], rtol=0, atol=1e-5)
    assert (logp[mask == 0] == 0).all()


# -----------------------------------------------------------------------------
# The processes

def launch(args, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK",
                                                            "WORLD_SIZE")}
    return subprocess.Popen([sys.executable, "async_grpo.py", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, **kw)


def children(p):
    """The pids of p's child processes (the actors: each in a session of its own, so not in p's
    process group)."""
    return [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                           text=True).stdout.split()]


def running(pids):
    """Those of pids still running (a zombie has ended)."""
    states = [subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                             text=True).stdout.strip() for pid in pids]
    return [pid for pid, state in zip(pids, states) if state and not state.startswith("Z")]


SMALL = ["--prompts_per_step", "4", "--group_size", "4", "--eval_n", "16", "--log_every", "1",
         "--eval_every", "2"]


def rows_of(out):
    return [json.loads(line) for line in open(os.path.join(out, "async_grpo", "metrics.jsonl"))]


@pytest.mark.slow
def test_one_actor_and_a_learner_train_resume_and_respect_the_lag_bound(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = launch(SMALL + ["--steps", "4", "--max_lag", "1", "--init", tiny_sft, "--out", out])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert "done: 4 steps" in stdout and "held-out greedy accuracy" in stdout
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["samples"] == 4 * 4 * 4
    # step 1: the first weights
    assert all(0 <= r["lag_max"] <= 1 for r in rows[1:]) and rows[1]["lag_max"] == 0
    assert all(0 < r["is_weight_mean"] <= 2.0 for r in rows[1:])
    p = launch(SMALL + ["--steps", "6", "--max_lag", "1", "--resume", "--init", tiny_sft,
                        "--out", out])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert "resuming from" in stdout and "done: 6 steps" in stdout
    assert [r["step"] for r in rows_of(out)] == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_max_lag_0_is_on_policy(tiny_sft, tmp_path):
    """Admission at --max_lag 0: every group sampled with the weights it is trained on, and then the
    importance weight is 1 up to the sampler's numerics (its KV-cache decoding against the learner's
    full forward)."""
    out = str(tmp_path)
    p = launch(SMALL + ["--steps", "3", "--max_lag", "0", "--is_correction", "none",
                        "--init", tiny_sft, "--out", out])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stdout[-2000:] + stderr[-2000:]
    for r in rows_of(out)[1:]:
        assert r["lag_max"] == 0 and r["logp_gap_lag0"] < 1e-4 and r["rho_outside_band"] == 0
        assert r["logp_gap_lag0"] <= r["sampler_logp_diff"] < 1e-4           # the mean, the largest


@pytest.mark.slow
def test_weights_published_every_second_step_within_a_lag_of_one(tiny_sft, tmp_path):
    """--sync_every 2 --max_lag 1: the learner publishes after steps 2, 4, ...; the groups of step s
    need weights of version >= s - 1, which the last publication always is: the run ends, every lag
    within 1. --sync_every 2 with --max_lag 0 would wait forever (the actor for version s, the
    learner for the actor's groups): refused."""
    out = str(tmp_path)
    p = launch(SMALL + ["--steps", "4", "--max_lag", "1", "--sync_every", "2", "--init", tiny_sft,
                        "--out", out])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert ([r["step"] for r in rows_of(out)] == [0, 1, 2, 3, 4]
            and all(r["lag_max"] <= 1 for r in rows_of(out)[1:]))
    p = launch(SMALL + ["--max_lag", "0", "--sync_every", "2", "--init", tiny_sft,
                        "--out", str(tmp_path / "no")])
    stdout, stderr = p.communicate(timeout=60)
    assert (p.returncode == 2 and "allowed: --sync_every <= --max_lag + 1 = 1" in stderr
            and "Traceback" not in stderr)
    assert not os.path.exists(tmp_path / "no")


def wait_for_rows(p, out, n):
    """Until the running learner `p` has logged n rows of metrics in `out` (at most 120 s)."""
    t = time.time()
    while not os.path.exists(out / "async_grpo" / "metrics.jsonl") or len(rows_of(str(out))) < n:
        assert time.time() - t < 120 and p.poll() is None, p.communicate()
        time.sleep(0.2)


@pytest.mark.slow
def test_a_killed_actor_stops_the_run_with_its_exit_code(tiny_sft, tmp_path):
    p = launch(SMALL + ["--steps", "100000", "--eval_every", "1000", "--init", tiny_sft,
                        "--out", str(tmp_path)])
    wait_for_rows(p, tmp_path, 3)
    actor_pid = children(p)[0]
    os.kill(actor_pid, signal.SIGKILL)
    stdout, stderr = p.communicate(timeout=60)     # a hang (gloo's 30-minute timeout) is an error
    assert p.returncode != 0 and "Traceback" not in stderr
    assert f"actor 1 (pid {actor_pid}) exited with code -9" in stderr, stderr[-2000:]


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_says_how_to_resume(tiny_sft, tmp_path):
    p = launch(SMALL + ["--steps", "100000", "--eval_every", "1000", "--init", tiny_sft,
                        "--out", str(tmp_path)])
    wait_for_rows(p, tmp_path, 2)
    actors = children(p)
    assert len(actors) == 1
    os.killpg(p.pid, signal.SIGINT)             # as a terminal's Ctrl-C: every process of the group
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "continue with: python async_grpo.py" in stdout and "--resume" in stdout
    assert running(actors) == []                # no orphaned actor


@pytest.mark.parametrize("after, ignored", [(0.0, False), (1.0, False), (0.0, True)])
@pytest.mark.slow
def test_ctrl_c_while_the_processes_start_ends_every_one_at_once(tiny_sft, tmp_path, after,
                                                                 ignored):
    """A Ctrl-C as soon as the learner has started its actor (`after` seconds later), while the
    actor is still importing torch or meeting the learner: it reaches the learner alone (the actor
    has a session of its own), which stops within seconds with one line (it used to hang in gloo's
    rendezvous until SIGKILL, and, while it ignored Ctrl-C for its actor to inherit, to lose one
    sent in that window and train on), and no process is left. ignored: the learner started with
    SIGINT ignored, as a background job of a script starts (Python then installs no Ctrl-C handler
    of its own): it used to lose the Ctrl-C and train on."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    p = launch(SMALL + ["--steps", "100000", "--eval_every", "1000", "--init", tiny_sft,
                        "--out", str(tmp_path)], preexec_fn=ignore)
    t = time.time()
    while not children(p):
        assert time.time() - t < 120 and p.poll() is None, p.communicate()
        time.sleep(0.05)
    actors = children(p)
    time.sleep(after)
    os.killpg(p.pid, signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)   # a hang is forever; a loaded machine is slow
    assert p.returncode == 130 and "Traceback" not in stderr, stdout[-2000:] + stderr[-2000:]
    assert running(actors) == []


@pytest.mark.slow
def test_a_killed_learner_leaves_the_actors_quietly(tiny_sft, tmp_path):
    """SIGKILL of the learner: every actor ends without a gloo traceback."""
    p = launch(SMALL + ["--steps", "100000", "--eval_every", "1000", "--init", tiny_sft,
                        "--out", str(tmp_path)])
    wait_for_rows(p, tmp_path, 2)
    actors = children(p)
    assert len(actors) == 1
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    t = time.time()
    while running(actors):
        assert time.time() - t < 30, "an actor outlived the learner"
        time.sleep(0.2)
    assert "Traceback" not in p.stderr.read()
