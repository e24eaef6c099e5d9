"""
Outcome and process reward models (ORM, PRM): verifiers that learn to judge the SFT policy's
completions, whole (ORM) or step by step (PRM), for test-time search (search.py: best-of-N and
PRM-guided beam search).

Sample completions from the SFT policy on training prompts; label each completion with the task's
verifier (ORM), or each of its steps (PRM); train a copy of the SFT policy with a scalar head
(model.ScalarGPT, head at 0) to predict the labels with binary cross-entropy. The ORM reads one
score per completion, at its EOS; the PRM one per step, at the step's last token: the ',' that ends
it, and the EOS for the final step, the one with the answer. The ORM is the PRM with a single step.

ORM: Cobbe et al. 2021, arXiv 2110.14168. PRM: Lightman et al. 2023, "Let's Verify Step by Step",
arXiv 2305.20050; automatic step labels: Math-Shepherd, Wang et al. 2023, arXiv 2312.08935. For a
completion with steps 1..K:
    ORM    p(y correct) = sigmoid(r at y's EOS)
    PRM    p_k = sigmoid(r_k), r_k at the last token of step k (causal: it sees steps 1..k only)
    L = -1/#steps sum_(y, k) [ l_k log p_k + (1 - l_k) log(1 - p_k) ]        (labels l_k in [0, 1])
    a completion's PRM score (aggregate_steps): min_k p_k | prod_k p_k | p_K (last) | mean_k p_k
Step labels (--labels): rule, exact (arithmetic.step_labels: the steps up to k start the correct
derivation), the counterpart of Lightman et al.'s human labels; mc, Math-Shepherd's: from the
prefix through step k, --mc_k continuations of the SFT policy, hard label 1 if any reaches the
right answer, soft label the share that does.

Deviations and choices the papers leave open (experiments/README.md has the longer account):
- The ORM is read at the EOS only and trained without a language-modelling loss (Cobbe et al. read
  every token).
- Labels are 0/1 on every step, a step after a wrong one 0 (Lightman et al.: up to the first wrong).
- Aggregation: the product (Lightman et al.) or the minimum (Math-Shepherd); search.py has both.
- The step boundary is the ',' token (a token containing ',' for BPE); the answer follows '#'.

Shapes: B completions, T tokens, S steps (read positions) per completion.
Run (from out/sft.pt, built first if missing):
    python prm.py                        # out/orm.pt, then out/prm.pt
    python prm.py --labels mc            # the PRM on Math-Shepherd labels, agreement with rule's
    python prm.py --train prm --resume   # continue the PRM run from out/prm.pt up to --epochs
Metrics: out/orm/metrics.jsonl and out/prm/metrics.jsonl (docs/metrics.md says what each means).
"""
import argparse
import json
import os
import random

import torch
import torch.nn.functional as F

import sampler
import task
from model import ScalarGPT, scores_at
from plumbing import Run, lr_schedule
from plumbing.flags import (SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser,
                            require_arithmetic)
from plumbing.loading import load_model
from task import left_pad, pad_steps
from tasks import arithmetic

KINDS = ("orm", "prm")


# -----------------------------------------------------------------------------
# The algorithm: the step loss, the aggregation of step scores, and where the scores are read

def prm_loss(step_logits, step_labels, step_mask, count=None):
    """Mean binary cross-entropy over the real steps -> scalar. step_logits (B, S) the head's r_k;
    step_labels (B, S) in [0, 1] (hard or soft); step_mask (B, S) 1.0 on real steps. Values at
    masked steps are never read. count: the number of real steps of the whole batch when this is a
    part of it (a micro-batch, one rank's share): the result is then this part's share of the
    batch's mean. With no real step: 0."""
    real = step_mask > 0
    logits, labels = torch.where(real, step_logits, 0.0), torch.where(real, step_labels, 0.0)
    # -(l log sigmoid(r) + (1-l) log(1-sigmoid(r)))
    bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    return torch.where(real, bce, 0.0).sum() / (real.sum().clamp(min=1) if count is None else count)


