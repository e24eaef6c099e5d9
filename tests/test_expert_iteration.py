"""expert_iteration.py: the selection rule (verifier: the distinct accepted samples, capped; reward
model: the best of N) against hand-worked examples and a reference written here from its definition;
the fine-tuning batches; the round's counts; the reward model's scoring of prompt + completion +
EOS; the script end to end (a resumed run equal to an uninterrupted one, --restart's growing data,
--select rm's best of N) and bad input refused."""
import json
import os
import random

import pytest
import torch

import task
from conftest import refused, refuses_all, run_script
from expert_iteration import (demonstrations, hindsight_pairs, minibatches, reward_model_scores,
                              round_counts, select)
from hf.checkpoint import load_checkpoint, save_checkpoint
from hf.tokenizer import Tokenizer
from model import GPTConfig, ScalarGPT
from tasks import arithmetic


# -----------------------------------------------------------------------------
# The selection rule

def reference_select(scores, completions, cap, threshold=None):
    """The definition, written out another way: order a prompt's samples by (score descending, index
    ascending); a sample is kept iff it is a candidate (score >= threshold, or any sample without
    one), no candidate before it in that order is the same completion, and fewer than `cap` distinct
    candidates come before it."""
    kept = []
    for row, comps in zip(scores, completions):
        N = len(row)
        before = lambda j, k: row[k] > row[j] or (row[k] == row[j] and k < j)     # k comes before j
        candidate = [threshold is None or row[j] >= threshold for j in range(N)]
        first = [candidate[j] and not any(candidate[k] and before(j, k) and comps[k] == comps[j]
                                          for k in range(N)) for j in range(N)]
        kept.append([first[j] and sum(first[k] and before(j, k) for k in range(N)) < cap
                     for j in range(N)])
    return torch.tensor(kept, dtype=torch.bool)


def test_verifier_keeps_the_distinct_accepted_samples_in_the_order_sampled_up_to_the_cap():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0],     # accepted: a, c, a (a duplicate), d
                            [0.0, 0.0, 0.0, 0.0, 0.0],     # nothing accepted: nothing kept
                            # all accepted, all the same completion: one kept
                            [1.0, 1.0, 1.0, 1.0, 1.0]])
    completions = [["a", "b", "c", "a", "d"], ["a", "b", "c", "d", "e"], ["x"] * 5]
    assert select(rewards, completions, 4, threshold=1.0).tolist() == [
        [True, False, True, False, True], [False] * 5, [True, False, False, False, False]]
    assert select(rewards, completions, 2, threshold=1.0).tolist() == [  # cap: the first 2 distinct
        [True, False, True, False, False], [False] * 5, [True, False, False, False, False]]


def test_reward_model_keeps_the_best_of_n_ties_going_to_the_first_sampled():
    scores = torch.tensor([[0.5, 2.0, -1.0, 2.0],          # tie at the top: the first of the two
                           [-3.0, -2.0, -2.5, -4.0]])      # all negative: still the best one, -2.0
    completions = [["a", "b", "c", "d"], ["a", "b", "c", "d"]]
    assert select(scores, completions, 1).tolist() == [[False, True, False, False],
                                                       [False, True, False, False]]
    # top 2 distinct: the second "2.0" repeats the first's completion, so the next distinct one
    # (0.5) is taken
    assert select(scores, [["a", "b", "c", "b"], ["a", "b", "c", "d"]], 2).tolist() == [
        [True, True, False, False], [False, True, True, False]]
    # a threshold on reward-model scores keeps only those above it, best first
    assert select(scores, completions, 4, threshold=0.0).tolist() == [
        [True, True, False, True], [False] * 4]


