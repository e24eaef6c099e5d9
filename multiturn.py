"""
Multi-turn credit: GRPO on episodes of several turns, each answered by the environment, with the
credit each turn gets chosen by --credit. The environment: tasks/guess.py, a hidden number from 1
to 15 found by at most four guesses, each wrong one answered higher or lower (binary search needs
3.27 turns on average); every turn has a reward the environment computes (the information its
answer gives), and the episode an outcome (found or not). --chat: each guess an assistant turn and
each answer a user turn, in the checkpoint's chat template. --layout steps: each turn its own
sample, trained on the game so far as the template renders it then (as the model read it where a
template rewrites earlier turns: Qwen3's drops earlier reasoning), each row normalised by its
episode's |o_i|; --history k keeps the last k turns, summary none, the prompt saying the range
still possible.

Group of G episodes of one game, episode i, turn k (K_i turns), r_ik the turn's reward, O_i the
outcome; every token the policy wrote in turn k gets A_ik, the environment's tokens none:
    outcome  A_ik = z(O_i)                           GRPO on the whole episode (baseline)
    mt_grpo  A_ik = z_k(r_ik) + lambda z(O_i)        MT-GRPO (Zeng et al. 2025, arXiv 2505.11821)
    returns  A_ik = z_k(R_ik),  R_ik = sum_{j>=k} gamma^(j-k) r'_ij,  r'_ij = r_ij + O_i [j = K_i-1]
    gigpo    A_ik = z(sum_j r'_ij) + omega z_s(R_ik) GiGPO (Feng et al. 2025, arXiv 2505.10978)
z: (x - mean) / (std + eps) over the group (population std), 0 where all are equal; z_k over the
group's episodes that reached turn k; z_s over the group's turns that start from the same state s
(the numbers guessed so far, as the environment reads them: the anchor states), 0 for a state
seen once. lambda and omega: --turn_weight; gamma: --gamma. The loss is agent.py's: the clipped
surrogate plus beta KL, on the tokens the policy sampled.

Deviations and choices:
- MT-GRPO's paper has two turns, a tool call's reward on the first and the outcome alone on the
  last; here every turn has its own reward, so every turn gets z_k(r_ik) + lambda z(O_i).
- GiGPO's episode return is the undiscounted sum of rewards: here the information of the turns
  (1 for any episode that ends knowing the number) plus the outcome, so a longer search is not
  paid more; its step returns are discounted (gamma, the paper's 0.95 by default here too).
- An episode cut by the token budget ends there; its turns so far keep their rewards.
- z: the population std (the papers'; the official code's torch.std is Bessel's), 0 for a group
  of one. GiGPO's episode term over the G episodes (Eq. 3; verl-agent's default: over the group's
  turns). MT-GRPO's lambda weighs the outcome (its trainer's coef, the turn term: 1 / lambda, the
  advantage times lambda). --official: the official numbers of all three (tests/test_multiturn.py).
Shapes: P prompts, G episodes each, B = P*G rows; Tn episode tokens; K turns at most.
Run (builds out/guess/sft.pt first, sft.py --task guess): python multiturn.py (--credit outcome)
    python multiturn.py --credit gigpo       # or mt_grpo, returns (experiments/multiturn_credit.py)
Metrics: out/guess/multiturn/metrics.jsonl (docs/metrics.md); checkpoint out/guess/multiturn.pt.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

import sampler
import task
from agent import agent_loss
from lora import trainable
from model import completion_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser
from tasks import guess

CREDITS = ("outcome", "mt_grpo", "returns", "gigpo")


# -----------------------------------------------------------------------------
# The algorithm: advantages per turn, each from its estimator's equation

def normalise(x, present, groups, eps=1e-6, tol=1e-6, counts=None, bessel=False):
    """z-scores of x (N,) within each group (groups (N,) int64, any ids) over the present
    entries (present (N,) bool), population std; 0 for absent entries and for a group whose
    present entries are all equal (a group of one too): within tol * max(1, |x|), as float32 sums
    equal in arithmetic are (searches that all find the number: 1 + 1 each, to 1e-7). counts (N,):
    each entry counted so many times in the mean and std; bessel: std over n - 1 (torch.std)."""
    ids, idx = torch.unique(groups, return_inverse=True)
    w = present.to(x.dtype) * (1.0 if counts is None else counts.to(x.dtype))
    zeros = lambda: x.new_zeros(len(ids))
    n = zeros().index_add_(0, idx, w).clamp(min=1)
    mean = zeros().index_add_(0, idx, w * x) / n
    var = zeros().index_add_(0, idx, w * (x - mean[idx]) ** 2) / (n - 1 if bessel else n).clamp(
        min=1)
    hi = x.new_full((len(ids),), -torch.inf).scatter_reduce_(
        0, idx, torch.where(present, x, -torch.inf), "amax")
    lo = x.new_full((len(ids),), torch.inf).scatter_reduce_(
        0, idx, torch.where(present, x, torch.inf), "amin")
    z = (x - mean[idx]) / (var[idx].sqrt() + eps)
    spread = hi - lo > tol * torch.maximum(hi.abs(), lo.abs()).clamp(min=1.0)
    return torch.where(present & spread[idx], z, torch.zeros_like(z))


def episode_z(values, G, **stats):
    """values (B,) -> z over each group of G consecutive episodes (B,); stats: normalise's."""
    groups = torch.arange(len(values), device=values.device) // G
    return normalise(values, torch.ones_like(values, dtype=torch.bool), groups, **stats)


