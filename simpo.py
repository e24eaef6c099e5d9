"""
SimPO: Simple Preference Optimisation, DPO's pairs and loop with a reward that needs no reference
model.

The implicit reward is the policy's own average token log-prob, beta/|y| log pi(y|x): no reference
model, and the quantity the loss ranks is the one decoding follows (a long completion gains nothing
from its length). A target margin gamma asks the chosen completion to win by at least gamma. No
sampling, no reward model, no value.

Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
arXiv 2405.14734, eq. 6, with y_w the chosen completion and y_l the rejected one:
    r(x, y) = beta/|y| log pi(y|x)                      (beta times the average token log-prob)
    L_SimPO = -log sigmoid(r(x, y_w) - r(x, y_l) - gamma)
gamma is in reward units, subtracted after beta, as in eq. 6 and TRL's simpo_gamma; the paper's
repository sets gamma/beta instead (gamma_beta_ratio): its beta 2.5 with gamma/beta 0.55 is gamma
1.375 here. With identical chosen and rejected the loss is log(1 + e^gamma), not log 2 (`diff
dpo.py simpo.py`). The data: task.preference_dataset's pairs (as dpo.py's; out/pairs_*.json).

Deviations and choices the paper leaves open:
- |y| counts the completion's tokens and its EOS (task.pair_batch), at temperature 1.
- The frozen SFT policy is loaded for the held-out KL metric alone: the loss never reads it.
- AdamW, a linear warm-up then constant; lr 1e-5 for 200 steps (6 epochs): at 3e-5 held-out
  accuracy peaks by step 75 and then falls, the chosen log-probs dragged down with the rejected (no
  reference holds them); beta 2, gamma 1, within the paper's ranges.

Shapes: B pairs per step, scored as 2B rows (chosen, then rejected); T tokens; V vocabulary.

Run:
    python simpo.py                  # builds out/sft.pt first if it is missing; writes out/simpo.pt
    python simpo.py --resume         # continue from out/simpo.pt up to --steps
Metrics: out/simpo/metrics.jsonl (docs/metrics.md says what each means).
"""
import random

import torch
import torch.nn.functional as F

import task
from kernels import kl
from lora import trainable
from model import token_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, Float, Int, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm

def sequence_logprobs(token_logp, mask, average=False):
    """log pi(y|x) per sequence: token_logp, mask (B, T), mask 1.0 on completion tokens -> (B,),
    their sum (average=True: their mean)."""
    total = torch.where(mask > 0, token_logp, 0.0).sum(-1)           # (B,) masked values never leak
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def simpo_loss(chosen_avg_logp, rejected_avg_logp, beta=2.0, gamma=1.0):
    """SimPO loss per pair (eq. 6) and the rewards; inputs (B,) average token log-probs
    1/|y| log pi(y|x). Returns (losses (B,), chosen_rewards (B,), rejected_rewards (B,)),
    r = beta/|y| log pi(y|x); gamma in reward units."""
    chosen_rewards = beta * chosen_avg_logp                   # r(x, y_w) = beta/|y_w| log pi(y_w|x)
    rejected_rewards = beta * rejected_avg_logp                              # r(x, y_l)
    # -log sigmoid(r_w - r_l - gamma)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses, chosen_rewards, rejected_rewards


# -----------------------------------------------------------------------------
# Pairs: sequence log-probs, batches, held-out metrics

def pair_logprobs(model, pairs, tok, device, autocast, average=False):
    """(chosen (B,), rejected (B,)) sequence log-probs log pi(y|x) of the pairs under `model`."""
    tokens, attn, mask = task.pair_batch(pairs, tok, device)           # (2B, T), (2B, T), (2B, T-1)
    with autocast:                                                       # (2B, T-1) token log-probs
        logp = token_logprobs(model, tokens[:, :-1], attn[:, :-1], tokens[:, 1:])
    logp = sequence_logprobs(logp, mask, average)                        # (2B,)
    return logp[:len(pairs)], logp[len(pairs):]


