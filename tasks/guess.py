"""
The guessing game (--task guess; multiturn.py): find a hidden number from 1 to 15 in at most four
guesses, each wrong one answered by the environment: the number is higher, or lower. What the
environment says changes what the policy should guess next, and binary search, the optimal policy,
takes 49/15 = 3.27 guesses on average (every number by the fourth): an episode is three policy
turns or more, and a turn can be credited with what it did.

    prompt      #482913 1-15?
    episode     8<|endoftext|>> 12<|endoftext|>< 10<|endoftext|>> 11<|endoftext|>
                the policy guesses 8, 12, 10, 11 (each turn ended by its end token); the environment
                writes "> " (higher) or "< " (lower) after a wrong guess; a right one ends it
    --chat      each guess an assistant turn, each answer a user turn ("higher", "lower"), as
                the chat template renders them

Why this game: the reply is all the policy has to go on (the prompt shows no trace of the number:
it is the game's id hashed, crc32, and the ids are a million), the optimal policy is known and
short, every turn has a reward the environment computes, and two episodes of a group that guessed
alike stand in the same state (GiGPO's anchor states).

Rewards, all computed by the environment:
- turn k: the information the guess and its answer give, log2(n_k / n_k+1) / log2(15), n_k the
  numbers still possible before it (15 at first; 1 once it is said): a halving about 0.26, a guess
  already ruled out (or not a number: answered "? ") 0. They add up to log2(15 / n_end) / log2(15)
  whatever the number of turns: 1 for any episode that ends knowing the number;
- outcome: 1 if a guess within MAX_TURNS is right, else 0.
The state a turn starts from (`states`): the guesses so far, as written (with the hidden number,
they fix every reply). The demonstrator guesses the middle of what is still possible, and with
probability SLIP_RATE another number still possible, uniformly: it finds the number within four
guesses 75 % of the time, so RL has room. A hard game (`is_hard`): one the optimal search needs all
four guesses for (an odd number, 8 of the 15). Nothing here raises on any text.
"""
import math
import random
import re
import zlib

from tasks import Task

LOW, HIGH = 1, 15
MAX_TURNS = 4          # guesses an episode allows (multiturn.py --turns)
MAX_NEW_TOKENS = 3     # a turn: two digits and the end token
CHAT_BLOCK_SIZE = 160  # sft.py's default --block_size with --chat: four turns in bytes-chat: 136
HIGHER, LOWER, UNREAD = "> ", "< ", "? "    # the environment's answers to a wrong guess
CHAT_REPLIES = {HIGHER: "higher", LOWER: "lower", UNREAD: "a number?"}
FEEDBACK_CHARS = 2     # the longest of them
SLIP_RATE = 0.5
HELD_OUT = 512
IDS = 10 ** 6
SPLIT_SEED = 1618
_PROMPT = re.compile(r"#([0-9]{1,7}) 1-15\?")
_GUESS = re.compile(r"\s*([0-9]{1,2})\s*")
_REPLY = re.compile("(> |< |\\? )")          # an episode's text: guess, reply, guess, ...


def secret(prompt):
    """The hidden number of a game's prompt, or None for a text that is not one."""
    m = _PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    return None if m is None else LOW + zlib.crc32(m.group(1).encode()) % (HIGH - LOW + 1)


def parse_guess(text):
    """A turn's number (after its reasoning, where it ends with </think>), or None."""
    m = _GUESS.fullmatch(text.rpartition("</think>")[2]) if isinstance(text, str) else None
    return None if m is None else int(m.group(1))


def feedback(prompt, guesses):
    """What the environment writes after the last of `guesses` (each turn's text): None when it
    is right (the episode ends), else HIGHER, LOWER, or UNREAD for a text that is not a number."""
    n, g = secret(prompt), parse_guess(guesses[-1]) if guesses else None
    if g is None or n is None:
        return UNREAD
    return None if g == n else HIGHER if n > g else LOWER


def _possible(n, guesses):
    """The numbers still possible after each guess (len(guesses) + 1 counts, the first 15)."""
    lo, hi, left = LOW, HIGH, [HIGH - LOW + 1]
    for text in guesses:
        g = parse_guess(text)
        if g == n:
            lo, hi = n, n                                  # said: only it is possible
        elif g is not None and lo <= g <= hi:
            lo, hi = (g + 1, hi) if n > g else (lo, g - 1)
        left.append(max(hi - lo + 1, 0))
    return left


def summary(prompt, guesses):
    """The game after `guesses` in the prompt's own words, the range still possible: "#482913
    9-12?" (multiturn.py --history summary); a text that is not a game's prompt as it is."""
    n, m = secret(prompt), _PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    if n is None:
        return prompt
    lo, hi = LOW, HIGH
    for text in guesses:
        g = parse_guess(text)
        if g is not None and g != n and lo <= g <= hi:
            lo, hi = (g + 1, hi) if n > g else (lo, g - 1)
    return f"#{m.group(1)} {lo}-{hi}?"


