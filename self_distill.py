"""
Self-distillation: the policy, shown the verified answer, teaches itself without it.

Each step the policy samples completions; the same weights then score those tokens twice: as the
student from the prompt alone (with gradient), and as the teacher from the prompt with its
privileged context ahead of it (task.privileged: the verified answer), without gradient. The loss
is the reverse KL from student to teacher at every completion token: what the model writes
knowing the answer becomes what it writes without it. One model, a signal at every token of every
sample, the wrong ones too.

On-policy self-distillation with the ground truth as the privileged context, as SDFT (Shenfeld et
al. 2026, "Self-Distillation Enables Continual Learning", arXiv 2601.19897) and OPSD; SDPO (Hubotter
et al. 2026, "Reinforcement Learning via Self-Distillation", arXiv 2601.20802) puts the verifier's
feedback there instead. At completion token t, ls and lt the student's (prompt x) and teacher's
(privileged c + x) log-softmax at --temperature, the loss is the mean over completion tokens of
    KL_t = sum_v exp(ls_v) (ls_v - sg(lt_v))             (kernels.kl: exact over the vocabulary)
The privileged context: arithmetic, the answer ('(answer: 11) 3+4*2='); Countdown, the
demonstrator's expression that reaches the target; GSM8K, the number after '####'.

Against distill.py: the teacher is the student's own weights, a target that moves as it learns;
against expert iteration: no sample need be right; every token moves towards the hinted choice.

Deviations and choices:
- The tiny policy never read a hint: it starts from sft.py --hint_share 0.25 (a quarter of the
  demonstrations carry the answer), built if missing; a pretrained model reads one in context.
- The teacher is the current weights under no_grad: OPSD's choice. SDFT's public recipes use an
  EMA of the student (Tinker's) or the frozen start (TRL's); not offered (a second model to keep).

Shapes: P prompts, G samples each, B = P*G rows; T time (Tp, Tp' the two prompts, Tn completion).
Run (about 2 minutes on 2 CPU cores once out/sft_hint/sft.pt exists; built first if missing):
    python self_distill.py
    python self_distill.py --resume          # continue from out/self_distill.pt up to --steps
Metrics: out/self_distill/metrics.jsonl (docs/metrics.md).
"""
import os

import torch

import task
from kernels import entropy, kl, logprobs
from lora import trainable
from model import completion_logits
from plumbing import Run
from plumbing.flags import TEMPERATURE, Float, Int, add_run_flags, default_path, parser, task_flags
from plumbing.loading import build_missing

HINT_SFT_PATH = os.path.join("out", "sft_hint", "sft.pt")
HINT_SFT_FLAGS = ["--hint_share", "0.25"]


# -----------------------------------------------------------------------------
# The algorithm: the reverse KL from the student to itself with the privileged context

def self_distillation_loss(student_logits, teacher_logits, mask, temperature=1.0, num_tokens=None):
    """Mean over completion tokens of KL(student || teacher): student_logits (B, T, V) from the
    prompt alone, teacher_logits (B, T, V) from the privileged one (never given gradient), mask
    (B, T) 1.0 on completion tokens; num_tokens: the whole step's count if this is a part."""
    real = mask > 0                                                    # (B, T) bool
    # sum_v p_v (ls_v - lt_v)   (B, T)
    per_token = kl(student_logits, teacher_logits.detach(), temperature)
    n_tokens = real.sum().clamp(min=1) if num_tokens is None else num_tokens
    return torch.where(real, per_token, 0.0).sum() / n_tokens          # 1/sum_i |o_i| sum_i sum_t


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=50,
                   help="steps (one batch of samples each)")
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
    g = add_run_flags(p, "self_distill", log_every=5, eval_every=10)
    g.add_argument("--init", default=HINT_SFT_PATH,
                   help="the policy: one that reads the privileged context (default: sft.py "
                        f"{' '.join(HINT_SFT_FLAGS)}, built if missing)")
    args = p.parse_args(argv)
    if args.task == "toolcalc" or args.tools:
        p.error("self_distill.py puts the verified answer ahead of a problem's text; not with "
                "--task toolcalc or --tools (episodes)")
    return args


class SelfDistillRun(Run):
    """plumbing.Run whose --init defaults to the hint-reading SFT policy, built if missing."""
    CHECKPOINT_FLAGS = {"init": (HINT_SFT_PATH, f"sft.py {' '.join(HINT_SFT_FLAGS)}")}


