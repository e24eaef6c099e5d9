"""distill.py: each estimator of the per-token reverse KL against a float64 reference written here
from its equation (value and gradient, masked rows and positions, one-token completions, extreme
logits, odd vocabularies); the k1 and k3 gradients' expectations over the sampled token, enumerated
exactly; the loss copied out alone; the script end to end (start-up, metrics, resume, a short run
that lowers the KL) and its refusals."""
import inspect
import json
import math
import os

import pytest
import torch

import distill
import kernels
from conftest import ROOT, refuses_all, run_script
from distill import distillation_loss, topk_kl
from hf.checkpoint import load_checkpoint

ESTIMATORS = ["exact", "k1", "k3", "topk"]


# -----------------------------------------------------------------------------
# float64 references, straight from the equations

def ref_token(s, t, y, estimator, k=None, temp=1.0):
    """One position: s, t (V,) float64 student and teacher logits (s differentiable), y the sampled
    token."""
    ls, lt = torch.log_softmax(s / temp, -1), torch.log_softmax(t / temp, -1)
    if estimator == "exact":                                        # sum_v p_v (log p_v - log q_v)
        return (ls.exp() * (ls - lt)).sum()
    if estimator == "k1":                                           # sg(log p_y - log q_y) log p_y
        return (ls[y] - lt[y]).detach() * ls[y]
    if estimator == "k3":                                           # r - 1 - log r, r = q_y / p_y
        r = (lt[y] - ls[y]).exp()
        return r - 1 - torch.log(r)
    # the teacher's tokens, most likely first
    order = sorted(range(len(s)), key=lambda v: -float(lt[v]))
    top, rest = order[:k], order[k:]
    out = (ls[top].exp() * (ls[top] - lt[top])).sum()
    if rest:                                            # the tail bin: 1 - sum_top p, 1 - sum_top q
        p_tail, q_tail = ls[rest].exp().sum(), lt[rest].exp().sum()
        out = out + p_tail * (torch.log(p_tail) - torch.log(q_tail))
    return out


def ref_loss(S, T, tokens, mask, estimator, k=None, temp=1.0):
    """The mean over the positions where mask is 1 of ref_token; 0 when there are none."""
    terms = [ref_token(S[b, i], T[b, i], int(tokens[b, i]), estimator, k, temp)
             for b in range(S.size(0)) for i in range(S.size(1)) if mask[b, i] > 0]
    return sum(terms) / len(terms) if terms else (S * 0).sum()


