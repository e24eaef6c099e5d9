"""
GRPO: Group Relative Policy Optimization, with the verifier as the reward.

In plain words: for each prompt, sample a group of G completions, score each with the verifier, and
give every token of a completion the same advantage, its reward standardised within its group (how
much better than its siblings it did). That group baseline replaces PPO's value network. The loss is
PPO's clipped surrogate on those advantages plus a KL penalty to the SFT reference. With the default
single optimisation pass per batch (mu = 1, as in DeepSeek-R1) the policy has not moved when the loss
is computed: the ratio is exactly 1, the clip never acts, and the update is a group-baselined policy
gradient, A * grad log pi. The clip starts to matter only with --mu > 1.

Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv 2402.03300 (the algorithm); DeepSeek-AI 2025, "DeepSeek-R1", arXiv 2501.12948
(its use with rule-based, verifiable rewards). Completion i of a group, token t:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)          (population std, divide by G)
    L = 1/G sum_i 1/|o_i| sum_t [ -min(ratio_it * A_i, clip(ratio_it, 1-eps, 1+eps) * A_i) + beta * KL_it ]
    ratio_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    KL_it    = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1       (the "k3" estimator, DeepSeekMath eq. 4)

(DeepSeekMath eq. 3, written as a loss to minimise.) KL estimators (Schulman 2020, "Approximating KL
Divergence"), per sampled token y ~ pi_theta, with log r = log pi_ref(y) - log pi_theta(y):
    k1 = -log r                 unbiased for KL(pi_theta || pi_ref); negative on some tokens
    k2 = (log r)^2 / 2          biased for KL(pi_theta || pi_ref), low variance, >= 0
    k3 = (r - 1) - log r        unbiased for KL(pi_theta || pi_ref), low variance, >= 0 (the paper's)
As a *loss term* (differentiated through log pi_theta, not through the sampling) they behave
differently: the expected gradient of k1 is 0 (it only penalises through a reward), k2's is the
gradient of KL(pi_theta || pi_ref), and k3's is the gradient of KL(pi_ref || pi_theta), the other
direction, which agrees with it near pi_ref. The exact per-token KL(pi_theta || pi_ref) over the
whole vocabulary (kernels.kl) is logged beside the estimate the loss uses. k3 grows like e^|log r| on the
side where pi_theta puts much less mass than pi_ref, so one token with a huge log-ratio can dominate the
loss: verl and OpenRLHF clamp log r before the estimator, TRL does not. Here `--kl_clamp c` clamps log r
to [-c, c] (the clamped tokens then give no KL gradient); the default is no clamp, as in the paper.

Why the loss sits near 0 while the policy learns: at mu = 1 the surrogate's value is -mean_i A_i
(times 1/|o_i| sums that are 1), and group-standardised advantages have mean 0 in every group, so the
logged loss is about beta * KL, small, whatever the policy learns. Its gradient, A * grad log pi, is
not 0. Watch reward_mean, zero_var_groups and eval_accuracy, not the loss.

Deviations from the papers, and choices the papers leave open:
- Loss aggregation: default as DeepSeekMath (token mean within each completion, then the mean over
  completions). `--loss_agg token` is DAPO's token-level mean (Yu et al. 2025, arXiv 2503.14476);
  `--loss_agg dr_grpo` divides the token sum by a constant (completions x max_new_tokens), as in
  Dr. GRPO (Liu et al. 2025, arXiv 2503.20783), which also drops the std: `--no_std_scaling`.
- `--eps_high` (DAPO's clip-higher) widens the upper clip bound; default equal to --clip_eps.
- mu optimisation passes per batch of rollouts, the old log-probs kept from sampling time. Each
  pass uses the whole batch (no minibatches).
- A group whose rewards are all equal gets advantage exactly 0 (never 0/0).
- The reward is the task's verifier (1 correct, 0 otherwise, optional --format_weight). GRPO
  explores by sampling its group at a temperature, not by beam search, and it has no value
  function, so no GAE.
- Small scale: a 0.8M-parameter policy on arithmetic, AdamW at a constant learning rate.

Run:
    python grpo.py                       # from out/sft.pt (trained first if missing); about 1 min on 2 idle CPU cores
    python grpo.py --resume              # continue from out/grpo.pt up to --steps
    python grpo.py --loss_agg token --eps_high 0.28 --beta 0   # DAPO-style variant
Metrics: one JSON object per log step in out/grpo/metrics.jsonl (README: metrics glossary); checkpoint out/grpo.pt.
"""
import torch

import task
from kernels import entropy, kl, logprobs
from model import completion_logits, masked_mean
from plumbing import SFT_PATH, TEMPERATURE, Float, Int, Run, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm: group-relative advantages and the clipped surrogate with a KL penalty

