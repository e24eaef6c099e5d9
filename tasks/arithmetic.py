"""
The default task (--task arithmetic): arithmetic where operator precedence matters, the classic
"2 + 2 x 3" precedence example made into a verifiable task.

    prompt       3+4*2=
    completion   4*2=8,3+8=11#11<|endoftext|>
                 ^ steps, one operation each    ^ final answer after '#'

Problems: three operands from 1..9, two operators from + - *, at most one * (so every number on the
correct path lies in [-80, 90] and a ~1M-parameter model can learn the arithmetic itself).
That gives 9^3 * 8 = 5832 problems. "Precedence problems" have the form a+b*c or a-b*c: the only
form where evaluating left to right gives different steps (and, unless c = 1, a different answer).
Prompts are drawn so that `precedence_share` of them (default one half) are precedence problems.

Demonstrations (for SFT) are correct, except that with probability `mistake_rate` the demonstrator
evaluates left to right, ignoring precedence: 3+4*2= -> 3+4=7,7*2=14#14. On the other forms that
gives the correct steps anyway, so the mistake shows only where precedence matters. With the
default mistake_rate 0.6 the SFT policy's most likely path on a precedence problem is the wrong
one: greedy accuracy sits near half, while sampling still finds the right path often enough for RL
to have something to reinforce.

Held-out set: 512 fixed problems (256 precedence, 256 other, alternating so that any prefix is
balanced), chosen with a fixed seed and never drawn for training.

Verifier: outcome reward 1.0 if the integer after the last '#' equals the answer, else 0.0; plus
`format_weight` times 1.0 if the whole completion is well formed (steps, '#', integer). It never
raises.
"""
import random
import re
from functools import lru_cache

from tasks import Task

OPERANDS = range(1, 10)
OP_PAIRS = [(a, b) for a in "+-*" for b in "+-*" if (a, b) != ("*", "*")]
PRECEDENCE_PAIRS = [("+", "*"), ("-", "*")]
HELD_OUT_PER_CLASS = 256
SPLIT_SEED = 1234
MAX_NEW_TOKENS = 24   # longest demonstration: "9+9=18,18*9=162#162" + EOS = 20 tokens

# Every pattern is matched with fullmatch: '$' would also match before a trailing newline
# ('4*2=8\n' a valid step)
_PROMPT = re.compile(r"([1-9])([+\-*])([1-9])([+\-*])([1-9])=")
_PAREN = re.compile(r"\(([1-9])([+\-])([1-9])\)\*([1-9])=")     # (a+b)*c= and (a-b)*c=
_NUM = r"-?[0-9]{1,9}"
_WELL_FORMED = re.compile(rf"{_NUM}[+\-*]{_NUM}={_NUM}(,{_NUM}[+\-*]{_NUM}={_NUM})*#{_NUM}")
_ANSWER = re.compile(r"#[ \t]*(-?[0-9]{1,12})\s*\Z")   # any trailing whitespace: spaces, \r\n, tabs


# -----------------------------------------------------------------------------
# Problems and their solutions

def _apply(x, op, y):
    return x + y if op == "+" else x - y if op == "-" else x * y


def solve(prompt, left_to_right=False):
    """'3+4*2=' -> (['4*2=8', '3+8=11'], 11). left_to_right=True ignores precedence (the mistake). A
    parenthesised problem '(3+4)*2=' -> (['3+4=7', '7*2=14'], 14): the parentheses first, always."""
    m = _PROMPT.fullmatch(prompt)
    if m is None and _PAREN.fullmatch(prompt):
        a, op, b, c = _PAREN.fullmatch(prompt).groups()
        ab = _apply(int(a), op, int(b))
        return [f"{a}{op}{b}={ab}", f"{ab}*{c}={ab * int(c)}"], ab * int(c)
    if m is None:
        raise ValueError(f"not a task prompt: {prompt!r}; expected like '3+4*2=' or '(3+4)*2=' "
                         "(operands 1-9)")
    a, op1, b, op2, c = int(m[1]), m[2], int(m[3]), m[4], int(m[5])
    if op2 == "*" and op1 != "*" and not left_to_right:   # b*c first
        bc = _apply(b, op2, c)
        r = _apply(a, op1, bc)
        return [f"{b}{op2}{c}={bc}", f"{a}{op1}{bc}={r}"], r
    ab = _apply(a, op1, b)                                  # a op1 b first
    r = _apply(ab, op2, c)
    return [f"{a}{op1}{b}={ab}", f"{ab}{op2}{c}={r}"], r


