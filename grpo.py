"""
GRPO: Group Relative Policy Optimization, with the verifier as the reward.

For each prompt, sample a group of G completions, score each with the verifier, and give every
token of a completion the same advantage: its reward standardised within the group, how much
better it did than its siblings. That group baseline replaces PPO's value network. The loss is
PPO's clipped surrogate on those advantages plus a KL penalty to the SFT reference. With one pass
per batch (mu = 1, the default, as in DeepSeek-R1) the ratio is exactly 1 and the clip never acts:
the update is a group-baselined policy gradient, A * grad log pi.

Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, eq. 3 as a loss to minimise; DeepSeek-AI
2025, "DeepSeek-R1", arXiv 2501.12948, for verifiable rewards. Completion i of a group, token t:
    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)         (population std: divide by G)
    L = 1/G sum_i 1/|o_i| sum_t [ -min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) + beta KL_it ]
    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t);   KL_it: k3 (kernels.kl_penalty)

The family, as flags (experiments/README.md compares them at --mu 4): --std sample (TRL, verl);
Dr. GRPO (arXiv 2503.20783) --loss_agg dr_grpo --no_std_scaling; DAPO (2503.14476) --loss_agg
token --eps_high --dynamic_sampling --overlong_buffer --beta 0; GSPO (2507.18071) --ratio_level
sequence; CISPO (2506.13585), SAPO (2511.20347), DPPO (2602.04879) --loss_type cispo, sapo, dppo
(at mu = 1 these four give GRPO's gradient); MaxRL (2602.02710) --maxrl.

Deviations and choices the papers leave open:
1. mu passes over the whole batch (no minibatches); pi_old is scored once per batch (step 2),
   with the weights that sampled it; at mu = 1 it is the loss forward's own, detached (as TRL).
2. A group whose rewards are all equal gets advantage exactly 0 (never 0/0).
3. The reward is the task's verifier (1 correct, else 0; --format_weight adds a format bonus).
4. Small scale: a 0.44M-parameter policy, AdamW at a constant learning rate.

Shapes: P prompts, G completions each, B = P*G rows; T time (Tp prompt, Tn completion); V vocab.

    python grpo.py                  # from out/sft.pt (built first if missing); ~1 min on 2 CPUs
    python grpo.py --resume         # continue from out/grpo.pt up to --steps
Metrics: out/grpo/metrics.jsonl (docs/metrics.md); checkpoint out/grpo.pt.
"""
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import task
from kernels import kl_penalty
from lora import trainable
from model import completion_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser
from sampler import score


# -----------------------------------------------------------------------------
# The algorithm: group-relative advantages and the clipped surrogate with a KL penalty

def grpo_advantages(rewards, group_size, eps=1e-6, scale_by_std=True, std="population"):
    """rewards (P*G,), G = group_size consecutive samples per prompt -> advantages (P*G,), 0 for a
    group whose rewards are all equal. std="sample": G - 1 in the std (TRL, verl, OpenRLHF);
    scale_by_std=False: Dr. GRPO."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups "
                         f"of group_size = {group_size}; need a flat tensor whose length is a "
                         f"multiple of it (>= 1)")
    if std not in ("population", "sample"):
        raise ValueError(f"std {std!r} is unknown; allowed: 'population', 'sample'")
    r = rewards.view(-1, group_size)                                   # (P, G)
    mean = r.mean(dim=1, keepdim=True)                                 # (P, 1)
    advantages = r - mean                                              # r_i - mean_g
    if scale_by_std:
        if std == "population":
            sd = r.std(dim=1, keepdim=True, unbiased=False)            # sqrt(1/G sum (r - mean)^2)
        else:
            sd = (advantages.pow(2).sum(1, keepdim=True) / max(group_size - 1, 1)).sqrt()  # G-1
        advantages = advantages / (sd + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)               # (P, 1) no signal
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)  # (P*G,)


def maxrl_advantages(rewards, group_size, eps=1e-6):
    """MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning", arXiv 2602.02710):
    rewards (P*G,) >= 0 -> advantages (P*G,), the group's mean as baseline and as the scale. With
    0/1 rewards, K successes of G, mean_g A_i grad log pi_i = 1/K sum_{correct} grad log pi_i -
    1/G sum_i grad log pi_i (the second term a zero-mean control variate): the paper's estimate
    of grad log p(correct), truncated at G samples, where GRPO follows grad p(correct); a prompt
    of pass rate p weighs 1/p; under --loss_agg seq, grad log pi_i is 1/|o_i| sum_t grad log pi_it:
    the paper's estimate up to that length weighting. 0 for a group whose rewards are all equal."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups "
                         f"of group_size = {group_size}; need a flat tensor whose length is a "
                         f"multiple of it (>= 1)")
    if (rewards < 0).any():
        raise ValueError(f"MaxRL divides by the group's mean reward: rewards must be >= 0, got "
                         f"{rewards.min().item()}")
    r = rewards.view(-1, group_size)                                   # (P, G)
    mean = r.mean(dim=1, keepdim=True)                                 # (P, 1) pass rate p
    advantages = (r - mean) / (mean + eps)                             # A_i = (r_i - p) / p
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)               # (P, 1) no signal
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)  # (P*G,)


