"""
PPO with a critic and GAE against a learned reward model: RLHF as it is taught.

Four models: the policy pi_theta (from SFT), a frozen reference pi_ref (the SFT policy), the frozen
reward model r_phi (reward_model.py) and a critic V_psi (a ScalarGPT, initialised from the reward
model as InstructGPT does, or from the SFT backbone with --critic_init sft). Each generated token is
one action; the episode ends at the EOS. The reward model scores the whole completion at its last
token; every token pays -beta times its log-ratio to the reference; GAE turns these rewards and the
critic's values into advantages; several epochs of minibatches minimise the clipped surrogate plus
the clipped value loss.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347 (eqs. 7, 9);
GAE: Schulman et al. 2015, arXiv 1506.02438 (eq. 16); the KL-penalised reward and the adaptive
controller: Ziegler et al. 2019, arXiv 1909.08593 (eq. 2, section 2.2), as InstructGPT (Ouyang et
al. 2022, arXiv 2203.02155). With gamma = 1:
    r_t = -beta (log pi_old(y_t | s_t) - log pi_ref(y_t | s_t)) + [t = last] r_phi(x, y)
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t)
    A_t = delta_t + gamma lambda A_{t+1},   R_t = A_t + V(s_t)
    L = -mean_t min(rho_t A_t, clip(rho_t, 1-eps, 1+eps) A_t)
        + vf_coef mean_t 0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
        - ent_coef entropy

Deviations and choices the papers leave open:
- The reward's KL is the sampled-token estimate (k1), as Ziegler et al.; the logged "kl" is exact.
- Advantages whitened over the batch (--no_whiten: not); token losses averaged per minibatch.
- The adaptive controller's horizon defaults to 640 episodes, so that it acts within a short run.
- No pretraining-mix term (InstructGPT's PPO-ptx); policy and critic are separate networks.
- Every model in eval mode (no dropout): the update scores exactly what the rollout sampled.
- --a2c is A2C (Mnih et al. 2016, arXiv 1602.01783): one unclipped pass per batch; --reward
  verifier trains on the task's verifier instead of the reward model.

Shapes: B prompts per batch, one completion each; Tp prompt and Tn completion tokens; V vocabulary.

Run (about a minute on 2 CPU cores; builds out/sft.pt and out/rm.pt first if missing):
    python ppo.py
    python ppo.py --reward verifier    # PPO on the verifier's reward
    python ppo.py --a2c                # A2C
    python ppo.py --resume             # continue from out/ppo.pt up to --steps
Metrics: out/ppo/metrics.jsonl (docs/metrics.md says what each means); checkpoint out/ppo.pt.
"""
import math

import numpy as np
import torch

import sampler
import task
from kernels import entropy, kl, logprobs
from lora import trainable
from model import ScalarGPT, completion_logits, masked_mean
from plumbing import Run
from plumbing.flags import RM_PATH, SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm: GAE, the clipped losses, the KL controller

def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalized Advantage Estimation (eq. 16) on right-padded rows: rewards, values, mask (B, T),
    mask a run of 1s then 0s; the value after a row's last real token is 0. Returns
    (advantages, returns), (B, T), 0 on padding."""
    B, T = rewards.shape
    real = mask > 0                                                           # (B, T) bool
    rewards, values = torch.where(real, rewards, 0.0), torch.where(real, values, 0.0)  # no padding
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # V(s_t+1), 0 at end
    next_advantage = torch.zeros_like(next_value)                         # A_{t+1}, 0 after the end
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]             # (B,) TD error
        # A_t = delta_t + gamma lambda A_{t+1}: (B,), 0 on padding
        advantage = torch.where(real[:, t], delta + gamma * lam * next_advantage, 0.0)
        advantages[:, t] = advantage
        next_value, next_advantage = values[:, t], advantage                  # both 0 on padding
    returns = torch.where(real, advantages + values, 0.0)                     # R_t = A_t + V(s_t)
    return advantages, returns


def kl_penalised_rewards(score, logp, ref_logp, mask, beta):
    """Per-token RLHF reward (Ziegler et al. eq. 2), (B, T): -beta (log pi - log pi_ref) on every
    real token, plus score (B,) on each right-padded row's last real token; 0 on padding."""
    real = mask > 0
    rewards = torch.where(real, -beta * (logp - ref_logp), 0.0)  # (B, T)
    last = (mask.sum(1).long() - 1).clamp(min=0)                 # (B,) index of the last real token
    bonus = torch.zeros_like(rewards).scatter_(1, last[:, None],
                                               score[:, None].to(rewards.dtype))            # (B, T)
    return rewards + torch.where(real, bonus, 0.0)