def answer(prompt):
    return solve(prompt)[1]


def demonstration(prompt, left_to_right=False):
    steps, r = solve(prompt, left_to_right)
    return ",".join(steps) + f"#{r}"


def is_precedence(prompt):
    return (prompt[1], prompt[3]) in PRECEDENCE_PAIRS


@lru_cache(maxsize=None)
def _split():
    """All 5832 problems split into held-out (fixed) and training pools, each by class."""
    problems = [f"{a}{o1}{b}{o2}{c}=" for a in OPERANDS for b in OPERANDS for c in OPERANDS
                for o1, o2 in OP_PAIRS]
    prec = sorted(p for p in problems if is_precedence(p))
    other = sorted(p for p in problems if not is_precedence(p))
    rng = random.Random(SPLIT_SEED)
    rng.shuffle(prec)
    rng.shuffle(other)
    n = HELD_OUT_PER_CLASS
    held_out = tuple(p for pair in zip(prec[:n], other[:n]) for p in pair)  # any prefix balanced
    return held_out, tuple(prec[n:]), tuple(other[n:])


def all_prompts():
    """Every problem of the task, held-out ones included (5832)."""
    return list(_split()[0] + _split()[1] + _split()[2])


@lru_cache(maxsize=None)
def _max_prompt_tokens(encode, parenthesised):
    prompts = all_prompts() + ([parenthesise(p) for p in all_prompts() if is_precedence(p)]
                               if parenthesised else [])
    return max(len(encode(p)) for p in prompts)


def max_prompt_tokens(tokenizer, parenthesised=False):
    """The longest prompt of the task in `tokenizer`'s tokens (6 with the byte tokenizer; 8 with the
    parenthesised problems)."""
    return _max_prompt_tokens(tokenizer.encode, parenthesised)


# -----------------------------------------------------------------------------
# Parenthesised problems, (a+b)*c= and (a-b)*c=: the problems a left-to-right attempt at a+b*c= does
# solve. Never in the default data: for hindsight relabelling (expert_iteration.py --hindsight) and
# its evaluation.

def is_parenthesised(prompt):
    return isinstance(prompt, str) and _PAREN.fullmatch(prompt) is not None


def parenthesise(prompt):
    """'3+4*2=' -> '(3+4)*2=': the problem a+b*c='s left-to-right mistake correctly solves."""
    if not is_precedence(prompt):
        raise ValueError(f"{prompt!r} is not of the form a+b*c= or a-b*c=")
    return f"({prompt[:3]}){prompt[3:]}"


def paren_eval_prompts():
    """The held-out parenthesised problems (256): the images of the held-out precedence problems, so
    that a training prompt a+b*c= is never relabelled into a held-out (a+b)*c=."""
    return [parenthesise(p) for p in eval_prompts() if is_precedence(p)]


def sample_paren_prompts(rng, n):
    """n parenthesised training problems (never held-out ones); rng is a random.Random."""
    _, prec, _ = _split()
    return [parenthesise(rng.choice(prec)) for _ in range(n)]


def hindsight_prompt(prompt, completion):
    """Hindsight relabelling (Andrychowicz et al. 2017): the problem a failed attempt did solve, or
    None. A wrong completion of a+b*c= that is exactly the left-to-right derivation solves (a+b)*c=,
    exactly."""
    if (not isinstance(completion, str) or not is_precedence(prompt)
            or reward(prompt, completion) == 1.0):
        return None
    target = parenthesise(prompt)
    return target if completion == demonstration(target) else None


def eval_prompts():
    """The fixed held-out set: 512 prompts, 256 precedence problems and 256 others alternating."""
    return list(_split()[0])


def sample_prompts(rng, n, precedence_share=None):
    """n training prompts (never held-out ones); rng is a random.Random; precedence_share None means
    one half."""
    precedence_share = 0.5 if precedence_share is None else precedence_share
    if not 0.0 <= precedence_share <= 1.0:
        raise ValueError(f"precedence_share = {precedence_share}; "
                         "allowed: 0 <= precedence_share <= 1")
    _, prec, other = _split()
    return [rng.choice(prec) if rng.random() < precedence_share else rng.choice(other)
            for _ in range(n)]


# -----------------------------------------------------------------------------
# Verifier

