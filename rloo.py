"""
RLOO: REINFORCE Leave-One-Out, with the verifier as the reward.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs", arXiv 2402.14740 (the leave-one-out baseline is Kool et al. 2019, "Buy 4
REINFORCE Samples, Get a Baseline for Free!"). No value function and no ratio: each prompt gets k
sampled completions, and each completion's baseline is the mean reward of the other k - 1,

    R_i = r_i - beta * sum_t KL_it                                  (KL to the reference in the reward)
    A_i = R_i - 1/(k-1) sum_{j != i} R_j  =  k/(k-1) * (R_i - mean_j R_j)
    grad J = 1/k sum_i A_i * grad log pi(y_i | x),   log pi(y_i | x) = sum_t log pi(y_it | x, y_i<t)

so the loss is L = -1/(N k) sum_i A_i sum_t log pi_theta(y_it | .) over the batch's N prompts. The
baseline of sample i does not depend on sample i, so the estimate stays unbiased, unlike a mean that
includes it. The whole completion is one action (the paper's point: no per-token credit assignment).

KL_it is a per-token estimate of KL(pi_theta || pi_ref) on the sampled token (Schulman 2020), with
log r = log pi_ref(y) - log pi_theta(y):
    k1 = -log r                 unbiased for KL(pi_theta || pi_ref) (the paper's: the log-ratio)
    k2 = (log r)^2 / 2          biased, low variance, >= 0
    k3 = (r - 1) - log r        unbiased, low variance, >= 0
In the reward it is a number (no gradient flows through it); the exact per-token
KL(pi_theta || pi_ref) over the whole vocabulary (kernels.kl) is logged beside it.

Deviations from the paper, and choices it leaves open:
- One gradient step per batch of rollouts (on-policy), as the paper; the batch is not split into
  minibatches.
- The reward is the task's verifier (1 correct, 0 otherwise, optional --format_weight), not a
  learned reward model.
- Small scale: a 0.8M-parameter policy on arithmetic, AdamW at a constant learning rate.

Run:
    python rloo.py                       # from out/sft.pt (trained first if missing); about 1 min on 2 idle CPU cores
    python rloo.py --resume              # continue from out/rloo.pt up to --steps
    python rloo.py --group_size 2        # the smallest group: each sample's baseline is the other's reward
Metrics: one JSON object per log step in out/rloo/metrics.jsonl; checkpoint out/rloo.pt.
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
# The algorithm: the leave-one-out baseline and the REINFORCE loss

def rloo_advantages(rewards, k):
    """rewards (N*k,) flat, k consecutive samples per prompt -> advantages (N*k,):
    A_i = R_i - 1/(k-1) sum_{j != i} R_j, each sample's baseline the mean of its k - 1 siblings."""
    if k < 2:
        raise ValueError(f"k = {k}; RLOO needs k >= 2 samples per prompt (a sample's baseline is the mean of the others)")
    if rewards.dim() != 1 or rewards.numel() % k:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of k = {k}; "
                         f"need a flat tensor whose length is a multiple of k")
    R = rewards.view(-1, k)                                            # (N, k)
    baseline = (R.sum(dim=1, keepdim=True) - R) / (k - 1)              # 1/(k-1) sum_{j != i} R_j
    return (R - baseline).view(-1)                                     # (N*k,)


