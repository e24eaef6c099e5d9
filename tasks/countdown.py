"""
Countdown: reach a target number from a few given numbers with + - * / (Gandhi et al. 2024, "Stream
of Search", arXiv 2404.03683; the task TinyZero and nano-aha-moment train GRPO on). Generated here,
nothing downloaded.

    prompt       3,5,7:22=
    completion   5*3=15,15+7=22#5*3+7<|endoftext|>
                 ^ steps, one operation each   ^ the answer: an expression over the given numbers

Problems: N_NUMBERS numbers (3 by default, `--countdown_numbers 4` for the harder setting) from
1..MAX_NUMBER, and a target between 1 and MAX_TARGET that some expression using every number once
reaches with integer steps. The held-out set is 512 fixed problems; training problems are drawn from
a separate stream and never equal one.

Verifier (`score_countdown`): the answer is parsed (no eval: a recursive-descent parser over
digits, + - * / and parentheses), must use each given number exactly once (as a multiset:
TinyZero's, nano-aha-moment's and Stream of Search's rule; `--countdown_rule at_most` allows
leaving numbers out, the easier task this project first used), and its value is computed in exact
rational arithmetic (fractions.Fraction): 7/2*2 is 7, a division by zero is simply wrong. It never
raises.

Demonstrations come from a brute-force solver (`solve`): the first solution in a fixed enumeration
order that uses every number with integer steps. With probability `mistake_rate` the demonstrator
writes the answer without the parentheses its steps need (steps 5+3=8,8*7=56 written as 5+3*7):
correct steps, a wrong answer, and only where precedence matters, which leaves room for RL as the
arithmetic task's left-to-right mistake does.
"""
import random
import re
from fractions import Fraction
from functools import lru_cache
from itertools import permutations

from tasks import Task

N_NUMBERS = 3          # numbers per problem (3 or 4)
MAX_NUMBER = 9         # the numbers are drawn from 1..MAX_NUMBER
MAX_TARGET = 99        # targets lie in 1..MAX_TARGET
HELD_OUT = 512
SPLIT_SEED = 4321
MAX_NEW_TOKENS = {3: 28, 4: 40}  # by numbers per problem; longest demonstrations 22, 34 chars + EOS
MAX_ANSWER_CHARS = 64  # the parser reads at most this many characters of an answer
OPS = "+-*/"
RULES = ("exactly", "at_most")  # each given number used exactly once (the field's), or at most once

_PROMPT = re.compile(r"([1-9][0-9]*(?:,[1-9][0-9]*)+):([1-9][0-9]*)=")
_STEP = r"[0-9]+[+\-*/][0-9]+=[0-9]+"


# -----------------------------------------------------------------------------
# The verifier: parse without eval, count the numbers used, evaluate exactly

class _Parser:
    """expr := term (('+'|'-') term)*;  term := factor (('*'|'/') factor)*;
    factor := number | '(' expr ')'. Numbers are non-negative integer literals; no unary minus.
    Values are Fractions; a division by zero gives None, which propagates."""

    def __init__(self, text):
        self.text, self.i, self.numbers = text, 0, []

    def peek(self):
        """The next character that is not a space ('' at the end); spaces separate tokens, never
        join them."""
        while self.i < len(self.text) and self.text[self.i] == " ":
            self.i += 1
        return self.text[self.i] if self.i < len(self.text) else ""

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.text[self.i]
            self.i += 1
            right = self.term()
            value = (None if value is None or right is None
                     else value + right if op == "+" else value - right)
        return value

    def term(self):
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.text[self.i]
            self.i += 1
            right = self.factor()
            if value is None or right is None or (op == "/" and right == 0):
                value = None
            else:
                value = value * right if op == "*" else value / right
        return value

    def factor(self):
        if self.peek() == "(":
            self.i += 1
            value = self.expr()
            if self.peek() != ")":
                raise ValueError("unbalanced parenthesis")
            self.i += 1
            return value
        start = self.i if self.peek() else len(self.text)
        while self.i < len(self.text) and self.text[self.i] in "0123456789":
            self.i += 1
        if start == self.i or self.i - start > 6:
            raise ValueError("a number was expected")
        self.numbers.append(int(self.text[start:self.i]))
        return Fraction(int(self.text[start:self.i]))


def evaluate_expression(expression):
    """(value as a Fraction or None for a division by zero, the numbers it uses), or None if
    `expression` is not an expression of integers, + - * / and parentheses (spaces allowed). Never
    raises."""
    if not isinstance(expression, str) or len(expression) > MAX_ANSWER_CHARS:
        return None
    parser = _Parser(expression)
    try:
        value = parser.expr()
    except (ValueError, RecursionError):
        return None
    if parser.peek() != "":
        return None                                                    # something is left over
    return value, parser.numbers


def score_countdown(numbers, target, expression, rule="exactly"):
    """True when `expression` uses each of `numbers` exactly once (rule "at_most": at most once), as
    a multiset, and equals `target` exactly. Never raises, never evals: anything that is not such an
    expression is False."""
    parsed = evaluate_expression(expression)
    if parsed is None or parsed[0] is None:
        return False
    value, used = parsed
    available = list(numbers)
    for n in used:
        if n not in available:
            return False
        available.remove(n)
    return value == target and (rule == "at_most" or not available)


