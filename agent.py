"""
Agent: GRPO on multi-turn episodes; the policy may call a calculator, whose replies are context.
An episode is one token sequence, policy and environment tokens in turn (episode.sample):
- compact (the toy's own, --task toolcalc): the policy writes <37+12*46>, the environment 589 right
  after it, the policy #589; under --turns 2 a revision prompt answers attempt 1.
- --chat --tools calculator: the chat template's own (Qwen2.5/Hermes <tool_call>{json}</tool_call>,
  Llama 3.x's JSON): the schemas in the prompt as the template renders them, a turn's calls run when
  a stop id ends it, the replies as the template's tool messages (hf/tools.py); a turn with no call
  is the answer. Any task.
GRPO's group-relative advantage (G episodes a prompt) goes to every token the policy sampled, never
to the environment's: a loss on those teaches the policy to predict the tool's output instead of
using the tool (ReTool, arXiv 2504.11536; Search-R1, 2503.09516; RAGEN, 2504.20073; ARTIST,
2505.01441). --train_on_env_tokens does it anyway, to show what it does (experiments/README.md).

Episode i, o_i the tokens the policy sampled (the environment's are context, not summed), t in o_i:
    r_i = 1[final answer right] - c * calls_i                                    (c = --call_cost)
    A_i = (r_i - mean(r_1..r_G)) / (s + eps), s = population std of the step's r (--scale_rewards)
    L = 1/G sum_i 1/|o_i| sum_t [ -min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) + beta KL_it ]
--turns 2, self-correction (SCoRe, Kumar et al. 2024, arXiv 2409.12917): each attempt's own reward.
    stage I (the first --stage1_steps): r_2 = right_2 - c calls_2; attempt 1 no reward, KL beta_2
    stage II: r_1 = right_1 - c calls_1,  r_2 = right_2 + alpha (right_2 - right_1) - c calls_2

Deviations and choices (alpha = --shaping):
- s is the step's std, not each group's (GRPO's): a group all right, or all wrong, differs only by
  calls, and its own std would make the 0.1 call cost advantages of +-1 against the tool (TRL's
  scale_rewards="batch", Bessel's std). --scale_rewards group is GRPO's; none divides by 1.
- Each attempt trains on its own reward. The paper's gradient credits attempt 1 with r_2 (stage I)
  or r_1 + r_2 (stage II); here it never earns credit for setting up a good revision.
- Any stop id ends an attempt, trained as sampled; then the revision prompt (a new line, "revise:",
  the problem, no verdict). A malformed call costs a call, answered with an error (hf/tools.py).
- mu passes over the whole batch; old log-probs scored once (step 3); equal rewards give A = 0.

Shapes: P prompts, G episodes each, B = P*G rows; Tp prompt, Tn episode tokens; K attempts.
Run (builds out/toolcalc/sft.pt first; about 6 minutes on 2 CPU cores in all):
    python agent.py
    python agent.py --chat --tools calculator     # the chat protocol (bytes-chat); about 25 minutes
    python agent.py --turns 2 --stage1_steps 20 --steps 40   # SCoRe's stages I and II (README)
    python agent.py --init path/to/Qwen2.5-0.5B-Instruct --chat --tools calculator --task gsm8k ...
Metrics: out/toolcalc/agent/metrics.jsonl (docs/metrics.md); checkpoint out/toolcalc/agent.pt.
"""
import math

import torch

import task
from kernels import kl_penalty
from lora import trainable
from model import completion_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser
from sampler import score
from tasks import toolcalc


# -----------------------------------------------------------------------------
# The algorithm: rewards per attempt, group-relative advantages, the clipped surrogate on the
# policy's tokens only

def episode_rewards(correct, calls, call_cost, shaping):
    """correct, calls (B, K): each attempt's 0/1 answer and its calls -> rewards (B, K):
    r_k = right_k - c calls_k, and with a second attempt SCoRe's bonus alpha (right_2 - right_1)
    added to r_2."""
    rewards = correct - call_cost * calls                              # (B, K)
    if correct.size(1) == 2:
        rewards[:, 1] += shaping * (correct[:, 1] - correct[:, 0])     # alpha (right_2 - right_1)
    return rewards


