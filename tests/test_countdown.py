"""tasks/countdown.py: the verifier against a reference evaluator written here (expression trees
evaluated with Fractions), hand-worked cases and hostile expressions; the solver's demonstrations
checked step by step; the generator's held-out split; the demonstrator's mistake."""
import random
import time
from fractions import Fraction

import pytest

import task
from conftest import task_args
from tasks import countdown as cd


# -----------------------------------------------------------------------------
# The verifier

@pytest.mark.parametrize("numbers, target, expression, want", [
    ((3, 5, 7), 22, "5*3+7", True),
    ((3, 5, 7), 22, "(5*3)+7", True),
    ((3, 5, 7), 22, " 5 * 3 + 7 ", True),    # spaces between tokens
    ((3, 5, 7), 15, "5*3", False),           # 7 unused: each number exactly once (the field's rule)
    ((3, 5, 7), 22, "5*3+7+7", False),       # 7 used twice
    ((3, 5, 7), 26, "7*3+5", True),
    ((3, 5, 7), 22, "7*3+5", False),         # 26, not 22
    ((2, 2, 9), 20, "2+2*9", True),          # a repeated number, once per copy
    ((2, 2, 6), 6, "6", False),              # copying a given number: a strict subset
    ((2, 2, 9), 22, "2*9+2+2", False),       # three 2s from two
    ((7, 2, 2), 7, "7/2*2", True),           # exact rationals: 7/2 * 2 = 7
    ((1, 3, 3), 1, "1/3*3", True),
    ((6, 4), 1, "6/4", False),               # 3/2, not 1
    ((6, 4), 3, "6/4*2", False),             # 2 is not given
    ((6, 4), Fraction(3, 2), "6/4", True),
    ((7, 2, 2), 7, "7/(2-2)", False),        # division by zero is wrong, never an error
    ((5, 3, 53), 53, "5 3", False),          # a space never joins digits
    ((5, 3), 8, "5+3", True),
    ((5, 3), 8, "-5+13", False),             # no unary minus (13 is not given either)
    ((5, 3), 2, "5-3", True),
    ((5, 3), -2, "3-5", True),
])
def test_score_countdown_hand_worked(numbers, target, expression, want):
    assert cd.score_countdown(numbers, target, expression) is want


@pytest.mark.parametrize("numbers, target, expression, exactly, at_most", [
    ((3, 5, 7), 15, "5*3", False, True),             # a strict subset
    ((2, 2, 6), 6, "6", False, True),                # copying a given number
    ((3, 5, 7), 22, "5*3+7", True, True),            # every number
    ((3, 5, 7), 22, "5*3+7+7", False, False),        # one used twice: wrong under both
])
def test_the_at_most_rule_allows_unused_numbers_the_default_does_not(numbers, target, expression,
                                                                     exactly, at_most):
    assert cd.score_countdown(numbers, target, expression) is exactly
    assert cd.score_countdown(numbers, target, expression, "at_most") is at_most
    prompt = cd.make_prompt(numbers, target)
    assert cd.task(rule="at_most").reward(prompt, f"x#{expression}") == float(at_most)
    assert cd.task().reward(prompt, f"x#{expression}") == float(exactly)


@pytest.mark.parametrize("expression", [
    "", " ", None, 22, b"5*3+7", "5**3", "9**9**9", "__import__('os').system('true')", "5+", "(5",
    "5)", "5*(3+7", "5*3+7\n", "1e9", "5.0", "٥+٣", "５*３", "999999999*999999999",
    "(" * 5000 + "5" + ")" * 5000, "5" * 10000,
    "5*3+7 # 22", "5//3", "5 % 3", "abs(5)", "5*3+7=22", "[5]",
])
def test_hostile_expressions_are_false_fast_and_never_raise(expression):
    """Fast in CPU seconds (load does not stretch them): 3e-5 here, the bound 0.1 (9**9**9
    evaluated would take hours)."""
    start = time.process_time()
    assert cd.score_countdown((3, 5, 7), 22, expression) is False
    assert time.process_time() - start < 0.1


def random_tree(rng, numbers):
    """A random expression tree over a random subset of `numbers` (each used at most once)."""
    leaves = rng.sample(numbers, rng.randint(1, len(numbers)))
    nodes = list(leaves)
    while len(nodes) > 1:
        a, b = nodes.pop(rng.randrange(len(nodes))), nodes.pop(rng.randrange(len(nodes)))
        nodes.append((rng.choice("+-*/"), a, b))
    return nodes[0], leaves