def grpo_advantages(rewards, group_size, eps=1e-6, scale_by_std=True):
    """rewards (B*G,) flat, G = group_size consecutive samples per prompt -> advantages (B*G,).
    A_i = (r_i - mean_g) / (std_g + eps), std the population std (divide by G). A group whose
    rewards are all equal gets exactly 0. scale_by_std=False gives Dr. GRPO's A_i = r_i - mean_g."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                         f"group_size = {group_size}; need a flat tensor whose length is a multiple of it (>= 1)")
    r = rewards.view(-1, group_size)                                   # (B, G)
    mean = r.mean(dim=1, keepdim=True)                                 # (B, 1)
    advantages = r - mean                                              # r_i - mean_g
    if scale_by_std:
        std = r.std(dim=1, keepdim=True, unbiased=False)               # population std: sqrt(1/G sum (r - mean)^2)
        advantages = advantages / (std + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)               # (B, 1) no signal in this group
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)  # (B*G,)


def kl_penalty(logp, ref_logp, estimator="k3", clamp=None):
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled from pi_theta (see the docstring
    above for what each estimator's gradient does). logp, ref_logp (B, T) -> (B, T). clamp: if given,
    log r is clamped to [-clamp, clamp] first (as verl and OpenRLHF do)."""
    log_r = ref_logp - logp                                            # log r = log pi_ref - log pi_theta
    if clamp is not None:
        log_r = log_r.clamp(-clamp, clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1                            # (r - 1) - log r
    raise ValueError(f"kl estimator {estimator!r} is unknown; allowed: 'k1', 'k2', 'k3'")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps=0.2, beta=0.04, eps_high=None,
              kl_estimator="k3", loss_agg="seq", max_tokens=None, kl_clamp=None):
    """The GRPO loss (DeepSeekMath eq. 3, negated) and its metrics.

    logp (B, T) log pi_theta of the sampled tokens (with grad); old_logp (B, T) at sampling time;
    ref_logp (B, T) under the frozen reference; advantages (B,) one per completion; mask (B, T) 1.0 on
    completion tokens. Per token: -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + eps_high) * A) + beta * KL.
    loss_agg: "seq" (DeepSeekMath: token mean per completion, then mean over completions),
    "token" (DAPO: mean over all tokens of the batch), "dr_grpo" (sum over tokens / (B * max_tokens),
    max_tokens defaulting to T). kl_clamp: see kl_penalty. Values at masked positions are never read.
    Returns (loss scalar, dict of float metrics)."""
    eps_high = clip_eps if eps_high is None else eps_high
    real = mask > 0                                                    # (B, T) bool
    logp, old_logp, ref_logp = (torch.where(real, x, 0.0) for x in (logp, old_logp, ref_logp))  # padding never leaks
    A = advantages[:, None]                                            # (B, 1) the same advantage for every token
    log_ratio = logp - old_logp                                        # (B, T)
    ratio = torch.exp(log_ratio)                                       # pi_theta / pi_old
    surr1 = ratio * A
    surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high) * A
    kl_t = kl_penalty(logp, ref_logp, kl_estimator, kl_clamp)          # (B, T)
    per_token = torch.where(real, -torch.min(surr1, surr2) + beta * kl_t, 0.0)  # (B, T)
    if loss_agg == "seq":
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()    # 1/G sum_i 1/|o_i| sum_t
    elif loss_agg == "token":
        loss = per_token.sum() / mask.sum().clamp(min=1)               # 1/sum_i |o_i| sum_i sum_t
    elif loss_agg == "dr_grpo":
        loss = per_token.sum() / (mask.size(0) * (max_tokens or mask.size(1)))
    else:
        raise ValueError(f"loss_agg {loss_agg!r} is unknown; allowed: 'seq', 'token', 'dr_grpo'")
    with torch.no_grad():
        zero_grad = ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - clip_eps))  # (B, T) bool: the clip took over
        metrics = {"clip_frac": masked_mean(zero_grad.float(), mask).item(),
                   "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),  # k3 of KL(old || new)
                   "kl_est": masked_mean(kl_t, mask).item()}
    return loss, metrics


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--group_size", type=Int(ge=2), default=8, help="G: completions sampled per prompt")
    g.add_argument("--clip_eps", type=Float(gt=0, lt=1), default=0.2, help="PPO clip: ratio kept in [1-clip_eps, 1+eps_high]")
    g.add_argument("--eps_high", type=Float(gt=0), default=None, help="upper clip (DAPO clip-higher); default --clip_eps")
    g.add_argument("--beta", type=Float(ge=0), default=0.04, help="weight of the KL-to-reference penalty in the loss")
    g.add_argument("--kl_estimator", default="k3", choices=["k1", "k2", "k3"], help="per-token KL estimate in the loss")
    g.add_argument("--kl_clamp", type=Float(gt=0), default=None, help="clamp log(pi_ref/pi) to [-c, c] in the KL term (verl, OpenRLHF)")
    g.add_argument("--mu", type=Int(ge=1), default=1, help="optimisation passes over each batch of rollouts")
    g.add_argument("--loss_agg", default="seq", choices=["seq", "token", "dr_grpo"], help="how token losses are averaged")
    g.add_argument("--no_std_scaling", action="store_true", help="advantages r - mean without / std (Dr. GRPO)")
    g.add_argument("--format_weight", type=Float(ge=0), default=0.0, help="reward bonus for a well-formed completion")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=50, help="RL steps (one batch of rollouts each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=32, help="B: prompts drawn per step")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0, help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=task.MAX_NEW_TOKENS, help="longest completion")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=0.5, help="share of a+b*c / a-b*c prompts")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0, help="clip the gradient's global norm to this")
    g = add_run_flags(p, "grpo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH, help="SFT checkpoint: the starting policy and the frozen reference")
    return p.parse_args(argv)


def main(args):
    run = Run("grpo", args)                         # device, seeds, lock, log, resume, Ctrl-C: plumbing.py
    policy, tok = run.load_policy(args.init)        # the policy starts as the SFT policy ...
    ref, _ = run.load_policy(args.init)             # ... which stays frozen as the reference
    ref.requires_grad_(False)
    run.check_lengths(policy, tok, args.max_new_tokens)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    G, T = args.group_size, args.temperature
    run.print(f"GRPO: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {args.steps} steps of "
              f"{args.prompts_per_step} prompts x {G} samples, beta {args.beta} ({args.kl_estimator}), mu {args.mu}")
    if run.step == 0:
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: G completions per prompt at temperature T, scored by the verifier
        prompts = task.sample_prompts(run.rng, args.prompts_per_step, args.precedence_share)
        prompt, prompt_mask = tok.encode_batch(prompts, run.device)                      # (B, Tp)
        with run.autocast:
            tokens, mask, truncated = policy.generate(prompt, prompt_mask, args.max_new_tokens, tok.eos_id, tok.pad_id,
                                                      num_samples=G, temperature=T, generator=run.gen)  # (B*G, Tn)
        completions = tok.decode_completions(tokens, mask)
        run.samples += len(completions)
        rewards = torch.tensor([task.reward(prompts[i // G], c, args.format_weight) for i, c in enumerate(completions)],
                               device=run.device)                                        # (B*G,)
        prompt, prompt_mask = prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)  # (B*G, Tp)
        with torch.no_grad(), run.autocast:
            ref_logits = completion_logits(ref, prompt, prompt_mask, tokens, mask)      # (B*G, Tn, V)
        ref_logp = logprobs(ref_logits, tokens, T)                                       # (B*G, Tn) log pi_ref

        # 2. advantages: the group is the baseline
        advantages = grpo_advantages(rewards, G, scale_by_std=not args.no_std_scaling)  # (B*G,)

        # 3. mu passes of the clipped surrogate + KL penalty
        for epoch in range(args.mu):
            with run.autocast:
                logits = completion_logits(policy, prompt, prompt_mask, tokens, mask)   # (B*G, Tn, V)
            logp = logprobs(logits, tokens, T)                                           # (B*G, Tn) log pi_theta
            if epoch == 0:  # the policy has not moved yet: these are the sampling-time log-probs
                old_logp = logp.detach()
                kl_exact = masked_mean(kl(logits.detach(), ref_logits, T), mask).item()  # KL(pi_theta || pi_ref)
                ent = masked_mean(entropy(logits.detach(), T), mask).item()
            loss, stats = grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps=args.clip_eps, beta=args.beta,
                                    eps_high=args.eps_high, kl_estimator=args.kl_estimator, loss_agg=args.loss_agg,
                                    max_tokens=args.max_new_tokens, kl_clamp=args.kl_clamp)
            run.check_finite(loss, f"lower --lr (now {args.lr})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            optimizer.step()
        run.step += 1
        run.tokens += int(mask.sum())

        # 4. log, evaluate, checkpoint
        if run.log_due():
            groups = rewards.view(-1, G)
            metrics = {"loss": loss.item(), "reward_mean": rewards.mean().item(),
                       "reward_std": rewards.std(unbiased=False).item(),
                       "zero_var_groups": (groups == groups[:, :1]).all(1).float().mean().item(),
                       "kl_exact": kl_exact, f"kl_{args.kl_estimator}": stats["kl_est"], "entropy": ent,
                       "response_len": mask.sum(1).mean().item(), "truncated": truncated.float().mean().item(),
                       "grad_norm": grad_norm.item(), "clip_frac": stats["clip_frac"], "approx_kl": stats["approx_kl"]}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | zero-var {metrics['zero_var_groups']:.2f} | kl "
                             f"{kl_exact:.4f} | ent {ent:.3f} | len {metrics['response_len']:.1f} | gnorm "
                             f"{metrics['grad_norm']:.3f} | clip {metrics['clip_frac']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
