"""The pure functions of experiments/results.py, kl_estimators.py, forward_reverse_kl.py and
multiturn_credit.py:
hand-worked values, float64 references written here from the definitions, and exact expectations
over small enumerable categoricals (where E_{y ~ p}[...] is a finite sum). The sweeps themselves are
benchmarks, not tests; results.py's table and figures are checked end to end on a synthetic runs
folder (--table_only)."""
import json
import math
import os
import sys

import pytest
import torch

from conftest import ROOT, refused, run_script

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import forward_reverse_kl as frk  # noqa: E402
import kl_estimators as kle  # noqa: E402
import multiturn_credit  # noqa: E402
import results  # noqa: E402


# -----------------------------------------------------------------------------
# experiments/results.py

def test_read_metrics_drops_a_cut_line_and_a_missing_file_is_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 5, "loss": 1.0}\n{"step": 10, "lo')
    assert results.read_metrics(str(path)) == [{"step": 0, "eval_accuracy": 0.5},
                                               {"step": 5, "loss": 1.0}]
    assert results.read_metrics(str(tmp_path / "absent.jsonl")) == []


def test_is_done():
    rows = [{"step": 0, "eval_accuracy": 0.5}, {"step": 10, "loss": 1.0, "eval_accuracy": 0.7}]
    assert results.is_done(rows, 10, 10)
    assert not results.is_done(rows, 5, 10)                              # checkpoint behind the log
    assert not results.is_done(rows, None, 10)                           # no checkpoint
    assert not results.is_done(rows[:1] + [{"step": 10, "loss": 1.0}],
                               10, 10)                                  # last row not an evaluation
    assert not results.is_done(rows, 10, 20)                                  # a larger step limit
    assert not results.is_done([], 10, 10)
    assert results.is_done([{"step": 0},
                            {"step": 4, "eval_pair_accuracy": 0.9}], 4, 4)      # the reward model's


def test_curve_keeps_the_evaluations():
    rows = [{"step": 0, "eval_accuracy": 0.5, "eval_pass_at_1": 0.4},
            {"step": 5, "loss": 1.0, "samples": 80, "elapsed_s": 2.0},
            {"step": 10, "loss": 0.5, "samples": 160, "elapsed_s": 4.0, "eval_accuracy": 0.7,
             "eval_pass_at_1": 0.6}]
    assert results.curve(rows) == [
        {"step": 0, "samples": 0, "elapsed_s": 0.0, "eval_accuracy": 0.5, "eval_pass_at_1": 0.4},
        {"step": 10, "samples": 160, "elapsed_s": 4.0, "eval_accuracy": 0.7, "eval_pass_at_1": 0.6}]


def test_spread_and_its_format():
    s = results.spread([1, 2, 3, 4])
    assert s["mean"] == 2.5 and s["min"] == 1 and s["max"] == 4 and s["n"] == 4
    # sample std, n - 1
    assert s["std"] == pytest.approx(math.sqrt(((1.5 ** 2 + 0.5 ** 2) * 2) / 3))
    assert results.fmt_spread(results.spread([0.5, 0.7])) == "0.600 +- 0.141 [0.500, 0.700]"
    assert results.fmt_spread(results.spread([0.5, 0.7]), range_=False) == "0.600 +- 0.141"
    assert results.fmt_spread(results.spread([1.0, 3.0]), "+.2f", range_=False) == "+2.00 +- 1.41"
    one = results.spread([0.25])
    assert one["std"] == 0.0 and results.fmt_spread(one) == "0.250"


def test_mean_curve_over_the_steps_every_seed_has():
    a = [{"step": 0, "samples": 0, "eval_accuracy": 0.2},
         {"step": 10, "samples": 100, "eval_accuracy": 0.6},
         {"step": 20, "samples": 200, "eval_accuracy": 0.8}]
    b = [{"step": 0, "samples": 0, "eval_accuracy": 0.4},
         {"step": 10, "samples": 140, "eval_accuracy": 0.5}]
    xs, mean, lo, hi = results.mean_curve([a, b])
    assert (xs == [0, 10] and mean == pytest.approx([0.3, 0.55]) and lo == [0.2, 0.5]
            and hi == [0.4, 0.6])
    xs, *_ = results.mean_curve([a, b], x="samples")
    assert xs == [0, 120]


def test_summary_table():
    def run(seed, before, after, prec, seconds):
        return {"seed": seed, "before": {"eval_accuracy": before}, "samples": 12800,
                "seconds": seconds, "process_s": seconds + 10,
                "after": {"eval_accuracy": after, "eval_accuracy_precedence": prec,
                          "eval_pass_at_1": after - 0.1}}
    s = results.summarise([run(0, 0.6, 0.9, 0.8, 40), run(1, 0.6, 0.7, 0.6, 60)])
    assert s["after"]["eval_accuracy"]["mean"] == pytest.approx(0.8) and s["seeds"] == [0, 1]
    md = results.table({"grpo": s}, {"grpo": "GRPO"}, {"grpo": "python grpo.py"})
    row = md.splitlines()[2]
    assert row.startswith("| GRPO | 0.600 +- 0.000 -> **0.800 +- 0.141** [0.700, 0.900] | "
                          "0.700 +- 0.141 | 0.700 +- 0.141 |")
    assert "| 50 +- 14 / 60 +- 14 | 12,800 | 2 | `python grpo.py` |" in row
    assert (len(md.splitlines()) == 3
            and md.splitlines()[1].count("|") == md.splitlines()[0].count("|"))


def test_discover_picks_up_a_new_algorithm_file(tmp_path, monkeypatch):
    """A script is an algorithm when its parse_args has --init defaulting to flags.SFT_PATH; prm and
    search are not; a script whose --init defaults elsewhere is not; a file that does not import is
    left out with a warning."""
    head = ("import argparse\nfrom plumbing.flags import SFT_PATH\n\ndef parse_args(argv=None):\n"
            "    p = argparse.ArgumentParser()\n")
    tail = '    p.add_argument("--steps", type=int, default=3)\n    return p.parse_args(argv)\n'
    (tmp_path / "zz_newalgo.py").write_text(
        head + '    p.add_argument("--init", default=SFT_PATH)\n' + tail)
    (tmp_path / "prm.py").write_text(head
                                     + '    p.add_argument("--init", default=SFT_PATH)\n' + tail)
    (tmp_path / "zz_tool.py").write_text(
        head + '    p.add_argument("--init", default="elsewhere.pt")\n' + tail)
    (tmp_path / "zz_broken.py").write_text(
        head + '    p.add_argument("--init", default=SFT_PATH)\n    return (\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    found = results.discover(str(tmp_path))
    assert list(found) == ["zz_newalgo"]
    assert results.step_limit(found["zz_newalgo"], ["zz_newalgo.py", "--steps", "7"]) == 7


def test_discover_the_repository_and_the_commands():
    found = results.discover()
    assert list(found)[:2] == ["sft", "reward_model"]                         # prerequisites first
    assert ({"grpo", "rloo", "reinforce", "ppo", "dpo", "ipo"} <= set(found)
            and not {"prm", "search"} & set(found))
    d = os.path.join("results", "runs", "seed1")
    assert results.command(found["sft"], "sft", 1, d) == ["sft.py", "--seed", "1", "--out", d]
    assert results.command(found["ppo"], "ppo", 1, d) == ["ppo.py", "--seed", "1", "--out", d,
                                                          "--init", os.path.join(d, "sft.pt"),
                                                          "--rm", os.path.join(d, "rm.pt")]
    quick = results.command(found["grpo"], "grpo", 1, d, quick=True)
    assert results.step_limit(found["grpo"], quick) == 4 and "--eval_n" in quick
    rm = results.command(found["reward_model"], "reward_model", 1, d)
    assert results.step_limit(found["reward_model"], rm) == 128
    extra = ["--task", "countdown", "--steps", "500"]       # --task countdown --flags '--steps 500'
    argv = results.command(found["grpo"], "grpo", 1, d, extra=extra)
    assert argv[:7] == ["grpo.py", "--seed", "1", "--out", d, "--task", "countdown"]
    assert results.step_limit(found["grpo"], argv) == 500
    # the task's budget, not arithmetic's
    assert found["grpo"].parse_args(argv[1:]).max_new_tokens == 28


def write_run(folder, name, limit, every, accuracies):
    """A synthetic metrics.jsonl: an evaluation every `every` steps, accuracy from `accuracies` in
    turn."""
    os.makedirs(os.path.join(folder, name), exist_ok=True)
    with open(os.path.join(folder, name, "metrics.jsonl"), "w") as f:
        for i, step in enumerate(range(0, limit + 1, every)):
            acc = accuracies[i]
            row = {"step": step, "eval_accuracy": acc, "eval_pass_at_1": acc,
                   "eval_accuracy_precedence": acc / 2, "eval_accuracy_other": acc}
            if step:
                row.update(samples=step * 256, elapsed_s=float(step))
            f.write(json.dumps(row) + "\n")


def test_table_only_end_to_end_on_synthetic_runs(tmp_path):
    for seed, end in ((0, 0.9), (1, 0.8)):
        folder = str(tmp_path / "runs" / f"seed{seed}")
        write_run(folder, "sft", 1500, 500, [0.0, 0.3, 0.5, 0.6])
        write_run(folder, "grpo", 50, 10, [0.6, 0.7, 0.75, 0.8, 0.85, end])
        if seed == 0:                                                          # rloo: one seed only
            write_run(folder, "rloo", 50, 10, [0.6] * 5 + [end])
    p = run_script("experiments/results.py",
                   ["--table_only", "--seeds", "0", "1", "--dir", str(tmp_path)])
    assert p.returncode == 0, p.stderr
    md = (tmp_path / "results.md").read_text()
    assert "| GRPO | 0.600 +- 0.000 -> **0.850 +- 0.071** [0.800, 0.900] |" in md
    assert "| SFT | 0.000 +- 0.000 -> **0.600 +- 0.000** [0.600, 0.600] |" in md
    assert ("| RLOO | 0.600 -> **0.900** [0.900, 0.900] |" in md
            and "| 1 | `OMP_NUM_THREADS=1 python rloo.py` |" in md)
    # the thread count is part of the command
    assert "`OMP_NUM_THREADS=1 python X.py --seed S" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["setting"]["threads"] == 1
    saved = json.loads((tmp_path / "results.json").read_text())
    assert ([r["seed"] for r in saved["runs"]["grpo"]] == [0, 1]
            and len(saved["runs"]["grpo"][0]["curve"]) == 6)
    for png in ("accuracy_vs_step.png", "accuracy_vs_samples.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_harness_sets_the_thread_count_of_every_run(tmp_path, monkeypatch):
    """run_one starts each script with OMP_NUM_THREADS set (on a CPU the thread count changes the
    results)."""
    seen = {}

    class Proc:
        def wait(self):
            return 0

    def popen(cmd, cwd=None, stdout=None, stderr=None, env=None):
        seen.update(env=env, cmd=cmd)
        return Proc()
    monkeypatch.setattr(results.subprocess, "Popen", popen)
    results.run_one(["grpo.py", "--seed", "0"], str(tmp_path / "log"), str(tmp_path / "time.json"),
                    False, threads=3)
    assert seen["env"]["OMP_NUM_THREADS"] == "3" and seen["cmd"][1:] == ["grpo.py", "--seed", "0"]


def test_bad_input_is_refused(tmp_path):
    refused(run_script("experiments/results.py",
                       ["--only", "nosuchscript", "--dir", str(tmp_path)]),
            "--only", "nosuchscript")
    refused(run_script("experiments/results.py", ["--table_only", "--dir", str(tmp_path)]),
            "no finished runs")
    (tmp_path / "a_file").write_text("x")
    refused(run_script("experiments/results.py",
                       ["--table_only", "--dir", str(tmp_path / "a_file")]),
            "--dir", "cannot write")
    refused(run_script("experiments/results.py", ["--threads", "0", "--dir", str(tmp_path)]),
            "--threads 0")


# -----------------------------------------------------------------------------
# experiments/kl_estimators.py, on enumerable categoricals

def categorical(V=7, positions=3, scale=1.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(positions, V, generator=g, dtype=torch.float64)).requires_grad_()
    ref_logits = scale * torch.randn(positions, V, generator=g, dtype=torch.float64)
    return logits, ref_logits


def ref_quantities(logits, ref_logits):
    """float64, from the definitions: p, q, KL(p || q), KL(q || p) per position, and their gradients
    w.r.t. the logits of p: d KL(p||q)/d z = p (log p/q - KL(p||q)); d KL(q||p)/d z = p - q (d/dz of
    -sum q log p)."""
    p, q = torch.softmax(logits.detach(), -1), torch.softmax(ref_logits, -1)
    fwd = (p * (p.log() - q.log())).sum(-1)
    rev = (q * (q.log() - p.log())).sum(-1)
    return p, q, fwd, rev, p * (p.log() - q.log() - fwd[:, None]), p - q


def test_expected_estimators_values_and_gradients_match_grpo_docstring():
    """E_p[k1] = E_p[k3] = KL(p || q), E_p[k2] = E_p[(log p/q)^2] / 2; as losses, E[grad k1] = 0,
    E[grad k2] = grad KL(p || q), E[grad k3] = grad KL(q || p): exactly, over the whole
    vocabulary."""
    logits, ref_logits = categorical()
    p, q, fwd, rev, g_fwd, g_rev = ref_quantities(logits, ref_logits)
    expected_value = {"k1": fwd, "k2": (p * (p.log() - q.log()) ** 2).sum(-1) / 2, "k3": fwd}
    expected_grad = {"k1": torch.zeros_like(p), "k2": g_fwd, "k3": g_rev}
    for est in ("k1", "k2", "k3"):
        value = kle.expected_estimator_loss(logits, ref_logits, est)
        (grad,) = torch.autograd.grad(value.sum(), logits)
        torch.testing.assert_close(value, expected_value[est], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad[est], rtol=1e-9, atol=1e-12)


def test_sampled_estimators_converge_to_the_expectation():
    """The Monte Carlo loss over many draws: its value and gradient within a few standard errors of
    the exact ones."""
    logits, ref_logits = categorical(V=5, positions=2, scale=1.0, seed=1)
    M = 40000
    for est in ("k1", "k2", "k3"):
        gen = torch.Generator().manual_seed(3)
        value = kle.sampled_estimator_loss(logits, ref_logits, est, M, gen)
        (grad,) = torch.autograd.grad(value.sum(), logits)
        exact = kle.expected_estimator_loss(logits, ref_logits, est)
        (exact_grad,) = torch.autograd.grad(exact.sum(), logits)
        assert value.shape == (2,)
        torch.testing.assert_close(value, exact.detach(),
                                   rtol=0, atol=0.05)           # values are O(1); 5 standard errors
        torch.testing.assert_close(grad, exact_grad, rtol=0, atol=0.05)


def test_exact_kls_against_float64():
    logits, ref_logits = categorical(V=11, positions=4)
    _, _, fwd, rev, g_fwd, g_rev = ref_quantities(logits, ref_logits)
    z = logits.detach().float().requires_grad_()
    forward, reverse = kle.exact_kls(z, ref_logits.float())
    torch.testing.assert_close(forward.double(), fwd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reverse.double(), rev, rtol=1e-5, atol=1e-6)
    (gf,) = torch.autograd.grad(forward.sum(), z)
    (gr,) = torch.autograd.grad(reverse.sum(), z)
    torch.testing.assert_close(gf.double(), g_fwd, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gr.double(), g_rev, rtol=1e-4, atol=1e-6)
    same, _ = kle.exact_kls(ref_logits.float(), ref_logits.float())
    assert torch.all(same == 0)


def test_estimator_stats_by_hand():
    s = kle.estimator_stats(torch.tensor([1.0, 3.0, -1.0, 5.0]), torch.tensor([2.0, 2.0, 1.0, 3.0]))
    # errors -1, 1, -2, 2: bias 0, population std sqrt(10/4), RMSE sqrt(10/4), mean exact 2
    assert s["bias"] == pytest.approx(0.0) and s["std"] == pytest.approx(math.sqrt(2.5))
    assert (s["rel_rmse"] == pytest.approx(math.sqrt(2.5) / 2) and s["negative"] == 0.25
            and s["mean_exact"] == 2.0)
    biased = kle.estimator_stats(torch.tensor([3.0, 3.0]), torch.tensor([1.0, 1.0]))
    assert biased["bias"] == 2.0 and biased["std"] == 0.0 and biased["rel_rmse"] == 2.0


def test_grad_similarity_by_hand():
    assert kle.grad_similarity(torch.tensor([1.0, 0.0]),
                               torch.tensor([2.0, 0.0])) == pytest.approx((1.0, 0.5))
    assert kle.grad_similarity(torch.tensor([0.0, 3.0]),
                               torch.tensor([2.0, 0.0])) == pytest.approx((0.0, 1.5))
    assert kle.grad_similarity(torch.tensor([-1.0, -1.0]),
                               torch.tensor([1.0, 1.0])) == pytest.approx((-1.0, 1.0))


def test_per_completion_never_reads_padding():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert kle.per_completion(x, mask).tolist() == [3.0, 4.0]


# -----------------------------------------------------------------------------
# experiments/forward_reverse_kl.py

def test_kl_divergence_and_the_distributions_against_float64():
    x = frk.support()
    assert len(x) == 41 and x[0] == -8 and x[-1] == 8
    log_p = frk.log_two_peaks(x)
    mu, log_sigma = torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    log_q = frk.log_gaussian(x, mu, log_sigma)
    g = [math.exp(-(xi - 0.7) ** 2 / (2 * math.exp(0.3) ** 2)) for xi in x.tolist()]
    q_ref = [v / sum(g) for v in g]
    def peak(c, s):
        w = [math.exp(-(xi - c) ** 2 / (2 * s * s)) for xi in x.tolist()]
        return [v / sum(w) for v in w]
    p_ref = [0.6 * a + 0.4 * b for a, b in zip(peak(-2.5, 0.75), peak(2.5, 0.75))]
    assert log_q.exp().tolist() == pytest.approx(q_ref, rel=1e-12, abs=1e-300)
    assert log_p.exp().tolist() == pytest.approx(p_ref, rel=1e-12, abs=1e-300)
    kl_pq = sum(a * math.log(a / b) for a, b in zip(p_ref, q_ref) if a > 0)
    kl_qp = sum(b * math.log(b / a) for a, b in zip(p_ref, q_ref) if b > 0)
    assert frk.kl_divergence(log_p, log_q).item() == pytest.approx(kl_pq, rel=1e-10)
    assert frk.kl_divergence(log_q, log_p).item() == pytest.approx(kl_qp, rel=1e-10)
    zero = torch.tensor([0.0, -math.inf]).double()              # a puts no mass on the second point
    assert frk.kl_divergence(zero,
                             torch.tensor([math.log(0.5)] * 2).double()).item() == pytest.approx(
        math.log(2))


@pytest.mark.slow
def test_forward_fit_matches_the_moments_and_covers_both_peaks():
    """q's family is exponential with statistics x and x^2, so the forward-KL optimum matches p's
    mean and variance, from any start: its mean sits between the peaks, its spread covers both."""
    x = frk.support()
    log_p = frk.log_two_peaks(x)
    p_mean, p_var = frk.moments(x, log_p)
    for mu0 in (-4.0, 4.0):
        mu, sigma, _ = frk.fit(x, log_p, "forward", mu0)
        q_mean, q_var = frk.moments(x, frk.log_gaussian(x, torch.tensor(mu).double(),
                                                        torch.tensor(math.log(sigma)).double()))
        assert q_mean.item() == pytest.approx(p_mean.item(), abs=2e-3)
        assert q_var.item() == pytest.approx(p_var.item(), rel=2e-3)
        assert -2.0 < mu < 2.0 and sigma > 2.0


@pytest.mark.slow
def test_reverse_fit_picks_the_peak_it_starts_near():
    """Each reverse-KL fit sits on one peak (mean and width of that peak), at KL about -log(the
    peak's weight)."""
    x = frk.support()
    log_p = frk.log_two_peaks(x)
    for mu0, peak, weight in ((-4.0, -2.5, 0.6), (4.0, 2.5, 0.4)):
        mu, sigma, value = frk.fit(x, log_p, "reverse", mu0)
        assert mu == pytest.approx(peak, abs=0.05) and sigma == pytest.approx(0.75, abs=0.05)
        assert value == pytest.approx(-math.log(weight), abs=0.01)
    with pytest.raises(ValueError, match="direction"):
        frk.fit(x, log_p, "sideways", 0.0)


def test_landscape_one_minimum_forward_one_per_peak_reverse():
    x = frk.support()
    log_p = frk.log_two_peaks(x)
    mus, log_sigmas = torch.linspace(-4.5, 4.5, 91).double(), torch.linspace(-2, 2, 81).double()
    minima = lambda v: [i for i in range(1, len(v) - 1) if v[i] < v[i - 1] and v[i] < v[i + 1]]
    assert len(minima(frk.landscape(x, log_p, "forward", mus, log_sigmas))) == 1
    rev = minima(frk.landscape(x, log_p, "reverse", mus, log_sigmas))
    assert any(abs(mus[i] + 2.5) < 0.2 for i in rev) and any(abs(mus[i] - 2.5) < 0.2 for i in rev)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_early_experience_refuses_a_device_or_a_checkpoint_it_cannot_use_before_any_run(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(300))
    refused(run_script("experiments/early_experience.py", ["--device", "cuda"]),
            "cuda is not available")
    absent = not os.path.exists(os.path.join(ROOT, "out", "early_experience"))
    refused(run_script("experiments/early_experience.py", ["--sft", str(junk)]), "--sft", "junk.pt")
    assert not absent or not os.path.exists(os.path.join(ROOT, "out", "early_experience"))


# -----------------------------------------------------------------------------
# experiments/multiturn_credit.py (and multiturn_history.py, which shares it)

def test_a_runs_curve_is_read_as_turns_sampled_and_compared_at_equal_turns(tmp_path):
    """read: the turns sampled by each eval step (turns a game x games a step, summed over the
    logged steps); found_at: the curve at any number of turns, interpolated linearly, its points
    exact and past its end its last value."""
    rows = [{"step": 0, "eval_found": 0.5, "eval_turns": 3.5},
            {"step": 1, "turns": 2.0, "samples": 10},
            {"step": 2, "turns": 3.0, "samples": 20, "eval_found": 0.7, "eval_turns": 3.4},
            {"step": 3, "turns": 4.0, "samples": 30},
            {"step": 4, "turns": 1.0, "samples": 40, "eval_found": 0.9, "eval_turns": 3.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = multiturn_credit.read(str(path))               # 10 games a step
    assert got["curve"] == [(0, 0.5), (50, 0.7), (100, 0.9)] and got["sampled"] == 100
    assert (got["before"], got["after"], got["turns_before"], got["turns_after"]) == \
        (0.5, 0.9, 3.5, 3.3)
    at = lambda turns: multiturn_credit.found_at(got["curve"], turns)
    assert (at(0), at(50), at(100), at(500)) == (0.5, 0.7, 0.9, 0.9)
    assert at(25) == pytest.approx(0.6, abs=1e-15) and at(75) == pytest.approx(0.8, abs=1e-15)