def ref_value(tree):
    """Reference evaluation with Fractions; None for a division by zero anywhere."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, a, b = tree
    x, y = ref_value(a), ref_value(b)
    if x is None or y is None or (op == "/" and y == 0):
        return None
    return {"+": x + y, "-": x - y, "*": x * y, "/": x / y if op == "/" and y else None}[op]


def fully_parenthesised(tree):
    return (str(tree) if isinstance(tree, int)
            else f"({fully_parenthesised(tree[1])}{tree[0]}{fully_parenthesised(tree[2])})")


def test_score_countdown_agrees_with_a_reference_on_random_expressions():
    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        numbers = [rng.randint(1, 12) for _ in range(rng.randint(2, 4))]
        tree, leaves = random_tree(rng, numbers)
        value = ref_value(tree)
        text = fully_parenthesised(tree)
        if value is None:
            assert cd.score_countdown(numbers, 0, text) is False
            continue
        every = sorted(leaves) == sorted(numbers)     # the default rule: each number exactly once
        assert cd.score_countdown(numbers, value, text) is every, (numbers, text, value)
        assert cd.score_countdown(numbers, value, text, "at_most") is True, (numbers, text, value)
        assert cd.score_countdown(numbers, value + 1, text, "at_most") is False
        x = leaves[0]                                 # one copy fewer of x than the expression uses
        fewer = [n for n in numbers if n != x] + [x] * (leaves.count(x) - 1)
        assert cd.score_countdown(fewer, value, text, "at_most") is False
        checked += 1
    assert checked > 2000


def test_minimal_parentheses_keep_the_value():
    """The solver writes its answers with only the parentheses precedence needs: the value must be
    the tree's."""
    rng = random.Random(1)
    for _ in range(2000):
        numbers = [rng.randint(1, 9) for _ in range(rng.randint(2, 4))]
        tree, _ = random_tree(rng, numbers)
        value = ref_value(tree)
        if value is not None:
            assert cd.evaluate_expression(cd._expression(tree))[0] == value, (tree,
                                                                              cd._expression(tree))


# -----------------------------------------------------------------------------
# The solver, the demonstrations and the split

def check_steps(prompt, completion):
    """Every step is one true integer operation on numbers available at that point (the given
    numbers, each once, and earlier results), the last step reaches the target, and the answer after
    '#' scores."""
    numbers, target = cd.parse_prompt(prompt)
    steps, answer = completion.rsplit("#", 1)
    pool = list(numbers)
    for step in steps.split(","):
        lhs, result = step.split("=")
        op = next(c for c in "+-*/" if c in lhs[1:])
        x, y = lhs.split(op, 1)
        x, y, result = int(x), int(y), int(result)
        assert x in pool, (prompt, completion)
        pool.remove(x)
        assert y in pool, (prompt, completion)
        pool.remove(y)
        assert (x + y if op == "+" else x
                - y if op == "-" else x * y if op == "*" else Fraction(x, y)) == result
        pool.append(result)
    assert pool == [target] and cd.score_countdown(numbers, target, answer)


@pytest.mark.parametrize("n_numbers", [3, 4])
@pytest.mark.slow
def test_every_held_out_problem_has_a_solver_demonstration_that_checks(n_numbers):
    prompts = cd.held_out(n_numbers)
    assert len(prompts) == len(set(prompts)) == cd.HELD_OUT
    for p in prompts[:200]:
        check_steps(p, cd.demonstration(p))
        assert cd.reward(p, cd.demonstration(p)) == 1.0 and cd.is_well_formed(cd.demonstration(p))


def test_held_out_is_fixed_and_never_drawn_for_training():
    assert cd.held_out() == cd.held_out.__wrapped__()   # the same problems, recomputed from scratch
    drawn = cd.sample_prompts(random.Random(0), 3000)
    assert not set(drawn) & set(cd.held_out())
    assert len(set(drawn)) > 1000                       # a large pool, not a handful of problems


def test_the_mistake_drops_parentheses_and_shows_only_where_they_matter():
    for p in cd.held_out()[:300]:
        wrong = cd.demonstration(p, mistake=True)
        assert "(" not in wrong.rsplit("#", 1)[1]
        assert wrong.rsplit("#", 1)[0] == cd.demonstration(p).rsplit("#", 1)[0]     # the same steps
        if not cd.needs_parentheses(p):
            assert wrong == cd.demonstration(p)
    mistakes = [p for p in cd.held_out() if cd.needs_parentheses(p)
                and cd.reward(p, cd.demonstration(p, True)) == 0]
    assert len(mistakes) > 100                       # the mistake costs the answer on many problems


def test_demonstrations_mix_mistakes_at_the_rate_asked():
    task.use(task_args("countdown"))
    demos = task.sample_demonstrations(random.Random(0), 2000, mistake_rate=0.6)
    flat = [c for p, c in demos if cd.needs_parentheses(p)]
    share = sum("(" not in c.rsplit("#", 1)[1] for c in flat) / len(flat)
    assert 0.55 < share < 0.65
    with pytest.raises(ValueError, match="mistake_rate"):
        task.sample_demonstrations(random.Random(0), 1, mistake_rate=1.5)


@pytest.mark.parametrize("setting", [(5, 9, 99), (1, 9, 99), (3, 0, 99), (3, 9, 0), (3, 100, 99)])
def test_a_setting_outside_the_allowed_ranges_is_refused(setting):
    with pytest.raises(ValueError, match="countdown"):
        cd.held_out(*setting)


def test_prompts_parse_and_reward_never_raises():
    assert cd.parse_prompt("3,5,7:22=") == ((3, 5, 7), 22)
    for bad in ("3+4*2=", "", None, "3,5,7:22", "3,,5:2="):
        assert cd.parse_prompt(bad) is None
        assert cd.reward(bad, "5*3=15,15+7=22#5*3+7") == 0.0
    assert cd.reward("3,5,7:22=", "5*3=15,15+7=22#5*3+7", format_weight=0.5) == 1.5
    assert cd.reward("3,5,7:22=", "#5*3+7", format_weight=0.5) == 1.0       # right, not well formed
    assert cd.reward("3,5,7:22=", None) == 0.0
