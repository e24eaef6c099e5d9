"""
Expert iteration: fine-tune the policy on its own verified successes, round after round.

In plain words: sample N completions for each training prompt from the current policy, let the
verifier keep the ones with the right answer (or let the reward model keep its favourite of the N),
drop duplicates, and fine-tune the policy on what was kept with the SFT loss, teacher forcing on the
completion tokens. Then do it again with the better policy. There is no advantage, no ratio, no
reference and no KL term: the filter is the whole of the reinforcement. It is the simplest bridge from
imitation to reinforcement: one step of it on the policy's own accepted samples is REINFORCE with a 0/1
reward and no baseline, grad E[r log pi] = E[r grad log pi], and the rest is imitation of the best of
what the policy already does. It cannot learn what it never samples: a prompt with no accepted sample
among the N teaches nothing that round.

The name is Anthony et al.'s 2017 (arXiv 1705.08439, where the expert is tree search); for language
models the same loop is STaR (Zelikman et al. 2022, "STaR: Bootstrapping Reasoning With Reasoning",
arXiv 2203.14465), rejection-sampling fine-tuning, RFT (Yuan et al. 2023, "Scaling Relationship on
Learning Mathematical Reasoning with Large Language Models", arXiv 2308.01825), ReST-EM (Singh et al.
2023, "Beyond Human Data: Scaling Self-Training for Problem-Solving with Language Models", arXiv
2312.06585) and Llama 2's rejection sampling between RLHF rounds (Touvron et al. 2023, arXiv 2307.09288,
section 3.2.3, where a reward model, not a verifier, picks the best of N). Round k, policy pi_k, P
prompts x_1..x_P:

    y_i1 .. y_iN ~ pi_k( . | x_i)  at temperature T                                      (sample)
    K_i = the first `max_per_prompt` distinct y_ij with r(x_i, y_ij) = 1, in the order sampled   (--select verifier)
        = the y_ij with the highest reward-model score R(x_i, y_ij), the best of N               (--select rm)
    D_k = {(x_i, y) : y in K_i}                                                          (the round's data)
    L(theta) = - 1 / sum_(x,y) |y|  *  sum_(x,y) in D  sum_t log pi_theta(y_t | x, y_<t)          (SFT loss, EOS included)

minimised for --epochs passes over D, from theta_k (the default: D = D_k) or, with --restart, from the
SFT weights theta_0 with a fresh optimiser on D = D_1 u ... u D_k. With binary rewards, ReST-EM's M-step
objective E_(x, y ~ pi_k)[r(x, y) log pi_theta(y | x)] is exactly this NLL on the accepted samples.

Where the papers differ and what this file does (every choice a flag):
- Selection. STaR, RFT and ReST-EM keep what the answer check accepts (--select verifier, the default);
  Llama 2 keeps the reward model's best of N (--select rm; the reward model is reward_model.py's
  out/rm.pt, built if missing). The reward model has no access to the answer: its best of N can be a
  confident wrong answer, and the verifier (which never selects in that mode) counts how often
  (kept_wrong: share of kept completions that are wrong; missed_correct: share of prompts where a
  correct sample was drawn and none was kept).
- Duplicates and the cap. RFT keeps only distinct reasoning paths; ReST-EM caps the solutions kept per
  problem so that easy problems do not dominate. Here a completion identical (same token ids) to one
  already kept for the same prompt in the same round is dropped, and at most --max_per_prompt are kept
  (default 4 with the verifier; 1 with the reward model, which makes it Llama 2's best of N). On this
  task a prompt has one or two distinct correct derivations, so after deduplication a solved prompt
  contributes about one completion, however often the policy sampled it: easy prompts weigh no more
  than hard ones, unlike in a policy gradient, where a prompt's weight grows with its number of successes.
- Where each round starts. --restart fine-tunes from the SFT weights with a fresh optimiser every round,
  as STaR and ReST-EM do to limit overfitting and drift; it trains on everything kept so far, as Llama 2
  did from its third round on (STaR and ReST-EM train on the latest round's samples only). The default
  continues from the current policy and its optimiser on the latest round's data: the cheaper, online
  form, whose cost per round stays constant.
- Two additions, off by default, for experiments/early_experience.py. --hindsight (Andrychowicz et al. 2017, arXiv
  1707.01495): a failed attempt is kept as a correct demonstration of the problem it did solve; here a failed
  a+b*c= attempt that is exactly the left-to-right derivation is kept for (a+b)*c=, a problem never asked (not
  deduplicated against the round's own successes: the problems differ). --demos s: expert demonstrations (the
  correct derivation) of fresh training prompts make up a share s of each round's data, a warm buffer, as RFT
  mixes its SFT data with its samples.
- No rationalisation (STaR's hint for failed problems), single-temperature sampling (Llama 2 tunes the temperature
  per round), AdamW at a constant learning rate, no early stopping on a validation set (ReST-EM picks
  the number of M-step steps on one). Small scale: a 0.8M-parameter policy on arithmetic.
- A truncated completion (no EOS within --max_new_tokens) is fine-tuned on with an EOS appended, as
  every kept completion; the verifier only accepts one whose answer is complete.

Costs: every round samples P * N completions (the "samples" metric counts them all, kept or not) and
then fine-tunes on the kept ones: the README compares methods by completions sampled, not only by time.

Shapes: P prompts per round, N samples per prompt (the best-of-N's N), B = P*N samples; T time, V vocabulary.

Run:
    python expert_iteration.py                   # from out/sft.pt (trained first if missing); about 2 minutes on 2 CPU cores
    python expert_iteration.py --restart         # every round from the SFT weights, on everything kept so far (ReST-EM style)
    python expert_iteration.py --select rm       # Llama 2's rejection sampling: the reward model's best of N (builds out/rm.pt)
    python expert_iteration.py --hindsight       # also learn (a+b)*c= from the left-to-right failures on a+b*c=
    python expert_iteration.py --demos 0.25      # a quarter of each round's data: expert demonstrations
    python expert_iteration.py --resume          # continue from out/expert_iteration.pt up to --rounds
Metrics: one JSON object per round in out/expert_iteration/metrics.jsonl: reward_mean (share of samples the
verifier accepts), solved (share of prompts with an accepted sample, pass@N), kept_fraction (kept / sampled),
kept_per_prompt, kept_precedence_share (share of kept completions on precedence problems), kept_wrong,
missed_correct, kept_left_to_right (share of the kept precedence completions that are the left-to-right
derivation: right answer by coincidence, as in 3+4*1=, or with --select rm wrong), data_size (completions
fine-tuned on this round), relabelled (--hindsight's share of them), demos (--demos's), ft_steps, loss (mean NLL per completion token), grad_norm, samples (completions
sampled so far) and, every --eval_every rounds, the held-out eval_* metrics.
"""
import copy