@pytest.mark.parametrize("seed", range(5))
def test_select_matches_the_reference_on_random_rows_with_ties_and_duplicates(seed):
    rng = random.Random(seed)
    P, N = 40, rng.choice([1, 2, 3, 8])
    # many ties
    scores = torch.tensor([[float(rng.randint(-2, 2)) for _ in range(N)] for _ in range(P)])
    completions = [[tuple(rng.choice([[1, 2], [3], [1, 2, 3]])) for _ in range(N)]
                   for _ in range(P)]                                              # many duplicates
    for cap in (1, 2, 3, 10):
        for threshold in (None, 0.0, 1.0):
            got = select(scores, completions, cap, threshold)
            assert torch.equal(got, reference_select(scores.tolist(), completions, cap,
                                                     threshold)), (cap, threshold)
            for i in range(P):                                    # the properties the rule promises
                kept = [j for j in range(N) if got[i, j]]
                assert len(kept) <= cap and len({completions[i][j] for j in kept}) == len(kept)
                assert threshold is None or all(scores[i, j] >= threshold for j in kept)


def test_select_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError, match="do not match"):
        select(torch.zeros(2, 3), [["a"] * 3], 1)
    with pytest.raises(ValueError, match="do not match"):
        select(torch.zeros(2, 3), [["a"] * 3, ["a"] * 2], 1)
    with pytest.raises(ValueError, match="max_per_prompt = 0"):
        select(torch.zeros(1, 2), [["a", "b"]], 0)
    with pytest.raises(ValueError, match="finite"):
        select(torch.tensor([[0.0, float("nan")]]), [["a", "b"]], 1)


# -----------------------------------------------------------------------------
# Fine-tuning batches, the round's counts, the reward model's scores

@pytest.mark.parametrize("n,batch_size,epochs",
                         [(10, 4, 1), (10, 4, 2), (3, 8, 1), (16, 4, 3), (1, 1, 1)])
