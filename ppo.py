"""
PPO with a critic and GAE against a learned reward model: classic RLHF.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347 (eq. 7, the clipped
surrogate; eq. 9, the combined loss); Schulman et al. 2015, "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", arXiv 1506.02438 (eq. 16, GAE); the RLHF reward with a per-token KL
penalty and the adaptive KL controller are from Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences", arXiv 1909.08593 (eq. 2 and section 2.2), as used by InstructGPT (Ouyang et al. 2022).

Four models: the policy pi_theta (from SFT), a frozen reference pi_ref (the SFT policy), the frozen
reward model r_phi (reward_model.py), and a critic V_psi (a ScalarGPT; initialised from the reward
model by default, as InstructGPT does, or from the SFT backbone with `--critic_init sft`).
Each generated token is one action; the episode ends at the EOS. Per-token reward on completion token t:

    r_t = - beta * (log pi_old(y_t | s_t) - log pi_ref(y_t | s_t))   + [t = last real token] * r_phi(x, y)

The reward-model score is read at the last real token of prompt + completion (the EOS, exactly as
reward_model.py trains it; a truncated completion is scored at its last token). Then, with gamma = 1
and V = 0 after the last real token,

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t)       A_t = delta_t + gamma lambda A_{t+1}       R_t = A_t + V(s_t)
    ratio_t = pi_theta(y_t | s_t) / pi_old(y_t | s_t)
    L_clip  = - mean_t min(ratio_t A_t, clip(ratio_t, 1 - eps, 1 + eps) A_t)
    L_V     = mean_t 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
    L       = L_clip + vf_coef * L_V - ent_coef * entropy

Advantages are whitened over the batch (masked mean and std) by default, outside `gae`. Several epochs
of minibatches per rollout batch (every sample in one minibatch per epoch, sizes differing by at most one
when the batch does not divide); `--target_kl` stops them early; `--adaptive_kl` adjusts beta
(Ziegler et al.): beta <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) * B / horizon). Ziegler et al.
used a horizon of 10000 episodes over runs of millions of episodes; our default run has 2560 (40 steps of
64), where that horizon moves beta by at most 5 %: the default --kl_horizon is 640 episodes (10 steps),
so that the controller visibly acts within a run (up to x2.2 or x0.45 over 40 steps).

Settings:
    --a2c               A2C (Mnih et al. 2016, arXiv 1602.01783, synchronous): one pass over each batch as one
                        minibatch, no clipping (eps = eps_v = inf): the loss is -ratio * A, whose gradient at
                        ratio 1 is the policy gradient -A grad log pi. It overrides --ppo_epochs, --minibatches,
                        --clip_eps and --clip_value (the start-up line says so).
    --reward verifier   PPO on the task's verifiable reward (1 correct / 0 wrong) instead of the reward model.
    --beta 0 --steps N  no KL anchor: the over-optimisation run (python experiments/overoptimisation.py runs it into
                        out/ppo/overopt/ and tabulates reward-model score against gold accuracy and KL).

Defaults (beta 0.3, 40 steps of 64 prompts, lr 1e-4): on the default task, held-out greedy accuracy peaks
after 20-40 steps; trained longer, it slowly falls again on the non-precedence problems as the policy drifts
into completions the reward model never saw and scores too high (the over-optimisation the bench shows with
beta = 0). Lower beta (0.05) reaches that regime within 40 steps.

Deviations from the papers: the KL term in the reward uses the sampled-token estimate log pi_old - log pi_ref
(as Ziegler et al. and InstructGPT do); the logged "kl" is the exact per-token KL summed over the completion
(kernels.kl). Token losses are averaged over all completion tokens of a minibatch. No pretraining-mix term
(InstructGPT's PPO-ptx). The policy and the critic are separate networks (no shared backbone). Every model
runs in eval mode (no dropout), so that the update scores exactly the distribution the rollout sampled from.

Run:
    python ppo.py                      # about a minute on 2 CPU cores; builds out/sft.pt and out/rm.pt first if missing
    python ppo.py --reward verifier    # PPO on the verifier's reward
    python ppo.py --a2c                # A2C
    python ppo.py --resume             # continue from out/ppo.pt up to --steps
Metrics: one JSON object per log step in out/ppo/metrics.jsonl. Rollouts: rm_score (proxy), gold_accuracy
(verifier), kl (exact, per completion), kl_k1 (sampled estimate), beta, completion_len, truncated. Update
(means over minibatches): pg_loss, vf_loss, entropy, clip_frac (tokens where the clipped term was taken),
vf_clip_frac, approx_kl (k3 estimate of KL(old || new)), explained_variance (of the returns by V_old).
Held-out, on eval steps: eval_accuracy (greedy), eval_pass_at_1, eval_accuracy_precedence / _other,
eval_rm_score (the reward model's mean score of the greedy completions).
"""
import math

