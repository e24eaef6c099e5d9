"""
TRPO: Trust Region Policy Optimization, with the verifier as the reward.

Each update moves the policy as far as it can in the direction that raises the reward, but no
further than a fixed distance from the policy that sampled the batch: the mean KL(pi_old || pi_new)
over the batch's token positions, at most delta (--max_kl). No learning rate and no optimiser: the
step length comes from delta. The direction is the natural gradient F^-1 g, the policy gradient
corrected by the curvature F of that KL (the Fisher matrix), found by conjugate gradient without
forming F; a backtracking line search then checks the true KL and gain. PPO replaced all of this by
a clipped ratio and Adam: this file shows what it replaced (experiments/trpo_compare.py, what it
costs).

Schulman et al. 2015, "Trust Region Policy Optimization", arXiv 1502.05477 (section 6; appendix
C, the step):
    L(theta) = 1/N sum_it ratio_it(theta) A_i,   ratio_it = pi_theta(y_it|s_it) / pi_old(y_it|s_it)
    KLbar(theta) = 1/N sum_it KL(pi_old(.|s_it) || pi_theta(.|s_it))     (exact over the vocabulary)
    maximise L subject to KLbar <= delta: g = grad L(theta_old), F = Hessian of KLbar at theta_old,
    x = (F + damping I)^-1 g (conjugate gradient),  s = sqrt(2 delta / x^T (F + damping I) x) x,
    theta = theta_old + 0.5^j s, the first j with KLbar <= delta and L(theta) > L(theta_old)
The rollout, reward and baseline are rloo.py's: R_i = r_i - beta sum_t KL_it to the reference, A_i
leave-one-out.

Deviations and choices the paper leaves open:
- Advantages from the leave-one-out baseline over k samples per prompt, not a value function.
- The constraint: the mean KL over sampled positions (the paper's practical algorithm), each exact.
- Damping: F + damping I in place of the singular F (as common TRPO code; the paper does not).
- The line search accepts any gain at all within delta, halving at most --backtracks times.
- Under torchrun the gradient, every Fisher-vector product and the line search's KL and gain are
  sums of the ranks' shares, so every rank takes the same step.
- Small scale: a 0.44M-parameter policy; the verifier's reward, not a learned one. Every step has
  the same length (delta), however noisy its direction: 20 steps of 64 prompts at delta 0.01 hold
  their gains where 40 of 32 swing (experiments/README.md, TRPO).

Shapes: P prompts, G completions each, B = P*G rows, Tn completion tokens, V vocabulary, D params.
Run (from out/sft.pt, built first if missing; about 9 minutes on one CPU core):
    python trpo.py
    python trpo.py --max_kl 0.05      # a larger trust region
    python trpo.py --resume           # continue from out/trpo.pt up to --steps
Metrics: out/trpo/metrics.jsonl (docs/metrics.md says what each means); checkpoint out/trpo.pt.
"""
import time
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parameters_to_vector

import task
from kernels import entropy, kl, kl_penalty, logprobs
from lora import trainable
from model import completion_logits
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser


# -----------------------------------------------------------------------------
# The advantages (rloo.py's): the leave-one-out baseline

def rloo_advantages(rewards, k):
    """rewards (P*k,) flat, k consecutive samples per prompt -> (P*k,): A_i = R_i - 1/(k-1) sum_{j
    != i} R_j."""
    if k < 2:
        raise ValueError(f"k = {k}; RLOO needs k >= 2 samples per prompt (a sample's baseline "
                         f"is the others' mean)")
    if rewards.dim() != 1 or rewards.numel() % k:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups "
                         f"of k = {k}; need a flat tensor whose length is a multiple of k")
    R = rewards.view(-1, k)                                            # (P, k)
    baseline = (R.sum(dim=1, keepdim=True) - R) / (k - 1)              # 1/(k-1) sum_{j != i} R_j
    return (R - baseline).view(-1)                                     # (P*k,)


# -----------------------------------------------------------------------------
# The trust region: surrogate, KL, Fisher-vector products, conjugate gradient, the step

