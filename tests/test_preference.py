"""dpo.py and ipo.py: both losses and their gradients against float64 references written here from
the papers' equations, hand-worked examples, degenerate cases, and each script end to end (smoke,
resume, a tiny run whose implicit-reward accuracy rises above chance)."""
import importlib.util
import inspect
import json
import math
import os

import pytest
import torch

from conftest import ROOT, refused, run_script
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing runs nothing: training is under __main__
    return module


dpo, ipo = load("dpo"), load("ipo")


# -----------------------------------------------------------------------------
# float64 references, straight from the equations

def dpo_reference(pc, pr, rc, rr, beta):
    """Rafailov et al. 2023, eq. 7: -log sigma(beta log pi(yw)/ref(yw) - beta log pi(yl)/ref(yl)),
    written as log(1 + exp(-u)) in a numerically stable form (not logsigmoid, which the code under
    test uses)."""
    u = beta * (pc - rc) - beta * (pr - rr)
    return torch.clamp(-u, min=0) + torch.log1p(torch.exp(-torch.abs(u)))


def ipo_reference(pc, pr, rc, rr, tau):
    """Azar et al. 2023, the sampled IPO loss (section 5): (log[pi(yw) ref(yl) / (pi(yl) ref(yw))] -
    1/(2 tau))^2."""
    return ((pc - rc - pr + rr) - 1.0 / (2.0 * tau)) ** 2


def random_logps(n, gen):
    # sequence log-probs are negative, tens of nats for ~20-token completions
    return [-torch.rand(n, generator=gen, dtype=torch.float64) * 30 for _ in range(4)]


@pytest.mark.parametrize("B", [1, 7, 64])
def test_dpo_loss_and_gradient_match_the_float64_reference(B):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))  # fresh inputs each run
    for beta in (0.01, 0.1, 0.5, 2.0):
        pc, pr, rc, rr = random_logps(B, gen)
        a = [x.clone().requires_grad_() for x in (pc, pr)]
        b = [x.clone().requires_grad_() for x in (pc, pr)]
        losses, r_c, r_r = dpo.dpo_loss(a[0], a[1], rc, rr, beta)
        expected = dpo_reference(b[0], b[1], rc, rr, beta)
        torch.testing.assert_close(losses, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r_c, beta * (pc - rc)), torch.testing.assert_close(
            r_r, beta * (pr - rr))
        # a random linear functional of the losses
        w = torch.rand(B, generator=gen, dtype=torch.float64)
        (losses * w).sum().backward(), (expected * w).sum().backward()
        torch.testing.assert_close(a[0].grad, b[0].grad), torch.testing.assert_close(
            a[1].grad, b[1].grad)
        # closed form: dL/dpi(yw) = -beta sigma(-u), dL/dpi(yl) = +beta sigma(-u)
        u = beta * ((pc - rc) - (pr - rr))
        torch.testing.assert_close(a[0].grad, -beta * w / (1 + torch.exp(u)))
        torch.testing.assert_close(a[1].grad, beta * w / (1 + torch.exp(u)))


@pytest.mark.parametrize("B", [1, 7, 64])
def test_ipo_loss_and_gradient_match_the_float64_reference(B):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for tau in (0.05, 0.1, 0.5, 1.0):
        pc, pr, rc, rr = random_logps(B, gen)
        a = [x.clone().requires_grad_() for x in (pc, pr)]
        b = [x.clone().requires_grad_() for x in (pc, pr)]
        losses, r_c, r_r = ipo.ipo_loss(a[0], a[1], rc, rr, tau)
        expected = ipo_reference(b[0], b[1], rc, rr, tau)
        torch.testing.assert_close(losses, expected, rtol=1e-10, atol=1e-9)
        torch.testing.assert_close(r_c, tau * (pc - rc)), torch.testing.assert_close(
            r_r, tau * (pr - rr))
        w = torch.rand(B, generator=gen, dtype=torch.float64)
        (losses * w).sum().backward(), (expected * w).sum().backward()
        torch.testing.assert_close(a[0].grad, b[0].grad), torch.testing.assert_close(
            a[1].grad, b[1].grad)
        h = (pc - rc) - (pr - rr)
        # d/dh (h - c)^2 = 2 (h - c)
        torch.testing.assert_close(a[0].grad, 2 * w * (h - 1 / (2 * tau)))
        torch.testing.assert_close(a[1].grad, -2 * w * (h - 1 / (2 * tau)))


