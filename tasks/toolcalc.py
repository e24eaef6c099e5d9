"""
The tool-use task (--task toolcalc): arithmetic the small model cannot do reliably in its head, and
a calculator it may call. agent.py trains on its episodes; sft.py on its demonstrations (the
environment's text masked out).

    prompt        37+12*46=
    with a call   <37+12*46>589#589<|endoftext|>   the policy writes <37+12*46>, the environment 589
    in the head   12*46=552,37+552=589#589<|endoftext|>
    two attempts  12*46=562,37+562=599#599\\nrevise:37+12*46=<37+12*46>589#589<|endoftext|>
                  (agent.py --turns 2)

Problems: half "hard", a+b*c= or a-b*c= with a in 1..99 and b, c in 10..99 (a two-digit product),
half "easy", the arithmetic task's (three operands from 1..9). The held-out set is 512 fixed
problems, hard and easy alternating (any prefix is balanced); training problems never equal one.
`is_precedence` means hard here.

The calculator (`calculator`): integers, + - * (a minus may also negate a number or a parenthesis)
and parentheses, no spaces; at most MAX_CHARS characters, MAX_DEPTH nested parentheses, every
number and intermediate result within MAX_MAGNITUDE. A recursive-descent parser, never eval: it
never raises, answers anything else with a string starting "error", and takes microseconds whatever
it is given. In an episode the environment writes its result, or "error" for a refused call
(`tool_reply`).

Demonstrations: the right way is the tool for a hard problem and the head for an easy one. The
demonstrator's slip (sft.py --mistake_rate) is the other way: the head on a hard problem (its
arithmetic is right, but a 0.8M-parameter model does not learn two-digit products from it reliably)
or an unneeded call on an easy one. A quarter of the demonstrations (a fixed quarter of the
problems) are two attempts: a first (on a hard problem in the head and wrong, its product off by
ten, as the model's own are; on an easy one the slip at SLIP_RATE), the revision prompt, then a
second drawn as a one-attempt demonstration is. So a revision changes every hard answer and no easy
one: SFT cannot learn "say it again". The revision prompt (`revision`) restates the problem: REVISE,
then the prompt. A second attempt then copies its expression from just before, as a first does,
not from a whole attempt back.
Verifier: the arithmetic task's: the integer after the last '#' (of the last attempt).
"""
import random
import re
import zlib
from functools import lru_cache

from tasks import Task, arithmetic

# the policy writes <expression>; the environment answers right after the '>'
CALL_OPEN, CALL_CLOSE = "<", ">"
REVISE = "\nrevise:"  # the environment writes it and the problem after a first attempt (--turns 2)
MAX_CHARS = 64       # the calculator's limits: expression length, nesting, every number's magnitude
MAX_DEPTH = 8
MAX_MAGNITUDE = 10 ** 12
MAX_CALLS = 2        # calls answered per episode (agent.py --max_calls)
CHAT_MAX_NEW_TOKENS = 100  # with --chat --tools (bytes-chat): a call turn, reply and answer: 93
CHAT_BLOCK_SIZE = 176      # sft.py's default --block_size then: the tools' system turn (61) too
MAX_NEW_TOKENS = 36  # per attempt; longest demonstration '99*99=9801,99-9801=-9702#-9702' + EOS: 32
BLOCK_SIZE = 112     # sft.py's default --block_size for this task: two attempts must fit
POSITIONS = "rope"   # sft.py's default --pos here: a second attempt copies at later positions
HELD_OUT_PER_CLASS = 256
SPLIT_SEED = 2718
TWO_ATTEMPT_SHARE = 0.25  # of the problems whose demonstration is two attempts
SLIP_RATE = 0.6      # the first attempt's slip rate in those on easy problems (hard: always wrong)

_HARD = re.compile(r"([1-9][0-9]?)([+\-])([1-9][0-9])\*([1-9][0-9])=")
_REPLY = re.compile(rf"(?<={re.escape(CALL_CLOSE)})(?:-?[0-9]+|error)"
                    rf"|{re.escape(REVISE)}[0-9+\-*]+=")
_WELL_FORMED = re.compile(r"(?:<[0-9+\-*()]{1,64}>(?:-?[0-9]+|error))*[0-9+\-*=,]*#-?[0-9]{1,12}")


# -----------------------------------------------------------------------------
# The calculator: expr := term (('+' | '-') term)*;  term := factor ('*' factor)*;
#                 factor := '-'? (digits | '(' expr ')')

