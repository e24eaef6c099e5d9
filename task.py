"""
The task in use and what every script draws from it: prompts and demonstrations, the verifier's
reward, the held-out evaluation, rollouts (sampled with sampler.py, scored here), tool episodes,
preference pairs and the batches the losses read. The problems themselves live in tasks/, one
module per task; use(args), called once by plumbing.Run, chooses the task and its format.

Formats (--format):
    plain   the task's own: the prompt as the task writes it, the completion's reasoning, a '#'
            (GSM8K: '####') and the answer (tasks/*.py show each).
    r1      DeepSeek-R1-Zero's template (DeepSeek-AI 2025, arXiv 2501.12948, Table 1), word for
            word (R1_TEMPLATE), with the task's prompt as the question. A completion is
            ' <think>{reasoning}</think> <answer>{answer}</answer>'. Reward: the task's verifier
            on the text of the last <answer> tag (1 or 0), plus --format_weight when the whole
            completion is one think block then one answer block (the paper's format reward; its
            weight is not published). The template is about 400 bytes (the byte tokenizer's).
"""
import functools
import json
import os
import random
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F

import episode
import sampler
from hf import chat as templates
from hf import tools
from hf.checkpoint import fingerprint
from tasks import arithmetic, countdown, gsm8k, guess, toolcalc

TASKS = ("arithmetic", "countdown", "gsm8k", "toolcalc", "guess")
FORMATS = ("plain", "r1")
R1_TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the "
               "Assistant solves it. The assistant first thinks about the reasoning process in the "
               "mind and then provides the user with the answer. The reasoning process and answer "
               "are enclosed within <think> </think> and <answer> </answer> tags, respectively, "
               "i.e., <think> reasoning process here </think> <answer> answer here </answer>. "
               "User: {prompt}. Assistant:")
_R1_PROMPT = re.compile(re.escape(R1_TEMPLATE).replace(re.escape("{prompt}"), "(.*)"), re.S)
_R1_COMPLETION = re.compile(r"\s*<think>((?:(?!</?think>|</?answer>).)*)</think>\s*"
                            r"<answer>((?:(?!</?think>|</?answer>).)*)</answer>\s*", re.S)
R1_EXTRA_TOKENS = 34           # ' <think></think> <answer></answer>' in bytes: R1's extra
R1_MAX_CHARS = 20_000          # a longer R1 completion scores 0 unread (the tag regexes: quadratic)
_R1_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
HINT = "(answer: {answer}) "     # privileged(): the verified answer, ahead of the problem
calculator = toolcalc.calculator   # the tool: calculator('12*46') -> '552'; "error..." otherwise


# -----------------------------------------------------------------------------
# The task in use: one record, use(args) its one writer

class InUse(NamedTuple):
    """The task every function here draws from."""
    task: object                      # tasks/<name>.task(): problems, demonstrations, verifier
    format: str = "plain"             # --format
    chat: bool = False                # --chat: prompts through the checkpoint's chat template
    max_calls: int = toolcalc.MAX_CALLS   # tool calls answered per episode (agent.py --max_calls)
    tools: dict | None = None         # --tools: {name: tools.Tool}, called in the chat protocol


_in_use = InUse(arithmetic.task())   # the default


def use(args):
    """Make args.task (in args.format) the task every function here uses; returns a line that
    says which. ValueError for a --data file it cannot use (naming the file and the line)."""
    global _in_use
    name, skipped = getattr(args, "task", "arithmetic"), 0
    rule = getattr(args, "countdown_rule", "exactly")
    if name == "countdown":
        chosen = countdown.task(n_numbers=args.countdown_numbers, rule=rule)
    elif name == "gsm8k":
        chosen, skipped = gsm8k.task(args.data)
    elif name == "toolcalc":
        chosen = toolcalc.task()
    elif name == "guess":
        chosen = guess.task()
    else:
        chosen = arithmetic.task()
    spec = getattr(args, "tools", None)
    _in_use = InUse(chosen, getattr(args, "format", "plain"), bool(getattr(args, "chat", False)),
                    getattr(args, "max_calls", toolcalc.MAX_CALLS),
                    tools.resolve(spec) if spec else None)
    fmt, chat = _in_use.format, ", in the chat template" if _in_use.chat else ""
    line = f"task {name} ({fmt} format{chat}), {len(chosen.eval_prompts())} held-out problems"
    if name == "countdown":
        line += f", each number used {rule.replace('_', ' ')} once"
    if spec:
        line += f", tools {', '.join(_in_use.tools)} in the template's protocol"
    if skipped:
        line += (f", {skipped} line{'s' * (skipped != 1)} skipped for an answer with no number "
                 f"after '#### '")
    return line


