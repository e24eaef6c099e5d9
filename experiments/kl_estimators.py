"""
The KL estimators k1, k2 and k3 measured: how well each estimates KL(pi_theta || pi_ref) from tokens
sampled from pi_theta, and which gradient each gives when used as a loss, for policies at increasing
distance from the reference. grpo.py's docstring makes the claims; this measures them.

The estimators (Schulman 2020, "Approximating KL Divergence"; kernels.kl_penalty, the object under
test), per token y sampled from pi_theta, log r = log pi_ref(y) - log pi_theta(y):
    k1 = -log r,   k2 = (log r)^2 / 2,   k3 = (r - 1) - log r.

Policy pairs. pi_ref is the SFT policy; pi_theta is GRPO trained from it with no KL penalty and a
higher learning rate (`grpo.py --beta 0 --lr 1e-3`) so that it walks away from the reference:
checkpoints after --checkpoints steps, copies of out/kl_estimators/grpo.pt taken by running grpo.py
again with --resume and a larger --steps (one run, bit-exact, stopped and continued).

Values. For each pair: completions sampled from pi_theta at temperature 1 on held-out prompts, the
logits of both policies at every completion token, the exact per-token KL(pi_theta || pi_ref) over
the vocabulary at that position (kernels.kl) and the three estimators at the sampled token. Per
token the target is the exact KL at the token's position (given the prefix, E[k1] = E[k3] = that KL
and E[k2] is not); per completion, the sums over its tokens. For each: bias = mean(estimate -
exact), std = std(estimate - exact), relative RMSE = sqrt(mean (estimate - exact)^2) / mean(exact),
and the share of negative estimates (k1 only can be negative).

Gradients. Each estimator used as a loss term, as in grpo_loss: differentiated through log
pi_theta(y) of the sampled token, not through the sampling. At every position the completions visit,
--grad_samples tokens are drawn from pi_theta and the loss is the mean of k over them (the Monte
Carlo expected gradient); the exact expectation over the vocabulary (expected_estimator_loss) is
computed too, as a control. Each gradient, with respect to all the policy's parameters and summed
over the positions, is compared with the exact gradients of KL(pi_theta || pi_ref) and of KL(pi_ref
|| pi_theta) at the same positions (full-vocabulary sums: kernels.kl and a log-softmax): cosine
similarity and norm ratio |g_estimator| / |g_exact|. grpo.py says: E[grad k1] = 0 (k1 penalises only
through a reward), E[grad k2] = grad KL(pi_theta || pi_ref), E[grad k3] = grad KL(pi_ref ||
pi_theta).

Outputs: the table printed and written to results/kl_estimators.md, the numbers to
results/kl_estimators.json, the figure to results/kl_estimators.png.

Run:
    # about 3 minutes on 2 CPU cores (+ SFT if missing)
    python experiments/kl_estimators.py
    # redo the measurements on the checkpoints there, no training
    python experiments/kl_estimators.py --table_only
    # redraw the figure from results/kl_estimators.json alone
    python experiments/kl_estimators.py --figure_only
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import task                                                 # noqa: E402  (after the path is set)
from plumbing.flags import SFT_PATH  # noqa: E402
from kernels import kl_penalty                              # noqa: E402  the estimators under test
from kernels import kl                                      # noqa: E402  the exact per-position KL
from model import completion_logits  # noqa: E402
from plumbing.loading import load_model  # noqa: E402

ESTIMATORS = ("k1", "k2", "k3")


# -----------------------------------------------------------------------------
# Pure functions (tested in tests/test_experiments.py on enumerable categoricals)

def exact_kls(logits, ref_logits):
    """Per position, over the vocabulary: (KL(pi_theta || pi_ref), KL(pi_ref || pi_theta)), each
    (...), differentiable w.r.t. logits (pi_theta's); ref_logits is the frozen reference. The first
    is kernels.kl."""
    forward = kl(logits, ref_logits)                                       # sum_v p (log p - log q)
    log_p = torch.log_softmax(logits, dim=-1)
    log_q = torch.log_softmax(ref_logits, dim=-1)
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1)                      # sum_v q (log q - log p)
    return forward, reverse


def expected_estimator_loss(logits, ref_logits, estimator):
    """E_{y ~ pi_theta}[k(y)] per position (...), computed exactly over the vocabulary, whose
    gradient is the expected gradient of k used as a loss: sum_y sg(pi_theta(y)) grad k(y), the
    sampling distribution held fixed (sg: stop-gradient), as when k is computed on sampled
    tokens."""
    log_p = torch.log_softmax(logits, dim=-1)                          # (..., V) log pi_theta
    log_q = torch.log_softmax(ref_logits, dim=-1)                      # (..., V) log pi_ref
    k = kl_penalty(log_p, log_q, estimator)                            # (..., V) k at every token y
    return (log_p.detach().exp() * k).sum(-1)                          # sum_y sg(p(y)) k(y)


def sampled_estimator_loss(logits, ref_logits, estimator, num_samples, generator=None):
    """The mean of k over num_samples tokens drawn from pi_theta at each position (...): a Monte
    Carlo estimate of expected_estimator_loss, with its gradient through log pi_theta of the drawn
    tokens only."""
    log_p = torch.log_softmax(logits, dim=-1)                                  # (..., V)
    log_q = torch.log_softmax(ref_logits, dim=-1)
    V = log_p.size(-1)
    flat_p, flat_q = log_p.reshape(-1, V), log_q.reshape(-1, V)                # (N, V)
    # (N, M)
    y = torch.multinomial(flat_p.detach().exp(), num_samples, replacement=True, generator=generator)
    k = kl_penalty(flat_p.gather(1, y), flat_q.gather(1, y), estimator)        # (N, M)
    return k.mean(1).view(log_p.shape[:-1])                                    # (...)


def estimator_stats(estimate, exact):
    """How an estimate tracks the exact value, over paired samples (flat tensors of equal length):
    bias = mean(e - x), std = std(e - x) (population), rel_rmse = sqrt(mean (e - x)^2) / mean(x),
    negative = share of e < 0, mean_exact = mean(x). Computed in float64."""
    e, x = estimate.double().flatten(), exact.double().flatten()
    err = e - x
    return {"mean_exact": x.mean().item(), "bias": err.mean().item(),
            "std": err.std(unbiased=False).item(),
            "rel_rmse": (err.pow(2).mean().sqrt() / x.mean()).item(),
            "negative": (e < 0).double().mean().item()}


def grad_similarity(g, g_ref):
    """(cosine similarity, norm ratio |g| / |g_ref|) of two flat gradient vectors, in float64."""
    g, g_ref = g.double().flatten(), g_ref.double().flatten()
    cos = (g @ g_ref / (g.norm() * g_ref.norm())).item()
    return cos, (g.norm() / g_ref.norm()).item()


def per_completion(x, mask):
    """Sum over each completion's tokens: x, mask (B, T) -> (B,); padding never read."""
    return torch.where(mask > 0, x, 0.0).sum(1)


# -----------------------------------------------------------------------------
# The policy pairs

def train_checkpoints(args):
    """Run GRPO (beta 0) from the SFT policy, keeping a copy of its checkpoint after each of
    args.checkpoints steps."""
    out = os.path.join(ROOT, args.out)
    paths, last = {}, 0
    for step in args.checkpoints:
        path = os.path.join(out, f"step{step}.pt")
        paths[step] = path
        if os.path.exists(path):
            last = step
            continue
        cmd = [sys.executable, "grpo.py", "--beta", "0", "--lr", str(args.lr), "--steps", str(step),
               "--seed", str(args.seed), "--init", args.init, "--out", args.out,
               "--eval_every", str(max(args.checkpoints)), "--log_every", "1", "--eval_n", "32"] + (
                   ["--resume"] if last else [])
        print(" ".join(["python"] + cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        shutil.copyfile(os.path.join(out, "grpo.pt"), path)
        last = step
    return paths


# -----------------------------------------------------------------------------
# Measuring one pair

def measure(policy, ref, tok, prompts, args, gen):
    """Estimator statistics (per token, per completion) and gradient similarities for one
    (pi_theta, pi_ref) pair."""
    policy.eval()
    batch = task.rollout(policy, tok, prompts, args.samples_per_prompt, 1.0, generator=gen)
    prompt, prompt_mask, tokens, mask = batch[:4]          # (B, Tp), (B, Tn); B = prompts x samples
    real = mask > 0
    with torch.no_grad():
        ref_logits = completion_logits(ref, prompt, prompt_mask, tokens, mask)  # (B, Tn, V)
    logits = completion_logits(policy, prompt, prompt_mask, tokens, mask)    # (B, Tn, V), with grad
    # 1. values: the three estimators at the sampled tokens against the exact KL at their positions
    # (B, Tn)
    log_p = torch.log_softmax(logits.detach(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    log_q = torch.log_softmax(ref_logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    exact = kl(logits.detach(), ref_logits)                         # (B, Tn) KL(pi_theta || pi_ref)
    row = {"kl_token": exact[real].double().mean().item(),
           "kl_completion": per_completion(exact, mask).double().mean().item(),
           "tokens": int(mask.sum()), "completions": len(mask)}
    for est in ESTIMATORS:
        k = kl_penalty(log_p, log_q, est)                           # (B, Tn)
        row[f"{est}_token"] = estimator_stats(k[real], exact[real])
        row[f"{est}_completion"] = estimator_stats(per_completion(k, mask),
                                                   per_completion(exact, mask))
    # 2. gradients w.r.t. every parameter, each loss summed over the positions visited
    params = [p for p in policy.parameters() if p.requires_grad]
    total = lambda per_position: torch.where(real, per_position, 0.0).sum() / len(mask)
    forward, reverse = exact_kls(logits, ref_logits)
    losses = {"forward": total(forward), "reverse": total(reverse)}
    for est in ESTIMATORS:
        losses[f"{est}_mc"] = total(sampled_estimator_loss(logits, ref_logits, est,
                                                           args.grad_samples, gen))
        losses[f"{est}_expected"] = total(expected_estimator_loss(logits, ref_logits, est))
    grads = {}
    for name, loss in losses.items():
        grads[name] = torch.cat([g.flatten()
                                 for g in torch.autograd.grad(loss, params, retain_graph=True)])
    for name in losses:
        if name not in ("forward", "reverse"):
            row[f"{name}_vs_forward"] = grad_similarity(grads[name], grads["forward"])
            row[f"{name}_vs_reverse"] = grad_similarity(grads[name], grads["reverse"])
    row["forward_vs_reverse"] = grad_similarity(grads["reverse"], grads["forward"])
    return row


# -----------------------------------------------------------------------------
# Table and figure

def tables(rows, args):
    """Two markdown tables: the estimators' values, and their gradients."""
    f = lambda x: f"{x:+.4f}" if abs(x) < 10 else f"{x:+.1f}"
    v = ["| GRPO step | exact KL per token | per completion | estimator | bias / token | "
         "std / token | rel. RMSE / token | bias / completion | std / completion | "
         "rel. RMSE / completion | share < 0 (token) |",
         "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        for est in ESTIMATORS:
            t, c = r[f"{est}_token"], r[f"{est}_completion"]
            v.append(f"| {r['step']} | {r['kl_token']:.4f} | {r['kl_completion']:.3f} | {est} | "
                     f"{f(t['bias'])} | {t['std']:.4f} | {t['rel_rmse']:.2f} | {f(c['bias'])} | "
                     f"{c['std']:.4f} | {c['rel_rmse']:.2f} | {t['negative']:.3f} |")
    g = ["| GRPO step | exact KL per token | estimator as a loss "
         "| cos with grad KL(pi_theta \\|\\| pi_ref) | norm ratio "
         "| cos with grad KL(pi_ref \\|\\| pi_theta) | norm ratio "
         "| exact expectation: cos forward / reverse |",
         "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        for est in ESTIMATORS:
            cf, nf = r[f"{est}_mc_vs_forward"]
            cr, nr = r[f"{est}_mc_vs_reverse"]
            ef, er = r[f"{est}_expected_vs_forward"][0], r[f"{est}_expected_vs_reverse"][0]
            g.append(f"| {r['step']} | {r['kl_token']:.4f} | {est} | {cf:+.3f} | {nf:.3f} | "
                     f"{cr:+.3f} | {nr:.3f} | {ef:+.4f} / {er:+.4f} |")
        cos, ratio = r["forward_vs_reverse"]
        g.append(f"| {r['step']} | {r['kl_token']:.4f} | "
                 f"(exact reverse vs forward) | {cos:+.3f} | {ratio:.3f} | | | |")
    n = rows[0]
    head = (f"pi_ref: the SFT policy; pi_theta: `grpo.py --beta 0 --lr {args.lr}` after the "
            f"given steps. {n['completions']} completions sampled from pi_theta at T = 1 "
            f"on {args.prompts} held-out prompts per pair (about {n['tokens']} tokens); bias "
            f"and std of (estimate - exact KL at the token's position), relative RMSE = RMSE / "
            f"mean exact KL; per completion: the sums over its tokens.")
    ghead = (f"Gradients w.r.t. all the policy's parameters, each estimator as a loss "
             f"with {args.grad_samples} tokens drawn from pi_theta at every position visited "
             f"(Monte Carlo), against the exact gradient of each KL direction at the same "
             f"positions; last column: the expectation over the vocabulary computed exactly.")
    return f"{head}\n\n" + "\n".join(v) + f"\n\n{ghead}\n\n" + "\n".join(g) + "\n"


def figure(rows, path):
    import matplotlib
    matplotlib.use("Agg")                                                      # no display needed
    import matplotlib.pyplot as plt
    x = [r["kl_token"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for est, color in zip(ESTIMATORS, ("C0", "C1", "C2")):
        axes[0].plot(x, [r[f"{est}_token"]["rel_rmse"] for r in rows], "o-", color=color,
                     label=f"{est} per token")
        axes[0].plot(x, [r[f"{est}_completion"]["rel_rmse"] for r in rows], "s--", color=color,
                     label=f"{est} per completion")
        axes[1].plot(x, [r[f"{est}_token"]["bias"] / r["kl_token"] for r in rows], "o-",
                     color=color, label=est)
        axes[2].plot(x, [r[f"{est}_mc_vs_forward"][0] for r in rows], "o-", color=color,
                     label=f"{est}: vs KL(pi_theta||pi_ref)")
        axes[2].plot(x, [r[f"{est}_mc_vs_reverse"][0] for r in rows], "s--", color=color,
                     label=f"{est}: vs KL(pi_ref||pi_theta)")
    axes[0].set(title="relative RMSE of the estimate", ylabel="RMSE / mean exact KL", yscale="log")
    axes[1].set(title="relative bias per token", ylabel="bias / mean exact KL")
    axes[2].set(title="gradient as a loss: cosine with the exact gradient",
                ylabel="cosine similarity", ylim=(-0.2, 1.05))
    for ax in axes:                       # legends below the curves, never over them
        ax.set(xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.supxlabel("exact KL(pi_theta || pi_ref) per token (GRPO, beta 0, along training)",
                  fontsize=9)
    fig.suptitle("KL estimators k1, k2, k3 against the exact KL (python "
                 "experiments/kl_estimators.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="k1, k2, k3 against the exact KL: values "
                                                 "and gradients")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[1, 3, 10, 30, 60],
                        help="GRPO steps at which pi_theta is taken (increasing)")
    parser.add_argument("--lr", type=float, default=1e-3, help="grpo.py --lr (with --beta 0)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts per pair")
    parser.add_argument("--samples_per_prompt", type=int, default=4, help="completions per prompt")
    parser.add_argument("--grad_samples", type=int, default=64,
                        help="tokens drawn per position for the gradients")
    parser.add_argument("--init", default=SFT_PATH,
                        help="the SFT policy: pi_ref and GRPO's start (built if missing)")
    parser.add_argument("--out", default="out/kl_estimators",
                        help="folder for the GRPO run and its checkpoint copies")
    parser.add_argument("--results", default="results",
                        help="folder for the table, numbers and figure")
    parser.add_argument("--seed", type=int, default=0, help="grpo.py --seed, and the sampling here")
    parser.add_argument("--table_only", action="store_true",
                        help="measure the checkpoints already there, train nothing")
    parser.add_argument("--figure_only", action="store_true",
                        help="redraw the figure from the results folder's kl_estimators.json")
    args = parser.parse_args()
    if args.figure_only:
        with open(os.path.join(ROOT, args.results, "kl_estimators.json")) as f:
            figure(json.load(f)["rows"], os.path.join(ROOT, args.results, "kl_estimators.png"))
        return print(f"wrote {args.results}/kl_estimators.png")
    if (sorted(set(args.checkpoints)) != args.checkpoints or args.checkpoints[0] < 1 or args.lr <= 0
            or min(args.prompts, args.samples_per_prompt, args.grad_samples) < 1 or args.seed < 0):
        parser.error(f"--checkpoints {args.checkpoints} must increase from at least 1; "
                     f"--lr {args.lr} > 0; --prompts {args.prompts}, "
                     f"--samples_per_prompt {args.samples_per_prompt}, "
                     f"--grad_samples {args.grad_samples} at least 1; --seed {args.seed} >= 0")
    if args.prompts > len(task.eval_prompts()):
        parser.error(f"--prompts {args.prompts} exceeds the {len(task.eval_prompts())} "
                     f"held-out prompts")
    torch.manual_seed(args.seed)
    if args.table_only:
        paths = {s: os.path.join(ROOT, args.out, f"step{s}.pt") for s in args.checkpoints}
        if not all(os.path.exists(p) for p in paths.values()):
            raise SystemExit(f"error: checkpoints missing in {args.out}; run without "
                             f"--table_only first")
    else:
        if not os.path.exists(os.path.join(ROOT, args.init)) and args.init == SFT_PATH:
            print(f"{args.init} not found: grpo.py builds it first", flush=True)
        paths = train_checkpoints(args)
    ref, tok, _ = load_model(os.path.join(ROOT, args.init), "cpu")
    ref.requires_grad_(False)
    prompts = task.eval_prompts()[:args.prompts]
    rows = []
    for step, path in paths.items():
        policy, _, _ = load_model(path, "cpu")
        gen = torch.Generator().manual_seed(args.seed)
        rows.append({"step": step, **measure(policy, ref, tok, prompts, args, gen)})
        print(f"step {step}: exact KL {rows[-1]['kl_token']:.4f} per "
              f"token, {rows[-1]['kl_completion']:.3f} per completion", flush=True)
    text = tables(rows, args)
    out = os.path.join(ROOT, args.results)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kl_estimators.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "kl_estimators.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    figure(rows, os.path.join(out, "kl_estimators.png"))
    print("\n" + text)
    print(f"wrote {args.results}/kl_estimators.md, kl_estimators.json, kl_estimators.png")


if __name__ == "__main__":
    main()