def turn_z(values, present, G, **stats):
    """values, present (B, K) -> z_k: over each group's episodes that reached turn k (B, K)."""
    B, K = values.shape
    rows, turns = (torch.arange(n, device=values.device) for n in (B, K))
    groups = (rows[:, None] // G) * K + turns[None, :]                           # (B, K)
    return normalise(values.reshape(-1), present.reshape(-1), groups.reshape(-1),
                     **stats).view(B, K)


def with_outcome(rewards, present, outcome):
    """r'_ik: the turn rewards (B, K) with the outcome (B,) added at each episode's last turn."""
    last = present & ~torch.cat([present[:, 1:], torch.zeros_like(present[:, :1])], 1)
    return torch.where(present, rewards, 0.0) + last * outcome[:, None]


def discounted_returns(rewards, present, gamma):
    """R_ik = sum_{j>=k, present} gamma^(j-k) r_ij (B, K), 0 where turn k is absent."""
    out, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for k in reversed(range(rewards.size(1))):
        running = torch.where(present[:, k], rewards[:, k], 0.0) + gamma * running
        out[:, k] = torch.where(present[:, k], running, 0.0)
    return out


def outcome_advantages(outcome, present, G):
    """A_ik = z(O_i) on every turn the episode reached (B, K)."""
    return torch.where(present, episode_z(outcome, G)[:, None], 0.0)


def mt_grpo_advantages(rewards, outcome, present, G, weight=1.0, official=False):
    """MT-GRPO: A_ik = z_k(r_ik) + lambda z(O_i) (B, K); official: A_ik = lambda z_k(r_ik) + z(O_i),
    Bessel's std and eps 1e-4, as its trainer computes them (--turn_advantage_coef)."""
    if official:
        z = dict(eps=1e-4, bessel=True)
        return torch.where(present, weight * turn_z(rewards, present, G, **z) +
                           episode_z(outcome, G, **z)[:, None], 0.0)
    return torch.where(present, turn_z(rewards, present, G) + weight *
                       episode_z(outcome, G)[:, None], 0.0)


def returns_advantages(rewards, outcome, present, G, gamma=0.95):
    """A_ik = z_k(R_ik), R the discounted returns of r' (the outcome at the last turn) (B, K)."""
    R = discounted_returns(with_outcome(rewards, present, outcome), present, gamma)
    return turn_z(R, present, G)


def gigpo_advantages(rewards, outcome, present, states, G, gamma=0.95, weight=1.0,
                     official=False):
    """GiGPO: A_ik = z(sum_j r'_ij) + omega z_s(R_ik); states (B, K) int64, the same id for the
    same state (ids never shared across groups), z_s over the turns of each state (B, K).
    official: as verl-agent computes them, Bessel's std, the episode term's mean and std over the
    group's turns (an episode counted once per turn: compute_mean_std_cross_steps)."""
    full = with_outcome(rewards, present, outcome)                     # (B, K) r'
    R = discounted_returns(full, present, gamma)                       # (B, K) step returns
    step = normalise(R.reshape(-1), present.reshape(-1), states.reshape(-1),
                     bessel=official).view_as(R)
    episode = episode_z(full.sum(1), G, bessel=official,
                        counts=present.sum(1) if official else None)
    return torch.where(present, episode[:, None] + weight * step, 0.0)


def turn_advantages(credit, rewards, outcome, present, states, G, gamma, weight,
                    official=False):
    """--credit's estimator: (B, K) advantages of each episode's turns (--official: mt_grpo's
    and gigpo's as their code computes them)."""
    if credit == "outcome":
        return outcome_advantages(outcome, present, G)
    if credit == "mt_grpo":
        return mt_grpo_advantages(rewards, outcome, present, G, weight, official)
    if credit == "returns":
        return returns_advantages(rewards, outcome, present, G, gamma)
    return gigpo_advantages(rewards, outcome, present, states, G, gamma, weight, official)


# -----------------------------------------------------------------------------
# What the environment says of each episode

def judged(prompts, G, texts, K, device):
    """(rewards (B, K), outcome (B,), present (B, K) bool, states (B, K) int64) of the episodes'
    turns (texts), by the environment (tasks/guess.py)."""
    B = len(texts)
    rewards, present = torch.zeros(B, K, device=device), torch.zeros(B, K, dtype=torch.bool,
                                                                     device=device)
    states, ids = torch.zeros(B, K, dtype=torch.long, device=device), {}
    outcome = torch.tensor([guess.outcome(prompts[i // G], t) for i, t in enumerate(texts)],
                           device=device)
    for i, t in enumerate(texts):
        p = prompts[i // G]
        for k, (r, s) in enumerate(zip(guess.turn_rewards(p, t), guess.states(p, t))):
            rewards[i, k], present[i, k] = r, True
            states[i, k] = ids.setdefault((i // G, s), len(ids))   # ids of this group alone
    return rewards, outcome, present, states


# -----------------------------------------------------------------------------
# The two layouts: an episode a row (what the policy read, if the template only appends), or a
# turn a row, its prompt the game so far as the template renders it then

class Rows(NamedTuple):
    prompt: torch.Tensor        # (R, Tp) left-padded
    prompt_mask: torch.Tensor   # (R, Tp)
    tokens: torch.Tensor        # (R, Tn) right-padded: an episode's tokens, or one turn's
    mask: torch.Tensor          # (R, Tn) 1.0 on real tokens
    sampled: torch.Tensor       # (R, Tn) 1.0 on the policy's
    logp: torch.Tensor          # (R, Tn) the sampler's log-probs
    turn: torch.Tensor          # (R, Tn) int64: each token's turn
    episode: torch.Tensor       # (R,) int64: each row's episode
    texts: list                 # each episode's turns as written
    hidden: object = None       # (R, Tn, C) the sampler's hidden states (logged steps)


def step_prompt(tok, prompt, turns, history=None):
    """The ids the policy reads before the turn after `turns`: through the chat template, the
    user's prompt, each turn and its answer, then the generation prompt, rendered whole (a
    template may write earlier turns otherwise than it did then); compact: the prompt, then each
    turn, its end token and its answer. history (--history): None, every turn; k, the last k
    (an answer reads only its own guess); "summary", none, the prompt rewritten with the range
    still possible (guess.summary)."""
    if history == "summary":
        prompt, turns = guess.summary(prompt, turns), []
    elif history is not None:
        turns = turns[len(turns) - history:] if history else []
    if tok.chat is not None:
        chat = [{"role": "user", "content": prompt}, *guess.messages(prompt, turns, True)]
        return tok.chat.encode(chat, tok.encode_special, tok.encode)
    ids = tok.encode_prompt(prompt)
    for k, text in enumerate(turns):
        ids += tok.encode(text) + [tok.eos_id] + tok.encode(guess.feedback(prompt, turns[:k + 1]))
    return ids


def episode_rows(ep, tok):
    """Rows of whole episodes (episode.Episodes)."""
    return Rows(ep.prompt, ep.prompt_mask, ep.tokens, ep.mask, ep.sampled, ep.logp, ep.turn,
                torch.arange(len(ep.tokens), device=ep.tokens.device), task.turn_texts(ep, tok),
                ep.hidden)


def check_step_prompt(n, k, max_new_tokens, block_size):
    """--layout steps: turn k's prompt of n tokens and its turn must fit the context."""
    if n + max_new_tokens > block_size:
        raise SystemExit(f"error: --layout steps: turn {k}'s prompt, the game so far rendered "
                         f"again by the chat template, is {n} tokens, and {max_new_tokens} more "
                         f"(--max_new_tokens) pass the model's context of {block_size}: its "
                         f"template writes the history longer than the episode; allowed: a "
                         f"context of {n + max_new_tokens}, or --layout episode")


def check_step_prompts(policy, tok, max_new_tokens, K, history=None):
    """Before any work: the longest held-out game's last turn after K - 1 misses (a template may
    write earlier turns longer as the game goes on: the episode's check cannot see it)."""
    prompt = max(task.eval_prompts(), key=len)
    misses = [str(n) for n in range(10, 16) if n != guess.secret(prompt)][:K - 1]
    check_step_prompt(len(step_prompt(tok, prompt, misses, history)), K, max_new_tokens,
                      policy.config.block_size)


@torch.no_grad()
def step_rows(policy, tok, prompts, G, temperature, max_new_tokens, K, generator=None,
              keep_hidden=False, history=None):
    """G episodes a game sampled a turn at a time, each turn from step_prompt (ended by a stop id,
    or by the budget, which ends the episode; a right guess ends it too): a row each turn, its
    prompt what the policy read (history: step_prompt's)."""
    device = next(policy.parameters()).device
    games = [p for p in prompts for _ in range(G)]
    texts, live, made = [[] for _ in games], list(range(len(games))), []
    for k in range(K):
        if not live:
            break
        prompts_k = [step_prompt(tok, games[i], texts[i], history) for i in live]
        check_step_prompt(max(map(len, prompts_k)), k + 1, max_new_tokens,
                          policy.config.block_size)
        prompt, prompt_mask = sampler.left_pad(prompts_k, tok.pad_id, device)
        tokens, mask, truncated, *logp = sampler.generate(
            policy, prompt, prompt_mask, max_new_tokens, tok.stop_ids, tok.pad_id,
            temperature=temperature, generator=generator, return_logprobs=temperature > 0,
            return_hidden=keep_hidden)
        still = []
        for j, i in enumerate(live):
            n = int(mask[j].sum())
            ids = tokens[j, :n].tolist()
            texts[i].append(tok.decode([t for t in ids if t not in tok.stop_ids]))
            made.append((i, k, prompt[j][prompt_mask[j] > 0].tolist(), ids,
                         logp[0][j, :n].tolist() if temperature > 0 else [0.0] * n,
                         logp[-1][j, :n] if keep_hidden else None))
            if not truncated[j] and guess.feedback(games[i], texts[i]) is not None:
                still.append(i)
        live = still
    made.sort(key=lambda r: r[:2])                       # an episode's turns together, in order
    prompt, prompt_mask = sampler.left_pad([r[2] for r in made], tok.pad_id, device)
    Tn = max(len(r[3]) for r in made)
    pad = lambda rows, v: torch.tensor([r + [v] * (Tn - len(r)) for r in rows], device=device)
    mask = pad([[1.0] * len(r[3]) for r in made], 0.0)
    hidden = (torch.stack([F.pad(r[5], (0, 0, 0, Tn - len(r[5]))) for r in made])
              if keep_hidden else None)                                  # (R, Tn, C)
    return Rows(prompt, prompt_mask, pad([r[3] for r in made], tok.pad_id), mask, mask,
                pad([r[4] for r in made], 0.0),
                torch.tensor([r[1] for r in made], device=device)[:, None].expand(-1, Tn),
                torch.tensor([r[0] for r in made], device=device), texts, hidden)


def sample(policy, tok, prompts, G, temperature, args, generator=None, keep_hidden=False):
    """--layout's rows of G episodes a game (keep_hidden: and the sampler's hidden states)."""
    if args.layout == "steps":
        return step_rows(policy, tok, prompts, G, temperature, args.max_new_tokens,
                         guess.MAX_TURNS, generator, keep_hidden, history(args))
    return episode_rows(task.episodes(policy, tok, prompts, G, temperature, args.max_new_tokens,
                                      0, guess.MAX_TURNS, generator=generator,
                                      keep_hidden=keep_hidden), tok)


def evaluate_turns(run, policy, tok, args):
    """Held-out greedy episodes: how often found, with how many turns (rank 0 alone)."""
    if not run.is_main:
        return {}
    prompts = task.eval_prompts()[:args.eval_n]
    with run.autocast:
        texts = sample(policy, tok, prompts, 1, 0.0, args).texts
    found = [guess.outcome(p, t) for p, t in zip(prompts, texts)]
    turns = [len(t) for t in texts]
    return {"eval_found": sum(found) / len(found), "eval_turns": sum(turns) / len(turns),
            "eval_turns_found": (sum(n for n, f in zip(turns, found) if f) / max(sum(found), 1))}


# -----------------------------------------------------------------------------
# Hyperparameters

def history(args):
    """--history as step_prompt takes it: None (full), a number of turns, or "summary"."""
    h = args.history
    return None if h == "full" else h if h == "summary" else int(h)


def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--credit", default="outcome", choices=CREDITS,
                   help="how each turn's advantage is made (module docstring)")
    g.add_argument("--gamma", type=Float(ge=0, le=1), default=0.95,
                   help="discount of later turns' rewards (returns, gigpo)")
    g.add_argument("--turn_weight", type=Float(ge=0), default=1.0,
                   help="lambda (mt_grpo: the outcome's weight) or omega (gigpo: the step's)")
    g.add_argument("--official", action="store_true",
                   help="mt_grpo and gigpo as their official code computes them (module "
                        "docstring: Bessel's std, the episode term over turns, lambda's place)")
    g.add_argument("--layout", default="episode", choices=["episode", "steps"],
                   help="a row an episode, or a row a turn, its prompt re-rendered (what the "
                        "policy read where a template rewrites earlier turns)")
    g.add_argument("--history", default="full",
                   help="--layout steps: what a turn's prompt holds of the game so far: full, the "
                        "last k turns (0 to the game's 4), or summary (the range still "
                        "possible, in the prompt's words)")
    g.add_argument("--group_size", type=Int(ge=2), default=8, help="G: episodes sampled per game")
    g.add_argument("--clip_eps", type=Float(gt=0, le=1), default=0.2,
                   help="PPO clip: the ratio kept in [1-eps, 1+eps]")
    g.add_argument("--beta", type=Float(ge=0), default=0.04,
                   help="weight of the KL-to-reference penalty in the loss")
    g.add_argument("--kl_estimator", default="k3", choices=["k1", "k2", "k3"],
                   help="per-token KL estimate in the loss")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=40, help="RL steps (one batch each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=16,
                   help="P: games drawn per step")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="tokens per turn (default: the task's)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "multiturn", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    p.set_defaults(task="guess")
    args = p.parse_args(argv)
    if args.task != "guess":
        p.error(f"--task {args.task}: multiturn.py's turns and their rewards are the guessing "
                f"game's; allowed: --task guess")
    allowed = {"full", "summary", *map(str, range(guess.MAX_TURNS + 1))}
    if args.history not in allowed:
        p.error(f"--history {args.history}: allowed: full, summary, or the last k turns, k from 0 "
                f"to {guess.MAX_TURNS} (a game's turns)")
    if args.history != "full" and args.layout != "steps":
        p.error(f"--history {args.history} needs --layout steps: an episode's row is the whole "
                f"game as one sequence")
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("multiturn", args, batch_flag="prompts_per_step")
    policy, tok = run.load_policy(args.init)            # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy)              # ... which stays frozen as the reference
    ref_weights = run.parked(ref, policy)               # ... in host memory outside step 3 (GPU)
    K = guess.MAX_TURNS                                 # between turns: an answer, an end token
    reply = max(len(r if isinstance(r, list) else tok.encode(r))
                for r in task.environment(0, tok).replies)
    run.check_lengths(policy, tok, args.max_new_tokens, turns=K, extra=(K - 1) * (reply + 1))
    if args.layout == "steps":
        check_step_prompts(policy, tok, args.max_new_tokens, K, history(args))
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    run.print(f"multi-turn ({args.credit} credit): {policy.num_params() / 1e6:.2f}M parameters "
              f"on {run.device}, {args.steps} steps of {P} games x {G} episodes of at most {K} "
              f"turns, gamma {args.gamma}, turn weight {args.turn_weight}, beta {args.beta}, "
              f"{args.layout} layout" + (f", history {args.history}" if args.layout == "steps"
                                         else ""))
    if not args.resume:                                 # a fresh run: the starting policy is step 0
        run.log_start({**run.evaluate(policy, tok), **evaluate_turns(run, policy, tok, args)})

    while run.training():
        # 1. episodes: G per game; the environment answers each turn's guess. A row an episode, or
        #    (--layout steps) a turn, sampled from the game so far as the template renders it
        prompts = run.shard(task.sample_prompts(run.rng, P))
        with run.autocast:
            ep = sample(policy, tok, prompts, G, temp, args, run.gen, keep_hidden=run.logging())
        prompt, prompt_mask, tokens, mask = ep.prompt, ep.prompt_mask, ep.tokens, ep.mask
        run.samples += P * G

        # 2. each turn's reward and state from the environment; the estimator's advantage of each
        #    turn, on every token the policy wrote in it; each row normalised by its episode's
        #    |o_i| (a step is part of one)
        rewards, outcome, present, states = judged(prompts, G, ep.texts, K, run.device)
        turn_adv = turn_advantages(args.credit, rewards, outcome, present, states, G, args.gamma,
                                   args.turn_weight, args.official)                    # (B, K)
        advantages = turn_adv[ep.episode[:, None], ep.turn]                           # (R, Tn)
        lengths = torch.zeros(len(ep.texts), device=run.device).index_add_(
            0, ep.episode, ep.sampled.sum(1))[ep.episode]                            # (R,) |o_i|

        # 3. score without gradient (sampler.score): pi_ref (pi_old is step 4's own forward,
        #    detached); the KL, the entropy and the sampler's KL to the trainer on logged steps.
        #    --batch_invariant: pi_old is the sampler's
        n_seqs, n_tokens = run.all_sum(len(ep.texts)), run.all_sum(ep.sampled.sum())
        with ref_weights, run.autocast:
            scored = sampler.score(policy, ref, prompt, prompt_mask, tokens, mask, ep.logp, temp,
                                   run.micro_batches(len(mask)), run.logging(),
                                   args.batch_invariant, kl_mask=ep.sampled, n_kl=n_tokens,
                                   sampler_hidden=ep.hidden, policy_pass=False)

        # 4. one pass of the loss over the --grad_accum micro-batches, normalised by the step's
        #    counts
        loss, stats = 0.0, {}
        for rows in run.micro_batches(len(mask), train_policy):
            with run.autocast:                   # (b, Tn) log pi_theta, (b, T, C) its states
                logp, h = completion_logprobs(train_policy, prompt[rows], prompt_mask[rows],
                                              tokens[rows], mask[rows], temp, return_hidden=True)
            part, part_stats = agent_loss(logp, scored.own(rows, logp), scored.ref_logp[rows],
                                          advantages[rows], ep.sampled[rows], args.clip_eps,
                                          args.beta, args.kl_estimator, n_seqs, n_tokens,
                                          lengths[rows])
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            scored.measure(rows, logp, h)        # logged: the KL, entropy, sampler gap
            loss = loss + part.detach()
            stats = {k: stats.get(k, 0.0) + v for k, v in part_stats.items()}
        grad_norm = run.clip_grad_norm(train_policy, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.tokens += int(n_tokens)

        # 5. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            used = present.sum(1).float()
            metrics = {"loss": run.all_sum(loss).item(), "found": run.mean(outcome),
                       "turns": run.mean(used), "turn_reward": run.mean(rewards, present),
                       "kl_exact": run.all_sum(scored.kl_exact).item(),
                       "entropy": run.all_sum(scored.entropy).item(),
                       **{k.replace("kl_est", f"kl_{args.kl_estimator}"): run.all_sum(v).item()
                          for k, v in stats.items()},
                       "advantage_abs": run.mean(turn_adv.abs(), present),
                       "grad_norm": grad_norm.item(),
                       "sampler_logp_diff": run.max(scored.sampler_gap),
                       "sampler_kl": run.all_sum(scored.sampler_kl).item()}
            if run.eval_due():
                metrics.update({**run.evaluate(policy, tok), **evaluate_turns(run, policy, tok,
                                                                              args)})
            run.log(metrics, f"found {metrics['found']:.3f} | turns {metrics['turns']:.2f} | "
                             f"turn reward {metrics['turn_reward']:.3f} | "
                             f"kl {metrics['kl_exact']:.4f} | gnorm {metrics['grad_norm']:.3f}",
                    tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
