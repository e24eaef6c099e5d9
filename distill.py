"""
On-policy distillation: a small student samples, a strong teacher grades every token, the student
moves towards it.

Each step the student samples completions for training prompts; the frozen teacher scores the same
tokens (its logits at each position of the student's own completion, no gradient); the loss is the
reverse KL from the student to the teacher at every completion token. Every token carries a signal
(how much more the student likes it than the teacher does), where RL gets one reward per
completion; and the states are the student's own, so it learns to recover from its own mistakes,
which imitating the teacher's completions (SFT on them) never shows it.

Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD), arXiv 2306.13649, with the
reverse KL (their beta = 1) and lambda = 1 (student samples only); Thinking Machines 2025,
"On-Policy Distillation" (the per-token reverse KL as the loss, one sampled token). At completion
token t, ls, lt the student's and teacher's log-softmax (at --temperature), y the sampled token, sg
stop-gradient, the loss the mean over the step's completion tokens of:
    exact  KL_t = sum_v exp(ls_v) (ls_v - lt_v)                  (kernels.kl: the whole vocabulary)
    k1     sg(ls_y - lt_y) ls_y         gradient unbiased for grad KL_t (y ~ student); value not KL
    k3     r - 1 - log r, log r = lt_y - ls_y   unbiased for KL_t; mean gradient KL(lt || ls)'s
    topk   KL_t over the teacher's top-k tokens plus a tail bin of each side's rest (<= KL_t)
    + reward_weight * -(r_i - mean_j r_j) ls_y   (optional: REINFORCE on the verifier, baselined)

Deviations and choices:
- The prefixes are the student's samples, held fixed: the loss is sum_t KL_t, not the sequence KL
  (whose gradient also flows through later tokens' sampling), as GKD and Thinking Machines.
- Temperature: both sides' logits divided by the sampling --temperature (default 1): the KL is 0
  only where the student's logits equal the teacher's (up to a constant), at any temperature.
- --estimator exact by default: here (V = 258) it learns most per completion, for 20 ms a step.
- The teacher's accuracy is logged as its greedy answers on the step's prompts (at log steps only).
- Small scale: a 0.12M-parameter student (sft.py --n_layer 2 --n_embd 64), the 0.44M teacher.

Shapes: P prompts, G samples each, B = P*G rows; T time (Tp prompt, Tn completion); V vocabulary.
Run (about 2.5 minutes on 2 CPU cores once the teacher out/expert_iteration.pt and the student
out/sft_small/sft.pt exist; built first if missing):
    python distill.py
    python distill.py --estimator k1         # or k3, topk --topk 8
    python distill.py --reward_weight 1      # the verifier's policy gradient beside the KL
    python distill.py --resume               # continue from out/distill.pt up to --steps
Metrics: out/distill/metrics.jsonl (docs/metrics.md); experiments/README.md compares estimators.
"""
import os

import torch

import task
from kernels import entropy, kl, logprobs
from lora import trainable
from model import completion_logits, masked_mean
from plumbing import Run
from plumbing.flags import TEMPERATURE, Float, Int, add_run_flags, default_path, parser, task_flags
from plumbing.loading import build_missing, read_checkpoint

TEACHER_PATH = os.path.join("out", "expert_iteration.pt")  # the best RL policy of the results table
STUDENT_PATH = os.path.join("out", "sft_small", "sft.pt")  # sft.py with the flags below
STUDENT_FLAGS = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--lr", "3e-3"]   # 4x smaller


# -----------------------------------------------------------------------------
# The algorithm: the per-token reverse KL to the teacher, exact or estimated

