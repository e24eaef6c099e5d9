"""The task layer (task.py) over every task module: one interface, the R1-Zero format, --task's
flags."""
import json
import os
import random

import pytest

import task
from conftest import ROOT, refused, run_script, run_scripts, task_args
from hf.tokenizer import Tokenizer
from plumbing import flags
from plumbing.flags import add_run_flags, parser
from tasks import arithmetic, countdown, gsm8k

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


def test_the_r1_verifier_stays_fast_on_hostile_completions():
    """400 kB of unclosed <answer> tags took the tag regex minutes (quadratic); past
    task.R1_MAX_CHARS a completion scores 0 unread, and at the limit it is still well under a
    second."""
    import time
    task.use(task_args("arithmetic", "r1"))
    prompt = task.eval_prompts()[0]
    for text in ("<answer>1" * 50_000, ("<answer>" * 5000)[:task.R1_MAX_CHARS]):
        t = time.time()
        assert task.reward(prompt, text, 0.5) == 0.0 and time.time() - t < 1.0
    task.use(task_args("arithmetic"))
