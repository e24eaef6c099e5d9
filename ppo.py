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
of minibatches per rollout batch; `--target_kl` stops them early; `--adaptive_kl` adjusts beta
(Ziegler et al.): beta <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) * B / horizon).

Settings:
    --a2c               A2C (Mnih et al. 2016, arXiv 1602.01783, synchronous): one pass over each batch as one
                        minibatch, no clipping (eps = eps_v = inf): the loss is -ratio * A, whose gradient at
                        ratio 1 is the policy gradient -A grad log pi.
    --reward verifier   PPO on the task's verifiable reward (1 correct / 0 wrong) instead of the reward model.
    --beta 0 --steps N  no KL anchor: the over-optimisation run (python bench/overoptimisation.py runs it into
                        out/ppo/overopt/ and tabulates reward-model score against gold accuracy and KL).

Defaults (beta 0.3, 40 steps of 64 prompts, lr 1e-4): on the default task, held-out greedy accuracy peaks
after 20-40 steps; trained longer, it slowly falls again on the non-precedence problems as the policy drifts
into completions the reward model never saw and scores too high (the over-optimisation the bench shows with
beta = 0). Lower beta (0.05) reaches that regime within 40 steps.

Deviations from the papers: the KL term in the reward uses the sampled-token estimate log pi_old - log pi_ref
(as Ziegler et al. and InstructGPT do); the logged "kl" is the exact per-token KL summed over the completion
(kernels.kl). Token losses are averaged over all completion tokens of a minibatch. No pretraining-mix term
(InstructGPT's PPO-ptx). The policy and the critic are separate networks (no shared backbone).

Run:
    python ppo.py                      # a few minutes on 2 CPU cores; builds out/sft.pt and out/rm.pt first if missing
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
import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import torch

import task
from kernels import entropy, kl, logprobs
from model import CheckpointError, GPT, ScalarGPT, completion_logits, Tokenizer, load_checkpoint, pick_device, save_checkpoint


# -----------------------------------------------------------------------------
# The algorithm: GAE, the clipped losses, the KL controller

def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalized Advantage Estimation (Schulman et al. 2015, eq. 16) on right-padded sequences.
    rewards, values, mask: (B, T); mask 1 on real tokens, a run of 1s then 0s per row. The value after
    a row's last real token is 0 (the episode ends there). Returns (advantages, returns), (B, T),
    zero on padding:  delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t."""
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)   # V(s_{t+1}), 0 after the end
    next_advantage = torch.zeros_like(next_value)                             # A_{t+1}, 0 after the end
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]             # (B,) TD error
        advantage = delta + gamma * lam * next_advantage                      # (B,)
        advantages[:, t] = advantage * m
        next_value = values[:, t] * m                                         # padding contributes 0
        next_advantage = advantage * m
    returns = (advantages + values) * mask                                    # R_t = A_t + V(s_t)
    return advantages, returns


def kl_penalised_rewards(score, logp, ref_logp, mask, beta):
    """Per-token RLHF reward (Ziegler et al. 2019, eq. 2, spread over tokens), (B, T):
    r_t = -beta * (log pi(y_t) - log pi_ref(y_t)) on every real token, plus score (B,) on the last real
    token of each right-padded row (not on a token after it); 0 on padding."""
    rewards = -beta * (logp - ref_logp) * mask                              # (B, T)
    last = (mask.sum(1).long() - 1).clamp(min=0)                            # (B,) index of the last real token
    bonus = torch.zeros_like(rewards).scatter_(1, last[:, None], score[:, None].to(rewards.dtype))  # (B, T)
    return rewards + bonus * mask


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, eps=1e-8):
    """(x - mean) / (std + eps) over the real entries (population std); padding stays 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps) * mask


