"""
Direct Preference Optimisation (DPO): preference learning without a reward model or an RL loop.

Rafailov, Sharma, Mitchell, Ermon, Manning, Finn (2023), "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model", arXiv 2305.18290, equation 7:

    L_DPO = - log sigmoid( beta * [ (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)) ] )

y_w is the chosen (preferred) completion, y_l the rejected one, pi_ref the frozen SFT policy. The
implicit reward of a completion is r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)); DPO is the
Bradley-Terry loss on these rewards, so the policy that minimises it is the KL-regularised optimum
for the reward the preferences imply. Write h = (pi_c - ref_c) - (pi_r - ref_r) (in nats of
log-ratio): the loss is -log sigmoid(beta * h), which only reaches 0 as h -> infinity. When the data
prefer y_w over y_l every time (deterministic preferences, as ours: a correct answer always beats a
wrong one) nothing stops h from growing: the KL regularisation that beta stands for is not enforced
(Azar et al. 2023, section 4.2). ipo.py replaces the loss with a squared one that has a finite
target; `diff dpo.py ipo.py` shows the difference, and `python bench/dpo_ipo_margin.py` measures it.

The data: task.preference_dataset, one pair per training prompt, sampled from the SFT policy and
labelled by the verifier (chosen correct, rejected wrong; a side the samples lack is the
demonstration or a synthetic mistake: the pair's "source"), cached in out/pairs_*.json and shared
with reward_model.py and ipo.py. On precedence problems (a+b*c) the rejected side is mostly the SFT
policy's own left-to-right path and the chosen side the correct path, and the two differ from their
first token: that is the preference that teaches precedence.

Choices the paper leaves open, and deviations from it:
- log pi(y|x) is the sum of the token log-probs of the completion and its final EOS (the EOS is
  part of what the policy generates and both sides of a pair end with it), through kernels.logprobs
  at temperature 1, the temperature the pairs were sampled at.
- The reference log-probs are computed once, before training, for every pair (kept in memory and
  recomputed on --resume): pi_ref is frozen, so they never change.
- AdamW with linear warm-up then a constant learning rate (the paper: RMSprop, warm-up, constant),
  and several epochs over a small dataset, where the paper makes one pass over a large one.
- Defaults: lr 3e-5 for 100 steps (about 3 epochs), then stop. On deterministic preferences DPO's
  held-out accuracy rises, peaks and then falls as h keeps growing and the chosen log-probs start
  to fall (bench/dpo_ipo_margin.py: at lr 1e-4 for 200 steps, h 27 and held-out greedy accuracy
  0.27); the default stops before that. ipo.py runs with the same settings.
- Metrics the paper does not define: implicit-reward accuracy and margin (on the training batch and on
  the held-out pairs), the policy's log-probs of chosen and rejected (the chosen ones usually fall
  too, a known property of DPO), the exact KL(pi || pi_ref) summed over the tokens of the held-out
  chosen completions (teacher-forced, through kernels.kl; not on samples), and held-out greedy
  accuracy of generations, scored by the verifier.

Run:
    python dpo.py                     # trains out/sft.pt first if it is missing; writes out/dpo.pt
    python dpo.py --resume            # continue from out/dpo.pt up to --steps
Metrics: one JSON object per log step in out/dpo/metrics.jsonl.
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
import torch.nn.functional as F

import task
from kernels import kl, logprobs
from model import CheckpointError, Tokenizer, load_checkpoint, pick_device, save_checkpoint

# -----------------------------------------------------------------------------
# The algorithm

def sequence_logprobs(token_logp, mask, average=False):
    """log pi(y|x) per sequence: token_logp (B, T) float32, mask (B, T) 1.0 on completion tokens.
    Sum over the completion's tokens (average=True: their mean, length-normalised)."""
    total = (token_logp * mask).sum(-1)                                      # (B,)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1):
    """DPO loss per pair (Rafailov et al. 2023, eq. 7) and the implicit rewards; all inputs (B,) sequence log-probs.
    Returns (losses (B,), chosen_rewards (B,), rejected_rewards (B,)), with r = beta * (log pi - log pi_ref)."""
    chosen_rewards = beta * (policy_chosen - ref_chosen)                     # r(x, y_w) = beta log pi/pi_ref
    rejected_rewards = beta * (policy_rejected - ref_rejected)               # r(x, y_l)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards)                # -log sigmoid(beta * h)
    return losses, chosen_rewards, rejected_rewards