import numpy as np
import torch

import task
from kernels import entropy, kl, logprobs
from model import ScalarGPT, completion_logits, masked_mean
from plumbing import RM_PATH, SFT_PATH, TEMPERATURE, Float, Int, Run, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm: GAE, the clipped losses, the KL controller

def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalized Advantage Estimation (Schulman et al. 2015, eq. 16) on right-padded sequences.
    rewards, values, mask: (B, T); mask 1 on real tokens, a run of 1s then 0s per row. The value after
    a row's last real token is 0 (the episode ends there). Returns (advantages, returns), (B, T),
    zero on padding:  delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t."""
    B, T = rewards.shape
    real = mask > 0                                                           # (B, T) bool
    rewards, values = torch.where(real, rewards, 0.0), torch.where(real, values, 0.0)  # padding never leaks
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)   # V(s_{t+1}), 0 after the end
    next_advantage = torch.zeros_like(next_value)                             # A_{t+1}, 0 after the end
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]             # (B,) TD error
        advantage = torch.where(real[:, t], delta + gamma * lam * next_advantage, 0.0)  # (B,), 0 on padding
        advantages[:, t] = advantage
        next_value, next_advantage = values[:, t], advantage                  # both 0 on padding
    returns = torch.where(real, advantages + values, 0.0)                     # R_t = A_t + V(s_t)
    return advantages, returns


def kl_penalised_rewards(score, logp, ref_logp, mask, beta):
    """Per-token RLHF reward (Ziegler et al. 2019, eq. 2, spread over tokens), (B, T):
    r_t = -beta * (log pi(y_t) - log pi_ref(y_t)) on every real token, plus score (B,) on the last real
    token of each right-padded row (not on a token after it); 0 on padding."""
    real = mask > 0
    rewards = torch.where(real, -beta * (logp - ref_logp), 0.0)             # (B, T)
    last = (mask.sum(1).long() - 1).clamp(min=0)                            # (B,) index of the last real token
    bonus = torch.zeros_like(rewards).scatter_(1, last[:, None], score[:, None].to(rewards.dtype))  # (B, T)
    return rewards + torch.where(real, bonus, 0.0)


def masked_whiten(x, mask, eps=1e-8, all_sum=None):
    """(x - mean) / (std + eps) over the real entries (population std); padding stays 0. all_sum: when the batch is
    split over processes (torchrun), a function summing a tensor over them, so that mean and std are the whole batch's."""
    all_sum = all_sum or (lambda v: v)
    x = torch.where(mask > 0, x, 0.0)                                         # padding never leaks
    n = all_sum(mask.sum()).clamp(min=1)
    mean = all_sum(x.sum()) / n
    var = all_sum(torch.where(mask > 0, (x - mean) ** 2, 0.0).sum()) / n
    return torch.where(mask > 0, (x - mean) / (var.sqrt() + eps), 0.0)


def ppo_policy_loss(logp, old_logp, advantages, clip_eps):
    """Per-token clipped surrogate loss (PPO eq. 7, negated to minimise), (B, T):
    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) with ratio = exp(logp - old_logp).
    clip_eps = inf gives the unclipped -ratio * A (A2C). Also returns clip_taken, a (B, T) bool: where the
    clipped term is the smaller one, so the token's gradient is zero."""
    ratio = torch.exp(logp - old_logp)                                        # pi_theta / pi_old
    surr = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.min(surr, surr_clipped), surr_clipped < surr