def name():
    return _in_use.task.name


def chat():
    """--chat: every prompt through the checkpoint's chat template (plumbing.load_model)."""
    return _in_use.chat


def uses_tools():
    """Whether completions are episodes with a tool (--task toolcalc, or --tools)."""
    return _in_use.task.name == "toolcalc" or _in_use.tools is not None


@functools.lru_cache(maxsize=4)
def _chat_tools(tokenizer, named):          # named: ((name, tools.Tool), ...), hashable
    return tools.ChatTools(tokenizer, dict(named))


def chat_tools(tokenizer):
    """The chat protocol's tools.ChatTools for `tokenizer` (--tools), or None."""
    if _in_use.tools is None:
        return None
    if tokenizer.chat is None:
        raise ValueError("--tools calls tools in the chat template's protocol: it needs --chat")
    return _chat_tools(tokenizer, tuple(_in_use.tools.items()))


def default_max_new_tokens():
    """The task's completion budget; the R1 format's tags take 34 more."""
    if _in_use.task.name == "toolcalc" and _in_use.tools is not None:
        return toolcalc.CHAT_MAX_NEW_TOKENS
    return _in_use.task.max_new_tokens + (R1_EXTRA_TOKENS if _in_use.format == "r1" else 0)


def longest_demonstration(tokenizer):
    """The most tokens after the prompt a demonstration takes: the completion budget; the game's
    every turn and the answers between them."""
    if _in_use.task.name != "guess":
        return default_max_new_tokens()
    replies = environment(0, tokenizer).replies
    reply = max(len(r if isinstance(r, list) else tokenizer.encode(r)) for r in replies)
    return guess.MAX_TURNS * guess.MAX_NEW_TOKENS + (guess.MAX_TURNS - 1) * (reply + 1)


def eval_prompts():
    """The fixed held-out prompts, in the format in use."""
    return [_prompt(p) for p in _in_use.task.eval_prompts()]


def sample_prompts(rng, n, precedence_share=None):
    """n training prompts (never held-out ones); rng is a random.Random. precedence_share: the
    share of problems where the demonstrator's slip shows (None: the task's own mix)."""
    if precedence_share is not None and not 0.0 <= precedence_share <= 1.0:
        raise ValueError(f"precedence_share = {precedence_share}; allowed: 0 <= precedence_share "
                         f"<= 1")
    return [_prompt(p) for p in _in_use.task.sample_prompts(rng, n, precedence_share)]


def sample_demonstrations(rng, n, mistake_rate=0.6, precedence_share=None):
    """n (prompt, completion) pairs for SFT, a share mistake_rate with the demonstrator's slip."""
    if not 0.0 <= mistake_rate <= 1.0:
        raise ValueError(f"mistake_rate = {mistake_rate}; allowed: 0 <= mistake_rate <= 1")
    return [(p, demonstration(p, mistake=rng.random() < mistake_rate))
            for p in sample_prompts(rng, n, precedence_share)]


def demonstration(prompt, mistake=False):
    """A completion's text; with --tools the messages after the user's (toolcalc's call, the
    tool's reply and the answer; another task's one assistant message); the game's with --chat."""
    if _in_use.task.name == "guess" and _in_use.chat:
        return guess.messages(prompt, guess.guesses_of(_in_use.task.demonstration(prompt,
                                                                                    mistake)))
    if _in_use.tools is not None:
        if _in_use.task.name == "toolcalc":
            return toolcalc.messages(prompt, mistake)
        return [{"role": "assistant", "content": _in_use.task.demonstration(prompt, mistake)}]
    return _completion(_in_use.task.demonstration(_problem(prompt), mistake))


def privileged(prompt):
    """The prompt with its privileged context ahead of the problem: the verified answer (the right
    demonstration's, as split_answer reads it: arithmetic's and GSM8K's number, a Countdown
    expression that reaches the target). self_distill.py's teacher reads it; sft.py --hint_share
    teaches a policy to."""
    problem = _problem(prompt)
    answer = _in_use.task.split_answer(_in_use.task.demonstration(problem, False))[1].strip()
    return _prompt(HINT.format(answer=answer) + problem)


