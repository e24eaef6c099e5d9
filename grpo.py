"""
GRPO: Group Relative Policy Optimization, with the verifier as the reward.

Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv 2402.03300 (the algorithm); DeepSeek-AI 2025, "DeepSeek-R1", arXiv 2501.12948
(its use with rule-based, verifiable rewards). No value function: each prompt gets a group of G
sampled completions, and a completion's advantage is its reward standardised within its group,

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)          (population std, divide by G)

given to every token of completion i. The objective (DeepSeekMath eq. 3, written as a loss):

    L = 1/G sum_i 1/|o_i| sum_t [ -min(ratio_it * A_i, clip(ratio_it, 1-eps, 1+eps) * A_i) + beta * KL_it ]
    ratio_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    KL_it    = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1       (the "k3" estimator, DeepSeekMath eq. 4)

KL estimators (Schulman 2020, "Approximating KL Divergence"), all per sampled token y ~ pi_theta,
with log r = log pi_ref(y) - log pi_theta(y):
    k1 = -log r                 unbiased for KL(pi_theta || pi_ref); negative on some tokens
    k2 = (log r)^2 / 2          biased for KL(pi_theta || pi_ref), low variance, >= 0
    k3 = (r - 1) - log r        unbiased for KL(pi_theta || pi_ref), low variance, >= 0 (the paper's)
As a *loss term* (differentiated through log pi_theta, not through the sampling) they behave
differently: the expected gradient of k1 is 0 (it only penalises through a reward), k2's is the
gradient of KL(pi_theta || pi_ref), and k3's is the gradient of KL(pi_ref || pi_theta), the other
direction, which agrees with it near pi_ref. The exact per-token KL(pi_theta || pi_ref) over the
whole vocabulary (kernels.kl) is logged beside the estimate the loss uses.

Deviations from the papers, and choices the papers leave open:
- Loss aggregation: default as DeepSeekMath (token mean within each completion, then the mean over
  completions). `--loss_agg token` is DAPO's token-level mean (Yu et al. 2025, arXiv 2503.14476);
  `--loss_agg dr_grpo` divides the token sum by a constant (completions x max_new_tokens), as in
  Dr. GRPO (Liu et al. 2025, arXiv 2503.20783), which also drops the std: `--no_std_scaling`.
- `--eps_high` (DAPO's clip-higher) widens the upper clip bound; default equal to --clip_eps.
- mu optimisation passes per batch of rollouts, the old log-probs kept from sampling time;
  default 1 as in R1, where the ratio is identically 1 but its gradient (A * grad log pi) flows.
  Each pass uses the whole batch (no minibatches).
- A group whose rewards are all equal gets advantage exactly 0 (never 0/0).
- The reward is the task's verifier (1 correct, 0 otherwise, optional --format_weight); the notes'
  "GRPO explores with beam search and smooths with GAE" is wrong: it samples at a temperature and
  has no value function, so no GAE.
- Small scale: a 0.8M-parameter policy on arithmetic, AdamW at a constant learning rate.

Run:
    python grpo.py                       # from out/sft.pt (trained first if missing); about 1 min on 2 idle CPU cores
    python grpo.py --resume              # continue from out/grpo.pt up to --steps
    python grpo.py --loss_agg token --eps_high 0.28 --beta 0   # DAPO-style variant
Metrics: one JSON object per log step in out/grpo/metrics.jsonl; checkpoint out/grpo.pt.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import torch

import task
from kernels import entropy, kl, logprobs
from model import CheckpointError, completion_logits, Tokenizer, load_checkpoint, pick_device, save_checkpoint

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_INIT = os.path.join("out", "sft.pt")


# -----------------------------------------------------------------------------
# The algorithm: group-relative advantages and the clipped surrogate with a KL penalty

def grpo_advantages(rewards, group_size, eps=1e-6, scale_by_std=True):
    """rewards (N*G,) flat, G = group_size consecutive samples per prompt -> advantages (N*G,).
    A_i = (r_i - mean_g) / (std_g + eps), std the population std (divide by G). A group whose
    rewards are all equal gets exactly 0. scale_by_std=False gives Dr. GRPO's A_i = r_i - mean_g."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                         f"group_size = {group_size}; need a flat tensor whose length is a multiple of it (>= 1)")
    r = rewards.view(-1, group_size)                                   # (N, G)
    mean = r.mean(dim=1, keepdim=True)                                 # (N, 1)
    advantages = r - mean                                              # r_i - mean_g
    if scale_by_std:
        std = r.std(dim=1, keepdim=True, unbiased=False)               # population std: sqrt(1/G sum (r - mean)^2)
        advantages = advantages / (std + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)               # (N, 1) no signal in this group
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)  # (N*G,)