class _Refused(Exception):
    pass


def calculator(expression):
    """The value of an integer expression as a string ('12*46' -> '552'), or a string starting with
    "error" for anything else: not a string, empty, too long, a character other than 0-9 + - * ( ),
    bad syntax, too deep, too large."""
    if not isinstance(expression, str):
        return "error: not a string"
    if not expression or len(expression) > MAX_CHARS:
        return ("error: "
                f"{'empty' if not expression else 'longer than ' + str(MAX_CHARS) + ' characters'}")
    bad = next((ch for ch in expression if ch not in "0123456789+-*()"), None)
    if bad is not None:
        return f"error: {bad!r} is not allowed (digits, + - * and parentheses only)"
    try:
        value, end = _expr(expression, 0, 0)
        if end != len(expression):
            raise _Refused(f"unexpected {expression[end]!r} at {end}")
    except _Refused as e:
        return f"error: {e}"
    return str(value)


def _bounded(value):
    if abs(value) > MAX_MAGNITUDE:
        raise _Refused(f"a value beyond {MAX_MAGNITUDE:.0e}")
    return value


def _expr(s, i, depth):
    value, i = _term(s, i, depth)
    while i < len(s) and s[i] in "+-":
        right, j = _term(s, i + 1, depth)
        value, i = _bounded(value + right if s[i] == "+" else value - right), j
    return value, i


def _term(s, i, depth):
    value, i = _factor(s, i, depth)
    while i < len(s) and s[i] == "*":
        right, i = _factor(s, i + 1, depth)
        value = _bounded(value * right)  # both factors within the bound: at most 1e24 here
    return value, i


def _factor(s, i, depth):
    sign = 1
    if i < len(s) and s[i] == "-":                 # one unary minus; a second one is a syntax error
        sign, i = -1, i + 1
    if i < len(s) and s[i] == "(":
        if depth == MAX_DEPTH:
            raise _Refused(f"more than {MAX_DEPTH} nested parentheses")
        value, i = _expr(s, i + 1, depth + 1)
        if i >= len(s) or s[i] != ")":
            raise _Refused("unbalanced parentheses")
        return sign * value, i + 1
    j = i
    while j < len(s) and s[j].isascii() and s[j].isdigit():
        j += 1
    if j == i:
        raise _Refused(f"a number expected at {i}")
    if j - i > len(str(MAX_MAGNITUDE)):
        raise _Refused(f"a value beyond {MAX_MAGNITUDE:.0e}")
    return _bounded(sign * int(s[i:j])), j


def tool_reply(expression):
    """What the environment writes after a call: the calculator's result, or "error" if refused."""
    result = calculator(expression)
    return "error" if result.startswith("error") else result


def segments(completion):
    """A demonstration -> [(text, written_by_environment)]: the tool's replies and the revision
    prompt are the environment's (for demonstrations only, which this module writes; an episode's
    tokens are never re-read from text)."""
    out, i = [], 0
    for m in _REPLY.finditer(completion):
        out += [(completion[i:m.start()], False)] if m.start() > i else []
        out.append((m.group(), True))
        i = m.end()
    return out + ([(completion[i:], False)] if i < len(completion) else [])


# -----------------------------------------------------------------------------
# Problems, answers and demonstrations

def is_hard(prompt):
    return isinstance(prompt, str) and _HARD.fullmatch(prompt) is not None


def answer(prompt):
    m = _HARD.fullmatch(prompt) if isinstance(prompt, str) else None
    if m is None:
        return arithmetic.answer(prompt)                # ValueError for a prompt of neither kind
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    return a + b * c if op == "+" else a - b * c


def _head(prompt):
    """The derivation in the head, one operation per step (right)."""
    m = _HARD.fullmatch(prompt)
    if m is None:
        return arithmetic.demonstration(prompt)
    product = int(m[3]) * int(m[4])
    return f"{m[3]}*{m[4]}={product},{m[1]}{m[2]}{product}={answer(prompt)}#{answer(prompt)}"


def _call(prompt):
    r = answer(prompt)
    return f"{CALL_OPEN}{prompt[:-1]}{CALL_CLOSE}{r}#{r}"


def attempt(prompt, slip=False):
    """One attempt: the tool on a hard problem and the head on an easy one; slip=True reverses."""
    return _head(prompt) if is_hard(prompt) == slip else _call(prompt)