def distillation_loss(student_logits, teacher_logits, tokens, mask, estimator="exact", topk=None,
                      temperature=1.0, num_tokens=None):
    """Mean over completion tokens of KL(student || teacher) or an estimator of it -> scalar.
    student_logits, teacher_logits (B, T, V) (the teacher's never get gradient); tokens (B, T) the
    student's sampled tokens; mask (B, T) 1.0 on completion tokens; estimator "exact", "k1", "k3" or
    "topk" (with topk = k >= 1). num_tokens: the whole step's count when this batch is a part of it
    (a micro-batch, a rank's share)."""
    teacher_logits = teacher_logits.detach()                           # a fixed target
    real = mask > 0                                                    # (B, T) bool
    if estimator == "exact":
        # sum_v p_v (ls_v - lt_v)   (B, T)
        per_token = kl(student_logits, teacher_logits, temperature)
    elif estimator in ("k1", "k3"):
        ls_y = logprobs(student_logits, tokens, temperature)           # (B, T) log p_student(y)
        lt_y = logprobs(teacher_logits, tokens, temperature)           # (B, T) log p_teacher(y)
        if estimator == "k1":
            per_token = (ls_y - lt_y).detach() * ls_y                  # sg(ls_y - lt_y) ls_y
        else:
            log_r = torch.where(real, lt_y - ls_y, 0.0)    # log r = log p_teacher(y) / p_student(y)
            per_token = torch.exp(log_r) - 1 - log_r                   # r - 1 - log r
    elif estimator == "topk":
        if topk is None or topk < 1:
            raise ValueError(f"estimator 'topk' needs topk >= 1; got topk = {topk}")
        per_token = topk_kl(student_logits, teacher_logits, topk, temperature)
    else:
        raise ValueError(f"estimator {estimator!r} is unknown; allowed: 'exact', 'k1', "
                         f"'k3', 'topk'")
    n_tokens = real.sum().clamp(min=1) if num_tokens is None else num_tokens
    return torch.where(real, per_token, 0.0).sum() / n_tokens           # 1/sum_i |o_i| sum_i sum_t


def topk_kl(student_logits, teacher_logits, k, temperature=1.0):
    """KL(student || teacher) on k + 1 bins, (..., V) -> (...): the teacher's k most likely tokens,
    and one tail bin holding the rest of each side's probability. A coarsening, so 0 <= topk_kl <=
    KL, equal for k >= V - 1; the teacher need only send k log-probs and its tail's. Both
    log-softmaxes are materialised (V is small here)."""
    ls = torch.log_softmax(student_logits.float() / temperature, dim=-1)   # (..., V)
    lt = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    top = lt.topk(min(k, lt.size(-1)), dim=-1).indices                # (..., k) the teacher's top k
    ls_k, lt_k = ls.gather(-1, top), lt.gather(-1, top)                    # (..., k)
    head = (ls_k.exp() * (ls_k - lt_k)).sum(-1)                   # sum_{v in top} p_v (ls_v - lt_v)
    if k >= lt.size(-1):
        return head                                                        # no tail
    in_top = torch.zeros_like(lt, dtype=torch.bool).scatter_(-1, top, True)
    ls_tail = ls.masked_fill(in_top, float("-inf")).logsumexp(-1)          # log(1 - sum_top p_v)
    lt_tail = lt.masked_fill(in_top, float("-inf")).logsumexp(-1)          # log(1 - sum_top q_v)
    return head + ls_tail.exp() * (ls_tail - lt_tail)           # + p_tail (log p_tail - log q_tail)


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--estimator", default="exact", choices=["exact", "k1", "k3", "topk"],
                   help="the per-token reverse KL: exact over the vocabulary, or estimated from "
                        "the sampled token")
    g.add_argument("--topk", type=Int(ge=1), default=8,
                   help="with --estimator topk: the teacher's tokens kept")
    g.add_argument("--reward_weight", type=Float(ge=0), default=0.0,
                   help="weight of the verifier's REINFORCE term beside the KL (0: pure "
                        "distillation)")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=200,
                   help="steps (one batch of student samples each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=64,
                   help="P: prompts drawn per step")
    g.add_argument("--group_size", type=Int(ge=1), default=1,
                   help="G: completions sampled per prompt")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; both KL sides use it")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=1e-4, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "distill", log_every=5, eval_every=25)
    g.add_argument("--init", default=STUDENT_PATH,
                   help="the student's start: a small SFT policy (built if missing)")
    g.add_argument("--teacher", default=TEACHER_PATH,
                   help="the teacher: any policy checkpoint with the student's tokenizer "
                        "(default built by expert_iteration.py if missing)")
    return p.parse_args(argv)


class DistillRun(Run):
    """plumbing.Run with this script's checkpoint flag, --teacher: checked before any work, its
    default built if missing. --init is checked in load_models (its default is a folder's sft.pt,
    which Run's check cannot name)."""
    CHECKPOINT_FLAGS = {"teacher": (TEACHER_PATH, "expert_iteration.py")}


