"""
DPO: Direct Preference Optimisation, preference learning without a reward model or an RL loop.

The policy's log-ratio to the frozen SFT reference, beta log(pi / pi_ref), is an implicit reward:
DPO fits it to the preference pairs with the Bradley-Terry loss a reward model would be trained
with, so the policy that minimises it is the KL-regularised optimum for the reward the preferences
imply. No sampling, no reward model, no value.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model", arXiv 2305.18290, eq. 7, with y_w the chosen completion and y_l the rejected one:
    h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))   (margin, nats)
    L_DPO = -log sigmoid(beta h)
The loss reaches 0 only as h -> infinity: when the data prefer y_w every time (deterministic
preferences, as ours) nothing stops h from growing, and the KL regularisation beta stands for is
not enforced (Azar et al. 2023, section 4.2); ipo.py's loss has a finite target (`diff dpo.py
ipo.py`).

The data: task.preference_dataset, one pair per training prompt, sampled from the SFT policy and
labelled by the verifier (chosen correct, rejected wrong; a side the samples lack is the
demonstration or a synthetic mistake: the pair's "source"), cached in out/pairs_*.json and shared
by reward_model.py, dpo.py and ipo.py. On precedence problems the rejected side is mostly the SFT
policy's own left-to-right path, which differs from the chosen one from its first token: the
preference that teaches precedence.

Deviations and choices the paper leaves open:
- log pi(y|x) sums the completion's token log-probs and its EOS, at temperature 1, the tokens as
  sampled (task.pair_batch); --seq_logp mean averages them (as TRL's IPO and Tulu 3's DPO).
- The reference log-probs are computed once, before training (pi_ref is frozen), and on --resume.
- AdamW, a linear warm-up then constant; lr 3e-5, 100 steps (3 epochs of a small dataset).

Shapes: B pairs per step, scored as 2B rows (chosen, then rejected); T tokens; V vocabulary.

Run:
    python dpo.py                     # builds out/sft.pt first if it is missing; writes out/dpo.pt
    python dpo.py --resume            # continue from out/dpo.pt up to --steps
Metrics: out/dpo/metrics.jsonl (docs/metrics.md says what each means).
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


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1):
    """DPO loss per pair (eq. 7) and the implicit rewards; inputs (B,) sequence log-probs. Returns
    (losses (B,), chosen_rewards (B,), rejected_rewards (B,)), r = beta * (log pi - log pi_ref)."""
    chosen_rewards = beta * (policy_chosen - ref_chosen)            # r(x, y_w) = beta log pi/pi_ref
    rejected_rewards = beta * (policy_rejected - ref_rejected)      # r(x, y_l)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards)       # -log sigmoid(beta * h)
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
def evaluate_pairs(model, reference, tok, pairs, ref_chosen, ref_rejected, beta, device, autocast,
                   average=False, chunk=256):
    """Held-out pair metrics: the loss, implicit-reward accuracy and margin, the policy's log-probs
    of chosen and rejected, and the exact KL(pi || pi_ref) summed over the tokens of the chosen
    completions (teacher-forced)."""
    was_training = model.training
    model.eval()
    chosen, rejected = reference_logprobs(model, pairs, tok, device, autocast, average, chunk)
    losses, r_c, r_r = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)
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
    g.add_argument("--beta", type=Float(gt=0), default=0.1,
                   help="DPO beta: strength of the implicit KL regularisation")
    g.add_argument("--seq_logp", choices=("sum", "mean"), default="sum",
                   help="log pi(y|x): the sum over the completion's tokens (the paper) or "
                        "their mean")
    g.add_argument("--n_pairs", type=Int(ge=1), default=2048,
                   help="training pairs (2048 shares the cache with reward_model.py)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=Int(ge=1), default=100, help="optimisation steps")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="preference pairs per step")
    g.add_argument("--lr", type=Float(gt=0), default=3e-5, help="AdamW learning rate after warm-up")
    g.add_argument("--warmup", type=Int(ge=0), default=20,
                   help="linear warm-up steps, then constant")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "dpo", log_every=10, eval_every=50)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    args = p.parse_args(argv)
    if args.batch_size > args.n_pairs:
        p.error(f"--batch_size {args.batch_size} exceeds --n_pairs {args.n_pairs}; it must be "
                f"at most n_pairs")
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("dpo", args, batch_flag="batch_size")
    model, tok = run.load_policy(args.init)         # the policy starts as the SFT policy ...
    reference = run.reference(args.init, model)     # ... which stays frozen as pi_ref
    train_model = run.ddp(model)  # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(trainable(train_model), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    # The data: pairs sampled from the reference policy (cached on disk), and their reference
    # log-probs, computed once (pi_ref is frozen).
    train_pairs, eval_pairs = task.preference_dataset(reference, tok, n_train=args.n_pairs,
                                                      seed=args.seed, cache_dir=args.out,
                                                      n_eval=args.eval_n)
    run.samples = 4 * len(train_pairs)              # the pairs' cost: 4 completions per prompt
    average = args.seq_logp == "mean"
    ref_chosen_all, ref_rejected_all = reference_logprobs(reference, train_pairs, tok, run.device,
                                                          run.autocast, average)  # (N,), (N,)
    eval_ref = reference_logprobs(reference, eval_pairs, tok, run.device, run.autocast, average)
    sources = {s: sum(p["source"] == s for p in train_pairs)
               for s in sorted({p["source"] for p in train_pairs})}
    run.print(f"DPO: {model.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{len(train_pairs)} pairs {sources}, {args.steps} steps of {args.batch_size}, "
              f"log pi {args.seq_logp}, beta {args.beta}")
    if not args.resume and run.is_main:             # a fresh run: the starting policy is step 0
        e = {**run.evaluate(model, tok),
             **evaluate_pairs(model, reference, tok, eval_pairs, *eval_ref, args.beta, run.device,
                              run.autocast, average)}
        run.log_start(e, f"{pairs_line(e)} (the SFT policy)")

    model.train()
    while run.training():
        # 1. the step's pairs, and the learning rate: linear warm-up, then constant
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (run.step + 1) / max(args.warmup, 1))
        idx = run.shard(batch_indices(run.step, len(train_pairs),
                                      args.batch_size, args.seed))               # this rank's share
        pairs = [train_pairs[i] for i in idx]

        # 2. the loss on the policy's sequence log-probs against the reference's: the mean over
        #    every rank's pairs, over the --grad_accum micro-batches
        ref_chosen, ref_rejected = ref_chosen_all[idx], ref_rejected_all[idx]  # (B,), (B,)
        n_pairs = run.all_sum(len(idx))
        optimizer.zero_grad(set_to_none=True)
        loss, parts = 0.0, []
        for rows in run.micro_batches(len(idx), train_model):
            policy_chosen, policy_rejected = pair_logprobs(                     # (b,), (b,)
                train_model, [pairs[j] for j in rows.tolist()], tok, run.device, run.autocast,
                average)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                policy_chosen, policy_rejected, ref_chosen[rows], ref_rejected[rows], args.beta)
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
            # log-ratio margin, nats
            h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
            metrics = {"epoch": run.step / (len(train_pairs) // args.batch_size),
                       "loss": run.all_sum(loss).item(),
                       "lr": optimizer.param_groups[0]["lr"],
                       "reward_accuracy": run.mean((chosen_rewards > rejected_rewards).float()),
                       "reward_margin": run.mean(chosen_rewards - rejected_rewards),   # beta * h
                       "logratio_margin": run.mean(h),                                       # h
                       "chosen_logp": run.mean(policy_chosen),
                       "rejected_logp": run.mean(policy_rejected),
                       "chosen_logratio": run.mean(policy_chosen - ref_chosen),
                       "rejected_logratio": run.mean(policy_rejected - ref_rejected),
                       "grad_norm": grad_norm.item()}
            line = (f"loss {metrics['loss']:.4f} | "
                    f"reward acc {metrics['reward_accuracy']:.2f} "
                    f"margin {metrics['reward_margin']:.2f} (h {metrics['logratio_margin']:.1f}) | "
                    f"logp chosen {metrics['chosen_logp']:.2f} "
                    f"rejected {metrics['rejected_logp']:.2f}")
            if run.eval_due() and run.is_main:
                metrics.update(run.evaluate(model, tok))
                metrics.update(evaluate_pairs(model, reference, tok, eval_pairs, *eval_ref,
                                              args.beta, run.device, run.autocast, average))
                line += " | " + pairs_line(metrics)
            run.log(metrics, line)
        if run.eval_due():
            run.save(model, optimizer)
    run.finish(model, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