import torch
import torch.distributed as dist

import task
from kernels import logprobs
from model import masked_mean
from plumbing import RM_PATH, SFT_PATH, TEMPERATURE, Float, Int, Run, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm: which samples to keep, and what the fine-tuning sees

def select(scores, completions, max_per_prompt, threshold=None):
    """Which of N samples per prompt to fine-tune on: scores (P, N), completions P lists of N hashable completions
    (e.g. tuples of token ids) -> kept (P, N) bool.

    Per prompt: the candidates are the samples scoring at least `threshold` (every sample when None), taken from the
    highest score down (ties: in the order sampled); a candidate equal to one already kept is skipped (a duplicate);
    at most max_per_prompt are kept.
      verifier (STaR, RFT, ReST-EM): scores = 0/1 rewards, threshold 1: the distinct accepted samples, in the order
                                     sampled, at most max_per_prompt;
      reward model (Llama 2):        scores = reward-model scores, no threshold, max_per_prompt 1: the best of N."""
    if scores.dim() != 2 or len(completions) != scores.size(0) or any(len(c) != scores.size(1) for c in completions):
        raise ValueError(f"scores of shape {tuple(scores.shape)} and {len(completions)} lists of completions do not "
                         f"match; need scores (P, N) and P lists of N completions")
    if max_per_prompt < 1:
        raise ValueError(f"max_per_prompt = {max_per_prompt}; it must be at least 1")
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite: a NaN or infinite score cannot be ranked")
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    for i, row in enumerate(scores.tolist()):
        seen = set()
        for j in sorted(range(len(row)), key=lambda j: -row[j]):          # highest first; sorted() is stable
            if len(seen) == max_per_prompt or (threshold is not None and row[j] < threshold):
                break                                                       # full, or no candidate left
            if completions[i][j] not in seen:                               # drop duplicates
                seen.add(completions[i][j])
                kept[i, j] = True
    return kept


