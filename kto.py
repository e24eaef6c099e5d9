"""
KTO: Kahneman-Tversky Optimisation, preference learning from completions labelled good or bad,
without pairs.

Each training example is one completion, sampled from the SFT policy and labelled desirable
(correct) or undesirable (wrong) by the verifier. The policy's log-ratio to the frozen SFT
reference is an implicit reward, as in DPO; KTO pushes a desirable completion's reward above a
reference point z0 and an undesirable one's below it, each through a sigmoid that saturates (a
prospect-theory value). No pairs, no sampling during training, no reward model, no value.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", arXiv
2402.01306, eq. 8:
    r(x, y) = log pi(y|x) - log pi_ref(y|x)
    z0 = max(0, mean over the batch of log pi(y'|x) - log pi_ref(y'|x))   (mismatched pairs: KL)
    v(x, y) = lambda_D sigmoid(beta (r - z0)) if y is desirable, lambda_U sigmoid(beta (z0 - r))
    L_KTO = mean over examples of lambda_y - v(x, y)
z0 is detached (no gradient flows through it). The data are imbalanced: the SFT policy is right on
about 70 % of its samples (1,436 of 2,048 at seed 0, 2.35 desirable per undesirable); the paper
asks for lambda_D n_D / (lambda_U n_U) in [1, 4/3]: lambda_D = 1 and, by default,
lambda_U = n_D / n_U (the ratio 1), set from the sampled labels and printed at start-up.

Deviations and choices the paper leaves open:
- The mismatched pairs: the step's batch rotated by one (prompt k with completion k+1), over every
  process's examples, as TRL's KTOTrainer; their policy log-probs are taken without gradient.
- log pi(y|x) sums the completion's token log-probs and its EOS, at temperature 1 (--seq_logp
  mean averages them).
- The data are sampled again, from --seed, on --resume; the reference log-probs are computed once.
- AdamW, a linear warm-up then constant; lr 1e-5 for 200 steps of 64 (6 epochs), beta 0.1 (the
  paper's); at 3e-5 and 1e-4 the undesirable log-probs fall fast, the desirable ones follow,
  accuracy swings 10-25 points.

Shapes: B examples per step; T tokens; V vocabulary.

Run:
    python kto.py                     # builds out/sft.pt first if it is missing; writes out/kto.pt
    python kto.py --resume            # continue from out/kto.pt up to --steps
Metrics: out/kto/metrics.jsonl (docs/metrics.md says what each means).
"""
import random

import torch

import task
from kernels import kl
from lora import trainable
from model import token_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser


# -----------------------------------------------------------------------------
# The algorithm

def sequence_logprobs(token_logp, mask, average=False):
    """log pi(y|x) per sequence: token_logp, mask (B, T), mask 1.0 on completion tokens -> (B,),
    their sum (average=True: their mean)."""
    total = torch.where(mask > 0, token_logp, 0.0).sum(-1)           # (B,) masked values never leak
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def kto_loss(policy_logp, ref_logp, desirable, ref_kl, beta=0.1, lambda_d=1.0, lambda_u=1.0):
    """KTO loss per example (eq. 8; L_KTO is its mean) and the implicit rewards; inputs (B,)
    sequence log-probs, desirable (B,) bool, ref_kl the reference point z0 (detached here). Returns
    (losses (B,), rewards (B,)), rewards = beta * (log pi - log pi_ref)."""
    # z0, no gradient
    z0 = torch.as_tensor(ref_kl, dtype=policy_logp.dtype, device=policy_logp.device).detach()
    r = policy_logp - ref_logp                                             # r(x, y) = log pi/pi_ref
    v = torch.where(desirable,
                    lambda_d * torch.sigmoid(beta * (r - z0)),     # lambda_D sigmoid(beta (r - z0))
                    lambda_u * torch.sigmoid(beta * (z0 - r)))     # lambda_U sigmoid(beta (z0 - r))
    lambda_y = torch.full_like(v, lambda_u).masked_fill(desirable, lambda_d)  # lambda_D or lambda_U
    return lambda_y - v, beta * r


