"""
Episodes: the policy's tokens and an environment's in one sequence, sampled token by token with a
KV cache, all rows at once (agent.py, multiturn.py). The environment answers calls (a tool's reply)
and ends attempts (a revision prompt, feedback, or the chat template's tool messages); its tokens
are never re-tokenised, so the masks of who wrote what are exact.

    env = task.environment(max_calls=2)
    ep = episode.sample(policy, tok, prompts, env, group_size=G, turns=2, generator=g)

Shapes: B = prompts * group_size rows, Tp prompt length, Tn the longest episode, C channels.
"""
import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from model import KVCache
from sampler import check_finite, left_pad, token_logp

class Environment(NamedTuple):
    """What answers the policy in an episode (task.environment builds them). Compact protocol: a
    call is the text between call_open and call_close, answered with reply(call) right after it;
    between attempts comes revision(prompt), or feedback(prompt, the attempts' texts so far), one
    of `replies` (None: the episode ends). Chat protocol (chat, a tools.ChatTools): a turn's calls
    are answered when a stop id ends it, in the template's tool messages; a turn without a call
    ends the attempt. score(prompt, the attempt's text or last turn) says if it is right."""
    call_open: str | None
    call_close: str | None
    reply: Callable[[str], str] | None
    revision: Callable[[str], str] | None
    score: Callable[[str, str], bool]
    max_calls: int                    # calls answered per episode; later ones get "error"
    chat: object = None               # tools.ChatTools: the chat template's protocol
    feedback: Callable[[str, list], str | None] | None = None
    replies: tuple = ()               # every text feedback may write


class Episodes(NamedTuple):
    """A batch of episodes: each the prompt, then the policy's and the environment's tokens in one
    sequence, a prompt's G on consecutive rows (B = P*G); never re-tokenised: exact masks."""
    prompt: torch.Tensor       # (B, Tp) prompt ids, left-padded
    prompt_mask: torch.Tensor  # (B, Tp) 1.0 on prompt tokens
    tokens: torch.Tensor       # (B, Tn) the policy's and the environment's tokens, right-padded
    mask: torch.Tensor         # (B, Tn) 1.0 on every real token (what attention sees)
    sampled: torch.Tensor      # (B, Tn) 1.0 on the tokens the policy sampled (what a loss sees)
    turn: torch.Tensor         # (B, Tn) int64: the attempt each token belongs to (0, 1, ...)
    truncated: torch.Tensor    # (B,) bool: an attempt ran out of max_new_tokens
    correct: torch.Tensor      # (B, turns) float32: 1.0 where that attempt's answer is right
    calls: torch.Tensor        # (B, turns) float32: calls the policy opened in each attempt
    malformed: torch.Tensor    # (B, turns) float32: of those, the ones answered with an error
    policy_turns: torch.Tensor  # (B,) float32: the policy's turns (ended by a stop id, or cut)
    logp: torch.Tensor         # (B, Tn) the sampler's log-prob of each token (greedy: 0.0)
    hidden: object = None      # (B, Tn, C) the final hidden state each was drawn from (asked)


_POLICY, _ENV = 1, 2           # who wrote a token (0: padding)


class _Episode:
    """One episode being sampled: what is written, by whom, what the environment has yet to."""

    def __init__(self, turns):
        self.ids, self.who, self.turn_of, self.queue, self.segment = [], [], [], [], []
        self.logp = []
        self.turn, self.used, self.done, self.truncated = 0, 0, False, False
        self.policy_turns = 0
        self.answer_ids = [[] for _ in range(turns)]   # each attempt's tokens, replies included
        self.calls, self.malformed = [0] * turns, [0] * turns

    def write(self, token, who, counts=True):
        self.ids.append(token)
        self.who.append(who)
        self.turn_of.append(self.turn)
        self.used += counts
        if counts:
            self.answer_ids[self.turn].append(token)


@functools.lru_cache(maxsize=16)
def _holding(tokenizer, text, added=False):
    """The ids whose text holds `text`, the stop, pad and added ids excepted unless `added` (a chat
    protocol's call opener, <tool_call>, is an added token)."""
    skip = () if added else {tokenizer.eos_id, tokenizer.pad_id, *tokenizer.stop_ids,
                             *tokenizer.added_ids}
    return [i for i in range(tokenizer.vocab_size) if i not in skip
            and text in tokenizer.decode([i])]