def ppo_value_loss(values, old_values, returns, clip_value):
    """Per-token clipped value loss, (B, T): 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)
    (PPO2 baselines / Ziegler et al.). clip_value = inf gives the plain 0.5 * (V - R)^2."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip_value, clip_value)
    return 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)


def adaptive_kl_beta(beta, kl_value, kl_target, horizon, n_steps):
    """Ziegler et al. 2019, section 2.2: e = clip(KL / KL_target - 1, -0.2, 0.2); beta <- beta (1 + e n / horizon)."""
    error = min(max(kl_value / kl_target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


# -----------------------------------------------------------------------------
# Rollouts and scoring: one completion per prompt, the logits and values along it

@torch.no_grad()
def rollout(policy, tok, prompts, temperature, max_new_tokens, generator, device, autocast):
    """One completion per prompt. Returns seq (B, Tp + Tn) prompt + completion tokens and seq_mask, Tp, the
    completion tokens (B, Tn), their mask (1 through the EOS) and truncated (B,) (no EOS within the budget)."""
    idx, idx_mask = tok.encode_batch(prompts, device)                         # (B, Tp) left-padded
    with autocast:
        tokens, mask, truncated = policy.generate(idx, idx_mask, max_new_tokens, tok.eos_id, tok.pad_id,
                                                  temperature=temperature, generator=generator)  # (B, Tn)
    return torch.cat([idx, tokens], 1), torch.cat([idx_mask, mask], 1), idx.size(1), tokens, mask, truncated


def token_logits(model, seq, seq_mask, Tp, autocast):
    """Logits (B, Tn, V) predicting each completion token of seq = prompt + completion, in float32."""
    with autocast:
        return completion_logits(model, seq[:, :Tp], seq_mask[:, :Tp], seq[:, Tp:], seq_mask[:, Tp:]).float()


def token_values(critic, seq, seq_mask, Tp, autocast):
    """V(s_t) (B, Tn) for each completion token t. The state s_t is everything before token t, so its value is
    the critic's output at position Tp - 1 + t, the position whose logits predict token t: hence [Tp-1 : -1]."""
    with autocast:
        return critic(seq, seq_mask)[:, Tp - 1:-1].float()