def aggregate_steps(step_scores, step_mask, how):
    """One score per completion from its step probabilities: step_scores (B, S) in [0, 1], step_mask
    (B, S) 1.0 on real steps -> (B,). how: 'min' (the weakest step; Math-Shepherd), 'prod' (every
    step right; Lightman et al.), 'last' (the last real step), 'mean'. A row with no real step gives
    0."""
    if how not in ("min", "prod", "last", "mean"):
        raise ValueError(f"how {how!r} is unknown; allowed: 'min', 'prod', 'last', 'mean'")
    if step_scores.size(1) == 0:                                                   # no steps at all
        return torch.zeros(step_scores.size(0), dtype=step_scores.dtype, device=step_scores.device)
    real = step_mask > 0
    has_step = real.any(1)
    if how == "min":
        agg = torch.where(real, step_scores, float("inf")).min(1).values                 # min_k p_k
    elif how == "prod":
        agg = torch.where(real, step_scores, 1.0).prod(1)                     # prod_k p_k
    elif how == "last":
        S = step_scores.size(1)
        last = S - 1 - real.flip(1).float().argmax(1)                         # (B,) last real index
        agg = step_scores.gather(1, last[:, None]).squeeze(1)                 # p_K
    else:
        agg = torch.where(real, step_scores, 0.0).sum(1) / real.sum(1).clamp(min=1)  # 1/K sum_k p_k
    return torch.where(has_step, agg, 0.0)


def verifier_batch(records, labels, tok, kind, device):
    """task.completion_batch of the records (prompt + completion ids, as sampled) and, per row, the
    read positions, the labels (one list per record, one label per read position) and the step mask:
    tokens, attn (B, T); positions, labels, step_mask (B, S)."""
    tokens, attn, _ = task.completion_batch([r["prompt"] for r in records],
                                            [r["ids"] for r in records], tok, device)
    reads = [task.read_positions(tok.encode_prompt(r["prompt"]), r["ids"], tok, kind)
             for r in records]
    positions, step_mask = pad_steps(reads, 0, torch.long, device)
    labels, _ = pad_steps(labels, device=device)
    if labels.shape != positions.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match the read "
                         f"positions {tuple(positions.shape)}")
    return tokens, attn, positions, labels, step_mask


# -----------------------------------------------------------------------------
# The data: completions of the SFT policy and their labels


