"""
The benchmark task every algorithm is measured on: arithmetic where operator precedence matters,
the classic "2 + 2 x 3" precedence example made into a verifiable task.

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
import json
import os
import random
import re
from functools import lru_cache
from typing import NamedTuple

import torch

from model import fingerprint

OPERANDS = range(1, 10)
OP_PAIRS = [(a, b) for a in "+-*" for b in "+-*" if (a, b) != ("*", "*")]
PRECEDENCE_PAIRS = [("+", "*"), ("-", "*")]
HELD_OUT_PER_CLASS = 256
SPLIT_SEED = 1234
MAX_NEW_TOKENS = 24   # longest demonstration: "9+9=18,18*9=162#162" + EOS = 20 tokens

# Every pattern is matched with fullmatch: '$' would also match before a trailing newline ('4*2=8\n' a valid step)
_PROMPT = re.compile(r"([1-9])([+\-*])([1-9])([+\-*])([1-9])=")
_PAREN = re.compile(r"\(([1-9])([+\-])([1-9])\)\*([1-9])=")     # (a+b)*c= and (a-b)*c=
_NUM = r"-?[0-9]{1,9}"
_WELL_FORMED = re.compile(rf"{_NUM}[+\-*]{_NUM}={_NUM}(,{_NUM}[+\-*]{_NUM}={_NUM})*#{_NUM}")
_ANSWER = re.compile(r"#[ \t]*(-?[0-9]{1,12})\s*\Z")    # any trailing whitespace: spaces, \r\n, tabs


# -----------------------------------------------------------------------------
# Problems and their solutions

def _apply(x, op, y):
    return x + y if op == "+" else x - y if op == "-" else x * y


def solve(prompt, left_to_right=False):
    """'3+4*2=' -> (['4*2=8', '3+8=11'], 11). left_to_right=True ignores precedence (the mistake).
    A parenthesised problem '(3+4)*2=' -> (['3+4=7', '7*2=14'], 14): the parentheses first, always."""
    m = _PROMPT.fullmatch(prompt)
    if m is None and _PAREN.fullmatch(prompt):
        a, op, b, c = _PAREN.fullmatch(prompt).groups()
        ab = _apply(int(a), op, int(b))
        return [f"{a}{op}{b}={ab}", f"{ab}*{c}={ab * int(c)}"], ab * int(c)
    if m is None:
        raise ValueError(f"not a task prompt: {prompt!r}; expected like '3+4*2=' or '(3+4)*2=' (operands 1-9)")
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
    problems = [f"{a}{o1}{b}{o2}{c}=" for a in OPERANDS for b in OPERANDS for c in OPERANDS for o1, o2 in OP_PAIRS]
    prec = sorted(p for p in problems if is_precedence(p))
    other = sorted(p for p in problems if not is_precedence(p))
    rng = random.Random(SPLIT_SEED)
    rng.shuffle(prec)
    rng.shuffle(other)
    n = HELD_OUT_PER_CLASS
    held_out = tuple(p for pair in zip(prec[:n], other[:n]) for p in pair)  # alternating: any prefix is balanced
    return held_out, tuple(prec[n:]), tuple(other[n:])


def all_prompts():
    """Every problem of the task, held-out ones included (5832)."""
    return list(_split()[0] + _split()[1] + _split()[2])


@lru_cache(maxsize=None)
def _max_prompt_tokens(encode, parenthesised):
    prompts = all_prompts() + ([parenthesise(p) for p in all_prompts() if is_precedence(p)] if parenthesised else [])
    return max(len(encode(p)) for p in prompts)


def max_prompt_tokens(tokenizer, parenthesised=False):
    """The longest prompt of the task in `tokenizer`'s tokens (6 with the byte tokenizer; 8 with the parenthesised
    problems)."""
    return _max_prompt_tokens(tokenizer.encode, parenthesised)


# -----------------------------------------------------------------------------
# Parenthesised problems, (a+b)*c= and (a-b)*c=: the problems a left-to-right attempt at a+b*c= does solve.
# Never in the default data: for hindsight relabelling (expert_iteration.py --hindsight) and its evaluation.

def is_parenthesised(prompt):
    return isinstance(prompt, str) and _PAREN.fullmatch(prompt) is not None


def parenthesise(prompt):
    """'3+4*2=' -> '(3+4)*2=': the problem whose correct derivation is a+b*c='s left-to-right mistake."""
    if not is_precedence(prompt):
        raise ValueError(f"{prompt!r} is not of the form a+b*c= or a-b*c=")
    return f"({prompt[:3]}){prompt[3:]}"


