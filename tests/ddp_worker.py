"""Run a training script's main() with fixed rollouts, for tests/test_distributed.py and
tests/test_updates.py.

    python tests/ddp_worker.py grpo --steps 1 ...                               # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/ddp_worker.py grpo --steps 1 ...                                  # two processes

The script's sampler is replaced by one whose completions depend only on the prompt and the sample's
index in its group (a correct demonstration or the left-to-right mistake, padded to a fixed width),
so that one process with a batch of P prompts, two processes with P/2 each, and one process with
--grad_accum 2 see exactly the same rollouts: what the test then compares is the update alone. The
optimiser is plain SGD with a large step (lr 0.1 in every parameter group; a script that sets the
learning rate each step, for its warm-up or schedule, sets it here too, and AdamW's decoupled weight
decay is SGD's, which for SGD is the same update): its update is -lr * gradient, far above the
float32 rounding of the weights, so any difference in the gradient (a wrong normaliser) shows in the
weights, where AdamW's first step, about -lr * sign(gradient), would hide it.

Environment:
    DDP_WORKER_INIT   a path: the starting weights of the model the first optimiser trains
                      (trpo.py, which has none: of the policy), in model.parameters() order, for
                      the test to subtract
    DDP_WORKER_LOG    a path: what each step was fed, in order, for tests/test_updates.py to
                      rebuild it (rank 0 only): a list of {"kind": ..., ...}: "rollout" (prompts,
                      group_size), "ppo_rollout" (prompts), "complete" (prompts, n), "randperm"
                      (perm: ppo.py's minibatch order), and the batches a loss saw (built with
                      gradient enabled): "completion_batch" (prompts, completions), "pair_batch"
                      (pairs), "async_batch" (async_grpo.py's learner: what its actors sent,
                      recording_unpack); and each optimiser step, "step": its lr and gradients
                      (after any clipping), per parameter group
    DDP_WORKER_NAN_RANK   this rank's log-probs are NaN
    DDP_WORKER_LR     the SGD learning rate in place of 0.1

agent.py's episodes (task.episodes with a generator: training's, not the evaluation's) are played by
a policy that writes a fixed plan (fixed_episode), the environment answering as it does; "episodes"
records (prompts, group_size). async_grpo.py's actors are processes of this same command: they send
the fixed completions with their policy's log-probs of them (the behaviour policy's, as the
sampler's own); its learner (rank 0) records what they sent.

The script name "orm" runs prm.py --train orm (its checkpoint is orm.pt); a --steps flag goes to
expert_iteration.py as --rounds and is dropped for prm.py and orm (their --epochs, --batch_size and
data size set the steps).
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import plumbing  # noqa: E402
import task  # noqa: E402
from model import completion_hidden, completion_logprobs  # noqa: E402
from tasks import arithmetic, guess, toolcalc  # noqa: E402

# completions padded to a fixed width: the same tensors whatever the batch
WIDTH = arithmetic.MAX_NEW_TOKENS
EVENTS = []
EPISODES, COMPLETE = task.episodes, task.complete


def record(kind, **data):
    """Append an event to $DDP_WORKER_LOG (rewritten whole: the file is complete however the run
    ends)."""
    path = os.environ.get("DDP_WORKER_LOG")
    if path and int(os.environ.get("RANK", 0)) == 0:
        EVENTS.append({"kind": kind, **data})
        torch.save(EVENTS, path)


def fixed_completion(prompt, j):
    if prompt.startswith("(answer: "):        # self_distill.py's teacher prompt (task.privileged)
        prompt = prompt.split(") ", 1)[1]
    return arithmetic.demonstration(prompt,
                                    left_to_right=(j + len(prompt) + ord(prompt[0])) % 3 == 0)


def fixed_tokens(tokenizer, prompts, group_size, device):
    """tokens, mask (P*G, WIDTH) and truncated (P*G,) of the fixed completions, a prompt's G on
    consecutive rows."""
    rows = [tokenizer.encode(fixed_completion(p, j)) + [tokenizer.eos_id] for p in prompts
            for j in range(group_size)]
    tokens = torch.full((len(rows), WIDTH), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), WIDTH)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
    return tokens.to(device), mask.to(device), torch.zeros(len(rows), dtype=torch.bool,
                                                           device=device)


def fixed_rollout(policy, tokenizer, prompts, group_size, temperature, max_new_tokens=None,
                  format_weight=0.0, generator=None, return_logprobs=False, return_hidden=False):
    """task.rollout's contract, with the fixed completions; return_logprobs: the policy's log-probs
    of them at the temperature, 0 after each row's end, as the sampler returns its own
    (async_grpo.py's actors), and with return_hidden its hidden states as the sampler's."""
    record("rollout", prompts=list(prompts), group_size=group_size)
    device, G = next(policy.parameters()).device, group_size
    prompt, prompt_mask = tokenizer.encode_batch(prompts, device)
    prompt, prompt_mask = prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    tokens, mask, truncated = fixed_tokens(tokenizer, prompts, G, device)
    completions = tokenizer.decode_completions(tokens, mask)
    rewards = torch.tensor([task.reward(prompts[i // G], c, format_weight)
                            for i, c in enumerate(completions)], device=device)
    correct = torch.tensor([task.reward(prompts[i // G], c) == 1.0
                            for i, c in enumerate(completions)], device=device)
    batch = task.Rollout(prompt, prompt_mask, tokens, mask, truncated, rewards, correct)
    if not return_logprobs:
        return batch
    with torch.no_grad():                                                     # (P*G, WIDTH)
        logp = completion_logprobs(policy, prompt, prompt_mask, tokens, mask, temperature)
        hidden = (completion_hidden(policy, prompt, prompt_mask, tokens, mask)[:, -tokens.size(1):]
                  if return_hidden else None)
    return batch, torch.where(mask > 0, logp, 0.0), hidden


def fixed_complete(model, tokenizer, prompts, num_samples=1, temperature=0.0, max_new_tokens=None,
                   batch_size=256, generator=None, return_ids=False, return_logprobs=False,
                   top_p=None, done=None, return_hidden=False):
    """task.complete's contract, with the fixed completions (expert_iteration.py's and prm.py's
    samples) and the policy's log-probs of them as the sampler's; the tool task's evaluation
    (agent.py's) samples its episodes."""
    if task.name() in ("toolcalc", "guess"):
        return COMPLETE(model, tokenizer, prompts, num_samples, temperature, max_new_tokens,
                        batch_size, generator, return_ids, return_logprobs, top_p, done,
                        return_hidden)
    record("complete", prompts=list(prompts), n=num_samples)
    if done is not None:
        done(len(prompts))
    texts = [fixed_completion(p, j) for p in prompts for j in range(num_samples)]
    ids = [tokenizer.encode(t) + [tokenizer.eos_id] for t in texts]                      # ended
    if return_logprobs:
        flat = task.sampled_logprobs(model, tokenizer, [p for p in prompts
                                                        for _ in range(num_samples)],
                                     ids, temperature).tolist()
        ends = torch.tensor([len(c) for c in ids]).cumsum(0).tolist()
        out = texts, ids, [flat[e - len(c):e] for c, e in zip(ids, ends)]
        return (*out, sampled_hidden(model, tokenizer, prompts, num_samples, ids)) \
            if return_hidden else out
    return (texts, ids) if return_ids else texts


@torch.no_grad()
def sampled_hidden(model, tokenizer, prompts, n, ids):
    """The policy's final hidden states of every id in order, flat (sum of lengths, C), as the
    sampler's (task.complete's return_hidden)."""
    device, parts = next(model.parameters()).device, []
    for p, c in zip([p for p in prompts for _ in range(n)], ids):
        tokens, attn, mask = task.completion_batch([p], [c], tokenizer, device)
        parts.append(model.hidden(tokens[:, :-1], attn[:, :-1])[mask > 0])
    return torch.cat(parts)


def fixed_episode(prompt, j, turns):
    """Episode j of a tool-task prompt as the worker's policy plays it: [(text, who)] in order, who
    "policy" or "env", None as text for the policy's EOS. The first attempt by j % 4: a call
    (right), the head with the product or the last result off (wrong), a call the calculator refuses
    (on an easy problem the head, right: groups of the two kinds differ in their rewards' spread), a
    run-on with no answer (40 tokens: past any budget below it, the episode truncated); with turns
    2, the revision prompt and the second: the head off, a call, the head (right)."""
    # right, in the head
    r, head = toolcalc.answer(prompt), toolcalc.attempt(prompt, slip=toolcalc.is_hard(prompt))
    call = [(f"<{prompt[:-1]}>", "policy"), (str(r), "env"), (f"#{r}", "policy")]
    wrong = [(toolcalc.synthetic_mistake(prompt), "policy")]
    refused = [(f"<{prompt[:-1]}x>", "policy"), ("error", "env"), ("#0", "policy")]
    third = refused if toolcalc.is_hard(prompt) else [(head, "policy")]
    first = [call, wrong, third, [("1+" * 20, "policy")]][j % 4] + [(None, "policy")]
    second = [wrong, call, [(head, "policy")], []][j % 4] + [(None, "policy")]
    return first + ([(toolcalc.revision(prompt), "env")] + second if turns == 2 else [])


def fixed_guess_episode(prompt, j):
    """Episode j of a game (multiturn.py) as the worker's policy plays it, [(text, who)] as
    fixed_episode's. By j % 4: the middle of what is still possible each turn; 8, then the lowest
    number still possible; a turn that is not a number, then the middle; a run-on of three digits
    (the turn's whole budget: cut there). Each guess then the policy's EOS, then the environment's
    answer, until a right guess or MAX_TURNS."""
    n, lo, hi, guesses, out = guess.secret(prompt), 1, 15, [], []
    if j % 4 == 3:
        return [("123", "policy")]
    while len(guesses) < guess.MAX_TURNS:
        if j % 4 == 2 and not guesses:
            g = "x"
        else:
            g = str(8 if j % 4 == 1 and not guesses else lo if j % 4 == 1 else (lo + hi) // 2)
        guesses.append(g)
        out += [(g, "policy"), (None, "policy")]
        reply = guess.feedback(prompt, guesses)
        if reply is None or len(guesses) == guess.MAX_TURNS:
            break
        out.append((reply, "env"))
        if g != "x":
            lo, hi = (int(g) + 1, hi) if n > int(g) else (lo, int(g) - 1)
    return out


def fixed_chat_episode(protocol, prompt, j):
    """Episode j in the chat protocol (--chat --tools calculator): [(ids, who)] in order, the
    policy's turns as the template writes them (its end of turn last), the environment's tool
    messages and next opening. By j % 4: a call, its reply, the answer (right); the head with the
    product or last result off (wrong); a call the calculator refuses (on an easy problem the head,
    right), its error, '#0'; a run-on with no end (120 tokens)."""
    r, head = toolcalc.answer(prompt), toolcalc.attempt(prompt, slip=toolcalc.is_hard(prompt))

    def called(expression, reply, answer):
        call = {"type": "function", "function": {"name": "calculator",
                                                 "arguments": {"expression": expression}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": reply}, {"role": "assistant", "content": answer}]
    refused = prompt[:-1] + "x"
    wrong = [{"role": "assistant", "content": toolcalc.synthetic_mistake(prompt)}]
    plans = [called(prompt[:-1], str(r), f"#{r}"), wrong,
             called(refused, toolcalc.calculator(refused), "#0") if toolcalc.is_hard(prompt) else
             [{"role": "assistant", "content": head}]]
    if j % 4 == 3:
        return [(protocol.tok.encode("1+" * 60), "policy")]
    _, pieces = protocol.demonstration(prompt, plans[j % 4])
    return [(ids, "env" if env else "policy") for ids, env in pieces]


class Planned(torch.nn.Module):
    """A policy that puts all its probability on the next token of each row's plan (token ids after
    the prompt; an EOS past its end), whatever it was fed: where the environment writes, its choice
    is not used, so an episode is its plan when the environment writes what the plan says it
    does."""

    def __init__(self, config, plans, device, eos_id):
        super().__init__()
        self.config, self.plans, self.eos_id, self.k = config, plans, eos_id, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1, device=device))  # next(parameters()).device

    def hidden(self, idx, mask=None, cache=None):
        self.k = 0 if cache.length == 0 else self.k + 1                 # the position being sampled
        cache.length += idx.size(1)
        return torch.zeros(idx.size(0), idx.size(1), self.config.n_embd, device=idx.device)

    def logits(self, h, *args, **kwargs):
        out = torch.zeros(*h.shape[:-1], self.config.vocab_size, device=h.device)
        last = out if out.dim() == 2 else out[:, -1]
        for i, plan in enumerate(self.plans):
            last[i, plan[self.k] if self.k < len(plan) else self.eos_id] = 100.0
        return out

    def forward(self, idx, mask=None, cache=None):
        return self.logits(self.hidden(idx, mask, cache))


def fixed_episodes(policy, tokenizer, prompts, group_size=1, temperature=1.0, max_new_tokens=None,
                   max_calls=None, turns=1, tool=True, generator=None, keep_hidden=False):
    """task.episodes with the planned policy when agent.py samples for training (a generator and
    --max_calls given); the held-out evaluation's (greedy, or task.complete's samples) as is."""
    if generator is None or max_calls is None:
        return EPISODES(policy, tokenizer, prompts, group_size, temperature, max_new_tokens,
                        max_calls, turns, tool, keep_hidden=keep_hidden)
    record("episodes", prompts=list(prompts), group_size=group_size)
    protocol = task.chat_tools(tokenizer)
    if protocol is not None:
        plans = [sum((ids for ids, _ in fixed_chat_episode(protocol, p, j)), []) for p in prompts
                 for j in range(group_size)]
    else:
        plan = (lambda p, j: fixed_guess_episode(p, j)) if task.name() == "guess" else (
            lambda p, j: fixed_episode(p, j, turns))
        plans = [sum(([tokenizer.eos_id] if text is None else tokenizer.encode(text) for text, _ in
                      plan(p, j)), []) for p in prompts for j in range(group_size)]
    planned = Planned(policy.config, plans, next(policy.parameters()).device, tokenizer.eos_id)
    return EPISODES(planned, tokenizer, prompts, group_size, temperature, max_new_tokens, max_calls,
                    turns, tool, generator, keep_hidden)


class PlannedTurns(torch.nn.Module):
    """multiturn.py --layout steps: a policy that writes each row's next turn as planned, found by
    the row's step prompt (rows of one prompt take their plans in order: the games' order)."""
    sampler_mode = "eager"

    def __init__(self, config, turns, device, eos_id):
        super().__init__()
        self.config, self.turns, self.eos_id, self.plans, self.k = config, turns, eos_id, [], 0
        self.anchor = torch.nn.Parameter(torch.zeros(1, device=device))

    def hidden(self, idx, mask, cache):
        if cache.length == 0:                             # the prompts: each row's plan found
            self.plans = [self.turns[tuple(row[m > 0].tolist())].pop(0)
                          for row, m in zip(idx, mask)]
            self.k = -1
        self.k += 1                                       # the position being sampled
        cache.length += idx.size(1)
        return torch.zeros(idx.size(0), idx.size(1), self.config.n_embd, device=idx.device)

    def logits(self, h, *args, **kwargs):
        out = torch.zeros(*h.shape[:-1], self.config.vocab_size, device=h.device)
        last = out if out.dim() == 2 else out[:, -1]
        for i, plan in enumerate(self.plans):
            last[i, plan[self.k] if self.k < len(plan) else self.eos_id] = 100.0
        return out

    def forward(self, idx, mask=None, cache=None):
        return self.logits(self.hidden(idx, mask, cache))


def fixed_step_rows(script):
    """multiturn.step_rows with the planned games (fixed_guess_episode) when it samples for
    training (a generator given); the held-out evaluation's as is."""
    step_rows = script.step_rows

    def step_rows_(policy, tok, prompts, G, temperature, max_new_tokens, K, generator=None,
                   keep_hidden=False, history=None):
        if generator is None or history is not None:     # the plans key on the full history
            return step_rows(policy, tok, prompts, G, temperature, max_new_tokens, K, generator,
                             keep_hidden, history)
        record("episodes", prompts=list(prompts), group_size=G)
        turns = {}                                 # step prompt ids -> its turns' ids, j's order
        for p in prompts:
            for j in range(G):
                plan, said = fixed_guess_episode(p, j), []
                for k, (text, who) in enumerate(plan):
                    if who == "policy" and text is not None:
                        ended = k + 1 < len(plan) and plan[k + 1][0] is None
                        ids = tok.encode(text) + ([tok.eos_id] if ended else [])
                        turns.setdefault(tuple(script.step_prompt(tok, p, said)), []).append(ids)
                        said.append(text)
        planned = PlannedTurns(policy.config, turns, next(policy.parameters()).device,
                               tok.eos_id)
        return step_rows(planned, tok, prompts, G, temperature, max_new_tokens, K, generator,
                         keep_hidden)
    script.step_rows = step_rows_


def fixed_ppo_rollout(policy, tok, prompts, temperature, max_new_tokens, generator, device,
                      autocast):
    """ppo.rollout's contract, with the fixed completions (one per prompt) and the policy's
    log-probs of them as the sampler's (greedy: 0.0, as the sampler's)."""
    record("ppo_rollout", prompts=list(prompts))
    idx, idx_mask = tok.encode_batch(prompts, device)
    tokens, mask, truncated = fixed_tokens(tok, prompts, 1, device)
    with torch.no_grad():
        logp = (completion_logprobs(policy, idx, idx_mask, tokens, mask, temperature)
                if temperature > 0 else torch.zeros_like(mask))
        hidden = completion_hidden(policy, idx, idx_mask, tokens, mask)[:, -tokens.size(1):]
    return (torch.cat([idx, tokens], 1), torch.cat([idx_mask, mask], 1), idx.size(1), tokens, mask,
            truncated, torch.where(mask > 0, logp, 0.0), hidden)


def recording_batches():
    """task.completion_batch and task.pair_batch record what a loss is computed on (a call with
    gradient enabled; scoring and evaluation run without); a pair batch is recorded as its pairs,
    not as the rows it builds."""
    completion_batch, pair_batch = task.completion_batch, task.pair_batch
    inside_pairs = []

    def completion_batch_(prompts, completions, tokenizer, device="cpu"):
        if torch.is_grad_enabled() and not inside_pairs:
            record("completion_batch", prompts=list(prompts),
                   completions=[c if isinstance(c, str) else list(c) for c in completions])
        return completion_batch(prompts, completions, tokenizer, device)

    def pair_batch_(pairs, tokenizer, device="cpu"):
        if torch.is_grad_enabled():
            record("pair_batch", pairs=[dict(p) for p in pairs])
        inside_pairs.append(True)
        try:
            return pair_batch(pairs, tokenizer, device)
        finally:
            inside_pairs.pop()
    task.completion_batch, task.pair_batch = completion_batch_, pair_batch_


def recording_unpack(script):
    """async_grpo.py's learner records each step's groups as it unpacks them: prompt ids (padding
    dropped), completion rows (Tn ids each, padding kept: the test finds the EOS itself), rewards,
    behaviour log-probs and versions."""
    unpack = script.unpack

    def unpack_(*args, **kwargs):
        batch, logp, version = unpack(*args, **kwargs)
        record("async_batch", prompts=[p[m > 0].tolist()
                                       for p, m in zip(batch.prompt, batch.prompt_mask)],
               tokens=batch.tokens.tolist(), rewards=batch.rewards.tolist(),
               logp=logp.cpu().clone(), version=version.long().tolist())
        return batch, logp, version
    script.unpack = unpack_


def recording_randperm():
    randperm = torch.randperm

    def randperm_(*args, **kwargs):
        perm = randperm(*args, **kwargs)
        record("randperm", perm=perm.cpu().clone())
        return perm
    torch.randperm = randperm_


def save_init(params):
    """The starting weights to $DDP_WORKER_INIT (rank 0); --fsdp's shards made whole first (every
    rank takes part)."""
    path = os.environ.get("DDP_WORKER_INIT")
    if not path:
        return
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    if int(os.environ.get("RANK", 0)) == 0 and not os.path.exists(path):
        torch.save([p.detach().cpu().clone() for p in whole], path)


class SGD(torch.optim.SGD):
    """torch.optim.SGD that records each step's gradients (after any clipping) and learning rates to
    $DDP_WORKER_LOG, one list per parameter group."""

    def step(self, closure=None):
        if os.environ.get("DDP_WORKER_LOG"):
            record("step", lr=[g["lr"] for g in self.param_groups],
                   grads=[[None if p.grad is None else p.grad.detach().cpu().clone()
                           for p in g["params"]] for g in self.param_groups])
        return super().step(closure)


def sgd(params, lr=None, weight_decay=0.0, **kwargs):
    """SGD at lr 0.1 ($DDP_WORKER_LR) in place of AdamW (the weight decay passed on: for SGD,
    AdamW's decoupled decay is the same update); the first optimiser made (the policy's) records the
    starting weights, in model.parameters() order, to $DDP_WORKER_INIT, for the test to subtract
    (sft.py starts from random weights)."""
    params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
    # the policy's (ppo.py: group 0)
    first = params[0]["params"] if isinstance(params[0], dict) else params
    save_init(first)
    lr = float(os.environ.get("DDP_WORKER_LR", 0.1))
    optimizer = SGD(params, lr=lr, weight_decay=weight_decay)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return optimizer


def trpo_init():
    """trpo.py has no optimiser: the starting weights are the first policy loaded."""
    load_policy = plumbing.Run.load_policy

    def load_policy_(self, path):
        policy, tok = load_policy(self, path)
        save_init(policy.parameters())
        return policy, tok
    plumbing.Run.load_policy = load_policy_


def script_args(name, argv):
    """(module name, its flags): the "orm" alias, and --steps where a script counts its steps
    otherwise."""
    if name == "orm":
        name, argv = "prm", argv + ["--train", "orm"]
    if name in ("expert_iteration", "prm") and "--steps" in argv:
        i = argv.index("--steps")
        argv = argv[:i] + (["--rounds", argv[i + 1]] if name == "expert_iteration" else []) + argv[
            i + 2:]
    return name, argv


if __name__ == "__main__":
    name, argv = script_args(sys.argv[1], sys.argv[2:])
    script = importlib.import_module(name)
    task.rollout = fixed_rollout
    task.complete = fixed_complete
    task.episodes = fixed_episodes
    recording_batches()
    torch.optim.AdamW = sgd
    if name == "ppo":
        script.rollout = fixed_ppo_rollout
        recording_randperm()
    if name == "trpo":
        trpo_init()
    if name == "async_grpo":                # its actors run this command too: the fixed completions
        recording_unpack(script)
    if name == "multiturn":
        fixed_step_rows(script)
    # this rank's log-probs are NaN
    if os.environ.get("DDP_WORKER_NAN_RANK") == os.environ.get("RANK", "0"):
        completion_logprobs = script.completion_logprobs

        def nan_logprobs(*a, **k):                  # (and the hidden states, when asked for)
            got = completion_logprobs(*a, **k)
            return (got[0] * float("nan"), got[1]) if isinstance(got, tuple) else got * float("nan")
        script.completion_logprobs = nan_logprobs
    script.main(script.parse_args(argv))