@dataclass(frozen=True)
class LossSettings:
    """grpo_loss's settings (the flags of the same names), checked when made."""
    clip_eps: float = 0.2         # rho kept in [1 - clip_eps, 1 + eps_high]
    eps_high: float = None        # DAPO's clip-higher (default clip_eps)
    beta: float = 0.04            # weight of the KL penalty
    kl_estimator: str = "k3"      # KL_it's estimate, and its clamp: kernels.kl_penalty
    kl_clamp: float = None
    ratio_level: str = "token"    # "sequence": GSPO's one ratio per completion (gspo_ratio)
    loss_type: str = "clip"       # the surrogate: clip_terms, cispo_terms, sapo_terms, dppo_terms
    loss_agg: str = "seq"         # and max_tokens: aggregate
    max_tokens: int = None
    tau_pos: float = 1.0          # SAPO's gate temperatures (sapo_terms)
    tau_neg: float = 1.05
    divergence: str = "tv"        # DPPO's divergence, its bound, its ratio cap (dppo_terms)
    delta: float = None
    ratio_cap: float = 10.0

    def __post_init__(self):
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level {self.ratio_level!r} is unknown; allowed: 'token', "
                             f"'sequence'")
        if self.loss_type not in ("clip", "cispo", "sapo", "dppo"):
            raise ValueError(f"loss_type {self.loss_type!r} is unknown; allowed: 'clip', "
                             f"'cispo', 'sapo', 'dppo'")
        if self.loss_type != "clip" and self.ratio_level != "token":
            raise ValueError(f"loss_type {self.loss_type!r} weighs each token by its own ratio; "
                             f"use ratio_level 'token'")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, settings=LossSettings(),
              num_seqs=None, num_tokens=None):
    """The GRPO loss (DeepSeekMath eq. 3, negated) and its metrics (detached tensors). logp (B, T)
    log pi_theta of the sampled tokens (with grad); old_logp (B, T) at sampling time; ref_logp
    (B, T) under the frozen reference; advantages (B,); mask (B, T) 1.0 on completion tokens (values
    elsewhere are never read). num_seqs, num_tokens: the whole step's counts when this batch is a
    part of it (a micro-batch, a rank's share), so that the parts' losses add up to the step's;
    default: this batch's."""
    s = settings
    real = mask > 0                                              # (B, T) bool
    logp, old_logp, ref_logp = (torch.where(real, x, 0.0)        # padding never leaks
                                for x in (logp, old_logp, ref_logp))
    A = advantages[:, None]                                      # (B, 1): A_i on every token of o_i
    log_ratio = logp - old_logp                                  # (B, T)
    ratio = torch.exp(log_ratio)                                 # rho_it = pi_theta / pi_old
    if s.ratio_level == "sequence":                              # GSPO: one ratio per completion
        ratio = gspo_ratio(log_ratio, mask)
    eps_high = s.clip_eps if s.eps_high is None else s.eps_high
    if s.loss_type == "clip":                                    # (B, T) terms, cut tokens
        pg, clipped = clip_terms(ratio, A, s.clip_eps, eps_high)
    elif s.loss_type == "cispo":
        pg, clipped = cispo_terms(logp, ratio, A, s.clip_eps, eps_high)
    elif s.loss_type == "sapo":
        pg, clipped = sapo_terms(ratio, A, s.tau_pos, s.tau_neg)
    else:
        pg, clipped = dppo_terms(logp, old_logp, ratio, A, s.divergence, s.delta, s.ratio_cap)
    kl_t = kl_penalty(logp, ref_logp, s.kl_estimator, s.kl_clamp)      # (B, T) KL_it
    per_token = torch.where(real, pg + s.beta * kl_t, 0.0)             # (B, T)
    loss = aggregate(per_token, mask, s.loss_agg, num_seqs, num_tokens, s.max_tokens)
    n_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    token_mean = lambda x: torch.where(real, x.detach(), 0.0).sum() / n_tokens
    return loss, {"clip_frac": token_mean(clipped.float()),
                  "approx_kl": token_mean((log_ratio.exp() - 1) - log_ratio),  # k3, pi_old || pi
                  "kl_est": token_mean(kl_t)}


