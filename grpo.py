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

The GRPO family, as options (each a clear branch in grpo_advantages, grpo_loss or the loop):
- `--std sample`: divide by the unbiased std over G - 1, as TRL, verl and OpenRLHF do (torch's default .std());
  the default population std is the algorithm as usually written. Advantages differ by sqrt((G-1)/G).
- `--ratio_level sequence` is GSPO (Zheng et al. 2025, arXiv 2507.18071): one ratio per completion,
      s_i = exp( 1/|o_i| sum_t log(pi_theta(o_it) / pi_old(o_it)) ),   L_i = -min(s_i A_i, clip(s_i, 1-eps, 1+eps_high) A_i)
  its value on every real token of completion i, then --loss_agg as usual; the KL term stays per token. The
  paper clips s_i in a band about a thousand times narrower than PPO's (3e-4, 4e-4): set --clip_eps/--eps_high.
- `--loss_type cispo` is CISPO (MiniMax 2025, arXiv 2506.13585): per token
      L_it = -sg(clip(ratio_it, 1-eps, 1+eps_high)) * A_i * log pi_theta(o_it) + beta * KL_it       (sg: stop-gradient)
  a token outside the band keeps its gradient, scaled by the clipped weight, where PPO's clip drops it.
- DAPO (Yu et al. 2025, arXiv 2503.14476): `--loss_agg token`, `--eps_high` (clip-higher), `--dynamic_sampling`
  (eq. 11: keep only groups with 0 < #correct < G, sample more prompts until the step has B of them, at most
  --max_sample_rounds rounds; groups_sampled and groups_kept are logged) and `--overlong_buffer N` (eq. 13: a
  reward penalty ramping from 0 to -1 over the last N tokens of --max_new_tokens). DAPO also drops the KL term
  (--beta 0).
At mu = 1 the ratio is 1 and every option above gives the same gradient as GRPO (CISPO's weight and GSPO's
s_i are 1): they differ only with --mu > 1. `python experiments/grpo_family.py` compares them at --mu 4.

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

Shapes: P prompts per step, G completions per prompt, B = P*G completions (the rows of every (B, T) tensor the
loss functions take), T time (Tp prompt tokens, Tn completion tokens), V vocabulary.

Run:
    python grpo.py                       # from out/sft.pt (trained first if missing); about 1 min on 2 idle CPU cores
    python grpo.py --resume              # continue from out/grpo.pt up to --steps
    python grpo.py --mu 4 --loss_agg token --eps_high 0.28 --beta 0 --dynamic_sampling --overlong_buffer 4   # DAPO
    python grpo.py --mu 4 --ratio_level sequence --clip_eps 3e-4 --eps_high 4e-4                                # GSPO
    python grpo.py --mu 4 --loss_type cispo --loss_agg token --clip_eps 1 --eps_high 1                          # CISPO
Metrics: one JSON object per log step in out/grpo/metrics.jsonl (README: metrics glossary); checkpoint out/grpo.pt.
"""
import torch

import task
from kernels import entropy, kl, kl_penalty, logprobs
from model import completion_logits, masked_mean
from plumbing import SFT_PATH, TEMPERATURE, Float, Int, Run, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm: group-relative advantages and the clipped surrogate with a KL penalty

def grpo_advantages(rewards, group_size, eps=1e-6, scale_by_std=True, std="population"):
    """rewards (P*G,) flat, G = group_size consecutive samples per prompt -> advantages (P*G,).
    A_i = (r_i - mean_g) / (std_g + eps). std="population" divides the squared deviations by G (the
    default: the algorithm as usually written); std="sample" by G - 1, the unbiased std that TRL, verl and
    OpenRLHF use (torch's default .std()), which gives advantages smaller by sqrt((G-1)/G). A group whose
    rewards are all equal gets exactly 0. scale_by_std=False gives Dr. GRPO's A_i = r_i - mean_g."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                         f"group_size = {group_size}; need a flat tensor whose length is a multiple of it (>= 1)")
    if std not in ("population", "sample"):
        raise ValueError(f"std {std!r} is unknown; allowed: 'population', 'sample'")
    r = rewards.view(-1, group_size)                                   # (P, G)
    mean = r.mean(dim=1, keepdim=True)                                 # (P, 1)
    advantages = r - mean                                              # r_i - mean_g
    if scale_by_std:
        if std == "population":
            sd = r.std(dim=1, keepdim=True, unbiased=False)            # sqrt(1/G sum (r - mean)^2)
        else:
            sd = (advantages.pow(2).sum(1, keepdim=True) / max(group_size - 1, 1)).sqrt()  # sqrt(1/(G-1) sum (r - mean)^2)
        advantages = advantages / (sd + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)               # (P, 1) no signal in this group
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)  # (P*G,)


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps=0.2, beta=0.04, eps_high=None,
              kl_estimator="k3", loss_agg="seq", max_tokens=None, kl_clamp=None, ratio_level="token", loss_type="clip",
              num_seqs=None, num_tokens=None):
    """The GRPO loss (DeepSeekMath eq. 3, negated) and its metrics.

    logp (B, T) log pi_theta of the sampled tokens (with grad); old_logp (B, T) at sampling time;
    ref_logp (B, T) under the frozen reference; advantages (B,) one per completion; mask (B, T) 1.0 on
    completion tokens. Per token: -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + eps_high) * A) + beta * KL.
    loss_agg: "seq" (DeepSeekMath: token mean per completion, then mean over completions),
    "token" (DAPO: mean over all tokens of the batch), "dr_grpo" (sum over tokens / (B * max_tokens),
    max_tokens defaulting to T). kl_clamp: see kl_penalty.
    ratio_level="sequence" is GSPO (Zheng et al. 2025): one ratio per completion, the geometric mean of its
    token ratios s_i = exp(1/|o_i| sum_t (log pi_theta - log pi_old)), clipped as above, the value standing on
    every real token of completion i (the KL term stays per token).
    loss_type="cispo" is CISPO (MiniMax 2025): -sg(clip(ratio, 1 - clip_eps, 1 + eps_high)) * A * log pi_theta per
    token, sg = stop-gradient: a token outside the band keeps its gradient, with a clipped weight, where the PPO
    clip would give it none. Values at masked positions are never read.
    num_seqs, num_tokens: when this batch is one part of a step's batch (a --grad_accum micro-batch, or one rank's
    share under torchrun), the whole batch's numbers of completions and of completion tokens: the loss and the metrics
    are then this part's share of the whole batch's, and the parts add up to them exactly. Default: this batch's.
    Returns (loss scalar, dict of float metrics)."""
    eps_high = clip_eps if eps_high is None else eps_high
    real = mask > 0                                                    # (B, T) bool
    logp, old_logp, ref_logp = (torch.where(real, x, 0.0) for x in (logp, old_logp, ref_logp))  # padding never leaks
    A = advantages[:, None]                                            # (B, 1) the same advantage for every token
    log_ratio = logp - old_logp                                        # (B, T)
    if ratio_level == "token":
        ratio = torch.exp(log_ratio)                                   # pi_theta / pi_old, per token
    elif ratio_level == "sequence":                                    # GSPO: s_i = exp(mean_t log ratio_it)
        seq_log_ratio = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
        ratio = torch.exp(seq_log_ratio).expand_as(log_ratio)          # (B, T) s_i on every token of completion i
    else:
        raise ValueError(f"ratio_level {ratio_level!r} is unknown; allowed: 'token', 'sequence'")
    if loss_type == "clip":
        surr1 = ratio * A
        surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high) * A
        pg = -torch.min(surr1, surr2)                                  # (B, T)
        clipped = ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - clip_eps))  # (B, T) bool: no gradient
    elif loss_type == "cispo":
        if ratio_level != "token":
            raise ValueError("loss_type 'cispo' weights token log-probs by token ratios; use ratio_level 'token'")
        weight = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high).detach()   # sg(clip(ratio))
        pg = -weight * A * logp                                        # (B, T)
        clipped = (ratio > 1 + eps_high) | (ratio < 1 - clip_eps)      # (B, T) bool: weight truncated, gradient kept
    else:
        raise ValueError(f"loss_type {loss_type!r} is unknown; allowed: 'clip', 'cispo'")
    kl_t = kl_penalty(logp, ref_logp, kl_estimator, kl_clamp)          # (B, T)
    per_token = torch.where(real, pg + beta * kl_t, 0.0)               # (B, T)
    n_seqs = mask.size(0) if num_seqs is None else num_seqs
    n_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    if loss_agg == "seq":
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs   # 1/G sum_i 1/|o_i| sum_t
    elif loss_agg == "token":
        loss = per_token.sum() / n_tokens                              # 1/sum_i |o_i| sum_i sum_t
    elif loss_agg == "dr_grpo":
        loss = per_token.sum() / (n_seqs * (max_tokens or mask.size(1)))
    else:
        raise ValueError(f"loss_agg {loss_agg!r} is unknown; allowed: 'seq', 'token', 'dr_grpo'")
    with torch.no_grad():
        token_mean = lambda x: (torch.where(real, x, 0.0).sum() / n_tokens).item()
        metrics = {"clip_frac": token_mean(clipped.float()),
                   "approx_kl": token_mean((log_ratio.exp() - 1) - log_ratio),  # k3 of KL(old || new)
                   "kl_est": token_mean(kl_t)}
    return loss, metrics


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward: lengths (B,) -> float (B,):
    0 when L <= max_len - buffer; ((max_len - buffer) - L) / buffer when max_len - buffer < L <= max_len; -1 beyond."""
    L = lengths.float()
    start = max_len - buffer                                           # the penalty starts after this length
    ramp = (start - L) / buffer                                        # 0 at start, -1 at max_len
    return torch.where(L <= start, torch.zeros_like(L), torch.where(L <= max_len, ramp, -torch.ones_like(L)))


# -----------------------------------------------------------------------------
# DAPO's dynamic sampling: keep the groups that carry a signal

def informative_groups(batch, G):
    """DAPO's dynamic-sampling filter (Yu et al. 2025, eq. 11: 0 < #correct < G): the rows of the groups whose
    rewards are not all equal; the others get advantage 0 and teach nothing. batch: task.rollout's tuple, rewards
    last; returns the same tuple with fewer rows."""
    r = batch[-1].view(-1, G)                                                        # (P, G) rewards
    keep = (r != r[:, :1]).any(1).repeat_interleave(G)                               # (P*G,) bool
    return type(batch)(*(x[keep] for x in batch))


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--group_size", type=Int(ge=2), default=8, help="G: completions sampled per prompt")
    g.add_argument("--clip_eps", type=Float(gt=0, le=1), default=0.2, help="PPO clip: ratio kept in [1-clip_eps, 1+eps_high]")
    g.add_argument("--eps_high", type=Float(gt=0), default=None, help="upper clip (DAPO clip-higher); default --clip_eps")
    g.add_argument("--beta", type=Float(ge=0), default=0.04, help="weight of the KL-to-reference penalty in the loss")
    g.add_argument("--kl_estimator", default="k3", choices=["k1", "k2", "k3"], help="per-token KL estimate in the loss")
    g.add_argument("--kl_clamp", type=Float(gt=0), default=None, help="clamp log(pi_ref/pi) to [-c, c] in the KL term (verl, OpenRLHF)")
    g.add_argument("--mu", type=Int(ge=1), default=1, help="optimisation passes over each batch of rollouts")
    g.add_argument("--loss_agg", default="seq", choices=["seq", "token", "dr_grpo"], help="how token losses are averaged")
    g.add_argument("--no_std_scaling", action="store_true", help="advantages r - mean without / std (Dr. GRPO)")
    g.add_argument("--std", default="population", choices=["population", "sample"], help="std over G (population) or G-1 (sample: TRL, verl, OpenRLHF)")
    g.add_argument("--ratio_level", default="token", choices=["token", "sequence"], help="one ratio per token, or per completion (GSPO)")
    g.add_argument("--loss_type", default="clip", choices=["clip", "cispo"], help="PPO's clipped surrogate, or CISPO's clipped weight")
    g.add_argument("--overlong_buffer", type=Int(ge=0), default=0, help="DAPO's overlong penalty over the last N tokens of the budget (0: off)")
    g.add_argument("--format_weight", type=Float(ge=0), default=0.0, help="reward bonus for a well-formed completion")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=50, help="RL steps (one batch of rollouts each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=32, help="P: prompts drawn per step")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0, help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=task.MAX_NEW_TOKENS, help="longest completion")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=0.5, help="share of a+b*c / a-b*c prompts")
    g.add_argument("--dynamic_sampling", action="store_true", help="DAPO: keep only groups with a reward spread, sample more to fill B")
    g.add_argument("--max_sample_rounds", type=Int(ge=1), default=4, help="with --dynamic_sampling: most rollout rounds per step")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0, help="clip the gradient's global norm to this")
    g = add_run_flags(p, "grpo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH, help="SFT checkpoint: the starting policy and the frozen reference")
    args = p.parse_args(argv)
    if args.overlong_buffer > args.max_new_tokens:
        p.error(f"--overlong_buffer {args.overlong_buffer} exceeds --max_new_tokens {args.max_new_tokens}")
    return args


def main(args):
    run = Run("grpo", args, batch_flag="prompts_per_step")  # device, seeds, lock, log, resume, torchrun: plumbing.py
    policy, tok = run.load_policy(args.init)        # the policy starts as the SFT policy ...
    ref, _ = run.load_policy(args.init)             # ... which stays frozen as the reference
    ref.requires_grad_(False)
    run.check_lengths(policy, tok, args.max_new_tokens)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    train_policy = run.ddp(policy)                  # DistributedDataParallel under torchrun, else the policy itself
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    run.print(f"GRPO: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {args.steps} steps of {P} prompts x {G} "
              f"samples, beta {args.beta} ({args.kl_estimator}), mu {args.mu}, {args.ratio_level} ratio, {args.loss_type} loss"
              f"{', dynamic sampling' if args.dynamic_sampling else ''}")
    if not args.resume:                             # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: G completions for each of this rank's prompts, scored by the verifier; with --dynamic_sampling
        #    (DAPO) only the groups whose rewards differ are kept, sampling again until each rank has its share of P
        kept, rounds, short = [], 0, True
        while short and rounds < (args.max_sample_rounds if args.dynamic_sampling else 1):
            prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
            with run.autocast:
                batch = task.rollout(policy, tok, prompts, G, temp, args.max_new_tokens, args.format_weight, run.gen)
            kept, rounds = kept + [informative_groups(batch, G) if args.dynamic_sampling else batch], rounds + 1
            short = run.all_sum(float(sum(len(b[-1]) for b in kept) < len(prompts) * G)).item() > 0  # any rank short
        if sum(len(b[-1]) for b in kept) > 0:                                      # else: the last batch, all A = 0
            batch = task.Rollout(*(x[:len(prompts) * G] for x in task.concat_rollouts(kept, tok.pad_id)))
        prompt, prompt_mask, tokens, mask, truncated, rewards, _ = batch              # (B, Tp), (B, Tn), (B,); B = P*G
        if args.overlong_buffer > 0:                                               # DAPO's overlong punishment
            rewards = rewards + overlong_penalty(mask.sum(1), args.max_new_tokens, args.overlong_buffer)
        run.samples += rounds * P * G

        # 2. score without gradient: sampling-time and reference log-probs, the exact KL and entropy (for the log)
        old_logp, ref_logp = torch.zeros_like(mask), torch.zeros_like(mask)      # (B, Tn)
        n_seqs, n_tokens = run.all_sum(len(mask)), run.all_sum(mask.sum())        # the step's, over every rank
        kl_exact = ent = 0.0
        for rows in run.micro_batches(len(mask)):
            with torch.no_grad(), run.autocast:
                logits = completion_logits(policy, prompt[rows], prompt_mask[rows], tokens[rows], mask[rows])  # (b, Tn, V)
                ref_logits = completion_logits(ref, prompt[rows], prompt_mask[rows], tokens[rows], mask[rows])
            old_logp[rows], ref_logp[rows] = logprobs(logits, tokens[rows], temp), logprobs(ref_logits, tokens[rows], temp)
            kl_exact += torch.where(mask[rows] > 0, kl(logits, ref_logits, temp), 0.0).sum() / n_tokens  # KL(pi || pi_ref)
            ent += torch.where(mask[rows] > 0, entropy(logits, temp), 0.0).sum() / n_tokens

        # 3. advantages: the group is the baseline
        advantages = grpo_advantages(rewards, G, scale_by_std=not args.no_std_scaling, std=args.std)  # (B,)

        # 4. mu passes of the clipped surrogate (or CISPO's weighted log-likelihood) + KL penalty, each over the
        #    --grad_accum micro-batches, normalised by the whole step's counts: the parts add up to one batch's loss
        for epoch in range(args.mu):
            optimizer.zero_grad(set_to_none=True)
            loss, stats = 0.0, {}
            for rows in run.micro_batches(len(mask), train_policy):
                with run.autocast:
                    logits = completion_logits(train_policy, prompt[rows], prompt_mask[rows], tokens[rows], mask[rows])
                logp = logprobs(logits, tokens[rows], temp)                        # (b, Tn) log pi_theta
                part, part_stats = grpo_loss(logp, old_logp[rows], ref_logp[rows], advantages[rows], mask[rows],
                                             clip_eps=args.clip_eps, beta=args.beta, eps_high=args.eps_high,
                                             kl_estimator=args.kl_estimator, loss_agg=args.loss_agg,
                                             max_tokens=args.max_new_tokens, kl_clamp=args.kl_clamp,
                                             ratio_level=args.ratio_level, loss_type=args.loss_type,
                                             num_seqs=n_seqs, num_tokens=n_tokens)
                run.check_finite(part, f"lower --lr (now {args.lr})")
                part.backward()
                loss, stats = loss + part.item(), {k: stats.get(k, 0.0) + v for k, v in part_stats.items()}
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            optimizer.step()
        run.step += 1
        run.tokens += int(n_tokens)

        # 5. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            groups = rewards.view(-1, G)
            metrics = {"loss": run.all_sum(loss).item(), "reward_mean": run.mean(rewards), "reward_std": run.std(rewards),
                       "zero_var_groups": run.mean((groups == groups[:, :1]).all(1).float()),
                       "reward_groups": run.mean((groups != 0).any(1).float()),     # groups with any reward at all
                       "kl_exact": run.all_sum(kl_exact).item(), "entropy": run.all_sum(ent).item(),
                       **{k.replace("kl_est", f"kl_{args.kl_estimator}"): run.all_sum(v).item() for k, v in stats.items()},
                       "completion_len": run.mean(mask.sum(1)), "truncated": run.mean(truncated.float()),
                       "grad_norm": grad_norm.item(), "groups_sampled": rounds * P, "groups_kept": run.all_sum(len(rewards)).item() // G}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | zero-var {metrics['zero_var_groups']:.2f} | kl "
                             f"{metrics['kl_exact']:.4f} | ent {metrics['entropy']:.3f} | len {metrics['completion_len']:.1f} "
                             f"| gnorm {metrics['grad_norm']:.3f} | clip {metrics['clip_frac']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
