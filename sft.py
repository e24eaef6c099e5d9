"""
Supervised fine-tuning (SFT): the warm start every other script begins from.

Teacher forcing on the task's demonstrations, from random initialisation. The loss is the
negative log-likelihood of the completion tokens only (the prompt is context, not a target):

    L(theta) = - (1 / sum_t m_t) * sum_t m_t * log pi_theta(y_t | x, y_<t)

where m_t is 1 on completion tokens (the final EOS included) and 0 on prompt and padding.
In the language of the notes, SFT is "early experience": it imitates the demonstrator, mistakes
included. The demonstrations ignore operator precedence `--mistake_rate` of the time, so the
policy this script writes is deliberately imperfect, and the RL scripts have room to show what they do.

Run:
    python sft.py                      # about 4 minutes on 2 CPU cores; writes out/sft.pt
    python sft.py --resume             # continue from out/sft.pt up to --steps
Metrics: one JSON object per log step in out/sft/metrics.jsonl.
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch

import task
from kernels import logprobs
from model import CheckpointError, GPT, GPTConfig, Tokenizer, load_checkpoint, pick_device, save_checkpoint

# -----------------------------------------------------------------------------
# Hyperparameters
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="optimisation steps")
    parser.add_argument("--batch_size", type=int, default=64, help="demonstrations per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then cosine decay to lr/10")
    parser.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--mistake_rate", type=float, default=0.6, help="share of demonstrations evaluated left to right")
    parser.add_argument("--precedence_share", type=float, default=0.5, help="share of prompts of the form a+b*c / a-b*c")
    parser.add_argument("--n_layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n_head", type=int, default=4, help="attention heads")
    parser.add_argument("--n_embd", type=int, default=128, help="model width")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' (built in, offline) or a tiktoken encoding name")
    parser.add_argument("--log_every", type=int, default=50, help="print and log metrics every this many steps")
    parser.add_argument("--eval_every", type=int, default=500, help="evaluate on the held-out set every this many steps")
    parser.add_argument("--eval_n", type=int, default=512, help="held-out prompts to evaluate on (at most 512)")
    parser.add_argument("--out", default="out", help="folder for sft.pt and sft/metrics.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seeds python, numpy and torch")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/sft.pt")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "n_layer", "n_head", "n_embd", "log_every", "eval_every", "eval_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be at least 1")
    for name in ("mistake_rate", "precedence_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name} = {getattr(args, name)}; it must be between 0 and 1")
    if args.n_embd % args.n_head:
        parser.error(f"--n_embd = {args.n_embd} must be divisible by --n_head = {args.n_head}")
    return args


def make_batch(demos, tok, device):
    """(prompt, completion) pairs -> right-padded prompt+completion+EOS sequences: tokens (B, T),
    attention mask (B, T), and loss mask (B, T-1), 1 where target token t+1 belongs to the completion."""
    pairs = [(tok.encode(p), tok.encode(c) + [tok.eos_id]) for p, c in demos]
    T = max(len(p) + len(c) for p, c in pairs)
    tokens = torch.full((len(pairs), T), tok.pad_id, dtype=torch.long)
    attn = torch.zeros(len(pairs), T)
    loss_mask = torch.zeros(len(pairs), T - 1)
    for i, (p, c) in enumerate(pairs):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1.0
        loss_mask[i, len(p) - 1:len(p) + len(c) - 1] = 1.0  # the predictions of c[0] .. c[-1]
    return tokens.to(device), attn.to(device), loss_mask.to(device)


def main(args):
    ckpt_path = os.path.join(args.out, "sft.pt")
    metrics_path = os.path.join(args.out, "sft", "metrics.jsonl")

    # -------------------------------------------------------------------------
    # Setup
    device = args.device or pick_device()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")  # bf16 on GPU, fp32 elsewhere
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    rng = random.Random(args.seed)  # draws the demonstrations
    tok = Tokenizer(args.tokenizer)
    eval_set = task.eval_prompts()[:args.eval_n]
    if args.resume:
        model, ckpt = load_checkpoint(ckpt_path, device, kind="gpt", tokenizer=tok)
        step, rng_state = ckpt["step"], ckpt.get("rng")
        if rng_state is not None:
            rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))
        print(f"resuming from {ckpt_path} at step {step}")
    else:
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)).to(device)
        step, ckpt = 0, None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    if ckpt is not None and ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log
    print(f"SFT: {model.num_params() / 1e6:.2f}M parameters on {device}, {args.steps} steps of {args.batch_size}")

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def log(metrics):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def run_eval():
        with autocast:
            return task.evaluate(model, tok, eval_set, num_samples=4, temperature=1.0, seed=args.seed)


    # -------------------------------------------------------------------------
    # Training loop
    e, eval_step = None, -1
    if step == 0:
        e, eval_step = run_eval(), 0
        print(f"step 0 | held-out greedy accuracy {e['greedy_accuracy']:.3f} (random init)")
        log({"step": 0, "eval_accuracy": e["greedy_accuracy"], "eval_pass_at_1": e["pass_at_1"]})
    t0, t_log, n_tokens = time.time(), time.time(), 0
    model.train()
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        demos = task.sample_demonstrations(rng, args.batch_size, args.mistake_rate, args.precedence_share)
        tokens, attn, loss_mask = make_batch(demos, tok, device)
        with autocast:
            logits = model(tokens[:, :-1], attn[:, :-1])                    # (B, T-1, V)
        logp = logprobs(logits, tokens[:, 1:])                               # (B, T-1) float32: log pi(y_t | .)
        loss = -(logp * loss_mask).sum() / loss_mask.sum()                   # mean NLL over completion tokens
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss is {loss.item()} at step {step}; lower --lr (now {args.lr}) and rerun")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        n_tokens += int(attn.sum())

        if step % args.log_every == 0 or step == args.steps:
            dt = time.time() - t_log
            metrics = {"step": step, "loss": loss.item(), "lr": lr_at(step - 1), "grad_norm": grad_norm.item(),
                       "tokens_per_sec": n_tokens / dt, "elapsed_s": time.time() - t0}
            t_log, n_tokens = time.time(), 0
            line = f"step {step:5d} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | {metrics['tokens_per_sec']:,.0f} tok/s"
            if step % args.eval_every == 0 or step == args.steps:
                e, eval_step = run_eval(), step
                metrics.update(eval_accuracy=e["greedy_accuracy"], eval_pass_at_1=e["pass_at_1"],
                               eval_accuracy_precedence=e["greedy_accuracy_precedence"],
                               eval_accuracy_other=e["greedy_accuracy_other"])
                line += f" | held-out greedy {e['greedy_accuracy']:.3f} pass@1 {e['pass_at_1']:.3f}"
                save_checkpoint(ckpt_path, model, tok.name, optimizer, step, args, rng=list(rng.getstate()))
                t_log = time.time()  # evaluation time is not training throughput
            print(line)
            log(metrics)

    final = e if eval_step == step else run_eval()
    print(f"done: {step} steps in {time.time() - t0:.0f}s | held-out greedy accuracy {final['greedy_accuracy']:.3f} "
          f"(precedence {final['greedy_accuracy_precedence']:.3f}, other {final['greedy_accuracy_other']:.3f}) "
          f"| sampled pass@1 {final['pass_at_1']:.3f} | wrote {ckpt_path}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except CheckpointError as e:  # a missing, unreadable or mismatched checkpoint: say which, no traceback
        raise SystemExit(f"error: {e}")