def ppo_policy_loss(logp, old_logp, advantages, clip_eps):
    """Per-token clipped surrogate loss (PPO eq. 7, negated to minimise), (B, T):
    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) with ratio = exp(logp - old_logp).
    clip_eps = inf gives the unclipped -ratio * A (A2C). Also returns the (B, T) bool 'clipped' mask
    (where the clipped term is the one taken, so the token's gradient is zero)."""
    ratio = torch.exp(logp - old_logp)                                        # pi_theta / pi_old
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.min(unclipped, clipped), clipped < unclipped


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
# Hyperparameters
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="PPO iterations (rollout batch + update epochs)")
    parser.add_argument("--batch_size", type=int, default=64, help="prompts per rollout batch (one completion each)")
    parser.add_argument("--minibatches", type=int, default=2, help="minibatches per epoch over the rollout batch")
    parser.add_argument("--ppo_epochs", type=int, default=4, help="passes over each rollout batch")
    parser.add_argument("--lr", type=float, default=1e-4, help="policy AdamW learning rate (constant)")
    parser.add_argument("--critic_lr", type=float, default=1e-4, help="critic AdamW learning rate (constant)")
    parser.add_argument("--clip_eps", type=float, default=0.2, help="policy ratio clip range eps")
    parser.add_argument("--clip_value", type=float, default=0.2, help="value clip range around the rollout values")
    parser.add_argument("--vf_coef", type=float, default=0.5, help="weight of the value loss")
    parser.add_argument("--ent_coef", type=float, default=0.0, help="weight of the entropy bonus")
    parser.add_argument("--beta", type=float, default=0.3, help="KL penalty coefficient in the reward (initial value if --adaptive_kl)")
    parser.add_argument("--adaptive_kl", action="store_true", help="adapt beta towards --kl_target (Ziegler et al. 2019)")
    parser.add_argument("--kl_target", type=float, default=2.0, help="target KL(pi || pi_ref) per completion for --adaptive_kl")
    parser.add_argument("--kl_horizon", type=int, default=10000, help="horizon of the adaptive KL controller, in episodes")
    parser.add_argument("--target_kl", type=float, default=None, help="stop a batch's epochs once approx-KL(old || new) exceeds 1.5x this")
    parser.add_argument("--gamma", type=float, default=1.0, help="discount factor")
    parser.add_argument("--gae_lambda", type=float, default=0.95, help="GAE lambda")
    parser.add_argument("--no_whiten", action="store_true", help="do not whiten the advantages over the batch")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (log-probs use the same)")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="clip each model's gradient norm to this")
    parser.add_argument("--a2c", action="store_true", help="A2C: one epoch, one minibatch, no ratio or value clipping")
    parser.add_argument("--reward", choices=("rm", "verifier"), default="rm", help="reward model score or the task's verifier")
    parser.add_argument("--critic_init", choices=("rm", "sft"), default=None, help="critic starts from the reward model or the SFT backbone (default: rm with --reward rm, sft with --reward verifier)")
    parser.add_argument("--log_every", type=int, default=5, help="print and log metrics every this many steps")
    parser.add_argument("--eval_every", type=int, default=10, help="evaluate on the held-out set every this many steps")
    parser.add_argument("--eval_n", type=int, default=512, help="held-out prompts to evaluate on (at most 512)")
    parser.add_argument("--init", default="out/sft.pt", help="SFT checkpoint: the policy's start and the reference")
    parser.add_argument("--rm", default="out/rm.pt", help="reward model checkpoint (reward_model.py)")
    parser.add_argument("--out", default="out", help="folder for ppo.pt and ppo/metrics.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seeds python, numpy and torch")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/ppo.pt")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "minibatches", "ppo_epochs", "kl_horizon", "log_every", "eval_every", "eval_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be at least 1")
    for name in ("lr", "critic_lr", "clip_eps", "clip_value", "kl_target", "temperature"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} = {getattr(args, name)}; it must be positive")
    for name in ("vf_coef", "ent_coef", "beta"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} = {getattr(args, name)}; it must be >= 0")
    if not (0 <= args.gamma <= 1 and 0 <= args.gae_lambda <= 1):
        parser.error(f"--gamma = {args.gamma}, --gae_lambda = {args.gae_lambda}; both must be in [0, 1]")
    if args.minibatches > args.batch_size:
        parser.error(f"--minibatches = {args.minibatches} exceeds --batch_size = {args.batch_size}")
    if args.critic_init is None:
        args.critic_init = "rm" if args.reward == "rm" else "sft"
    if args.a2c:  # derived: A2C is one unclipped pass per batch
        args.ppo_epochs, args.minibatches, args.clip_eps, args.clip_value = 1, 1, math.inf, math.inf
    return args