def parse_answer(completion):
    """The integer after the last '#' (only whitespace may follow it), or None."""
    if not isinstance(completion, str):
        return None
    m = _ANSWER.search(completion[-64:])  # an answer has at most 13 characters; the tail is enough
    return int(m[1]) if m else None


def is_well_formed(completion):
    """Steps, '#' and an integer, and nothing after it: the format bonus is strict where the reward
    is not (reward accepts whitespace after the answer)."""
    return (isinstance(completion, str) and len(completion) <= 256
            and _WELL_FORMED.fullmatch(completion) is not None)


def reward(prompt, completion, format_weight=0.0):
    """1.0 for the correct final answer, else 0.0; plus format_weight for a well-formed one."""
    try:
        truth = answer(prompt)
    except (ValueError, TypeError):
        return 0.0
    correct = float(parse_answer(completion) == truth)
    return correct + format_weight * float(is_well_formed(completion))


# -----------------------------------------------------------------------------
# Step labels: which steps of a completion are right (prm.py's process reward model's exact labels)

_STEP = re.compile(rf"({_NUM})([+\-*])({_NUM})=({_NUM})")


def split_steps(completion):
    """A completion's steps: the pieces between the ','s, the last one carrying the final answer.
    '4*2=8,3+8=11#11' -> ['4*2=8', '3+8=11#11']."""
    return completion.split(",")


def _equation(step):
    """'4*2=8' -> (4, '*', 2, 8), or None when the text is not one operation and its result."""
    m = _STEP.fullmatch(step)
    return None if m is None else (int(m[1]), m[2], int(m[3]), int(m[4]))


def step_labels(prompt, completion):
    """One 0/1 label per step of `completion` (split_steps): 1 when the steps up to and including it
    are the start of the correct derivation of `prompt`, else 0. The correct derivation is
    task.solve's: operator precedence respected (the multiplication first, then left to right), each
    step one operation with its right result, operands in the derivation's order. The final step
    must also end with the right answer ('#r', trailing whitespace allowed as the verifier does),
    and a step with '#' must be the final one. Once a step is wrong, every later step is too (a
    prefix with a wrong step starts no correct derivation). So on 9+8*1= the left-to-right
    '9+8=17,17*1=17#17' gets [0, 0] although its answer is right: the first step breaks precedence.
    Never raises: a prompt that is not a task problem gives all 0, a non-string completion []."""
    if not isinstance(completion, str):
        return []
    steps = split_steps(completion)
    try:
        correct, result = solve(prompt)
    except (ValueError, TypeError):
        return [0] * len(steps)
    labels, good = [], True
    for i, step in enumerate(steps):
        final = i == len(correct) - 1            # the derivation's last step: it carries the answer
        equation, hashes = step.split("#", 1)[0], step.count("#")
        good = (good and i < len(correct) and _equation(equation) == _equation(correct[i])
                and hashes == int(final) and (not final or parse_answer(step) == result))
        labels.append(int(good))
    return labels


# -----------------------------------------------------------------------------
# The interface every task module shares (tasks.Task)

def synthetic_mistake(prompt):
    """A wrong completion: left to right where that changes the answer, else the result off by 1."""
    ltr = demonstration(prompt, left_to_right=True)
    if parse_answer(ltr) != answer(prompt):
        return ltr
    steps, r = solve(prompt)
    steps[-1] = steps[-1].rsplit("=", 1)[0] + f"={r + 1}"
    return ",".join(steps) + f"#{r + 1}"


def split_answer(completion):
    """'4*2=8,3+8=11#11' -> ('4*2=8,3+8=11', '11'): the steps and the answer after the last '#'."""
    reasoning, _, answer_text = completion.rpartition("#")
    return reasoning, answer_text


def score_answer(prompt, text):
    """The verifier on an answer alone: `text` is one integer, the prompt's answer (spaces around
    it allowed)."""
    try:
        truth = answer(prompt)
    except (ValueError, TypeError):
        return False
    return (isinstance(text, str) and re.fullmatch(r"\s*-?[0-9]{1,12}\s*", text) is not None
            and int(text) == truth)


def task():
    """This task as a tasks.Task (the demonstrator's slip is the left-to-right derivation)."""
    return Task("arithmetic", MAX_NEW_TOKENS, eval_prompts, sample_prompts,
                lambda prompt, mistake=False: demonstration(prompt, left_to_right=mistake),
                synthetic_mistake, reward, split_answer, score_answer, is_precedence,
                max_prompt_tokens)
