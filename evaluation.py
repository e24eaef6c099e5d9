"""
Held-out evaluation as the field reports it; every eval row of metrics.jsonl carries its decoding
settings (eval_temperature, eval_top_p, eval_k). Greedy (the default): eval_accuracy is the mean
of one answer a problem at temperature 0. Sampled (--eval_temperature > 0): k samples a problem,
eval_accuracy avg@k, eval_pass_at_k the unbiased pass@k (Chen et al. 2021, arXiv 2107.03374).
With num_samples (a run's first and last evaluation, or --pass_at_1_every): eval_pass_at_1, that
many samples at temperature 1, 4x the greedy pass's rows. SimpleRL-Zoo and DeepSeek-R1 report
sampled numbers (top-p 0.95), most RL code greedy ones: they differ by points on the same weights.
"""
import math

import torch

import task


def pass_at_k(n, c, k):
    """pass@k from n samples, c right: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, eq. 1), as
    their stable product 1 - prod_{i = n - c + 1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}); allowed: 0 <= c <= n, 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def evaluate(model, tokenizer, prompts=None, temperature=0.0, top_p=1.0, k=1, seed=0,
             max_new_tokens=None, num_samples=4, progress=None):
    """eval_* metrics on the held-out set (or `prompts`), within the run's max_new_tokens;
    num_samples 0: no sampled pass@1. progress(done, total): the prompts done of the passes, after
    each batch."""
    prompts = task.eval_prompts() if prompts is None else prompts
    P, passes = len(prompts), 2 if num_samples else 1
    first, second = ((lambda n: progress(n, passes * P)), (lambda n: progress(P + n, 2 * P))) \
        if progress else (None, None)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    if temperature == 0:
        answers = task.complete(model, tokenizer, prompts, temperature=0.0,
                                max_new_tokens=max_new_tokens, done=first)
    else:
        answers = task.complete(model, tokenizer, prompts, k, temperature, max_new_tokens,
                                generator=g, top_p=top_p, done=first)
    sampled = task.complete(model, tokenizer, prompts, num_samples, 1.0, max_new_tokens,
                            generator=g, done=second) if num_samples else None
    model.train(was_training)
    n = 1 if temperature == 0 else k
    right = [sum(task.reward(p, c) == 1.0 for c in answers[i * n:(i + 1) * n])      # (P,)
             for i, p in enumerate(prompts)]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    of = lambda keep: mean([r / n for p, r in zip(prompts, right) if keep(p)])
    out = {"eval_accuracy": of(lambda p: True),                         # greedy, or avg@k
           "eval_accuracy_precedence": of(task.is_precedence),
           "eval_accuracy_other": of(lambda p: not task.is_precedence(p))}
    if sampled is not None:
        out["eval_pass_at_1"] = mean([task.reward(prompts[i // num_samples], c)
                                      for i, c in enumerate(sampled)])
    if temperature > 0:
        out["eval_pass_at_k"] = mean([pass_at_k(n, r, k) for r in right])
    return {**out, "eval_temperature": temperature, "eval_top_p": top_p, "eval_k": k}


def name(metrics):
    """eval_accuracy in words: "greedy accuracy", or "avg@4 (T 1, top-p 0.95)"."""
    if not metrics.get("eval_temperature"):
        return "greedy accuracy"
    return (f"avg@{metrics['eval_k']} (T {metrics['eval_temperature']:g}, top-p "
            f"{metrics['eval_top_p']:g})")


def line(metrics):
    """The held-out part of a step's printed line."""
    if not metrics.get("eval_temperature"):
        text = f"greedy {metrics['eval_accuracy']:.3f}"
    else:
        text = (f"{name(metrics)} {metrics['eval_accuracy']:.3f} pass@{metrics['eval_k']} "
                f"{metrics['eval_pass_at_k']:.3f}")
    if "eval_pass_at_1" in metrics:
        text += f" pass@1 {metrics['eval_pass_at_1']:.3f}"
    return text