def surrogate(logp, old_logp, advantages, mask, num_tokens=None):
    """L = 1/N sum_it ratio_it A_i over completion tokens (maximised: a gain, not a loss); logp,
    old_logp, mask (B, T), advantages (B,); num_tokens: N when this batch is a part of the step's.
    At theta_old its gradient is the policy gradient 1/N sum_it A_i grad log pi_theta(y_it)."""
    ratio = torch.exp(torch.where(mask > 0, logp - old_logp, 0.0))    # (B, T) pi_theta / pi_old
    N = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return torch.where(mask > 0, ratio * advantages[:, None], 0.0).sum() / N


def mean_kl(old_logits, logits, mask, temperature=1.0, num_tokens=None):
    """KLbar = 1/N sum_it KL(pi_old(. | s_it) || pi_theta(. | s_it)), exact over the vocabulary and
    twice differentiable in `logits`, so that its Hessian at theta_old is F (kernels.kl,
    once_differentiable and refusing a second argument with grad, cannot; it measures the constraint
    instead, and the tests check the two agree). old_logits, logits (B, T, V), old_logits without
    gradient; mask (B, T). Scalar."""
    real = mask[..., None] > 0                              # (B, T, 1): padding rows become uniform
    # float32 at least (float64 stays float64)
    up = lambda x: x.to(torch.promote_types(x.dtype, torch.float32))
    old_logp = torch.log_softmax(torch.where(real, up(old_logits.detach()), 0.0) / temperature,
                                 dim=-1)                                  # log pi_old
    new_logp = torch.log_softmax(torch.where(real, up(logits), 0.0) / temperature,
                                 dim=-1)                                  # (B, T, V) log pi_theta
    # (B, T) sum_v p_old (log p_old - log p_theta)
    kl_t = (old_logp.exp() * (old_logp - new_logp)).sum(-1)
    N = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return torch.where(mask > 0, kl_t, 0.0).sum() / N


def flat_grad(y, params, **kwargs):
    """d y / d params as one flat (D,) vector (zeros for a parameter y does not depend on)."""
    grads = torch.autograd.grad(y, params, allow_unused=True, **kwargs)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for g, p in zip(grads, params)])


def fisher_vector_product(kl_grad, params, v, damping=0.0):
    """(F + damping I) v, F the Hessian of KLbar at theta_old, without forming F: kl_grad is grad
    KLbar (D,), built with create_graph=True at theta_old; F v = grad (kl_grad . v), a second
    back-propagation."""
    return flat_grad(kl_grad @ v, params, retain_graph=True) + damping * v        # (D,)


def conjugate_gradient(fvp, b, iters=10, residual_tol=1e-10):
    """x approximately solving F x = b for a symmetric positive definite F known only through fvp: v
    -> F v (flat tensors). Hestenes-Stiefel conjugate gradient from x = 0: at most `iters` products
    F v; stops early once r.r < residual_tol * b.b (r = b - F x; relative, so that x scales with b
    whatever its size) or a direction has no positive curvature."""
    x = torch.zeros_like(b)
    r = b.clone()                                           # r = b - F x, with x = 0
    p = r.clone()                                           # the search direction
    rr = r @ r
    stop = residual_tol * rr                                # |r|^2 <= tol |b|^2
    for _ in range(iters):
        if rr <= stop:
            break
        Fp = fvp(p)
        pFp = p @ Fp
        if pFp <= 0:                                        # F not positive definite along p: stop
            break
        alpha = rr / pFp                                    # minimises the quadratic along p
        x = x + alpha * p
        r = r - alpha * Fp
        rr_new = r @ r
        p = r + (rr_new / rr) * p                           # F-conjugate to the previous directions
        rr = rr_new
    return x


def natural_gradient_step(g, fvp, max_kl, cg_iters=10, stats=None, residual_tol=1e-10):
    """TRPO's full step (appendix C): x = F^-1 g by conjugate_gradient,
    s = sqrt(2 max_kl / x^T F x) x, whose quadratic KL model 1/2 s^T F s is max_kl. Returns (s (D,),
    g . s, the first-order gain); a zero gradient gives a zero step. stats: a dict to fill with
    "cg_residual" (|g - F x| / |g|) and "xFx"."""
    # (D,) approximately F^-1 g
    x = conjugate_gradient(fvp, g, iters=cg_iters, residual_tol=residual_tol)
    Fx = fvp(x)
    xFx = x @ Fx
    if stats is not None:
        stats["cg_residual"] = ((g - Fx).norm() / g.norm().clamp(min=1e-30)).item()
        stats["xFx"] = xFx.item()
    if xFx <= 0:                                        # g = 0 (every advantage 0): nothing to gain
        return torch.zeros_like(g), 0.0
    full_step = torch.sqrt(2 * max_kl / xFx) * x        # s = sqrt(2 delta / x^T F x) x
    return full_step, (g @ full_step).item()            # g . s = sqrt(2 delta g^T F^-1 g)