def kl_penalty(logp, ref_logp, estimator="k1"):
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.
    logp, ref_logp (B, T) -> (B, T)."""
    log_r = ref_logp - logp                                            # log r = log pi_ref - log pi_theta
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1                            # (r - 1) - log r
    raise ValueError(f"kl estimator {estimator!r} is unknown; allowed: 'k1', 'k2', 'k3'")


def rloo_loss(logp, advantages, mask):
    """The REINFORCE loss with sequence-level advantages: -1/B sum_i A_i sum_t log pi_theta(y_it | .).
    logp (B, T) log-probs of the sampled tokens (with grad); advantages (B,); mask (B, T) 1.0 on
    completion tokens. Returns (loss scalar, dict of float metrics)."""
    seq_logp = (logp * mask).sum(dim=1)                                # (B,) log pi(y_i | x)
    loss = -(advantages * seq_logp).mean()
    return loss, {"seq_logp": seq_logp.mean().item()}


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
    parser.add_argument("--group_size", type=int, default=8, help="k: completions sampled per prompt (>= 2)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; log-probs use the same")
    parser.add_argument("--max_new_tokens", type=int, default=task.MAX_NEW_TOKENS, help="longest completion")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (constant)")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--beta", type=float, default=0.04, help="weight of the KL-to-reference penalty in the reward")
    parser.add_argument("--kl_estimator", default="k1", choices=["k1", "k2", "k3"], help="per-token KL estimate in the reward")
    parser.add_argument("--format_weight", type=float, default=0.0, help="reward bonus for a well-formed completion")
    parser.add_argument("--precedence_share", type=float, default=0.5, help="share of training prompts of the form a+b*c / a-b*c")
    parser.add_argument("--init", default=DEFAULT_INIT, help="SFT checkpoint: the starting policy and the frozen reference")
    parser.add_argument("--log_every", type=int, default=5, help="print and log metrics every this many steps")
    parser.add_argument("--eval_every", type=int, default=10, help="evaluate on the held-out set every this many steps")
    parser.add_argument("--eval_n", type=int, default=512, help="held-out prompts to evaluate on (at most 512)")
    parser.add_argument("--out", default="out", help="folder for rloo.pt and rloo/metrics.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seeds python, numpy and torch")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/rloo.pt")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts_per_step", "max_new_tokens", "log_every", "eval_every", "eval_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be at least 1")
    if args.group_size < 2:
        parser.error(f"--group_size = {args.group_size}; it must be at least 2 (a sample's baseline is the mean of the others)")
    if not args.temperature > 0:
        parser.error(f"--temperature = {args.temperature}; it must be > 0 (sampling, not greedy)")
    for name in ("lr", "grad_clip"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} = {getattr(args, name)}; it must be > 0")
    if args.beta < 0 or args.weight_decay < 0:
        parser.error(f"--beta = {args.beta}, --weight_decay = {args.weight_decay}; both must be >= 0")
    if not 0.0 <= args.precedence_share <= 1.0:
        parser.error(f"--precedence_share = {args.precedence_share}; allowed: 0 <= precedence_share <= 1")
    return args


def main(args):
    ckpt_path = os.path.join(args.out, "rloo.pt")
    metrics_path = os.path.join(args.out, "rloo", "metrics.jsonl")

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
    print(f"RLOO: {model.num_params() / 1e6:.2f}M parameters on {device}, {args.steps} steps of "
          f"{args.prompts_per_step} prompts x {G} samples, beta {args.beta} ({args.kl_estimator})")


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
        # 1. rollout: k completions per prompt at temperature T, scored by the verifier
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

        with autocast:
            logits = completion_logits(model, prompt, prompt_mask, tokens, mask)        # (B*G, Tn, V)
        logp = logprobs(logits, tokens, args.temperature)                                # (B*G, Tn) log pi_theta
        kl_exact = masked_mean(kl(logits.detach(), ref_logits, args.temperature), mask)  # KL(pi_theta || pi_ref)
        ent = masked_mean(entropy(logits.detach(), args.temperature), mask)

        # 2. advantages: KL to the reference in the reward, the other k - 1 samples are the baseline
        kl_t = kl_penalty(logp.detach(), ref_logp, args.kl_estimator)                   # (B*G, Tn)
        scores = rewards - args.beta * (kl_t * mask).sum(1)                              # R_i = r_i - beta * sum_t KL_it
        advantages = rloo_advantages(scores, G)                                          # (B*G,)

        # 3. one on-policy REINFORCE step
        loss, stats = rloo_loss(logp, advantages, mask)
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
                       "kl_exact": kl_exact, f"kl_{args.kl_estimator}": masked_mean(kl_t, mask), "entropy": ent,
                       "response_len": mask.sum(1).mean().item(), "truncated": truncated.float().mean().item(),
                       "grad_norm": grad_norm.item(), "seq_logp": stats["seq_logp"],
                       "tokens_per_sec": n_tokens / dt, "elapsed_s": time.time() - t0}
            t_log, n_tokens = time.time(), 0
            line = (f"step {step:5d} | reward {metrics['reward_mean']:.3f} | zero-var {metrics['zero_var_groups']:.2f} "
                    f"| kl {kl_exact:.4f} | ent {ent:.3f} | len {metrics['response_len']:.1f} | gnorm {metrics['grad_norm']:.3f} "
                    f"| {metrics['tokens_per_sec']:,.0f} tok/s")
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
