"""The tool task (tasks/toolcalc.py): the calculator against an independent evaluation written here
and against hostile input (each refused with an "error..." string, fast, never raising); the
problems, the fixed held-out set, the demonstrations and the SFT mask over the environment's text;
the scripts that refuse the task."""
import ast
import os
import random
import re
import time

import pytest

import task
from conftest import ROOT, refused, run_scripts, task_args
from hf.tokenizer import Tokenizer
from tasks import toolcalc
from tasks.toolcalc import calculator


# -----------------------------------------------------------------------------
# The calculator

def tree(rng, depth):
    """A random fully parenthesised expression and its value, computed on the tree (never by parsing
    the text)."""
    if depth == 0 or rng.random() < 0.35:
        v = rng.randint(0, 999)
        return str(v), v
    op = rng.choice("+-*")
    (a, x), (b, y) = tree(rng, depth - 1), tree(rng, depth - 1)
    return f"({a}{op}{b})", x + y if op == "+" else x - y if op == "-" else x * y


def flat_value(text):
    """An unparenthesised a op b op c ...: the sum of its signed products (precedence by
    construction)."""
    numbers, ops = [int(n) for n in re.findall(r"[0-9]+", text)], re.findall(r"[+\-*]", text)
    total, product, sign = 0, numbers[0], 1
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            product *= n
        else:
            total, product, sign = total + sign * product, n, 1 if op == "+" else -1
    return total + sign * product


def test_calculator_hand_worked():
    cases = {"37+12*46": "589", "12*46": "552", "2+3*4-5": "9", "(2+3)*4": "20", "-(2+3)*4": "-20",
             "2*-3": "-6", "2--3": "5", "007": "7", "0": "0", "1-2-3": "-4",
             "((((((((1))))))))": "1", "999999*999999": str(999999 ** 2),
             str(10 ** 12): str(10 ** 12), f"-{10 ** 12}": str(-10 ** 12)}
    for expression, value in cases.items():
        assert calculator(expression) == value, expression


def test_calculator_matches_an_independent_evaluation_on_random_expressions():
    rng, checked = random.Random(0), 0
    while checked < 400:
        text, value = tree(rng, 3)
        if len(text) <= toolcalc.MAX_CHARS and abs(value) <= toolcalc.MAX_MAGNITUDE:
            assert calculator(text) == str(value), text
            checked += 1
    for _ in range(400):                                   # precedence: flat chains, no parentheses
        n = rng.randint(1, 6)
        text = "".join(f"{rng.randint(0, 99)}{rng.choice('+-*')}"
                       for _ in range(n)) + str(rng.randint(0, 99))
        assert calculator(text) == str(flat_value(text)), text


HOSTILE = ["", " ", "9" * 100, "9" * 13, "999999*999999*999999", "(" * 9 + "1" + ")" * 9, "(" * 30
           + "1" + ")" * 30, "(" * 40 + "1" + ")" * 40, "9**9**9", "2**10", "1/2", "7//2", "7%2",
           "abs(1)", "__import__('os').system('ls')", "exec('1')", "\uff11\uff12+\uff13",
           "\u0663+1", "\u00b2", "1e5", "0x10", "1_000", "1.5", "1 + 2", "\t1+2", "1+2\n",
           "1\u00a0+2", "\u20281", "1\r", "(1+2", "1+2)", "((1)", ")(", "()", "+", "1+", "*2",
           "--1", "1+-", "-", "1" * 64, "-" * 64, "(" * 64, "9" * 12 + "*" + "9" * 12,
           "99999999999*99999999999-1", None, 12, 1.5, b"1+2", ["1"], {"1": 2}]


@pytest.mark.parametrize("expression", HOSTILE, ids=range(len(HOSTILE)))
def test_calculator_refuses_hostile_input_fast_and_never_raises(expression):
    """Fast in CPU seconds, which load does not stretch: 3e-5 here, the bound 0.05."""
    t = time.process_time()
    result = calculator(expression)
    assert time.process_time() - t < 0.05
    assert isinstance(result, str) and result.startswith("error"), (expression, result)