def max_privileged_tokens(tokenizer):
    """The longest privileged prompt, in tokens: the task's longest prompt (max_prompt_tokens) and
    the longest hint the held-out set's answers make (an answer varies less than a problem)."""
    hint = max(len(tokenizer.encode_prompt(privileged(p))) - len(tokenizer.encode_prompt(p))
               for p in eval_prompts())
    return max_prompt_tokens(tokenizer) + hint


def synthetic_mistake(prompt):
    return _completion(_in_use.task.synthetic_mistake(_problem(prompt)))


def is_precedence(prompt):
    return _in_use.task.is_precedence(_problem(prompt))


def max_prompt_tokens(tokenizer):
    """The task's longest prompt in the format in use, in `tokenizer`'s tokens as encode_prompt
    encodes it: after the tokenizer's BOS, or in its chat template (2 tokens allowed for merges
    across the message's edges)."""
    n = _in_use.task.max_prompt_tokens(tokenizer)
    protocol = chat_tools(tokenizer)
    n += len(protocol.prompt("") if protocol else tokenizer.encode_prompt("")) + \
        (2 if getattr(tokenizer, "chat", None) is not None else 0)
    if _in_use.format == "plain":
        return n
    return n + len(tokenizer.encode(R1_TEMPLATE.format(prompt="")))


def reward(prompt, completion, format_weight=0.0):
    """1.0 for a correct answer, else 0.0; plus format_weight if the completion is well formed.
    Never raises."""
    if _in_use.format == "plain":
        return _in_use.task.reward(prompt, completion, format_weight)
    if not isinstance(completion, str) or len(completion) > R1_MAX_CHARS:   # unread: fast
        return 0.0
    problem = _problem(prompt)
    answers = _R1_ANSWER.findall(completion)
    correct = bool(answers) and problem is not None and \
        _in_use.task.score_answer(problem, answers[-1])
    well_formed = isinstance(completion, str) and _R1_COMPLETION.fullmatch(completion) is not None
    return float(correct) + format_weight * float(well_formed)


def _prompt(problem):                    # the task's prompt -> the prompt in the format in use
    return problem if _in_use.format == "plain" else R1_TEMPLATE.format(prompt=problem)


def _problem(prompt):                    # and back (None for an r1 prompt that is not the template)
    if _in_use.format == "plain":
        return prompt
    m = _R1_PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    return m[1] if m else None


def _completion(text):                   # the task's completion -> the one in the format in use
    if _in_use.format == "plain":
        return text
    reasoning, answer = _in_use.task.split_answer(text)
    return f" <think>{reasoning.strip()}</think> <answer>{answer.strip()}</answer>"


def read_positions(prompt_ids, ids, tok, kind, finished=True):
    """Where a verifier reads its scores, as indices into completion_batch's row (the prompt, then
    the completion's ids as sampled, its stop token last when one ended it): the ORM ("orm") at
    the last token; the PRM ("prm") at each step's last token: every ',' token and, when the
    completion is finished, the last (the final step). A partial path ends with its ','."""
    start, last = len(prompt_ids), len(prompt_ids) + len(ids) - 1
    if kind == "orm":
        return [last]
    commas = [start + j for j, t in enumerate(ids) for _ in range(tok.decode([t]).count(","))]
    return commas + ([last] if finished else [])


# -----------------------------------------------------------------------------
# Rollouts, episodes and evaluation

