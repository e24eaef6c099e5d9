"""evaluation.py: pass@k against its float64 definition, the held-out numbers against the
completions they are made of (greedy, and avg@k / pass@k at a temperature and a nucleus), the eval
flags' refusals, and flags read from a file (@FILE)."""
import itertools
import math
import os
import random

import pytest
import torch

import evaluation
import sampler
import task
from conftest import ROOT, refuses_all, run_metrics, run_script, task_args
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig

TINY_SFT = os.path.join(ROOT, "tests", "fixtures", "tiny_sft.pt")


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16)).eval()


# -----------------------------------------------------------------------------
# pass@k

def test_pass_at_k_is_the_chance_that_k_drawn_hold_a_right_one():
    """Against 1 - C(n - c, k) / C(n, k) in exact fractions (math.comb), and by counting every
    k-subset of n samples for small n; its edges: c = 0 gives 0, n - c < k gives 1, k = 1 gives
    c / n; arguments outside 0 <= c <= n, 1 <= k <= n are refused."""
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert abs(evaluation.pass_at_k(n, c, k) - want) < 1e-12, (n, c, k)
    for n, c, k in [(5, 2, 2), (6, 3, 4), (4, 1, 1)]:
        right = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(right, k))
        assert abs(evaluation.pass_at_k(n, c, k) - sum(map(any, subsets)) / len(subsets)) < 1e-12
    rng = random.Random(0)
    for _ in range(200):                    # large n: the product form stays finite and exact
        n = rng.randint(50, 400)
        c, k = rng.randint(0, n), rng.randint(1, n)
        want = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert abs(evaluation.pass_at_k(n, c, k) - want) < 1e-9, (n, c, k)
    assert evaluation.pass_at_k(10, 0, 3) == 0.0 and evaluation.pass_at_k(10, 8, 3) == 1.0
    assert evaluation.pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match=r"allowed: 0 <= c <= n, 1 <= k <= n"):
            evaluation.pass_at_k(*bad)


# -----------------------------------------------------------------------------
# The held-out numbers: made of the completions

def test_greedy_evaluation_is_the_mean_of_the_greedy_answers():
    task.use(task_args())
    tok, prompts, model = Tokenizer(), task.eval_prompts()[:16], tiny_policy()
    out = evaluation.evaluate(model, tok, prompts, num_samples=2)
    greedy = task.complete(model, tok, prompts)
    right = [task.reward(p, c) for p, c in zip(prompts, greedy)]
    assert out["eval_accuracy"] == sum(right) / len(right)
    assert set(out) == {"eval_accuracy", "eval_pass_at_1", "eval_accuracy_precedence",
                        "eval_accuracy_other", "eval_temperature", "eval_top_p", "eval_k"}
    assert (out["eval_temperature"], out["eval_top_p"], out["eval_k"]) == (0.0, 1.0, 1)


def test_sampled_evaluation_is_avg_at_k_and_pass_at_k_of_its_samples():
    """k = 4 samples a problem at T 0.8 in the nucleus 0.9, drawn again here from the same seed:
    eval_accuracy is their mean correctness, eval_pass_at_k the mean of pass@4 over problems (with
    n = k: whether any is right); a policy that is right sometimes, so both lie strictly inside."""
    task.use(task_args())
    tok, prompts = Tokenizer(), task.eval_prompts()[:32]
    model, _ = load_checkpoint(TINY_SFT)
    out = evaluation.evaluate(model.eval(), tok, prompts, 0.8, 0.9, 4, seed=5)
    g = torch.Generator().manual_seed(5)
    texts = task.complete(model, tok, prompts, 4, 0.8, generator=g, top_p=0.9)
    right = [[task.reward(p, c) == 1.0 for c in texts[4 * i:4 * i + 4]]
             for i, p in enumerate(prompts)]
    assert out["eval_accuracy"] == sum(map(sum, right)) / (4 * len(prompts))
    assert out["eval_pass_at_k"] == sum(map(any, right)) / len(prompts)
    assert 0 < out["eval_accuracy"] < out["eval_pass_at_k"] < 1, out
    assert (out["eval_temperature"], out["eval_top_p"], out["eval_k"]) == (0.8, 0.9, 4)
