"""
Expert iteration: fine-tune the policy on its own verified successes, round after round.

Sample N completions for each training prompt from the current policy, let the verifier keep the
ones with the right answer (or the reward model its favourite of the N), drop duplicates, and
fine-tune on what was kept with the SFT loss. Then again, with the better policy. No advantage, no
ratio, no reference, no KL: the filter is the whole of the reinforcement. It cannot learn what it
never samples: a prompt with no accepted sample teaches nothing.

Anthony et al. 2017, arXiv 1705.08439 (the name); for language models STaR (Zelikman et al. 2022,
arXiv 2203.14465), RFT (Yuan et al. 2023, arXiv 2308.01825), ReST-EM (Singh et al. 2023, arXiv
2312.06585) and Llama 2's rejection sampling (Touvron et al. 2023, arXiv 2307.09288, section
3.2.3). Round k, policy pi_k:
    y_i1 .. y_iN ~ pi_k( . | x_i)                                      (sample, at temperature T)
    K_i = the distinct y_ij with r(x_i, y_ij) = 1, at most max_per_prompt     (--select verifier)
        = the y_ij with the highest reward-model score          (--select rm: Llama 2's best of N)
    L(theta) = -1 / sum |y|  sum_{(x, y) kept} sum_t log pi_theta(y_t | x, y_<t)    (sft.py's loss)
With binary rewards ReST-EM's M-step maximises E[r log pi_theta(y | x)] over samples; this loss
differs from its sample mean in three ways: duplicates are dropped, at most max_per_prompt are kept
per prompt, and it is a mean over tokens (EOS included), not over completions.

Deviations and choices the papers leave open (experiments/README.md says where each paper stands):
- Fine-tuning continues from the current policy on the latest round's data; --restart starts every
  round from the SFT weights with a fresh optimiser, on everything kept so far.
- --hindsight keeps failed a+b*c= attempts for the problem they solve, (a+b)*c=; --demos s makes a
  share s of each round's data expert demonstrations; both for experiments/early_experience.py.
- A kept completion is trained on as sampled: with the stop token that ended it, and a truncated
  one with none (an EOS it never sampled would teach it to stop there).
- AdamW at a constant learning rate; no early stopping; one sampling temperature.

Shapes: P prompts per round, N samples per prompt, B = P*N samples; T time, V vocabulary.
Run (from out/sft.pt, built first if missing; about 2 minutes on 2 CPU cores):
    python expert_iteration.py
    python expert_iteration.py --restart      # every round from SFT, on all kept so far (ReST-EM)
    python expert_iteration.py --select rm    # Llama 2's rejection sampling: the RM's best of N
    python expert_iteration.py --resume       # continue from out/expert_iteration.pt to --rounds
Metrics: one row per round in out/expert_iteration/metrics.jsonl (docs/metrics.md: what each means).
"""
import copy

import torch
import torch.distributed as dist

import task
from lora import trainable
from model import masked_mean, token_logprobs
from plumbing import Run
from plumbing.flags import (RM_PATH, SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser,
                            require_arithmetic)
from tasks import arithmetic


# -----------------------------------------------------------------------------
# The algorithm: which samples to keep, and what the fine-tuning sees

def select(scores, completions, max_per_prompt, threshold=None):
    """Which of N samples per prompt to fine-tune on: scores (P, N), completions P lists of N
    hashable completions (tuples of token ids) -> kept (P, N) bool. Per prompt, the samples scoring
    at least `threshold` (all when None), highest first (ties in the order sampled), duplicates
    skipped, at most max_per_prompt: with 0/1 rewards and threshold 1, the distinct accepted samples
    (STaR, RFT, ReST-EM); with reward-model scores and max_per_prompt 1, the best of N (Llama 2)."""
    if (scores.dim() != 2 or len(completions) != scores.size(0)
            or any(len(c) != scores.size(1) for c in completions)):
        raise ValueError(f"scores of shape {tuple(scores.shape)} and {len(completions)} lists "
                         f"of completions do not match; need scores (P, N) and P lists of "
                         f"N completions")
    if max_per_prompt < 1:
        raise ValueError(f"max_per_prompt = {max_per_prompt}; it must be at least 1")
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite: a NaN or infinite score cannot be ranked")
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    for i, row in enumerate(scores.tolist()):
        seen = set()
        # highest first; sorted() is stable
        for j in sorted(range(len(row)), key=lambda j: -row[j]):
            if len(seen) == max_per_prompt or (threshold is not None and row[j] < threshold):
                break                                                   # full, or no candidate left
            if completions[i][j] not in seen:                           # drop duplicates
                seen.add(completions[i][j])
                kept[i, j] = True
    return kept