def kl_penalty(logp, ref_logp, estimator="k3"):
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled from pi_theta (see the docstring
    above for what each estimator's gradient does). logp, ref_logp (B, T) -> (B, T)."""
    log_r = ref_logp - logp                                            # log r = log pi_ref - log pi_theta
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1                            # (r - 1) - log r
    raise ValueError(f"kl estimator {estimator!r} is unknown; allowed: 'k1', 'k2', 'k3'")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps=0.2, beta=0.04, eps_high=None,
              kl_estimator="k3", loss_agg="seq", max_tokens=None):
    """The GRPO loss (DeepSeekMath eq. 3, negated) and its metrics.

    logp (B, T) log pi_theta of the sampled tokens (with grad); old_logp (B, T) at sampling time;
    ref_logp (B, T) under the frozen reference; advantages (B,) one per completion; mask (B, T) 1.0 on
    completion tokens. Per token: -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + eps_high) * A) + beta * KL.
    loss_agg: "seq" (DeepSeekMath: token mean per completion, then mean over completions),
    "token" (DAPO: mean over all tokens of the batch), "dr_grpo" (sum over tokens / (B * max_tokens),
    max_tokens defaulting to T). Returns (loss scalar, dict of float metrics)."""
    eps_high = clip_eps if eps_high is None else eps_high
    A = advantages[:, None]                                            # (B, 1) the same advantage for every token
    log_ratio = logp - old_logp                                        # (B, T)
    ratio = torch.exp(log_ratio)                                       # pi_theta / pi_old
    surr1 = ratio * A
    surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high) * A
    kl_t = kl_penalty(logp, ref_logp, kl_estimator)                    # (B, T)
    per_token = -torch.min(surr1, surr2) + beta * kl_t                 # (B, T)
    if loss_agg == "seq":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()   # 1/G sum_i 1/|o_i| sum_t
    elif loss_agg == "token":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)               # 1/sum_i |o_i| sum_i sum_t
    elif loss_agg == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.size(0) * (max_tokens or mask.size(1)))
    else:
        raise ValueError(f"loss_agg {loss_agg!r} is unknown; allowed: 'seq', 'token', 'dr_grpo'")
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped = ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - clip_eps))  # the clip zeroes the gradient
        metrics = {"clip_frac": ((clipped.float() * mask).sum() / n).item(),
                   "approx_kl": (((ratio - 1) - log_ratio) * mask).sum().item() / n.item(),  # k3 of KL(old || new)
                   "kl_est": ((kl_t * mask).sum() / n).item()}
    return loss, metrics


# -----------------------------------------------------------------------------
# Rollout: what the model says after each prompt, and the logits that score it

def masked_mean(x, mask):
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


# -----------------------------------------------------------------------------
# Hyperparameters
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="RL steps (one batch of rollouts each)")
    parser.add_argument("--prompts_per_step", type=int, default=32, help="prompts drawn per step")
    parser.add_argument("--group_size", type=int, default=8, help="G: completions sampled per prompt (>= 2)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; log-probs use the same")
    parser.add_argument("--max_new_tokens", type=int, default=task.MAX_NEW_TOKENS, help="longest completion")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (constant)")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--clip_eps", type=float, default=0.2, help="PPO clip range: ratio kept in [1-clip_eps, 1+eps_high]")
    parser.add_argument("--eps_high", type=float, default=None, help="upper clip (DAPO clip-higher); default --clip_eps")
    parser.add_argument("--beta", type=float, default=0.04, help="weight of the KL-to-reference penalty in the loss")
    parser.add_argument("--kl_estimator", default="k3", choices=["k1", "k2", "k3"], help="per-token KL estimate in the loss")
    parser.add_argument("--mu", type=int, default=1, help="optimisation passes over each batch of rollouts")
    parser.add_argument("--loss_agg", default="seq", choices=["seq", "token", "dr_grpo"], help="how token losses are averaged")
    parser.add_argument("--no_std_scaling", action="store_true", help="advantages r - mean without / std (Dr. GRPO)")
    parser.add_argument("--format_weight", type=float, default=0.0, help="reward bonus for a well-formed completion")
    parser.add_argument("--precedence_share", type=float, default=0.5, help="share of training prompts of the form a+b*c / a-b*c")
    parser.add_argument("--init", default=DEFAULT_INIT, help="SFT checkpoint: the starting policy and the frozen reference")
    parser.add_argument("--log_every", type=int, default=5, help="print and log metrics every this many steps")
    parser.add_argument("--eval_every", type=int, default=10, help="evaluate on the held-out set every this many steps")
    parser.add_argument("--eval_n", type=int, default=512, help="held-out prompts to evaluate on (at most 512)")
    parser.add_argument("--out", default="out", help="folder for grpo.pt and grpo/metrics.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seeds python, numpy and torch")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/grpo.pt")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts_per_step", "max_new_tokens", "mu", "log_every", "eval_every", "eval_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be at least 1")
    if args.group_size < 2:
        parser.error(f"--group_size = {args.group_size}; it must be at least 2 (a group of one has no relative advantage)")
    if not args.temperature > 0:
        parser.error(f"--temperature = {args.temperature}; it must be > 0 (sampling, not greedy)")
    for name in ("lr", "clip_eps", "grad_clip"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} = {getattr(args, name)}; it must be > 0")
    if args.eps_high is not None and not args.eps_high > 0:
        parser.error(f"--eps_high = {args.eps_high}; it must be > 0")
    if args.beta < 0 or args.weight_decay < 0:
        parser.error(f"--beta = {args.beta}, --weight_decay = {args.weight_decay}; both must be >= 0")
    if not 0.0 <= args.precedence_share <= 1.0:
        parser.error(f"--precedence_share = {args.precedence_share}; allowed: 0 <= precedence_share <= 1")
    return args