@torch.no_grad()
def reference_logprobs(reference, pairs, tok, device, autocast, average=False, chunk=256):
    """pair_logprobs of every pair under the frozen reference, in chunks: (chosen, rejected)."""
    parts = [pair_logprobs(reference, pairs[i:i + chunk], tok, device, autocast, average)
             for i in range(0, len(pairs), chunk)]
    return torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])


def batch_indices(step, n_pairs, batch_size, seed):
    """The step's pairs: epoch e a permutation seeded by (seed, e): a resumed run sees the same."""
    epoch, i = divmod(step, n_pairs // batch_size)
    perm = random.Random(seed * 1_000_003 + epoch).sample(range(n_pairs), n_pairs)
    return perm[i * batch_size:(i + 1) * batch_size]


@torch.no_grad()
def evaluate_pairs(model, reference, tok, pairs, beta, gamma, device, autocast, chunk=256):
    """Held-out pair metrics: the loss, reward accuracy and margin, the policy's average log-probs
    of chosen and rejected, and the exact KL(pi || pi_ref) summed over the tokens of the chosen
    completions (teacher-forced)."""
    was_training = model.training
    model.eval()
    chosen, rejected = reference_logprobs(model, pairs, tok, device, autocast, True, chunk)
    losses, r_c, r_r = simpo_loss(chosen, rejected, beta, gamma)
    kls = []
    for i in range(0, len(pairs), chunk):
        tokens, attn, mask = task.pair_batch(pairs[i:i + chunk], tok, device)
        n = tokens.size(0) // 2                                              # chosen rows only
        with autocast:
            logits, ref_logits = (model(tokens[:n, :-1], attn[:n, :-1]),
                                  reference(tokens[:n, :-1], attn[:n, :-1]))
        # (n,) over completion tokens
        kls.append(torch.where(mask[:n] > 0, kl(logits, ref_logits), 0.0).sum(-1))
    model.train(was_training)
    return {"eval_loss": losses.mean().item(),
            "eval_reward_accuracy": (r_c > r_r).float().mean().item(),
            "eval_reward_margin": (r_c - r_r).mean().item(),
            "eval_chosen_logp": chosen.mean().item(), "eval_rejected_logp": rejected.mean().item(),
            "eval_kl": torch.cat(kls).mean().item()}


def pairs_line(e):
    return (f"held-out pairs: reward acc {e['eval_reward_accuracy']:.3f} "
            f"margin {e['eval_reward_margin']:.2f} kl {e['eval_kl']:.2f}")


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--beta", type=Float(gt=0), default=2.0,
                   help="SimPO beta: the reward is beta times avg log pi")
    g.add_argument("--gamma", type=Float(ge=0), default=1.0,
                   help="SimPO gamma: target reward margin (reward units)")
    g.add_argument("--n_pairs", type=Int(ge=1), default=2048,
                   help="training pairs (2048 shares the cache with reward_model.py)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=Int(ge=1), default=200, help="optimisation steps")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="preference pairs per step")
    g.add_argument("--lr", type=Float(gt=0), default=1e-5, help="AdamW learning rate after warm-up")
    g.add_argument("--warmup", type=Int(ge=0), default=20,
                   help="linear warm-up steps, then constant")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "simpo", log_every=10, eval_every=50)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy (and the KL metric's ref)")
    args = p.parse_args(argv)
    if args.batch_size > args.n_pairs:
        p.error(f"--batch_size {args.batch_size} exceeds --n_pairs {args.n_pairs}; it must be "
                f"at most n_pairs")
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("simpo", args, batch_flag="batch_size")
    model, tok = run.load_policy(args.init)         # the policy starts as the SFT policy ...
    reference = run.reference(args.init, model)     # ... frozen: the held-out KL, never the loss
    train_model = run.ddp(model)  # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(trainable(train_model), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    # The data: pairs sampled from the SFT policy (cached on disk); no reference log-probs (the
    # reward needs none).
    train_pairs, eval_pairs = task.preference_dataset(reference, tok, n_train=args.n_pairs,
                                                      seed=args.seed, cache_dir=args.out,
                                                      n_eval=args.eval_n)
    run.samples = 4 * len(train_pairs)              # the pairs' cost: 4 completions per prompt
    sources = {s: sum(p["source"] == s for p in train_pairs)
               for s in sorted({p["source"] for p in train_pairs})}
    run.print(f"SimPO: {model.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{len(train_pairs)} pairs {sources}, {args.steps} steps of {args.batch_size}, "
              f"beta {args.beta}, gamma {args.gamma}, no reference model")
    if not args.resume and run.is_main:             # a fresh run: the starting policy is step 0
        e = {**run.evaluate(model, tok),
             **evaluate_pairs(model, reference, tok, eval_pairs, args.beta, args.gamma,
                              run.device, run.autocast)}
        run.log_start(e, f"{pairs_line(e)} (the SFT policy)")

    model.train()
    while run.training():
        # 1. the step's pairs, and the learning rate: linear warm-up, then constant
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (run.step + 1) / max(args.warmup, 1))
        idx = run.shard(batch_indices(run.step, len(train_pairs),
                                      args.batch_size, args.seed))               # this rank's share
        pairs = [train_pairs[i] for i in idx]

        # 2. the loss on the policy's average token log-probs: the mean over every rank's pairs,
        #    over the --grad_accum micro-batches
        n_pairs = run.all_sum(len(idx))
        optimizer.zero_grad(set_to_none=True)
        loss, parts = 0.0, []
        for rows in run.micro_batches(len(idx), train_model):
            policy_chosen, policy_rejected = pair_logprobs(            # (b,), (b,) averages
                train_model, [pairs[j] for j in rows.tolist()], tok, run.device, run.autocast, True)
            losses, chosen_rewards, rejected_rewards = simpo_loss(policy_chosen, policy_rejected,
                                                                  args.beta, args.gamma)
            part = losses.sum() / n_pairs                            # this part's share of the loss
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss = loss + part.detach()
            parts.append((policy_chosen.detach(), policy_rejected.detach(), chosen_rewards.detach(),
                          rejected_rewards.detach()))
        policy_chosen, policy_rejected, chosen_rewards, rejected_rewards = (
            torch.cat(x) for x in zip(*parts))                                  # (B,) each
        grad_norm = run.clip_grad_norm(train_model, args.grad_clip)
        optimizer.step()
        run.step += 1
        run.tokens += 2 * args.batch_size

        # 3. log, evaluate, checkpoint
        if run.log_due():
            metrics = {"epoch": run.step / (len(train_pairs) // args.batch_size),
                       "loss": run.all_sum(loss).item(),
                       "lr": optimizer.param_groups[0]["lr"],
                       "reward_accuracy": run.mean((chosen_rewards > rejected_rewards).float()),
                       # r_w - r_l, against gamma
                       "reward_margin": run.mean(chosen_rewards - rejected_rewards),
                       "chosen_logp": run.mean(policy_chosen),
                       "rejected_logp": run.mean(policy_rejected),
                       "grad_norm": grad_norm.item()}
            line = (f"loss {metrics['loss']:.4f} | "
                    f"reward acc {metrics['reward_accuracy']:.2f} "
                    f"margin {metrics['reward_margin']:.2f} (gamma {args.gamma}) | "
                    f"avg logp chosen {metrics['chosen_logp']:.3f} "
                    f"rejected {metrics['rejected_logp']:.3f}")
            if run.eval_due() and run.is_main:
                metrics.update(run.evaluate(model, tok))
                metrics.update(evaluate_pairs(model, reference, tok, eval_pairs, args.beta,
                                              args.gamma, run.device, run.autocast))
                line += " | " + pairs_line(metrics)
            run.log(metrics, line)
        if run.eval_due():
            run.save(model, optimizer)
    run.finish(model, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