def _unclosed_call(e, tokenizer, env):
    """At the end of an attempt: a call opened and never closed is a call, and malformed. In the
    chat protocol (the budget ran out): every call of the cut turn, never run."""
    text = tokenizer.decode(e.segment)
    if env.chat is not None:
        calls, errors = env.chat.unfinished(text)
        e.calls[e.turn] += calls
        e.malformed[e.turn] += errors
        e.answer_ids[e.turn] = list(e.segment)
    elif env.call_open is not None and text.rfind(env.call_open) > text.rfind(env.call_close):
        e.calls[e.turn] += 1
        e.malformed[e.turn] += 1


def _chat_turn_end(e, sampled, tokenizer, env, tool):
    """A stop id in the chat protocol: the turn's calls answered (the template's tool messages
    and next opening queued, the stop id counted in the budget), or with no call the attempt's
    end, its last turn the answer."""
    e.policy_turns += 1
    reply = env.chat.reply(tokenizer.decode(e.segment), sum(e.calls), env.max_calls, tool)
    if reply is None:
        e.write(sampled, _POLICY, counts=False)
        e.answer_ids[e.turn], e.done = list(e.segment), True
        return
    calls, errors, ids = reply
    e.calls[e.turn] += calls
    e.malformed[e.turn] += errors
    e.write(sampled, _POLICY)
    e.queue, e.segment = [(t, True) for t in ids], []


def _advance(e, sampled, tokenizer, env, closes, revise, turns, budget, tool=True):
    """Write one position of episode e, return the token written: the environment's next queued
    token, else the policy's `sampled`, acted on: a call's close queues the tool's reply (past
    env.max_calls: "error"); a stop id ends the attempt, kept and trained as a chat template trains
    a turn's end, `revise` following before the last. Chat protocol: see _chat_turn_end."""
    if e.done:
        return tokenizer.pad_id
    if e.queue:
        token, counts = e.queue.pop(0)
        e.write(token, _ENV, counts)
    elif sampled in tokenizer.stop_ids and env.chat is not None:
        _chat_turn_end(e, sampled, tokenizer, env, tool)
        if e.done:
            return sampled
    elif sampled in tokenizer.stop_ids:
        e.policy_turns += 1
        _unclosed_call(e, tokenizer, env)
        e.write(sampled, _POLICY, counts=False)          # the end of this attempt: the policy's
        revise = revise(e) if callable(revise) and e.turn + 1 < turns else revise
        if e.turn + 1 < turns and revise is not None:
            e.turn, e.used, e.segment = e.turn + 1, 0, []
            e.queue = [(t, False) for t in revise]       # the revision prompt (feedback) is next
        else:
            e.done = True
        return sampled
    else:
        e.write(sampled, _POLICY)
        e.segment.append(sampled)
        if sampled in closes:
            text = tokenizer.decode(e.segment)
            close = text.rfind(env.call_close)
            start = text.rfind(env.call_open, 0, close)
            if start >= 0:                                # a call: <expression>
                e.calls[e.turn] += 1
                call = text[start + len(env.call_open):close]
                reply = env.reply(call) if sum(e.calls) <= env.max_calls else "error"
                e.malformed[e.turn] += reply == "error"
                e.queue, e.segment = [(t, True) for t in tokenizer.encode(reply)], []
    if e.used >= budget:                                  # out of tokens: the episode ends
        _unclosed_call(e, tokenizer, env)
        e.done = e.truncated = True
        e.policy_turns += not e.queue and e.who[-1] == _POLICY   # a turn it began, cut
    return e.ids[-1]


