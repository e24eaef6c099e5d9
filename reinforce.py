"""
REINFORCE with a choice of baselines, and REINFORCE++, with the verifier as the reward.

The policy-gradient theorem with the whole completion y_i as one action: raise the log-probability
of each sample in proportion to its reward minus a baseline b that does not depend on it. No value
network, no ratio.

Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
Learning" (Machine Learning 8); REINFORCE++: Hu 2025, arXiv 2501.03262.
    R_i = r_i - beta * sum_t KL_it                  (KL to the reference in the reward; k1 default)
    A_i = R_i - b,    L = -1/B sum_i sum_t A_it log pi_theta(y_it | .)
    (A_it = A_i for sequence-level baselines). --baseline picks b:
    none            b = 0: vanilla REINFORCE, unbiased, with the variance problem the baselines fix
    moving_average  b = an exponential moving average of the mean R of earlier batches (--ema_decay)
    batch_mean      b = this batch's mean R; it includes sample i itself, so the estimate is biased
                    by a factor (1 - 1/B) (rloo.py's leave-one-out baseline removes it)
    reinforce_pp    REINFORCE++: r_t = -beta KL_t + r_i [t = last], returns-to-go
                    G_t = sum_{s >= t} r_s (gamma 1),
                    A_t = (G_t - mean) / (std + eps) over every completion token of the batch

Deviations and choices the papers leave open:
- One on-policy step per batch: REINFORCE++'s clipped ratio is 1 there, its clip left out.
- The loss sums a completion's tokens and averages over completions, REINFORCE++ included (its
  code averages tokens).
- Several samples per prompt (--group_size, so the sibling scripts' runs compare); no baseline
  here uses the groups.
- The reward is the task's verifier (1 correct, 0 otherwise; --format_weight adds a format bonus).
- Small scale: a 0.44M-parameter policy, AdamW at a constant learning rate.

Shapes: P prompts, G completions per prompt, B = P*G rows; T time (Tp prompt, Tn completion tokens).
Run:
    python reinforce.py                  # REINFORCE++ from out/sft.pt (built if missing), ~1 min
    python reinforce.py --baseline none  # vanilla REINFORCE: watch grad_norm
    python reinforce.py --resume         # continue from out/reinforce.pt up to --steps
Metrics: out/reinforce/metrics.jsonl (docs/metrics.md); checkpoint out/reinforce.pt.
"""
import torch

import task
from kernels import kl_penalty
from lora import trainable
from model import completion_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser
from sampler import score


# -----------------------------------------------------------------------------
# The algorithm: baselines, REINFORCE++ advantages and the REINFORCE loss

BASELINES = ("none", "moving_average", "batch_mean", "reinforce_pp")


def batch_mean(x, all_sum=None):
    """x's mean over the whole batch; all_sum (Run.all_sum) sums over the processes it spans."""
    all_sum = all_sum or (lambda v: v)
    return all_sum(x.sum()) / all_sum(torch.tensor(float(x.numel()), device=x.device))


def baseline_advantages(rewards, baseline, moving_average=None, all_sum=None):
    """A_i = R_i - b, rewards (B,) -> (B,); b: 0 ("none"), moving_average (a float; None before any
    batch: 0), or the batch's mean ("batch_mean"; all_sum: see batch_mean)."""
    if baseline == "none":
        return rewards.clone()
    if baseline == "moving_average":
        return rewards - (0.0 if moving_average is None else moving_average)
    if baseline == "batch_mean":
        return rewards - batch_mean(rewards, all_sum)
    raise ValueError(f"baseline {baseline!r} is unknown here; allowed: 'none', "
                     f"'moving_average', 'batch_mean'")


def update_moving_average(moving_average, rewards, decay, all_sum=None):
    """b <- decay * b + (1 - decay) * mean(R); the first sets b = mean(R) (all_sum: batch_mean)."""
    mean = batch_mean(rewards, all_sum).item()
    return mean if moving_average is None else decay * moving_average + (1 - decay) * mean


