"""
RLOO: REINFORCE Leave-One-Out, with the verifier as the reward.

REINFORCE with a better baseline and nothing else: no value network, no ratio, no clip. Each prompt
gets k samples, and each one's baseline is the mean reward of the other k - 1, which does not depend
on the sample itself, so the gradient estimate stays unbiased. The whole completion is one action:
all its tokens get the same advantage.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs", arXiv 2402.14740 (the baseline: Kool et al. 2019, "Buy 4 REINFORCE
Samples, Get a Baseline for Free!"):
    R_i = r_i - beta * sum_t KL_it                         (the KL to the reference in the reward)
    A_i = R_i - 1/(k-1) sum_{j != i} R_j  =  k/(k-1) (R_i - mean_j R_j)
    L = -1/(N k) sum_i A_i sum_t log pi_theta(y_it | x, y_i<t)      over the batch's N prompts
KL_it: a per-token estimate (kernels.kl_penalty; k1 by default), a number: no gradient.

Deviations and choices the paper leaves open:
- One gradient step per batch of rollouts (on-policy, as the paper), no minibatches.
- The reward is the task's verifier (1 correct, 0 otherwise; --format_weight: a format bonus).
- Small scale: a 0.44M-parameter policy, AdamW at a constant learning rate.

Shapes: P prompts, G = k completions per prompt, B = P*G rows; T time (Tp prompt, Tn completion).

Run:
    python rloo.py                     # from out/sft.pt (built first if missing); ~1 min on 2 CPUs
    python rloo.py --resume            # continue from out/rloo.pt up to --steps
    python rloo.py --group_size 2      # smallest group: each one's baseline is the other's reward
Metrics: out/rloo/metrics.jsonl (docs/metrics.md says what each means); checkpoint out/rloo.pt.
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
# The algorithm: the leave-one-out baseline and the REINFORCE loss

def rloo_advantages(rewards, k):
    """rewards (P*k,) flat, k consecutive samples per prompt -> advantages (P*k,):
    A_i = R_i - 1/(k-1) sum_{j != i} R_j, each sample's baseline the mean of its k - 1 siblings."""
    if k < 2:
        raise ValueError(f"k = {k}; RLOO needs k >= 2 samples per prompt (a sample's baseline "
                         f"is the others' mean)")
    if rewards.dim() != 1 or rewards.numel() % k:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups "
                         f"of k = {k}; need a flat tensor whose length is a multiple of k")
    R = rewards.view(-1, k)                                            # (P, k)
    baseline = (R.sum(dim=1, keepdim=True) - R) / (k - 1)              # 1/(k-1) sum_{j != i} R_j
    return (R - baseline).view(-1)                                     # (P*k,)


def rloo_loss(logp, advantages, mask, num_seqs=None):
    """The REINFORCE loss with sequence-level advantages and its metrics (detached tensors):
    -1/B sum_i A_i sum_t log pi_theta(y_it | .). logp (B, T) log-probs of the sampled tokens (with
    grad); advantages (B,); mask (B, T) 1.0 on completion tokens (values elsewhere never read).
    num_seqs: the step's count when this batch is a part of it."""
    seq_logp = torch.where(mask > 0, logp, 0.0).sum(dim=1)             # (B,) log pi(y_i | x)
    n_seqs = mask.size(0) if num_seqs is None else num_seqs
    loss = -(advantages * seq_logp).sum() / n_seqs
    return loss, {"seq_logp": seq_logp.detach().sum() / n_seqs}


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--group_size", type=Int(ge=2), default=8,
                   help="k (G in the code): completions sampled per prompt")
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
    g = add_run_flags(p, "rloo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    return p.parse_args(argv)


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("rloo", args, batch_flag="prompts_per_step")
    policy, tok = run.load_policy(args.init)            # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy)              # ... which stays frozen as the reference
    ref_weights = run.parked(ref, policy)               # ... in host memory outside step 2 (GPU)
    run.check_lengths(policy, tok, args.max_new_tokens)
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    run.print(f"RLOO: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {args.steps} "
              f"steps of {P} prompts x {G} samples, beta {args.beta} ({args.kl_estimator})")
    if not args.resume:                                 # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: G = k completions per prompt (sampling temperature), scored by the verifier
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

        # 3. advantages: KL to the reference in the reward, the other k - 1 samples are the baseline
        kl_t = kl_penalty(old_logp, ref_logp, args.kl_estimator)                     # (B, Tn)
        # R_i = r_i - beta * sum_t KL_it
        scores = rewards - args.beta * torch.where(mask > 0, kl_t, 0.0).sum(1)
        advantages = rloo_advantages(scores, G)                                      # (B,)

        # 4. one on-policy REINFORCE step over the --grad_accum micro-batches, normalised by the
        #    whole step's counts
        loss, stats = 0.0, {}
        for rows in run.micro_batches(len(mask), train_policy):
            with run.autocast:                                                # (b, Tn) log pi_theta
                logp = completion_logprobs(train_policy, prompt[rows], prompt_mask[rows],
                                           tokens[rows], mask[rows], temp)
            part, part_stats = rloo_loss(logp, advantages[rows], mask[rows], num_seqs=n_seqs)
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
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