def load_models(run, args):
    """Build what is missing (rank 0), then (student, tokenizer, teacher); a teacher with another
    vocabulary is one error line naming both."""
    if os.path.exists(args.init):
        read_checkpoint(args.init, "--init")             # unreadable: one line, before any building
    if run.is_main:
        build_missing(args.init, default_path(STUDENT_PATH, args),
                      ["sft.py", *STUDENT_FLAGS, *task_flags(args)], args.device)
        build_missing(args.teacher, default_path(TEACHER_PATH, args),
                      ["expert_iteration.py", *task_flags(args)], args.device)
    run.barrier()
    policy, tok = run.load_policy(args.init)
    teacher, teacher_tok = run.load(args.teacher)
    teacher.requires_grad_(False)
    if (teacher_tok.name, teacher.config.vocab_size) != (tok.name, policy.config.vocab_size):
        raise SystemExit(f"error: --teacher {args.teacher} has tokenizer {teacher_tok.name!r} "
                         f"({teacher.config.vocab_size} tokens) but the student {args.init} "
                         f"has {tok.name!r} ({policy.config.vocab_size} tokens); distillation "
                         f"compares them token by token: pass a teacher with the "
                         f"student's tokenizer")
    if args.estimator == "topk" and args.topk > tok.vocab_size:
        raise SystemExit(f"error: --topk {args.topk} exceeds the vocabulary ({tok.vocab_size} "
                         f"tokens); allowed: 1 to {tok.vocab_size}")
    for model in (policy, teacher):
        run.check_lengths(model, tok, args.max_new_tokens)
    return policy, tok, teacher