@torch.no_grad()
def rm_score_greedy(policy, rm, tok, prompts, device, autocast):
    """The reward model's mean score of the policy's greedy completions (the proxy, beside the verifier's accuracy)."""
    seq, seq_mask, *_ = rollout(policy, tok, prompts, 0.0, task.MAX_NEW_TOKENS, None, device, autocast)
    with autocast:
        return rm.score(seq, seq_mask).float().mean().item()


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--reward", choices=("rm", "verifier"), default="rm", help="reward model score or the task's verifier")
    g.add_argument("--beta", type=Float(ge=0), default=0.3, help="KL penalty coefficient in the reward (initial value if --adaptive_kl)")
    g.add_argument("--adaptive_kl", action="store_true", help="adapt beta towards --kl_target (Ziegler et al. 2019)")
    g.add_argument("--kl_target", type=Float(gt=0), default=2.0, help="target KL(pi || pi_ref) per completion for --adaptive_kl")
    g.add_argument("--kl_horizon", type=Int(ge=1), default=640, help="horizon of the adaptive KL controller, in episodes")
    g.add_argument("--clip_eps", type=Float(gt=0, lt=1), default=0.2, help="policy ratio clip range eps")
    g.add_argument("--clip_value", type=Float(gt=0), default=0.2, help="value clip range around the rollout values")
    g.add_argument("--vf_coef", type=Float(ge=0), default=0.5, help="weight of the value loss")
    g.add_argument("--ent_coef", type=Float(ge=0), default=0.0, help="weight of the entropy bonus")
    g.add_argument("--gamma", type=Float(ge=0, le=1), default=1.0, help="discount factor")
    g.add_argument("--gae_lambda", type=Float(ge=0, le=1), default=0.95, help="GAE lambda")
    g.add_argument("--no_whiten", action="store_true", help="do not whiten the advantages over the batch")
    g.add_argument("--critic_init", choices=("rm", "sft"), default=None,
                   help="critic starts from the reward model or the SFT backbone (default: rm with --reward rm, sft with --reward verifier)")
    g.add_argument("--a2c", action="store_true", help="A2C: sets --ppo_epochs 1 --minibatches 1 and no ratio or value clipping")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=40, help="PPO iterations (rollout batch + update epochs)")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="B: prompts per rollout batch (one completion each)")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0, help="sampling temperature (log-probs use the same)")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=task.MAX_NEW_TOKENS, help="longest completion")
    g = p.add_argument_group("optimisation")
    g.add_argument("--ppo_epochs", type=Int(ge=1), default=4, help="passes over each rollout batch")
    g.add_argument("--minibatches", type=Int(ge=1), default=2, help="minibatches per epoch over the rollout batch")
    g.add_argument("--target_kl", type=Float(gt=0), default=None, help="stop a batch's epochs once approx-KL(old || new) exceeds 1.5x this")
    g.add_argument("--lr", type=Float(gt=0), default=1e-4, help="policy AdamW learning rate (constant)")
    g.add_argument("--critic_lr", type=Float(gt=0), default=1e-4, help="critic AdamW learning rate (constant)")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0, help="clip each model's gradient norm to this")
    g = add_run_flags(p, "ppo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH, help="SFT checkpoint: the policy's start and the reference")
    g.add_argument("--rm", default=RM_PATH, help="reward model checkpoint (reward_model.py)")
    args = p.parse_args(argv)
    if args.minibatches > args.batch_size:
        p.error(f"--minibatches {args.minibatches} exceeds --batch_size {args.batch_size}; it must be at most batch_size")
    if args.critic_init is None:  # derived: the critic starts from the model whose scores it will predict
        args.critic_init = "rm" if args.reward == "rm" else "sft"
    if args.a2c:  # derived: A2C is one unclipped pass per batch
        args.ppo_epochs, args.minibatches, args.clip_eps, args.clip_value = 1, 1, math.inf, math.inf
    return args


def main(args):
    run = Run("ppo", args, batch_flag="batch_size")  # device, seeds, lock, log, resume, torchrun: plumbing.py
    if args.batch_size // run.world < args.minibatches * args.grad_accum:
        raise SystemExit(f"error: --batch_size {args.batch_size} over {run.world} process(es) leaves fewer than "
                         f"--minibatches {args.minibatches} x --grad_accum {args.grad_accum} completions per process")
    ref, tok = run.load_policy(args.init)           # pi_ref: the SFT policy, frozen
    policy, _ = run.load_policy(args.init)          # pi_theta starts as pi_ref
    rm = run.load_reward_model(args.rm, args.init) if "rm" in (args.reward, args.critic_init) else None
    critic = ScalarGPT.from_policy(ref) if args.critic_init == "sft" else ScalarGPT(rm.config).to(run.device)
    if args.critic_init == "rm":
        critic.load_state_dict(rm.state_dict())
    critic.eval()                                   # every model in eval mode: no dropout
    for frozen in (ref, rm):
        if frozen is not None:
            frozen.requires_grad_(False)
    run.check_lengths(policy, tok, args.max_new_tokens)
    optimizer = torch.optim.AdamW([{"params": policy.parameters(), "lr": args.lr},
                                   {"params": critic.parameters(), "lr": args.critic_lr}], weight_decay=0.0, betas=(0.9, 0.95))
    ckpt = run.resume(policy, optimizer, critic=critic)
    train_policy, train_critic = run.ddp(policy), run.ddp(critic)  # DistributedDataParallel under torchrun
    beta, temp = (ckpt["beta"] if ckpt else args.beta), args.temperature
    eval_set = task.eval_prompts()[:args.eval_n]
    run.print(f"{'A2C (--a2c: 1 epoch, 1 minibatch, no clipping)' if args.a2c else 'PPO'}: policy "
              f"{policy.num_params() / 1e6:.2f}M parameters on {run.device}, reward {args.reward}, critic from "
              f"{args.critic_init}, {args.steps} steps of {args.batch_size} prompts, beta {beta}"
              f"{f' (adaptive, target KL {args.kl_target})' if args.adaptive_kl else ''}")
    if not args.resume:                             # a fresh run: the starting policy is step 0
        e = run.evaluate(policy, tok)
        e["eval_rm_score"] = rm_score_greedy(policy, rm, tok, eval_set, run.device, run.autocast) if rm and run.is_main else None
        run.log_start(e)

    while run.training():
        # 1. rollout: one completion for each of this rank's prompts, scored by the reward model and the verifier
        prompts = run.shard(task.sample_prompts(run.rng, args.batch_size))
        seq, seq_mask, Tp, tokens, mask, truncated = rollout(policy, tok, prompts, temp, args.max_new_tokens, run.gen,
                                                             run.device, run.autocast)  # (B, Tp + Tn), (B, Tn)
        completions = tok.decode_completions(tokens, mask)
        run.samples += args.batch_size
        gold = torch.tensor([task.reward(p, c) for p, c in zip(prompts, completions)], device=run.device)  # (B,) verifier
        with torch.no_grad(), run.autocast:
            rm_score = rm.score(seq, seq_mask).float() if rm is not None else None    # (B,) at the last real token

        # 2. score without gradient, in micro-batches: pi_old, pi_ref and V_old along each completion, the exact KL
        old_logp, ref_logp, old_values = torch.zeros_like(mask), torch.zeros_like(mask), torch.zeros_like(mask)  # (B, Tn)
        kl_exact = torch.zeros(len(mask), device=run.device)                        # (B,) exact KL per completion
        with torch.no_grad():
            for rows in run.micro_batches(len(mask)):
                old_logits = token_logits(policy, seq[rows], seq_mask[rows], Tp, run.autocast)  # (b, Tn, V)
                ref_logits = token_logits(ref, seq[rows], seq_mask[rows], Tp, run.autocast)
                old_logp[rows] = logprobs(old_logits, tokens[rows], temp)            # log pi_old(y_t | s_t)
                ref_logp[rows] = logprobs(ref_logits, tokens[rows], temp)
                kl_exact[rows] = torch.where(mask[rows] > 0, kl(old_logits, ref_logits, temp), 0.0).sum(1)
                values = token_values(critic, seq[rows], seq_mask[rows], Tp, run.autocast)
                old_values[rows] = torch.where(mask[rows] > 0, values, 0.0)         # V(s_t)

        # 3. rewards and advantages: the score on the last token, -beta KL on every token; GAE, whitened over all ranks
        score = rm_score if args.reward == "rm" else gold
        rewards = kl_penalised_rewards(score, old_logp, ref_logp, mask, beta)        # (B, Tn)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.gae_lambda)  # (B, Tn) each
        if not args.no_whiten:
            advantages = masked_whiten(advantages, mask, all_sum=run.all_sum)

        # 4. update: epochs of minibatches on the clipped policy and value losses, each minibatch in --grad_accum
        #    micro-batches whose token means are normalised by the minibatch's tokens on every rank
        stats = {k: [] for k in ("pg_loss", "vf_loss", "entropy", "clip_frac", "approx_kl", "vf_clip_frac")}
        for epoch in range(args.ppo_epochs):
            perm = torch.randperm(len(mask), generator=run.gen, device=run.device)
            for mb in torch.tensor_split(perm, args.minibatches):                   # every sample, once an epoch
                n_mb = run.all_sum(mask[mb].sum())                                   # the minibatch's tokens, all ranks
                optimizer.zero_grad(set_to_none=True)
                mb_stats = dict.fromkeys(stats, 0.0)
                for rows in run.micro_batches(len(mb), train_policy, train_critic):
                    i, m = mb[rows], mask[mb[rows]]                                  # (b,) sample indices, (b, Tn)
                    logits = token_logits(train_policy, seq[i], seq_mask[i], Tp, run.autocast)  # (b, Tn, V)
                    logp = logprobs(logits, tokens[i], temp)                        # (b, Tn)
                    values = token_values(train_critic, seq[i], seq_mask[i], Tp, run.autocast)  # (b, Tn)
                    pg_tok, clip_taken = ppo_policy_loss(logp, old_logp[i], advantages[i], args.clip_eps)
                    vf_tok = ppo_value_loss(values, old_values[i], returns[i], args.clip_value)
                    ent = masked_mean(entropy(logits, temp), m, n_mb)
                    pg_loss, vf_loss = masked_mean(pg_tok, m, n_mb), masked_mean(vf_tok, m, n_mb)
                    loss = pg_loss + args.vf_coef * vf_loss - args.ent_coef * ent   # PPO eq. 9
                    run.check_finite(loss, f"lower --lr (now {args.lr}) or --critic_lr (now {args.critic_lr})")
                    loss.backward()
                    with torch.no_grad():
                        log_ratio = logp - old_logp[i]
                        for k, v in (("pg_loss", pg_loss), ("vf_loss", vf_loss), ("entropy", ent),
                                     ("approx_kl", masked_mean(torch.exp(log_ratio) - 1 - log_ratio, m, n_mb)),  # k3 of KL(old || new)
                                     ("clip_frac", masked_mean(clip_taken.float(), m, n_mb)),
                                     ("vf_clip_frac", masked_mean(((values - old_values[i]).abs() > args.clip_value).float(), m, n_mb))):
                            mb_stats[k] += float(v)
                torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
                optimizer.step()
                for k, v in mb_stats.items():
                    stats[k].append(run.all_sum(v).item())
                if args.target_kl is not None and stats["approx_kl"][-1] > 1.5 * args.target_kl:
                    break
            if args.target_kl is not None and stats["approx_kl"][-1] > 1.5 * args.target_kl:
                break
        kl_mean = run.mean(kl_exact)
        if args.adaptive_kl:
            beta = adaptive_kl_beta(beta, kl_mean, args.kl_target, args.kl_horizon, args.batch_size)
        run.step += 1

        # 5. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            ret_mean = run.mean(returns, mask)
            err_mean = run.mean(returns - old_values, mask)
            var = lambda x, mean: run.mean((x - mean) ** 2, mask)             # population variance over all ranks
            metrics = {"rm_score": run.mean(rm_score) if rm is not None else None, "gold_accuracy": run.mean(gold),
                       "kl": kl_mean, "kl_k1": run.mean(torch.where(mask > 0, old_logp - ref_logp, 0.0).sum(1)),
                       "beta": beta, "explained_variance": 1 - var(returns - old_values, err_mean) / max(var(returns, ret_mean), 1e-8),
                       "completion_len": run.mean(mask.sum(1)), "truncated": run.mean(truncated.float()),
                       "epochs_done": epoch + 1, **{k: float(np.mean(v)) for k, v in stats.items()}}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
                if rm is not None and run.is_main:
                    metrics["eval_rm_score"] = rm_score_greedy(policy, rm, tok, eval_set, run.device, run.autocast)
            run.log(metrics, f"rm {metrics['rm_score'] if rm is not None else float('nan'):+.2f} | gold "
                             f"{metrics['gold_accuracy']:.3f} | kl {kl_mean:.3f} | clip {metrics['clip_frac']:.3f} | approx_kl "
                             f"{metrics['approx_kl']:.4f} | vf {metrics['vf_loss']:.3f} | ev {metrics['explained_variance']:+.2f} "
                             f"| ent {metrics['entropy']:.3f}")
        if run.eval_due():
            run.save(policy, optimizer, critic=critic.state_dict(), beta=beta)
    run.finish(policy, tok, optimizer, critic=critic.state_dict(), beta=beta)


if __name__ == "__main__":
    main(parse_args())
