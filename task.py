"""
What every task shares: the task in use (--task, --format), sampling and scoring completions, the held-out
evaluation, and the preference pairs. The problems themselves live in tasks/, one module per task; the scripts
call `task.use(args)` once (plumbing.Run does it) and every function here draws from that task.

Formats (--format):
    plain   the task's own: the prompt as the task writes it, the completion's reasoning, a '#' (GSM8K: '####')
            and the answer (tasks/*.py show each).
    r1      DeepSeek-R1-Zero's template (DeepSeek-AI 2025, arXiv 2501.12948, Table 1), word for word, with the
            task's prompt as the question:
                A conversation between User and Assistant. The user asks a question, and the Assistant solves it.
                The assistant first thinks about the reasoning process in the mind and then provides the user with
                the answer. The reasoning process and answer are enclosed within <think> </think> and <answer>
                </answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here
                </answer>. User: {prompt}. Assistant:
            A completion is ' <think>{reasoning}</think> <answer>{answer}</answer>'. Reward: the task's verifier on
            the text of the last <answer> tag (1 or 0), plus --format_weight when the whole completion is exactly
            one think block then one answer block (the paper's format reward; its weight is not published). The
            template is about 400 bytes: with the byte tokenizer it needs a model whose block_size exceeds that.
"""
import json
import os
import random
import re
from functools import lru_cache
from typing import NamedTuple


import torch
import torch.nn.functional as F

import sampler
from model import KVCache, fingerprint
from tasks import arithmetic, countdown, gsm8k, toolcalc

# -----------------------------------------------------------------------------
# The task in use: --task and --format choose it, use(args) sets it, every function below reads it

TASKS = ("arithmetic", "countdown", "gsm8k", "toolcalc")
FORMATS = ("plain", "r1")
R1_TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
               "The assistant first thinks about the reasoning process in the mind and then provides the user with "
               "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
               "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here "
               "</answer>. User: {prompt}. Assistant:")
_R1_PROMPT = re.compile(re.escape(R1_TEMPLATE).replace(re.escape("{prompt}"), "(.*)"), re.S)
_R1_COMPLETION = re.compile(r"\s*<think>((?:(?!</?think>|</?answer>).)*)</think>\s*"
                            r"<answer>((?:(?!</?think>|</?answer>).)*)</answer>\s*", re.S)
R1_EXTRA_TOKENS = 34           # ' <think></think> <answer></answer>' in bytes: what the R1 format adds to a completion
R1_MAX_CHARS = 20_000          # a longer R1 completion scores 0 unread (its tag regexes are quadratic in the length)
_R1_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

_task, _format, _chat = arithmetic.task(), "plain", False     # the default; use(args) replaces them
_max_calls = toolcalc.MAX_CALLS                  # calls answered per episode (agent.py --max_calls sets it)
calculator = toolcalc.calculator                 # the tool: calculator('12*46') -> '552'; "error..." for the rest


def check_args(parser, args):
    """The task flags (plumbing.add_task_flags) checked at parse time (plumbing.parser calls this): --data with gsm8k
    and only with it, at most two files. The files themselves are read, and refused line by line, by use()."""
    if getattr(args, "task", None) is None:
        return
    if args.task == "gsm8k" and not args.data:
        parser.error("--task gsm8k needs --data FILE.jsonl [HELD_OUT.jsonl] (GSM8K's format; nothing is downloaded)")
    if args.task != "gsm8k" and args.data:
        parser.error(f"--data is for --task gsm8k; --task {args.task} is generated in code")
    if args.data and len(args.data) > 2:
        parser.error(f"--data takes one or two files (training, held-out); got {len(args.data)}")
    if args.task == "toolcalc":
        check_tool_args(parser, args)
    for flag in ("out", "init", "rm"):                     # the defaults move to the task's folder (folder())
        default = {"out": "out", "init": os.path.join("out", "sft.pt"), "rm": os.path.join("out", "rm.pt")}[flag]
        if getattr(args, flag, None) == default:
            setattr(args, flag, folder(args) if flag == "out" else default_path(default, args))
    if getattr(args, "max_new_tokens", 0) is None:         # the task's completion budget (default_max_new_tokens)
        budget = {"arithmetic": arithmetic.MAX_NEW_TOKENS, "gsm8k": gsm8k.MAX_NEW_TOKENS,
                  "toolcalc": toolcalc.MAX_NEW_TOKENS, "countdown": countdown.MAX_NEW_TOKENS[args.countdown_numbers]
                  }[args.task]
        args.max_new_tokens = budget + (R1_EXTRA_TOKENS if args.format == "r1" else 0)


