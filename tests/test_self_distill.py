"""self_distill.py: the loss against a float64 reference written here from the reverse KL's
equation (value and gradient, masked rows and positions, one-token completions, the teacher never
given gradient); task.privileged's teacher prompts on each task; the loss copied out alone; the
script end to end (metrics, resume, a short run that lowers the KL) and its refusals. Its exact
update is in tests/test_updates.py."""
import argparse
import inspect
import json
import math
import os
import random

import pytest
import torch

import kernels
import self_distill
import task
from conftest import refuses_all, run_script
from hf.checkpoint import load_checkpoint
from self_distill import self_distillation_loss


def ref_loss(S, Tt, mask, temp):
    """1/sum_i |o_i| sum_i sum_t sum_v p_v (log p_v - log q_v), p the student's softmax, q the
    teacher's (float64, a position at a time)."""
    total, n = 0.0, 0
    for i in range(S.size(0)):
        for t in range(S.size(1)):
            if mask[i, t] != 0:
                ls = torch.log_softmax(S[i, t] / temp, -1)
                lt = torch.log_softmax(Tt[i, t].detach() / temp, -1)
                total, n = total + (ls.exp() * (ls - lt)).sum(), n + 1
    return total / max(n, 1)


def random_inputs(B=4, T=6, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    Tt = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    mask = (torch.arange(T)[None] < torch.tensor([6, 1, 0, 3])[:, None]).double()
    return S, Tt, mask


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_loss_matches_its_float64_reference(temp):
    """Random logits, a one-token row and an empty one: the value, the student's gradient, and none
    for the teacher (a fixed target even when its logits require grad)."""
    for seed in range(3):
        S, Tt, mask = random_inputs(seed=seed)
        s1, t1 = S.clone().requires_grad_(True), Tt.clone().requires_grad_(True)
        got = self_distillation_loss(s1, t1, mask, temp)
        s2 = S.clone().requires_grad_(True)
        want = ref_loss(s2, Tt, mask, temp)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)   # kernels.kl sums in float32
        g, gt = torch.autograd.grad(got, (s1, t1), allow_unused=True)
        g_ref = torch.autograd.grad(want, s2)[0]
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-5,
                                   atol=1e-5 * g_ref.abs().max().item())
        assert gt is None or (gt == 0).all()
        assert (g[2] == 0).all() and (g[1, 1:] == 0).all()


def test_hand_worked_two_token_vocabulary_and_the_teacher_itself():
    """V = 2, p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3); a student
    equal to its teacher: 0 and no gradient."""
    S = torch.zeros(1, 1, 2, dtype=torch.float64)
    Tt = torch.tensor([[[0.0, math.log(3)]]], dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    assert self_distillation_loss(S, Tt, one).item() == pytest.approx(0.5 * math.log(4 / 3))
    s = Tt.clone().requires_grad_(True)
    loss = self_distillation_loss(s, Tt, one)
    assert loss.item() == 0.0 and (torch.autograd.grad(loss, s)[0].abs() < 1e-7).all()


def test_the_step_normaliser_splits_a_batch():
    S, Tt, mask = random_inputs(seed=4)
    n = mask.sum()
    parts = sum(self_distillation_loss(S[i:i + 2], Tt[i:i + 2], mask[i:i + 2], 1.0, n)
                for i in (0, 2))
    assert parts.item() == pytest.approx(self_distillation_loss(S, Tt, mask).item(), rel=1e-6)


def test_the_loss_runs_when_copied_with_torch_and_kernels_kl_alone():
    namespace = {"torch": torch, "kl": kernels.kl}
    exec(inspect.getsource(self_distill.self_distillation_loss), namespace)
    S, Tt, mask = random_inputs(seed=5)
    assert torch.equal(namespace["self_distillation_loss"](S, Tt, mask, 0.9),
                       self_distillation_loss(S, Tt, mask, 0.9))


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_the_privileged_context_is_the_verified_answer(name):
    """Every task's teacher prompt: its verified answer ahead of the problem, an answer the verifier
    accepts; the problem itself unchanged at the end."""
    args = argparse.Namespace(task=name, countdown_numbers=3, format="plain")
    task.use(args)
    try:
        for prompt in task.sample_prompts(random.Random(0), 20):
            hinted = task.privileged(prompt)
            answer = hinted[len("(answer: "):hinted.index(") ")]
            assert hinted == f"(answer: {answer}) {prompt}"
            assert task.reward(prompt, task.demonstration(prompt)) == 1.0
            assert answer == task.demonstration(prompt).rpartition("#")[2]
    finally:
        task.use(argparse.Namespace(task="arithmetic", format="plain"))


# -----------------------------------------------------------------------------
# The script, end to end

TINY = ["--prompts_per_step", "8", "--log_every", "1", "--eval_every", "2", "--eval_n", "16"]


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "self_distill", "metrics.jsonl"))]