def load_policy(run, args):
    """Build the default start if missing (rank 0), then (policy, tokenizer); the held-out set's
    privileged prompts must fit beside the completion budget."""
    if run.is_main:                   # (a missing or unreadable non-default: refused by the Run)
        build_missing(args.init, default_path(HINT_SFT_PATH, args),
                      ["sft.py", *HINT_SFT_FLAGS, *task_flags(args)], args.device)
    run.barrier()
    policy, tok = run.load_policy(args.init)
    run.check_lengths(policy, tok, args.max_new_tokens)
    longest = task.max_privileged_tokens(tok) + (args.max_new_tokens or
                                                 task.default_max_new_tokens())
    if longest > policy.config.block_size:
        raise SystemExit(f"error: the teacher's prompts (the verified answer ahead of the problem) "
                         f"and completions take up to {longest} tokens; --init {args.init} holds "
                         f"{policy.config.block_size}: train one with a longer sft.py --block_size")
    return policy, tok


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = SelfDistillRun("self_distill", args, batch_flag="prompts_per_step")
    policy, tok = load_policy(run, args)
    train_policy = run.ddp(policy)  # DDP or --fsdp's shards under torchrun, else the policy
    optimizer = torch.optim.AdamW(trainable(train_policy), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    P, G, temp = args.prompts_per_step, args.group_size, args.temperature
    run.print(f"self-distillation: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, "
              f"{args.steps} steps of {P} prompts x {G} samples; the teacher: the same weights "
              f"with the verified answer in the prompt")
    if not args.resume:                             # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))

    while run.training():
        # 1. rollout: the policy samples G completions per prompt from the prompt alone (the
        #    verifier scores them for the log only)
        prompts = run.shard(task.sample_prompts(run.rng, P, args.precedence_share))
        with run.autocast:
            batch, sampler_logp, sampler_hidden = task.rollout(     # (B, Tn), (B, Tn, C) logged
                policy, tok, prompts, G, temp, args.max_new_tokens, 0.0, run.gen,
                return_logprobs=True, return_hidden=run.logging())
        # (B, Tp), (B, Tn), (B,); B = P*G
        prompt, prompt_mask, tokens, mask, truncated, rewards, _ = batch
        run.samples += P * G

        # 2. the teacher's prompts: the same problems with their verified answers ahead (B, Tp')
        hinted, hinted_mask = (x.repeat_interleave(G, 0) for x in tok.encode_batch(
            [task.privileged(p) for p in prompts], run.device))

        # 3. the teacher (no gradient) and the student score the same completion tokens; the loss
        #    over the --grad_accum micro-batches, normalised by the whole step's token count
        n_tokens = run.all_sum(mask.sum())                             # the step's, over every rank
        loss = kl_forward = ent = sampler_kl = 0.0
        sampler_diff = torch.zeros_like(mask)                          # (B, Tn)
        for rows in run.micro_batches(len(mask), train_policy):
            with torch.no_grad(), run.autocast:                        # (b, Tn, V) from c + x
                teacher_logits = completion_logits(policy, hinted[rows], hinted_mask[rows],
                                                   tokens[rows], mask[rows])
            with run.autocast:                                         # (b, Tn, V) from x alone
                logits = completion_logits(train_policy, prompt[rows], prompt_mask[rows],
                                           tokens[rows], mask[rows])
            part = self_distillation_loss(logits, teacher_logits, mask[rows], temp, n_tokens)
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss = loss + part.detach()
            with torch.no_grad():                    # for the log: the forward KL, the entropy
                real, s = mask[rows] > 0, logits.detach()
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

        # 4. log (the teacher's greedy answers, the hint in its prompts, beside the student's
        #    samples), evaluate, save
        if run.log_due():
            with run.autocast:                       # the hinted prompts, graded as the plain
                answers = task.complete(policy, tok, [task.privileged(p) for p in prompts],
                                        max_new_tokens=args.max_new_tokens)
            teacher_rewards = torch.tensor([task.reward(p, a) for p, a in zip(prompts, answers)])
            metrics = {"loss": run.all_sum(loss).item(),
                       "kl_forward": run.all_sum(kl_forward).item(),
                       "entropy": run.all_sum(ent).item(), "reward_mean": run.mean(rewards),
                       "teacher_reward": run.mean(teacher_rewards.to(run.device)),
                       "completion_len": run.mean(mask.sum(1)),
                       "truncated": run.mean(truncated.float()), "grad_norm": grad_norm.item(),
                       "sampler_logp_diff": run.max(torch.where(mask > 0, sampler_diff, 0.0)),
                       "sampler_kl": run.all_sum(sampler_kl).item()}
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            run.log(metrics, f"kl {metrics['loss']:.4f} | "
                             f"forward kl {metrics['kl_forward']:.4f} | "
                             f"reward {metrics['reward_mean']:.3f} "
                             f"(teacher {metrics['teacher_reward']:.3f}) | "
                             f"ent {metrics['entropy']:.3f} | "
                             f"len {metrics['completion_len']:.1f} | "
                             f"gnorm {metrics['grad_norm']:.3f}", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    run.finish(policy, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