@torch.no_grad()
def sample_completions(policy, tok, prompts, n, temperature, generator):
    """n completions of each prompt: records {prompt, ids (as sampled, the stop token last), text,
    outcome (0/1, the verifier), rule (arithmetic.step_labels)}."""
    texts, ids = task.complete(policy, tok, prompts, n, temperature, generator=generator,
                               return_ids=True)
    out = []
    for i, (text, c) in enumerate(zip(texts, ids)):
        p = prompts[i // n]
        out.append({"prompt": p, "ids": c, "text": text, "outcome": task.reward(p, text),
                    "rule": arithmetic.step_labels(p, text)})
    return out


@torch.no_grad()
def mc_labels(policy, tok, records, k, temperature, generator,
              max_new_tokens=arithmetic.MAX_NEW_TOKENS, batch_size=256):
    """Math-Shepherd's labels: for each step that ends with a ',', the share of k continuations of
    the policy from the prefix through that ',' that reach the correct answer (the soft label; hard
    = share > 0); the final step's label is the completion's own outcome. Returns one list of soft
    labels per record."""
    device = next(policy.parameters()).device
    jobs = [(i, j) for i, r in enumerate(records)
            for j, t in enumerate(r["ids"]) if "," in tok.decode([t])]
    share = {}
    for b in range(0, len(jobs), batch_size):
        chunk = jobs[b:b + batch_size]
        prefixes = [tok.encode_prompt(records[i]["prompt"]) + records[i]["ids"][:j + 1]
                    for i, j in chunk]
        # what remains of each completion's budget
        left = [max_new_tokens - (j + 1) for _, j in chunk]
        max_new = max(1, min(max(left), policy.config.block_size - max(len(s) for s in prefixes)))
        idx, mask = left_pad(prefixes, tok.pad_id, device)
        tokens, cmask, _ = sampler.generate(policy, idx, mask, max_new, tok.stop_ids, tok.pad_id,
                                            num_samples=k, temperature=temperature,
                                            generator=generator)              # (len(chunk) * k, Tn)
        rows, keep = tokens.tolist(), cmask.tolist()
        for n, (i, j) in enumerate(chunk):
            r = records[i]
            # a continuation cut at its own budget is distributed as one sampled with that budget
            ends = [r["ids"][:j + 1] + [t for t, m in zip(rows[row][:left[n]], keep[row][:left[n]])
                                        if m and t not in tok.stop_ids]
                    for row in range(n * k, (n + 1) * k)]          # the k completions, as token ids
            share[i, j] = sum(task.reward(r["prompt"], tok.decode(e)) for e in ends) / k
    return [[share[i, j] for j, t in enumerate(r["ids"]) for _ in range(tok.decode([t]).count(","))]
            + [r["outcome"]] for i, r in enumerate(records)]


def label_agreement(records, mc, max_examples=12):
    """How often the hard MC labels (share > 0) equal the rule labels, over all steps; the confusion
    counts; and examples of disagreement, the a+b*1 / a-b*1 left-to-right derivation (right answer,
    wrong order) counted apart."""
    steps = agree = lucky = 0
    confusion = {"rule1_mc1": 0, "rule1_mc0": 0, "rule0_mc1": 0, "rule0_mc0": 0}
    examples = []
    for r, soft in zip(records, mc):
        for k, (rule, s) in enumerate(zip(r["rule"], soft)):
            hard = int(s > 0)
            steps, agree = steps + 1, agree + (rule == hard)
            confusion[f"rule{rule}_mc{hard}"] += 1
            if rule != hard:
                ltr = (arithmetic.demonstration(r["prompt"], True)
                       if arithmetic.is_precedence(r["prompt"]) else None)
                precedence_luck = r["text"] == ltr
                lucky += precedence_luck
                why = ("left to right, right answer (c = 1)" if precedence_luck else
                       "right step, every continuation slipped" if rule else
                       "wrong step, right answer")
                if len(examples) < max_examples:
                    examples.append({"prompt": r["prompt"], "completion": r["text"], "step": k + 1,
                                     "rule": rule,
                                     "mc_soft": s, "why": why})
    return {"steps": steps, "agreement": agree / max(steps, 1),
            "disagree_left_to_right_lucky": lucky,
            **confusion, "examples": examples}


# -----------------------------------------------------------------------------
# Held-out evaluation

@torch.no_grad()
def evaluate_verifier(model, tok, records, kind, device, autocast, batch_size=256):
    """Held-out metrics of a verifier on completions it never trained on. ORM and PRM:
    eval_outcome_accuracy, the share whose predicted correctness (p > 0.5; for the PRM, min_k p_k >
    0.5) is the verifier's, also on the correct and on the wrong ones. PRM: eval_step_accuracy, the
    share of steps with (p_k > 0.5) = rule label, also on the good and on the bad steps."""
    model.eval()
    pred, truth, pred_step, rule = [], [], [], []
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        labels = [r["rule"] for r in chunk] if kind == "prm" else [[r["outcome"]] for r in chunk]
        tokens, attn, positions, labels, step_mask = verifier_batch(chunk, labels, tok, kind,
                                                                    device)
        with autocast:
            # (b, S)
            p = torch.sigmoid(scores_at(model, tokens, attn, positions, step_mask)).float().cpu()
        real = step_mask.cpu() > 0
        pred.append(aggregate_steps(p, step_mask.cpu(), "min") > 0.5)
        truth.append(torch.tensor([r["outcome"] for r in chunk]) > 0.5)
        pred_step.append((p > 0.5)[real])
        rule.append((labels.cpu() > 0.5)[real])
    model.train()

    def accuracy(name, guess, true):
        return {name: (guess == true).float().mean().item(),
                f"{name}_{'good' if 'step' in name else 'correct'}":
                    (guess[true] == true[true]).float().mean().item(),
                f"{name}_{'bad' if 'step' in name else 'wrong'}":
                    (guess[~true] == true[~true]).float().mean().item()}
    # an empty class gives nan
    out = accuracy("eval_outcome_accuracy", torch.cat(pred), torch.cat(truth))
    if kind == "prm":
        out.update(accuracy("eval_step_accuracy", torch.cat(pred_step), torch.cat(rule)))
    return out


def describe(metrics):
    """The headline held-out numbers as text, for the printed line."""
    names = {"eval_step_accuracy": "step acc", "eval_outcome_accuracy": "outcome acc"}
    return " | ".join(f"held-out {short} {metrics[k]:.3f}"
                      for k, short in names.items() if k in metrics)


def load_verifier(path, device, kind):
    """An ORM or PRM written by this script, in eval mode; a checkpoint of another kind is one error
    line."""
    model, tok, ckpt = load_model(path, device, "scalar",
                                  expect={"script": "prm", "reward_type": kind})
    return model, tok, ckpt


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--train", default="both", choices=["both", *KINDS],
                   help="which verifier(s) to train: both is the ORM, then the PRM")
    g.add_argument("--labels", default="rule", choices=["rule", "mc"],
                   help="PRM step labels: exact (arithmetic.step_labels) or Math-Shepherd's "
                        "Monte Carlo")
    g.add_argument("--mc_k", type=Int(ge=1), default=4,
                   help="--labels mc: continuations sampled from each step's prefix")
    g.add_argument("--mc_label", default="hard", choices=["hard", "soft"],
                   help="--labels mc: 1 if any continuation is right, or the share that is")
    g = p.add_argument_group("sampling")
    g.add_argument("--n_prompts", type=Int(ge=1), default=512,
                   help="training prompts (never held-out ones)")
    g.add_argument("--samples_per_prompt", type=Int(ge=1), default=4,
                   help="completions of the SFT policy per training prompt")
    g.add_argument("--eval_samples", type=Int(ge=1), default=2,
                   help="completions per held-out prompt for the held-out metrics")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature of the completions and the MC continuations")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=Int(ge=1), default=2,
                   help="passes over the training completions")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="completions per step")
    g.add_argument("--lr", type=Float(gt=0), default=5e-4, help="peak AdamW learning rate")
    g.add_argument("--warmup", type=Int(ge=0), default=10,
                   help="linear warm-up steps, then cosine decay to lr/10")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "{orm,prm}", log_every=8, eval_every=32)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT policy: the backbone to start from and the sampler of the data")
    args = p.parse_args(argv)
    require_arithmetic(p, args, "process labels (arithmetic.step_labels)")
    n = args.n_prompts * args.samples_per_prompt
    if args.batch_size > n:
        p.error(f"--batch_size {args.batch_size} exceeds the {n} training completions "
                f"(--n_prompts {args.n_prompts} x "
                f"--samples_per_prompt {args.samples_per_prompt}); it must be at most that")
    # derived: total steps (a last partial batch is dropped)
    args.steps = args.epochs * (n // args.batch_size)
    return args


def main(args):
    """Train the ORM, then the PRM (or the one --train names), each its own run: checkpoint, log,
    lock, resume."""
    kinds = KINDS if args.train == "both" else (args.train,)
    # with --resume, a verifier the interrupted run had not started yet starts afresh
    for kind in kinds:
        started = os.path.exists(os.path.join(args.out, f"{kind}.pt")) or kind == kinds[0]
        train(argparse.Namespace(**{**vars(args), "resume": args.resume and started}), kind)


def train(args, kind):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("prm", args, name=kind, batch_flag="batch_size")
    sft, tok = run.load_policy(args.init)
    model = ScalarGPT.from_policy(sft)  # backbone = the SFT policy, head = 0: every p starts at 1/2
    train_model = run.ddp(model)  # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(train_model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    # the data, the same in every run with this seed (its own generator: a resumed run draws it
    # again identically)
    gen = torch.Generator(device=run.device).manual_seed(args.seed)
    with run.autocast:
        train_set = sample_completions(
            sft, tok, task.sample_prompts(random.Random(args.seed), args.n_prompts),
            args.samples_per_prompt, args.temperature, gen)
        eval_set = sample_completions(sft, tok, task.eval_prompts()[:args.eval_n],
                                      args.eval_samples, args.temperature, gen)
        mc = None
        if kind == "prm" and args.labels == "mc":
            mc = mc_labels(sft, tok, train_set, args.mc_k, args.temperature, gen,
                           arithmetic.MAX_NEW_TOKENS)
    run.samples = (len(train_set) + len(eval_set)
                   + (args.mc_k * sum(len(m) - 1 for m in mc) if mc else 0))
    # what the verifier learns to predict, one label per read position
    for i, r in enumerate(train_set):
        r["target"] = ([r["outcome"]] if kind == "orm" else r["rule"] if mc is None else
                       [float(s > 0) if args.mc_label == "hard" else s for s in mc[i]])
    del sft
    steps_per_epoch = args.steps // args.epochs
    n_correct = sum(r["outcome"] for r in train_set)
    run.print(f"{kind.upper()}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
              f"parameters on {run.device}, {len(train_set)} training completions "
              f"({n_correct / len(train_set):.1%} correct) and {len(eval_set)} "
              f"held-out, {'outcome' if kind == 'orm' else args.labels} labels, {args.epochs} "
              f"epochs x {steps_per_epoch} steps of {args.batch_size}")
    final, final_step = {}, -1                      # the latest held-out evaluation, and its step
    if not args.resume:                             # a fresh run: the starting policy is step 0
        start = (evaluate_verifier(model, tok, eval_set, kind, run.device, run.autocast)
                 if run.is_main else {})
        if mc is not None:
            agreement = label_agreement(train_set, mc)
            start["labels_agree"] = agreement["agreement"]
            examples = ", ".join(f"{e['prompt']}{e['completion']} step {e['step']}"
                                 for e in agreement["examples"][:4])
            run.print(f"labels: mc (hard) and rule agree on {agreement['agreement']:.1%} "
                      f"of {agreement['steps']} training "
                      f"steps; {agreement['disagree_left_to_right_lucky']} of the disagreements "
                      f"are a+b*1 or a-b*1 left to right; e.g. {examples}")
            if run.is_main:
                with open(os.path.join(args.out, kind, "label_agreement.json"), "w") as f:
                    json.dump(agreement, f, indent=1)
        run.log_start(start, describe(start) + " (the head starts at zero: every p is 1/2)")

    model.train()
    while run.training():
        # 1. the step's completions: shuffled epochs, each order seeded by (seed, epoch) so a
        #    resumed run sees the same
        epoch, i = divmod(run.step, steps_per_epoch)
        order = list(range(len(train_set)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        batch = run.shard([train_set[j] for j in
                           order[i * args.batch_size:(i + 1) * args.batch_size]])   # this rank's
        for group in optimizer.param_groups:
            group["lr"] = lr_schedule(run.step, args.lr, args.warmup, args.steps)

        # 2. binary cross-entropy of the scores read at each step's end (the ORM: one step, at the
        #    EOS) against the labels, the mean over every rank's steps, over the
        #    --grad_accum micro-batches
        tokens, attn, positions, labels, step_mask = verifier_batch(
            batch, [r["target"] for r in batch], tok, kind, run.device)
        n_steps = run.all_sum(step_mask.sum())
        optimizer.zero_grad(set_to_none=True)
        loss, right = 0.0, 0.0
        for rows in run.micro_batches(len(batch), train_model):
            with run.autocast:
                logits = scores_at(train_model, tokens[rows], attn[rows], positions[rows],
                                   step_mask[rows])                                         # (b, S)
            part = prm_loss(logits.float(), labels[rows], step_mask[rows], n_steps)
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            hit = (logits.detach() > 0) == (labels[rows] > 0.5)         # p > 1/2 where the label is
            loss, right = (loss + part.item(),
                           right + torch.where(step_mask[rows] > 0, hit.float(), 0.0).sum())
        grad_norm = run.clip_grad_norm(train_model, args.grad_clip)
        optimizer.step()
        run.step += 1

        # 3. log, evaluate, checkpoint
        if run.log_due():
            metrics = {"epoch": run.step / steps_per_epoch, "loss": run.all_sum(loss).item(),
                       "train_accuracy": (run.all_sum(right) / n_steps).item(),
                       "lr": lr_schedule(run.step - 1, args.lr, args.warmup, args.steps),
                       "grad_norm": grad_norm.item()}
            line = (f"epoch {metrics['epoch']:.2f} | loss {metrics['loss']:.4f} | train acc "
                    f"{metrics['train_accuracy']:.3f}")
            if run.eval_due() and run.is_main:
                final, final_step = evaluate_verifier(model, tok, eval_set, kind, run.device,
                                                      run.autocast), run.step
                metrics.update(final)
                line += " | " + describe(metrics)
            run.log(metrics, line)
        if run.eval_due():
            run.save(model, optimizer, reward_type=kind,
                     labels="outcome" if kind == "orm" else (
                         args.labels
                         + (f" ({args.mc_label}, k={args.mc_k})" if args.labels == "mc" else "")),
                     read_at="EOS" if kind == "orm" else "each step's ',' and the final EOS")
    if final_step != run.step and run.is_main:     # e.g. resumed at the step limit
        final = evaluate_verifier(model, tok, eval_set, kind, run.device, run.autocast)
    get = lambda key: final.get(key, 0)
    summary = (f"held-out outcome accuracy {get('eval_outcome_accuracy'):.3f} "
               f"(correct {get('eval_outcome_accuracy_correct'):.3f}, "
               f"wrong {get('eval_outcome_accuracy_wrong'):.3f})")
    if kind == "prm":
        summary = (f"held-out step accuracy vs rule labels {get('eval_step_accuracy'):.3f} "
                   f"(good {get('eval_step_accuracy_good'):.3f}, "
                   f"bad {get('eval_step_accuracy_bad'):.3f}) | " + summary)
    run.finish(model, tok, optimizer, summary=summary)


if __name__ == "__main__":
    main(parse_args())