def check_tool_args(parser, args):
    """--task toolcalc: its episodes need the environment, which only agent.py (and sft.py, on demonstrations) run; the
    plain format only; sft.py's --block_size default becomes toolcalc.BLOCK_SIZE (two attempts must fit) and its --pos
    default toolcalc.POSITIONS."""
    if not (hasattr(args, "max_calls") or hasattr(args, "mistake_rate")):
        parser.error("--task toolcalc needs its environment (the calculator answering calls): train on it with sft.py "
                     "(demonstrations) and agent.py (episodes)")
    if args.format != "plain":
        parser.error(f"--task toolcalc is defined in the plain format only; got --format {args.format}")
    if hasattr(args, "pos") and args.pos is None:
        args.pos = toolcalc.POSITIONS
    if getattr(args, "block_size", None) == 64:
        args.block_size = toolcalc.BLOCK_SIZE
    elif getattr(args, "block_size", toolcalc.BLOCK_SIZE) < toolcalc.BLOCK_SIZE:
        parser.error(f"--block_size {args.block_size} is too short for --task toolcalc's two-attempt demonstrations; "
                     f"allowed: --block_size >= {toolcalc.BLOCK_SIZE}")


def require_arithmetic(parser, args, what):
    """A parse error unless args choose the arithmetic task in its plain format: for what only it defines."""
    if (args.task, args.format) != ("arithmetic", "plain"):
        parser.error(f"{what} is defined for the arithmetic task in its plain format only; got --task {args.task} "
                     f"--format {args.format}")


def folder(args):
    """Where a script's default outputs go: out/ for the arithmetic task in the plain format, else out/<task>/ (with
    the setting: out/countdown4_r1/), so that the tasks' checkpoints never overwrite each other."""
    name, fmt = getattr(args, "task", "arithmetic"), getattr(args, "format", "plain")
    if name == "arithmetic" and fmt == "plain":
        return "out"
    numbers = str(args.countdown_numbers) if name == "countdown" and args.countdown_numbers != 3 else ""
    rule = "_atmost" if name == "countdown" and getattr(args, "countdown_rule", "exactly") == "at_most" else ""
    return os.path.join("out", name + numbers + rule + ("_r1" if fmt == "r1" else ""))


def default_path(path, args):
    """A default checkpoint path (out/sft.pt) for the task in `args` (out/countdown/sft.pt)."""
    return os.path.join(folder(args), os.path.basename(path))


def flags(args):
    """The task flags of `args`, to hand to a script that builds a missing prerequisite."""
    if getattr(args, "task", None) is None:
        return []
    out = ["--task", args.task, "--format", args.format, "--countdown_numbers", str(args.countdown_numbers),
           "--countdown_rule", getattr(args, "countdown_rule", "exactly")] + (["--chat"] if getattr(args, "chat",
                                                                                                   False) else [])
    return out + (["--data", *args.data] if args.data else [])


def use(args):
    """Make args.task (in args.format) the task every function here uses; returns a line that says which.
    ValueError for a --data file it cannot use (naming the file and the line)."""
    global _task, _format, _chat, _max_calls
    name, skipped = getattr(args, "task", "arithmetic"), 0
    _chat = bool(getattr(args, "chat", False))
    _max_calls = getattr(args, "max_calls", toolcalc.MAX_CALLS)
    if name == "countdown":
        chosen = countdown.task(n_numbers=args.countdown_numbers, rule=getattr(args, "countdown_rule", "exactly"))
    elif name == "gsm8k":
        chosen, skipped = gsm8k.task(args.data)
    elif name == "toolcalc":
        chosen = toolcalc.task()
    else:
        chosen = arithmetic.task()
    _task, _format = chosen, getattr(args, "format", "plain")
    line = f"task {name} ({_format} format{', in the chat template' if _chat else ''}), " \
           f"{len(_task.eval_prompts())} held-out problems"
    if name == "countdown":
        line += f", each number used {getattr(args, 'countdown_rule', 'exactly').replace('_', ' ')} once"
    if skipped:
        line += f", {skipped} line{'s' * (skipped != 1)} skipped for an answer with no number after '#### '"
    return line


