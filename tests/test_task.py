"""task.py: problems, solutions, the verifier, the held-out split and preference pairs."""
import random

import pytest
import torch

import task
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig
from tasks import arithmetic


def test_solutions_follow_precedence_and_left_to_right_mistakes_ignore_it():
    assert task.demonstration("3+4*2=") == "4*2=8,3+8=11#11"
    assert arithmetic.demonstration("3+4*2=", left_to_right=True) == "3+4=7,7*2=14#14"
    assert task.demonstration("2-3*4=") == "3*4=12,2-12=-10#-10"
    assert task.demonstration("9-8-7=") == "9-8=1,1-7=-6#-6"       # subtraction is left-associative
    assert task.demonstration("2*3+4=") == "2*3=6,6+4=10#10"
    assert arithmetic.demonstration("2*3+4=", left_to_right=True) == task.demonstration("2*3+4=")


def test_answers_match_python_on_every_problem():
    held, prec, other = arithmetic._split()
    for prompt in held + prec + other:
        # Python applies the same precedence rules
        assert arithmetic.answer(prompt) == eval(prompt[:-1])


def test_split_is_fixed_disjoint_and_balanced():
    held = task.eval_prompts()
    assert len(held) == len(set(held)) == 512
    assert sum(task.is_precedence(p) for p in held) == 256
    _, prec, other = arithmetic._split()
    assert not set(held) & (set(prec) | set(other))
    assert len(held) + len(prec) + len(other) == 9 ** 3 * 8
    drawn = task.sample_prompts(random.Random(0), 4000)
    assert not set(drawn) & set(held)
    share = sum(task.is_precedence(p) for p in drawn) / len(drawn)
    assert 0.45 < share < 0.55


def test_mistake_rate_sets_the_share_of_left_to_right_demonstrations():
    demos = task.sample_demonstrations(random.Random(1), 4000, mistake_rate=0.3,
                                       precedence_share=1.0)
    wrong = sum(c == arithmetic.demonstration(p, left_to_right=True) for p, c in demos) / len(demos)
    assert 0.26 < wrong < 0.34
    with pytest.raises(ValueError, match="mistake_rate = 1.5"):
        task.sample_demonstrations(random.Random(1), 1, mistake_rate=1.5)


@pytest.mark.parametrize("completion, outcome, well_formed", [
    ("4*2=8,3+8=11#11", 1.0, True),          # correct
    ("3+4=7,7*2=14#14", 0.0, True),          # wrong (left to right)
    ("4*2=8,3+8=12#11", 1.0, True),          # the outcome reward reads only the final answer
    ("4*2=8,3+8=11#11  ", 1.0, False),       # trailing whitespace is allowed after the answer ...
    ("4*2=8,3+8=11#11\r\n", 1.0, False),     # ... a Windows line end too
    # ... a newline: accepted by the reward, not by the strict format
    ("4*2=8,3+8=11#11\n", 1.0, False),
    ("4*2=8,3+8=11#11\t\n ", 1.0, False),
    ("11", 0.0, False),                      # no '#'
    ("#11", 1.0, False),                     # right answer, wrong format
    ("4*2=8,3+8=11 #  11 ", 1.0, False),     # whitespace around the answer is tolerated
    ("#11#12", 0.0, False),                  # the last '#' counts
    ("#11x", 0.0, False),                    # trailing garbage
    ("", 0.0, False),                        # empty
    ("\x00\xff#@!", 0.0, False),             # garbage
    ("#١١", 0.0, False),                     # non-ASCII digits are not an answer
    ("漢字😀" * 1000 + "#11", 1.0, False),     # very long with unicode
    ("#" + "9" * 5000, 0.0, False),          # a huge number (int() would refuse > 4300 digits)
    ("#-11", 0.0, False),
])
def test_verifier_on_hand_written_cases(completion, outcome, well_formed):
    assert task.reward("3+4*2=", completion) == outcome
    assert arithmetic.is_well_formed(completion) == well_formed
    assert task.reward("3+4*2=", completion, format_weight=0.5) == outcome + 0.5 * well_formed


def test_a_prompt_with_a_trailing_newline_is_not_a_task_prompt():
    with pytest.raises(ValueError, match="not a task prompt"):
        arithmetic.solve("3+4*2=\n")
    assert (task.reward("3+4*2=\n", "4*2=8,3+8=11#11") == 0.0
            and not arithmetic.is_parenthesised("(3+4)*2=\n"))


def test_verifier_never_raises():
    rng = random.Random()
    for _ in range(2000):
        n = rng.choice([0, 1, 5, 30, 300])
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 0x10FFFF)]))
                       for _ in range(n))
        text = text.encode("utf-8", "replace").decode("utf-8", "replace")
        r = task.reward("3+4*2=", text, format_weight=0.1)
        assert r in (0.0, 0.1, 1.0, 1.1)
    for bad in [None, 11, b"#11", ["#11"]]:
        assert task.reward("3+4*2=", bad) == 0.0
    assert task.reward("not a prompt", "#11") == 0.0


