"""task.py and the task modules: problems, solutions, the verifier, the held-out split and
preference pairs; one interface over every task (the R1-Zero format, --task's flags); and
arithmetic.step_labels, the exact step labels of prm.py's process reward model, on hand-written
completions."""
import json
import os
import random

import pytest
import torch

import task
from conftest import ROOT, Counted, refused, run_script, run_scripts, task_args
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig
from plumbing import flags
from plumbing.flags import add_run_flags, parser
from tasks import arithmetic, countdown, gsm8k


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


def test_held_out_pairs_are_sampled_for_the_evaluated_prompts_alone(tmp_path):
    """--eval_n n: pairs on the first n held-out prompts, in a cache of their own; every prompt
    (None or 512): the shared pairs_eval.json."""
    tok, all_prompts = Tokenizer(), task.eval_prompts()
    few = task.held_out_pairs(tiny_policy(), tok, seed=0, cache_dir=str(tmp_path), n=3)
    assert [p["prompt"] for p in few] == all_prompts[:3]
    assert sorted(os.listdir(tmp_path)) == ["pairs_eval_3.json"]
    every = task.held_out_pairs(None, tok, seed=0, cache_dir=str(tmp_path), n=len(all_prompts))
    assert [p["prompt"] for p in every] == all_prompts
    assert sorted(os.listdir(tmp_path)) == ["pairs_eval.json", "pairs_eval_3.json"]
    assert task.held_out_pairs(None, tok, seed=0, cache_dir=str(tmp_path)) == every


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


# -----------------------------------------------------------------------------
# Every task through one interface

# DeepSeek-R1's Table 1, typed here from the paper (not from task.py), with the question in place of
# "prompt"
PAPER_R1 = ("A conversation between User and Assistant. The user asks a question, and the "
            "Assistant solves it. The assistant first thinks about the reasoning process in the "
            "mind and then provides the user with the answer. The reasoning process and answer "
            "are enclosed within <think> </think> and <answer> </answer> tags, respectively, "
            "i.e., <think> reasoning process here </think> <answer> answer here </answer>. User: "
            "{}. Assistant:")


def gsm8k_file(path, n, start=0):
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({
                "question": f"Ann has {i} pens and gets {i + 2} more. How many pens now?",
                "answer": f"She has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} pens.\n"
                          f"#### {2 * i + 2:,}"}) + "\n")
    return str(path)


def every_task(tmp_path):
    data = gsm8k_file(tmp_path / "g.jsonl", 40)
    return [task_args("arithmetic"), task_args("countdown"), task_args("countdown", numbers=4),
            task_args("gsm8k", data=[data])]


@pytest.mark.parametrize("fmt", ["plain", "r1"])
@pytest.mark.slow
def test_every_task_keeps_the_shared_interface(tmp_path, fmt):
    tok = Tokenizer()
    for args in every_task(tmp_path):
        args.format = fmt
        task.use(args)
        held = task.eval_prompts()
        assert held == task.eval_prompts() and len(set(held)) == len(held) > 0  # fixed, distinct
        drawn = task.sample_prompts(random.Random(0), 200)
        assert not set(drawn) & set(held), args.task                          # never a held-out one
        for p in held[:40] + drawn[:40]:
            good, bad = task.demonstration(p), task.synthetic_mistake(p)
            assert (task.reward(p, good) == 1.0
                    and task.reward(p, good, format_weight=0.5) == 1.5), (p, good)
            assert task.reward(p, bad) == 0.0, (p, bad)
            assert len(tok.encode(p)) <= task.max_prompt_tokens(tok)
            # + EOS fits the budget
            assert len(tok.encode(good)) + 1 <= task.default_max_new_tokens()
            if fmt == "r1":
                assert p == PAPER_R1.format(task._problem(p))


def test_the_r1_format_rewards_the_last_answer_tag_and_one_strict_format():
    task.use(task_args("arithmetic", "r1"))
    p = PAPER_R1.format("3+4*2=")
    assert task.eval_prompts()[0] == PAPER_R1.format(arithmetic.eval_prompts()[0])
    assert task.demonstration(p) == " <think>4*2=8,3+8=11</think> <answer>11</answer>"
    cases = {" <think>4*2=8,3+8=11</think> <answer>11</answer>": 1.5,
             # whitespace between and around is fine
             "<think>x</think>\n<answer> 11 </answer>\n": 1.5,
             "<answer>11</answer>": 1.0,                                 # right, but no think block
             # the last tag is read; two: no bonus
             "<think>a</think><answer>14</answer><answer>11</answer>": 1.0,
             # text after the answer: not the format
             "<think>a</think><answer>11</answer> and so on": 1.0,
             # nested tags: not the format
             "<think><think>a</think></think><answer>11</answer>": 1.0,
             "<think>a</think><answer>14</answer>": 0.5,                # the format, a wrong answer
             "<think>11</think>": 0.0, "4*2=8,3+8=11#11": 0.0, "": 0.0, None: 0.0, 11: 0.0}
    for completion, want in cases.items():
        assert task.reward(p, completion, format_weight=0.5) == want, completion
    # not the template's prompt
    assert task.reward("3+4*2=", " <think>a</think> <answer>11</answer>") == 0.0