def main(args):
    ckpt_path = os.path.join(args.out, "grpo.pt")
    metrics_path = os.path.join(args.out, "grpo", "metrics.jsonl")

    # -------------------------------------------------------------------------
    # Setup
    device = args.device or pick_device()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")  # bf16 on GPU, fp32 elsewhere
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    rng = random.Random(args.seed)                                    # draws the prompts
    gen = torch.Generator(device=device).manual_seed(args.seed)      # draws the completions
    tok = Tokenizer()
    eval_set = task.eval_prompts()[:args.eval_n]
    if args.init == DEFAULT_INIT and not os.path.exists(args.init):
        print(f"{args.init} not found: training the SFT policy first (python sft.py, about 4 minutes on 2 CPU cores)")
        subprocess.run([sys.executable, "sft.py", "--out", os.path.abspath(os.path.dirname(args.init))], cwd=ROOT, check=True)
    ref, _ = load_checkpoint(args.init, device, kind="gpt", tokenizer=tok)    # the frozen reference policy
    model, _ = load_checkpoint(args.init, device, kind="gpt", tokenizer=tok)  # the policy starts as the reference
    ref.requires_grad_(False)
    step, before, ckpt = 0, None, None
    if args.resume:
        model, ckpt = load_checkpoint(ckpt_path, device, kind="gpt", tokenizer=tok)
        step, before = ckpt["step"], ckpt["eval_before"]
        rng.setstate((ckpt["rng"][0], tuple(ckpt["rng"][1]), ckpt["rng"][2]))
        gen.set_state(ckpt["generator"].cpu())
        print(f"resuming from {ckpt_path} at step {step}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log
    G = args.group_size
    print(f"GRPO: {model.num_params() / 1e6:.2f}M parameters on {device}, {args.steps} steps of "
          f"{args.prompts_per_step} prompts x {G} samples, beta {args.beta} ({args.kl_estimator}), mu {args.mu}")


    def log(metrics):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


    def run_eval():
        with autocast:
            return task.evaluate(model, tok, eval_set, num_samples=4, temperature=1.0, seed=args.seed)


    def eval_metrics(e):
        return {"eval_accuracy": e["greedy_accuracy"], "eval_pass_at_1": e["pass_at_1"],
                "eval_accuracy_precedence": e["greedy_accuracy_precedence"], "eval_accuracy_other": e["greedy_accuracy_other"]}


    # -------------------------------------------------------------------------
    # Training loop
    e, eval_step = None, -1
    if step == 0:
        e, eval_step = run_eval(), 0
        before = e
        print(f"step     0 | held-out greedy accuracy {e['greedy_accuracy']:.3f} pass@1 {e['pass_at_1']:.3f} (the SFT policy)")
        log({"step": 0, **eval_metrics(e)})
    t0, t_log, n_tokens = time.time(), time.time(), 0
    while step < args.steps:
        # 1. rollout: G completions per prompt at temperature T, scored by the verifier
        prompts = task.sample_prompts(rng, args.prompts_per_step, args.precedence_share)
        prompt, prompt_mask = tok.encode_batch(prompts, device)                          # (B, Tp)
        with autocast:
            tokens, mask, truncated = model.generate(prompt, prompt_mask, args.max_new_tokens, tok.eos_id, tok.pad_id,
                                                     num_samples=G, temperature=args.temperature, generator=gen)  # (B*G, Tn)
        completions = tok.decode_completions(tokens, mask)
        rewards = torch.tensor([task.reward(prompts[i // G], c, args.format_weight) for i, c in enumerate(completions)],
                               device=device)                                            # (B*G,)
        prompt, prompt_mask = prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)  # (B*G, Tp)
        with torch.no_grad(), autocast:
            ref_logits = completion_logits(ref, prompt, prompt_mask, tokens, mask)      # (B*G, Tn, V)
        ref_logp = logprobs(ref_logits, tokens, args.temperature)                        # (B*G, Tn) log pi_ref

        # 2. advantages: the group is the baseline
        advantages = grpo_advantages(rewards, G, scale_by_std=not args.no_std_scaling)  # (B*G,)

        # 3. mu passes of the clipped surrogate + KL penalty
        for epoch in range(args.mu):
            with autocast:
                logits = completion_logits(model, prompt, prompt_mask, tokens, mask)    # (B*G, Tn, V)
            logp = logprobs(logits, tokens, args.temperature)                            # (B*G, Tn) log pi_theta
            if epoch == 0:  # the policy has not moved yet: these are the sampling-time log-probs
                old_logp = logp.detach()
                kl_exact = masked_mean(kl(logits.detach(), ref_logits, args.temperature), mask)  # KL(pi_theta || pi_ref)
                ent = masked_mean(entropy(logits.detach(), args.temperature), mask)
            loss, stats = grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps=args.clip_eps, beta=args.beta,
                                    eps_high=args.eps_high, kl_estimator=args.kl_estimator, loss_agg=args.loss_agg,
                                    max_tokens=args.max_new_tokens)
            if not torch.isfinite(loss):
                raise RuntimeError(f"loss is {loss.item()} at step {step}; lower --lr (now {args.lr}) and rerun")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
        step += 1
        n_tokens += int(mask.sum())

        # 4. log, evaluate, checkpoint
        if step % args.log_every == 0 or step == args.steps:
            dt = time.time() - t_log
            groups = rewards.view(-1, G)
            metrics = {"step": step, "loss": loss.item(), "reward_mean": rewards.mean().item(),
                       "reward_std": rewards.std(unbiased=False).item(),
                       "zero_var_groups": (groups == groups[:, :1]).all(1).float().mean().item(),
                       "kl_exact": kl_exact, f"kl_{args.kl_estimator}": stats["kl_est"], "entropy": ent,
                       "response_len": mask.sum(1).mean().item(), "truncated": truncated.float().mean().item(),
                       "grad_norm": grad_norm.item(), "clip_frac": stats["clip_frac"], "approx_kl": stats["approx_kl"],
                       "tokens_per_sec": n_tokens / dt, "elapsed_s": time.time() - t0}
            t_log, n_tokens = time.time(), 0
            line = (f"step {step:5d} | reward {metrics['reward_mean']:.3f} | zero-var {metrics['zero_var_groups']:.2f} "
                    f"| kl {kl_exact:.4f} | ent {ent:.3f} | len {metrics['response_len']:.1f} | gnorm {metrics['grad_norm']:.3f} "
                    f"| clip {metrics['clip_frac']:.3f} | {metrics['tokens_per_sec']:,.0f} tok/s")
            if step % args.eval_every == 0 or step == args.steps:
                e, eval_step = run_eval(), step
                metrics.update(eval_metrics(e))
                line += f" | held-out greedy {e['greedy_accuracy']:.3f} pass@1 {e['pass_at_1']:.3f}"
                save_checkpoint(ckpt_path, model, tok.name, optimizer, step, args, rng=list(rng.getstate()),
                                generator=gen.get_state(), eval_before=before)
                t_log = time.time()  # evaluation time is not training throughput
            print(line)
            log(metrics)

    final = e if eval_step == step else run_eval()
    if eval_step != step:
        save_checkpoint(ckpt_path, model, tok.name, optimizer, step, args, rng=list(rng.getstate()),
                        generator=gen.get_state(), eval_before=before)
    print(f"done: {step} steps in {time.time() - t0:.0f}s | held-out greedy accuracy {before['greedy_accuracy']:.3f} -> "
          f"{final['greedy_accuracy']:.3f} (precedence {before['greedy_accuracy_precedence']:.3f} -> "
          f"{final['greedy_accuracy_precedence']:.3f}, other {final['greedy_accuracy_other']:.3f}) "
          f"| sampled pass@1 {before['pass_at_1']:.3f} -> {final['pass_at_1']:.3f} | wrote {ckpt_path}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except CheckpointError as e:  # a missing, unreadable or mismatched checkpoint: say which, no traceback
        raise SystemExit(f"error: {e}")