def reinforce_pp_advantages(rewards, kl_t, mask, beta, eps=1e-8, all_sum=None):
    """REINFORCE++ token advantages (B, T): rewards (B,); kl_t, mask (B, T) (a prefix per row)."""
    all_sum = all_sum or (lambda v: v)
    real = mask > 0                                                    # (B, T) bool
    r = torch.where(real, -beta * kl_t, 0.0)                           # (B, T) per-token KL penalty
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & real        # (B, T) last of each row
    r = r + rewards[:, None] * last                                    # outcome reward, last token
    returns = torch.where(real, r.flip(1).cumsum(1).flip(1), 0.0)      # G_t = sum_{s >= t} r_s
    n = all_sum(mask.sum()).clamp(min=1)                               # the batch's tokens
    mean = all_sum(torch.where(real, returns, 0.0).sum()) / n          # global mean over the tokens
    # global (population) std
    std = (all_sum(torch.where(real, (returns - mean) ** 2, 0.0).sum()) / n).sqrt()
    return torch.where(real, (returns - mean) / (std + eps), 0.0)      # (B, T)


def reinforce_loss(logp, advantages, mask, num_seqs=None):
    """-1/B sum_i sum_t A_it log pi_theta(y_it | .) and its metrics (detached tensors). logp, mask
    (B, T); advantages (B,) per completion or (B, T) per token. num_seqs: the step's count when this
    batch is a part of it."""
    real = mask > 0                                                    # masked values never read
    A = advantages[:, None] if advantages.dim() == 1 else advantages   # (B, 1) or (B, T)
    A, logp = torch.where(real, A, 0.0), torch.where(real, logp, 0.0)  # (B, T) each
    n_seqs = mask.size(0) if num_seqs is None else num_seqs
    loss = -(A * logp).sum(dim=1).sum() / n_seqs
    return loss, {"seq_logp": logp.detach().sum(dim=1).sum() / n_seqs}


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--baseline", default="reinforce_pp", choices=BASELINES,
                   help="b in A = R - b (see the docstring)")
    g.add_argument("--ema_decay", type=Float(ge=0, lt=1), default=0.9,
                   help="decay of the moving-average baseline")
    g.add_argument("--group_size", type=Int(ge=1), default=8,
                   help="G: completions sampled per prompt")
    g.add_argument("--beta", type=Float(ge=0), default=0.04,
                   help="weight of the KL-to-reference penalty in the reward")
    g.add_argument("--kl_estimator", default="k1", choices=["k1", "k2", "k3"],
                   help="per-token KL estimate (reward)")
    g.add_argument("--format_weight", type=Float(ge=0), default=0.0,
                   help="reward bonus for a well-formed completion")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=50,
                   help="RL steps (one batch of rollouts each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=32,
                   help="P: prompts drawn per step")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "reinforce", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    return p.parse_args(argv)


