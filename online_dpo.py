"""
Online DPO: DPO on pairs the current policy samples at every step, judged as they come.

Each step draws prompts, samples G completions of each from the policy being trained, and lets a
judge rank them: the task's verifier (default) or the Bradley-Terry reward model (--judge rm,
out/rm.pt). The best and the worst become a pair (chosen, rejected); a prompt whose completions all
score the same teaches nothing and is skipped (a tie). Then one DPO step on the step's pairs, with
the SFT policy as the frozen reference. The pairs follow the policy: it is corrected on the mistakes
it makes now, not on those the SFT policy made (`diff dpo.py online_dpo.py`).

Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792
(OAIF: two samples, an annotator picks); the loss is DPO's (Rafailov et al. 2023, arXiv
2305.18290, eq. 7):
    h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))   (margin, nats)
    L_DPO = -log sigmoid(beta h),   averaged over the step's informative pairs (every process's)
TRL's OnlineDPOTrainer does the same with a judge or a reward model.

Deviations and choices the papers leave open:
- The judge is the verifier (exact, 1 or 0) or the reward model's score, not an LLM annotator;
  with --group_size G > 2 the pair is the best and the worst of the G (a tie: equal scores, or the
  same tokens).
- Ties are dropped before scoring; a step with no informative pair on any process makes no update.
- log pi(y|x) sums the completion's token log-probs and its EOS at temperature 1, whatever
  --temperature samples at.
- AdamW, a linear warm-up then constant; lr 1e-4, 100 steps of 64 prompts x 2 samples (12,800,
  GRPO's default).

Shapes: P prompts per step, G samples each (P*G rows), P' <= P pairs scored as 2P' rows; T tokens;
V vocabulary.

Run:
    python online_dpo.py              # builds out/sft.pt first if missing; writes out/online_dpo.pt
    python online_dpo.py --judge rm   # the reward model judges (out/rm.pt, built first if missing)
    python online_dpo.py --resume     # continue from out/online_dpo.pt up to --steps
Metrics: out/online_dpo/metrics.jsonl (docs/metrics.md says what each means).
"""

import torch
import torch.nn.functional as F

import task
from kernels import kl
from lora import trainable
from model import token_logprobs
from plumbing import Run
from plumbing.flags import RM_PATH, SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser


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


@torch.no_grad()
def judge(batch, rm, autocast):
    """The judge's score of each sampled completion (P*n,): the reward model's at the EOS, else the
    verifier's."""
    if rm is None:
        return batch.rewards                                   # 1 correct, 0 wrong
    with autocast:                                             # prompt + completion, (P*n, Tp + Tn)
        return rm.score(torch.cat([batch.prompt, batch.tokens], 1),
                        torch.cat([batch.prompt_mask, batch.mask], 1))