@torch.no_grad()
def reward_model_scores(rm, tok, prompts, completions, device, batch_size=256):
    """The reward model's score (B,) of each prompt + completion (token ids) + EOS, read at the EOS: the sequence
    reward_model.py trains on (task.completion_batch builds it, the prompt encoded on its own)."""
    scores = []
    for i in range(0, len(prompts), batch_size):
        tokens, attn, _ = task.completion_batch(prompts[i:i + batch_size], completions[i:i + batch_size], tok, device)
        scores.append(rm.score(tokens, attn).float().cpu())                 # (b,) at each row's last real token
    return torch.cat(scores)


def minibatches(n, batch_size, epochs, rng):
    """Index lists for `epochs` passes over n items: ceil(epochs * n / batch_size) batches of batch_size each, drawn
    from one reshuffled pass after another (a batch can straddle two passes, so every batch is full); rng is a
    random.Random (the run's, so that a resumed run draws the same batches)."""
    steps = -(-epochs * n // batch_size)                                   # ceil
    stream = []
    while len(stream) < steps * batch_size:
        order = list(range(n))
        rng.shuffle(order)
        stream += order
    return [stream[s * batch_size:(s + 1) * batch_size] for s in range(steps)]


def round_counts(prompts, texts, rewards, kept):
    """What a round sampled and kept, as counts for the log (summed over ranks by the caller): prompts (P,),
    texts (P*N,) the completions, rewards (P, N) the verifier's, kept (P, N) bool."""
    P, N = kept.shape
    precedence = torch.tensor([task.is_precedence(p) for p in prompts])[:, None].expand(P, N)                 # (P, N)
    left_to_right = torch.tensor([texts[i] == task.demonstration(prompts[i // N], left_to_right=True)
                                  for i in range(P * N)]).view(P, N) & precedence                             # (P, N)
    correct = rewards > 0                                                                                      # (P, N)
    return {"sampled": P * N, "prompts": P, "accepted": int(correct.sum()), "solved": int(correct.any(1).sum()),
            "kept": int(kept.sum()), "kept_precedence": int((kept & precedence).sum()),
            "kept_wrong": int((kept & ~correct).sum()), "kept_left_to_right": int((kept & left_to_right).sum()),
            "missed_correct": int((correct.any(1) & ~(kept & correct).any(1)).sum())}


def hindsight_pairs(prompts, texts, ids, N):
    """Hindsight relabelling (Andrychowicz et al. 2017, "Hindsight Experience Replay", arXiv 1707.01495): every failed
    sample that exactly solves another problem, kept as a demonstration of that problem. prompts (P,), texts and ids
    (P*N,) a prompt's N samples on consecutive entries -> distinct (problem, completion ids) pairs. On this task a
    failed a+b*c= attempt that is the left-to-right derivation, '3+4=7,7*2=14#14' for 3+4*2=, is exactly the correct
    derivation of (a+b)*c= (task.hindsight_prompt), a problem the policy was never asked."""
    pairs = []
    for i, text in enumerate(texts):
        goal = task.hindsight_prompt(prompts[i // N], text)          # the problem this failure did solve, or None
        if goal is not None and (goal, tuple(ids[i])) not in pairs:
            pairs.append((goal, tuple(ids[i])))
    return pairs


def demonstrations(rng, n, precedence_share, tok):
    """A warm buffer's share: n expert demonstrations (task.demonstration, the correct derivation) of fresh training
    prompts, as (prompt, completion ids) pairs."""
    return [(p, tuple(tok.encode(task.demonstration(p)))) for p in task.sample_prompts(rng, n, precedence_share)]


def all_gather(run, items):
    """Every rank's list of items, concatenated in rank order (the list itself in one process): the kept data is
    gathered so that every rank fine-tunes on the same batches, each rank on its share of each."""
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
                   help="keep the samples the verifier accepts, or the reward model's best of N (Llama 2)")
    g.add_argument("--samples_per_prompt", type=Int(ge=1), default=4, help="N: completions sampled per prompt")
    g.add_argument("--max_per_prompt", type=Int(ge=1), default=None,
                   help="most distinct completions kept per prompt (default: 4 with --select verifier, 1 with --select rm)")
    g.add_argument("--restart", action="store_true",
                   help="fine-tune every round from the SFT weights on everything kept so far (default: continue)")
    g.add_argument("--hindsight", action="store_true",
                   help="also keep each failed a+b*c= attempt that solves (a+b)*c=, as a demonstration of that problem")
    g.add_argument("--demos", type=Float(ge=0, lt=1), default=0.0,
                   help="share of each round's fine-tuning data that is expert demonstrations of fresh prompts (a warm buffer)")
    g = p.add_argument_group("sampling")
    g.add_argument("--rounds", type=Int(ge=1), default=8, help="rounds of sample, select, fine-tune")
    g.add_argument("--prompts_per_round", type=Int(ge=1), default=256, help="P: prompts drawn per round")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0, help="sampling temperature")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=task.MAX_NEW_TOKENS, help="longest completion")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=0.5, help="share of a+b*c / a-b*c prompts")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=Int(ge=1), default=2, help="passes over each round's fine-tuning data")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="completions per fine-tuning step")
    g.add_argument("--lr", type=Float(gt=0), default=1e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0, help="clip the gradient's global norm to this")
    g = add_run_flags(p, "expert_iteration", log_every=1, eval_every=1)
    g.add_argument("--init", default=SFT_PATH, help="SFT checkpoint: the starting policy (and, with --restart, every round's)")
    g.add_argument("--rm", default=RM_PATH, help="reward model checkpoint for --select rm (reward_model.py; built if missing)")
    args = p.parse_args(argv)
    if args.max_per_prompt is None:                                # derived: the cap each selection rule starts from
        args.max_per_prompt = 4 if args.select == "verifier" else 1
    args.steps = args.rounds                                       # derived: one Run step is one round
    return args