def main(args):
    # device, seeds, lock, log, resume, torchrun
    run = Run("reinforce", args, batch_flag="prompts_per_step")
    policy, tok = run.load_policy(args.init)            # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy)              # ... which stays frozen as the reference
    ref_weights = run.parked(ref, policy)               # ... in host memory outside step 2 (GPU)
    run.check_lengths(policy, tok, args.max_new_tokens)
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    ckpt = run.resume(policy, optimizer)
    moving_average = ckpt["moving_average"] if ckpt else None   # the moving-average baseline's b
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    run.print(f"REINFORCE (baseline {args.baseline}): {policy.num_params() / 1e6:.2f}M "
              f"parameters on {run.device}, {args.steps} steps of {P} prompts x {G} samples, "
              f"beta {args.beta} ({args.kl_estimator})")
    if not args.resume:                                 # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: G completions per prompt at the sampling temperature, scored by the verifier
        # this rank's share
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            batch, sampler_logp, sampler_hidden = task.rollout(     # (B, Tn), (B, Tn, C) logged
                policy, tok, prompts, G, temp, args.max_new_tokens, args.format_weight, run.gen,
                return_logprobs=True, return_hidden=run.logging())
        # (B, Tp), (B, Tn), (B,); B = P*G
        prompt, prompt_mask, tokens, mask, truncated, rewards, _ = batch
        run.samples += P * G

        # 2. score without gradient (sampler.score): pi_old and pi_ref of every token, each
        #    model's forward once through the function step 4 calls (on-policy, the same bits); on
        #    a logged step the exact KL, the entropy and the sampler's KL to the trainer.
        #    --batch_invariant: pi_old is the sampler's
        n_seqs, n_tokens = run.all_sum(len(mask)), run.all_sum(mask.sum())  # the step's, all ranks
        with ref_weights, run.autocast:
            scored = score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, temp,
                           run.micro_batches(len(mask)), run.logging(), args.batch_invariant,
                           n_kl=n_tokens, sampler_hidden=sampler_hidden)
        old_logp, ref_logp = scored.old_logp, scored.ref_logp                    # (B, Tn)

        # 3. advantages: KL to the reference in the reward, minus the baseline (statistics over
        #    all ranks)
        kl_t = kl_penalty(old_logp, ref_logp, args.kl_estimator)                     # (B, Tn)
        if args.baseline == "reinforce_pp":
            advantages = reinforce_pp_advantages(rewards, kl_t, mask, args.beta,
                                                 all_sum=run.all_sum)                      # (B, Tn)
        else:
            # R_i = r_i - beta * sum_t KL_it
            scores = rewards - args.beta * torch.where(mask > 0, kl_t, 0.0).sum(1)
            # (B,)
            advantages = baseline_advantages(scores, args.baseline, moving_average, run.all_sum)
            moving_average = update_moving_average(moving_average, scores, args.ema_decay,
                                                   all_sum=run.all_sum)

        # 4. one on-policy REINFORCE step over the --grad_accum micro-batches, normalised by the
        #    whole step's counts
        loss, stats = 0.0, {}
        for rows in run.micro_batches(len(mask), train_policy):
            with run.autocast:                                                # (b, Tn) log pi_theta
                logp = completion_logprobs(train_policy, prompt[rows], prompt_mask[rows],
                                           tokens[rows], mask[rows], temp)
            part, part_stats = reinforce_loss(logp, advantages[rows], mask[rows], num_seqs=n_seqs)
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss = loss + part.detach()
            stats = {k: stats.get(k, 0.0) + v for k, v in part_stats.items()}
        grad_norm = run.clip_grad_norm(train_policy, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.tokens += int(n_tokens)

        # 5. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            groups = rewards.view(-1, G)
            metrics = {"loss": run.all_sum(loss).item(), "reward_mean": run.mean(rewards),
                       "reward_std": run.std(rewards),
                       "zero_var_groups": run.mean((groups == groups[:, :1]).all(1).float()),
                       "kl_exact": run.all_sum(scored.kl_exact).item(),
                       f"kl_{args.kl_estimator}": run.mean(kl_t, mask),
                       "entropy": run.all_sum(scored.entropy).item(),
                       "completion_len": run.mean(mask.sum(1)),
                       "truncated": run.mean(truncated.float()), "grad_norm": grad_norm.item(),
                       "sampler_logp_diff": run.max(scored.sampler_gap),
                       "sampler_kl": run.all_sum(scored.sampler_kl).item(),
                       "seq_logp": run.all_sum(stats["seq_logp"]).item()}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | "
                             f"zero-var {metrics['zero_var_groups']:.2f} | "
                             f"kl {metrics['kl_exact']:.4f} | ent {metrics['entropy']:.3f} | "
                             f"len {metrics['completion_len']:.1f} | "
                             f"gnorm {metrics['grad_norm']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer, moving_average=moving_average)
    run.finish(policy, tok, optimizer, moving_average=moving_average)


if __name__ == "__main__":
    main(parse_args())
