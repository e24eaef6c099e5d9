"""
On-policy distillation against GRPO, from the same small student: which estimator of the per-token
reverse KL learns most per completion sampled and per second, how far the student gets towards its
teacher, and what the exact KL over the vocabulary costs against the sampled estimators, here (V =
258) and at a real vocabulary (V = 151936, Qwen2's).

Runs distill.py with each --estimator (exact, k1, k3, topk) and grpo.py --init <the student> (its
defaults: the same small SFT policy, the verifier as the reward), each from the same seed, and reads
their metrics.jsonl: held-out greedy accuracy against completions sampled and against wall time
(evaluations excluded: training_seconds), the teacher's held-out accuracy as the ceiling. Then times
the loss alone, forward and backward, for each estimator on random logits at V = 258 and V = 151936.

Run:
    # seed 0, about 12 minutes on 2 CPU cores (+ prerequisites)
    python experiments/distill_compare.py
    # more seeds
    python experiments/distill_compare.py --seeds 0 1
    # re-print the tables from the runs already there
    python experiments/distill_compare.py --table_only
Outputs: results/distill/results.md (the tables), results.json, distill.png (the figure).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from distill import STUDENT_PATH, TEACHER_PATH, distillation_loss  # noqa: E402

# distill.py evaluates as often as grpo.py (same training: evaluation draws nothing)
EVERY = ["--eval_every", "10"]
RUNS = {  # name -> (script, flags beyond --seed, --out and the checkpoints)
    "distill exact": ("distill", ["--estimator", "exact", *EVERY]),
    "distill k1": ("distill", ["--estimator", "k1", *EVERY]),
    "distill k3": ("distill", ["--estimator", "k3", *EVERY]),
    "distill topk 8": ("distill", ["--estimator", "topk", "--topk", "8", *EVERY]),
    "GRPO": ("grpo", []),
}


def training_seconds(rows):
    """elapsed_s of each logged step less the evaluations so far: an evaluation's time is estimated
    as the median length of a log interval that holds one less the median of those that do not (all
    of log_every steps)."""
    steps = [r for r in rows if r["step"] > 0]
    gaps = [(b["elapsed_s"] - a.get("elapsed_s", 0.0), "eval_accuracy" in b)
            for a, b in zip([rows[0]] + steps, steps) if b["step"] - a["step"] == steps[0]["step"]]
    eval_s = max(0.0, statistics.median([g for g, e in gaps if e])
                 - statistics.median([g for g, e in gaps if not e]))
    n_evals = [sum("eval_accuracy" in s for s in steps[:i + 1]) for i in range(len(steps))]
    return {r["step"]: r["elapsed_s"] - n * eval_s for r, n in zip(steps, n_evals)} | {0: 0.0}


def read(out, script):
    rows = [json.loads(line) for line in open(os.path.join(out, script, "metrics.jsonl"))]
    seconds = training_seconds(rows)
    evals = [(r.get("samples", 0), seconds[r["step"]], r["eval_accuracy"])
             for r in rows if "eval_accuracy" in r]
    last = rows[-1]
    return {"evals": evals, "samples": last["samples"], "seconds": seconds[last["step"]],
            "s_per_step": seconds[last["step"]] / last["step"]}


def to_half_gap(evals, teacher):
    """Completions and seconds at the first evaluation that closes half the gap to the teacher, or
    None."""
    before = evals[0][2]
    hit = [(n, s) for n, s, acc in evals if acc >= before + (teacher - before) / 2]
    return hit[0] if hit else (None, None)


def bench_loss(V, N, repeats, device="cpu"):
    """Seconds for one forward and backward of distillation_loss per estimator, N positions,
    vocabulary V."""
    g = torch.Generator().manual_seed(0)
    S, T = torch.randn(1, N, V, generator=g), torch.randn(1, N, V, generator=g)
    tokens, mask = torch.randint(0, V, (1, N), generator=g), torch.ones(1, N)
    out = {}
    for name, k in (("exact", None), ("k1", None), ("k3", None), ("topk", 8)):
        times = []
        for _ in range(repeats + 1):                                    # the first is a warm-up
            s = S.clone().requires_grad_(True)
            t0 = time.perf_counter()
            distillation_loss(s, T, tokens, mask, name, k).backward()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
    return out


def fmt(values, f):
    values = [v for v in values if v is not None]
    if not values:
        return "not reached"
    if len(values) == 1:
        return format(values[0], f)
    return f"{format(statistics.mean(values), f)} +- {format(statistics.stdev(values), f)}"


def tables(results, teacher, seeds, loss_times):
    lines = [f"Seeds {seeds}; teacher (--teacher) held-out greedy accuracy {teacher:.3f}. "
             f"Seconds: wall time of training, evaluations excluded (training_seconds).", "",
             "| run | held-out greedy accuracy, before -> after | best | "
             "gap to the teacher closed | completions to close half the gap | "
             "seconds to close half the gap | completions sampled | seconds | s per step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, runs in results.items():
        col = lambda f, key: fmt([r[key] for r in runs], f)
        before, after = [r["evals"][0][2] for r in runs], [r["evals"][-1][2] for r in runs]
        closed = [(a - b) / (teacher - b) for a, b in zip(after, before)]
        half = [to_half_gap(r["evals"], teacher) for r in runs]
        lines.append(f"| {name} | {fmt(before, '.3f')} -> **{fmt(after, '.3f')}** | "
                     f"{fmt([max(e[2] for e in r['evals']) for r in runs], '.3f')} "
                     f"| {fmt(closed, '.0%')} | {fmt([h[0] for h in half], ',.0f')} | "
                     f"{fmt([h[1] for h in half], '.0f')} | {col(',.0f', 'samples')} | "
                     f"{col('.0f', 'seconds')} | {col('.2f', 's_per_step')} |")
    lines += ["", "The loss alone, one forward and backward on random logits (median, 1 torch "
                  "thread, CPU):", "", "| estimator | "
              + " | ".join(f"V = {V}, N = {N} positions, ms" for V, N in loss_times) + " |",
              "| --- | " + " | ".join("---:" for _ in loss_times) + " |"]
    for name in ("exact", "k1", "k3", "topk"):
        lines.append(f"| {name}{' 8' if name == 'topk' else ''} | "
                     + " | ".join(f"{1000 * t[name]:.1f}" for t in loss_times.values()) + " |")
    return "\n".join(lines) + "\n"


def figure(results, teacher, path):
    import matplotlib
    matplotlib.use("Agg")                                                      # no display needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for (name, runs), color in zip(results.items(), ("C0", "C1", "C2", "C3", "C4")):
        for i, r in enumerate(runs):
            n, s, acc = zip(*r["evals"])
            axes[0].plot(n, acc, "o-", color=color, label=name if i == 0 else None, alpha=0.8)
            axes[1].plot(s, acc, "o-", color=color, label=name if i == 0 else None, alpha=0.8)
    start = statistics.mean(r["evals"][0][2] for runs in results.values() for r in runs)
    for ax, xlabel in zip(axes, ("completions sampled",
                                 "wall time s of training (evaluations excluded)")):
        ax.axhline(teacher, color="k", ls="--", lw=1, label=f"teacher {teacher:.3f}")
        ax.axhline(start + (teacher - start) / 2, color="gray", ls=":", lw=1, label="half the gap")
        ax.set(xlabel=xlabel, ylabel="held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("On-policy distillation (4 estimators) and GRPO from the same small SFT student "
                 "(python experiments/distill_compare.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="distill.py's estimators against GRPO from the "
                                                 "same small student")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds to run (one run per method and seed)")
    parser.add_argument("--init", default=STUDENT_PATH,
                        help="the student (distill.py builds the default if missing)")
    parser.add_argument("--teacher", default=TEACHER_PATH,
                        help="the teacher (built if missing, as distill.py does)")
    parser.add_argument("--out", default="out/distill_compare", help="folder for the runs")
    parser.add_argument("--results", default="results/distill",
                        help="folder for the tables, numbers and figure")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the tables of the runs already there")
    args = parser.parse_args()
    if any(s < 0 for s in args.seeds):
        parser.error(f"--seeds {args.seeds}: seeds must be at least 0")
    results, teacher = {}, None
    for name, (script, flags) in RUNS.items():
        for seed in args.seeds:
            out = os.path.join(args.out, f"{name.replace(' ', '_')}-s{seed}")
            cmd = [sys.executable, f"{script}.py", *flags, "--seed", str(seed), "--init", args.init,
                   "--out", out]
            cmd += ["--teacher", args.teacher] if script == "distill" else []
            done = os.path.exists(os.path.join(ROOT, out, f"{script}.pt"))
            if not args.table_only and not done:
                print(" ".join(["python"] + cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            if os.path.exists(os.path.join(ROOT, out, f"{script}.pt")):
                results.setdefault(name, []).append(read(os.path.join(ROOT, out), script))
                if script == "distill":
                    ckpt = torch.load(os.path.join(ROOT, out, "distill.pt"), map_location="cpu",
                                      weights_only=True)
                    teacher = ckpt["teacher_eval"]["eval_accuracy"]
    if not results or teacher is None:
        raise SystemExit(f"error: no finished distill.py runs in {args.out}; run without "
                         f"--table_only first")
    torch.set_num_threads(1)
    loss_times = {(258, 1024): bench_loss(258, 1024, 5), (151936, 256): bench_loss(151936, 256, 2)}
    text = tables(results, teacher, args.seeds, loss_times)
    folder = os.path.join(ROOT, args.results)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"seeds": args.seeds, "teacher": teacher, "runs": results,
                   "loss_seconds": {f"V{V}_N{N}": t for (V, N), t in loss_times.items()}}, f,
                  indent=1)
    figure(results, teacher, os.path.join(folder, "distill.png"))
    print("\n" + text)
    print(f"wrote {args.results}/results.md, results.json, distill.png")


if __name__ == "__main__":
    main()