def new_optimizer(policy, args):
    return torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))


def main(args):
    run = Run("expert_iteration", args, batch_flag="batch_size")  # device, seeds, lock, log, resume, torchrun: plumbing.py
    if args.prompts_per_round % run.world:
        raise SystemExit(f"error: --prompts_per_round {args.prompts_per_round} must split evenly over {run.world} processes")
    policy, tok = run.load_policy(args.init)        # the policy starts as the SFT policy
    sft_weights = copy.deepcopy(policy.state_dict()) if args.restart else None    # --restart: every round starts here
    rm = run.load_reward_model(args.rm, args.init).requires_grad_(False) if args.select == "rm" else None
    run.check_lengths(policy, tok, args.max_new_tokens)
    optimizer = new_optimizer(policy, args)
    ckpt = run.resume(policy, optimizer)
    kept_so_far = [(p, tuple(c)) for p, c in ckpt["kept_so_far"]] if ckpt else []  # --restart trains on all of it
    train_policy = run.ddp(policy)                  # DistributedDataParallel under torchrun, else the policy itself
    P, N = args.prompts_per_round, args.samples_per_prompt
    run.print(f"expert iteration: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {args.rounds} rounds of "
              f"{P} prompts x {N} samples, select {'the verifier-accepted' if args.select == 'verifier' else 'the reward model best-of-N'}"
              f" (at most {args.max_per_prompt} distinct per prompt), {args.epochs} epochs per round, "
              f"{'from the SFT weights on all data so far (--restart)' if args.restart else 'continuing from the current policy'}")
    if not args.resume:                             # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. sample: N completions for each of this rank's prompts from the current policy, at the temperature
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            texts, ids = task.complete(policy, tok, prompts, N, args.temperature, args.max_new_tokens,
                                       generator=run.gen, return_ids=True)          # P*N, a prompt's N consecutive
        run.samples += P * N
        rewards = torch.tensor([task.reward(prompts[i // N], c) for i, c in enumerate(texts)]).view(-1, N)  # (P, N)

        # 2. select: the distinct accepted samples (verifier), or the reward model's best of N; at most
        #    --max_per_prompt per prompt
        if args.select == "verifier":
            scores, threshold = rewards, 1.0
        else:
            with run.autocast:
                scores = reward_model_scores(rm, tok, [p for p in prompts for _ in range(N)], ids, run.device)
            scores, threshold = scores.view(-1, N), None                             # (P, N) R(x, y)
        kept = select(scores, [[tuple(c) for c in ids[i * N:(i + 1) * N]] for i in range(len(prompts))],
                      args.max_per_prompt, threshold)                                # (P, N) bool

        # 3. the round's fine-tuning data: (prompt, completion token ids) pairs, every rank's; --hindsight adds the
        #    failures relabelled with the problem they solved, --demos expert demonstrations; with --restart, all the
        #    pairs kept so far, and the policy back at the SFT weights with a fresh optimiser
        data = all_gather(run, [(prompts[i // N], tuple(ids[i])) for i in kept.view(-1).nonzero().view(-1).tolist()])
        relabelled = all_gather(run, hindsight_pairs(prompts, texts, ids, N)) if args.hindsight else []
        demos = demonstrations(run.rng, round(args.demos / (1 - args.demos) * (len(data) + len(relabelled))),
                               args.precedence_share, tok)                   # the same on every rank: run.rng is
        data = data + relabelled + demos                                     # --demos: their share of the round's data
        if args.restart:
            kept_so_far += data
            data = kept_so_far
            policy.load_state_dict(sft_weights)
            optimizer = new_optimizer(policy, args)

        # 4. fine-tune by teacher forcing: the mean NLL of the kept completions' tokens (sft.py's loss), --epochs
        #    passes in batches of --batch_size, each batch shared among the ranks and the --grad_accum micro-batches
        losses, grad_norm = [], torch.tensor(0.0)
        for batch in (minibatches(len(data), args.batch_size, args.epochs, run.rng) if data else []):
            pairs = run.shard([data[j] for j in batch])                              # this rank's share
            tokens, attn, loss_mask = task.completion_batch([p for p, _ in pairs], [c for _, c in pairs], tok, run.device)
            n_tokens = run.all_sum(loss_mask.sum())                                  # the whole batch's
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for rows in run.micro_batches(len(tokens), train_policy):
                with run.autocast:
                    logits = train_policy(tokens[rows, :-1], attn[rows, :-1])       # (b, T-1, V)
                logp = logprobs(logits, tokens[rows, 1:])                            # (b, T-1) log pi(y_t | x, y_<t)
                part = -masked_mean(logp, loss_mask[rows], n_tokens)                 # this part's share of the mean NLL
                run.check_finite(part, f"lower --lr (now {args.lr})")
                part.backward()
                loss += part.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            optimizer.step()
            losses.append(run.all_sum(loss).item())
        run.step += 1

        # 5. log, evaluate, checkpoint (counts summed over all ranks)
        if run.log_due():
            c = {k: run.all_sum(v).item() for k, v in round_counts(prompts, texts, rewards, kept).items()}
            kept_n = max(c["kept"], 1)
            metrics = {"reward_mean": c["accepted"] / c["sampled"], "solved": c["solved"] / c["prompts"],
                       "kept_fraction": c["kept"] / c["sampled"], "kept_per_prompt": c["kept"] / c["prompts"],
                       "kept_precedence_share": c["kept_precedence"] / kept_n, "kept_wrong": c["kept_wrong"] / kept_n,
                       "missed_correct": c["missed_correct"] / c["prompts"],
                       "kept_left_to_right": c["kept_left_to_right"] / max(c["kept_precedence"], 1),
                       "data_size": len(data), "relabelled": len(relabelled), "demos": len(demos), "ft_steps": len(losses),
                       "loss": sum(losses) / max(len(losses), 1), "grad_norm": grad_norm.item()}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"accepted {metrics['reward_mean']:.3f} | kept {metrics['kept_fraction']:.3f} "
                             f"({metrics['kept_per_prompt']:.2f}/prompt, precedence {metrics['kept_precedence_share']:.2f}, "
                             f"wrong {metrics['kept_wrong']:.3f}) | data {len(data)} | {len(losses)} steps, loss "
                             f"{metrics['loss']:.4f}")
        if run.eval_due():
            run.save(policy, optimizer, kept_so_far=[[p, list(c)] for p, c in kept_so_far])
    run.finish(policy, tok, optimizer, kept_so_far=[[p, list(c)] for p, c in kept_so_far])


if __name__ == "__main__":
    main(parse_args())