class LineSearch(NamedTuple):
    frac: float        # the accepted fraction of the full step; 0.0: no step
    kl: float          # the measured KL of the accepted step (0.0 for no step)
    gain: float        # the measured gain of the surrogate (0.0 for no step)
    halvings: int      # halvings tried
    kl_full: float     # the measured KL of the full step: how far the quadratic model was off
    nan_trials: int    # trials whose KL or gain was NaN (all of them: the step was not a number)


def backtracking_line_search(try_step, max_kl, backtracks):
    """TRPO's line search (appendix C): try the fractions 1, 1/2, ..., 1/2^backtracks of the full
    step and take the first whose measured KL is at most max_kl and whose measured gain is positive.
    try_step(frac) -> (kl, gain) at theta_old + frac * s, measured exactly (not the quadratic
    model). Returns a LineSearch."""
    kl_full, nan_trials = None, 0
    for j in range(backtracks + 1):
        frac = 0.5 ** j
        kl_new, gain = try_step(frac)
        kl_full = kl_new if j == 0 else kl_full
        nan_trials += kl_new != kl_new or gain != gain         # NaN compares unequal to itself
        if kl_new <= max_kl and gain > 0:                      # inside the trust region, and better
            return LineSearch(frac, kl_new, gain, j, kl_full, nan_trials)
    return LineSearch(0.0, 0.0, 0.0, backtracks, kl_full, nan_trials)


def set_flat_params(params, theta):
    """Write the flat vector theta (D,) into the parameters, in parameters_to_vector's order: the
    update by hand."""
    with torch.no_grad():
        for p, chunk in zip(params, torch.split(theta, [p.numel() for p in params])):
            p.copy_(chunk.view_as(p))


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--max_kl", type=Float(gt=0), default=0.01,
                   help="delta: the trust region, mean KL(pi_old || pi_new) per token")
    g.add_argument("--damping", type=Float(ge=0), default=0.1,
                   help="conjugate gradient solves (F + damping I) x = g: every curvature is "
                        "raised by damping")
    g.add_argument("--cg_iters", type=Int(ge=1), default=10,
                   help="conjugate gradient iterations (F v products)")
    g.add_argument("--backtracks", type=Int(ge=0), default=10,
                   help="most halvings of the step in the line search")
    g.add_argument("--group_size", type=Int(ge=2), default=8,
                   help="k (G in the code): completions sampled per prompt")
    g.add_argument("--beta", type=Float(ge=0), default=0.04,
                   help="weight of the KL-to-reference penalty in the reward")
    g.add_argument("--kl_estimator", default="k1", choices=["k1", "k2", "k3"],
                   help="per-token KL estimate (reward)")
    g.add_argument("--format_weight", type=Float(ge=0), default=0.0,
                   help="reward bonus for a well-formed completion")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=20,
                   help="TRPO updates (one batch of rollouts each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=64,
                   help="P: prompts drawn per step (twice GRPO's: the step's length is fixed, "
                        "its noise is not)")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g = add_run_flags(p, "trpo", log_every=5, eval_every=5)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    return p.parse_args(argv)