def test_synthetic_mistakes_are_always_wrong():
    for prompt in task.eval_prompts():
        assert task.reward(prompt, task.synthetic_mistake(prompt)) == 0.0
        assert arithmetic.is_well_formed(task.synthetic_mistake(prompt))


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16)).eval()


def test_evaluate_scores_what_the_policy_generates():
    tok = Tokenizer()
    prompts = task.eval_prompts()[:8]
    model = tiny_policy()
    result = task.evaluate(model, tok, prompts, num_samples=2)
    greedy = task.complete(model, tok, prompts)
    want = sum(task.reward(p, c) for p, c in zip(prompts, greedy)) / len(prompts)
    assert result["greedy_accuracy"] == want
    assert set(result) == {"greedy_accuracy", "pass_at_1", "greedy_accuracy_precedence",
                           "greedy_accuracy_other"}


def test_evaluation_samples_within_the_runs_own_budget(monkeypatch):
    """The held-out evaluation draws at most the max_new_tokens it is given (the run's
    --max_new_tokens, which was checked against the model's context), not the task's default
    (GSM8K's 512 used to overflow a small model's context halfway through a run)."""
    import sampler
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda m, p, pm, n, *a, **k: seen.append(n)
                        or real(m, p, pm, n, *a, **k))
    task.evaluate(tiny_policy(), Tokenizer(), task.eval_prompts()[:4], num_samples=2,
                  max_new_tokens=5)
    assert seen == [5, 5]
    seen.clear()
    task.evaluate(tiny_policy(), Tokenizer(), task.eval_prompts()[:4], num_samples=2)
    assert seen == [task.default_max_new_tokens()] * 2


def test_a_prompt_longer_than_the_context_is_refused_without_a_negative_budget():
    from plumbing.loading import check_fits
    with pytest.raises(SystemExit,
                       match="longest prompt of the task has 70 tokens.*block_size\\) is 64"):
        check_fits(70, 8, 64)
    with pytest.raises(SystemExit, match="allowed: --max_new_tokens <= 14"):
        check_fits(50, 20, 64)


def test_preference_pairs_chosen_correct_rejected_wrong_and_cached(tmp_path):
    tok = Tokenizer()
    prompts = task.eval_prompts()[:6]
    cache = str(tmp_path / "pairs.json")
    pairs = task.preference_pairs(prompts, tiny_policy(), tok, samples_per_prompt=2, cache=cache)
    assert [p["prompt"] for p in pairs] == prompts
    for p in pairs:
        assert task.reward(p["prompt"], p["chosen"]) == 1.0
        assert task.reward(p["prompt"], p["rejected"]) == 0.0
    # an untrained policy is never right: chosen falls back to the demonstration
    assert all(p["source"].startswith("demo/") for p in pairs)
    assert task.preference_pairs(prompts, tiny_policy(), tok, samples_per_prompt=2,
                                 cache=cache) == pairs
    with open(cache, "w") as f:
        f.write("{ truncated")
    assert task.preference_pairs(prompts, tiny_policy(), tok, samples_per_prompt=2,
                                 cache=cache) == pairs


def test_preference_cache_is_remade_for_a_different_policy(tmp_path):
    tok = Tokenizer()
    prompts = task.eval_prompts()[:4]
    cache = str(tmp_path / "pairs.json")
    task.preference_pairs(prompts, tiny_policy(0), tok, samples_per_prompt=2, cache=cache)
    meta0 = open(cache).read()
    task.preference_pairs(prompts, tiny_policy(1), tok, samples_per_prompt=2, cache=cache)
    assert open(cache).read() != meta0


def test_pair_batch_masks_exactly_the_completions_and_eos_and_keeps_the_sampled_ids():
    """A pair's ids are taken as they are (preference_pairs stores a sample as sampled, its EOS
    last, and a demonstration with its EOS): nothing is appended, so a sample that ran out of tokens
    is trained without one."""
    tok = Tokenizer()
    pairs = [{"prompt": "3+4*2=", "chosen": "4*2=8,3+8=11#11", "rejected": "3+4=7,7*2=14#14"},
             {"prompt": "1+1+1=", "chosen": "1+1=2,2+1=3#3", "rejected": "1+1=2,2+1=4#4"}]
    for p in pairs:
        p["chosen_ids"], p["rejected_ids"] = (tok.encode(p[k]) + [tok.eos_id]
                                              for k in ("chosen", "rejected"))
    tokens, attn, mask = task.pair_batch(pairs, tok, "cpu")
    assert tokens.shape[0] == 4 and mask.shape == (4, tokens.shape[1] - 1)
    targets = tokens[:, 1:]
    got = [tok.decode([t for t, k in zip(targets[i].tolist(), mask[i].tolist()) if k])
           for i in range(4)]
    assert got == [c + "<|endoftext|>" for c in ("4*2=8,3+8=11#11", "1+1=2,2+1=3#3",
                                                 "3+4=7,7*2=14#14", "1+1=2,2+1=4#4")]
    assert attn.sum(1).tolist() == [len(p["prompt"]) + len(p[k]) + 1
                                    for k in ("chosen", "rejected") for p in pairs]
    # each row ends with its EOS
    assert (tokens[torch.arange(4), attn.sum(1).long() - 1] == tok.eos_id).all()
    # a sampled side is scored as the ids that were sampled, even where decoding them and encoding
    # again differs
    odd = [0xE2, 0x82]                    # half a UTF-8 character: decodes to U+FFFD, 3 other bytes
    pairs[0]["rejected_ids"] = odd + tok.encode("#3") + [tok.eos_id]
    assert tok.encode(tok.decode(pairs[0]["rejected_ids"][:-1])) != pairs[0]["rejected_ids"][:-1]
    # ran out of tokens: no EOS, and none is added
    pairs[1]["rejected_ids"] = tok.encode("1+1=2,2+1=4#4")
    tokens, attn, mask = task.pair_batch(pairs, tok, "cpu")
    rows = [[t for t, k in zip(tokens[i, 1:].tolist(), mask[i].tolist()) if k] for i in (2, 3)]
    assert rows == [odd + tok.encode("#3") + [tok.eos_id], tok.encode("1+1=2,2+1=4#4")]