def test_calculator_never_raises_on_random_strings():
    rng, alphabet = random.Random(1), "0123456789+-*()/ %.e_x\n\t-٣１"
    t = time.process_time()                   # CPU seconds: 0.06 here
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        result = calculator(text)
        assert result.startswith("error") or re.fullmatch(r"-?[0-9]+", result), (text, result)
        assert not result.startswith("error") or toolcalc.tool_reply(text) == "error"
    assert time.process_time() - t < 5.0


def test_calculator_never_evaluates_code():
    source = open(os.path.join(ROOT, "tasks", "toolcalc.py")).read()
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    assert not names & {"eval", "exec", "compile", "__import__"}
    assert task.calculator is calculator                      # the contract's name: task.calculator


# -----------------------------------------------------------------------------
# Problems, the held-out set, demonstrations

def test_held_out_set_is_fixed_balanced_and_never_drawn_for_training():
    held = toolcalc.eval_prompts()
    assert len(held) == 512 == len(set(held)) and held == toolcalc.eval_prompts()
    assert held[:4] == ["28+50*44=", "8+5*3=", "27+10*52=", "4-7-3="]  # pinned: the set never moves
    assert [toolcalc.is_hard(p) for p in held[:8]] == [True, False] * 4
    drawn = toolcalc.sample_prompts(random.Random(0), 20000)
    assert not set(drawn) & set(held)
    assert 0.45 < sum(map(toolcalc.is_hard, drawn)) / len(drawn) < 0.55
    assert all(toolcalc.is_hard(p) for p in toolcalc.sample_prompts(random.Random(0), 50, 1.0))


def test_answers_and_the_verifier():
    assert toolcalc.answer("37+12*46=") == 589 and toolcalc.answer("5-10*10=") == -95
    assert toolcalc.answer("3+4*2=") == 11
    assert toolcalc.reward("37+12*46=", "<37+12*46>589#589") == 1.0
    assert toolcalc.reward("37+12*46=", "12*46=552,37+552=589#588") == 0.0
    revise = toolcalc.revision("37+12*46=")
    assert revise == "\nrevise:37+12*46="           # the problem again, no word on the first answer
    assert toolcalc.reward("37+12*46=", "<37+12*46>589#588" + revise + "<37+12*46>589#589") == 1.0
    # the last attempt
    assert toolcalc.reward("37+12*46=", "<37+12*46>589#589" + revise + "#588") == 0.0
    assert (toolcalc.reward("not a problem", "#1") == 0.0
            and toolcalc.reward("37+12*46=", None) == 0.0)


def test_demonstrations_are_right_and_the_slip_is_the_wrong_way_to_compute():
    rng = random.Random(0)
    prompts = toolcalc.sample_prompts(rng, 400)
    two = 0
    for p in prompts:
        for mistake in (False, True):
            d = toolcalc.demonstration(p, mistake)
            assert toolcalc.reward(p, d) == 1.0, (p, d)
            last = d.split(toolcalc.revision(p))[-1]
            # tool iff hard xor slip
            assert last.startswith("<") == (toolcalc.is_hard(p) != mistake), (p, mistake, d)
            assert len(d) + 1 <= 2 * toolcalc.MAX_NEW_TOKENS + len(toolcalc.revision(p))
        d = toolcalc.demonstration(p)
        if toolcalc.REVISE in d:
            two += 1
            first, second = d.split(toolcalc.revision(p))
            # hard: in the head, wrong
            assert toolcalc.reward(p, first) == float(not toolcalc.is_hard(p)), (p, d)
            assert toolcalc.is_hard(p) == (not first.startswith("<"))
            assert toolcalc.reward(p, second) == 1.0
    assert 0.18 < two / len(prompts) < 0.32