# -----------------------------------------------------------------------------
# Completions and pairs: sequence log-probs, batches, held-out metrics

def example_logprobs(model, prompts, completions, tok, device, autocast, average=False):
    """Sequence log-probs log pi(y|x) (B,) of each prompt with its completion (token ids as
    task.completion_batch takes them: as sampled, the stop token included when one ended it) under
    `model`."""
    # (B, T), (B, T), (B, T-1)
    tokens, attn, mask = task.completion_batch(prompts, completions, tok, device)
    with autocast:                                                        # (B, T-1) token log-probs
        logp = token_logprobs(model, tokens[:, :-1], attn[:, :-1], tokens[:, 1:])
    return sequence_logprobs(logp, mask, average)                         # (B,)


@torch.no_grad()
def all_logprobs(model, prompts, completions, tok, device, autocast, average=False, chunk=256):
    """example_logprobs of every example under `model` (frozen, or scored without gradient), in
    chunks: (N,)."""
    return torch.cat([example_logprobs(model, prompts[i:i + chunk], completions[i:i + chunk], tok,
                                       device, autocast, average)
                      for i in range(0, len(prompts), chunk)])


def sample_examples(policy, tok, prompts, temperature, generator, autocast, chunk=256):
    """One completion per prompt from `policy` (task.rollout), labelled by the verifier: (ids,
    desirable (N,) bool); ids are the sampled token ids, the stop token included when one ended the
    sample (none if it ran out of tokens: no EOS is trained that was never sampled)."""
    ids, correct = [], []
    for i in range(0, len(prompts), chunk):
        with autocast:
            batch = task.rollout(policy, tok, prompts[i:i + chunk], 1, temperature,
                                 generator=generator)
        ids += [[t for t, m in zip(row, keep) if m]
                for row, keep in zip(batch.tokens.tolist(), batch.mask.tolist())]
        correct.append(batch.correct)
    return ids, torch.cat(correct)