def grpo_advantages(rewards, group_size, eps=1e-6, present=None, scale=None):
    """rewards (P*G,), G = group_size consecutive episodes per prompt ->
    (r - mean_g) / (std_g + eps) (P*G,), population std; 0 for a group whose rewards are all equal.
    present (P*G,) bool: the episodes that reached this attempt (one that ran out of tokens before
    it has no reward there): the group's mean and std over those alone, 0 for the rest. scale: a
    number to divide by in place of each group's own std (the batch's std, or 1 for none)."""
    r = rewards.view(-1, group_size)                                   # (P, G)
    # (P, G)
    m = torch.ones_like(r, dtype=torch.bool) if present is None else present.view(-1, group_size)
    n = m.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(m, r, 0.0).sum(1, keepdim=True) / n             # over the present ones
    std = ((torch.where(m, (r - mean) ** 2, 0.0).sum(1, keepdim=True) / n).sqrt() if scale is None
           else scale)
    advantages = (r - mean) / (std + eps)
    all_equal = (torch.where(m, r, -math.inf).amax(1, keepdim=True)
                 == torch.where(m, r, math.inf).amin(1, keepdim=True))
    return torch.where(all_equal | ~m, torch.zeros_like(advantages), advantages).view(-1)   # (P*G,)


def batch_std(run, rewards, present=None):
    """The population std of the step's rewards (B,) over every rank, where present (B,) bool: the
    scale of --scale_rewards batch (a group's mean is still its baseline; Liu et al. 2025,
    arXiv 2508.08221)."""
    mean = run.mean(rewards, present)                            # over every rank's present rewards
    return math.sqrt(run.mean((rewards - mean) ** 2, present))


def agent_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps=0.2, beta=0.04,
               kl_estimator="k3", num_seqs=None, num_tokens=None, lengths=None):
    """GRPO's loss on episodes and its metrics (detached). logp (B, T) log pi_theta of the episode's
    tokens (with grad); old_logp (B, T) at sampling time; ref_logp (B, T) under the reference;
    advantages (B, T), each token its attempt's A; beta a number or (B, T), each token's KL weight;
    mask (B, T) 1.0 on the tokens the loss sees: the policy's (Episodes.sampled), never the
    environment's. Where mask is 0 the gradient is exactly 0 (values there are never read).
    num_seqs, num_tokens: the whole step's counts when this batch is a part of it; lengths (B,):
    each row's |o_i| where a row is part of an episode (multiturn.py's steps), else its own."""
    real = mask > 0                                                    # (B, T) bool
    logp, old_logp, ref_logp = (torch.where(real, x, 0.0) for x in (logp, old_logp, ref_logp))
    ratio = torch.exp(logp - old_logp)                                 # rho_it = pi_theta / pi_old
    pg = -torch.min(ratio * advantages,
                    torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)            # (B, T)
    kl_t = kl_penalty(logp, ref_logp, kl_estimator)             # (B, T) KL_it
    per_token = torch.where(real, pg + beta * kl_t, 0.0)        # (B, T) the environment's tokens: 0
    n_seqs = mask.size(0) if num_seqs is None else num_seqs
    o = mask.sum(1) if lengths is None else lengths                    # (B,) |o_i|
    loss = (per_token.sum(1) / o.clamp(min=1)).sum() / n_seqs          # 1/G sum_i 1/|o_i| sum_t
    n_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    clipped = (((advantages > 0) & (ratio > 1 + clip_eps))
               | ((advantages < 0) & (ratio < 1 - clip_eps)))
    return loss, {"clip_frac": torch.where(real, clipped.float(), 0.0).sum() / n_tokens,
                  "kl_est": torch.where(real, kl_t.detach(), 0.0).sum() / n_tokens}


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--group_size", type=Int(ge=2), default=8, help="G: episodes sampled per prompt")
    g.add_argument("--clip_eps", type=Float(gt=0, le=1), default=0.2,
                   help="PPO clip: the ratio kept in [1-eps, 1+eps]")
    g.add_argument("--beta", type=Float(ge=0), default=0.04,
                   help="weight of the KL-to-reference penalty in the loss")
    g.add_argument("--kl_estimator", default="k3", choices=["k1", "k2", "k3"],
                   help="per-token KL estimate in the loss")
    g.add_argument("--mu", type=Int(ge=1), default=1,
                   help="optimisation passes over each batch of episodes")
    g.add_argument("--call_cost", type=Float(ge=0), default=0.1,
                   help="c: subtracted from the reward per call")
    g.add_argument("--max_calls", type=Int(ge=0), default=toolcalc.MAX_CALLS,
                   help="calls the tool answers per episode; later ones get 'error'")
    g.add_argument("--turns", type=Int(ge=1, le=2), default=1,
                   help="attempts: 2 adds a revision turn (SCoRe)")
    g.add_argument("--shaping", type=Float(ge=0), default=1.0,
                   help="alpha: --turns 2 adds alpha (right_2 - right_1) to the second attempt's "
                        "reward (stage II)")
    g.add_argument("--stage1_steps", type=Int(ge=0), default=0,
                   help="--turns 2: SCoRe's stage I for the first steps: attempt 2 trained, "
                        "attempt 1 held by a KL")
    g.add_argument("--stage1_beta", type=Float(ge=0), default=1.0,
                   help="beta_2: stage I's KL weight on the first attempt's tokens")
    g.add_argument("--scale_rewards", default="batch", choices=["group", "batch", "none"],
                   help="divide r - mean_group by the group's std (GRPO), the step's std, "
                        "or nothing")
    g.add_argument("--train_on_env_tokens", action="store_true",
                   help="WRONG, for the study: the environment's tokens (tool replies, revision "
                        "prompt) in the loss")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=30,
                   help="RL steps (one batch of episodes each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=32,
                   help="P: prompts drawn per step")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="tokens per attempt, tool replies included (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of hard problems (two-digit products; default: the task's, 0.5)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "agent", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    p.set_defaults(task="toolcalc")
    args = p.parse_args(argv)
    if args.task != "toolcalc" and not args.tools:
        p.error(f"--task {args.task}: agent.py's compact environment is the tool task's; use "
                f"--task toolcalc, or --chat --tools calculator (the chat template's protocol)")
    if args.tools and args.turns != 1:
        p.error(f"--turns {args.turns}: with --tools an episode is one attempt (the revision "
                f"turn is the compact protocol's); allowed: --turns 1")
    if args.stage1_steps and args.turns != 2:
        p.error(f"--stage1_steps {args.stage1_steps}: SCoRe's stage I trains a second attempt; "
                f"it needs --turns 2")
    if args.stage1_steps > args.steps:
        p.error(f"--stage1_steps {args.stage1_steps} is longer than the run "
                f"(--steps {args.steps}); allowed: --stage1_steps <= --steps")
    return args