def main(args):
    ckpt_path = os.path.join(args.out, "ppo.pt")
    metrics_path = os.path.join(args.out, "ppo", "metrics.jsonl")
    root = os.path.dirname(os.path.abspath(__file__))

    # -------------------------------------------------------------------------
    # Setup: build what is missing, then the four models
    device = args.device or pick_device()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")  # bf16 on GPU, fp32 elsewhere
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    rng = random.Random(args.seed)  # draws the prompts
    gen = torch.Generator(device=device).manual_seed(args.seed)  # draws the completions and minibatches
    for path, default, script in ((args.init, "out/sft.pt", "sft.py"), (args.rm, "out/rm.pt", "reward_model.py")):
        if script == "reward_model.py" and args.reward == "verifier" and args.critic_init == "sft":
            continue  # no reward model needed
        if not os.path.exists(path):
            if path != default:
                raise SystemExit(f"{path}: no such checkpoint; train it with {script} or use the default {default}")
            print(f"{path} not found: training it first (python {script})")
            subprocess.run([sys.executable, script], check=True, cwd=root)
    ref, sft_ckpt = load_checkpoint(args.init, device, kind="gpt")
    tok = Tokenizer(sft_ckpt["tokenizer"])
    rm = None
    if args.reward == "rm" or args.critic_init == "rm":
        rm, _ = load_checkpoint(args.rm, device, kind="scalar")
    if args.resume:
        policy, ckpt = load_checkpoint(ckpt_path, device, kind="gpt")
        critic = ScalarGPT(policy.config).to(device)
        critic.load_state_dict(ckpt["critic"])
        step, beta = ckpt["step"], ckpt["beta"]
        rng.setstate((ckpt["rng"][0], tuple(ckpt["rng"][1]), ckpt["rng"][2]))
        gen.set_state(ckpt["gen"])
        print(f"resuming from {ckpt_path} at step {step}")
    else:
        policy = GPT(ref.config).to(device)
        policy.load_state_dict(ref.state_dict())
        critic = ScalarGPT.from_policy(ref) if args.critic_init == "sft" else ScalarGPT(rm.config).to(device)
        if args.critic_init == "rm":
            critic.load_state_dict(rm.state_dict())
        step, beta, ckpt = 0, args.beta, None
    for frozen in (ref, rm):
        if frozen is not None:
            frozen.requires_grad_(False).eval()
    optimizer = torch.optim.AdamW([{"params": policy.parameters(), "lr": args.lr},
                                   {"params": critic.parameters(), "lr": args.critic_lr}], weight_decay=0.0, betas=(0.9, 0.95))
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    eval_set = task.eval_prompts()[:args.eval_n]
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log
    print(f"{'A2C' if args.a2c else 'PPO'}: policy {policy.num_params() / 1e6:.2f}M parameters on {device}, reward {args.reward}, "
          f"critic from {args.critic_init}, {args.steps} steps of {args.batch_size} prompts, beta {beta}")


    def log(metrics):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


    @torch.no_grad()
    def rollout(prompts, temperature):
        """One completion per prompt: prompt + completion tokens (B, Tp + Tn), their mask, Tp, the completion
        tokens (B, Tn), their mask (1 through the EOS) and truncated (B,) (no EOS within the token budget)."""
        idx, idx_mask = tok.encode_batch(prompts, device)                      # (B, Tp) left-padded
        policy.eval()
        with autocast:
            tokens, mask, truncated = policy.generate(idx, idx_mask, task.MAX_NEW_TOKENS, tok.eos_id, tok.pad_id,
                                                      temperature=temperature, generator=gen)  # (B, Tn)
        policy.train()
        return torch.cat([idx, tokens], 1), torch.cat([idx_mask, mask], 1), idx.size(1), tokens, mask, truncated


    def run_eval():
        """task.evaluate's held-out metrics, plus the reward model's mean score of the greedy completions (the proxy)."""
        with autocast:
            e = task.evaluate(policy, tok, eval_set, num_samples=4, temperature=1.0, seed=args.seed)
            if rm is not None:
                seq, seq_mask, *_ = rollout(eval_set, 0.0)
                e["rm_score"] = rm.score(seq, seq_mask).float().mean().item()
        return e


    def token_logits(model, seq, seq_mask, Tp):
        """Logits (B, Tn, V) predicting each completion token of prompt + completion (seq), in float32."""
        with autocast:
            return completion_logits(model, seq[:, :Tp], seq_mask[:, :Tp], seq[:, Tp:], seq_mask[:, Tp:]).float()


    # -------------------------------------------------------------------------
    # Training loop
    e, eval_step = None, -1
    if step == 0:
        e, eval_step = run_eval(), 0
        print(f"step 0 | held-out greedy accuracy {e['greedy_accuracy']:.3f} pass@1 {e['pass_at_1']:.3f} (SFT)")
        log({"step": 0, "eval_accuracy": e["greedy_accuracy"], "eval_pass_at_1": e["pass_at_1"], "eval_rm_score": e.get("rm_score"),
             "eval_accuracy_precedence": e["greedy_accuracy_precedence"], "eval_accuracy_other": e["greedy_accuracy_other"]})
    t0 = time.time()
    while step < args.steps:
        # ---- rollout: sample one completion per prompt, score it, and record pi_old, pi_ref and V_old
        prompts = task.sample_prompts(rng, args.batch_size)
        seq, seq_mask, Tp, tokens, mask, truncated = rollout(prompts, args.temperature)  # (B, Tp + Tn), (B, Tn)
        completions = tok.decode_completions(tokens, mask)
        gold = torch.tensor([task.reward(p, c) for p, c in zip(prompts, completions)], device=device)  # (B,) verifier
        with torch.no_grad():
            old_logits = token_logits(policy, seq, seq_mask, Tp)           # (B, Tn, V)
            ref_logits = token_logits(ref, seq, seq_mask, Tp)
            old_logp = logprobs(old_logits, tokens, args.temperature)           # (B, Tn) log pi_old(y_t | s_t)
            ref_logp = logprobs(ref_logits, tokens, args.temperature)
            kl_exact = (kl(old_logits, ref_logits, args.temperature) * mask).sum(1)  # (B,) exact KL per completion
            with autocast:
                old_values = critic(seq, seq_mask)[:, Tp - 1:-1].float() * mask     # (B, Tn) V(s_t)
                rm_score = rm.score(seq, seq_mask).float() if rm is not None else torch.full_like(gold, float("nan"))  # (B,) at the last real token
            score = rm_score if args.reward == "rm" else gold
            rewards = kl_penalised_rewards(score, old_logp, ref_logp, mask, beta)  # (B, Tn)
            kl_per_token = (old_logp - ref_logp) * mask                         # (B, Tn) for the log
            advantages, returns = gae(rewards, old_values, mask, args.gamma, args.gae_lambda)  # (B, Tn) each
            if not args.no_whiten:
                advantages = masked_whiten(advantages, mask)

        # ---- update: several epochs of minibatches on the clipped losses
        stats = {k: [] for k in ("pg_loss", "vf_loss", "entropy", "clip_frac", "approx_kl", "vf_clip_frac")}
        mb_size = args.batch_size // args.minibatches
        stop = False
        for epoch in range(args.ppo_epochs):
            perm = torch.randperm(args.batch_size, generator=gen, device=device)
            for j in range(args.minibatches):
                mb = perm[j * mb_size:(j + 1) * mb_size]
                m = mask[mb]                                                     # (b, Tn)
                logits = token_logits(policy, seq[mb], seq_mask[mb], Tp)  # (b, Tn, V)
                logp = logprobs(logits, tokens[mb], args.temperature)          # (b, Tn)
                with autocast:
                    values = critic(seq[mb], seq_mask[mb])[:, Tp - 1:-1].float()  # (b, Tn)
                pg_tok, clipped = ppo_policy_loss(logp, old_logp[mb], advantages[mb], args.clip_eps)
                vf_tok = ppo_value_loss(values, old_values[mb], returns[mb], args.clip_value)
                ent = masked_mean(entropy(logits, args.temperature), m)
                pg_loss, vf_loss = masked_mean(pg_tok, m), masked_mean(vf_tok, m)
                loss = pg_loss + args.vf_coef * vf_loss - args.ent_coef * ent   # PPO eq. 9
                if not torch.isfinite(loss):
                    raise RuntimeError(f"loss is {loss.item()} at step {step}; lower --lr (now {args.lr}) "
                                       f"or --critic_lr (now {args.critic_lr}) and rerun")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
                optimizer.step()
                with torch.no_grad():
                    log_ratio = logp - old_logp[mb]
                    approx_kl = masked_mean(torch.exp(log_ratio) - 1 - log_ratio, m).item()  # k3 estimate of KL(old || new)
                    stats["pg_loss"].append(pg_loss.item()), stats["vf_loss"].append(vf_loss.item())
                    stats["entropy"].append(ent.item()), stats["approx_kl"].append(approx_kl)
                    stats["clip_frac"].append(masked_mean(clipped.float(), m).item())
                    stats["vf_clip_frac"].append(masked_mean(((values - old_values[mb]).abs() > args.clip_value).float(), m).item())
                if args.target_kl is not None and approx_kl > 1.5 * args.target_kl:
                    stop = True
                    break
            if stop:
                break
        kl_mean = kl_exact.mean().item()
        if args.adaptive_kl:
            beta = adaptive_kl_beta(beta, kl_mean, args.kl_target, args.kl_horizon, args.batch_size)
        step += 1

        if step % args.log_every == 0 or step % args.eval_every == 0 or step == args.steps:
            ret, val = returns[mask > 0], old_values[mask > 0]
            metrics = {"step": step, "rm_score": rm_score.mean().item() if rm is not None else None, "gold_accuracy": gold.mean().item(),
                       "kl": kl_mean, "kl_k1": kl_per_token.sum(1).mean().item(), "beta": beta,
                       "explained_variance": (1 - (ret - val).var() / ret.var().clamp(min=1e-8)).item(),
                       "completion_len": mask.sum(1).mean().item(), "truncated": truncated.float().mean().item(),
                       "epochs_done": epoch + 1, **{k: float(np.mean(v)) for k, v in stats.items()},
                       "elapsed_s": time.time() - t0}
            line = (f"step {step:4d} | rm {rm_score.mean().item():+.2f} | gold {metrics['gold_accuracy']:.3f} | "
                    f"kl {kl_mean:.3f} | clip {metrics['clip_frac']:.3f} | approx_kl {metrics['approx_kl']:.4f} | "
                    f"vf {metrics['vf_loss']:.3f} | ev {metrics['explained_variance']:+.2f} | ent {metrics['entropy']:.3f}")
            if step % args.eval_every == 0 or step == args.steps:
                e, eval_step = run_eval(), step
                metrics.update(eval_accuracy=e["greedy_accuracy"], eval_pass_at_1=e["pass_at_1"],
                               eval_accuracy_precedence=e["greedy_accuracy_precedence"],
                               eval_accuracy_other=e["greedy_accuracy_other"], eval_rm_score=e.get("rm_score"))
                line += f" | held-out greedy {e['greedy_accuracy']:.3f} pass@1 {e['pass_at_1']:.3f}"
                save_checkpoint(ckpt_path, policy, tok.name, optimizer, step, args, critic=critic.state_dict(),
                                beta=beta, rng=list(rng.getstate()), gen=gen.get_state())
            print(line)
            log(metrics)

    final = e if eval_step == step else run_eval()
    first = json.loads(open(metrics_path).readline()) if os.path.exists(metrics_path) else {}
    print(f"done: {step} steps in {time.time() - t0:.0f}s | held-out greedy accuracy {first.get('eval_accuracy', float('nan')):.3f} -> "
          f"{final['greedy_accuracy']:.3f} (precedence {final['greedy_accuracy_precedence']:.3f}, other "
          f"{final['greedy_accuracy_other']:.3f}) | sampled pass@1 {final['pass_at_1']:.3f} | wrote {ckpt_path}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except CheckpointError as e:  # a missing, unreadable or mismatched checkpoint: say which, no traceback
        raise SystemExit(f"error: {e}")