@torch.no_grad()
def reward_model_scores(rm, tok, prompts, completions, device, batch_size=256):
    """The reward model's score (B,) of each prompt + completion (token ids as sampled, the stop
    token last), read at the last token, as reward_model.py trains it."""
    scores = []
    for i in range(0, len(prompts), batch_size):
        tokens, attn, _ = task.completion_batch(prompts[i:i + batch_size],
                                                completions[i:i + batch_size], tok, device)
        scores.append(rm.score(tokens, attn).float().cpu())     # (b,) at each row's last real token
    return torch.cat(scores)


def minibatches(n, batch_size, epochs, rng):
    """Index lists for `epochs` passes over n items: ceil(epochs * n / batch_size) full batches
    drawn from one reshuffled pass after another (a batch can straddle two); rng is the run's
    random.Random, so resuming repeats."""
    steps = -(-epochs * n // batch_size)                                   # ceil
    stream = []
    while len(stream) < steps * batch_size:
        order = list(range(n))
        rng.shuffle(order)
        stream += order
    return [stream[s * batch_size:(s + 1) * batch_size] for s in range(steps)]


def round_counts(prompts, texts, rewards, kept):
    """What a round sampled and kept, as counts for the log: prompts (P,), texts (P*N,), rewards and
    kept (P, N)."""
    P, N = kept.shape
    # (P, N)
    precedence = torch.tensor([task.is_precedence(p) for p in prompts])[:, None].expand(P, N)
    left_to_right = torch.tensor([texts[i] == task.demonstration(prompts[i // N], mistake=True)
                                  for i in range(P * N)]).view(P, N) & precedence           # (P, N)
    correct = rewards > 0                                                                   # (P, N)
    return {"sampled": P * N, "prompts": P, "accepted": int(correct.sum()),
            "solved": int(correct.any(1).sum()), "kept": int(kept.sum()),
            "kept_precedence": int((kept & precedence).sum()),
            "kept_wrong": int((kept & ~correct).sum()),
            "kept_left_to_right": int((kept & left_to_right).sum()),
            "missed_correct": int((correct.any(1) & ~(kept & correct).any(1)).sum())}


def hindsight_pairs(prompts, texts, ids, N):
    """Hindsight relabelling (Andrychowicz et al. 2017, arXiv 1707.01495): every failed sample that
    exactly solves another problem, as a demonstration of that problem: distinct (problem,
    completion ids) pairs. Here a failed a+b*c= attempt that is the left-to-right derivation solves
    (a+b)*c= (arithmetic.hindsight_prompt), a problem never asked; not deduplicated against the
    round's successes (the problems differ)."""
    pairs = []
    for i, text in enumerate(texts):
        # the problem this failure did solve, or None
        goal = arithmetic.hindsight_prompt(prompts[i // N], text)
        if goal is not None and (goal, tuple(ids[i])) not in pairs:
            pairs.append((goal, tuple(ids[i])))
    return pairs


def demonstrations(rng, n, precedence_share, tok):
    """A warm buffer's share, as RFT mixes its SFT data in: n demonstrations of fresh prompts,
    (prompt, ids) pairs."""
    return [(p, tuple(tok.encode(task.demonstration(p)) + [tok.eos_id]))
            for p in task.sample_prompts(rng, n, precedence_share)]


def all_gather(run, items):
    """Every rank's items, concatenated in rank order: every rank then fine-tunes on its share of
    the same batches."""
    if run.world == 1:
        return items
    parts = [None] * run.world
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--select", choices=["verifier", "rm"], default="verifier",
                   help="keep the samples the verifier accepts, or the reward model's best of N "
                        "(Llama 2)")
    g.add_argument("--samples_per_prompt", type=Int(ge=1), default=4,
                   help="N: completions sampled per prompt")
    g.add_argument("--max_per_prompt", type=Int(ge=1), default=None,
                   help="most distinct completions kept per prompt (default: 4 with --select "
                        "verifier, 1 with rm)")
    g.add_argument("--restart", action="store_true",
                   help="fine-tune every round from the SFT weights on everything kept so far "
                        "(default: continue)")
    g.add_argument("--hindsight", action="store_true",
                   help="also keep each failed a+b*c= attempt that solves (a+b)*c=, as a "
                        "demonstration of it")
    g.add_argument("--demos", type=Float(ge=0, lt=1), default=0.0,
                   help="share of each round's data that is demonstrations of fresh prompts (a "
                        "warm buffer)")
    g = p.add_argument_group("sampling")
    g.add_argument("--rounds", type=Int(ge=1), default=8,
                   help="rounds of sample, select, fine-tune")
    g.add_argument("--prompts_per_round", type=Int(ge=1), default=256,
                   help="P: prompts drawn per round")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0, help="sampling temperature")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=Int(ge=1), default=2,
                   help="passes over each round's fine-tuning data")
    g.add_argument("--batch_size", type=Int(ge=1), default=64,
                   help="completions per fine-tuning step")
    g.add_argument("--lr", type=Float(gt=0), default=1e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "expert_iteration", log_every=1, eval_every=1)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the start (with --restart, of every round)")
    g.add_argument("--rm", default=RM_PATH,
                   help="reward model for --select rm (reward_model.py; built if missing)")
    args = p.parse_args(argv)
    if args.max_per_prompt is None:               # derived: the cap each selection rule starts from
        args.max_per_prompt = 4 if args.select == "verifier" else 1
    args.steps = args.rounds                      # derived: one Run step is one round
    if args.hindsight:
        require_arithmetic(p, args, "--hindsight (relabelling a+b*c= attempts as (a+b)*c=)")
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun
    run = Run("expert_iteration", args, batch_flag="batch_size")
    if args.prompts_per_round % run.world:
        raise SystemExit(f"error: --prompts_per_round {args.prompts_per_round} must split "
                         f"evenly over {run.world} processes")
    policy, tok = run.load_policy(args.init)        # the policy starts as the SFT policy
    # --restart: every round starts here
    sft_weights = copy.deepcopy(policy.state_dict()) if args.restart else None
    rm = (run.load_reward_model(args.rm, args.init).requires_grad_(False) if args.select == "rm"
          else None)
    rm_weights = run.parked(rm, policy)             # in host memory outside step 2 (a GPU)
    run.check_lengths(policy, tok, args.max_new_tokens)
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    ckpt = run.resume(policy, optimizer)
    # --restart trains on all of it
    kept_so_far = [(p, tuple(c)) for p, c in ckpt["kept_so_far"]] if ckpt else []
    P, N = args.prompts_per_round, args.samples_per_prompt
    which = "the verifier-accepted" if args.select == "verifier" else "the reward model's best-of-N"
    start = ("from the SFT weights on all data so far (--restart)" if args.restart
             else "from the current policy")
    run.print(f"expert iteration: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{args.rounds} rounds of {P} prompts x {N} samples, select {which} (at "
              f"most {args.max_per_prompt} distinct per prompt), {args.epochs} epochs per "
              f"round, {start}")
    if not args.resume:                             # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. sample: N completions for each of this rank's prompts from the current policy (at
        #    --temperature)
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            # P*N, a prompt's N consecutive
            texts, ids, sampler_logp, *hidden = task.complete(
                policy, tok, prompts, N, args.temperature, args.max_new_tokens, generator=run.gen,
                return_logprobs=True, return_hidden=run.logging())  # hidden: [(n, C)] logged
            if run.logging():     # the trainer's log-probs of every sampled token, same weights
                logp, sampler_kl = task.sampled_logprobs(
                    policy, tok, [p for p in prompts for _ in range(N)], ids, args.temperature,
                    hidden=hidden[0])                                   # (n,) each
                sampler_diff = run.max((logp - torch.tensor(
                    [x for row in sampler_logp for x in row], device=run.device)).abs())
        run.samples += P * N
        rewards = torch.tensor([task.reward(prompts[i // N], c)
                                for i, c in enumerate(texts)]).view(-1, N)                   # (P,N)

        # 2. select: the distinct accepted samples (verifier), or the reward model's best of N; at
        #    most --max_per_prompt per prompt
        if args.select == "verifier":
            scores, threshold = rewards, 1.0
        else:
            with run.autocast, rm_weights:
                scores = reward_model_scores(rm, tok, [p for p in prompts for _ in range(N)], ids,
                                             run.device)
            scores, threshold = scores.view(-1, N), None                            # (P, N) R(x, y)
        # (P, N) bool
        kept = select(scores, [[tuple(c) for c in ids[i * N:(i + 1) * N]]
                               for i in range(len(prompts))], args.max_per_prompt, threshold)

        # 3. the round's fine-tuning data: (prompt, completion token ids) pairs, every rank's;
        #    --hindsight adds the failures relabelled with the problem they solved, --demos expert
        #    demonstrations; with --restart, all the pairs kept so far, and the policy back at the
        #    SFT weights with a fresh optimiser
        data = all_gather(run, [(prompts[i // N], tuple(ids[i]))
                                for i in kept.view(-1).nonzero().view(-1).tolist()])
        relabelled = (all_gather(run, hindsight_pairs(prompts, texts, ids, N)) if args.hindsight
                      else [])
        demos = demonstrations(run.rng,
                               round(args.demos / (1 - args.demos) * (len(data) + len(relabelled))),
                               args.precedence_share, tok)      # the same on every rank: run.rng is
        data = data + relabelled + demos                  # --demos: their share of the round's data
        if args.restart:
            kept_so_far += data
            data = kept_so_far
            policy.load_state_dict(sft_weights)
            optimizer.state.clear()                          # AdamW afresh: no moments, step 0

        # 4. fine-tune by teacher forcing: the mean NLL of the kept completions' tokens (sft.py's
        #    loss), --epochs passes in batches of --batch_size, each batch shared among the ranks
        #    and the --grad_accum micro-batches
        losses, grad_norm = [], torch.tensor(0.0)
        for batch in (minibatches(len(data), args.batch_size, args.epochs, run.rng) if data
                      else []):
            pairs = run.shard([data[j] for j in batch])                          # this rank's share
            tokens, attn, loss_mask = task.completion_batch([p for p, _ in pairs],
                                                            [c for _, c in pairs], tok, run.device)
            n_tokens = run.all_sum(loss_mask.sum())                              # the whole batch's
            loss = 0.0
            for rows in run.micro_batches(len(tokens), train_policy):
                with run.autocast:                                  # (b, T-1) log pi(y_t | x, y_<t)
                    logp = token_logprobs(train_policy, tokens[rows, :-1], attn[rows, :-1],
                                          tokens[rows, 1:])
                part = -masked_mean(logp, loss_mask[rows], n_tokens)     # its share of the mean NLL
                run.check_finite(part, f"lower --lr (now {args.lr})")
                part.backward()
                loss = loss + part.detach()
            grad_norm = run.clip_grad_norm(train_policy, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(run.all_sum(loss).item())
        run.step += 1

        # 5. log, evaluate, checkpoint (counts summed over all ranks)
        if run.log_due():
            c = {k: run.all_sum(v).item()
                 for k, v in round_counts(prompts, texts, rewards, kept).items()}
            kept_n = max(c["kept"], 1)
            metrics = {"reward_mean": c["accepted"] / c["sampled"],
                       "solved": c["solved"] / c["prompts"],
                       "kept_fraction": c["kept"] / c["sampled"],
                       "kept_per_prompt": c["kept"] / c["prompts"],
                       "kept_precedence_share": c["kept_precedence"] / kept_n,
                       "kept_wrong": c["kept_wrong"] / kept_n,
                       "missed_correct": c["missed_correct"] / c["prompts"],
                       "kept_left_to_right": c["kept_left_to_right"] / max(c["kept_precedence"], 1),
                       "data_size": len(data), "relabelled": len(relabelled), "demos": len(demos),
                       "ft_steps": len(losses), "loss": sum(losses) / max(len(losses), 1),
                       "grad_norm": grad_norm.item(), "sampler_logp_diff": sampler_diff,
                       "sampler_kl": run.mean(sampler_kl)}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"accepted {metrics['reward_mean']:.3f} | "
                             f"kept {metrics['kept_fraction']:.3f} "
                             f"({metrics['kept_per_prompt']:.2f}/prompt, "
                             f"precedence {metrics['kept_precedence_share']:.2f}, "
                             f"wrong {metrics['kept_wrong']:.3f}) | data {len(data)} | "
                             f"{len(losses)} steps, loss {metrics['loss']:.4f}")
        if run.eval_due():
            run.save(policy, optimizer, kept_so_far=[[p, list(c)] for p, c in kept_so_far])
    run.finish(policy, tok, optimizer, kept_so_far=[[p, list(c)] for p, c in kept_so_far])


if __name__ == "__main__":
    main(parse_args())