def test_evaluation_samples_within_the_runs_own_budget(monkeypatch):
    """The held-out evaluation draws at most the max_new_tokens it is given (the run's
    --max_new_tokens, which was checked against the model's context), not the task's default
    (GSM8K's 512 used to overflow a small model's context halfway through a run)."""
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda m, p, pm, n, *a, **k: seen.append(n)
                        or real(m, p, pm, n, *a, **k))
    evaluation.evaluate(tiny_policy(), Tokenizer(), task.eval_prompts()[:4], num_samples=2,
                        max_new_tokens=5)
    assert seen == [5, 5]
    seen.clear()
    evaluation.evaluate(tiny_policy(), Tokenizer(), task.eval_prompts()[:4], num_samples=2)
    assert seen == [task.default_max_new_tokens()] * 2
    seen.clear()                                     # num_samples 0: the greedy pass alone
    evaluation.evaluate(tiny_policy(), Tokenizer(), task.eval_prompts()[:4], num_samples=0,
                        max_new_tokens=5)
    assert seen == [5]


def test_the_sampled_pass_at_1_runs_at_the_first_and_last_step_unless_asked(tmp_path):
    """A run's evaluations at steps 0, 1, 2, 3 and 4 (the last): the sampled pass@1 at 0 and 4
    alone, at every even step with --pass_at_1_every 2; its value at step 4 is the same either
    way (the evaluation draws from its own seed), and so is every greedy number."""
    def evals(*extra):
        out = tmp_path / f"run{len(extra)}"
        p = run_script("grpo.py", ["--init", TINY_SFT, "--out", str(out), "--steps", "4",
                                   "--eval_every", "1", "--eval_n", "16", "--prompts_per_step",
                                   "2", "--group_size", "2", *extra], env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr
        return [r for r in run_metrics(str(out), "grpo") if "eval_accuracy" in r], p.stdout
    default, printed = evals()
    every2, _ = evals("--pass_at_1_every", "2")
    assert [r["step"] for r in default] == [0, 1, 2, 3, 4]
    assert ["eval_pass_at_1" in r for r in default] == [True, False, False, False, True]
    assert ["eval_pass_at_1" in r for r in every2] == [True, False, True, False, True]
    assert default[-1]["eval_pass_at_1"] == every2[-1]["eval_pass_at_1"]
    drop = lambda r: {k: v for k, v in r.items() if k != "eval_pass_at_1"}
    assert list(map(drop, default)) == list(map(drop, every2))
    assert "sampled pass@1" in printed.splitlines()[-1]         # the summary line still has it
    refuses_all("grpo.py", [(["--pass_at_1_every", "0"], ["--pass_at_1_every", ">= 1"])],
                tmp_path)




# -----------------------------------------------------------------------------
# The flags

def test_the_eval_flags_refuse_what_greedy_decoding_or_episodes_cannot_do(tmp_path):
    refuses_all("grpo.py", [
        (["--eval_k", "4"], ["--eval_k 4", "allowed with --eval_temperature above 0"]),
        (["--eval_top_p", "0.9"], ["--eval_top_p 0.9", "greedy decoding"]),
        (["--eval_temperature", "1", "--eval_top_p", "0"], ["--eval_top_p", "> 0 and <= 1"]),
        (["--eval_temperature", "1", "--eval_top_p", "1.01"], ["--eval_top_p", "<= 1"]),
        (["--eval_temperature", "1", "--eval_k", "0"], ["--eval_k", ">= 1"]),
        (["--eval_temperature", "-0.1"], ["--eval_temperature", ">= 0"]),
        (["--task", "guess", "--eval_temperature", "1", "--eval_top_p", "0.9"],
         ["--eval_top_p 0.9", "episodes (--task guess)", "allowed: --eval_top_p 1"])], tmp_path)
    assert not any((tmp_path / f"out{i}").exists() for i in range(7))


def test_flags_come_from_a_file_and_later_ones_win(tmp_path):
    """@FILE: one or more flags a line, split as a shell splits them, # a comment; a flag after it
    wins. A file that is not there, or a flag it names that the script lacks, is one line."""
    recipe = tmp_path / "recipe.txt"
    recipe.write_text("# a tiny run\n--steps 1 --eval_n 8\n--lr 1e-6  # replaced below\n"
                      "--log_every 1 --eval_every 1\n")
    out = tmp_path / "run"
    p = run_script("grpo.py", [f"@{recipe}", "--lr", "2e-6", "--init", TINY_SFT, "--out",
                               str(out), "--prompts_per_step", "2", "--group_size", "2"])
    assert p.returncode == 0, p.stderr
    args = load_checkpoint(str(out / "grpo.pt"))[1]["args"]
    assert (args["steps"], args["eval_n"], args["lr"]) == (1, 8, 2e-6)
    (tmp_path / "bad.txt").write_text("--no_such_flag 3\n")
    refuses_all("grpo.py", [([f"@{tmp_path / 'missing.txt'}"], ["No such file", "missing.txt"]),
                            ([f"@{tmp_path / 'bad.txt'}"], ["unrecognized arguments: "
                                                            "--no_such_flag 3"])], tmp_path)