@torch.no_grad()
def complete(model, tokenizer, prompts, num_samples=1, temperature=0.0, max_new_tokens=None,
             batch_size=256, generator=None, return_ids=False, return_logprobs=False, top_p=None,
             done=None, return_hidden=False):
    """Completions (strings, the stop token dropped) for each prompt, num_samples consecutive
    entries a prompt (top_p: the nucleus, single completions only). return_ids: also each
    completion's ids as sampled, the stop token that ended it included (none in one cut at
    max_new_tokens): (texts, ids), as completion_batch takes them; return_logprobs: (texts, ids,
    the log-prob the sampler gave each id); return_hidden: also the hidden state each id was drawn
    from, flat (sum of lengths, C). done(n): called with the prompts done after a batch."""
    device = next(model.parameters()).device
    max_new_tokens = max_new_tokens or default_max_new_tokens()
    texts, ids, logps, hidden = [], [], [], []
    for i in range(0, len(prompts), batch_size):
        if uses_tools() or name() == "guess":    # episodes: tools answer calls, or the game
            e = episodes(model, tokenizer, prompts[i:i + batch_size], num_samples, temperature,
                         max_new_tokens, turns=guess.MAX_TURNS if name() == "guess" else 1,
                         generator=generator, keep_hidden=return_hidden)
            tokens, cmask, logp = e.tokens, e.mask, [e.logp, e.hidden]
        else:
            idx, mask = tokenizer.encode_batch(prompts[i:i + batch_size], device)
            tokens, cmask, _, *logp = sampler.generate(
                model, idx, mask, max_new_tokens, tokenizer.stop_ids, tokenizer.pad_id,
                num_samples=num_samples, temperature=temperature, generator=generator,
                return_logprobs=return_logprobs or return_hidden, top_p=top_p,
                return_hidden=return_hidden)
        if name() == "guess":                   # its text, whatever the protocol wrote around it
            batch = [p for p in prompts[i:i + batch_size] for _ in range(num_samples)]
            texts += [guess.episode_text(p, t) for p, t in zip(batch, turn_texts(e, tokenizer))]
        else:
            texts += tokenizer.decode_completions(tokens, cmask)
        ids += kept(tokens, cmask) if return_ids or return_logprobs else []
        logps += kept(logp[0], cmask) if return_logprobs else []
        hidden += [logp[-1][cmask > 0]] if return_hidden else []                  # (n, C)
        if done is not None:
            done(min(i + batch_size, len(prompts)))
    if return_logprobs:
        return (texts, ids, logps, torch.cat(hidden)) if return_hidden else (texts, ids, logps)
    return (texts, ids) if return_ids else texts


def turn_texts(ep, tokenizer):
    """Each episode's turns (episode.Episodes) as the policy wrote them, stop ids dropped."""
    out = []
    for row, turn, sampled in zip(ep.tokens.tolist(), ep.turn.tolist(), ep.sampled.tolist()):
        turns = {}
        for t, k, s in zip(row, turn, sampled):
            if s:
                turns.setdefault(k, []).extend([] if t in tokenizer.stop_ids else [t])
        out.append([tokenizer.decode(turns[k]) for k in sorted(turns)])
    return out


def kept(x, mask):
    """x (B, T) -> B lists: each row's entries where mask (B, T) is nonzero, in order."""
    return [[v for v, m in zip(row, keep) if m] for row, keep in zip(x.tolist(), mask.tolist())]


@torch.no_grad()
def sampled_logprobs(model, tokenizer, prompts, ids, temperature, chunk=64, hidden=None):
    """The trainer's log-probs at `temperature` of completions as sampled (ids, one prompt each),
    every token in order, flat (N,) float32: the side sampler_logp_diff compares with the
    sampler's, each sequence scored whole from slot 0 (completion_batch's layout). hidden: the
    sampler's hidden states of those tokens (N, C): also sampler.sampler_kl of each (N,)."""
    device, parts, kls, n = next(model.parameters()).device, [], [], 0
    for i in range(0, len(ids), chunk):
        tokens, attn, mask = completion_batch(prompts[i:i + chunk], ids[i:i + chunk], tokenizer,
                                              device)
        h = model.hidden(tokens[:, :-1], attn[:, :-1])                  # model(..., targets=)
        parts.append(model.head_logprobs(h, tokens[:, 1:], temperature)[mask > 0])
        if hidden is not None:                                          # (1, n) -> (n,)
            mine = hidden[n:n + len(parts[-1])][None]
            kls.append(sampler.sampler_kl(model, mine, h[mask > 0][None], torch.ones_like(
                parts[-1])[None], temperature)[0])
            n += len(parts[-1])
    return (torch.cat(parts), torch.cat(kls)) if hidden is not None else torch.cat(parts)