def name():
    return _task.name


def chat():
    """--chat: every prompt through the checkpoint's chat template (plumbing.load_model sets the tokenizer to it)."""
    return _chat


def default_max_new_tokens():
    """The task's completion budget (the scripts' --max_new_tokens default); the R1 format's tags take 34 more."""
    return _task.max_new_tokens + (R1_EXTRA_TOKENS if _format == "r1" else 0)


def eval_prompts():
    """The fixed held-out prompts, in the format in use."""
    return [_prompt(p) for p in _task.eval_prompts()]


def sample_prompts(rng, n, precedence_share=None):
    """n training prompts (never held-out ones); rng is a random.Random. precedence_share: the share of problems
    where the demonstrator's slip shows (None: the task's own mix)."""
    if precedence_share is not None and not 0.0 <= precedence_share <= 1.0:
        raise ValueError(f"precedence_share = {precedence_share}; allowed: 0 <= precedence_share <= 1")
    return [_prompt(p) for p in _task.sample_prompts(rng, n, precedence_share)]


def sample_demonstrations(rng, n, mistake_rate=0.6, precedence_share=None):
    """n (prompt, completion) pairs for SFT; a share mistake_rate of them with the task's demonstrator's slip."""
    if not 0.0 <= mistake_rate <= 1.0:
        raise ValueError(f"mistake_rate = {mistake_rate}; allowed: 0 <= mistake_rate <= 1")
    return [(p, demonstration(p, mistake=rng.random() < mistake_rate))
            for p in sample_prompts(rng, n, precedence_share)]


def demonstration(prompt, mistake=False):
    return _completion(_task.demonstration(_problem(prompt), mistake))


def synthetic_mistake(prompt):
    return _completion(_task.synthetic_mistake(_problem(prompt)))


def is_precedence(prompt):
    return _task.is_precedence(_problem(prompt))


def max_prompt_tokens(tokenizer):
    """The longest prompt of the task, in the format in use, in `tokenizer`'s tokens, as tokenizer.encode_prompt
    encodes it: with the BOS the tokenizer puts first, or inside its chat template (2 tokens allowed for merges
    across the message's edges)."""
    n = _task.max_prompt_tokens(tokenizer)
    n += len(tokenizer.encode_prompt("")) + (2 if getattr(tokenizer, "chat", None) is not None else 0)
    return n if _format == "plain" else n + len(tokenizer.encode(R1_TEMPLATE.format(prompt="")))


def reward(prompt, completion, format_weight=0.0):
    """1.0 for a correct answer, else 0.0; plus format_weight if the completion is well formed. Never raises."""
    if _format == "plain":
        return _task.reward(prompt, completion, format_weight)
    if not isinstance(completion, str) or len(completion) > R1_MAX_CHARS:   # unread: the tag regexes stay fast
        return 0.0
    problem = _problem(prompt)
    answers = _R1_ANSWER.findall(completion)
    correct = bool(answers) and problem is not None and _task.score_answer(problem, answers[-1])
    well_formed = isinstance(completion, str) and _R1_COMPLETION.fullmatch(completion) is not None
    return float(correct) + format_weight * float(well_formed)


def _prompt(problem):                    # the task's prompt -> the prompt in the format in use
    return problem if _format == "plain" else R1_TEMPLATE.format(prompt=problem)


def _problem(prompt):                    # and back (None for an r1 prompt that is not the template)
    if _format == "plain":
        return prompt
    m = _R1_PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    return m[1] if m else None


