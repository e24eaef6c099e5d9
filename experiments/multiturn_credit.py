"""
Turn-level credit on the guessing game: multiturn.py --credit outcome, mt_grpo, returns and gigpo,
from the same SFT policy (sft.py --task guess, built if missing), each seed's runs at the script's
defaults: the same steps, games and episodes a step.

Prints a markdown table over the seeds (held-out greedy: found before -> after, and at the
smallest run's number of turns sampled; the turns used before -> after; the turns sampled in
training) and writes results/multiturn/credit.json and results/multiturn/found.png (held-out found
against the turns sampled, the mean over seeds). experiments/multiturn_history.py shares the loop.

Run:
    # seeds 0-2, two runs at a time: about 10 minutes on 2 CPU cores (+ the SFT policy)
    python experiments/multiturn_credit.py --seeds 0 1 2 --jobs 2
    python experiments/multiturn_credit.py --seeds 0 1 2 --table_only    # from the runs there
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from grpo_family import ROOT, fmt, run_jobs

INIT = os.path.join("out", "guess", "sft.pt")
CREDITS = {c: ["--credit", c] for c in ("outcome", "mt_grpo", "returns", "gigpo")}
RESULTS = os.path.join(ROOT, "results", "multiturn")


def read(path):
    rows = [json.loads(line) for line in open(path)]
    evals = [r for r in rows if "eval_found" in r]
    logged = [r for r in rows if "turns" in r]         # every step logged: the turns it sampled
    games = rows[-1]["samples"] // max(len(logged), 1)
    return {"before": evals[0]["eval_found"], "after": evals[-1]["eval_found"],
            "turns_before": evals[0]["eval_turns"], "turns_after": evals[-1]["eval_turns"],
            "sampled": sum(r["turns"] * games for r in logged),
            "curve": [(sum(r["turns"] * games for r in logged if r["step"] <= e["step"]),
                       e["eval_found"]) for e in evals]}


def found_at(curve, turns):
    """Held-out found at `turns` sampled: the curve's points (turns, found) interpolated."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= turns <= x1:
            return y0 + (y1 - y0) * (turns - x0) / max(x1 - x0, 1)
    return curve[-1][1]


def sweep(variants, flag, name, description):
    """Run multiturn.py with each variant's flags on each seed (the ones not there yet), print
    the table, write results/multiturn/<name>.json and the figure; `flag` heads the table."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run each")
    parser.add_argument("--out", default=f"out/multiturn_{name}", help="folder for the runs")
    parser.add_argument("--at", type=float, default=None,
                        help="turns sampled for the middle column (default: the smallest run's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (1 torch thread each)")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the table of the runs already there")
    args = parser.parse_args()
    if args.jobs < 1 or any(s < 0 for s in args.seeds) or (args.at or 1) <= 0:
        parser.error(f"--jobs {args.jobs}, --seeds {args.seeds}, --at {args.at}: jobs at least "
                     "1, seeds at least 0, at above 0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.table_only and not os.path.exists(os.path.join(ROOT, INIT)):
        subprocess.run([sys.executable, "sft.py", "--task", "guess"], check=True, cwd=ROOT,
                       env=env)
    runs, todo = [], []
    for variant, flags in variants.items():
        for seed in args.seeds:
            out = os.path.join(args.out, f"{variant}-s{seed}")
            runs.append((variant, os.path.join(ROOT, out, "multiturn", "metrics.jsonl")))
            if not os.path.exists(os.path.join(ROOT, out, "multiturn.pt")):
                # every step logged (the turns sampled), evaluated every 5 on 512 games
                todo.append([sys.executable, "multiturn.py", *flags, "--seed", str(seed),
                             "--init", INIT, "--out", out, "--log_every", "1",
                             "--eval_every", "5", "--eval_n", "512"])
    run_jobs([] if args.table_only else todo, args.jobs)
    results = {}
    for variant, path in runs:
        if os.path.exists(path):
            results.setdefault(variant, []).append(read(path))
    at = args.at or min(r["sampled"] for got in results.values() for r in got)
    print(f"\nseeds {args.seeds}, from {INIT}\n")
    print(f"| {flag} | held-out found, before -> after | at {at:,.0f} turns | turns used, "
          "before -> after | turns sampled |")
    print("| --- | --- | --- | --- | ---: |")
    for variant, got in results.items():
        col = lambda key, f: fmt([r[key] for r in got], f)
        print(f"| {variant} | {col('before', '.3f')} -> **{col('after', '.3f')}** | "
              f"{fmt([found_at(r['curve'], at) for r in got], '.3f')} | "
              f"{col('turns_before', '.2f')} -> {col('turns_after', '.2f')} | "
              f"{col('sampled', ',.0f')} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"seeds": args.seeds, "at": at, "runs": results}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, got in results.items():
        points = list(zip(*[r["curve"] for r in got]))          # each eval: one point per seed
        ax.plot([statistics.mean(x for x, _ in p) for p in points],
                [statistics.mean(y for _, y in p) for p in points], marker="o",
                label=f"{flag} {variant}")
    ax.set_xlabel("turns sampled in training")
    ax.set_ylabel("held-out games found (greedy)")
    ax.set_title(f"multiturn.py {flag}, mean of seeds {', '.join(map(str, args.seeds))}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "found.png" if name == "credit" else f"{name}.png"),
                dpi=120)


if __name__ == "__main__":
    sweep(CREDITS, "--credit", "credit", "multiturn.py's estimators, same start")