def paren_eval_prompts():
    """The held-out parenthesised problems (256): the images of the held-out precedence problems, so that a training
    prompt a+b*c= is never relabelled into a held-out (a+b)*c=."""
    return [parenthesise(p) for p in eval_prompts() if is_precedence(p)]


def sample_paren_prompts(rng, n):
    """n parenthesised training problems (never held-out ones); rng is a random.Random."""
    _, prec, _ = _split()
    return [parenthesise(rng.choice(prec)) for _ in range(n)]


def hindsight_prompt(prompt, completion):
    """Hindsight relabelling (Andrychowicz et al. 2017): the problem a failed attempt did solve, or None. A wrong
    completion of a+b*c= that is exactly the left-to-right derivation solves (a+b)*c=, exactly."""
    if not isinstance(completion, str) or not is_precedence(prompt) or reward(prompt, completion) == 1.0:
        return None
    target = parenthesise(prompt)
    return target if completion == demonstration(target) else None


def eval_prompts():
    """The fixed held-out set: 512 prompts, precedence problems and others alternating (256 each)."""
    return list(_split()[0])


def sample_prompts(rng, n, precedence_share=0.5):
    """n training prompts (never held-out ones); rng is a random.Random."""
    if not 0.0 <= precedence_share <= 1.0:
        raise ValueError(f"precedence_share = {precedence_share}; allowed: 0 <= precedence_share <= 1")
    _, prec, other = _split()
    return [rng.choice(prec) if rng.random() < precedence_share else rng.choice(other) for _ in range(n)]


def sample_demonstrations(rng, n, mistake_rate=0.6, precedence_share=0.5):
    """n (prompt, completion) pairs for SFT; a share mistake_rate of them evaluated left to right."""
    if not 0.0 <= mistake_rate <= 1.0:
        raise ValueError(f"mistake_rate = {mistake_rate}; allowed: 0 <= mistake_rate <= 1")
    return [(p, demonstration(p, left_to_right=rng.random() < mistake_rate))
            for p in sample_prompts(rng, n, precedence_share)]


# -----------------------------------------------------------------------------
# Verifier

def parse_answer(completion):
    """The integer after the last '#' (only whitespace may follow it), or None."""
    if not isinstance(completion, str):
        return None
    m = _ANSWER.search(completion[-64:])  # an answer has at most 13 characters; the tail is enough
    return int(m[1]) if m else None


def is_well_formed(completion):
    """Steps, '#' and an integer, and nothing after it: the format bonus is strict where the reward is not (reward
    accepts whitespace after the answer)."""
    return isinstance(completion, str) and len(completion) <= 256 and _WELL_FORMED.fullmatch(completion) is not None


def reward(prompt, completion, format_weight=0.0):
    """1.0 for the correct final answer, else 0.0; plus format_weight if the completion is well formed."""
    try:
        truth = answer(prompt)
    except (ValueError, TypeError):
        return 0.0
    correct = float(parse_answer(completion) == truth)
    return correct + format_weight * float(is_well_formed(completion))


# -----------------------------------------------------------------------------
# Step labels: which steps of a completion are right (the exact labels of prm.py's process reward model)

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
    """One 0/1 label per step of `completion` (split_steps): 1 when the steps up to and including it are the start
    of the correct derivation of `prompt`, else 0. The correct derivation is task.solve's: operator precedence
    respected (the multiplication first, then left to right), each step one operation with its right result,
    operands in the derivation's order. The final step must also end with the right answer ('#r', trailing
    whitespace allowed as the verifier does), and a step with '#' must be the final one. Once a step is wrong, every
    later step is too (a prefix with a wrong step starts no correct derivation).
    So on 9+8*1= the left-to-right '9+8=17,17*1=17#17' gets [0, 0] although its answer is right: the first step
    breaks precedence. Never raises: a prompt that is not a task problem gives all 0, a non-string completion []."""
    if not isinstance(completion, str):
        return []
    steps = split_steps(completion)
    try:
        correct, result = solve(prompt)
    except (ValueError, TypeError):
        return [0] * len(steps)
    labels, good = [], True
    for i, step in enumerate(steps):
        final = i == len(correct) - 1                            # the derivation's last step: it carries the answer
        equation, hashes = step.split("#", 1)[0], step.count("#")
        good = (good and i < len(correct) and _equation(equation) == _equation(correct[i])
                and hashes == int(final) and (not final or parse_answer(step) == result))
        labels.append(int(good))
    return labels