def test_minibatches_are_full_passes_over_the_data(n, batch_size, epochs):
    batches = minibatches(n, batch_size, epochs, random.Random(0))
    assert len(batches) == -(-epochs * n // batch_size)              # ceil(epochs * n / batch_size)
    assert all(len(b) == batch_size for b in batches)
    stream = [j for b in batches for j in b]
    for e in range(min(epochs, len(stream) // n)):             # each complete pass is a permutation
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    # the rng decides: a resume redraws them
    assert batches == minibatches(n, batch_size, epochs, random.Random(0))


def test_round_counts_hand_worked():
    prompts = ["3+4*2=", "3*4+2="]                                   # a precedence problem, another
    # right, left to right (wrong), right again
    texts = ["4*2=8,3+8=11#11", "3+4=7,7*2=14#14", "4*2=8,3+8=11#11",
             "3*4=12,12+2=14#14", "3*4=12,12+2=15#15", "oops"]                # right, wrong, wrong
    rewards = torch.tensor([[task.reward(prompts[i], t) for t in texts[i * 3:(i + 1) * 3]]
                            for i in range(2)])
    assert rewards.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    kept = torch.tensor([[True, True, False],
                         [False, True, False]])                  # as a bad selector might keep them
    c = round_counts(prompts, texts, rewards, kept)
    assert c == {"sampled": 6, "prompts": 2, "accepted": 3, "solved": 2, "kept": 3,
                 "kept_precedence": 2, "kept_wrong": 2, "kept_left_to_right": 1,
                 "missed_correct": 1}


def test_reward_model_scores_read_prompt_completion_eos_at_the_eos():
    torch.manual_seed(0)
    tok = Tokenizer("bytes")
    rm = ScalarGPT(GPTConfig(n_layer=1, n_head=2, n_embd=16)).eval()
    torch.nn.init.normal_(rm.head.weight)                                  # a head that is not zero
    prompts = ["3+4*2=", "9-9*9=", "1+1+1="]
    completions = [tok.encode("4*2=8,3+8=11#11") + [tok.eos_id], tok.encode("#1") + [tok.eos_id],
                   tok.encode("1+1=2,2+1=3#3")]                 # ids as sampled: the last truncated
    got = reward_model_scores(rm, tok, prompts, completions,
                              "cpu", batch_size=2)                 # two batches, padded within each
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = torch.tensor([tok.encode(p) + c])                     # one sequence alone, no padding
        assert got[i].item() == pytest.approx(rm(seq)[0, -1].item(), abs=1e-5)


# -----------------------------------------------------------------------------
# The script, end to end

TINY = ["--prompts_per_round", "8", "--samples_per_prompt", "4", "--batch_size", "8",
        "--eval_n", "8", "--lr", "1e-3"]


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "expert_iteration",
                                                           "metrics.jsonl"))]


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.slow
def test_a_resumed_run_is_the_uninterrupted_run(restart, tiny_sft, tmp_path):
    flags = TINY + ["--init", tiny_sft] + (["--restart"] if restart else [])
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    # compared bit for bit: one thread, one order of every sum, whatever the load
    one = {"OMP_NUM_THREADS": "1"}
    p = run_script("expert_iteration.py", flags + ["--rounds", "3", "--out", whole], env=one,
                   fresh=not restart)                     # once from the command line
    assert p.returncode == 0, p.stderr
    assert ("held-out greedy accuracy" in p.stdout and "->" in p.stdout
            and "done: 3 steps" in p.stdout)
    assert run_script("expert_iteration.py", flags + ["--rounds", "2", "--out", parts],
                      env=one).returncode == 0
    p = run_script("expert_iteration.py", flags + ["--rounds", "3", "--out", parts, "--resume"],
                   env=one)
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    a = load_checkpoint(os.path.join(whole, "expert_iteration.pt"))[1]
    b = load_checkpoint(os.path.join(parts, "expert_iteration.pt"))[1]
    assert a["step"] == b["step"] == 3 and a["samples"] == b["samples"] == 3 * 8 * 4
    assert a["kept_so_far"] == b["kept_so_far"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k                  # bit-exact on CPU
    # times aside, and the sampled pass@1 that the cut run reports at its own last step
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("elapsed_s", "eval_pass_at_1")}
                          for r in rows]
    rows = read_metrics(whole)
    assert strip(rows) == strip(read_metrics(parts))
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all("eval_accuracy" in r for r in rows)
    assert all(0 <= r["sampler_logp_diff"] < 1e-4 for r in rows[1:])    # every sampled token
    kept = [r["kept_per_prompt"] * 8 for r in rows[1:]]
    for r in rows[1:]:
        assert (0 <= r["kept_fraction"] <= r["reward_mean"] <= 1 and r["kept_wrong"] == 0
                and r["missed_correct"] == 0)
        assert r["ft_steps"] == -(-2 * r["data_size"] // 8)            # ceil(epochs * data / batch)
    if restart:                                                # everything kept so far, every round
        assert [r["data_size"] for r in rows[1:]] == [round(sum(kept[:i + 1])) for i in range(3)]
        assert len(a["kept_so_far"]) == round(sum(kept))
    else:                                                      # the round's own data only
        assert ([r["data_size"] for r in rows[1:]] == [round(k) for k in kept]
                and a["kept_so_far"] == [])


def test_reward_model_selection_keeps_one_per_prompt_and_counts_its_wrong_picks(tiny_sft, tmp_path):
    policy, ckpt = load_checkpoint(tiny_sft)
    rm = ScalarGPT.from_policy(policy)
    torch.manual_seed(0)
    torch.nn.init.normal_(rm.head.weight)                # an untrained reward model: it picks blind
    rm_path = str(tmp_path / "rm.pt")
    save_checkpoint(rm_path, rm, ckpt["tokenizer"], script="reward_model")
    out = str(tmp_path / "run")
    p = run_script("expert_iteration.py", TINY + [
        "--rounds", "2", "--select", "rm", "--rm", rm_path, "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    assert "best-of-N" in p.stdout
    for r in read_metrics(out)[1:]:
        # the best of N = 4, for every prompt
        assert r["kept_per_prompt"] == 1.0 and r["kept_fraction"] == 0.25
        assert 0 <= r["kept_wrong"] <= 1 and r["missed_correct"] <= r["solved"]
    # a blind pick on a weak policy is often wrong
    assert any(r["kept_wrong"] > 0 for r in read_metrics(out)[1:])


def test_hindsight_keeps_exactly_the_left_to_right_failures_for_the_parenthesised_problem():
    tok = Tokenizer("bytes")
    prompts = ["3+4*2=", "9-2*3="]
    texts = ["3+4=7,7*2=14#14",   # left to right: wrong for 3+4*2= (11), exactly right for (3+4)*2=
             "4*2=8,3+8=11#11",      # right: nothing to relabel
             "3+4=7,7*2=15#15",      # wrong, and wrong for (3+4)*2= too: no problem it solved
             "3+4=7,7*2=14#14",      # the same failure again: kept once
             "9-2=7,7*3=21#21",      # left to right on a-b*c: solves (9-2)*3=
             # trailing space: the verifier accepts it, the exact derivation does not match
             "9-2=7,7*3=21#21 "]
    ids = [tok.encode(t) for t in texts]
    got = hindsight_pairs(prompts, texts, ids, 3)
    assert got == [("(3+4)*2=", tuple(ids[0])), ("(9-2)*3=", tuple(ids[4]))]
    for goal, c in got:                            # each relabelled pair is a correct demonstration
        assert task.reward(goal, tok.decode(list(c))) == 1.0 and arithmetic.is_parenthesised(goal)


def test_demonstrations_are_correct_derivations_of_training_prompts():
    tok = Tokenizer("bytes")
    held = set(task.eval_prompts())
    pairs = demonstrations(random.Random(0), 50, 0.5, tok)
    assert len(pairs) == 50
    for p, c in pairs:
        text = tok.decode(list(c)[:-1])
        assert (c[-1] == tok.eos_id and p not in held and text == task.demonstration(p)
                and task.reward(p, text) == 1.0)


def test_hindsight_and_demos_in_the_round_data(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("expert_iteration.py", TINY + [
        "--rounds", "2", "--hindsight", "--demos", "0.5", "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    for r in read_metrics(out)[1:]:
        own = round(r["kept_per_prompt"] * 8)
        assert r["data_size"] == own + r["relabelled"] + r["demos"]
        assert r["demos"] == own + r["relabelled"]           # --demos 0.5: half of the round's data
    refused(run_script("expert_iteration.py", ["--demos", "1", "--out", out]), "--demos", "1")


def test_script_rejects_bad_settings_with_a_message(tiny_sft, tmp_path):
    cases = [([flag, value], [flag, value])
             for flag, value in (("--samples_per_prompt", "0"), ("--max_per_prompt", "0"),
                                 ("--rounds", "0"), ("--temperature", "0"), ("--epochs", "0"))]
    cases += [(["--select", "best"], ["--select", "'best'"]),
              (["--select", "rm", "--rm", str(tmp_path / "missing.pt"), "--init", tiny_sft],
               ["no checkpoint at", "missing.pt"])]
    refuses_all("expert_iteration.py", cases, tmp_path)


def test_the_parked_reward_model_is_away_but_in_selection_and_moves_no_number(tiny_sft, tmp_path,
                                                                              monkeypatch):
    """--select rm with the reward model parked as on a GPU (tests/test_plumbing.py's check): on the
    device for step 2's scores alone, away while the sampler and the fine-tuning run; metrics.jsonl
    is the unparked run's."""
    import expert_iteration
    from conftest import parked_runs
    policy, ckpt = load_checkpoint(tiny_sft)
    rm = ScalarGPT.from_policy(policy)
    torch.nn.init.normal_(rm.head.weight)
    save_checkpoint(str(tmp_path / "rm.pt"), rm, ckpt["tokenizer"], script="reward_model")
    argv = TINY + ["--rounds", "2", "--select", "rm", "--rm", str(tmp_path / "rm.pt"),
                   "--init", tiny_sft, "--device", "cpu"]
    assert parked_runs(expert_iteration, argv, tmp_path, monkeypatch) == [2]   # a batch a round