def clip_terms(ratio, A, clip_eps, eps_high):
    """PPO's clipped surrogate, -min(rho A, clip(rho, 1-eps, 1+eps_high) A) per token (B, T), and
    where the clip took the gradient."""
    pg = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_eps, 1 + eps_high) * A)
    return pg, ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - clip_eps))


def gspo_ratio(log_ratio, mask):
    """GSPO's s_i = exp(1/|o_i| sum_t log(pi_theta / pi_old)), on every token of completion i:
    (B, T) -> (B, T)."""
    n = mask.sum(1, keepdim=True).clamp(min=1)                         # (B, 1) |o_i|
    seq_log_ratio = log_ratio.sum(1, keepdim=True) / n                 # (B, 1)
    return torch.exp(seq_log_ratio).expand_as(log_ratio)


def cispo_terms(logp, ratio, A, clip_eps, eps_high):
    """CISPO's -sg(clip(rho, 1-eps, 1+eps_high)) A log pi_theta per token (sg: stop-gradient): a
    token outside the band keeps its gradient, scaled by the clipped weight. Returns the (B, T)
    terms and where the weight was cut."""
    weight = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high).detach()   # sg(clip(rho))
    return -weight * A * logp, (ratio > 1 + eps_high) | (ratio < 1 - clip_eps)


def sapo_terms(ratio, A, tau_pos=1.0, tau_neg=1.05):
    """SAPO's soft gate (Qwen 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347,
    the objective as a loss): -f(rho) A per token, f(x) = sigmoid(tau (x - 1)) 4 / tau, tau =
    tau_pos where A > 0, else tau_neg (the paper's 1.0 and 1.05: negative tokens fade faster). Its
    gradient is w A grad rho, w = 4 sigmoid (1 - sigmoid): exactly GRPO's at rho = 1, fading
    smoothly as rho leaves 1 where the clip cuts at once. Returns the (B, T) terms and where w
    fell below one half."""
    tau = torch.where(A > 0, A.new_tensor(tau_pos), A.new_tensor(tau_neg))   # by the sign of A
    gate = torch.sigmoid(tau * (ratio - 1))                            # sigma(tau (rho - 1))
    f = gate * 4 / tau                                                 # f(rho) = sigma(.) 4 / tau
    weight = 4 * gate * (1 - gate)                                     # df/drho
    return -f * A, weight.detach() < 0.5