def test_concat_rollouts_pads_so_that_each_row_reads_as_it_did_alone():
    from model import completion_logits
    torch.manual_seed(0)
    model, tok = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16)).eval(), Tokenizer()
    a = task.rollout(model, tok, ["1+2*3=", "9-8-7="], 2, 1.0, max_new_tokens=5,
                     generator=torch.Generator().manual_seed(0))
    b = task.rollout(model, tok, ["1=", "22+3="], 2, 1.0, max_new_tokens=9,
                     generator=torch.Generator().manual_seed(1))
    both = task.concat_rollouts([a, b], tok.pad_id)
    assert both[0].shape[0] == 8 and both[2].size(1) == max(a[2].size(1), b[2].size(1))
    with torch.no_grad():
        stacked = completion_logits(model, *both[:4])
        for k, part in ((0, a), (4, b)):
            alone = completion_logits(model, *part[:4])
            for i in range(4):
                n = int(part[3][i].sum())
                torch.testing.assert_close(stacked[k + i, :n], alone[i, :n], rtol=0, atol=1e-5)
    assert (torch.equal(both[5], torch.cat([a[5], b[5]]))
            and torch.equal(both[4], torch.cat([a[4], b[4]])))


def test_parenthesised_problems_solve_verify_and_split():
    assert arithmetic.solve("(3+4)*2=") == (["3+4=7", "7*2=14"], 14)
    # parentheses first
    assert arithmetic.solve("(2-7)*9=", left_to_right=True) == (["2-7=-5", "-5*9=-45"], -45)
    assert arithmetic.demonstration("(9-8)*7=") == "9-8=1,1*7=7#7"
    assert (task.reward("(3+4)*2=", "3+4=7,7*2=14#14") == 1.0
            and task.reward("(3+4)*2=", "4*2=8,3+8=11#11") == 0.0)
    for bad in ("(3*4)*2=", "(3+4)+2=", "(3+4*2=", "3+(4*2)="):
        assert task.reward(bad, "#1") == 0.0              # not a task prompt: 0, never an exception
    held = arithmetic.paren_eval_prompts()
    assert len(held) == len(set(held)) == 256 and all(arithmetic.is_parenthesised(p) for p in held)
    for p in held:                                        # Python's own precedence agrees
        assert arithmetic.answer(p) == eval(p[:-1])
    drawn = arithmetic.sample_paren_prompts(random.Random(0), 3000)
    assert not set(drawn) & set(held) and len(set(drawn)) > 1000
    assert task.max_prompt_tokens(Tokenizer()) == 6
    assert arithmetic.max_prompt_tokens(Tokenizer(), parenthesised=True) == 8


@pytest.mark.parametrize("prompt, completion, relabelled", [
    # the left-to-right mistake solves the parenthesised problem
    ("3+4*2=", "3+4=7,7*2=14#14", "(3+4)*2="),
    ("2-3*4=", "2-3=-1,-1*4=-4#-4", "(2-3)*4="),
    ("3+4*2=", "4*2=8,3+8=11#11", None),    # a correct attempt is kept as it is: nothing to relabel
    ("3+4*2=", "3+4=7,7*2=15#15", None),    # a slip in the arithmetic solves no problem of ours
    ("3+4*2=", "3+4=7,7*2=14#14 ", None),   # not exactly the derivation (trailing space)
    ("3+4+2=", "3+4=7,7+2=10#10", None),    # no precedence to get wrong
    ("3+4*1=", "3+4=7,7*1=7#7", None),      # left to right, but the answer is right: not a failure
])
def test_hindsight_relabels_exactly_the_left_to_right_failures(prompt, completion, relabelled):
    assert arithmetic.hindsight_prompt(prompt, completion) == relabelled
    if relabelled is not None:
        assert task.reward(relabelled, completion) == 1.0 and task.reward(prompt, completion) == 0.0
        assert relabelled not in arithmetic.paren_eval_prompts() or prompt in task.eval_prompts()