# -----------------------------------------------------------------------------
# Hyperparameters
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta: strength of the implicit KL regularisation")
    parser.add_argument("--steps", type=int, default=100, help="optimisation steps")
    parser.add_argument("--batch_size", type=int, default=64, help="preference pairs per step")
    parser.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate after warm-up")
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then constant")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--n_pairs", type=int, default=2048, help="training pairs (2048 shares the cache with reward_model.py)")
    parser.add_argument("--init", default="out/sft.pt", help="SFT checkpoint: the starting policy and the frozen reference")
    parser.add_argument("--log_every", type=int, default=10, help="print and log metrics every this many steps")
    parser.add_argument("--eval_every", type=int, default=50, help="evaluate on the held-out set every this many steps")
    parser.add_argument("--eval_n", type=int, default=512, help="held-out prompts (and pairs) to evaluate on (at most 512)")
    parser.add_argument("--out", default="out", help="folder for dpo.pt, dpo/metrics.jsonl and the pair caches")
    parser.add_argument("--seed", type=int, default=0, help="seeds python, numpy and torch, and the pairs")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/dpo.pt")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "n_pairs", "log_every", "eval_every", "eval_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be at least 1")
    if args.batch_size > args.n_pairs:
        parser.error(f"--batch_size = {args.batch_size} exceeds --n_pairs = {args.n_pairs}; it must be at most n_pairs")
    if not args.beta > 0:
        parser.error(f"--beta = {args.beta}; it must be > 0")
    if not args.lr > 0:
        parser.error(f"--lr = {args.lr}; it must be > 0")
    return args


def make_batch(pairs, tok, device):
    """Pairs -> one right-padded batch of 2B sequences prompt+completion+EOS (chosen rows 0..B-1, rejected
    rows B..2B-1): tokens (2B, T), attention mask (2B, T), completion mask (2B, T-1) over the targets."""
    seqs = [(p["prompt"], p["chosen"]) for p in pairs] + [(p["prompt"], p["rejected"]) for p in pairs]
    ids = [(tok.encode(p), tok.encode(c) + [tok.eos_id]) for p, c in seqs]
    T = max(len(p) + len(c) for p, c in ids)
    tokens = torch.full((len(ids), T), tok.pad_id, dtype=torch.long)
    attn = torch.zeros(len(ids), T)
    mask = torch.zeros(len(ids), T - 1)
    for i, (p, c) in enumerate(ids):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1.0
        mask[i, len(p) - 1:len(p) + len(c) - 1] = 1.0  # the predictions of c[0] .. EOS
    return tokens.to(device), attn.to(device), mask.to(device)