def test_segments_mark_exactly_the_tool_replies_and_the_revision_prompt():
    d = "12*46=562,37+562=599#599" + toolcalc.revision("37+12*46=") + "<37+12*46>589#589"
    assert toolcalc.segments(d) == [("12*46=562,37+562=599#599", False),
                                    ("\nrevise:37+12*46=", True), ("<37+12*46>", False),
                                    ("589", True), ("#589", False)]
    for p in toolcalc.sample_prompts(random.Random(2), 200):
        d = toolcalc.demonstration(p, True)
        pieces = toolcalc.segments(d)
        assert "".join(t for t, _ in pieces) == d
        calls = re.findall(r"<([^>]*)>", d)
        assert [t for t, env in pieces if env
                and not t.startswith(toolcalc.REVISE)] == [calculator(c) for c in calls]
        assert ([t for t, env in pieces if env and t.startswith(toolcalc.REVISE)]
                == [toolcalc.revision(p)] * (toolcalc.REVISE in d))


def test_sft_masks_the_environments_text_out_of_its_loss():
    task.use(task_args("toolcalc"))
    tok = Tokenizer()
    completion = "12*46=562,37+562=599#599" + toolcalc.revision("37+12*46=") + "<37+12*46>589#589"
    tokens, attn, mask = task.completion_batch(["37+12*46="], [completion], tok)
    targets = tokens[0, 1:][mask[0] > 0].tolist()                 # what the loss predicts
    first = len("12*46=562,37+562=599#599")               # attempt 1 ends with the policy's own EOS
    assert (tok.decode(targets[:first]) == "12*46=562,37+562=599#599"
            and targets[first] == tok.eos_id)
    assert tok.decode(targets[first + 1:-1]) == "<37+12*46>#589" and targets[-1] == tok.eos_id
    # the environment's text stays in the context
    assert attn.sum() == len("37+12*46=") + len(completion) + 2
    task.use(task_args("arithmetic"))
    _, _, plain = task.completion_batch(["37+12*46="], [completion], tok)
    assert plain.sum() == len(completion) + 1                  # other tasks: every completion token


def test_scripts_without_the_environment_refuse_the_task(tmp_path):
    cases = [("grpo.py", ["--task", "toolcalc"], ["--task toolcalc", "agent.py"]),
             ("sft.py", ["--task", "toolcalc", "--block_size", "80"], ["--block_size"]),
             ("agent.py", ["--task", "arithmetic"], ["--task arithmetic"]),
             ("sft.py", ["--task", "toolcalc", "--format", "r1"], ["--format r1"])]
    done = run_scripts([(script, args + ["--out", str(tmp_path)]) for script, args, _ in cases])
    for p, (_, _, words) in zip(done, cases):
        refused(p, *words)
    assert not os.path.exists(os.path.join(tmp_path, "sft.pt"))


def test_episode_budget_fits_the_default_model():
    tok = Tokenizer()
    task.use(task_args("toolcalc"))
    # and the first attempt's EOS
    revision = len(tok.encode(toolcalc.REVISE)) + toolcalc.max_prompt_tokens(tok)
    longest = toolcalc.max_prompt_tokens(tok) + 2 * toolcalc.MAX_NEW_TOKENS + revision + 1
    assert toolcalc.max_prompt_tokens(tok) == 9 and longest <= toolcalc.BLOCK_SIZE


def test_sft_gives_the_tool_task_rotary_positions():
    """A second attempt's tokens sit at positions the first's never reach: --task toolcalc's SFT
    model is rotary by default (relative positions), every other task's learned unless --pos says
    otherwise."""
    import sft
    assert sft.parse_args(["--task", "toolcalc"]).pos == toolcalc.POSITIONS == "rope"
    assert sft.parse_args(["--task", "toolcalc", "--pos", "learned"]).pos == "learned"
    assert sft.parse_args([]).pos == "learned" and sft.parse_args(["--pos", "rope"]).pos == "rope"