def _completion(text):                   # the task's completion -> the completion in the format in use
    if _format == "plain":
        return text
    reasoning, answer = _task.split_answer(text)
    return f" <think>{reasoning.strip()}</think> <answer>{answer.strip()}</answer>"


def read_positions(prompt_ids, ids, tok, kind, finished=True):
    """Where a verifier reads its scores, as indices into completion_batch's row (the prompt, then the completion's
    ids: as sampled, its stop token last when one ended it): the ORM ("orm") at the last token (the stop token); the
    PRM ("prm") at the last token of each step: every ',' token and, when the completion is finished, the last (the
    final step, with its answer). A partial path (finished=False) ends with its ','."""
    start, last = len(prompt_ids), len(prompt_ids) + len(ids) - 1
    if kind == "orm":
        return [last]
    commas = [start + j for j, t in enumerate(ids) for _ in range(tok.decode([t]).count(","))]
    return commas + ([last] if finished else [])


# -----------------------------------------------------------------------------
# Evaluation and preference pairs (these need a model; the model comes from model.py)

@torch.no_grad()
def complete(model, tokenizer, prompts, num_samples=1, temperature=0.0, max_new_tokens=None,
             batch_size=256, generator=None, return_ids=False):
    """Completions (strings, the stop token dropped) for each prompt: num_samples consecutive entries per prompt.
    return_ids=True also returns each completion's token ids as sampled, the stop token that ended it included (none
    in one cut at max_new_tokens): (texts, ids), ids as completion_batch takes them."""
    device = next(model.parameters()).device
    max_new_tokens = max_new_tokens or default_max_new_tokens()
    texts, ids = [], []
    for i in range(0, len(prompts), batch_size):
        if _task.name == "toolcalc":                   # episodes: the calculator answers the calls
            e = episodes(model, tokenizer, prompts[i:i + batch_size], num_samples, temperature, max_new_tokens,
                         generator=generator)
            tokens, cmask = e.tokens, e.mask
        else:
            idx, mask = tokenizer.encode_batch(prompts[i:i + batch_size], device)
            tokens, cmask, _ = sampler.generate(model, idx, mask, max_new_tokens, tokenizer.stop_ids, tokenizer.pad_id,
                                                num_samples=num_samples, temperature=temperature, generator=generator)
        texts += tokenizer.decode_completions(tokens, cmask)
        if return_ids:
            ids += [[t for t, keep in zip(row, m) if keep] for row, m in zip(tokens.tolist(), cmask.tolist())]
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
def rollout(policy, tokenizer, prompts, group_size, temperature, max_new_tokens=None, format_weight=0.0,
            generator=None, return_logprobs=False):
    """The rollout of the RL scripts: group_size completions per prompt at `temperature` (the full softmax, no
    top-k), scored by the verifier, a prompt's samples on consecutive rows; a Rollout on the policy's device.
    return_logprobs: (Rollout, the sampler's log-probs of the sampled tokens (P*G, Tn)), see sampler.generate."""
    device = next(policy.parameters()).device
    max_new_tokens = max_new_tokens or default_max_new_tokens()
    prompt, prompt_mask = tokenizer.encode_batch(prompts, device)                     # (P, Tp)
    tokens, mask, truncated, *logp = sampler.generate(policy, prompt, prompt_mask, max_new_tokens, tokenizer.stop_ids,
                                                      tokenizer.pad_id, num_samples=group_size,
                                                      temperature=temperature, generator=generator,
                                                      return_logprobs=return_logprobs)
    completions = tokenizer.decode_completions(tokens, mask)
    G = group_size
    rewards = torch.tensor([reward(prompts[i // G], c, format_weight) for i, c in enumerate(completions)],
                           device=device)                                             # (P*G,)
    correct = torch.tensor([reward(prompts[i // G], c) == 1.0 for i, c in enumerate(completions)], device=device)
    batch = Rollout(prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), tokens, mask, truncated,
                    rewards, correct)
    return (batch, logp[0]) if return_logprobs else batch


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


class Episodes(NamedTuple):
    """A batch of episodes (--task toolcalc): each the prompt, then one sequence of the policy's and the environment's
    tokens, an episode's G samples on consecutive rows (B = P*G rows). Built from token ids as they were sampled and
    written, never re-tokenised from text, so the masks are exact whatever the tokenizer."""
    prompt: torch.Tensor         # (B, Tp) prompt ids, left-padded
    prompt_mask: torch.Tensor    # (B, Tp) 1.0 on prompt tokens
    tokens: torch.Tensor         # (B, Tn) after the prompt: the policy's and the environment's tokens, right-padded
    mask: torch.Tensor           # (B, Tn) 1.0 on every real token (what attention sees)
    sampled: torch.Tensor        # (B, Tn) 1.0 on the tokens the policy sampled (what a loss may see); 0 elsewhere
    turn: torch.Tensor           # (B, Tn) int64: the attempt each token belongs to (0, 1, ...)
    truncated: torch.Tensor      # (B,) bool: an attempt ran out of max_new_tokens
    correct: torch.Tensor        # (B, turns) float32: 1.0 where that attempt's answer is right
    calls: torch.Tensor          # (B, turns) float32: calls the policy opened in each attempt
    malformed: torch.Tensor      # (B, turns) float32: of those, the ones the tool did not answer


_POLICY, _ENV = 1, 2             # who wrote a token (0: padding)


class _Episode:
    """One episode's state while it is sampled: what is written so far, by whom, and what the environment has yet to
    write (a tool reply, the revision prompt)."""

    def __init__(self, turns):
        self.ids, self.who, self.turn_of, self.queue, self.segment = [], [], [], [], []
        self.turn, self.used, self.done, self.truncated = 0, 0, False, False
        self.answer_ids = [[] for _ in range(turns)]      # each attempt's tokens, the tool's replies included
        self.calls, self.malformed = [0] * turns, [0] * turns

    def write(self, token, who, counts=True):
        self.ids.append(token)
        self.who.append(who)
        self.turn_of.append(self.turn)
        self.used += counts
        if counts:
            self.answer_ids[self.turn].append(token)


@lru_cache(maxsize=8)
def _markers(tokenizer):
    """(ids whose text holds CALL_OPEN, ids whose text holds CALL_CLOSE), the tokenizer's added tokens excepted
    (<|im_start|> is not a call's end)."""
    special = {tokenizer.eos_id, tokenizer.pad_id, *tokenizer.stop_ids, *tokenizer.added_ids}
    texts = [(i, tokenizer.decode([i])) for i in range(tokenizer.vocab_size) if i not in special]
    opens, closes = [i for i, t in texts if toolcalc.CALL_OPEN in t], [i for i, t in texts if toolcalc.CALL_CLOSE in t]
    return opens, frozenset(closes)


def _unclosed_call(e, tokenizer):
    """At the end of an attempt: a call opened and never closed is a call, and malformed."""
    text = tokenizer.decode(e.segment)
    if text.rfind(toolcalc.CALL_OPEN) > text.rfind(toolcalc.CALL_CLOSE):
        e.calls[e.turn] += 1
        e.malformed[e.turn] += 1


def _advance(e, sampled, tokenizer, closes, revise, turns, budget, max_calls):
    """Write one position of episode e and return the token written: the environment's next queued token if it has
    one, else the policy's `sampled` token, acted on: a token that closes a call gets the tool's reply queued (calls
    past max_calls are answered "error"); any stop id ends the attempt, and before the last attempt REVISE follows
    it: the stop id stays the policy's token as sampled, trained with its attempt (as a chat template trains the end
    of an assistant's turn), so that "stop here" is learned as "keep going" is."""
    if e.done:
        return tokenizer.pad_id
    if e.queue:
        token, counts = e.queue.pop(0)
        e.write(token, _ENV, counts)
    elif sampled in tokenizer.stop_ids:
        _unclosed_call(e, tokenizer)
        e.write(sampled, _POLICY, counts=False)            # the end of this attempt: the policy's decision
        if e.turn + 1 < turns:
            e.turn, e.used, e.segment = e.turn + 1, 0, []
            e.queue = [(t, False) for t in revise]         # the environment's revision prompt comes next
        else:
            e.done = True
        return sampled
    else:
        e.write(sampled, _POLICY)
        e.segment.append(sampled)
        if sampled in closes:
            text = tokenizer.decode(e.segment)
            close = text.rfind(toolcalc.CALL_CLOSE)
            start = text.rfind(toolcalc.CALL_OPEN, 0, close)
            if start >= 0:                                  # a call: <expression>
                e.calls[e.turn] += 1
                reply = toolcalc.tool_reply(text[start + 1:close]) if sum(e.calls) <= max_calls else "error"
                e.malformed[e.turn] += reply == "error"
                e.queue, e.segment = [(t, True) for t in tokenizer.encode(reply)], []
    if e.used >= budget:                                   # this attempt ran out of tokens: the episode ends
        _unclosed_call(e, tokenizer)
        e.done = e.truncated = True
    return e.ids[-1]


@torch.no_grad()
def episodes(policy, tokenizer, prompts, group_size=1, temperature=1.0, max_new_tokens=None, max_calls=None, turns=1,
             tool=True, generator=None):
    """Episodes of the tool task, sampled token by token with a KV cache, all rows at once: at each position a row
    takes the environment's next queued token if it has one (a tool reply, REVISE), else the token the policy samples
    (at `temperature`, the full softmax; 0 is greedy). Each attempt gets max_new_tokens (tool replies included);
    tool=False bans every token that opens a call (the policy without its tool). Returns Episodes, scored."""
    device = next(policy.parameters()).device
    budget = max_new_tokens or default_max_new_tokens()
    max_calls = _max_calls if max_calls is None else max_calls
    opens, closes = _markers(tokenizer)
    revise = [tokenizer.encode(toolcalc.revision(p)) for p in prompts for _ in range(group_size)]   # each row's
    prompt, prompt_mask = tokenizer.encode_batch(prompts, device)                     # (P, Tp)
    prompt, prompt_mask = prompt.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    B, Tn = prompt.size(0), turns * budget + (turns - 1) * (max(map(len, revise)) + 1)   # (B, Tp); longest episode
    cache = KVCache(policy.config.n_layer, B, prompt.size(1) + Tn, device)
    logits = policy(prompt, prompt_mask, cache)[:, -1].float()                        # (B, V) the first token's
    state = [_Episode(turns) for _ in range(B)]
    for _ in range(Tn):
        if not tool:
            logits[:, opens] = float("-inf")
        if temperature == 0:
            sampled = logits.argmax(-1)                                               # (B,)
        else:
            sampled = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=generator).squeeze(1)
        written = [_advance(e, s, tokenizer, closes, r, turns, budget, max_calls)
                   for e, s, r in zip(state, sampled.tolist(), revise)]
        if all(e.done for e in state):
            break
        logits = policy(torch.tensor(written, device=device)[:, None], torch.ones(B, 1, device=device),
                        cache)[:, -1].float()
    T = max(len(e.ids) for e in state)
    pad = lambda rows, v: torch.tensor([r + [v] * (T - len(r)) for r in rows], device=device)
    who = pad([e.who for e in state], 0)                                              # (B, T)
    correct = [[reward(prompts[i // group_size], tokenizer.decode(ids)) == 1.0 for ids in e.answer_ids]
               for i, e in enumerate(state)]
    as_float = lambda rows: torch.tensor(rows, dtype=torch.float32, device=device)
    return Episodes(prompt, prompt_mask, pad([e.ids for e in state], tokenizer.pad_id), (who > 0).float(),
                    (who == _POLICY).float(), pad([e.turn_of for e in state], 0),
                    torch.tensor([e.truncated for e in state], device=device), as_float(correct),
                    as_float([e.calls for e in state]), as_float([e.malformed for e in state]))


def evaluate(model, tokenizer, prompts=None, num_samples=4, temperature=1.0, seed=0, max_new_tokens=None):
    """Greedy accuracy and sampled pass@1 (mean correctness of num_samples samples at `temperature`)
    on the held-out set (or `prompts`); also greedy accuracy on precedence and on other problems. max_new_tokens:
    the completion budget (default: the task's), the run's own so that what was checked against the context is
    what runs."""
    prompts = eval_prompts() if prompts is None else prompts
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    greedy = complete(model, tokenizer, prompts, temperature=0.0, max_new_tokens=max_new_tokens)
    g = torch.Generator(device=device).manual_seed(seed)
    sampled = complete(model, tokenizer, prompts, num_samples, temperature, max_new_tokens, generator=g)
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


PAIR_FORMAT = 3   # version of the cached pair files; a cache of another version is rebuilt (3: ids end as sampled)


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
    *_ids are the completion's token ids as completion_batch takes them: for a sampled side, the ids the policy
    sampled (a decoded string need not encode back to them), with the stop token that ended it (none if it ran out of
    tokens); for a filled-in side, tokenizer.encode of the text and eos_id.
    cache: a JSON path; reused when it holds exactly these prompts and settings, else (re)written."""
    meta = {"prompts": list(prompts), "samples_per_prompt": samples_per_prompt, "temperature": temperature,
            "seed": seed, "policy": None if policy is None else f"{fingerprint(policy):.12e}",
            "tokenizer": getattr(tokenizer, "name", None), "chat": getattr(tokenizer, "chat", None) is not None}
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
        filled = lambda text: (text, tokenizer.encode(text) + [tokenizer.eos_id])          # a demonstration's ids
        (chosen, chosen_ids), chosen_src = (good[0], "sampled") if good else (filled(demonstration(prompt)), "demo")
        if bad:
            (rejected, rejected_ids), rejected_src = bad[0], "sampled"
        else:
            (rejected, rejected_ids), rejected_src = filled(synthetic_mistake(prompt)), "synthetic"
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
    """Right-padded batch of prompt + completion sequences, the prompt encoded on its own (tokenizer.encode_prompt).
    A completion is text or token ids. Text is a demonstration: encoded, then eos_id appended. Ids are taken as they
    are: a sample as it was sampled, its stop token last when one ended it and none when it ran out of tokens (so a
    model is trained on exactly what it sampled, whichever of the stop ids it was), a demonstration's with its EOS.
    Returns tokens (B, T), attention mask (B, T) 1.0 on real tokens, and completion mask (B, T-1) 1.0 where the
    target token t+1 is a completion token (the positions a teacher-forced loss or a sequence log-prob sums over).
    With --task toolcalc a text completion is encoded piece by piece and the environment's pieces (tool replies,
    REVISE) are 0 in the completion mask: context, not targets."""
    ids, targets = [], []
    for p, c in zip(prompts, completions):
        end = isinstance(c, str)                           # text: a demonstration, which ends with the EOS
        pieces = toolcalc.segments(c) if _task.name == "toolcalc" and isinstance(c, str) else [(c, False)]
        pieces = [x for text, env in pieces                # an attempt ends with the policy's EOS, before the revision
                  for x in ([([tokenizer.eos_id], False)] if env and text.startswith(toolcalc.REVISE) else [])
                  + [(text, env)]]
        encoded = [(tokenizer.encode(text) if isinstance(text, str) else list(text), env) for text, env in pieces]
        ids.append((tokenizer.encode_prompt(p), [t for piece, _ in encoded for t in piece] + [tokenizer.eos_id] * end))
        targets.append([float(not env) for piece, env in encoded for _ in piece] + [1.0] * end)
    T = max(len(p) + len(c) for p, c in ids)
    tokens = torch.full((len(ids), T), tokenizer.pad_id, dtype=torch.long)
    attn = torch.zeros(len(ids), T)
    mask = torch.zeros(len(ids), T - 1)
    for i, (p, c) in enumerate(ids):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1.0
        mask[i, len(p) - 1:len(p) + len(c) - 1] = torch.tensor(targets[i])   # the predictions of c[0] .. EOS
    return tokens.to(device), attn.to(device), mask.to(device)


def pair_batch(pairs, tokenizer, device="cpu"):
    """Pairs -> completion_batch of 2B sequences: chosen rows 0..B-1, rejected rows B..2B-1, each completion as its
    token ids (preference_pairs: as sampled, with the stop token that ended it, or a demonstration's with its EOS; a
    decoded string need not encode back to them)."""
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