def random_inputs(B=4, T=5, V=11, seed=0, scale=2.0, offset=0.0):
    """Student and teacher logits that differ (float32, as models give them), tokens, and a mask
    with a fully masked row (1), a one-token completion (row 2) and ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    S = scale * torch.randn(B, T, V, generator=g) + offset
    Tt = S + scale * 0.7 * torch.randn(B, T, V, generator=g) - offset
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    if B >= 3:
        mask[1], mask[2], mask[2, 0] = 0.0, 0.0, 1.0
    return S, Tt, tokens, mask


def check_against_reference(S, Tt, tokens, mask, estimator, k=None, temp=1.0, rtol=1e-5):
    s = S.clone().requires_grad_(True)
    t = Tt.clone().requires_grad_(True)           # a teacher that would take a gradient: never does
    loss = distillation_loss(s, t, tokens, mask, estimator, k, temp)
    loss.backward()
    s64 = S.double().requires_grad_(True)
    want = ref_loss(s64, Tt.double(), tokens, mask, estimator, k, temp)
    want.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(want.item(), rel=rtol, abs=rtol), (
        estimator, loss.item(), want.item())
    scale = s64.grad.abs().max().item()
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=rtol, atol=rtol * scale + 1e-9)
    assert t.grad is None                         # the teacher got no gradient
    assert (s.grad[mask == 0] == 0).all()         # nor did masked positions
    return loss


# -----------------------------------------------------------------------------
# The loss against the references

@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("V", [1, 11, 258])
def test_each_estimator_matches_its_float64_reference(estimator, V):
    for seed, temp in ((0, 1.0), (1, 0.7), (2, 1.6)):
        S, Tt, tokens, mask = random_inputs(V=V, seed=seed)
        for k in ([1, 3, V - 1, V] if estimator == "topk" else [None]):
            if k is not None and k < 1:
                continue
            check_against_reference(S, Tt, tokens, mask, estimator, k, temp)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_extreme_logits_give_the_references_value(estimator):
    """Logits around +1e4 (student) and -1e4 (teacher), spread over +-90: each log-softmax must be
    taken stably (a plain exp overflows). The reference runs in float64 on the same float32
    inputs."""
    S, Tt, tokens, mask = random_inputs(V=13, seed=3, scale=30.0, offset=1e4)
    # close to the student's shape
    Tt = S - 2e4 + torch.randn(S.shape, generator=torch.Generator().manual_seed(9))
    check_against_reference(S, Tt, tokens, mask, estimator, 4 if estimator == "topk" else None,
                            rtol=1e-3)


def test_padding_never_leaks_into_the_value_or_the_gradient():
    """A masked position where the teacher likes the token e^300 times more than the student (r =
    q_y / p_y overflows float32 there): the value and the gradient stay those of the real
    positions."""
    S, Tt, tokens, mask = random_inputs(seed=11)
    S2, Tt2 = S.clone(), Tt.clone()
    S2[1, 0, tokens[1, 0]] -= 150.0                                   # row 1 is masked
    Tt2[1, 0, tokens[1, 0]] += 150.0
    for estimator in ESTIMATORS:
        grads = []
        for s_in, t_in in ((S, Tt), (S2, Tt2)):
            s = s_in.clone().requires_grad_(True)
            loss = distillation_loss(s, t_in, tokens, mask, estimator, 3)
            loss.backward()
            grads.append((loss.detach(), s.grad))
        assert torch.isfinite(grads[1][1]).all(), estimator
        assert (torch.equal(grads[0][0], grads[1][0])
                and torch.equal(grads[0][1], grads[1][1])), estimator


def test_hand_worked_two_token_vocabulary():
    """p = (0.8, 0.2), q = (0.5, 0.5), sampled y = 0: KL = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.19274; k1's
    value is sg(ln 1.6) ln 0.8 = -0.10488; k3's: r = 0.625, r - 1 - ln r = 0.09500; topk with k = 1:
    one token and a tail holding the other, the exact KL again."""
    s = torch.tensor([[[math.log(0.8), math.log(0.2)]]])
    t = torch.zeros(1, 1, 2)
    y, m = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    want = {"exact": 0.8 * math.log(1.6) + 0.2 * math.log(0.4), "k1": math.log(1.6) * math.log(0.8),
            "k3": 0.625 - 1 - math.log(0.625)}
    want["topk"] = want["exact"]
    for estimator, value in want.items():
        assert distillation_loss(s, t, y, m, estimator, 1).item() == pytest.approx(
            value, abs=1e-6), estimator
    assert (want["exact"] == pytest.approx(0.19274, abs=1e-5)
            and want["k3"] == pytest.approx(0.09500, abs=1e-5))


def test_topk_lies_between_zero_and_the_exact_kl_and_reaches_it():
    S, Tt, _, _ = random_inputs(V=17, seed=5)
    exact = kernels.kl(S, Tt)                                       # (B, T)
    previous = torch.zeros_like(exact)
    for k in range(1, 18):
        got = topk_kl(S, Tt, k)
        assert ((got >= -1e-6).all()
                and (got <= exact + 1e-5).all()), k                 # a coarsening loses information
        if k >= 16:
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)
        previous = got
    assert previous.shape == exact.shape


def test_all_masked_gives_zero_and_the_step_normaliser_splits_a_batch():
    S, Tt, tokens, mask = random_inputs(seed=6)
    s = S.clone().requires_grad_(True)
    loss = distillation_loss(s, Tt, tokens, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and (s.grad == 0).all()
    for estimator in ESTIMATORS:                # two parts with the whole count add up to the whole
        whole = distillation_loss(S, Tt, tokens, mask, estimator, 3)
        n = mask.sum()
        parts = sum(distillation_loss(S[r], Tt[r], tokens[r], mask[r], estimator, 3, num_tokens=n)
                    for r in (slice(0, 2), slice(2, 4)))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-6), estimator


def test_bad_estimator_or_topk_is_a_value_error():
    S, Tt, tokens, mask = random_inputs()
    with pytest.raises(ValueError, match="'k2'"):
        distillation_loss(S, Tt, tokens, mask, "k2")
    for k in (None, 0):
        with pytest.raises(ValueError, match="topk >= 1"):
            distillation_loss(S, Tt, tokens, mask, "topk", k)


# -----------------------------------------------------------------------------
# What the sampled estimators' gradients are, in expectation over y ~ student (enumerated, not
# sampled)

def expected_gradient(S, Tt, estimator, temp=1.0):
    """sum_y p_student(y) grad_S loss(tokens = y), position by position (the loss at one position
    depends only on the token sampled there, so setting every position to y at once gives each
    position's gradient at y)."""
    p = torch.softmax(S.double() / temp, -1)                        # (B, T, V)
    mask = torch.ones(S.shape[:2])
    total = torch.zeros_like(S, dtype=torch.float64)
    for y in range(S.size(-1)):
        s = S.clone().requires_grad_(True)
        distillation_loss(s, Tt, torch.full(S.shape[:2], y), mask, estimator,
                          temperature=temp).backward()
        total += p[..., y:y + 1] * s.grad.double()
    return total


def exact_gradient(S, Tt, forward=False, temp=1.0):
    s = S.double().requires_grad_(True)
    ls, lt = torch.log_softmax(s / temp, -1), torch.log_softmax(Tt.double() / temp, -1)
    per_token = (lt.exp() * (lt - ls)).sum(-1) if forward else (ls.exp() * (ls - lt)).sum(-1)
    per_token.mean().backward()
    return s.grad


@pytest.mark.parametrize("temp", [1.0, 0.8])
def test_k1_gradient_is_in_expectation_the_reverse_kl_gradient(temp):
    S, Tt, _, _ = random_inputs(B=2, T=3, V=7, seed=7)
    want = exact_gradient(S, Tt, temp=temp)
    torch.testing.assert_close(expected_gradient(S, Tt, "k1", temp), want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(expected_gradient(S, Tt, "exact", temp), want, rtol=1e-4, atol=1e-6)
    # the directions differ here
    assert (want - exact_gradient(S, Tt, forward=True, temp=temp)).abs().max() > 1e-2


def test_k3_value_is_unbiased_but_its_gradient_is_the_forward_kls():
    """k3 = r - 1 - log r with y ~ student: E[k3] = KL(student || teacher), and E[grad k3] = E[(1 -
    r) grad log p_y] = grad KL(teacher || student): the forward direction (mass-covering), not the
    reverse."""
    S, Tt, _, _ = random_inputs(B=2, T=3, V=7, seed=8)
    p = torch.softmax(S.double(), -1)
    # (B, T, V) k3 at each y
    values = torch.stack([kernels.kl_penalty(kernels.logprobs(S, torch.full(S.shape[:2], y)),
                                             kernels.logprobs(Tt, torch.full(S.shape[:2], y)),
                                             "k3").double() for y in range(7)], -1)
    torch.testing.assert_close((p * values).sum(-1), kernels.kl(S, Tt).double(), rtol=1e-4,
                               atol=1e-6)
    torch.testing.assert_close(expected_gradient(S, Tt, "k3"), exact_gradient(S, Tt, forward=True),
                               rtol=1e-4, atol=1e-6)


# -----------------------------------------------------------------------------
# Copied out

def test_the_loss_runs_when_copied_with_torch_and_the_two_kernels_alone():
    """What a user copying distillation_loss gets: its source and topk_kl's, executed in a fresh
    namespace holding only torch and kernels.kl / kernels.logprobs. It must run and agree with the
    imported function."""
    namespace = {"torch": torch, "kl": kernels.kl, "logprobs": kernels.logprobs}
    for f in (distill.topk_kl, distill.distillation_loss):
        exec(inspect.getsource(f), namespace)
    S, Tt, tokens, mask = random_inputs(seed=10)
    for estimator in ESTIMATORS:
        got = namespace["distillation_loss"](S, Tt, tokens, mask, estimator, 3, 0.9)
        assert torch.equal(got, distillation_loss(S, Tt, tokens, mask, estimator, 3, 0.9)), (
            estimator)


# -----------------------------------------------------------------------------
# The script, end to end

TINY = ["--prompts_per_step", "8", "--log_every", "1", "--eval_every", "2", "--eval_n", "16"]


@pytest.fixture(scope="module")
def tiny_student(tmp_path_factory):
    """A student smaller than tiny_sft (1 layer, width 32) and barely trained (60 steps, ~5 s)."""
    out = str(tmp_path_factory.mktemp("tiny_student"))
    p = run_script("sft.py", ["--steps", "60", "--batch_size", "16", "--n_layer", "1",
                              "--n_head", "2", "--n_embd", "32", "--log_every", "60",
                              "--eval_every", "60", "--eval_n", "8", "--out", out])
    assert p.returncode == 0, p.stderr
    return os.path.join(out, "sft.pt")


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "distill", "metrics.jsonl"))]