def batch_indices(step, n_examples, batch_size, seed):
    """The step's examples: epoch e is a permutation seeded by (seed, e), so a resumed run sees the
    same batches."""
    epoch, i = divmod(step, n_examples // batch_size)
    perm = random.Random(seed * 1_000_003 + epoch).sample(range(n_examples), n_examples)
    return perm[i * batch_size:(i + 1) * batch_size]


@torch.no_grad()
def evaluate_pairs(model, reference, tok, pairs, ref_chosen, ref_rejected, beta, device, autocast,
                   average=False, chunk=256):
    """Held-out pair metrics (task.preference_dataset's held-out pairs): implicit-reward accuracy
    and margin, the policy's log-probs of chosen and rejected, and the exact KL(pi || pi_ref) summed
    over the chosen completions."""
    was_training = model.training
    model.eval()
    prompts, n = [p["prompt"] for p in pairs], len(pairs)
    # (2N,) chosen, then rejected
    logp = all_logprobs(model, prompts * 2, [p["chosen_ids"] for p in pairs]
                        + [p["rejected_ids"] for p in pairs], tok, device, autocast, average, chunk)
    chosen, rejected = logp[:n], logp[n:]
    r_c, r_r = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    kls = []
    for i in range(0, n, chunk):
        tokens, attn, mask = task.completion_batch(
            prompts[i:i + chunk], [p["chosen_ids"] for p in pairs[i:i + chunk]], tok, device)
        with autocast:
            logits, ref_logits = (model(tokens[:, :-1], attn[:, :-1]),
                                  reference(tokens[:, :-1], attn[:, :-1]))
        # (n,) over completion tokens
        kls.append(torch.where(mask > 0, kl(logits, ref_logits), 0.0).sum(-1))
    model.train(was_training)
    return {"eval_reward_accuracy": (r_c > r_r).float().mean().item(),
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
                   help="KTO beta: the implicit reward's scale in the sigmoid")
    g.add_argument("--lambda_d", type=Float(gt=0), default=1.0,
                   help="KTO lambda_D: the desirable examples' weight")
    g.add_argument("--lambda_u", type=Float(gt=0), default=None,
                   help="KTO lambda_U: the undesirable examples' weight (default: lambda_D n_D / "
                        "n_U, set at start-up)")
    g.add_argument("--seq_logp", choices=("sum", "mean"), default="sum",
                   help="log pi(y|x): the sum over the completion's tokens (the paper) or "
                        "their mean")
    g.add_argument("--n_examples", type=Int(ge=2), default=2048,
                   help="training examples: one completion sampled from the SFT policy on each "
                        "of as many prompts")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="temperature the examples are sampled at")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=Int(ge=1), default=200, help="optimisation steps")
    g.add_argument("--batch_size", type=Int(ge=2), default=64, help="examples per step")
    g.add_argument("--lr", type=Float(gt=0), default=1e-5, help="AdamW learning rate after warm-up")
    g.add_argument("--warmup", type=Int(ge=0), default=20,
                   help="linear warm-up steps, then constant")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "kto", log_every=10, eval_every=50)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    args = p.parse_args(argv)
    if args.batch_size > args.n_examples:
        p.error(f"--batch_size {args.batch_size} exceeds --n_examples {args.n_examples}; it "
                f"must be at most n_examples")
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("kto", args, batch_flag="batch_size")
    model, tok = run.load_policy(args.init)         # the policy starts as the SFT policy ...
    reference = run.reference(args.init, model)     # ... which stays frozen as pi_ref
    train_model = run.ddp(model)  # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(trainable(train_model), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    # The data: one completion per training prompt, sampled from the reference policy with its own
    # seed (the same on every process and on --resume), labelled by the verifier; their reference
    # log-probs, computed once. The held-out pairs are task.preference_dataset's (its cache), for
    # metrics comparable with dpo.py's.
    prompts = task.sample_prompts(random.Random(args.seed), args.n_examples)
    gen = torch.Generator(device=run.device).manual_seed(args.seed)
    # N, (N,)
    ids, desirable = sample_examples(reference, tok, prompts, args.temperature, gen, run.autocast)
    eval_pairs = task.held_out_pairs(reference, tok, args.seed, args.out, args.eval_n)
    run.samples = len(prompts)        # the examples' cost: 1 completion sampled per training prompt
    average = args.seq_logp == "mean"
    # (N,)
    ref_logp_all = all_logprobs(reference, prompts, ids, tok, run.device, run.autocast, average)
    eval_ref = all_logprobs(reference, [p["prompt"] for p in eval_pairs] * 2,
                            [p["chosen_ids"] for p in eval_pairs]
                            + [p["rejected_ids"] for p in eval_pairs],
                            tok, run.device, run.autocast, average)
    eval_ref = eval_ref[:len(eval_pairs)], eval_ref[len(eval_pairs):]
    n_d, n_u = int(desirable.sum()), int((~desirable).sum())
    lambda_d = args.lambda_d
    # derived: lambda_D n_D / (lambda_U n_U) = 1
    lambda_u = args.lambda_u or lambda_d * n_d / max(n_u, 1)
    run.print(f"KTO: {model.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{len(prompts)} examples: {n_d} desirable, {n_u} undesirable "
              f"({n_d / max(n_u, 1):.2f} to 1), {args.steps} steps of {args.batch_size}, "
              f"log pi {args.seq_logp}, beta {args.beta}, lambda_D {lambda_d}, "
              f"lambda_U {lambda_u:.3f}{'' if args.lambda_u else ' (derived)'}: "
              f"lambda_D n_D / (lambda_U n_U) = {lambda_d * n_d / max(lambda_u * n_u, 1e-12):.2f} "
              f"(the paper: 1 to 4/3)")
    if not args.resume and run.is_main:             # a fresh run: the starting policy is step 0
        e = {**run.evaluate(model, tok),
             **evaluate_pairs(model, reference, tok, eval_pairs, *eval_ref, args.beta, run.device,
                              run.autocast, average)}
        run.log_start(e, f"{pairs_line(e)} (the SFT policy)")

    model.train()
    while run.training():
        # 1. the step's examples, their mismatched pairs (prompt k, completion k+1 of the whole
        #    step's batch), and the learning rate: linear warm-up, then constant
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (run.step + 1) / max(args.warmup, 1))
        step_idx = batch_indices(run.step, len(prompts), args.batch_size, args.seed)
        # this rank's share of both
        idx, other = run.shard(step_idx), run.shard(step_idx[1:] + step_idx[:1])
        x, y = [prompts[i] for i in idx], [ids[i] for i in idx]

        # 2. the reference point z0: the KL estimate on the mismatched pairs, over every rank's,
        #    without gradient
        y_mismatched = [ids[j] for j in other]
        kl_sum = 0.0
        for rows in run.micro_batches(len(idx)):
            xs, ys = [x[j] for j in rows.tolist()], [y_mismatched[j] for j in rows.tolist()]
            with torch.no_grad():
                kl_sum += (example_logprobs(model, xs, ys, tok, run.device, run.autocast, average)
                           - example_logprobs(reference, xs, ys, tok, run.device, run.autocast,
                                              average)).sum()
        n_examples = run.all_sum(len(idx))
        kl_estimate = run.all_sum(kl_sum) / n_examples              # mean log pi(y'|x)/pi_ref(y'|x)
        z0 = kl_estimate.clamp(min=0.0)                             # z0 = max(0, KL estimate)

        # 3. the loss: the mean over every rank's examples, over the --grad_accum micro-batches
        ref_logp, labels = ref_logp_all[idx], desirable[idx]                 # (B,), (B,)
        optimizer.zero_grad(set_to_none=True)
        loss, parts = 0.0, []
        for rows in run.micro_batches(len(idx), train_model):
            policy_logp = example_logprobs(train_model, [x[j] for j in rows.tolist()],
                                           [y[j] for j in rows.tolist()], tok, run.device,
                                           run.autocast, average)                    # (b,)
            losses, rewards = kto_loss(policy_logp, ref_logp[rows], labels[rows], z0, args.beta,
                                       lambda_d, lambda_u)
            part = losses.sum() / n_examples                         # this part's share of the loss
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss = loss + part.detach()
            parts.append((policy_logp.detach(), rewards.detach()))
        policy_logp, rewards = (torch.cat(t) for t in zip(*parts))          # (B,)
        grad_norm = run.clip_grad_norm(train_model, args.grad_clip)
        optimizer.step()
        run.step += 1
        run.tokens += args.batch_size

        # 4. log, evaluate, checkpoint
        if run.log_due():
            good = labels.float()
            metrics = {"epoch": run.step / (len(prompts) // args.batch_size),
                       "loss": run.all_sum(loss).item(),
                       "lr": optimizer.param_groups[0]["lr"], "z0": z0.item(),
                       "kl_estimate": kl_estimate.item(),
                       "desirable_share": run.mean(good),
                       "desirable_reward": run.mean(rewards, good),        # beta r(x, y), desirable
                       # beta r(x, y), undesirable
                       "undesirable_reward": run.mean(rewards, 1.0 - good),
                       "desirable_logp": run.mean(policy_logp, good),
                       "undesirable_logp": run.mean(policy_logp, 1.0 - good),
                       "grad_norm": grad_norm.item()}
            line = (f"loss {metrics['loss']:.4f} | z0 {metrics['z0']:.3f} | reward "
                    f"desirable {metrics['desirable_reward']:+.3f} "
                    f"undesirable {metrics['undesirable_reward']:+.3f} | logp "
                    f"desirable {metrics['desirable_logp']:.2f} "
                    f"undesirable {metrics['undesirable_logp']:.2f}")
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