def main(args):
    # device, seeds, lock, log, resume: plumbing/run.py
    run = DistillRun("distill", args, batch_flag="prompts_per_step")
    policy, tok, teacher = load_models(run, args)
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    # the teacher's held-out accuracy, once per run (before resume: run.evaluate records the step it
    # evaluated)
    teacher_eval = (run.resume_ckpt.get("teacher_eval", {}) if args.resume
                    else run.evaluate(teacher, tok))
    run.resume(policy, optimizer)
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    run.print(f"distillation: student {policy.num_params() / 1e6:.2f}M parameters "
              f"({args.init}), teacher {teacher.num_params() / 1e6:.2f}M ({args.teacher}, "
              f"held-out greedy {teacher_eval.get('eval_accuracy', float('nan')):.3f}) "
              f"on {run.device}; {args.steps} steps of {P} prompts x {G} samples, "
              f"{args.estimator}{f' {args.topk}' if args.estimator == 'topk' else ''} "
              f"reverse KL, reward weight {args.reward_weight}")
    if not args.resume:                             # a fresh run: the starting student is step 0
        run.log_start(run.evaluate(policy, tok), "the student (small SFT policy)")

    while run.training():
        # 1. rollout: the student samples G completions per prompt (scored by the verifier, for the
        #    log and the optional reward term)
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            batch, sampler_logp, sampler_hidden = task.rollout(     # (B, Tn), (B, Tn, C) logged
                policy, tok, prompts, G, temp, args.max_new_tokens, 0.0, run.gen,
                return_logprobs=True, return_hidden=run.logging())
        # (B, Tp), (B, Tn), (B,); B = P*G
        prompt, prompt_mask, tokens, mask, truncated, rewards, _ = batch
        run.samples += P * G

        # 2. the verifier's advantage for the optional REINFORCE term: the reward minus the step's
        #    mean (no groups)
        n_tokens = run.all_sum(mask.sum())                             # the step's, over every rank
        # (B,) r_i - mean_j r_j
        advantages = rewards - run.all_sum(rewards.sum()) / run.all_sum(len(rewards))

        # 3. the teacher scores the student's tokens (no gradient); the loss over the
        #    --grad_accum micro-batches, normalised by the whole step's token count
        loss = kl_exact = kl_forward = ent = sampler_kl = 0.0
        sampler_diff = torch.zeros_like(mask)                          # (B, Tn)
        for rows in run.micro_batches(len(mask), train_policy):
            with torch.no_grad(), run.autocast:
                teacher_logits = completion_logits(teacher, prompt[rows], prompt_mask[rows],
                                                   tokens[rows], mask[rows])
            with run.autocast:
                logits = completion_logits(train_policy, prompt[rows], prompt_mask[rows],
                                           tokens[rows], mask[rows])
            part = distillation_loss(logits, teacher_logits, tokens[rows], mask[rows],
                                     args.estimator, args.topk, temp, n_tokens)
            if args.reward_weight > 0:                               # - w A_i log p_student(y_t)
                logp = logprobs(logits, tokens[rows], temp)          # (b, Tn)
                part = part - args.reward_weight * masked_mean(advantages[rows, None] * logp,
                                                               mask[rows], n_tokens)
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss = loss + part.detach()
            with torch.no_grad():                                    # for the log: both KLs exactly
                real, s = mask[rows] > 0, logits.detach()
                # KL(student||teacher)
                kl_exact += torch.where(real, kl(s, teacher_logits, temp), 0.0).sum() / n_tokens
                kl_forward += torch.where(real, kl(teacher_logits, s, temp), 0.0).sum() / n_tokens
                ent += torch.where(real, entropy(s, temp), 0.0).sum() / n_tokens
                sampler_diff[rows] = (logprobs(s, tokens[rows], temp) - sampler_logp[rows]).abs()
                if sampler_hidden is not None:           # KL(sampler || trainer), the support
                    with run.autocast:
                        s_logits = policy.logits(sampler_hidden[rows])        # (b, Tn, V)
                    sampler_kl += torch.where(real, kl(s_logits, s, temp), 0.0).sum() / n_tokens
        grad_norm = run.clip_grad_norm(train_policy, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.tokens += int(n_tokens)

        # 4. log (the teacher's greedy answers to this step's prompts beside the student's samples),
        #    evaluate, save
        if run.log_due():
            with run.autocast:
                teacher_batch = task.rollout(teacher, tok, prompts, 1, 0.0, args.max_new_tokens)
            metrics = {"loss": run.all_sum(loss).item(), "kl_exact": run.all_sum(kl_exact).item(),
                       "kl_forward": run.all_sum(kl_forward).item(),
                       "entropy": run.all_sum(ent).item(), "reward_mean": run.mean(rewards),
                       "teacher_reward": run.mean(teacher_batch.rewards),
                       "completion_len": run.mean(mask.sum(1)),
                       "truncated": run.mean(truncated.float()), "grad_norm": grad_norm.item(),
                       "sampler_logp_diff": run.max(torch.where(mask > 0, sampler_diff, 0.0)),
                       "sampler_kl": run.all_sum(sampler_kl).item()}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"kl {metrics['kl_exact']:.4f} | "
                             f"forward kl {metrics['kl_forward']:.4f} | "
                             f"reward {metrics['reward_mean']:.3f} "
                             f"(teacher {metrics['teacher_reward']:.3f}) | "
                             f"ent {metrics['entropy']:.3f} | "
                             f"len {metrics['completion_len']:.1f} | "
                             f"gnorm {metrics['grad_norm']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer, teacher_eval=teacher_eval)
    run.finish(policy, tok, optimizer, summary=summary(run, policy, tok, teacher_eval),
               teacher_eval=teacher_eval)


def summary(run, policy, tok, teacher_eval):
    """The final line: the student's held-out greedy accuracy before -> after, the teacher's, the
    gap closed."""
    if not run.is_main or run.interrupted:
        return None
    final = run.last_eval if run.eval_step == run.step else run.evaluate(policy, tok)
    before, after = (run.before or {}).get("eval_accuracy", float("nan")), final["eval_accuracy"]
    teacher = teacher_eval.get("eval_accuracy", float("nan"))
    gap = teacher - before
    closed = (f"{(after - before) / gap:.0%} of the gap closed" if gap == gap and gap != 0
              else "no gap to close" if gap == 0 else "the gap unknown")
    return (f"student held-out greedy accuracy {before:.3f} -> {after:.3f} "
            f"(teacher {teacher:.3f}: {closed}) | sampled pass@1 {final['eval_pass_at_1']:.3f}")


if __name__ == "__main__":
    main(parse_args())