def main(args):
    t_start = time.time()
    ckpt_path = os.path.join(args.out, "dpo.pt")
    metrics_path = os.path.join(args.out, "dpo", "metrics.jsonl")

    # -------------------------------------------------------------------------
    # Setup
    device = args.device or pick_device()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")  # bf16 on GPU, fp32 elsewhere
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    tok = Tokenizer()
    if not os.path.exists(args.init):
        if args.init != "out/sft.pt":
            sys.exit(f"--init {args.init}: no checkpoint there; train one with `python sft.py` or pass its path")
        print(f"no SFT checkpoint at {args.init}: training it first with sft.py (about 4 minutes on 2 CPU cores)")
        subprocess.run([sys.executable, "sft.py", "--out", "out"], check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    reference, _ = load_checkpoint(args.init, device, kind="gpt", tokenizer=tok)
    reference.eval().requires_grad_(False)                                   # pi_ref: frozen
    if args.resume:
        model, ckpt = load_checkpoint(ckpt_path, device, kind="gpt", tokenizer=tok)
        step = ckpt["step"]
        print(f"resuming from {ckpt_path} at step {step}")
    else:
        model, _ = load_checkpoint(args.init, device, kind="gpt", tokenizer=tok)
        step, ckpt = 0, None
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    if ckpt is not None and ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log

    # Data: pairs sampled from the reference policy (cached on disk), and their reference log-probs.
    train_pairs, eval_pairs = task.preference_dataset(reference, tok, n_train=args.n_pairs, seed=args.seed, cache_dir=args.out)
    eval_set, eval_pairs = task.eval_prompts()[:args.eval_n], eval_pairs[:args.eval_n]
    sources = {s: sum(p["source"] == s for p in train_pairs) for s in sorted({p["source"] for p in train_pairs})}
    print(f"DPO: {model.num_params() / 1e6:.2f}M parameters on {device}, {len(train_pairs)} pairs {sources}, "
          f"{args.steps} steps of {args.batch_size}, beta {args.beta}")


    def policy_logprobs(net, pairs):
        """(chosen (B,), rejected (B,)) sequence log-probs of the pairs under `net`."""
        tokens, attn, mask = make_batch(pairs, tok, device)
        with autocast:
            logits = net(tokens[:, :-1], attn[:, :-1])                       # (2B, T-1, V)
        logp = sequence_logprobs(logprobs(logits, tokens[:, 1:]), mask)      # (2B,)
        return logp[:len(pairs)], logp[len(pairs):]


    @torch.no_grad()
    def reference_logprobs(pairs, chunk=256):
        parts = [policy_logprobs(reference, pairs[i:i + chunk]) for i in range(0, len(pairs), chunk)]
        return torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])   # (N,), (N,)


    ref_chosen_all, ref_rejected_all = reference_logprobs(train_pairs)      # computed once: pi_ref is frozen
    eval_ref_chosen, eval_ref_rejected = reference_logprobs(eval_pairs)
    batches_per_epoch = len(train_pairs) // args.batch_size


    def batch_indices(step):
        """The step's pairs: epoch e is a permutation seeded by (seed, e), so a resumed run sees the same batches."""
        epoch, i = divmod(step, batches_per_epoch)
        perm = random.Random(args.seed * 1_000_003 + epoch).sample(range(len(train_pairs)), len(train_pairs))
        return perm[i * args.batch_size:(i + 1) * args.batch_size]


    def lr_at(step):
        return args.lr * min(1.0, (step + 1) / args.warmup)


    def log(metrics):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


    @torch.no_grad()
    def run_eval():
        was_training = model.training
        model.eval()
        parts = [policy_logprobs(model, eval_pairs[i:i + 256]) for i in range(0, len(eval_pairs), 256)]
        chosen, rejected = torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])
        losses, r_c, r_r = dpo_loss(chosen, rejected, eval_ref_chosen, eval_ref_rejected, args.beta)
        kls = []
        for i in range(0, len(eval_pairs), 256):  # exact KL(pi || pi_ref) on the held-out chosen completions
            tokens, attn, mask = make_batch(eval_pairs[i:i + 256], tok, device)
            n = tokens.size(0) // 2                                          # chosen rows only
            with autocast:
                logits, ref_logits = model(tokens[:n, :-1], attn[:n, :-1]), reference(tokens[:n, :-1], attn[:n, :-1])
            kls.append((kl(logits, ref_logits) * mask[:n]).sum(-1))          # (n,) summed over completion tokens
        with autocast:
            e = task.evaluate(model, tok, eval_set, num_samples=4, temperature=1.0, seed=args.seed)
        model.train(was_training)
        return {"eval_accuracy": e["greedy_accuracy"], "eval_pass_at_1": e["pass_at_1"],
                "eval_accuracy_precedence": e["greedy_accuracy_precedence"], "eval_accuracy_other": e["greedy_accuracy_other"],
                "eval_loss": losses.mean().item(), "eval_reward_accuracy": (r_c > r_r).float().mean().item(),
                "eval_reward_margin": (r_c - r_r).mean().item(), "eval_chosen_logp": chosen.mean().item(),
                "eval_rejected_logp": rejected.mean().item(), "eval_kl": torch.cat(kls).mean().item()}


    def eval_line(e):
        return (f"held-out greedy {e['eval_accuracy']:.3f} (precedence {e['eval_accuracy_precedence']:.3f}) "
                f"pass@1 {e['eval_pass_at_1']:.3f} | held-out pairs: reward acc {e['eval_reward_accuracy']:.3f} "
                f"margin {e['eval_reward_margin']:.2f} kl {e['eval_kl']:.2f}")


    # -------------------------------------------------------------------------
    # Training loop
    e, eval_step = None, -1
    if step == 0:
        e, eval_step = run_eval(), 0
        print(f"step 0 | {eval_line(e)} (the SFT policy)")
        log({"step": 0, **e})
    t0, t_log, n_pairs = time.time(), time.time(), 0
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        idx = batch_indices(step)
        pairs = [train_pairs[i] for i in idx]
        policy_chosen, policy_rejected = policy_logprobs(model, pairs)      # (B,), (B,) log pi(y|x)
        ref_chosen, ref_rejected = ref_chosen_all[idx], ref_rejected_all[idx]
        losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta)
        loss = losses.mean()                                                 # L_DPO over the batch
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss is {loss.item()} at step {step}; lower --lr (now {args.lr}) and rerun")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        n_pairs += len(idx)

        if step % args.log_every == 0 or step == args.steps:
            dt = time.time() - t_log
            h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # log-ratio margin, nats
            metrics = {"step": step, "epoch": step / batches_per_epoch, "loss": loss.item(), "lr": lr_at(step - 1),
                       "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
                       "reward_margin": (chosen_rewards - rejected_rewards).mean().item(),   # beta * h
                       "logratio_margin": h.mean().item(),                                   # h
                       "chosen_logp": policy_chosen.mean().item(), "rejected_logp": policy_rejected.mean().item(),
                       "chosen_logratio": (policy_chosen - ref_chosen).mean().item(),
                       "rejected_logratio": (policy_rejected - ref_rejected).mean().item(),
                       "grad_norm": grad_norm.item(), "pairs_per_sec": n_pairs / dt, "elapsed_s": time.time() - t0}
            t_log, n_pairs = time.time(), 0
            line = (f"step {step:4d} | loss {metrics['loss']:.4f} | reward acc {metrics['reward_accuracy']:.2f} "
                    f"margin {metrics['reward_margin']:.2f} (h {metrics['logratio_margin']:.1f}) | logp chosen "
                    f"{metrics['chosen_logp']:.2f} rejected {metrics['rejected_logp']:.2f}")
            if step % args.eval_every == 0 or step == args.steps:
                e, eval_step = run_eval(), step
                metrics.update(e)
                line += " | " + eval_line(e)
                save_checkpoint(ckpt_path, model, tok.name, optimizer, step, args)
                t_log = time.time()  # evaluation time is not training throughput
            print(line)
            log(metrics)

    final = e if eval_step == step else run_eval()
    first = json.loads(open(metrics_path).readline())
    print(f"done: {step} steps, {time.time() - t_start:.0f}s in all | held-out greedy accuracy {first['eval_accuracy']:.3f} -> "
          f"{final['eval_accuracy']:.3f} (precedence {first['eval_accuracy_precedence']:.3f} -> "
          f"{final['eval_accuracy_precedence']:.3f}, other {final['eval_accuracy_other']:.3f}) "
          f"| sampled pass@1 {final['eval_pass_at_1']:.3f} | wrote {ckpt_path}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except CheckpointError as e:  # a missing, unreadable or mismatched checkpoint: say which, no traceback
        raise SystemExit(f"error: {e}")