def dppo_terms(logp, old_logp, ratio, A, divergence="tv", delta=None, ratio_cap=10.0):
    """DPPO's divergence mask (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv 2602.04879, eq. 11 as a loss, the binary approximations, eqs. 13-14): -M rho A
    per token, M = 0 where the sampled token's probability p = pi_theta(y_t) has moved from q =
    pi_old(y_t) by a divergence D > delta in the direction A pushes it (up for A > 0, down for
    A < 0), else 1; no clip. D over the two outcomes {y_t, not y_t}:
        tv   D = |p - q|                                                   (delta: paper 0.15)
        kl   D = q log(q / p) + (1 - q) log((1 - q) / (1 - p)),  KL(q || p)  (delta: paper 0.05)
    As the authors' code (Stable-RL: clip_ratio_c 10; verl's 20), the weight rho is truncated at
    ratio_cap: past it a token's term is -M c A, its gradient -M c A grad log pi (below the cap,
    -M A grad rho: the paper's). pi_old is the paper's rollout policy mu: the weights that sampled
    (the same bits as the sampler's with --batch_invariant). Returns the (B, T) terms and the
    mask's zeros."""
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence {divergence!r} is unknown; allowed: 'tv', 'kl'")
    delta = (0.15 if divergence == "tv" else 0.05) if delta is None else delta
    lp, lq = logp.detach(), old_logp                                   # (B, T) log p, log q
    p, q = lp.exp(), lq.exp()
    if divergence == "tv":
        D = (p - q).abs()
    else:                                # 1 - p as -expm1(log p): exact near p = 1; 0 log 0 = 0
        p1, q1 = -torch.expm1(lp), -torch.expm1(lq)
        D = q * (lq - lp) + torch.xlogy(q1, q1) - torch.xlogy(q1, p1)
    masked = (D > delta) & (((A > 0) & (p > q)) | ((A < 0) & (p < q)))   # M_t = 0
    # min(rho, c), its gradient rho grad log pi below the cap and c grad log pi above
    weight = torch.where(ratio <= ratio_cap, ratio, ratio_cap * torch.exp(logp - logp.detach()))
    return -torch.where(masked, 0.0, weight * A), masked