# -----------------------------------------------------------------------------
# The solver: every way to combine the numbers, with integer steps

def _combine(x, op, y):
    """x op y on integers, or None when the step would not be an integer (or divides by zero)."""
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    return x // y if y != 0 and x % y == 0 else None


def _expression(node):
    """An expression tree (a number, or (op, left, right)) as text, with the parentheses that
    precedence needs."""
    if isinstance(node, int):
        return str(node)
    op, left, right = node
    a, b = _expression(left), _expression(right)
    if not isinstance(left, int) and op in "*/" and left[0] in "+-":
        a = f"({a})"
    if not isinstance(right, int) and (op in "*/" and right[0] in "+-"
                                       or op in "-/" and right[0] == op
                                       or op == "-" and right[0] == "+"
                                       or op == "/" and right[0] == "*"):
        b = f"({b})"
    return f"{a}{op}{b}"


def _flat_expression(node):
    """The demonstrator's mistake: the same tree written with no parentheses at all."""
    if isinstance(node, int):
        return str(node)
    return f"{_flat_expression(node[1])}{node[0]}{_flat_expression(node[2])}"


def _solutions(items):
    """Yield (value, tree, steps) for every way of combining all of `items` ((value, tree, steps)
    triples) into one value with integer steps, in a fixed order: pick two, combine, recurse."""
    if len(items) == 1:
        yield items[0]
        return
    for i, j in permutations(range(len(items)), 2):
        (x, tx, sx), (y, ty, sy) = items[i], items[j]
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        for op in OPS:
            z = _combine(x, op, y)
            if z is None or z < 0:
                continue
            yield from _solutions(rest + [(z, (op, tx, ty), sx + sy + [f"{x}{op}{y}={z}"])])


@lru_cache(maxsize=65536)
def solve(numbers, target):
    """The first (steps, tree) in the fixed enumeration that uses every number once, with
    non-negative integer steps, and reaches target; None if there is none. numbers: a tuple."""
    for value, tree, steps in _solutions([(n, n, []) for n in numbers]):
        if value == target:
            return steps, tree
    return None


# -----------------------------------------------------------------------------
# Problems, prompts, demonstrations

def make_prompt(numbers, target):
    return f"{','.join(map(str, numbers))}:{target}="


def parse_prompt(prompt):
    """'3,5,7:22=' -> ((3, 5, 7), 22); None if it is not a Countdown prompt."""
    m = _PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    return None if m is None else (tuple(int(x) for x in m[1].split(",")), int(m[2]))


def _draw_problem(rng, n_numbers, max_number, max_target):
    """Numbers from 1..max_number and a target that a random combination of all of them reaches with
    integer steps (targets in 1..max_target); None when this draw gives no such target."""
    numbers = tuple(rng.randint(1, max_number) for _ in range(n_numbers))
    reachable = sorted({v for v, _, _ in _solutions([(n, n, []) for n in numbers])
                        if 1 <= v <= max_target})
    return (numbers, rng.choice(reachable)) if reachable else None


def _draw_prompts(rng, n, setting, exclude=()):
    """n distinct prompts not in `exclude`, drawn with `rng`; ValueError if the setting yields no
    problems."""
    prompts, draws = [], 0
    while len(prompts) < n:
        draws += 1
        if draws > 100 * n + 1000 and not prompts:
            raise ValueError(f"countdown: no solvable problems with {setting}")
        problem = _draw_problem(rng, *setting)
        if problem is not None and make_prompt(*problem) not in exclude:
            prompts.append(make_prompt(*problem))
    return prompts


@lru_cache(maxsize=None)
def held_out(n_numbers=N_NUMBERS, max_number=MAX_NUMBER, max_target=MAX_TARGET):
    """The fixed held-out problems (HELD_OUT distinct prompts)."""
    check_setting(n_numbers, max_number, max_target)
    rng, prompts = random.Random(SPLIT_SEED), []
    while len(prompts) < HELD_OUT:
        prompts += [p for p in _draw_prompts(rng, 1, (n_numbers, max_number, max_target))
                    if p not in prompts]
    return tuple(prompts)


def check_setting(n_numbers, max_number, max_target):
    """ValueError unless 2 <= n_numbers <= 4 (the solver is brute force), 1 <= max_number <= 99 and
    1 <= max_target <= 999."""
    if not 2 <= n_numbers <= 4:
        raise ValueError(f"countdown: {n_numbers} numbers per problem; allowed: 2 to 4")
    if not 1 <= max_number <= 99:
        raise ValueError(f"countdown: numbers up to {max_number}; allowed: 1 to 99")
    if not 1 <= max_target <= 999:
        raise ValueError(f"countdown: targets up to {max_target}; allowed: 1 to 999")


