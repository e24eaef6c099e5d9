"""
Bradley-Terry reward model: the proxy reward that classic RLHF optimises with PPO (ppo.py).

The shared transformer with a scalar head (model.ScalarGPT), initialised from the SFT policy with
its head at zero, trained on pairs (x, y_chosen, y_rejected) so that the chosen completion scores
higher. Its score r(x, y) is read at the last real token of prompt + completion + EOS. The pairs
come from the verifier (the chosen is correct, the rejected wrong), so the labels are noiseless;
the model is still a proxy: it only ever saw SFT-like completions.

Ouyang et al. 2022, "Training language models to follow instructions with human feedback"
(InstructGPT), arXiv 2203.02155, eq. 1; the preference model is Bradley and Terry (1952):
    P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r))
    L = -E[ log sigmoid(r(x, y_c) - r(x, y_r) - m) ]        (m: an optional margin, as Llama 2; 0)

Deviations from InstructGPT:
- One pair per prompt (task.preference_dataset, shared with dpo.py and ipo.py), not all K-choose-2
  comparisons.
- No reward normalisation (ppo.py uses the raw score).
- The scored sequence ends with the EOS, as PPO's rollouts score it; the completion is the token
  ids sampled (task.pair_batch), exactly the sequence PPO scores.
Reported: held-out pair accuracy (r_c > r_r) and mean margin r_c - r_r, overall and per source.

Shapes: B pairs per step, scored as 2B rows; T tokens.

Run:
    python reward_model.py             # under a minute on 2 CPU cores once out/sft.pt exists
    python reward_model.py --resume    # continue from out/rm.pt up to --epochs
Metrics: out/rm/metrics.jsonl (docs/metrics.md says what each means); checkpoint out/rm.pt.
"""
import random

import torch
import torch.nn.functional as F

import task
from model import ScalarGPT, last_real
from plumbing import Run, lr_schedule
from plumbing.flags import SFT_PATH, Float, Int, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm: the Bradley-Terry loss, and where the score is read

def bradley_terry_loss(r_chosen, r_rejected, margin=0.0):
    """Per-pair loss (B,): -log sigmoid(r_c - r_r - margin). InstructGPT eq. 1 (margin 0);
    the margin variant asks for a gap of at least `margin` (Llama 2, Touvron et al. 2023)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)  # (B,) logsigmoid is stable for large gaps


def score_pairs(model, tok, pairs, device):
    """(r_chosen, r_rejected), each (B,): chosen and rejected scored in one batch of 2B rows, at
    each row's EOS."""
    tokens, attn, _ = task.pair_batch(pairs, tok, device)    # (2B, T) prompt + completion + EOS
    r = last_real(model(tokens, attn), attn)                 # (2B,) at the last real token: the EOS
    return r[:len(pairs)], r[len(pairs):]