def aggregate(per_token, mask, loss_agg="seq", num_seqs=None, num_tokens=None, max_tokens=None):
    """Token losses (B, T), zero where masked, to one number: "seq" (DeepSeekMath) the mean over
    completions of each one's token mean; "token" (DAPO) the mean over all tokens; "dr_grpo" the
    token sum over completions x max_tokens (default T). num_seqs, num_tokens: the step's counts
    when this batch is one part of it."""
    n_seqs = mask.size(0) if num_seqs is None else num_seqs
    n_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    if loss_agg == "seq":
        return (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs  # 1/G sum_i 1/|o_i|
    if loss_agg == "token":
        return per_token.sum() / n_tokens                              # 1/sum_i |o_i| sum_i sum_t
    if loss_agg == "dr_grpo":
        return per_token.sum() / (n_seqs * (max_tokens or mask.size(1)))
    raise ValueError(f"loss_agg {loss_agg!r} is unknown; allowed: 'seq', 'token', 'dr_grpo'")


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong punishment (eq. 13), added to the reward: lengths (B,) -> float (B,): 0
    when L <= max_len - buffer; ((max_len - buffer) - L) / buffer up to max_len; -1 beyond. A NaN
    length stays NaN."""
    L = lengths.float()
    start = max_len - buffer                                  # the penalty starts after this length
    ramp = (start - L) / buffer                               # 0 at start, -1 at max_len
    penalty = torch.where(L <= start, torch.zeros_like(L),
                          torch.where(L <= max_len, ramp, -torch.ones_like(L)))
    return torch.where(torch.isnan(L), L, penalty)


def dynamic_sampling_keep(correct, G):
    """DAPO's dynamic-sampling filter (eq. 11: 0 < #correct < G): correct (B,) the verifier's 0/1
    outcomes, B = P*G -> (B,) bool, True on the rows of the groups that are neither all right nor
    all wrong. A format bonus never makes a group informative: the filter reads correctness, not the
    reward."""
    n_correct = correct.view(-1, G).float().sum(1)                     # (P,) #correct per group
    return ((n_correct > 0) & (n_correct < G)).repeat_interleave(G)   # (P*G,)


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--group_size", type=Int(ge=2), default=8,
                   help="G: completions sampled per prompt")
    g.add_argument("--clip_eps", type=Float(gt=0, le=1), default=0.2,
                   help="PPO clip: the ratio kept in [1-clip_eps, 1+eps_high]")
    g.add_argument("--eps_high", type=Float(gt=0), default=None,
                   help="upper clip (DAPO clip-higher); default clip_eps")
    g.add_argument("--beta", type=Float(ge=0), default=0.04,
                   help="weight of the KL-to-reference penalty in the loss")
    g.add_argument("--kl_estimator", default="k3", choices=["k1", "k2", "k3"],
                   help="per-token KL estimate in the loss")
    g.add_argument("--kl_clamp", type=Float(gt=0), default=None,
                   help="clamp log(pi_ref/pi) to [-c, c] in the KL term")
    g.add_argument("--mu", type=Int(ge=1), default=1,
                   help="optimisation passes over each batch of rollouts")
    g.add_argument("--loss_agg", default="seq", choices=["seq", "token", "dr_grpo"],
                   help="how token losses average")
    g.add_argument("--no_std_scaling", action="store_true",
                   help="advantages r - mean without / std (Dr. GRPO)")
    g.add_argument("--std", default="population", choices=["population", "sample"],
                   help="std over G (population) or G-1 (sample: TRL, verl, OpenRLHF)")
    g.add_argument("--ratio_level", default="token", choices=["token", "sequence"],
                   help="one ratio per token, or per completion (GSPO)")
    g.add_argument("--loss_type", default="clip", choices=["clip", "cispo", "sapo", "dppo"],
                   help="PPO's clipped surrogate, CISPO's clipped weight, SAPO's soft gate or "
                        "DPPO's divergence mask")
    g.add_argument("--tau_pos", type=Float(ge=1e-3, le=1e3), default=None,
                   help="SAPO's gate temperature where A > 0 (default 1.0, the paper's)")
    g.add_argument("--tau_neg", type=Float(ge=1e-3, le=1e3), default=None,
                   help="SAPO's gate temperature where A < 0 (default 1.05, the paper's)")
    g.add_argument("--divergence", default=None, choices=["tv", "kl"],
                   help="DPPO's binary divergence: total variation (default) or KL")
    g.add_argument("--delta", type=Float(gt=0), default=None,
                   help="DPPO's divergence bound (default the paper's: 0.15 tv, 0.05 kl)")
    g.add_argument("--ratio_cap", type=Float(ge=1), default=None,
                   help="DPPO's truncation of the ratio (default 10, the authors' code's)")
    g.add_argument("--maxrl", action="store_true",
                   help="MaxRL's advantages: (r - mean) / mean in each group")
    g.add_argument("--overlong_buffer", type=Int(ge=0), default=0,
                   help="DAPO's overlong penalty over the last N tokens of the budget (0: off)")
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
    g.add_argument("--dynamic_sampling", action="store_true",
                   help="DAPO: keep only groups with 0 < #correct < G, sample more to fill "
                        "the batch")
    g.add_argument("--max_sample_rounds", type=Int(ge=1), default=4,
                   help="with --dynamic_sampling: most rollout rounds per step")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "grpo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    args = p.parse_args(argv)
    for flags, loss in ((("tau_pos", "tau_neg"), "sapo"),
                        (("divergence", "delta", "ratio_cap"), "dppo")):
        for flag in flags:
            if getattr(args, flag) is not None and args.loss_type != loss:
                p.error(f"--{flag} is {loss.upper()}'s; it needs --loss_type {loss} (now "
                        f"{args.loss_type})")
    if args.loss_type in ("cispo", "sapo", "dppo") and args.ratio_level != "token":
        p.error(f"--loss_type {args.loss_type} weighs each token by its own ratio; allowed with "
                f"--ratio_level token only (now {args.ratio_level})")
    if args.maxrl and (args.no_std_scaling or args.std != "population" or args.overlong_buffer):
        p.error("--maxrl divides by the group's mean reward: not with --no_std_scaling, --std "
                "or --overlong_buffer (its rewards go negative)")
    if args.maxrl and args.format_weight:
        p.error(f"--maxrl divides by the pass rate (the group's mean 0/1 reward); with "
                f"--format_weight {args.format_weight:g} the mean is not a pass rate and a "
                f"format-only difference weighs as a correct answer: allowed: --format_weight 0")
    if args.overlong_buffer > args.max_new_tokens:
        p.error(f"--overlong_buffer {args.overlong_buffer} exceeds "
                f"--max_new_tokens {args.max_new_tokens}")
    return args


def loss_settings(args):
    """grpo_loss's settings from the flags (one left unset: the record's default), and what to say
    if the loss is not finite."""
    flags = {f.name: getattr(args, "max_new_tokens" if f.name == "max_tokens" else f.name)
             for f in fields(LossSettings)}
    s = LossSettings(**{k: v for k, v in flags.items() if v is not None})
    constants = {"sapo": f", or --tau_pos {s.tau_pos:g} and --tau_neg {s.tau_neg:g}",
                 "dppo": f", or --ratio_cap {s.ratio_cap:g}"}.get(s.loss_type, "")
    return s, f"lower --lr (now {args.lr}){constants}"


def rollout(run, policy, tok, args):
    """Step 1, G completions for each of this rank's prompts, scored: (task.Rollout, the log-probs
    the sampler drew each token with (B, Tn), the hidden states it drew them from (B, Tn, C) on a
    logged step, else None, rounds). --dynamic_sampling: keep
    dynamic_sampling_keep's groups, sampling again (at most --max_sample_rounds) until every rank
    has its share of P of them. A rank that keeps none trains on its last round, each reward set to
    its group's mean (A = 0)."""
    kept, rounds = [], 0
    while True:
        prompts = run.shard(task.sample_prompts(run.rng, args.prompts_per_step,
                                                args.precedence_share))
        with run.autocast:
            batch, logp, hidden = task.rollout(policy, tok, prompts, args.group_size,
                                               args.temperature, args.max_new_tokens,
                                               args.format_weight, run.gen, return_logprobs=True,
                                               return_hidden=run.logging())
        rounds += 1
        if not args.dynamic_sampling:
            return batch, logp, hidden, rounds
        keep = dynamic_sampling_keep(batch.correct, args.group_size)   # (B,) bool
        kept.append((task.Rollout(*(x[keep] for x in batch)), logp[keep],
                     hidden[keep] if hidden is not None else None))
        rows = len(prompts) * args.group_size
        mine_short = float(sum(len(b.rewards) for b, *_ in kept) < rows)
        short = run.all_sum(mine_short).item() > 0                      # any rank short
        if not short or rounds == args.max_sample_rounds:
            break
    if sum(len(b.rewards) for b, *_ in kept) == 0:
        # nothing informative: the last round, its rewards set to their group's mean (A = 0)
        mean = batch.rewards.view(-1, args.group_size).mean(1)
        return batch._replace(rewards=mean.repeat_interleave(args.group_size)), logp, hidden, rounds
    batch = task.concat_rollouts([b for b, *_ in kept], tok.pad_id)
    Tn = batch.tokens.size(1)                     # every round's log-probs padded as its tokens
    logp = torch.cat([F.pad(lp, (0, Tn - lp.size(1))) for _, lp, _ in kept])
    if hidden is not None:
        hidden = torch.cat([F.pad(h, (0, 0, 0, Tn - h.size(1))) for *_, h in kept])[:rows]
    return task.Rollout(*(x[:rows] for x in batch)), logp[:rows], hidden, rounds


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("grpo", args, batch_flag="prompts_per_step")
    policy, tok = run.load_policy(args.init)            # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy, bf16=True)   # ... frozen as the reference (bf16 on GPU)
    ref_weights = run.parked(ref, policy)               # ... in host memory outside step 2 (GPU)
    run.check_lengths(policy, tok, args.max_new_tokens)
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    settings, hint = loss_settings(args)
    run.print(f"GRPO: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {args.steps} "
              f"steps of {P} prompts x {G} samples, beta {args.beta} ({args.kl_estimator}), "
              f"mu {args.mu}, {args.ratio_level} ratio, {args.loss_type} "
              f"loss{', dynamic sampling' if args.dynamic_sampling else ''}"
              f"{', MaxRL advantages' if args.maxrl else ''}")
    if not args.resume:                                 # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: G completions per prompt, scored by the verifier (--dynamic_sampling inside)
        batch, sampler_logp, sampler_hidden, rounds = rollout(run, policy, tok, args)
        # (B, Tp), (B, Tn), (B,); B = P*G
        prompt, prompt_mask, tokens, mask, truncated, rewards, _ = batch
        if args.overlong_buffer > 0:                                    # DAPO's overlong punishment
            rewards = rewards + overlong_penalty(mask.sum(1), args.max_new_tokens,
                                                 args.overlong_buffer)
        run.samples += rounds * P * G

        # 2. score without gradient (sampler.score): pi_ref of every token, and at mu > 1 pi_old,
        #    through the function step 4 calls (on-policy, the same bits). At mu = 1 pi_old is step
        #    4's own forward, detached (scored.own), one forward fewer. On a logged step the exact
        #    KL, the entropy and the sampler's KL to the trainer. --batch_invariant: pi_old is the
        #    sampler's
        n_seqs, n_tokens = run.all_sum(len(mask)), run.all_sum(mask.sum())  # the step's, all ranks
        with ref_weights, run.autocast:
            scored = score(policy, ref, prompt, prompt_mask, tokens, mask, sampler_logp, temp,
                           run.micro_batches(len(mask)), run.logging(), args.batch_invariant,
                           n_kl=n_tokens, sampler_hidden=sampler_hidden, policy_pass=args.mu > 1)

        # 3. advantages (B,): the group is the baseline (--maxrl: and the scale)
        if args.maxrl:
            advantages = maxrl_advantages(rewards, G)
        else:
            advantages = grpo_advantages(rewards, G, scale_by_std=not args.no_std_scaling,
                                         std=args.std)

        # 4. mu passes of the loss, each over the --grad_accum micro-batches, normalised by the
        #    whole step's counts: the parts add up to one batch's loss. At mu = 1 its value is about
        #    beta * KL (the advantages have mean 0 in every group): watch reward_mean and
        #    eval_accuracy, not the loss.
        for epoch in range(args.mu):
            loss, stats = 0.0, {}
            for rows in run.micro_batches(len(mask), train_policy):
                with run.autocast:               # (b, Tn) log pi_theta, (b, T, C) its states
                    logp, h = completion_logprobs(train_policy, prompt[rows], prompt_mask[rows],
                                                  tokens[rows], mask[rows], temp,
                                                  return_hidden=True)
                old_logp = scored.own(rows, logp) if args.mu == 1 else scored.old_logp[rows]
                part, part_stats = grpo_loss(logp, old_logp, scored.ref_logp[rows],
                                             advantages[rows], mask[rows], settings, n_seqs,
                                             n_tokens)
                run.check_finite(part, hint)
                part.backward()
                if args.mu == 1:                 # logged: the KL, entropy, sampler gap
                    scored.measure(rows, logp, h)  # (after the backward: apart from its graph)
                loss = loss + part.detach()
                stats = {k: stats.get(k, 0.0) + v for k, v in part_stats.items()}
            grad_norm = run.clip_grad_norm(train_policy, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)     # the gradients freed until the next backward
        run.step += 1
        run.tokens += int(n_tokens)

        # 5. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            groups, kept = rewards.view(-1, G), run.all_sum(len(rewards)).item() // G
            stats = {k.replace("kl_est", f"kl_{args.kl_estimator}"): run.all_sum(v).item()
                     for k, v in stats.items()}
            metrics = {"loss": run.all_sum(loss).item(), "reward_mean": run.mean(rewards),
                       "reward_std": run.std(rewards),
                       "zero_var_groups": run.mean((groups == groups[:, :1]).all(1).float()),
                       "reward_groups": run.mean((groups != 0).any(1).float()),  # any reward
                       "kl_exact": run.all_sum(scored.kl_exact).item(),
                       "entropy": run.all_sum(scored.entropy).item(),
                       **stats,
                       "completion_len": run.mean(mask.sum(1)),
                       "truncated": run.mean(truncated.float()),
                       "grad_norm": grad_norm.item(),
                       "sampler_logp_diff": run.max(scored.sampler_gap),
                       "sampler_kl": run.all_sum(scored.sampler_kl).item(),
                       "groups_sampled": rounds * P,
                       "groups_kept": kept}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | "
                             f"zero-var {metrics['zero_var_groups']:.2f} | "
                             f"kl {metrics['kl_exact']:.4f} | ent {metrics['entropy']:.3f} | "
                             f"len {metrics['completion_len']:.1f} | "
                             f"gnorm {metrics['grad_norm']:.3f} | "
                             f"clip {metrics['clip_frac']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