@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(tiny_sft, tmp_path):
    out = str(tmp_path)
    flags = TINY + ["--init", tiny_sft, "--out", out, "--group_size", "2", "--grad_accum", "2"]
    p = run_script("self_distill.py", flags + ["--steps", "2"], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "the same weights with the verified answer" in p.stdout and "done: 2 steps" in p.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["samples"] == 2 * 8 * 2
    for key in ("loss", "kl_forward", "entropy", "reward_mean", "teacher_reward",
                "completion_len", "grad_norm", "sampler_logp_diff"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    # the hint changes what the teacher predicts; the sampler and the student agree
    assert rows[1]["loss"] > 1e-3 and rows[1]["sampler_logp_diff"] < 1e-4
    p = run_script("self_distill.py", flags + ["--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout and "done: 3 steps" in p.stdout
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]
    assert load_checkpoint(os.path.join(out, "self_distill.pt"))[1]["step"] == 3


def test_the_teachers_pass_keeps_no_graph(tiny_sft, tmp_path, monkeypatch):
    """Each micro-batch scores the teacher (the hinted prompts: longer) under no_grad, so that no
    graph of its forward is kept, then the student with one."""
    import model
    calls, real = [], model.completion_logits

    def recorded(policy, prompt, *args, **kwargs):
        out = real(policy, prompt, *args, **kwargs)
        calls.append((prompt.size(1), torch.is_grad_enabled(), out.requires_grad))
        return out
    monkeypatch.setattr(model, "completion_logits", recorded)
    p = run_script("self_distill.py", TINY + ["--init", tiny_sft, "--out", str(tmp_path),
                                              "--steps", "1", "--grad_accum", "2"])
    assert p.returncode == 0, p.stderr[-2000:]
    teacher, student = calls[0::2], calls[1::2]
    assert len(teacher) == len(student) == 2
    assert all(not grad and not kept for _, grad, kept in teacher), teacher
    assert all(grad and kept for _, grad, kept in student), student
    assert all(t[0] > s[0] for t, s in zip(teacher, student))


@pytest.mark.slow
def test_self_distillation_lowers_the_kl_to_the_hinted_self(tiny_sft, tmp_path):
    """20 steps: the reverse KL to the teacher (itself with the answer) on the last 3 steps'
    samples falls below 0.7 of the first 3's, though the teacher moves with the student."""
    out = str(tmp_path)
    p = run_script("self_distill.py", ["--prompts_per_step", "16", "--log_every", "1",
                                       "--eval_every", "100", "--eval_n", "8", "--steps", "20",
                                       "--lr", "3e-3", "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    kl = [r["loss"] for r in read_metrics(out)[1:]]
    assert sum(kl[-3:]) < 0.7 * sum(kl[:3]), kl


def test_script_refuses_bad_input_with_one_line(tiny_sft, tmp_path):
    short = str(tmp_path / "short")
    p = run_script("sft.py", ["--steps", "1", "--n_layer", "1", "--n_head", "1", "--n_embd", "8",
                              "--block_size", "32", "--eval_n", "1", "--out", short])
    assert p.returncode == 0, p.stderr
    done = refuses_all("self_distill.py", [
        (["--task", "toolcalc"], ["--task toolcalc"]),
        (["--init", os.path.join(short, "sft.pt"), "--steps", "1"],
         ["the teacher's prompts", "holds 32", "--block_size"]),
        (["--init", str(tmp_path / "none.pt")], ["no checkpoint at", "none.pt"])],
        tmp_path)
    assert len(done[1].stderr.strip().splitlines()) == 1
    p = run_script("sft.py", ["--hint_share", "0.5", "--task", "toolcalc", "--out",
                              str(tmp_path / "o")])
    assert p.returncode == 2 and "--hint_share 0.5" in p.stderr