def turn_rewards(prompt, guesses):
    """Each turn's reward: log2(n_k / n_k+1) / log2(15), the information its answer gives."""
    n = secret(prompt)
    if n is None:
        return [0.0] * len(guesses)
    left = _possible(n, guesses)
    return [math.log2(a / b) / math.log2(HIGH - LOW + 1) for a, b in zip(left, left[1:])]


def outcome(prompt, guesses):
    """1.0 if a guess within MAX_TURNS is right."""
    n = secret(prompt)
    return float(n is not None and any(parse_guess(t) == n for t in guesses[:MAX_TURNS]))


def states(prompt, guesses):
    """The state each turn starts from, as the environment sees it: the game and the numbers
    guessed before it ("8", " 8" and "08" are 8, whatever reasoning came first; None unread)."""
    read = [parse_guess(t) for t in guesses]
    return [(prompt, *read[:k]) for k in range(len(guesses))]


def demonstrator(prompt, rng, slip_rate=SLIP_RATE):
    """The demonstrator's guesses until it is right or MAX_TURNS are used."""
    n, lo, hi, out = secret(prompt), LOW, HIGH, []
    while len(out) < MAX_TURNS:
        g = (lo + hi) // 2 if rng.random() >= slip_rate else rng.randint(lo, hi)
        out.append(str(g))
        if g == n:
            break
        lo, hi = (g + 1, hi) if n > g else (lo, g - 1)
    return out


def messages(prompt, guesses, answered=False):
    """The episode after the user's prompt as a chat (--chat): each guess an assistant message,
    each answer a user message (CHAT_REPLIES' words); answered: the last guess's answer too."""
    out = []
    for k, g in enumerate(guesses):
        out.append({"role": "assistant", "content": g})
        last = k + 1 == len(guesses) and not answered
        reply = None if last else feedback(prompt, guesses[:k + 1])
        if reply is not None:
            out.append({"role": "user", "content": CHAT_REPLIES[reply]})
    return out


def episode_text(prompt, guesses):
    """An episode as text, its end tokens left out: each guess, then the environment's answer."""
    replies = [feedback(prompt, guesses[:k + 1]) for k in range(len(guesses) - 1)]
    return "".join(g + (r or "") for g, r in zip(guesses, replies + [""]))


def guesses_of(text):
    """The guesses of an episode's text (episode_text, or the sampler's with its end tokens
    dropped)."""
    return _REPLY.split(text)[0::2] if isinstance(text, str) else []


def segments(text):
    """An episode's text as [(piece, written_by_environment)]: guess, answer, guess, ... (the
    policy's end token goes after each guess)."""
    pieces = _REPLY.split(text)
    return [(piece, k % 2 == 1) for k, piece in enumerate(pieces) if piece or k % 2 == 0]


# -----------------------------------------------------------------------------
# The interface every task module shares (tasks.Task)

def _split():
    rng = random.Random(SPLIT_SEED)
    held_out = sorted(rng.sample(range(IDS), HELD_OUT))
    return [f"#{i} 1-15?" for i in held_out], frozenset(held_out)


HELD_OUT_PROMPTS, _HELD = _split()


def eval_prompts():
    return list(HELD_OUT_PROMPTS)


def sample_prompts(rng, n, precedence_share=None):
    out = []
    while len(out) < n:
        i = rng.randrange(IDS)
        if i not in _HELD:
            out.append(f"#{i} 1-15?")
    return out


def demonstration(prompt, mistake=False):
    """The demonstrator's episode for this game as text (episode_text): a fixed draw per game
    (mistake: a draw that slips every time it can)."""
    rng = random.Random(zlib.crc32(prompt.encode()) if isinstance(prompt, str) else 0)
    return episode_text(prompt, demonstrator(prompt, rng, 1.0 if mistake else SLIP_RATE))


def reward(prompt, completion, format_weight=0.0):
    """The outcome of an episode's text."""
    return outcome(prompt, guesses_of(completion))


def is_hard(prompt):
    n = secret(prompt)
    return n is not None and n % 2 == 1


def task():
    score = lambda prompt, text: parse_guess(text) is not None and parse_guess(text) == secret(
        prompt)
    return Task("guess", MAX_NEW_TOKENS, eval_prompts, sample_prompts, demonstration,
                lambda prompt: demonstration(prompt, True), reward, lambda c: (c, c), score,
                is_hard, lambda tok: max(len(tok.encode(p)) for p in HELD_OUT_PROMPTS))