def test_the_default_task_is_the_arithmetic_module_draw_for_draw():
    assert (task.name() == "arithmetic"
            and task.default_max_new_tokens() == arithmetic.MAX_NEW_TOKENS)
    assert task.eval_prompts() == arithmetic.eval_prompts()
    assert (task.sample_prompts(random.Random(3), 500)
            == arithmetic.sample_prompts(random.Random(3), 500, 0.5))
    rng = random.Random(4)
    want = [(p, arithmetic.demonstration(p, left_to_right=rng.random() < 0.6))
            for p in arithmetic.sample_prompts(rng, 300, 0.5)]
    assert task.sample_demonstrations(random.Random(4), 300, 0.6) == want


def test_countdown_draws_the_share_of_parenthesised_answers_it_is_asked_for():
    task.use(task_args("countdown"))
    for share in (0.0, 1.0):
        drawn = task.sample_prompts(random.Random(0), 100, precedence_share=share)
        assert all(countdown.needs_parentheses(p) == bool(share) for p in drawn)
    natural = task.sample_prompts(random.Random(0), 600)
    assert 0.2 < sum(map(countdown.needs_parentheses, natural)) / 600 < 0.5


def test_gsm8k_splits_and_demonstrates_its_file(tmp_path):
    one = gsm8k_file(tmp_path / "one.jsonl", 40)
    task.use(task_args("gsm8k", data=[one]))
    held = task.eval_prompts()
    # the last tenth is held out
    assert len(held) == 4 and held[-1].startswith("Question: Ann has 39 pens")
    p = held[0]
    assert task.demonstration(p) == " She has 36 + 38 = 74 pens. #### 74"          # <<...>> removed
    assert task.reward(p, "so #### 74.0 in all") == 1.0 and task.reward(p, "#### 1,000") == 0.0
    assert task.reward(p, "so 74 in all") == 0.0                       # no marks: GSM8K's [invalid]
    test = gsm8k_file(tmp_path / "test.jsonl", 5, start=100)
    task.use(task_args("gsm8k", data=[one, test]))
    assert (len(task.eval_prompts()) == 5
            and len(set(task.sample_prompts(random.Random(0), 400))) == 40)
    with pytest.raises(ValueError, match="at least 10"):
        gsm8k.task([gsm8k_file(tmp_path / "few.jsonl", 5)])


def parse(*argv):
    p = parser("x")
    g = add_run_flags(p, "x", log_every=1, eval_every=1)
    g.add_argument("--init", default="out/sft.pt")
    g.add_argument("--rm", default="out/rm.pt")
    g.add_argument("--max_new_tokens", type=int, default=None)
    return p.parse_args(list(argv))


def test_task_flags_move_the_default_paths_and_budget_and_refuse_what_does_not_fit(tmp_path,
                                                                                   capsys):
    a = parse()
    assert (a.out, a.init, a.rm, a.max_new_tokens) == ("out", "out/sft.pt", "out/rm.pt", 24)
    a = parse("--task", "countdown", "--countdown_numbers", "4", "--format", "r1")
    assert (a.out, a.init, a.rm) == ("out/countdown4_r1", "out/countdown4_r1/sft.pt",
                                     "out/countdown4_r1/rm.pt")
    assert a.max_new_tokens == 40 + len(" <think></think> <answer></answer>")
    a = parse("--task", "countdown", "--init", "mine.pt", "--max_new_tokens", "9", "--out", "o")
    assert (a.out, a.init, a.rm, a.max_new_tokens) == ("o", "mine.pt", "out/countdown/rm.pt", 9)
    assert flags.task_flags(a) == ["--task", "countdown", "--format", "plain",
                                   "--countdown_numbers", "3", "--countdown_rule", "exactly"]
    # the easier rule keeps its own files
    a = parse("--task", "countdown", "--countdown_rule", "at_most")
    assert (a.out, a.init) == ("out/countdown_atmost", "out/countdown_atmost/sft.pt")
    for argv, words in ((["--task", "gsm8k"], "--data"), (["--data", "x.jsonl"], "--task gsm8k"),
                        (["--task", "gsm8k", "--data", "a", "b", "c"], "one or two")):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert words in capsys.readouterr().err