def sample_prompts(rng, n, precedence_share=None, n_numbers=N_NUMBERS, max_number=MAX_NUMBER,
                   max_target=MAX_TARGET):
    """n training prompts (never a held-out one); rng is a random.Random. precedence_share None: as
    drawn (about a third need parentheses with 3 numbers); else that share of them need parentheses
    (needs_parentheses)."""
    setting = (n_numbers, max_number, max_target)
    exclude = set(held_out(*setting))
    if precedence_share is None:
        return _draw_prompts(rng, n, setting, exclude)
    prompts = []
    while len(prompts) < n:
        want = rng.random() < precedence_share           # the class of the next prompt, then a draw
        prompts += [p for p in _draw_prompts(rng, 1, setting, exclude)
                    if needs_parentheses(p) == want][:1]
    return prompts


def demonstration(prompt, mistake=False):
    """The solver's steps and answer, '5*3=15,15+7=22#5*3+7'; mistake=True drops the answer's
    parentheses."""
    numbers, target = parse_prompt(prompt)
    steps, tree = solve(numbers, target)
    return ",".join(steps) + "#" + (_flat_expression(tree) if mistake else _expression(tree))


def needs_parentheses(prompt):
    """Whether the solver's answer needs parentheses (where the demonstrator's mistake shows)."""
    numbers, target = parse_prompt(prompt)
    return "(" in _expression(solve(numbers, target)[1])


# -----------------------------------------------------------------------------
# The reward

def answer_text(completion):
    """The text after the last '#', trailing whitespace dropped; None if there is no '#'."""
    if not isinstance(completion, str) or "#" not in completion:
        return None
    return completion.rsplit("#", 1)[1].rstrip()


def is_well_formed(completion):
    """Steps (one operation each, separated by ','), '#', and an expression."""
    if not isinstance(completion, str) or len(completion) > 256 or "#" not in completion:
        return False
    steps, answer = completion.rsplit("#", 1)
    return (re.fullmatch(rf"{_STEP}(,{_STEP})*", steps) is not None
            and evaluate_expression(answer) is not None)


def reward(prompt, completion, format_weight=0.0, rule="exactly"):
    """1.0 when the answer after '#' reaches the prompt's target (score_countdown under `rule`),
    else 0.0; plus format_weight if the completion is well formed. Never raises."""
    problem = parse_prompt(prompt)
    if problem is None:
        return 0.0
    correct = float(score_countdown(*problem, answer_text(completion), rule))
    return correct + format_weight * float(is_well_formed(completion))


# -----------------------------------------------------------------------------
# The interface every task module shares (tasks.Task)

def synthetic_mistake(prompt):
    """A wrong completion: the answer without its parentheses where that changes its value, else the
    solver's answer with its first number one larger (the solver uses every number once, so that one
    is not available)."""
    flat = demonstration(prompt, mistake=True)
    if reward(prompt, flat) == 0.0:
        return flat
    steps, answer = split_answer(demonstration(prompt))
    first = re.match(r"[0-9]+", answer.lstrip("("))[0]
    return f"{steps}#{answer.replace(first, str(int(first) + 1), 1)}"


def split_answer(completion):
    """'5*3=15,15+7=22#5*3+7' -> ('5*3=15,15+7=22', '5*3+7'): the steps, the answer after the last
    '#'."""
    reasoning, _, answer = completion.rpartition("#")
    return reasoning, answer


def score_answer(prompt, text, rule="exactly"):
    """The verifier on an answer alone: score_countdown on the prompt's numbers and target."""
    problem = parse_prompt(prompt)
    return problem is not None and score_countdown(
        *problem, text.strip() if isinstance(text, str) else text, rule)


def max_prompt_tokens(tokenizer, n_numbers=N_NUMBERS, max_number=MAX_NUMBER, max_target=MAX_TARGET):
    """The longest prompt of the setting in `tokenizer`'s tokens: every number and the target at
    their widest."""
    return len(tokenizer.encode(make_prompt((max_number,) * n_numbers, max_target)))


def task(n_numbers=N_NUMBERS, max_number=MAX_NUMBER, max_target=MAX_TARGET, rule="exactly"):
    """This task as a tasks.Task, for one setting (ValueError for one the solver cannot serve)."""
    check_setting(n_numbers, max_number, max_target)
    if rule not in RULES:
        raise ValueError(f"countdown rule {rule!r} is unknown; allowed: {', '.join(RULES)}")
    setting = dict(n_numbers=n_numbers, max_number=max_number, max_target=max_target)
    return Task("countdown", MAX_NEW_TOKENS.get(n_numbers, 40), lambda: list(held_out(**setting)),
                lambda rng, n, precedence_share=None:
                    sample_prompts(rng, n, precedence_share, **setting),
                lambda prompt, mistake=False: demonstration(prompt, mistake), synthetic_mistake,
                lambda prompt, completion, format_weight=0.0:
                    reward(prompt, completion, format_weight, rule),
                split_answer, lambda prompt, text: score_answer(prompt, text, rule),
                needs_parentheses, lambda tok: max_prompt_tokens(tok, **setting))
