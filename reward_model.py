"""
Bradley-Terry reward model: the proxy reward that classic RLHF optimises with PPO (ppo.py).

Ouyang et al. 2022, "Training language models to follow instructions with human feedback"
(InstructGPT), arXiv 2203.02155, eq. 1; the preference model is Bradley and Terry (1952).
The model is the shared transformer with a scalar head (model.ScalarGPT), initialised from the SFT
policy, its head at zero. Its score r(x, y) is read at the last real token of prompt + completion + EOS.
Trained on pairs (x, y_chosen, y_rejected) to make the chosen completion score higher:

    P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r))
    L = - E_(x, y_c, y_r) [ log sigmoid(r(x, y_c) - r(x, y_r) - m) ]        (m: optional margin, default 0)

Pairs: task.preference_dataset(sft_policy) (cached in out/pairs_train.json and out/pairs_eval.json,
shared with dpo.py and ipo.py): the chosen completion is correct, the rejected one is wrong (sampled
from the SFT policy where it made a mistake, else a synthetic mistake). Held-out pairs are on the 512
held-out prompts. Reported: held-out pairwise accuracy (share of pairs with r_c > r_r) and mean margin
r_c - r_r, overall and per pair source. The pairs come from a verifier, not from people, so the
labels are noiseless; the reward model is still a proxy: it only ever saw SFT-like completions.

Deviations from InstructGPT: one pair per prompt instead of all K-choose-2 comparisons from K ranked
samples (their batching trick); no reward normalisation here (ppo.py uses the raw score); the
scored sequence ends with the EOS token (the PPO rollouts score prompt + completion through EOS too,
so the reward model sees the same kind of sequence in training and in use).

Run:
    python reward_model.py             # a few minutes on 2 CPU cores; writes out/rm.pt
    python reward_model.py --resume    # continue from out/rm.pt up to --epochs
Metrics: one JSON object per log step in out/rm/metrics.jsonl (held-out pair accuracy as "eval_pair_accuracy").
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
import torch.nn.functional as F

import task
from model import CheckpointError, ScalarGPT, Tokenizer, load_checkpoint, pick_device, save_checkpoint


# -----------------------------------------------------------------------------
# The algorithm: the Bradley-Terry loss, and where the score is read

def bradley_terry_loss(r_chosen, r_rejected, margin=0.0):
    """Per-pair loss (B,): -log sigmoid(r_c - r_r - margin). InstructGPT eq. 1 (margin 0);
    the margin variant asks for a gap of at least `margin` (Llama 2, Touvron et al. 2023)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)            # (B,) logsigmoid is stable for large gaps


def make_batch(tok, prompts, completions, device="cpu"):
    """prompt + completion + EOS, right-padded: tokens (B, T), mask (B, T) float, 1 on real tokens.
    The reward model's score is read at each row's last real token: the EOS."""
    ids = [tok.encode(p + c) + [tok.eos_id] for p, c in zip(prompts, completions)]
    T = max(len(x) for x in ids)
    tokens = torch.full((len(ids), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(ids), T)
    for i, x in enumerate(ids):
        tokens[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1.0
    return tokens.to(device), mask.to(device)


def score_pairs(model, tok, pairs, device):
    """(r_chosen, r_rejected), each (B,): chosen and rejected scored in one batch of 2B rows."""
    prompts = [p["prompt"] for p in pairs]
    tokens, mask = make_batch(tok, prompts + prompts, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], device)
    r = model.score(tokens, mask)                                   # (2B,) at the EOS of each row
    return r[:len(pairs)], r[len(pairs):]


# -----------------------------------------------------------------------------
# Hyperparameters
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4, help="passes over the training pairs")
    parser.add_argument("--batch_size", type=int, default=64, help="pairs per step")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine decay to lr/10")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--margin", type=float, default=0.0, help="Bradley-Terry margin m (0: InstructGPT's loss)")
    parser.add_argument("--n_train", type=int, default=2048, help="training pairs (2048 uses the shared pair cache)")
    parser.add_argument("--log_every", type=int, default=16, help="print and log metrics every this many steps")
    parser.add_argument("--eval_n", type=int, default=512, help="held-out pairs to evaluate on (at most 512)")
    parser.add_argument("--init", default="out/sft.pt", help="SFT policy: the backbone to start from and the pair sampler")
    parser.add_argument("--out", default="out", help="folder for rm.pt, rm/metrics.jsonl and the pair cache")
    parser.add_argument("--seed", type=int, default=0, help="seeds python, numpy and torch (and the pair sampling)")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/rm.pt")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "n_train", "log_every", "eval_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be at least 1")
    if args.lr <= 0:
        parser.error(f"--lr = {args.lr}; it must be positive")
    if args.margin < 0:
        parser.error(f"--margin = {args.margin}; it must be >= 0")
    return args