@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(tiny_sft, tiny_student, tmp_path):
    out = str(tmp_path)
    flags = TINY + ["--teacher", tiny_sft, "--init", tiny_student, "--out", out,
                    "--estimator", "topk", "--topk", "4", "--reward_weight", "0.5",
                    "--group_size", "2", "--grad_accum", "2"]
    p = run_script("distill.py", flags + ["--steps", "2"], fresh=True)
    assert p.returncode == 0, p.stderr
    teacher = [line for line in p.stdout.splitlines() if line.startswith("distillation:")][0]
    # the start-up line names the teacher's accuracy
    assert "held-out greedy" in teacher and tiny_sft in teacher
    assert ("done: 2 steps" in p.stdout and "(teacher " in p.stdout
            and "of the gap closed" in p.stdout)
    rows = read_metrics(out)
    assert ([r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[2]
            and rows[2]["samples"] == 2 * 8 * 2)
    for key in ("loss", "kl_exact", "kl_forward", "entropy", "reward_mean", "teacher_reward",
                "completion_len", "grad_norm", "tokens_per_sec", "sampler_logp_diff"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert 0 <= rows[1]["sampler_logp_diff"] < 1e-4     # the sampler's log-probs, the trainer's
    assert rows[1]["kl_exact"] > 0.05 and 0 <= rows[1]["teacher_reward"] <= 1
    _, ckpt = load_checkpoint(os.path.join(out, "distill.pt"))
    assert ckpt["step"] == 2 and 0 <= ckpt["teacher_eval"]["eval_accuracy"] <= 1

    p = run_script("distill.py", flags + ["--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout and "done: 3 steps" in p.stdout
    _, ckpt2 = load_checkpoint(os.path.join(out, "distill.pt"))
    assert (ckpt2["step"] == 3
            and not torch.equal(ckpt2["model"]["wte.weight"], ckpt["model"]["wte.weight"]))
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]


def test_distillation_lowers_the_kl_to_the_teacher(tiny_sft, tiny_student, tmp_path):
    """15 steps from the barely trained student towards tiny_sft: the exact reverse KL on the last 3
    steps' samples falls below 0.7 of the first 3's (seeds 0, 1, 2: 0.49, 0.46, 0.59 of it). A
    flipped sign, or a loss that moved the teacher instead of the student, would not."""
    out = str(tmp_path)
    p = run_script("distill.py", ["--prompts_per_step", "16", "--log_every", "1",
                                  "--eval_every", "100", "--eval_n", "8", "--steps", "15",
                                  "--lr", "1e-2", "--teacher", tiny_sft, "--init", tiny_student,
                                  "--out", out])
    assert p.returncode == 0, p.stderr
    kl = [r["kl_exact"] for r in read_metrics(out)[1:]]
    assert sum(kl[-3:]) < 0.7 * sum(kl[:3]), kl


def test_script_refuses_bad_input_with_one_line(tiny_sft, tiny_student, tmp_path):
    both = ["--teacher", tiny_sft, "--init", tiny_student, "--steps", "1"]
    gpt2 = os.path.join(ROOT, "tests", "golden", "gpt2")  # a Hugging Face folder: another tokenizer
    done = refuses_all("distill.py", [
        (["--estimator", "k2"], ["--estimator", "k2"]),
        (["--topk", "0"], ["--topk", "0"]),
        (both + ["--estimator", "topk", "--topk", "300"], ["--topk 300", "258"]),
        (["--teacher", gpt2, "--init", tiny_student, "--steps", "1"],
         [f"--teacher {gpt2}", "'bytes' (258 tokens)", tiny_student]),
        (["--teacher", str(tmp_path / "none.pt"), "--init", tiny_student],
         ["--teacher", "no checkpoint at"]),
        (["--teacher", tiny_sft, "--init", str(tmp_path / "none.pt")],
         ["no checkpoint at", "none.pt"])], tmp_path)
    assert len(done[3].stderr.strip().splitlines()) == 1