@torch.no_grad()
def evaluate_pairs(model, tok, pairs, device, autocast):
    """Held-out pairwise accuracy (share of pairs with r_c > r_r) and mean margin, overall and per
    pair source."""
    model.eval()
    margins = []
    for i in range(0, len(pairs), 256):
        with autocast:
            r_c, r_r = score_pairs(model, tok, pairs[i:i + 256], device)
        margins.append((r_c - r_r).float().cpu())
    model.train()
    margins = torch.cat(margins)                                    # (N,) r_c - r_r
    out = {"eval_pair_accuracy": (margins > 0).float().mean().item(),
           "eval_margin": margins.mean().item()}
    for src in sorted({p["source"] for p in pairs}):
        sel = torch.tensor([p["source"] == src for p in pairs])
        out[f"eval_pair_accuracy/{src}"] = (margins[sel] > 0).float().mean().item()
    return out


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--margin", type=Float(ge=0), default=0.0,
                   help="Bradley-Terry margin m (0: InstructGPT's loss)")
    g.add_argument("--n_train", type=Int(ge=1), default=2048,
                   help="training pairs (2048 uses the shared pair cache)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=Int(ge=1), default=4, help="passes over the training pairs")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="pairs per step")
    g.add_argument("--lr", type=Float(gt=0), default=5e-4, help="peak AdamW learning rate")
    g.add_argument("--warmup", type=Int(ge=0), default=10,
                   help="linear warm-up steps, then cosine decay to lr/10")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "rm", log_every=16, eval_every=32)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT policy: the backbone to start from and the pair sampler")
    args = p.parse_args(argv)
    if args.batch_size > args.n_train:
        p.error(f"--batch_size {args.batch_size} exceeds --n_train {args.n_train}; it must be "
                f"at most n_train")
    # derived: total steps (a last partial batch is dropped)
    args.steps = args.epochs * (args.n_train // args.batch_size)
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun
    run = Run("reward_model", args, name="rm", batch_flag="batch_size")
    sft, tok = run.load_policy(args.init)
    model = ScalarGPT.from_policy(sft)              # backbone = the SFT policy, head = 0
    train_model = run.ddp(model)  # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(train_model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    train_pairs, eval_pairs = task.preference_dataset(sft, tok, n_train=args.n_train,
                                                      seed=args.seed, cache_dir=args.out,
                                                      n_eval=args.eval_n)
    run.samples = 4 * len(train_pairs)              # the pairs' cost: 4 completions per prompt
    del sft
    steps_per_epoch = args.steps // args.epochs
    run.print(f"reward model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
              f"parameters on {run.device}, {len(train_pairs)} training and {len(eval_pairs)} "
              f"held-out pairs (cached in {args.out}/pairs_*.json), {args.epochs} epochs "
              f"x {steps_per_epoch} steps of {args.batch_size} pairs")
    if not args.resume:                             # a fresh run: the untrained head is step 0
        e = {"eval_pair_accuracy": 0.0}
        if run.is_main:
            e = evaluate_pairs(model, tok, eval_pairs, run.device, run.autocast)
        run.log_start(e, f"held-out pair accuracy {e['eval_pair_accuracy']:.3f} (the head "
                         f"starts at zero: all ties)")

    model.train()
    while run.training():
        # 1. the step's pairs: shuffled epochs, each order seeded by (seed, epoch) so a resumed run
        #    sees the same
        epoch, i = divmod(run.step, steps_per_epoch)
        order = list(range(len(train_pairs)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        # this rank's
        batch = run.shard([train_pairs[j]
                           for j in order[i * args.batch_size:(i + 1) * args.batch_size]])
        for group in optimizer.param_groups:
            group["lr"] = lr_schedule(run.step, args.lr, args.warmup, args.steps)

        # 2. the Bradley-Terry loss on the scores at each sequence's EOS, the mean over every rank's
        #    pairs, over the --grad_accum micro-batches
        n_pairs = run.all_sum(len(batch))
        optimizer.zero_grad(set_to_none=True)
        loss, margins = 0.0, []
        for rows in run.micro_batches(len(batch), train_model):
            with run.autocast:
                r_c, r_r = score_pairs(train_model, tok, [batch[j] for j in rows.tolist()],
                                       run.device)                                      # (b,), (b,)
            part = bradley_terry_loss(r_c.float(), r_r.float(), args.margin).sum() / n_pairs
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss, margins = loss + part.item(), margins + [(r_c - r_r).detach()]
        grad_norm = run.clip_grad_norm(train_model, args.grad_clip)
        optimizer.step()
        run.step += 1

        # 3. log, evaluate, checkpoint
        if run.log_due():
            margin = torch.cat(margins)                        # (B,) r_c - r_r of this rank's pairs
            metrics = {"epoch": run.step / steps_per_epoch, "loss": run.all_sum(loss).item(),
                       "train_pair_accuracy": run.mean((margin > 0).float()),
                       "train_margin": run.mean(margin),
                       "lr": lr_schedule(run.step - 1, args.lr, args.warmup, args.steps),
                       "grad_norm": grad_norm.item()}
            line = (f"epoch {metrics['epoch']:.2f} | loss {metrics['loss']:.4f} | train acc "
                    f"{metrics['train_pair_accuracy']:.3f} | margin {metrics['train_margin']:+.2f}")
            if run.eval_due() and run.is_main:
                metrics.update(evaluate_pairs(model, tok, eval_pairs, run.device, run.autocast))
                line += (f" | held-out pair acc {metrics['eval_pair_accuracy']:.3f} "
                         f"margin {metrics['eval_margin']:+.2f}")
            run.log(metrics, line)
        if run.eval_due():
            run.save(model, optimizer, scored="prompt+completion+EOS")
    final = {"eval_pair_accuracy": 0.0, "eval_margin": 0.0}
    if run.is_main:
        final = evaluate_pairs(model, tok, eval_pairs, run.device, run.autocast)
    per_source = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in final.items()
                           if k.startswith("eval_pair_accuracy/"))
    run.finish(model, tok, optimizer, summary=f"held-out pair "
                                              f"accuracy {final['eval_pair_accuracy']:.3f} "
                                              f"({per_source}) | "
                                              f"mean margin {final['eval_margin']:+.2f}")


if __name__ == "__main__":
    main(parse_args())