def test_a_data_rows_question_and_answer_are_bounded_at_their_limit_and_one_past(tmp_path):
    n, path = gsm8k.MAX_ROW_CHARS, tmp_path / "rows.jsonl"
    for key in ("question", "answer"):
        row = {"question": "q", "answer": "#### 1"}
        row[key] = " " * (n - len(row[key])) + row[key]
        path.write_text(json.dumps(row) + "\n")
        assert len(gsm8k.load(str(path))[0]) == 1
        row[key] = " " + row[key]
        path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps(row))
        with pytest.raises(ValueError, match=f"rows.jsonl, line 2: a {key} of {n + 1:,} "
                                             f"characters .at most {n:,}."):
            gsm8k.load(str(path))


def test_scripts_refuse_bad_task_input_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    spaces = tmp_path / "spaces.jsonl"                # tiktoken's regex panicked on this row
    spaces.write_text("".join(json.dumps({"question": "a" + " " * 1_200_000 * (i == 10) + "b",
                                          "answer": f"#### {i}"}) + "\n" for i in range(20)))
    gpt2 = ["--task", "gsm8k", "--data", str(spaces), "--init", os.path.join(ROOT, "tests",
                                                                             "golden", "gpt2")]
    cases = [("grpo.py", ["--task", "gsm8k", "--data", str(bad)], ["line 2"]),
             *[(script, gpt2, ["spaces.jsonl, line 11: a question of 1,200,002 characters"])
               for script in ("grpo.py", "sft.py", "self_distill.py")],
             ("grpo.py", ["--task", "gsm8k", "--data", str(tmp_path / "none.jsonl")],
              ["none.jsonl"]), ("grpo.py", ["--task", "chess"], ["chess"]),
             ("prm.py", ["--task", "countdown"], ["arithmetic"]),
             ("sft.py", ["--task", "countdown", "--format", "r1"], ["--block_size"])]
    done = run_scripts([(script, args + ["--out", str(tmp_path / f"out{i}")])
                        for i, (script, args, _) in enumerate(cases)])
    for p, (_, _, words) in zip(done, cases):
        refused(p, *words)


def test_grpo_trains_on_countdown_from_a_countdown_sft_policy(tmp_path):
    out = str(tmp_path)
    p = run_script("sft.py", ["--task", "countdown", "--steps", "40", "--batch_size", "16",
                              "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--eval_n", "16",
                              "--out", out])
    assert p.returncode == 0, p.stderr
    p = run_script("grpo.py", ["--task", "countdown", "--steps", "2", "--prompts_per_step", "4",
                               "--group_size", "4", "--eval_n", "16", "--init", f"{out}/sft.pt",
                               "--out", out])
    assert p.returncode == 0, p.stderr
    assert ("task countdown (plain format), 512 held-out problems" in p.stdout
            and "held-out greedy accuracy" in p.stdout)
    rows = [json.loads(line) for line in open(f"{out}/grpo/metrics.jsonl")]
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 2 and "eval_accuracy" in rows[-1]


def test_the_r1_verifier_stays_fast_on_hostile_completions(monkeypatch):
    """400 kB of unclosed <answer> tags took the tag regex minutes (quadratic); past
    task.R1_MAX_CHARS a completion scores 0 with no regex run, and at the limit the two tag regexes
    scan it once each: the work counted, not timed."""
    scanned = []
    task.use(task_args("arithmetic", "r1"))
    prompt = task.eval_prompts()[0]
    for name in ("_R1_ANSWER", "_R1_COMPLETION"):
        monkeypatch.setattr(task, name, Counted(scanned, getattr(task, name)))
    for text in ("<answer>1" * 50_000, "<" * (task.R1_MAX_CHARS + 1)):
        assert task.reward(prompt, text, 0.5) == 0.0 and scanned == []
    text = ("<answer>" * 5000)[:task.R1_MAX_CHARS]
    assert len(text) == task.R1_MAX_CHARS and task.reward(prompt, text, 0.5) == 0.0
    assert scanned == [task.R1_MAX_CHARS] * 2, scanned
    assert task.R1_MAX_CHARS <= 20_000              # the tag regexes' quadratic worst case
    task.use(task_args("arithmetic"))


# -----------------------------------------------------------------------------
# arithmetic.step_labels: a step is good when the steps up to it start the correct
# derivation, precedence respected and arithmetic right; the last also needs the right answer