def read_positions(prompt_ids, ids, tok, kind, finished=True):
    """Where a verifier reads its scores, as indices into completion_batch's row (prompt, completion, EOS): the ORM
    ("orm") at the EOS; the PRM ("prm") at the last token of each step: every ',' token and, when the completion is
    finished, the EOS (the final step, with its answer). A partial path (finished=False) ends with its ','; the EOS
    completion_batch appends after it is never read (the model is causal)."""
    start, eos = len(prompt_ids), len(prompt_ids) + len(ids)
    if kind == "orm":
        return [eos]
    commas = [start + j for j, t in enumerate(ids) for _ in range(tok.decode([t]).count(","))]
    return commas + ([eos] if finished else [])


# -----------------------------------------------------------------------------
# Evaluation and preference pairs (these need a model; the model comes from model.py)

@torch.no_grad()
def complete(model, tokenizer, prompts, num_samples=1, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS,
             batch_size=256, generator=None, return_ids=False):
    """Completions (strings, EOS dropped) for each prompt: num_samples consecutive entries per prompt.
    return_ids=True also returns each completion's token ids as sampled (EOS dropped): (texts, ids)."""
    device = next(model.parameters()).device
    texts, ids = [], []
    for i in range(0, len(prompts), batch_size):
        idx, mask = tokenizer.encode_batch(prompts[i:i + batch_size], device)
        tokens, cmask, _ = model.generate(idx, mask, max_new_tokens, tokenizer.eos_id, tokenizer.pad_id,
                                          num_samples=num_samples, temperature=temperature, generator=generator)
        texts += tokenizer.decode_completions(tokens, cmask)
        if return_ids:
            ids += [[t for t, keep in zip(row, m) if keep and t != tokenizer.eos_id]
                    for row, m in zip(tokens.tolist(), cmask.tolist())]
    return (texts, ids) if return_ids else texts


class Rollout(NamedTuple):
    """A batch of sampled completions, a prompt's G samples on consecutive rows (B = P*G rows)."""
    prompt: torch.Tensor         # (B, Tp) prompt ids, left-padded
    prompt_mask: torch.Tensor    # (B, Tp) 1.0 on prompt tokens
    tokens: torch.Tensor         # (B, Tn) completion ids, right-padded
    mask: torch.Tensor           # (B, Tn) 1.0 on completion tokens, through each EOS
    truncated: torch.Tensor      # (B,) bool: no EOS within max_new_tokens
    rewards: torch.Tensor        # (B,) float32: the verifier's reward (correct + format_weight * well formed)
    correct: torch.Tensor        # (B,) bool: the final answer is right (the reward without the format bonus)