def _uniform(prompt, salt):          # a fixed number in [0, 1) per problem (no global random state)
    return zlib.crc32(f"{salt}:{prompt}".encode()) / 2 ** 32


def demonstration(prompt, mistake=False):
    """One attempt with the slip when `mistake`; for a fixed quarter of the problems, a first
    attempt (hard: in the head and wrong; easy: the slip at SLIP_RATE), the revision prompt, then
    that attempt."""
    if _uniform(prompt, "two") < TWO_ATTEMPT_SHARE:
        first = (synthetic_mistake(prompt) if is_hard(prompt)
                 else attempt(prompt, _uniform(prompt, "slip") < SLIP_RATE))
        return first + revision(prompt) + attempt(prompt, mistake)
    return attempt(prompt, mistake)


def messages(prompt, mistake=False):
    """A one-attempt demonstration in a chat template's protocol (agent.py --chat --tools
    calculator): the calculator called with the problem's expression, its reply, the answer; or
    the derivation in the head, as one assistant message."""
    text = attempt(prompt, mistake)
    if not text.startswith(CALL_OPEN):
        return [{"role": "assistant", "content": text}]
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": prompt[:-1]}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(answer(prompt))},
            {"role": "assistant", "content": f"#{answer(prompt)}"}]


def revision(prompt):
    """What the environment writes after a first attempt: REVISE and the problem again (no hint of
    whether the first answer was right)."""
    return REVISE + prompt


def synthetic_mistake(prompt):
    """A wrong completion: the head derivation, its product (hard) or last result (easy) off."""
    if not is_hard(prompt):
        return arithmetic.synthetic_mistake(prompt)
    a, op, b, c = _HARD.fullmatch(prompt).groups()
    product = int(b) * int(c) + 10
    r = int(a) + product if op == "+" else int(a) - product
    return f"{b}*{c}={product},{a}{op}{product}={r}#{r}"


@lru_cache(maxsize=None)
def _split():
    """(held-out prompts, the set of them): 256 hard drawn with a fixed seed, and 256 of the
    arithmetic task's held-out problems, alternating."""
    rng, hard = random.Random(SPLIT_SEED), []
    while len(hard) < HELD_OUT_PER_CLASS:
        p = _draw_hard(rng)
        hard += [p] if p not in hard else []
    held_out = tuple(p for pair in zip(hard, arithmetic.eval_prompts()[:HELD_OUT_PER_CLASS])
                     for p in pair)
    return held_out, frozenset(held_out)


def _draw_hard(rng):
    return f"{rng.randint(1, 99)}{rng.choice('+-')}{rng.randint(10, 99)}*{rng.randint(10, 99)}="


def eval_prompts():
    return list(_split()[0])


def sample_prompts(rng, n, precedence_share=None):
    """n training prompts (never held-out ones); precedence_share: the share of hard problems
    (None: one half)."""
    share = 0.5 if precedence_share is None else precedence_share
    out = []
    while len(out) < n:
        p = _draw_hard(rng) if rng.random() < share else arithmetic.sample_prompts(rng, 1)[0]
        out += [p] if p not in _split()[1] else []
    return out


def max_prompt_tokens(tokenizer):
    """The longest prompt in tokens (9 bytes, '99-99*99='; a byte-level tokenizer needs no more
    tokens than bytes)."""
    return max(len(tokenizer.encode("99-99*99=")), arithmetic.max_prompt_tokens(tokenizer))


def is_well_formed(completion):
    return (isinstance(completion, str) and len(completion) <= 256
            and _WELL_FORMED.fullmatch(completion) is not None)


def reward(prompt, completion, format_weight=0.0):
    """1.0 for the right final answer, else 0.0; plus format_weight for one well-formed attempt."""
    try:
        truth = answer(prompt)
    except (ValueError, TypeError):
        return 0.0
    return (float(arithmetic.parse_answer(completion) == truth)
            + format_weight * float(is_well_formed(completion)))


def score_answer(prompt, text):
    try:
        truth = answer(prompt)
    except (ValueError, TypeError):
        return False
    return (isinstance(text, str) and re.fullmatch(r"\s*-?[0-9]{1,12}\s*", text) is not None
            and int(text) == truth)


def task():
    return Task("toolcalc", MAX_NEW_TOKENS, eval_prompts, sample_prompts, demonstration,
                synthetic_mistake, reward, arithmetic.split_answer, score_answer, is_hard,
                max_prompt_tokens)