def test_the_losses_run_when_copied_with_torch_alone():
    """What a user copying dpo_loss or ipo_loss gets: the source executed in a fresh namespace with
    only torch (and torch.nn.functional as F); `diff dpo.py ipo.py` shows them side by side."""
    g = torch.Generator().manual_seed(4)
    pc, pr, rc, rr = (-10 * torch.rand(6, generator=g) for _ in range(4))
    for module, name in ((dpo, "dpo_loss"), (ipo, "ipo_loss")):
        namespace = {"torch": torch, "F": torch.nn.functional}
        exec(inspect.getsource(getattr(module, name)), namespace)
        got, want = namespace[name](pc, pr, rc, rr, 0.2), getattr(module, name)(pc, pr, rc, rr, 0.2)
        assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_float32_inputs_agree_with_float64():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    pc, pr, rc, rr = random_logps(256, gen)
    f32 = [x.float() for x in (pc, pr, rc, rr)]
    torch.testing.assert_close(dpo.dpo_loss(*f32, 0.1)[0].double(),
                               dpo_reference(pc, pr, rc, rr, 0.1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ipo.ipo_loss(*f32, 0.1)[0].double(),
                               ipo_reference(pc, pr, rc, rr, 0.1), rtol=1e-4, atol=1e-3)


def test_hand_worked_examples():
    # pi(yw) = -1, pi(yl) = -3, ref both -2: h = (-1 + 2) - (-3 + 2) = 2 nats
    t = lambda *xs: torch.tensor(xs, dtype=torch.float64)
    losses, r_c, r_r = dpo.dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-0.2)), abs=1e-12)  # 0.598138869...
    assert losses.item() == pytest.approx(0.5981388693815918, abs=1e-12)
    assert r_c.item() == pytest.approx(0.1) and r_r.item() == pytest.approx(-0.1)
    losses, r_c, r_r = ipo.ipo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), tau=0.1)
    assert losses.item() == pytest.approx((2 - 5) ** 2)                       # target 1/(2*0.1) = 5
    assert r_c.item() == pytest.approx(0.1) and r_r.item() == pytest.approx(-0.1)
    losses, _, _ = ipo.ipo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), tau=0.25)
    assert losses.item() == pytest.approx(0.0)                                # h = 2 = 1/(2*0.25)


def test_degenerate_cases():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    y = -torch.rand(5, generator=gen, dtype=torch.float64) * 20
    ref = -torch.rand(5, generator=gen, dtype=torch.float64) * 20
    # identical chosen and rejected: h = 0, so DPO gives log 2 and IPO 1/(4 tau^2), whatever the
    # policy
    for beta in (0.1, 1.0):
        torch.testing.assert_close(dpo.dpo_loss(y, y, ref, ref, beta)[0],
                                   torch.full_like(y, math.log(2)))
    for tau in (0.1, 0.5):
        torch.testing.assert_close(ipo.ipo_loss(y, y, ref, ref, tau)[0],
                                   torch.full_like(y, 1 / (4 * tau ** 2)))
    # policy equal to the reference: zero implicit rewards, on both sides
    yr = -torch.rand(5, generator=gen, dtype=torch.float64) * 20
    for fn in (dpo.dpo_loss, ipo.ipo_loss):
        _, r_c, r_r = fn(y, yr, y.clone(), yr.clone(), 0.1)
        assert torch.all(r_c == 0) and torch.all(r_r == 0)
    # IPO's gradient vanishes exactly at its target h = 1/(2 tau); DPO's never does
    pc = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    ipo.ipo_loss(pc, torch.tensor([-7.0], dtype=torch.float64),
                 torch.tensor([-2.0], dtype=torch.float64),
                 torch.tensor([-2.0], dtype=torch.float64), 0.1)[0].sum().backward()
    assert pc.grad.item() == 0.0
    pc.grad = None
    dpo.dpo_loss(pc, torch.tensor([-7.0], dtype=torch.float64),
                 torch.tensor([-2.0], dtype=torch.float64),
                 torch.tensor([-2.0], dtype=torch.float64), 0.1)[0].sum().backward()
    assert pc.grad.item() < 0  # DPO still pushes the chosen log-prob up at h = 5