def main(args):
    ckpt_path = os.path.join(args.out, "rm.pt")
    metrics_path = os.path.join(args.out, "rm", "metrics.jsonl")

    # -------------------------------------------------------------------------
    # Setup
    device = args.device or pick_device()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")  # bf16 on GPU, fp32 elsewhere
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    if not os.path.exists(args.init):
        if args.init != "out/sft.pt":
            raise SystemExit(f"--init {args.init}: no such checkpoint; train one with sft.py or use the default out/sft.pt")
        print(f"{args.init} not found: training the SFT policy first (python sft.py, about 4 minutes)")
        subprocess.run([sys.executable, "sft.py"], check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    sft, sft_ckpt = load_checkpoint(args.init, device, kind="gpt")
    tok = Tokenizer(sft_ckpt["tokenizer"])
    t0 = time.time()
    train_pairs, eval_pairs = task.preference_dataset(sft, tok, n_train=args.n_train, seed=args.seed, cache_dir=args.out)
    eval_pairs = eval_pairs[:args.eval_n]
    print(f"{len(train_pairs)} training pairs, {len(eval_pairs)} held-out pairs ({time.time() - t0:.0f}s; "
          f"cached in {args.out}/pairs_*.json)")
    steps_per_epoch = (len(train_pairs) + args.batch_size - 1) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    if args.resume:
        model, ckpt = load_checkpoint(ckpt_path, device, kind="scalar", tokenizer=tok)
        step = ckpt["step"]
        print(f"resuming from {ckpt_path} at step {step}")
    else:
        model, step, ckpt = ScalarGPT.from_policy(sft), 0, None   # backbone = SFT policy, head = 0
    del sft
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    if ckpt is not None and ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log
    print(f"reward model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}, "
          f"{args.epochs} epochs x {steps_per_epoch} steps of {args.batch_size} pairs")


    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, total_steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


    def log(metrics):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


    @torch.no_grad()
    def run_eval():
        """Held-out pairwise accuracy and mean margin, overall and per pair source."""
        model.eval()
        margins = []
        for i in range(0, len(eval_pairs), 256):
            with autocast:
                r_c, r_r = score_pairs(model, tok, eval_pairs[i:i + 256], device)
            margins.append((r_c - r_r).float().cpu())
        model.train()
        margins = torch.cat(margins)                                 # (N,) r_c - r_r
        out = {"eval_pair_accuracy": (margins > 0).float().mean().item(), "eval_margin": margins.mean().item()}
        for src in sorted({p["source"] for p in eval_pairs}):
            sel = torch.tensor([p["source"] == src for p in eval_pairs])
            out[f"eval_pair_accuracy/{src}"] = (margins[sel] > 0).float().mean().item()
        return out


    # -------------------------------------------------------------------------
    # Training loop: shuffled epochs over the pairs
    e, eval_step = None, -1
    if step == 0:
        e, eval_step = run_eval(), 0
        print(f"step 0 | held-out pair accuracy {e['eval_pair_accuracy']:.3f} (head at zero: all ties)")
        log({"step": 0, **e})
    t0 = time.time()
    model.train()
    while step < total_steps:
        epoch, i = divmod(step, steps_per_epoch)
        order = list(range(len(train_pairs)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)       # the epoch's order, reproducible on resume
        batch = [train_pairs[j] for j in order[i * args.batch_size:(i + 1) * args.batch_size]]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with autocast:
            r_c, r_r = score_pairs(model, tok, batch, device)        # (B,), (B,)
        loss = bradley_terry_loss(r_c.float(), r_r.float(), args.margin).mean()
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss is {loss.item()} at step {step}; lower --lr (now {args.lr}) and rerun")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1

        if step % args.log_every == 0 or step % steps_per_epoch == 0 or step == total_steps:
            margin = (r_c - r_r).detach()
            metrics = {"step": step, "epoch": step / steps_per_epoch, "loss": loss.item(),
                       "train_pair_accuracy": (margin > 0).float().mean().item(), "train_margin": margin.mean().item(),
                       "lr": lr_at(step - 1), "grad_norm": grad_norm.item(), "elapsed_s": time.time() - t0}
            line = (f"step {step:4d} | epoch {metrics['epoch']:.2f} | loss {metrics['loss']:.4f} | "
                    f"train acc {metrics['train_pair_accuracy']:.3f} | margin {metrics['train_margin']:+.2f}")
            if step % steps_per_epoch == 0 or step == total_steps:  # evaluate and checkpoint once an epoch
                e, eval_step = run_eval(), step
                metrics.update(e)
                line += f" | held-out pair acc {e['eval_pair_accuracy']:.3f} margin {e['eval_margin']:+.2f}"
                save_checkpoint(ckpt_path, model, tok.name, optimizer, step, args, eval_pair_accuracy=e["eval_pair_accuracy"], scored="prompt+completion+EOS")
            print(line)
            log(metrics)

    final = e if eval_step == step else run_eval()
    per_source = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in final.items() if k.startswith("eval_pair_accuracy/"))
    print(f"done: {step} steps in {time.time() - t0:.0f}s | held-out pair accuracy {final['eval_pair_accuracy']:.3f} "
          f"({per_source}) | mean margin {final['eval_margin']:+.2f} | wrote {ckpt_path}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except CheckpointError as e:  # a missing, unreadable or mismatched checkpoint: say which, no traceback
        raise SystemExit(f"error: {e}")