@torch.no_grad()
def sample(policy, tokenizer, prompts, env, group_size=1, temperature=1.0, max_new_tokens=16,
           turns=1, tool=True, generator=None, keep_hidden=False):
    """Episodes with `env`, sampled token by token with a KV cache, all rows at once: at each
    position a row takes the environment's next queued token if it has one, else the policy's
    (at `temperature`, the full softmax; 0: greedy). Each attempt gets max_new_tokens (replies
    included); tool=False bans every token that opens a call. Returns Episodes, scored; with
    keep_hidden, their hidden states too."""
    device = next(policy.parameters()).device
    if env.chat is None:
        opens, closes = (([_holding(tokenizer, env.call_open),
                           frozenset(_holding(tokenizer, env.call_close))]) if env.call_open
                         else ([], frozenset()))
        if env.feedback is None:
            revise = [tokenizer.encode(env.revision(p)) for p in prompts for _ in range(group_size)]
        else:                         # what the environment says after each attempt, as it goes
            revise = [functools.partial(_feedback, tokenizer, env, p) for p in prompts
                      for _ in range(group_size)]
        prompt, prompt_mask = tokenizer.encode_batch(prompts, device)         # (P, Tp)
    else:                             # calls at a turn's end; one attempt
        opens, closes = _holding(tokenizer, env.chat.opener, added=True), frozenset()
        revise = [[]] * (len(prompts) * group_size)
        prompt, prompt_mask = left_pad([env.chat.prompt(p) for p in prompts], tokenizer.pad_id,
                                       device)
    prompt = prompt.repeat_interleave(group_size, 0)                          # (B, Tp)
    prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
    B = prompt.size(0)
    between = (max(len(tokenizer.encode(r) if isinstance(r, str) else r) for r in env.replies)
               if env.feedback else max(map(len, revise)))
    Tn = turns * max_new_tokens + (turns - 1) * (between + 1)                 # longest episode
    cache = KVCache(policy.config.n_layer, B, prompt.size(1) + Tn, device)
    h = policy.hidden(prompt, prompt_mask, cache)                             # (B, Tp, C)
    logits, h = policy.logits(h)[:, -1].float(), h[:, -1:]                    # (B, V) the first's
    check_finite(logits)
    state, hidden = [_Episode(turns) for _ in range(B)], []
    for _ in range(Tn):
        hidden += [h] if keep_hidden else []
        if not tool:
            logits[:, opens] = float("-inf")
        if temperature == 0:
            sampled = logits.argmax(-1)                                       # (B,)
        else:
            probs = F.softmax(logits / temperature, -1)
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        written = [_advance(e, s, tokenizer, env, closes, r, turns, max_new_tokens, tool)
                   for e, s, r in zip(state, sampled.tolist(), revise)]
        if temperature > 0:                   # the log-prob of what each row wrote (N,)
            lp = token_logp(logits, torch.tensor(written, device=device), temperature).tolist()
            for e, x in zip(state, lp):
                e.logp += [x] * (len(e.ids) - len(e.logp))
        if all(e.done for e in state):
            break
        h = policy.hidden(torch.tensor(written, device=device)[:, None], None,
                          cache)                                  # (B, 1, C) the step: all real
        logits = policy.logits(h)[:, -1].float()
    T = max(len(e.ids) for e in state)
    pad = lambda rows, v: torch.tensor([r + [v] * (T - len(r)) for r in rows], device=device)
    who = pad([e.who for e in state], 0)                                      # (B, T)
    correct = [[env.score(prompts[i // group_size], tokenizer.decode(ids)) for ids in e.answer_ids]
               for i, e in enumerate(state)]
    as_float = lambda rows: torch.tensor(rows, dtype=torch.float32, device=device)
    return Episodes(prompt, prompt_mask, pad([e.ids for e in state], tokenizer.pad_id),
                    (who > 0).float(), (who == _POLICY).float(), pad([e.turn_of for e in state], 0),
                    torch.tensor([e.truncated for e in state], device=device), as_float(correct),
                    as_float([e.calls for e in state]), as_float([e.malformed for e in state]),
                    as_float([e.policy_turns for e in state]),
                    as_float([e.logp + [0.0] * (T - len(e.logp)) for e in state]),
                    torch.cat(hidden, 1)[:, :T] if keep_hidden else None)


def _feedback(tokenizer, env, prompt, e):
    """The ids env.feedback writes after episode e's attempts so far (or None)."""
    said = env.feedback(prompt, [tokenizer.decode(ids) for ids in e.answer_ids[:e.turn + 1]])
    return tokenizer.encode(said) if isinstance(said, str) else said      # ids as they are