def test_dpo_extreme_margins_stay_finite():
    x = torch.tensor([-1e4, -100.0, 100.0, 1e4], dtype=torch.float32, requires_grad=True)
    zero = torch.zeros(4)
    losses, _, _ = dpo.dpo_loss(x, zero, zero, zero, beta=1.0)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(losses, torch.tensor([1e4, 100.0, 0.0, 0.0]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, torch.tensor([-1.0, -1.0, 0.0, 0.0]), atol=1e-6, rtol=1e-6)


def test_sequence_logprobs_sum_and_mean():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    B, T = 6, 11
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 5
    mask = (torch.rand(B, T, generator=gen) < 0.6).double()
    mask[0] = 0.0                 # a fully masked row
    mask[1] = 0.0
    mask[1, 3] = 1.0              # a single-token completion
    for m in (dpo, ipo):
        total, mean = m.sequence_logprobs(logp, mask), m.sequence_logprobs(logp, mask, average=True)
        for i in range(B):
            toks = [logp[i, t].item() for t in range(T) if mask[i, t] == 1]
            assert total[i].item() == pytest.approx(sum(toks), abs=1e-12)
            assert mean[i].item() == pytest.approx(sum(toks) / len(toks) if toks else 0.0,
                                                   abs=1e-12)
    assert total[0].item() == 0.0 and total[1].item() == logp[1, 3].item()


# -----------------------------------------------------------------------------
# The scripts, end to end

TINY = ["--batch_size", "8", "--n_pairs", "128", "--log_every", "1", "--eval_every", "2",
        "--eval_n", "16", "--seed", "3"]


@pytest.mark.parametrize("script", ["dpo", "ipo"])
@pytest.mark.slow
def test_script_runs_resumes_and_learns(script, tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script(f"{script}.py", TINY + ["--init", tiny_sft, "--out", out, "--steps", "2"],
                   fresh=True)
    assert p.returncode == 0, p.stderr
    assert "held-out greedy accuracy" in p.stdout
    # the pair cache lives in --out, not in out/
    assert os.path.exists(os.path.join(out, "pairs_train.json"))
    rows = [json.loads(line) for line in open(os.path.join(out, script, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2] and "loss" in rows[1]
    assert (rows[0]["eval_reward_margin"] == 0.0
            and rows[0]["eval_kl"] == pytest.approx(0.0, abs=1e-5))  # policy = ref
    # step 1 starts at h = 0
    assert rows[1]["loss"] == pytest.approx(math.log(2) if script == "dpo" else 25.0, rel=1e-3)
    _, ckpt = load_checkpoint(os.path.join(out, f"{script}.pt"), kind="gpt", tokenizer=Tokenizer())
    assert ckpt["step"] == 2

    p = run_script(f"{script}.py",
                   TINY + ["--init", tiny_sft, "--out", out, "--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt2 = load_checkpoint(os.path.join(out, f"{script}.pt"))
    assert (ckpt2["step"] == 3
            and not torch.equal(ckpt2["model"]["wte.weight"], ckpt["model"]["wte.weight"]))
    assert [json.loads(line)["step"]
            for line in open(os.path.join(out, script, "metrics.jsonl"))] == [0, 1, 2, 3]

    # a tiny training run (same pairs, fresh start): the implicit reward learns to rank chosen above
    # rejected
    p = run_script(f"{script}.py", ["--init", tiny_sft, "--out", out, "--steps", "40",
                                    "--batch_size", "16", "--n_pairs", "128", "--lr", "1e-4",
                                    "--log_every", "10", "--eval_every", "40", "--eval_n", "256",
                                    "--seed", "3"])
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in open(os.path.join(out, script, "metrics.jsonl"))]
    # at the start every implicit reward is 0: no pair ranked
    assert rows[0]["eval_reward_accuracy"] == 0.0
    # training pairs (last two batches)
    assert sum(r["reward_accuracy"] for r in rows[-2:]) / 2 > 0.7
    assert rows[-1]["eval_reward_accuracy"] > 0.55              # held-out pairs (256): above chance


@pytest.mark.parametrize("script,bad,words",
                         [("dpo", ["--beta", "0"], ["--beta", "0"]),
                          ("ipo", ["--tau", "-1"], ["--tau", "-1"]),
                          ("ipo", ["--seq_logp", "max"], ["invalid choice: 'max'"]),
                          ("dpo", ["--batch_size", "100", "--n_pairs", "10"], ["--batch_size 100"]),
                          ("dpo", ["--warmup", "-1"], ["--warmup", "-1"])])
def test_bad_settings_are_rejected_with_a_message(script, bad, words, tmp_path):
    refused(run_script(f"{script}.py", bad + ["--out", str(tmp_path)]), *words)


def test_missing_init_is_reported(tmp_path):
    p = run_script("dpo.py", ["--init", str(tmp_path / "nope.pt"), "--out", str(tmp_path)])
    assert p.returncode != 0 and "nope.pt" in p.stderr and "sft.py" in p.stderr