def masked_whiten(x, mask, eps=1e-8, all_sum=None):
    """(x - mean) / (std + eps) over the real entries (population std), padding 0; all_sum sums a
    tensor over the processes (Run.all_sum) when the batch is split over them."""
    all_sum = all_sum or (lambda v: v)
    x = torch.where(mask > 0, x, 0.0)                                         # padding never leaks
    n = all_sum(mask.sum()).clamp(min=1)
    mean = all_sum(x.sum()) / n
    var = all_sum(torch.where(mask > 0, (x - mean) ** 2, 0.0).sum()) / n
    return torch.where(mask > 0, (x - mean) / (var.sqrt() + eps), 0.0)


def ppo_policy_loss(logp, old_logp, advantages, clip_eps):
    """Per-token clipped surrogate (eq. 7, negated), (B, T), and clip_taken (B, T) bool, where the
    clipped term was taken (no gradient). clip_eps = inf gives A2C's unclipped -ratio * A."""
    ratio = torch.exp(logp - old_logp)                                        # pi_theta / pi_old
    surr = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.min(surr, surr_clipped), surr_clipped < surr


def ppo_value_loss(values, old_values, returns, clip_value):
    """Per-token clipped value loss (PPO2 baselines, Ziegler et al.), (B, T); clip_value = inf: 0.5
    (V - R)^2."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip_value, clip_value)
    return 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)


def adaptive_kl_beta(beta, kl_value, kl_target, horizon, n_steps):
    """Ziegler et al. 2019, section 2.2: e = clip(KL / KL_target - 1, -0.2, 0.2);
    beta <- beta (1 + e n / horizon)."""
    error = min(max(kl_value / kl_target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


# -----------------------------------------------------------------------------
# Rollouts and scoring: one completion per prompt, the logits and values along it

@torch.no_grad()
def rollout(policy, tok, prompts, temperature, max_new_tokens, generator, device, autocast):
    """One completion per prompt: seq, seq_mask (B, Tp + Tn) prompt + completion, Tp, the completion
    tokens and mask (B, Tn), truncated (B,), the log-probs the sampler drew them with (B, Tn) and
    the hidden states it drew them from (B, Tn, C)."""
    idx, idx_mask = tok.encode_batch(prompts, device)                         # (B, Tp) left-padded
    with autocast:
        tokens, mask, truncated, logp, hidden = sampler.generate(             # (B, Tn) each
            policy, idx, idx_mask, max_new_tokens, tok.stop_ids, tok.pad_id,
            temperature=temperature, generator=generator, return_logprobs=True, return_hidden=True)
    return (torch.cat([idx, tokens], 1), torch.cat([idx_mask, mask], 1), idx.size(1), tokens, mask,
            truncated, logp, hidden)


def token_logits(model, seq, seq_mask, Tp, autocast):
    """Logits (B, Tn, V) predicting each completion token of seq = prompt + completion, in
    float32."""
    with autocast:
        return completion_logits(model, seq[:, :Tp], seq_mask[:, :Tp], seq[:, Tp:],
                                 seq_mask[:, Tp:]).float()


def token_values(critic, seq, seq_mask, Tp, autocast):
    """V(s_t) (B, Tn) for each completion token t. The state s_t is everything before token t, so
    its value is the critic's output at position Tp - 1 + t, the position whose logits predict token
    t: hence [Tp-1 : -1]."""
    with autocast:
        return critic(seq, seq_mask)[:, Tp - 1:-1].float()


@torch.no_grad()
def rm_score_greedy(run, policy, rm, rm_weights, tok):
    """The reward model's mean score of the policy's greedy completions of the held-out prompts
    (the proxy beside the verifier; rank 0's evaluation, None elsewhere or without a reward
    model); rm_weights: its weights' context (run.parked)."""
    if rm is None or not run.is_main:
        return None
    prompts = task.eval_prompts()[:run.args.eval_n]
    seq, seq_mask, *_ = rollout(policy, tok, prompts, 0.0, task.default_max_new_tokens(), None,
                                run.device, run.autocast)
    with run.autocast, rm_weights:
        return rm.score(seq, seq_mask).float().mean().item()