class Rollout(NamedTuple):
    """A batch of sampled completions, a prompt's G samples on consecutive rows (B = P*G)."""
    prompt: torch.Tensor         # (B, Tp) prompt ids, left-padded
    prompt_mask: torch.Tensor    # (B, Tp) 1.0 on prompt tokens
    tokens: torch.Tensor         # (B, Tn) completion ids, right-padded
    mask: torch.Tensor           # (B, Tn) 1.0 on completion tokens, through each EOS
    truncated: torch.Tensor      # (B,) bool: no EOS within max_new_tokens
    rewards: torch.Tensor        # (B,) float32: the verifier's (correct + format_weight * formed)
    correct: torch.Tensor        # (B,) bool: the final answer is right (no format bonus)


@torch.no_grad()
def rollout(policy, tokenizer, prompts, group_size, temperature, max_new_tokens=None,
            format_weight=0.0, generator=None, return_logprobs=False, return_hidden=False):
    """The RL scripts' rollout: group_size completions per prompt at `temperature` (the full
    softmax, no top-k), scored by the verifier; a Rollout on the policy's device.
    return_logprobs: (Rollout, the sampler's log-probs (P*G, Tn), with return_hidden the hidden
    states it drew from (P*G, Tn, C), else None), see sampler.generate."""
    device = next(policy.parameters()).device
    max_new_tokens = max_new_tokens or default_max_new_tokens()
    prompt, prompt_mask = tokenizer.encode_batch(prompts, device)             # (P, Tp)
    tokens, mask, truncated, *logp = sampler.generate(
        policy, prompt, prompt_mask, max_new_tokens, tokenizer.stop_ids, tokenizer.pad_id,
        num_samples=group_size, temperature=temperature, generator=generator,
        return_logprobs=return_logprobs, return_hidden=return_hidden)
    completions = tokenizer.decode_completions(tokens, mask)
    G = group_size
    rewards = torch.tensor([reward(prompts[i // G], c, format_weight)
                            for i, c in enumerate(completions)], device=device)   # (P*G,)
    correct = torch.tensor([reward(prompts[i // G], c) == 1.0 for i, c in enumerate(completions)],
                           device=device)
    batch = Rollout(prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), tokens,
                    mask, truncated, rewards, correct)
    return (batch, logp[0], logp[1] if return_hidden else None) if return_logprobs else batch


def concat_rollouts(batches, pad_id):
    """Stack Rollouts: prompts left-padded and completions right-padded to the longest, so that
    each row reads as it did alone (padding is masked out of attention and positions)."""
    Tp, Tn = max(b.prompt.size(1) for b in batches), max(b.tokens.size(1) for b in batches)
    left = lambda x, n, v: F.pad(x, (n - x.size(1), 0), value=v)
    right = lambda x, n, v: F.pad(x, (0, n - x.size(1)), value=v)
    return Rollout(torch.cat([left(b.prompt, Tp, pad_id) for b in batches]),
                   torch.cat([left(b.prompt_mask, Tp, 0.0) for b in batches]),
                   torch.cat([right(b.tokens, Tn, pad_id) for b in batches]),
                   torch.cat([right(b.mask, Tn, 0.0) for b in batches]),
                   *(torch.cat([b[i] for b in batches]) for i in (4, 5, 6)))


def environment(max_calls=None, tokenizer=None):
    """The episodes' environment (episode.Environment), each attempt scored by the verifier.
    --tools: the chat template's protocol (tools.ChatTools for `tokenizer`). Else the tool task's
    compact one: calls <expression> answered by the calculator, the revision prompt between
    attempts."""
    score = lambda p, text: reward(p, text) == 1.0
    max_calls = _in_use.max_calls if max_calls is None else max_calls
    protocol = chat_tools(tokenizer) if tokenizer is not None else None
    if name() == "guess":                        # what it says depends on the guess
        said = {r: r for r in guess.CHAT_REPLIES}
        if tokenizer is not None and tokenizer.chat is not None:     # a user turn, as rendered
            turn = [{"role": "user", "content": "1"}, {"role": "assistant",
                                                       "content": templates.PROBE}]
            said = {r: tokenizer.chat.encode_after_turn(
                turn + [{"role": "user", "content": text}], tokenizer.encode_special,
                tokenizer.encode) for r, text in guess.CHAT_REPLIES.items()}
        feedback = lambda p, turns: said.get(guess.feedback(p, turns))
        return episode.Environment(None, None, None, None, score, 0, None, feedback,
                                   tuple(said.values()))
    if protocol is not None:
        return episode.Environment(None, None, None, None, score, max_calls, protocol)
    return episode.Environment(toolcalc.CALL_OPEN, toolcalc.CALL_CLOSE, toolcalc.tool_reply,
                               toolcalc.revision, score, max_calls)


def episodes(policy, tokenizer, prompts, group_size=1, temperature=1.0, max_new_tokens=None,
             max_calls=None, turns=1, tool=True, generator=None, keep_hidden=False):
    """Episodes with the task's tools (episode.sample in `environment`), each attempt given
    max_new_tokens (default: the task's), scored by the verifier."""
    env = environment(max_calls, tokenizer)
    return episode.sample(policy, tokenizer, prompts, env, group_size, temperature,
                          max_new_tokens or default_max_new_tokens(), turns, tool, generator,
                          keep_hidden)


# -----------------------------------------------------------------------------
# Preference pairs

PAIR_FORMAT = 3   # the cached pair files' version; another is rebuilt (3: ids end as sampled)


def _valid_pairs(saved, meta):
    """A cache is used only when it is exactly what preference_pairs would write for `meta`."""
    if not isinstance(saved, dict) or saved.get("format") != PAIR_FORMAT or \
            saved.get("meta") != meta:
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


def preference_pairs(prompts, policy=None, tokenizer=None, samples_per_prompt=4, temperature=1.0,
                     seed=0, cache=None):
    """One pair per prompt: {"prompt", "chosen", "rejected", "source", "chosen_ids",
    "rejected_ids"}, chosen correct, rejected not: sampled from `policy` where its samples hold
    both, the missing side filled with the correct demonstration or synthetic_mistake (source:
    "sampled/sampled", "sampled/synthetic", "demo/sampled" or "demo/synthetic"). *_ids: as
    completion_batch takes them, a sampled side's as sampled (with the stop token that ended it,
    none if it ran out), a filled one's encoded with eos_id. cache: a JSON path, reused when it
    holds exactly these prompts and settings, else (re)written."""
    meta = {"prompts": list(prompts), "samples_per_prompt": samples_per_prompt,
            "temperature": temperature, "seed": seed,
            "policy": None if policy is None else f"{fingerprint(policy):.12e}",
            "tokenizer": getattr(tokenizer, "name", None),
            "chat": getattr(tokenizer, "chat", None) is not None}
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
        print(f"preference pairs: sampling {samples_per_prompt} completions for each of "
              f"{len(prompts)} prompts{f', then cached in {cache}' if cache else ''}", flush=True)
        g = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
        was_training = policy.training
        policy.eval()
        texts, ids = complete(policy, tokenizer, list(prompts), samples_per_prompt, temperature,
                              generator=g, return_ids=True)
        policy.train(was_training)
        k = samples_per_prompt
        samples = [list(zip(texts[i * k:(i + 1) * k], ids[i * k:(i + 1) * k]))
                   for i in range(len(prompts))]
    pairs = []
    for prompt, outs in zip(prompts, samples):
        good = [(c, i) for c, i in outs if reward(prompt, c) == 1.0]
        bad = [(c, i) for c, i in outs if reward(prompt, c) == 0.0]
        filled = lambda text: (text, tokenizer.encode(text) + [tokenizer.eos_id])   # a demo's ids
        if good:
            (chosen, chosen_ids), chosen_src = good[0], "sampled"
        else:
            (chosen, chosen_ids), chosen_src = filled(demonstration(prompt)), "demo"
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


def held_out_pairs(policy, tokenizer, seed=0, cache_dir="out", n=None):
    """Pairs on the first n held-out prompts (None: all 512), sampled with seed + 1 and cached in
    cache_dir/pairs_eval.json (all of them) or pairs_eval_{n}.json: every preference script's
    held-out set, sampled for the prompts --eval_n evaluates and no more."""
    prompts = eval_prompts()[:n]
    name = "pairs_eval.json" if len(prompts) == len(eval_prompts()) else f"pairs_eval_{n}.json"
    return preference_pairs(prompts, policy, tokenizer, seed=seed + 1,
                            cache=os.path.join(cache_dir, name))


def preference_dataset(policy, tokenizer, n_train=2048, seed=0, cache_dir="out", n_eval=None):
    """(train, held_out) pairs on n_train prompts and the first n_eval held-out ones
    (held_out_pairs), sampled from `policy` (the SFT policy), cached in cache_dir/pairs_*.json."""
    train_prompts = sample_prompts(random.Random(seed), n_train)
    train = preference_pairs(train_prompts, policy, tokenizer, seed=seed,
                             cache=os.path.join(cache_dir, "pairs_train.json"))
    return train, held_out_pairs(policy, tokenizer, seed, cache_dir, n_eval)


# -----------------------------------------------------------------------------
# Batches: what the losses read

def completion_batch(prompts, completions, tokenizer, device="cpu"):
    """Right-padded prompt + completion sequences, each prompt encoded alone (encode_prompt). A
    completion is text (a demonstration: encoded, eos_id appended) or ids, taken as they are (a
    sample as sampled, its stop token last when one ended it: a model is trained on exactly what
    it sampled). Returns tokens (B, T), attention mask (B, T) and completion mask (B, T-1), 1.0
    where target t+1 is a completion token. --task toolcalc: a text completion is encoded piece
    by piece, the environment's pieces (tool replies, REVISE) 0 in the completion mask."""
    ids, targets = [], []
    protocol = chat_tools(tokenizer)
    for p, c in zip(prompts, completions):
        if isinstance(c, list) and c and isinstance(c[0], dict) and protocol is None:
            head, pieces = templates.demonstration(tokenizer, p, c)  # the game's, as rendered
            ids.append((head, [t for piece, _ in pieces for t in piece]))
            targets.append([float(not env) for piece, env in pieces for _ in piece])
            continue
        if protocol is not None and not (isinstance(c, (list, tuple)) and c and
                                         isinstance(c[0], int)):    # a chat demonstration
            messages = [{"role": "assistant", "content": c}] if isinstance(c, str) else c
            head, pieces = protocol.demonstration(p, messages)
            ids.append((head, [t for piece, _ in pieces for t in piece]))
            targets.append([float(not env) for piece, env in pieces for _ in piece])
            continue
        end = isinstance(c, str)                         # text: a demonstration, ending with EOS
        turns = {"toolcalc": toolcalc.segments, "guess": guess.segments}.get(_in_use.task.name)
        pieces = turns(c) if turns and isinstance(c, str) else [(c, False)]
        pieces = [x for text, env in pieces   # an attempt ends with the policy's EOS, then REVISE
                  for x in ([([tokenizer.eos_id], False)] if env and (
                      text.startswith(toolcalc.REVISE) or name() == "guess") else [])
                  + [(text, env)]]
        encoded = [(tokenizer.encode(text) if isinstance(text, str) else list(text), env)
                   for text, env in pieces]
        ids.append((protocol.prompt(p) if protocol else tokenizer.encode_prompt(p),
                    [t for piece, _ in encoded for t in piece] + [tokenizer.eos_id] * end))
        targets.append([float(not env) for piece, env in encoded for _ in piece] + [1.0] * end)
    T = max(len(p) + len(c) for p, c in ids)
    tokens = torch.full((len(ids), T), tokenizer.pad_id, dtype=torch.long)
    attn = torch.zeros(len(ids), T)
    mask = torch.zeros(len(ids), T - 1)
    for i, (p, c) in enumerate(ids):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1.0
        mask[i, len(p) - 1:len(p) + len(c) - 1] = torch.tensor(targets[i])   # c[0] .. EOS
    return tokens.to(device), attn.to(device), mask.to(device)


def pair_batch(pairs, tokenizer, device="cpu"):
    """Pairs -> completion_batch of 2B sequences, chosen rows 0..B-1, rejected B..2B-1, each
    completion as its ids (preference_pairs)."""
    return completion_batch([p["prompt"] for p in pairs] * 2,
                            [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs],
                            tokenizer, device)


left_pad = sampler.left_pad   # id lists -> left-padded (B, T) tokens and mask


def pad_steps(rows, fill=0.0, dtype=torch.float32, device="cpu"):
    """Lists of per-step values -> (B, S) padded with `fill`, and the (B, S) step mask (S >= 1)."""
    S = max(1, max(len(r) for r in rows))
    values = torch.tensor([list(r) + [fill] * (S - len(r)) for r in rows], dtype=dtype,
                          device=device)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (S - len(r)) for r in rows], device=device)
    return values, mask