@torch.no_grad()
def rollout(policy, tokenizer, prompts, group_size, temperature, max_new_tokens=MAX_NEW_TOKENS, format_weight=0.0,
            generator=None):
    """The rollout of the RL scripts: group_size completions per prompt at `temperature` (the full softmax, no
    top-k), scored by the verifier, a prompt's samples on consecutive rows; a Rollout on the policy's device."""
    device = next(policy.parameters()).device
    prompt, prompt_mask = tokenizer.encode_batch(prompts, device)                     # (P, Tp)
    tokens, mask, truncated = policy.generate(prompt, prompt_mask, max_new_tokens, tokenizer.eos_id, tokenizer.pad_id,
                                              num_samples=group_size, temperature=temperature, generator=generator)
    completions = tokenizer.decode_completions(tokens, mask)
    G = group_size
    rewards = torch.tensor([reward(prompts[i // G], c, format_weight) for i, c in enumerate(completions)],
                           device=device)                                             # (P*G,)
    correct = torch.tensor([reward(prompts[i // G], c) == 1.0 for i, c in enumerate(completions)], device=device)
    return Rollout(prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), tokens, mask, truncated,
                   rewards, correct)


def concat_rollouts(batches, pad_id):
    """Stack Rollouts: prompts left-padded and completions right-padded to the longest, so that each row reads
    exactly as it did alone (padding is masked out of attention and positions)."""
    Tp, Tn = max(b.prompt.size(1) for b in batches), max(b.tokens.size(1) for b in batches)
    left = lambda x, n, v: torch.nn.functional.pad(x, (n - x.size(1), 0), value=v)
    right = lambda x, n, v: torch.nn.functional.pad(x, (0, n - x.size(1)), value=v)
    return Rollout(torch.cat([left(b.prompt, Tp, pad_id) for b in batches]),
                   torch.cat([left(b.prompt_mask, Tp, 0.0) for b in batches]),
                   torch.cat([right(b.tokens, Tn, pad_id) for b in batches]),
                   torch.cat([right(b.mask, Tn, 0.0) for b in batches]),
                   *(torch.cat([b[i] for b in batches]) for i in (4, 5, 6)))


def evaluate(model, tokenizer, prompts=None, num_samples=4, temperature=1.0, seed=0):
    """Greedy accuracy and sampled pass@1 (mean correctness of num_samples samples at `temperature`)
    on the held-out set (or `prompts`); also greedy accuracy on precedence and on other problems."""
    prompts = eval_prompts() if prompts is None else prompts
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    greedy = complete(model, tokenizer, prompts, temperature=0.0)
    g = torch.Generator(device=device).manual_seed(seed)
    sampled = complete(model, tokenizer, prompts, num_samples, temperature, generator=g)
    model.train(was_training)
    correct = [reward(p, c) for p, c in zip(prompts, greedy)]
    prec = [r for p, r in zip(prompts, correct) if is_precedence(p)]
    other = [r for p, r in zip(prompts, correct) if not is_precedence(p)]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    return {
        "greedy_accuracy": mean(correct),
        "pass_at_1": mean([reward(prompts[i // num_samples], c) for i, c in enumerate(sampled)]),
        "greedy_accuracy_precedence": mean(prec),
        "greedy_accuracy_other": mean(other),
    }


def synthetic_mistake(prompt):
    """A wrong completion: left to right where that changes the answer, else the last result off by one."""
    ltr = demonstration(prompt, left_to_right=True)
    if parse_answer(ltr) != answer(prompt):
        return ltr
    steps, r = solve(prompt)
    steps[-1] = steps[-1].rsplit("=", 1)[0] + f"={r + 1}"
    return ",".join(steps) + f"#{r + 1}"


PAIR_FORMAT = 2   # version of the cached pair files; a cache of another version is rebuilt


def _valid_pairs(saved, meta):
    """A cache is used only when it is exactly what preference_pairs would write for `meta`."""
    if not isinstance(saved, dict) or saved.get("format") != PAIR_FORMAT or saved.get("meta") != meta:
        return False
    pairs = saved.get("pairs")
    if not isinstance(pairs, list) or len(pairs) != len(meta["prompts"]):
        return False
    for pair, prompt in zip(pairs, meta["prompts"]):
        if not isinstance(pair, dict) or pair.get("prompt") != prompt:
            return False
        if not all(isinstance(pair.get(k), str) for k in ("chosen", "rejected", "source")):
            return False
        if not all(isinstance(pair.get(k), list) and all(isinstance(i, int) for i in pair[k])
                   for k in ("chosen_ids", "rejected_ids")):
            return False
    return True


def preference_pairs(prompts, policy=None, tokenizer=None, samples_per_prompt=4, temperature=1.0, seed=0,
                     cache=None):
    """One pair per prompt: {"prompt", "chosen", "rejected", "source", "chosen_ids", "rejected_ids"}; chosen is
    correct, rejected is not. Both are sampled from `policy` where its samples include a correct and an incorrect
    completion; the missing side is filled with the correct demonstration (chosen) or synthetic_mistake (rejected).
    source says which: "sampled/sampled", "sampled/synthetic", "demo/sampled" or "demo/synthetic".
    *_ids are the completion's token ids (EOS not included): for a sampled side, the ids the policy sampled (a
    decoded string need not encode back to them); for a filled-in side, tokenizer.encode of the text.
    cache: a JSON path; reused when it holds exactly these prompts and settings, else (re)written."""
    meta = {"prompts": list(prompts), "samples_per_prompt": samples_per_prompt, "temperature": temperature,
            "seed": seed, "policy": None if policy is None else f"{fingerprint(policy):.12e}",
            "tokenizer": getattr(tokenizer, "name", None)}
    if cache is not None and os.path.exists(cache):
        try:
            with open(cache) as f:
                saved = json.load(f)
            if _valid_pairs(saved, meta):
                return saved["pairs"]
        except (OSError, ValueError):
            pass  # unreadable, stale or malformed cache: make the pairs again
    samples = [[] for _ in prompts]
    if policy is not None:
        g = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
        was_training = policy.training
        policy.eval()
        texts, ids = complete(policy, tokenizer, list(prompts), samples_per_prompt, temperature, generator=g,
                              return_ids=True)
        policy.train(was_training)
        k = samples_per_prompt
        samples = [list(zip(texts[i * k:(i + 1) * k], ids[i * k:(i + 1) * k])) for i in range(len(prompts))]
    pairs = []
    for prompt, outs in zip(prompts, samples):
        good = [(c, i) for c, i in outs if reward(prompt, c) == 1.0]
        bad = [(c, i) for c, i in outs if reward(prompt, c) == 0.0]
        text = demonstration(prompt)
        (chosen, chosen_ids), chosen_src = (good[0], "sampled") if good else ((text, tokenizer.encode(text)), "demo")
        text = synthetic_mistake(prompt)
        if bad:
            (rejected, rejected_ids), rejected_src = bad[0], "sampled"
        else:
            (rejected, rejected_ids), rejected_src = (text, tokenizer.encode(text)), "synthetic"
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                      "source": f"{chosen_src}/{rejected_src}",
                      "chosen_ids": list(chosen_ids), "rejected_ids": list(rejected_ids)})
    if cache is not None:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
        tmp = f"{cache}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"format": PAIR_FORMAT, "meta": meta, "pairs": pairs}, f)
        os.replace(tmp, cache)
    return pairs


def completion_batch(prompts, completions, tokenizer, device="cpu"):
    """Right-padded batch of prompt + completion + EOS sequences: the prompt encoded on its own, each completion as
    token ids (a list of ints, as sampled; EOS not included) or as text (encoded). Returns tokens (B, T),
    attention mask (B, T) 1.0 on real tokens, and completion mask (B, T-1) 1.0 where the target token t+1 is a
    completion token or the final EOS (the positions a teacher-forced loss or a sequence log-prob sums over)."""
    ids = [(tokenizer.encode(p), (tokenizer.encode(c) if isinstance(c, str) else list(c)) + [tokenizer.eos_id])
           for p, c in zip(prompts, completions)]
    T = max(len(p) + len(c) for p, c in ids)
    tokens = torch.full((len(ids), T), tokenizer.pad_id, dtype=torch.long)
    attn = torch.zeros(len(ids), T)
    mask = torch.zeros(len(ids), T - 1)
    for i, (p, c) in enumerate(ids):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1.0
        mask[i, len(p) - 1:len(p) + len(c) - 1] = 1.0   # the predictions of c[0] .. EOS
    return tokens.to(device), attn.to(device), mask.to(device)


def pair_batch(pairs, tokenizer, device="cpu"):
    """Pairs -> completion_batch of 2B sequences: chosen rows 0..B-1, rejected rows B..2B-1, each completion as the
    token ids that were sampled (a decoded string need not encode back to them)."""
    return completion_batch([p["prompt"] for p in pairs] * 2,
                            [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs], tokenizer, device)


def preference_dataset(policy, tokenizer, n_train=2048, seed=0, cache_dir="out"):
    """The preference pairs reward_model.py, dpo.py and ipo.py share: (train, held_out) lists of pairs.
    Train pairs are on n_train training prompts, held-out pairs on the 512 held-out prompts; both sampled
    from `policy` (the SFT policy) and cached in cache_dir/pairs_train.json and cache_dir/pairs_eval.json."""
    train_prompts = sample_prompts(random.Random(seed), n_train)
    train = preference_pairs(train_prompts, policy, tokenizer, seed=seed,
                             cache=os.path.join(cache_dir, "pairs_train.json"))
    held_out = preference_pairs(eval_prompts(), policy, tokenizer, seed=seed + 1,
                                cache=os.path.join(cache_dir, "pairs_eval.json"))
    return train, held_out