def evaluate_tools(run, policy, tok, args):
    """Held-out greedy episodes, beyond run.evaluate's accuracy: calls (all, hard and easy
    problems), accuracy with and without a call and with the tool disabled; with --turns 2, the
    second attempt. Rank 0 alone; {} elsewhere."""
    if not run.is_main:
        return {}
    prompts = task.eval_prompts()[:args.eval_n]
    with run.autocast:
        e = task.episodes(policy, tok, prompts, 1, 0.0, args.max_new_tokens, args.max_calls,
                          args.turns)
        off = task.episodes(policy, tok, prompts, 1, 0.0, args.max_new_tokens, args.max_calls, 1,
                            tool=False)
    right, calls = e.correct[:, 0], e.calls[:, 0]                       # (B,) the first attempt
    called, hard = calls > 0, torch.tensor([task.is_precedence(p) for p in prompts])
    mean = lambda x, where=None: (x[where] if where is not None else x).float().mean().item()
    out = {"eval_accuracy_no_tool": mean(off.correct[:, 0]), "eval_calls": mean(calls),
           "eval_call_share": mean(called), "eval_call_share_hard": mean(called, hard),
           "eval_call_share_easy": mean(called, ~hard), "eval_malformed": mean(e.malformed[:, 0]),
           "eval_turns": mean(e.policy_turns), "eval_accuracy_called": mean(right, called),
           "eval_accuracy_uncalled": mean(right, ~called)}
    if args.turns == 2:
        out.update({"eval_accuracy_turn2": mean(e.correct[:, 1]),
                    "eval_calls_turn2": mean(e.calls[:, 1]),
                    "eval_wrong_to_right": mean((right == 0) & (e.correct[:, 1] == 1)),
                    "eval_right_to_wrong": mean((right == 1) & (e.correct[:, 1] == 0))})
    return out


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("agent", args, batch_flag="prompts_per_step")
    policy, tok = run.load_policy(args.init)            # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy)              # ... which stays frozen as the reference
    ref_weights = run.parked(ref, policy)               # ... in host memory outside step 2 (GPU)
    # REVISE and the problem again; the longest episode: each attempt, REVISE, an EOS
    revision = len(tok.encode(toolcalc.REVISE)) + toolcalc.max_prompt_tokens(tok)
    run.check_lengths(policy, tok, args.max_new_tokens, turns=args.turns,
                      extra=(args.turns - 1) * (revision + 1))
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    P, G, K, temp = args.prompts_per_step, args.group_size, args.turns, args.temperature
    run.print(f"agent: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{args.steps} steps of {P} prompts x {G} episodes, {K} attempt{'s' * (K > 1)}, "
              f"at most {args.max_calls} calls, call cost {args.call_cost}, beta {args.beta}"
              + (", ENVIRONMENT TOKENS IN THE LOSS (--train_on_env_tokens)"
                 if args.train_on_env_tokens else ""))
    if not args.resume:                                 # a fresh run: the starting policy is step 0
        run.log_start({**run.evaluate(policy, tok), **evaluate_tools(run, policy, tok, args)})
    tools = {}

    while run.training():
        # 1. episodes: G per prompt, token by token; the tool answers each call, the revision prompt
        #    follows a first attempt (--turns 2); one sequence per episode, and which of its tokens
        #    the policy sampled
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            ep = task.episodes(policy, tok, prompts, G, temp, args.max_new_tokens, args.max_calls,
                               K, generator=run.gen, keep_hidden=run.logging())
        # (B, Tp), (B, Tn)
        prompt, prompt_mask, tokens, mask = ep.prompt, ep.prompt_mask, ep.tokens, ep.mask
        # the policy's tokens; the pitfall: all of them
        loss_mask = mask if args.train_on_env_tokens else ep.sampled
        run.samples += P * G

        # 2. rewards and advantages per attempt: the group is the baseline; each token takes its
        #    attempt's A. SCoRe's stage I: no reward for attempt 1, no bonus for attempt 2, and
        #    beta_2 on attempt 1's KL
        stage1 = run.step < args.stage1_steps
        rewards = episode_rewards(ep.correct, ep.calls, args.call_cost,
                                  0.0 if stage1 else args.shaping)                          # (B, K)
        if stage1:
            rewards[:, 0] = 0.0                                                 # A = 0 on attempt 1
        reached = [None] + [((ep.turn == k) & (mask > 0)).any(1)
                            for k in range(1, K)]                                 # (B,) per attempt
        if args.scale_rewards == "batch":             # s: the step's std of each attempt's rewards
            scales = [batch_std(run, rewards[:, k], reached[k]) for k in range(K)]
        else:                                         # GRPO's: each group's own std (None); none: 1
            scales = [None if args.scale_rewards == "group" else 1.0] * K
        episode_adv = torch.stack([grpo_advantages(rewards[:, k], G, present=reached[k],
                                                   scale=scales[k]) for k in range(K)], 1)  # (B, K)
        advantages = episode_adv.gather(1, ep.turn)                                        # (B, Tn)
        beta = (torch.where(ep.turn == 0, args.stage1_beta, args.beta) if stage1
                else torch.full_like(mask, args.beta))

        # 3. score without gradient (sampler.score): pi_ref of every token (the environment's for
        #    the log), and at mu > 1 pi_old (at mu = 1: step 4's own forward, detached); on a
        #    logged step the exact KL, the entropy and the sampler's KL to the trainer on the
        #    policy's tokens. --batch_invariant: pi_old is the sampler's
        n_seqs, n_tokens = run.all_sum(len(mask)), run.all_sum(loss_mask.sum())  # over all ranks
        with ref_weights, run.autocast:
            scored = score(policy, ref, prompt, prompt_mask, tokens, mask, ep.logp, temp,
                           run.micro_batches(len(mask)), run.logging(), args.batch_invariant,
                           kl_mask=ep.sampled, n_kl=run.all_sum(ep.sampled.sum()),
                           sampler_hidden=ep.hidden, policy_pass=args.mu > 1)

        # 4. mu passes of the loss over the --grad_accum micro-batches, normalised by the whole
        #    step's counts
        for epoch in range(args.mu):
            loss, stats = 0.0, {}
            for rows in run.micro_batches(len(mask), train_policy):
                with run.autocast:               # (b, Tn) log pi_theta, (b, T, C) its states
                    logp, h = completion_logprobs(train_policy, prompt[rows], prompt_mask[rows],
                                                  tokens[rows], mask[rows], temp,
                                                  return_hidden=True)
                old_logp = scored.own(rows, logp) if args.mu == 1 else scored.old_logp[rows]
                part, part_stats = agent_loss(logp, old_logp, scored.ref_logp[rows],
                                              advantages[rows], loss_mask[rows], args.clip_eps,
                                              beta[rows], args.kl_estimator, n_seqs, n_tokens)
                run.check_finite(part, f"lower --lr (now {args.lr})")
                part.backward()
                if args.mu == 1:                 # logged: the KL, entropy, sampler gap
                    scored.measure(rows, logp, h)  # (after the backward: apart from its graph)
                loss = loss + part.detach()
                stats = {k: stats.get(k, 0.0) + v for k, v in part_stats.items()}
            grad_norm = run.clip_grad_norm(train_policy, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.tokens += int(run.all_sum(mask.sum()))

        # 5. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            right, calls, env = ep.correct[:, -1], ep.calls.sum(1), mask - ep.sampled
            called, groups, rights = ((calls > 0).float(), rewards[:, -1].view(-1, G),
                                      right.view(-1, G))
            # (P,) calls alone differ
            cost_only = (rights == rights[:, :1]).all(1) & ~(groups == groups[:, :1]).all(1)
            stats = {k.replace("kl_est", f"kl_{args.kl_estimator}"): run.all_sum(v).item()
                     for k, v in stats.items()}
            metrics = {"loss": run.all_sum(loss).item(), "reward_mean": run.mean(rewards.sum(1)),
                       "reward_std": run.std(rewards.sum(1)), "accuracy": run.mean(right),
                       "calls": run.mean(calls), "call_share": run.mean(called),
                       "malformed": run.mean(ep.malformed.sum(1)),
                       "accuracy_called": run.mean(right, called),
                       "accuracy_uncalled": run.mean(right, 1 - called),
                       "zero_var_groups": run.mean((groups == groups[:, :1]).all(1).float()),
                       "cost_only_groups": run.mean(cost_only.float()),
                       "advantage_called": run.mean(episode_adv[:, -1], called),
                       "kl_exact": run.all_sum(scored.kl_exact).item(),
                       "entropy": run.all_sum(scored.entropy).item(),
                       **stats, "turns": run.mean(ep.policy_turns),
                       "completion_len": run.mean(ep.sampled.sum(1)),
                       "env_tokens": run.mean(env.sum(1)),
                       "env_logp": run.mean(scored.old_logp, env),
                       "truncated": run.mean(ep.truncated.float()), "grad_norm": grad_norm.item(),
                       "sampler_logp_diff": run.max(scored.sampler_gap),
                       "sampler_kl": run.all_sum(scored.sampler_kl).item()}
            if K == 2:
                metrics["stage"] = 1 if stage1 else 2
                first = ep.correct[:, 0]
                metrics.update({"accuracy_turn1": run.mean(first),
                                "wrong_to_right": run.mean((1 - first) * right),
                                "right_to_wrong": run.mean(first * (1 - right))})
            if run.eval_due():
                tools = evaluate_tools(run, policy, tok, args)
                metrics.update({**run.evaluate(policy, tok), **tools})
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | "
                             f"acc {metrics['accuracy']:.3f} | calls {metrics['calls']:.2f} "
                             f"({metrics['call_share']:.2f} of episodes, "
                             f"malformed {metrics['malformed']:.3f}) | "
                             f"kl {metrics['kl_exact']:.4f} | "
                             f"len {metrics['completion_len']:.1f} + "
                             f"env {metrics['env_tokens']:.1f} | "
                             f"gnorm {metrics['grad_norm']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer, summary=summary(run, policy, tok, args, tools))


def summary(run, policy, tok, args, tools):
    """The final line: held-out greedy accuracy before -> after, on hard and easy problems and
    without the tool; calls; with --turns 2 the second attempt."""
    if not run.is_main or run.interrupted:
        return None
    if run.eval_step != run.step or not tools:                      # e.g. resumed at the step limit
        tools = {**run.evaluate(policy, tok), **evaluate_tools(run, policy, tok, args)}
    final, before = {**run.last_eval, **tools}, run.before or {}
    b = lambda key, f=".3f": f"{before[key]:{f}} -> " if key in before else ""
    line = (f"held-out greedy accuracy {b('eval_accuracy')}{final['eval_accuracy']:.3f} "
            f"(hard {b('eval_accuracy_precedence')}{final['eval_accuracy_precedence']:.3f}, "
            f"easy {b('eval_accuracy_other')}{final['eval_accuracy_other']:.3f}) | "
            f"without the tool {b('eval_accuracy_no_tool')}{final['eval_accuracy_no_tool']:.3f} | "
            f"calls per episode {b('eval_calls', '.2f')}{final['eval_calls']:.2f} "
            f"(hard {final['eval_call_share_hard']:.2f}, "
            f"easy {final['eval_call_share_easy']:.2f} of episodes)")
    if args.turns == 2:
        line += (f" | second attempt {b('eval_accuracy_turn2')}{final['eval_accuracy_turn2']:.3f} "
                 f"(wrong to right {b('eval_wrong_to_right')}{final['eval_wrong_to_right']:.3f}, "
                 f"right to wrong {b('eval_right_to_wrong')}{final['eval_right_to_wrong']:.3f})")
    return line


if __name__ == "__main__":
    main(parse_args())