CASES = [
    # prompt, completion, labels
    ("3+4*2=", "4*2=8,3+8=11#11", [1, 1]),           # the correct derivation
    ("3+4*2=", "3+4=7,7*2=14#14", [0, 0]),           # left to right: precedence broken at step 1
    ("9+8*1=", "9+8=17,17*1=17#17", [0, 0]),         # a+b*1: wrong order, right answer, still bad
    ("9-8*1=", "9-8=1,1*1=1#1", [0, 0]),             # the same with a minus
    ("9+8*1=", "8*1=8,9+8=17#17", [1, 1]),
    ("3+4*2=", "4*2=9,3+9=12#12", [0, 0]),           # an arithmetic slip at step 1 poisons the rest
    ("3+4*2=", "4*2=8,3+8=12#12", [1, 0]),           # ... at step 2
    ("3+4*2=", "4*2=8,3+8=11#12", [1, 0]),           # right steps, wrong answer after '#'
    ("3+4*2=", "4*2=8,3+8=11", [1, 0]),              # no answer: the last step is not finished
    ("3+4*2=", "4*2=8,3+8=11#11\r\n", [1, 1]),       # trailing whitespace, as the verifier allows
    ("3+4*2=", "4*2=8\n,3+8=11#11", [0, 0]),      # ... but not inside a step: '8\n' is not a result
    ("3+4*2=", "4*2=8#8,3+8=11#11", [0, 0]),                 # '#' before the last step
    ("3+4*2=", "4*2=8,3+8=11#11,1+1=2", [1, 1, 0]),          # a step after the answer
    ("3+4*2=", "2*4=8,3+8=11#11", [0, 0]),         # operands in another order than the derivation's
    ("3+4*2=", "4*2=8,8+3=11#11", [1, 0]),
    ("2*3+4=", "2*3=6,6+4=10#10", [1, 1]),        # the * comes first anyway: left to right is right
    ("9-8-7=", "9-8=1,1-7=-6#-6", [1, 1]),                   # negative numbers
    ("9-8-7=", "8-7=1,9-1=8#8", [0, 0]),                     # subtraction is left-associative
    ("1-9*9=", "9*9=81,1-81=-80#-80", [1, 1]),
    ("1-9*9=", "9*9=81,1--81=82#82", [1, 0]),
    ("(3+4)*2=", "3+4=7,7*2=14#14", [1, 1]),         # parenthesised problems: the parentheses first
    ("(3+4)*2=", "4*2=8,3+8=11#11", [0, 0]),
    ("3+4*2=", "", [0]),                                     # one empty step
    ("3+4*2=", "#11", [0]),
    ("3+4*2=", "4*2=8,", [1, 0]),               # a prefix cut at a ',' : the empty last step is bad
    ("3+4*2=", "4 *2=8,3+8=11#11", [0, 0]),                  # no spaces inside a step
]


@pytest.mark.parametrize("prompt,completion,labels", CASES)
def test_hand_written_step_labels(prompt, completion, labels):
    assert arithmetic.step_labels(prompt, completion) == labels
    assert len(labels) == len(arithmetic.split_steps(completion)) == completion.count(",") + 1


def test_one_label_per_step_and_the_split():
    assert arithmetic.split_steps("4*2=8,3+8=11#11") == ["4*2=8", "3+8=11#11"]
    assert arithmetic.split_steps("") == [""]


def test_every_demonstration_is_all_good_and_every_changed_answer_is_bad():
    """On every problem of the task: the correct demonstration is [1, 1]; the left-to-right one is
    [1, 1] exactly where its steps are the correct ones (no precedence problem), else [0, 0]
    whatever its answer; the correct steps with a wrong answer end in 0; and every all-good
    completion is one the verifier accepts."""
    for prompt in arithmetic.all_prompts():
        good = task.demonstration(prompt)
        assert arithmetic.step_labels(prompt, good) == [1, 1]
        assert task.reward(prompt, good) == 1.0
        ltr = arithmetic.demonstration(prompt, left_to_right=True)
        assert arithmetic.step_labels(prompt,
                                      ltr) == ([0, 0] if task.is_precedence(prompt) else [1, 1])
        wrong = good.rsplit("#", 1)[0] + f"#{arithmetic.answer(prompt) + 1}"
        assert arithmetic.step_labels(prompt, wrong) == [1, 0]


def test_never_raises():
    assert arithmetic.step_labels("not a prompt", "4*2=8,3+8=11#11") == [0, 0]
    assert arithmetic.step_labels("3+4*2=", None) == []
    assert arithmetic.step_labels(None, "1+1=2#2") == [0]
    assert arithmetic.step_labels("3+4*2=", "4*2=8,3+8=99999999999999#1") == [1, 0]