def best_and_worst(prompts, batch, scores, n, tok):
    """One pair per prompt from its n samples (consecutive rows): chosen the best-scored, rejected
    the worst, as token ids as sampled (the stop token that ended each included; none in a truncated
    one). Returns (pairs, informative (P,) bool, correct (P, 2)): informative where the two differ
    in score and in tokens; correct: the verifier's verdict on chosen, rejected."""
    s = scores.float().view(-1, n)                                           # (P, n)
    best, worst = s.argmax(1), s.argmin(1)                                   # (P,)
    ids = task.kept(batch.tokens, batch.mask)
    pairs = [{"prompt": p, "chosen_ids": ids[i * n + b], "rejected_ids": ids[i * n + w]}
             for i, (p, b, w) in enumerate(zip(prompts, best.tolist(), worst.tolist()))]
    differ = torch.tensor([p["chosen_ids"] != p["rejected_ids"] for p in pairs], device=s.device)
    correct = batch.correct.view(-1, n)                                      # (P, n)
    rows = torch.arange(len(prompts), device=s.device)
    return pairs, (s.max(1).values > s.min(1).values) & differ, torch.stack(
        [correct[rows, best], correct[rows, worst]], 1)


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
    g.add_argument("--judge", choices=("verifier", "rm"), default="verifier",
                   help="who ranks the samples: the task's verifier, or the reward model (--rm)")
    g = p.add_argument_group("sampling")
    g.add_argument("--group_size", type=Int(ge=2), default=2,
                   help="G: completions sampled per prompt (torchrun takes --n for its own); the "
                        "pair: best and worst")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; log-probs use 1")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=Int(ge=1), default=100,
                   help="optimisation steps (one batch of samples each)")
    g.add_argument("--batch_size", type=Int(ge=1), default=64,
                   help="prompts per step: one pair each, ties skipped")
    g.add_argument("--lr", type=Float(gt=0), default=1e-4, help="AdamW learning rate after warm-up")
    g.add_argument("--warmup", type=Int(ge=0), default=20,
                   help="linear warm-up steps, then constant")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "online_dpo", log_every=10, eval_every=50)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    g.add_argument("--rm", default=RM_PATH,
                   help="reward model checkpoint (reward_model.py), for --judge rm")
    return p.parse_args(argv)


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("online_dpo", args, batch_flag="batch_size")
    model, tok = run.load_policy(args.init)         # the policy starts as the SFT policy ...
    reference = run.reference(args.init, model)     # ... which stays frozen as pi_ref
    rm = (run.load_reward_model(args.rm, args.init).requires_grad_(False) if args.judge == "rm"
          else None)
    run.check_lengths(model, tok, args.max_new_tokens)
    train_model = run.ddp(model)  # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(trainable(train_model), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    # The held-out pairs: task.preference_dataset's (its cache), as dpo.py's for comparable metrics
    eval_pairs = task.held_out_pairs(reference, tok, args.seed, args.out, args.eval_n)
    average, G = args.seq_logp == "mean", args.group_size
    eval_ref = reference_logprobs(reference, eval_pairs, tok, run.device, run.autocast, average)
    run.print(f"online DPO: {model.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{args.steps} steps of {args.batch_size} prompts x {G} samples, "
              f"judge {args.judge}, log pi {args.seq_logp}, beta {args.beta}")
    if not args.resume and run.is_main:             # a fresh run: the starting policy is step 0
        e = {**run.evaluate(model, tok),
             **evaluate_pairs(model, reference, tok, eval_pairs, *eval_ref, args.beta, run.device,
                              run.autocast, average)}
        run.log_start(e, f"{pairs_line(e)} (the SFT policy)")

    model.train()
    while run.training():
        # 1. the learning rate: linear warm-up, then constant; this rank's prompts, G samples of
        #    each from the policy
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (run.step + 1) / max(args.warmup, 1))
        prompts = run.shard(task.sample_prompts(run.rng, args.batch_size, args.precedence_share))
        with run.autocast:
            batch, sampler_logp, hidden = task.rollout(model, tok, prompts, G, args.temperature,
                                                       args.max_new_tokens, generator=run.gen,
                                                       return_logprobs=True,
                                                       return_hidden=run.logging())
            if run.logging():     # the trainer's log-probs of every sampled token, same weights
                logp, sampler_kl = task.sampled_logprobs(
                    model, tok, [p for p in prompts for _ in range(G)],
                    task.kept(batch.tokens, batch.mask), args.temperature,
                    hidden=hidden[batch.mask > 0])                      # (n,) each
                sampler_diff = run.max((logp - sampler_logp[batch.mask > 0]).abs())
        run.samples += args.batch_size * G

        # 2. the judge ranks them: chosen the best, rejected the worst; ties are dropped, except
        #    that a rank left with fewer pairs than micro-batches keeps some at weight 0 (every rank
        #    runs every forward and backward)
        pairs, informative, correct = best_and_worst(prompts, batch, judge(batch, rm, run.autocast),
                                                     G, tok)
        ties = (~informative).nonzero().flatten().tolist()
        keep = (informative.nonzero().flatten().tolist()
                + ties[:max(0, args.grad_accum - int(informative.sum()))])
        # P' pairs
        pairs, weight, correct = [pairs[i] for i in keep], informative[keep].float(), correct[keep]
        ref_chosen, ref_rejected = reference_logprobs(reference, pairs, tok, run.device,
                                                      run.autocast, average)

        # 3. the loss on the policy's sequence log-probs against the reference's: the mean over
        #    every rank's informative pairs, over the --grad_accum micro-batches
        n_pairs = run.all_sum(weight.sum())
        optimizer.zero_grad(set_to_none=True)
        loss, parts = 0.0, []
        for rows in run.micro_batches(len(pairs), train_model):
            policy_chosen, policy_rejected = pair_logprobs(                     # (b,), (b,)
                train_model, [pairs[j] for j in rows.tolist()], tok, run.device, run.autocast,
                average)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                policy_chosen, policy_rejected, ref_chosen[rows], ref_rejected[rows], args.beta)
            # this part's share of the loss
            part = (weight[rows] * losses).sum() / n_pairs.clamp(min=1)
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss = loss + part.detach()
            parts.append((policy_chosen.detach(), policy_rejected.detach(), chosen_rewards.detach(),
                          rejected_rewards.detach()))
        policy_chosen, policy_rejected, chosen_rewards, rejected_rewards = (
            torch.cat(x) for x in zip(*parts))                                  # (P',) each
        grad_norm = run.clip_grad_norm(train_model, args.grad_clip)
        if n_pairs > 0:                                             # all ties everywhere: no update
            optimizer.step()
        run.step += 1
        run.tokens += 2 * len(pairs)

        # 4. log, evaluate, checkpoint (the pair metrics over the informative pairs)
        if run.log_due():
            # log-ratio margin, nats
            h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
            metrics = {"loss": run.all_sum(loss).item(), "lr": optimizer.param_groups[0]["lr"],
                       "reward_mean": run.mean(batch.rewards),        # the verifier, on the samples
                       "informative": run.mean(informative.float()),
                       "ties": int(run.all_sum(len(ties)).item()),
                       # verifier agrees
                       "label_accuracy": run.mean((correct[:, 0] & ~correct[:, 1]).float(), weight),
                       "reward_accuracy": run.mean((chosen_rewards > rejected_rewards).float(),
                                                   weight),
                       # beta * h
                       "reward_margin": run.mean(chosen_rewards - rejected_rewards, weight),
                       "logratio_margin": run.mean(h, weight),                                 # h
                       "chosen_logp": run.mean(policy_chosen, weight),
                       "rejected_logp": run.mean(policy_rejected, weight),
                       "grad_norm": grad_norm.item(), "sampler_logp_diff": sampler_diff,
                       "sampler_kl": run.mean(sampler_kl)}
            line = (f"loss {metrics['loss']:.4f} | reward {metrics['reward_mean']:.3f} | "
                    f"informative {metrics['informative']:.2f} | "
                    f"reward acc {metrics['reward_accuracy']:.2f} "
                    f"margin {metrics['reward_margin']:.2f} (h {metrics['logratio_margin']:.1f})")
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