def load_models(run, args):
    """pi_theta and pi_ref (the SFT policy, trained and frozen), the reward model (where --reward
    or --critic_init needs it, frozen) and the critic V (from the SFT policy or the reward model);
    every model in eval mode: no dropout. First, that every process gets its minibatches."""
    if args.batch_size // run.world < args.minibatches * args.grad_accum:
        raise SystemExit(f"error: --batch_size {args.batch_size} over {run.world} process(es) "
                         f"leaves fewer than --minibatches {args.minibatches} x "
                         f"--grad_accum {args.grad_accum} completions per process")
    policy, tok = run.load_policy(args.init)        # pi_theta starts as pi_ref ...
    ref = run.reference(args.init, policy)          # ... the SFT policy, frozen
    rm = (run.load_reward_model(args.rm, args.init) if "rm" in (args.reward, args.critic_init)
          else None)
    critic = (ScalarGPT.from_policy(ref) if args.critic_init == "sft"
              else ScalarGPT(rm.config).to(run.device))
    if args.critic_init == "rm":
        critic.load_state_dict(rm.state_dict())
    if rm is not None:
        rm.requires_grad_(False)
    return policy, tok, ref, rm, critic.eval()


def explained_variance(run, returns, values, mask):
    """1 - Var(R - V) / Var(R) over every rank's completion tokens (population variances)."""
    var = lambda x: run.mean((x - run.mean(x, mask)) ** 2, mask)
    return 1 - var(returns - values) / max(var(returns), 1e-8)


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--reward", choices=("rm", "verifier"), default="rm",
                   help="the reward model or the task's verifier")
    g.add_argument("--beta", type=Float(ge=0), default=0.3,
                   help="KL penalty coefficient in the reward (the initial value with "
                        "--adaptive_kl)")
    g.add_argument("--adaptive_kl", action="store_true",
                   help="adapt beta towards --kl_target (Ziegler et al. 2019)")
    g.add_argument("--kl_target", type=Float(gt=0), default=2.0,
                   help="--adaptive_kl's target KL per completion")
    g.add_argument("--kl_horizon", type=Int(ge=1), default=640,
                   help="the adaptive KL controller's horizon (episodes)")
    g.add_argument("--clip_eps", type=Float(gt=0, lt=1), default=0.2,
                   help="policy ratio clip range eps")
    g.add_argument("--clip_value", type=Float(gt=0), default=0.2,
                   help="value clip range around the rollout values")
    g.add_argument("--vf_coef", type=Float(ge=0), default=0.5, help="weight of the value loss")
    g.add_argument("--ent_coef", type=Float(ge=0), default=0.0, help="weight of the entropy bonus")
    g.add_argument("--gamma", type=Float(ge=0, le=1), default=1.0, help="discount factor")
    g.add_argument("--gae_lambda", type=Float(ge=0, le=1), default=0.95, help="GAE lambda")
    g.add_argument("--no_whiten", action="store_true",
                   help="do not whiten the advantages over the batch")
    g.add_argument("--critic_init", choices=("rm", "sft"), default=None,
                   help="the critic's start: the reward model or the SFT backbone (default: rm "
                        "with --reward rm, sft with --reward verifier)")
    g.add_argument("--a2c", action="store_true",
                   help="A2C: sets --ppo_epochs 1 --minibatches 1 and no ratio or value clipping "
                        "(said at start-up)")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=40,
                   help="PPO iterations (rollout batch + update epochs)")
    g.add_argument("--batch_size", type=Int(ge=1), default=64,
                   help="B: prompts per batch (one completion each)")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature (log-probs use the same)")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--ppo_epochs", type=Int(ge=1), default=4, help="passes over each rollout batch")
    g.add_argument("--minibatches", type=Int(ge=1), default=2,
                   help="minibatches per epoch over the rollout batch")
    g.add_argument("--target_kl", type=Float(gt=0), default=None,
                   help="stop a batch's epochs once approx-KL(old || new) exceeds 1.5x this")
    g.add_argument("--lr", type=Float(gt=0), default=1e-4,
                   help="policy AdamW learning rate (constant)")
    g.add_argument("--critic_lr", type=Float(gt=0), default=1e-4,
                   help="critic AdamW learning rate (constant)")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip each model's gradient norm to this")
    g = add_run_flags(p, "ppo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the policy's start and the reference")
    g.add_argument("--rm", default=RM_PATH, help="reward model checkpoint (reward_model.py)")
    args = p.parse_args(argv)
    if args.minibatches > args.batch_size:
        p.error(f"--minibatches {args.minibatches} exceeds --batch_size {args.batch_size}; at "
                f"most batch_size")
    # derived: the critic starts from the model whose scores it will predict
    if args.critic_init is None:
        args.critic_init = "rm" if args.reward == "rm" else "sft"
    if args.a2c:  # derived: A2C is one unclipped pass per batch
        args.ppo_epochs, args.minibatches, args.clip_eps, args.clip_value = 1, 1, math.inf, math.inf
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("ppo", args, batch_flag="batch_size")
    policy, tok, ref, rm, critic = load_models(run, args)
    # pi_ref in host memory outside step 2 (a GPU), once copied
    ref_weights = run.parked(ref, policy)
    rm_weights = run.parked(rm, policy)             # the RM outside step 1 and evaluations (a GPU)
    run.check_lengths(policy, tok, args.max_new_tokens)
    train_policy, train_critic = run.ddp(policy), run.ddp(critic)   # DDP or --fsdp's shards
    optimizer = torch.optim.AdamW([{"params": trainable(train_policy), "lr": args.lr},
                                   {"params": train_critic.parameters(), "lr": args.critic_lr}],
                                  weight_decay=0.0, betas=(0.9, 0.95))
    ckpt = run.resume(policy, optimizer, critic=critic)
    beta, temp = (ckpt["beta"] if ckpt else args.beta), args.temperature
    run.print(f"{'A2C (--a2c: 1 epoch, 1 minibatch, no clipping)' if args.a2c else 'PPO'}: policy "
              f"{policy.num_params() / 1e6:.2f}M parameters on {run.device}, reward {args.reward}, "
              f"critic from {args.critic_init}, {args.steps} steps of {args.batch_size} prompts, "
              f"beta {beta}{f' (adaptive to KL {args.kl_target})' if args.adaptive_kl else ''}")
    if not args.resume:                             # a fresh run: the starting policy is step 0
        run.log_start({**run.evaluate(policy, tok), "eval_rm_score": rm_score_greedy(
            run, policy, rm, rm_weights, tok)})

    while run.training():
        # 1. rollout: one completion for each of this rank's prompts, scored by the reward model and
        #    the verifier
        prompts = run.shard(task.sample_prompts(run.rng, args.batch_size))
        seq, seq_mask, Tp, tokens, mask, truncated, sampler_logp, sampler_hidden = rollout(
            policy, tok, prompts, temp, args.max_new_tokens, run.gen, run.device, run.autocast)
        completions = tok.decode_completions(tokens, mask)
        run.samples += args.batch_size
        gold = torch.tensor([task.reward(p, c) for p, c in zip(prompts, completions)],
                            device=run.device)                                            # verifier
        with torch.no_grad(), run.autocast, rm_weights:
            rm_score = rm.score(seq, seq_mask).float() if rm is not None else None   # (B,) at end

        # 2. score without gradient, in micro-batches: pi_old, pi_ref and V_old along each
        #    completion, the exact KL
        old_logp, ref_logp, old_values, sampler_kl = (torch.zeros_like(mask) for _ in range(4))
        kl_exact = torch.zeros(len(mask), device=run.device)          # (B,) exact KL per completion
        with torch.no_grad(), ref_weights:                         # pi_ref on the device here alone
            for rows in run.micro_batches(len(mask)):
                old_logits = token_logits(policy, seq[rows], seq_mask[rows], Tp,
                                          run.autocast)                             # (b, Tn, V)
                ref_logits = token_logits(ref, seq[rows], seq_mask[rows], Tp, run.autocast)
                old_logp[rows] = logprobs(old_logits, tokens[rows], temp)    # log pi_old(y_t | s_t)
                ref_logp[rows] = logprobs(ref_logits, tokens[rows], temp)
                kl_exact[rows] = torch.where(mask[rows] > 0, kl(old_logits, ref_logits, temp),
                                             0.0).sum(1)
                if run.logging():            # (b, Tn) KL(sampler || trainer) over the support
                    with run.autocast:
                        sampler_kl[rows] = kl(policy.logits(sampler_hidden[rows]), old_logits,
                                              temp)
                values = token_values(critic, seq[rows], seq_mask[rows], Tp, run.autocast)
                old_values[rows] = torch.where(mask[rows] > 0, values, 0.0)         # V(s_t)
        # how far the trainer's log-probs are from the sampler's (same weights; invariant: 0.0)
        sampler_diff = run.max(torch.where(mask > 0, (sampler_logp - old_logp).abs(), 0.0))

        # 3. rewards and advantages: the score on the last token, -beta KL on every token; GAE,
        #    whitened over all ranks
        score = rm_score if args.reward == "rm" else gold
        rewards = kl_penalised_rewards(score, old_logp, ref_logp, mask, beta)        # (B, Tn)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.gae_lambda)  # (B, Tn)
        if not args.no_whiten:
            advantages = masked_whiten(advantages, mask, all_sum=run.all_sum)

        # 4. update: epochs of minibatches on the clipped policy and value losses, each minibatch in
        #    --grad_accum micro-batches whose token means are normalised by the minibatch's tokens
        #    on every rank
        stats = {k: [] for k in ("pg_loss", "vf_loss", "entropy", "clip_frac", "approx_kl",
                                 "vf_clip_frac")}
        for epoch in range(args.ppo_epochs):
            perm = torch.randperm(len(mask), generator=run.gen, device=run.device)
            for mb in torch.tensor_split(perm, args.minibatches):      # every sample, once an epoch
                n_mb = run.all_sum(mask[mb].sum())               # the minibatch's tokens, all ranks
                mb_stats = dict.fromkeys(stats, 0.0)
                for rows in run.micro_batches(len(mb), train_policy, train_critic):
                    i, m = mb[rows], mask[mb[rows]]              # (b,) sample indices, (b, Tn)
                    logits = token_logits(train_policy, seq[i], seq_mask[i], Tp,
                                          run.autocast)                             # (b, Tn, V)
                    logp = logprobs(logits, tokens[i], temp)                        # (b, Tn)
                    values = token_values(train_critic, seq[i], seq_mask[i], Tp,
                                          run.autocast)                             # (b, Tn)
                    pg_tok, clip_taken = ppo_policy_loss(logp, old_logp[i], advantages[i],
                                                         args.clip_eps)
                    vf_tok = ppo_value_loss(values, old_values[i], returns[i], args.clip_value)
                    ent = masked_mean(entropy(logits, temp), m, n_mb)
                    pg_loss, vf_loss = masked_mean(pg_tok, m, n_mb), masked_mean(vf_tok, m, n_mb)
                    loss = pg_loss + args.vf_coef * vf_loss - args.ent_coef * ent   # PPO eq. 9
                    run.check_finite(loss, f"lower --lr (now {args.lr}) or --critic_lr "
                                           f"(now {args.critic_lr})")
                    loss.backward()
                    with torch.no_grad():
                        log_ratio = logp - old_logp[i]
                        vf_clipped = ((values - old_values[i]).abs() > args.clip_value).float()
                        for k, v in (("pg_loss", pg_loss), ("vf_loss", vf_loss), ("entropy", ent),
                                     ("approx_kl",                                  # k3
                                      masked_mean(torch.exp(log_ratio) - 1 - log_ratio, m, n_mb)),
                                     ("clip_frac", masked_mean(clip_taken.float(), m, n_mb)),
                                     ("vf_clip_frac", masked_mean(vf_clipped, m, n_mb))):
                            mb_stats[k] += v.detach()
                run.clip_grad_norm(train_policy, args.grad_clip)
                run.clip_grad_norm(train_critic, args.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
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
            metrics = {"rm_score": run.mean(rm_score) if rm is not None else None,
                       "gold_accuracy": run.mean(gold), "kl": kl_mean,
                       "kl_k1": run.mean(torch.where(mask > 0, old_logp - ref_logp, 0.0).sum(1)),
                       "beta": beta,
                       "explained_variance": explained_variance(run, returns, old_values, mask),
                       "completion_len": run.mean(mask.sum(1)),
                       "truncated": run.mean(truncated.float()), "epochs_done": epoch + 1,
                       "sampler_logp_diff": sampler_diff, "sampler_kl": run.mean(sampler_kl, mask),
                       **{k: float(np.mean(v)) for k, v in stats.items()}}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
                score = rm_score_greedy(run, policy, rm, rm_weights, tok)
                metrics.update({"eval_rm_score": score} if score is not None else {})
            run.log(metrics, f"rm {metrics['rm_score'] if rm is not None else float('nan'):+.2f} | "
                             f"gold {metrics['gold_accuracy']:.3f} | kl {kl_mean:.3f} | "
                             f"clip {metrics['clip_frac']:.3f} | "
                             f"approx_kl {metrics['approx_kl']:.4f} | "
                             f"vf {metrics['vf_loss']:.3f} | "
                             f"ev {metrics['explained_variance']:+.2f} | "
                             f"ent {metrics['entropy']:.3f}")
        if run.eval_due():
            run.save(policy, optimizer, critic=critic, beta=beta)
    run.finish(policy, tok, optimizer, critic=critic, beta=beta)


if __name__ == "__main__":
    main(parse_args())