def logits_of(model, part):
    """(b, Tn, V) completion logits of a micro-batch `part` (a task.Rollout's rows) under
    `model`."""
    return completion_logits(model, part.prompt, part.prompt_mask, part.tokens, part.mask)


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("trpo", args, batch_flag="prompts_per_step")
    policy, tok = run.load_policy(args.init)        # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy)          # ... which stays frozen as the reference
    run.check_lengths(policy, tok, args.max_new_tokens)
    ckpt = run.resume(policy)                       # no optimiser: the update is written out below
    violations = ckpt.get("violations", 0) if ckpt else 0   # accepted steps with KL > delta, so far
    params = trainable(policy)                    # theta (--lora_rank: the adapters), in this order
    P, G, temp, delta = args.prompts_per_step, args.group_size, args.temperature, args.max_kl
    run.print(f"TRPO: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {args.steps} "
              f"steps of {P} prompts x {G} samples, max_kl {delta}, damping {args.damping}, "
              f"{args.cg_iters} CG iterations, beta {args.beta}")
    if not args.resume:                           # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: G = k completions per prompt (sampling temperature), scored by the verifier
        t_start = time.perf_counter()
        # this rank's share
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            batch, sampler_logp, sampler_hidden = task.rollout(     # (B, Tn), (B, Tn, C) logged
                policy, tok, prompts, G, temp, args.max_new_tokens, args.format_weight, run.gen,
                return_logprobs=True, return_hidden=run.logging())
        mask, rewards = batch.mask, batch.rewards                                  # (B, Tn), (B,)
        run.samples += P * G
        t_rollout = time.perf_counter() - t_start
        parts = [(rows, task.Rollout(*(x[rows] for x in batch)))
                 for rows in run.micro_batches(len(mask))]

        # 2. score without gradient: pi_old's logits (kept: the KL is measured against them),
        #    log-probs of old and ref
        # (B, Tn) each
        old_logits, old_logp, ref_logp = [], torch.zeros_like(mask), torch.zeros_like(mask)
        n_tokens = run.all_sum(mask.sum())                                      # N, over every rank
        kl_ref = ent = sampler_kl = 0.0
        for rows, b in parts:
            with torch.no_grad(), run.autocast:
                logits, ref_logits = logits_of(policy, b), logits_of(ref, b)      # (b, Tn, V)
                if sampler_hidden is not None:     # KL(sampler || trainer) over the support
                    sampler_kl += torch.where(b.mask > 0, kl(policy.logits(sampler_hidden[rows]),
                                                             logits, temp), 0.0).sum() / n_tokens
            old_logits.append(logits)
            old_logp[rows], ref_logp[rows] = (logprobs(logits, b.tokens, temp),
                                              logprobs(ref_logits, b.tokens, temp))
            # KL(pi || pi_ref)
            kl_ref += torch.where(b.mask > 0, kl(logits, ref_logits, temp), 0.0).sum() / n_tokens
            ent += torch.where(b.mask > 0, entropy(logits, temp), 0.0).sum() / n_tokens

        # how far the trainer's log-probs are from those the sampler drew with (same weights)
        sampler_diff = run.max(torch.where(mask > 0, (sampler_logp - old_logp).abs(), 0.0))

        # 3. advantages: KL to the reference in the reward, the other k - 1 samples are the baseline
        kl_t = kl_penalty(old_logp, ref_logp, args.kl_estimator)                     # (B, Tn)
        # R_i = r_i - beta * sum_t KL_it
        scores = rewards - args.beta * torch.where(mask > 0, kl_t, 0.0).sum(1)
        advantages = rloo_advantages(scores, G)                                      # (B,)

        # 4. the policy gradient g = grad L(theta_old), one flat vector, summed over micro-batches
        #    and ranks
        g = 0.0
        for rows, b in parts:
            with run.autocast:
                logp = logprobs(logits_of(policy, b), b.tokens, temp)         # (b, Tn) log pi_theta
            part = surrogate(logp, old_logp[rows], advantages[rows], b.mask, num_tokens=n_tokens)
            run.check_finite(part, f"lower --max_kl (now {delta})")
            g = g + flat_grad(part, params)
        g = run.all_sum(g)                                                            # (D,)

        # 5. the natural gradient: x = (F + damping I)^-1 g by conjugate gradient, F v by double
        #    back-propagation of KLbar at theta_old (F is singular here, far more parameters than
        #    positions x vocabulary: the damping raises every curvature by `damping`, which bounds
        #    the components along directions the KL barely sees); attention runs on the math
        #    backend, the fused kernels have no double backward
        t_cg = time.perf_counter()
        kl_grads = []
        with sdpa_kernel(SDPBackend.MATH), run.autocast:
            for (rows, b), old in zip(parts, old_logits):
                kl_part = mean_kl(old, logits_of(policy, b), b.mask, temp, num_tokens=n_tokens)
                # grad KLbar: 0 here, graph kept
                kl_grads.append(flat_grad(kl_part, params, create_graph=True))
        fvp = lambda v: run.all_sum(sum(fisher_vector_product(kg, params, v)
                                        for kg in kl_grads)) + args.damping * v
        stats = {}
        full_step, expected = natural_gradient_step(g, fvp, delta, args.cg_iters, stats)
        del kl_grads, fvp
        t_cg = time.perf_counter() - t_cg

        # 6. line search: theta_old + 0.5^j s for j = 0..backtracks; the first with KLbar <= delta
        #    and a gain is taken
        t_ls = time.perf_counter()
        theta_old = parameters_to_vector(params).detach().clone()                    # (D,)
        # L = mean A
        L_old = run.all_sum(torch.where(mask > 0, advantages[:, None], 0.0).sum() / n_tokens).item()

        def try_step(frac):              # exact KLbar and gain of L at theta = theta_old + frac * s
            set_flat_params(params, theta_old + frac * full_step)
            kl_sum = L_new = 0.0
            for (rows, b), old in zip(parts, old_logits):
                with torch.no_grad(), run.autocast:
                    logits = logits_of(policy, b)                        # (b, Tn, V) under pi_theta
                # KL(pi_old||pi)
                kl_sum += torch.where(b.mask > 0, kl(old, logits, temp), 0.0).sum() / n_tokens
                L_new += surrogate(logprobs(logits, b.tokens, temp), old_logp[rows],
                                   advantages[rows], b.mask, n_tokens)
            return run.all_sum(kl_sum).item(), run.all_sum(L_new).item() - L_old
        finite = bool(torch.isfinite(full_step).all())
        if finite:
            ls = backtracking_line_search(try_step, delta, args.backtracks)
        else:                             # inf or NaN (reachable with --damping 0): refused untried
            ls = LineSearch(0.0, 0.0, 0.0, 0, float("nan"), 0)
        # the update
        set_flat_params(params, theta_old + ls.frac * full_step if ls.frac > 0 else theta_old)
        violations += ls.kl > delta                                              # 0 by construction
        t_ls = time.perf_counter() - t_ls
        run.step += 1
        run.tokens += int(n_tokens)

        # 7. log, evaluate, checkpoint (every number over all ranks)
        if run.log_due():
            groups, t_step, frac = rewards.view(-1, G), time.perf_counter() - t_start, ls.frac
            why = "" if frac else (": no step, the step was not finite" if not finite else
                                   ": no step, every trial was NaN"
                                   if ls.nan_trials == args.backtracks + 1 else ": no step")
            metrics = {"reward_mean": run.mean(rewards), "reward_std": run.std(rewards),
                       "zero_var_groups": run.mean((groups == groups[:, :1]).all(1).float()),
                       "kl_step": ls.kl, "kl_full_step": ls.kl_full, "violations": violations,
                       "accepted": float(frac > 0), "backtracks": ls.halvings,
                       "nan_trials": ls.nan_trials,
                       "finite_step": float(finite), "improvement": ls.gain,
                       "expected_improvement": frac * expected,                       # g . (frac s)
                       "improve_ratio": ls.gain / (frac * expected) if frac * expected > 0 else 0.0,
                       "cg_residual": stats["cg_residual"], "grad_norm": g.norm().item(),
                       "sampler_logp_diff": sampler_diff,
                       "sampler_kl": run.all_sum(sampler_kl).item(),
                       "step_norm": frac * full_step.norm().item(),
                       "kl_exact": run.all_sum(kl_ref).item(),
                       f"kl_{args.kl_estimator}": run.mean(kl_t, mask),
                       "entropy": run.all_sum(ent).item(), "completion_len": run.mean(mask.sum(1)),
                       "truncated": run.mean(batch.truncated.float()), "t_rollout": t_rollout,
                       "t_cg": t_cg,
                       "t_linesearch": t_ls, "t_rest": t_step - t_cg - t_ls - t_rollout,
                       "t_step": t_step}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | kl step {ls.kl:.4f} "
                             f"/ {delta} (full {ls.kl_full:.4f}, {ls.halvings} halvings{why}) | "
                             f"gain {ls.gain:.4f} / {frac * expected:.4f} | "
                             f"cg res {stats['cg_residual']:.2f} | s: cg {t_cg:.1f} "
                             f"ls {t_ls:.1f} other {t_step - t_cg - t_ls:.1f}", tokens=True)
        if run.eval_due():
            run.save(policy, violations=violations)
    run.finish(policy, tok, violations=violations)


if __name__ == "__main__":
    main(parse_args())
